"""GGUF -> this project's parameters, converted once and cached with orbax.

Cache layout (root `$SPEC_JAX_CACHE`, default `~/.cache/spec_jax`):
    {root}/gguf/{name}.gguf                   the verified GGUF (models.registry)
    {root}/converted/{name}/config.json       ModelConfig fields read from the GGUF metadata
    {root}/converted/{name}/tokenizer.json    the tokenizer built from the GGUF vocabulary
    {root}/converted/{name}/params/           float32 parameters (orbax StandardCheckpointer)
A conversion is written into a temporary folder beside its final place and renamed into
place when complete, so an interrupted conversion leaves nothing that looks finished.
"""

import concurrent.futures
import dataclasses
import json
import multiprocessing
import os
import pathlib
import shutil
import tempfile

import orbax.checkpoint as ocp

from models import gguf_loader, registry
from models.config import ModelConfig
from models.tokenizer import Tokenizer

FORMAT_VERSION = 2  # 2: matrices [out, in]


def converted_dir(name: str, cache_dir=None) -> pathlib.Path:
    return registry.cache_root(cache_dir) / "converted" / name


def convert(name: str, cache_dir=None, progress: bool = True) -> pathlib.Path:
    """Fetches and converts registry model `name` unless already done; returns its folder."""
    final = converted_dir(name, cache_dir)
    if (final / "config.json").exists():
        return final
    gguf = registry.fetch_gguf(name, cache_dir, progress=progress)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=final.parent))
    try:
        reader = gguf_loader.open_gguf(gguf)  # parsed once: it takes seconds for a 150k vocabulary
        config = ModelConfig(**gguf_loader.read_config(reader, name=name))
        params = gguf_loader.load_params(reader, config, progress=progress)
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(tmp / "params", params)
        checkpointer.wait_until_finished()
        Tokenizer.from_gguf(reader).save(tmp / "tokenizer.json")
        del params, reader
        meta = {"format_version": FORMAT_VERSION, "config": dataclasses.asdict(config)}
        (tmp / "config.json").write_text(json.dumps(meta, indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _is_current(folder: pathlib.Path) -> bool:
    config_json = folder / "config.json"
    return (
        config_json.exists() and json.loads(config_json.read_text()).get("format_version") == FORMAT_VERSION
    )


def load_converted(name: str, cache_dir=None, progress: bool = True):
    """Returns (ModelConfig, params as numpy arrays, Tokenizer), converting on first use.

    A conversion runs in a child process: the dequantized arrays, the GGUF pages and
    orbax's buffers go back to the OS before the converted checkpoint is read (measured on
    the 1.5B: a 19.8 GB peak RSS in one process). Its errors are re-raised here.
    """
    folder = converted_dir(name, cache_dir)
    if not _is_current(folder):
        if folder.exists():  # an older format: convert afresh
            shutil.rmtree(folder)
        with concurrent.futures.ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn")
        ) as pool:
            folder = pool.submit(convert, name, cache_dir, progress).result()
    meta = json.loads((folder / "config.json").read_text())
    config = ModelConfig(**meta["config"])
    params = ocp.StandardCheckpointer().restore(folder / "params")
    return config, params, Tokenizer.load(folder / "tokenizer.json")
