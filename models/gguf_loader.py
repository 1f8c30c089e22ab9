"""GGUF -> this project's config and parameter layout (see models/config.py).

GGUF conventions this module undoes:
  * Shapes are stored fastest-axis-first: a tensor listed as [in, out] is the numpy/torch array
    [out, in]. `gguf.GGUFReader` already gives `tensor.data` in numpy order (quantized tensors as
    [rows, bytes_per_row]), and `gguf.quants.dequantize` returns [rows, cols] = torch's [out, in].
  * llama.cpp's converter permutes the rows of attn_q / attn_k for arch "llama" from HF's
    rotate-half layout (pairs (j, j + Dh/2)) to GPT-J's interleaved layout (pairs (2j, 2j + 1)).
    Our model uses rotate-half, so we apply the inverse (`unpermute_llama_rows`). Qwen2 files are
    written without that permutation.

Peak memory: the stacked arrays are preallocated once and filled one tensor at a time; large
tensors are dequantized in row blocks, so the only extra memory beyond the result is one block.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize
from tqdm.auto import tqdm

from models.config import ModelConfig

PathOrReader = str | os.PathLike | GGUFReader

# Fields of ModelConfig that read_config fills from the file.
CONFIG_FIELDS = (
    "vocab_size", "num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim", "mlp_dim",
    "rope_theta", "rms_eps", "qkv_bias", "tie_embeddings", "max_seq_len", "name",
)  # fmt: skip

SUPPORTED_ARCHS = ("llama", "qwen2")

_ROWS_PER_BLOCK = 16384  # rows dequantized at once for big matrices (embedding, lm head)


def open_gguf(path_or_reader: PathOrReader) -> GGUFReader:
    """A GGUFReader (memory-mapped; opening parses all metadata, ~9 s for a Qwen vocabulary)."""
    if isinstance(path_or_reader, GGUFReader):
        return path_or_reader
    return GGUFReader(os.fspath(path_or_reader), "r")


def metadata_value(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """One metadata value as a Python object (str, int, float, bool, or list of those)."""
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    if field.types and field.types[0] == GGUFValueType.FLOAT32:
        # float32 metadata (1e-6 is stored as 9.99999997e-07): keep float32's shortest repr.
        value = float(str(np.float32(value)))
    return value


def _require(reader: GGUFReader, key: str) -> Any:
    value = metadata_value(reader, key)
    if value is None:
        raise ValueError(f"GGUF metadata has no {key!r}")
    return value


def _tensors(reader: GGUFReader) -> dict:
    return {t.name: t for t in reader.tensors}


def read_config(path_or_reader: PathOrReader, name: str | None = None) -> dict:
    """ModelConfig fields (CONFIG_FIELDS) from a GGUF file's metadata and tensor list.

    `ModelConfig(**read_config(path))` builds the config. `name` defaults to `general.name`.
    """
    reader = open_gguf(path_or_reader)
    arch = _require(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
    tensors = _tensors(reader)
    d_model = int(_require(reader, f"{arch}.embedding_length"))
    num_heads = int(_require(reader, f"{arch}.attention.head_count"))
    num_kv_heads = int(metadata_value(reader, f"{arch}.attention.head_count_kv", num_heads))
    head_dim = int(metadata_value(reader, f"{arch}.attention.key_length", d_model // num_heads))
    rope_dims = metadata_value(reader, f"{arch}.rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise ValueError(f"partial rotary embeddings ({rope_dims} of {head_dim} dims) are not supported")
    if "token_embd.weight" in tensors:
        # GGUF lists shapes fastest axis first: [D, V].
        vocab_size = int(tensors["token_embd.weight"].shape[1])
    else:
        vocab_size = len(_require(reader, "tokenizer.ggml.tokens"))
    return dict(
        vocab_size=vocab_size,
        num_layers=int(_require(reader, f"{arch}.block_count")),
        d_model=d_model,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        mlp_dim=int(_require(reader, f"{arch}.feed_forward_length")),
        rope_theta=float(metadata_value(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_eps=float(_require(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        qkv_bias="blk.0.attn_q.bias" in tensors,
        tie_embeddings="output.weight" not in tensors,
        max_seq_len=int(metadata_value(reader, f"{arch}.context_length", 2048)),
        name=name or str(metadata_value(reader, "general.name", arch)),
    )


def permute_llama_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute` (convert_hf_to_gguf.py): rotate-half rows -> interleaved rows.

    w: [n_head * Dh, ...] (torch [out, in] or a bias [out]). Inside each head, row j of the first
    half and row j of the second half (a rotate-half pair) become rows 2j and 2j + 1.
    Only here to test `unpermute_llama_rows` against.
    """
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_llama_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of `permute_llama_rows`: interleaved rows (as stored in a llama GGUF) -> rotate-half rows.

    w: [n_head * Dh, ...]. The forward map reshapes to (n_head, 2, Dh/2) and swaps the last two
    of those axes; undoing it reads the rows as (n_head, Dh/2, 2) and swaps them back.
    """
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize_tensor(tensor) -> np.ndarray:
    """A GGUF tensor as float32 in numpy order (a linear weight comes out torch-style [out, in])."""
    out = dequantize(tensor.data, tensor.tensor_type)
    return np.asarray(out, dtype=np.float32).reshape(tuple(int(d) for d in reversed(tensor.shape)))


def _dequantize_rows_into(tensor, out: np.ndarray) -> None:
    """Dequantize a 2-D tensor [R, C] into out [R, C] in row blocks (bounded temporary memory)."""
    rows = int(tensor.shape[1])
    cols = int(tensor.shape[0])
    data = tensor.data.reshape(rows, -1)  # quantized: [R, bytes_per_row]; float: [R, C]
    for r0 in range(0, rows, _ROWS_PER_BLOCK):
        block = dequantize(data[r0 : r0 + _ROWS_PER_BLOCK], tensor.tensor_type).reshape(-1, cols)
        out[r0 : r0 + block.shape[0]] = block


def load_params(
    path_or_reader: PathOrReader,
    config: ModelConfig | dict | None = None,
    dtype: Any = np.float32,
    progress: bool = True,
) -> dict:
    """Dequantized parameters as a nested dict of numpy arrays in ModelConfig's layout.

    Shapes (L layers, V vocab, D model, H/KVH heads, Dh head dim, F mlp):
      embed/embedding [V, D]; final_norm/scale [D]; lm_head/embedding [V, D] (only when untied);
      layers/attn_norm/scale, layers/mlp_norm/scale [L, D];
      layers/attn/wq [L, H, Dh, D], wk/wv [L, KVH, Dh, D], wo [L, D, H, Dh];
      layers/attn/bq [L, H, Dh], bk/bv [L, KVH, Dh] (only when qkv_bias);
      layers/mlp/w_gate, w_up [L, F, D], w_down [L, D, F].
    Matrices keep the file's [out, in] order; only the head axes are split out.
    `dtype` is the numpy dtype of the result (np.float32, or ml_dtypes.bfloat16).
    """
    reader = open_gguf(path_or_reader)
    arch = _require(reader, "general.architecture")
    file_config = read_config(reader)
    if config is None:
        config = file_config
    cfg = dict(config) if isinstance(config, dict) else dataclasses.asdict(config)
    for key in (
        "vocab_size",
        "num_layers",
        "d_model",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "mlp_dim",
        "qkv_bias",
        "tie_embeddings",
    ):
        if cfg[key] != file_config[key]:
            raise ValueError(f"config {key}={cfg[key]!r} does not match the GGUF file ({file_config[key]!r})")
    V, L, D = cfg["vocab_size"], cfg["num_layers"], cfg["d_model"]
    H, KVH, Dh, F = cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"], cfg["mlp_dim"]
    tensors = _tensors(reader)
    permute = arch == "llama"
    dtype = np.dtype(dtype)

    def empty(*shape):
        return np.empty(shape, dtype)

    attn = {
        "wq": empty(L, H, Dh, D),
        "wk": empty(L, KVH, Dh, D),
        "wv": empty(L, KVH, Dh, D),
        "wo": empty(L, D, H, Dh),
    }
    if cfg["qkv_bias"]:
        attn |= {"bq": empty(L, H, Dh), "bk": empty(L, KVH, Dh), "bv": empty(L, KVH, Dh)}
    params = {
        "embed": {"embedding": empty(V, D)},
        "layers": {
            "attn_norm": {"scale": empty(L, D)},
            "attn": attn,
            "mlp_norm": {"scale": empty(L, D)},
            "mlp": {"w_gate": empty(L, F, D), "w_up": empty(L, F, D), "w_down": empty(L, D, F)},
        },
        "final_norm": {"scale": empty(D)},
    }
    if not cfg["tie_embeddings"]:
        params["lm_head"] = {"embedding": empty(V, D)}

    def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"GGUF file has no tensor {name!r}")
        w = dequantize_tensor(tensors[name])
        if w.shape != shape:
            raise ValueError(f"tensor {name!r} has shape {w.shape}, expected {shape}")
        return w

    total = 2 + (0 if cfg["tie_embeddings"] else 1) + L * (9 + (3 if cfg["qkv_bias"] else 0))
    with tqdm(total=total, unit="tensor", desc="convert gguf", disable=not progress) as bar:
        _check_shape(tensors, "token_embd.weight", (V, D))
        _dequantize_rows_into(tensors["token_embd.weight"], params["embed"]["embedding"])
        bar.update(1)
        if not cfg["tie_embeddings"]:
            _check_shape(tensors, "output.weight", (V, D))
            _dequantize_rows_into(tensors["output.weight"], params["lm_head"]["embedding"])
            bar.update(1)
        params["final_norm"]["scale"][:] = get("output_norm.weight", (D,))
        bar.update(1)

        lay = params["layers"]
        for i in range(L):
            p = f"blk.{i}."
            lay["attn_norm"]["scale"][i] = get(p + "attn_norm.weight", (D,))
            lay["mlp_norm"]["scale"][i] = get(p + "ffn_norm.weight", (D,))
            # [out, in] as in the file; the out axis of q/k/v splits into (heads, Dh).
            wq = get(p + "attn_q.weight", (H * Dh, D))
            wk = get(p + "attn_k.weight", (KVH * Dh, D))
            if permute:
                wq, wk = unpermute_llama_rows(wq, H), unpermute_llama_rows(wk, KVH)
            attn["wq"][i] = wq.reshape(H, Dh, D)
            attn["wk"][i] = wk.reshape(KVH, Dh, D)
            attn["wv"][i] = get(p + "attn_v.weight", (KVH * Dh, D)).reshape(KVH, Dh, D)
            # o_proj [D, H*Dh]: its in axis splits into (heads, Dh).
            attn["wo"][i] = get(p + "attn_output.weight", (D, H * Dh)).reshape(D, H, Dh)
            if cfg["qkv_bias"]:
                bq = get(p + "attn_q.bias", (H * Dh,))
                bk = get(p + "attn_k.bias", (KVH * Dh,))
                if permute:
                    bq, bk = unpermute_llama_rows(bq, H), unpermute_llama_rows(bk, KVH)
                attn["bq"][i] = bq.reshape(H, Dh)
                attn["bk"][i] = bk.reshape(KVH, Dh)
                attn["bv"][i] = get(p + "attn_v.bias", (KVH * Dh,)).reshape(KVH, Dh)
            lay["mlp"]["w_gate"][i] = get(p + "ffn_gate.weight", (F, D))
            lay["mlp"]["w_up"][i] = get(p + "ffn_up.weight", (F, D))
            lay["mlp"]["w_down"][i] = get(p + "ffn_down.weight", (D, F))
            bar.update(9 + (3 if cfg["qkv_bias"] else 0))
    return params


def _check_shape(tensors: dict, name: str, shape: tuple[int, ...]) -> None:
    if name not in tensors:
        raise ValueError(f"GGUF file has no tensor {name!r}")
    got = tuple(int(d) for d in reversed(tensors[name].shape))
    if got != shape:
        raise ValueError(f"tensor {name!r} has shape {got}, expected {shape}")
