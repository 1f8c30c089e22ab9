"""A Hugging Face checkpoint folder's weights -> this project's parameter layout.

A folder holds `config.json` (models.hf_config reads it) and `model.safetensors`, or shards
listed by `model.safetensors.index.json`. Each table entry of models.weights names its tensor
(`Weight.hf_name`); HF's [out, in] matrices are the table's matrices reshaped (no permutation:
transformers' rotary is rotate-half, as ours). Gemma's norm scales are stored as scale - 1.

stream_params reads a block of rows of one tensor at a time (safetensors' slices, the file
opened per tensor), in the same (keys, shape, blocks) stream as
models.gguf_loader.stream_params, so the conversion (models.convert) holds one block whatever
the model's size.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from collections.abc import Iterator

import numpy as np
from safetensors import safe_open
from tqdm.auto import tqdm

from models import weights
from models.config import ModelConfig
from models.families import FAMILIES
from models.gguf_loader import BLOCK_BYTES  # float32 bytes of one tensor's rows read at once

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def read_config_json(folder: str | os.PathLike) -> dict:
    """The folder's config.json as a dict; ValueError naming the folder when it has none."""
    path = pathlib.Path(folder) / "config.json"
    if not path.is_file():
        raise ValueError(f"{folder}: not a Hugging Face checkpoint folder (no config.json)")
    return json.loads(path.read_text())


def tensor_files(folder: str | os.PathLike) -> dict[str, pathlib.Path]:
    """Tensor name -> the safetensors file holding it (from the index when sharded)."""
    folder = pathlib.Path(folder)
    if (folder / INDEX).is_file():
        index = json.loads((folder / INDEX).read_text())["weight_map"]
        return {name: folder / file for name, file in index.items()}
    if (folder / SINGLE).is_file():
        with safe_open(folder / SINGLE, "np") as f:
            return {name: folder / SINGLE for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    raise ValueError(f"{folder}: no {SINGLE} or {INDEX}")


def _prefix(names) -> str:
    """The decoder's prefix: "" for a causal LM, "language_model." for multimodal Gemma 3."""
    if "model.embed_tokens.weight" in names:
        return ""
    for prefix in ("language_model.", "model.language_model."):
        if prefix + "model.embed_tokens.weight" in names or prefix + "embed_tokens.weight" in names:
            return prefix
    raise ValueError("the checkpoint has no model.embed_tokens.weight")


def _resolve(name: str, prefix: str, names) -> str:
    """An HF tensor name of the table under the checkpoint's prefix (transformers 5's Gemma 3
    drops the inner "model." after "model.language_model.")."""
    for candidate in (prefix + name, prefix + name.removeprefix("model.")):
        if candidate in names:
            return candidate
    return prefix + name


def stream_params(
    folder: str | os.PathLike, config: ModelConfig, progress: bool = True
) -> Iterator[tuple[tuple[str, ...], tuple[int, ...], Iterator[np.ndarray]]]:
    """The folder's parameters in models.gguf_loader.stream_params' stream: (keys, shape,
    blocks) per leaf of the stacked layout, blocks float32 arrays (one tensor each) whose values
    in order are the leaf's. ValueError naming a missing or misshapen tensor."""
    files = tensor_files(folder)
    prefix = _prefix(files)
    table = weights.weights_of(config)
    norm_offset = np.float32(FAMILIES[config.family].norm_offset)
    total = sum(config.num_layers if w.per_layer else 1 for w in table)

    def read(w: weights.Weight, layer: int | None, shape) -> Iterator[np.ndarray]:
        """The tensor as float32 blocks of at most BLOCK_BYTES of rows. A file is opened per
        tensor (safetensors maps it; closing drops the pages read) and sliced by rows ("np"
        reads bfloat16 as ml_dtypes' bfloat16), so one block is held at a time."""
        name = _resolve(w.hf_name(config, layer), prefix, files)
        if name not in files:
            raise ValueError(f"checkpoint has no tensor {name!r} ({w.name})")
        with safe_open(files[name], "np") as f:
            tensor = f.get_slice(name)
            file_shape = tuple(tensor.get_shape())
            rows = file_shape[0] if file_shape else 1
            if math.prod(file_shape) != math.prod(shape) or (
                w.contract and rows != math.prod(shape[: len(shape) - w.contract])
            ):
                raise ValueError(f"tensor {name!r} has shape {file_shape}, expected {shape} ({w.name})")
            step = max(1, BLOCK_BYTES // (4 * max(1, math.prod(file_shape[1:]))))
            for r0 in range(0, rows, step):
                block = np.asarray(
                    tensor[r0 : min(rows, r0 + step)] if file_shape else tensor[...], np.float32
                )
                if norm_offset and w.init == "ones":
                    block = block + norm_offset  # Gemma's RMSNorm multiplies by 1 + w
                yield block

    with tqdm(total=total, unit="tensor", desc="convert safetensors", disable=not progress) as bar:

        def leaf_blocks(w: weights.Weight, shape) -> Iterator[np.ndarray]:
            for layer in range(config.num_layers) if w.per_layer else [None]:
                yield from read(w, layer, shape)
                bar.update(1)

        for w in table:
            shape = tuple(w.shape(config))
            keys = (weights.LAYER_PREFIX, *w.path) if w.per_layer else w.path
            yield keys, (config.num_layers, *shape) if w.per_layer else shape, leaf_blocks(w, shape)
