"""GGUF -> this project's config and parameter layout (see models/config.py).

GGUF conventions this module undoes:
  * Shapes are stored fastest-axis-first: a tensor listed as [in, out] is the numpy/torch array
    [out, in]. `gguf.GGUFReader` already gives `tensor.data` in numpy order (quantized tensors as
    [rows, bytes_per_row]), and `gguf.quants.dequantize` returns [rows, cols] = torch's [out, in].
  * llama.cpp's converter permutes the rows of attn_q / attn_k for arch "llama" (its LlamaModel
    and the classes derived from it, Mistral's HF checkpoints among them) from HF's rotate-half
    layout (pairs (j, j + Dh/2)) to GPT-J's interleaved layout (pairs (2j, 2j + 1)). Our model
    uses rotate-half, so we apply the inverse (`unpermute_llama_rows`). qwen2, qwen3 and gemma3
    files are written without that permutation (llama.cpp rotates them as NeoX, rotate-half).
  * Settings llama.cpp reads from the file or fixes per architecture (read_config): the shape
    keys every architecture has (GGUF_KEYS); a Llama 3 file's rope scaling is its
    `rope_freqs.weight` tensor, the divisors of the rotary frequencies
    (ModelConfig.rope_freq_divisors); linear scaling is `rope.scaling.factor`. What an
    architecture fixes is its family's entry in models.families (Family.gguf_fields: Gemma 3's
    activation, local layers and their rope base `rope.freq_base_swa`). Gemma 3's norm scales are
    stored with Gemma's 1 already added (the converter's norm_shift), so they are read as they are.

Peak memory: stream_params reads the file one block of rows at a time (BLOCK_BYTES of float32,
read with pread, not through the memory map), so a conversion that writes each block out as it
comes (models.convert) holds one block; load_params fills the stacked arrays from that stream.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import mmap
import os
import struct
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize
from tqdm.auto import tqdm

from models import precision, weights
from models.config import SHAPE_FIELDS, ModelConfig
from models.families import FAMILIES, GGUF_ARCHS

PathOrReader = str | os.PathLike | GGUFReader

# Fields of ModelConfig that read_config fills from the file.
CONFIG_FIELDS = (
    "vocab_size", "num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim", "mlp_dim",
    "rope_theta", "rms_eps", "qkv_bias", "tie_embeddings", "max_seq_len", "name",
    "family", "rope_freq_divisors", "sliding_window", "local_layers", "rope_local_theta", "qk_norm",
    "sandwich_norms", "embed_scale", "mlp_activation", "attention_scale",
)  # fmt: skip

# general.architecture values read (models.families.GGUF_ARCHS: each family's gguf_archs).
SUPPORTED_ARCHS = tuple(GGUF_ARCHS)
# Architectures whose q / k rows llama.cpp's converter permuted (a family's gguf_permuted_qk).
PERMUTED_ARCHS = tuple(a for a, family in GGUF_ARCHS.items() if FAMILIES[family].gguf_permuted_qk)
# ModelConfig field -> (its metadata key under "{arch}.", its type, its default; REQUIRED: the
# file must hold it): the keys llama.cpp writes for every architecture. num_kv_heads and
# head_dim default to num_heads and d_model / num_heads (read_config).
REQUIRED = object()
GGUF_KEYS = {
    "d_model": ("embedding_length", int, REQUIRED),
    "num_heads": ("attention.head_count", int, REQUIRED),
    "num_layers": ("block_count", int, REQUIRED),
    "mlp_dim": ("feed_forward_length", int, REQUIRED),
    "rms_eps": ("attention.layer_norm_rms_epsilon", float, REQUIRED),
    "rope_theta": ("rope.freq_base", float, 10000.0),
    "max_seq_len": ("context_length", int, 2048),
}

# Bytes of float32 dequantized at once (stream_params): what a conversion holds beyond its
# fixed costs, whatever the size of the tensor (the 1.5B's embedding is 933 MB of float32).
BLOCK_BYTES = 32 << 20


class GGUFFileError(RuntimeError):
    """A file that starts as a GGUF file but is not a whole, well-formed one (truncated,
    corrupted, an unknown version or tensor type). The CLI reports it in one line naming the
    file, exit code 1 (launch.common)."""


# struct format of each fixed-size metadata value type (GGUFValueType: 8 is STRING, 9 ARRAY).
_VALUE_FORMATS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_VALUE_SIZES = {kind: struct.calcsize(fmt) for kind, fmt in _VALUE_FORMATS.items()}
_READ_VERSIONS = (2, 3)
_MAX_DIMS = 4  # GGML_MAX_DIMS
_U64 = struct.Struct("<Q")  # a string's length


class _Header:
    """A bounds-checked little-endian reader over a GGUF file's bytes (check_file)."""

    def __init__(self, data, path):
        self.data, self.at, self.path = data, 0, path

    def take(self, fmt: str, what: str):
        size = struct.calcsize(fmt)
        if self.at + size > len(self.data):
            raise GGUFFileError(f"{self.path}: truncated: the file ends inside {what} (at byte {self.at})")
        values = struct.unpack_from(fmt, self.data, self.at)
        self.at += size
        return values[0] if len(values) == 1 else values

    def skip(self, size: int, what: str):
        if size > len(self.data) - self.at:
            raise GGUFFileError(f"{self.path}: truncated: the file ends inside {what} (at byte {self.at})")
        self.at += size

    def skip_strings(self, count: int, what: str) -> None:
        """Steps over an array of `count` strings (a vocabulary: 151k for Qwen) without reading
        them, in one loop (string()'s calls for each made a server's start about 0.5 s longer).
        GGUFFileError where the file ends inside them, as take() and skip() say it."""
        data, at, end = self.data, self.at, len(self.data)
        for _ in range(count):
            if at + _U64.size > end:
                break
            at += _U64.size + _U64.unpack_from(data, at)[0]
        else:
            if at <= end:
                self.at = at
                return None
        raise GGUFFileError(f"{self.path}: truncated: the file ends inside {what} (at byte {min(at, end)})")

    def string(self, what: str) -> bytes:
        size = self.take("<Q", what)
        start = self.at
        self.skip(size, what)
        return bytes(self.data[start : self.at])

    def value(self, kind: int, what: str, arrays: bool = False):
        """One metadata value of type `kind` (strings as bytes); an array's items skipped (None)
        unless `arrays`, then a list (strings decoded, as GGUFReader's contents() gives them)."""
        if kind == 8:
            return self.string(what)
        if kind == 9:
            item, count = self.take("<IQ", what)
            if item in _VALUE_SIZES:
                start = self.at
                self.skip(count * _VALUE_SIZES[item], what)
                return (
                    np.frombuffer(self.data, _VALUE_FORMATS[item], count, start).tolist() if arrays else None
                )
            if item not in (8, 9):
                raise GGUFFileError(f"{self.path}: corrupt: {what} has unknown item type {item}")
            if item == 8 and not arrays:
                return self.skip_strings(count, what)
            items = [self.value(item, what, arrays) for _ in range(count)]
            return [v.decode(errors="replace") if item == 8 else v for v in items] if arrays else None
        if kind not in _VALUE_SIZES:
            raise GGUFFileError(f"{self.path}: corrupt: {what} has unknown value type {kind}")
        return self.take(_VALUE_FORMATS[kind], what)


def _tensor_bytes(h: _Header, name: str, dims: tuple, kind: int) -> int:
    """Bytes of a tensor of shape dims (GGUF order) and type kind; GGUFFileError if unknown."""
    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    except (ValueError, KeyError):
        raise GGUFFileError(f"{h.path}: corrupt: tensor {name!r} has unknown type {kind}") from None
    if dims[0] % block:
        raise GGUFFileError(f"{h.path}: corrupt: tensor {name!r} rows of {dims[0]} are not whole blocks")
    return math.prod(dims) // block * size


class TensorInfo(NamedTuple):
    """One entry of a GGUF file's tensor table, as GGUFReader's tensors name them: shape in GGUF
    order (fastest axis first), data_offset from the start of the file."""

    name: str
    shape: tuple[int, ...]
    tensor_type: GGMLQuantizationType
    data_offset: int
    n_bytes: int


class GGUFIndex(NamedTuple):
    """A checked GGUF file's header without its arrays: the scalar metadata (strings decoded,
    float32 values as metadata_value gives them) and the tensor table. Read by check_file with
    struct in a fraction of a second, where GGUFReader builds a numpy view of every metadata
    item (~8 s for a 151k-token vocabulary: measured, issue 39) before anything can be read."""

    path: str
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]

    def data(self, tensor: TensorInfo) -> np.ndarray:
        """The tensor's bytes, uint8 [rows, bytes per row] (rows: every axis but the first in
        GGUF order), memory-mapped."""
        rows = math.prod(tensor.shape[1:])
        return np.memmap(self.path, np.uint8, "r", tensor.data_offset, (rows, tensor.n_bytes // rows))


def check_file(path: str | os.PathLike) -> GGUFIndex:
    """GGUFFileError in one line naming `path` and what is wrong unless it is a whole GGUF file:
    the magic, a version this reader takes (2, 3), every metadata entry and tensor description
    within the file, known tensor types, at most 4 dimensions, and each tensor's data (at its
    aligned offset) inside the file. Reads the header only (no tensor data) and returns it as a
    GGUFIndex; results are remembered per (path, size, modification time)."""
    st = os.stat(path)
    return _check_file(os.path.realpath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _check_file(path: str, size: int, mtime_ns: int) -> GGUFIndex:
    with open(path, "rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        try:
            metadata, tensors, end, alignment = _read_header(_Header(data, path), size)
        finally:
            if size:
                data.close()
    start = -(-end // alignment) * alignment
    for t in tensors:
        if t.data_offset % alignment or start + t.data_offset + t.n_bytes > size:
            raise GGUFFileError(
                f"{path}: truncated or corrupt: tensor {t.name!r} needs bytes up to "
                f"{start + t.data_offset + t.n_bytes}, the file has {size}"
            )
    return GGUFIndex(path, metadata, {t.name: t._replace(data_offset=start + t.data_offset) for t in tensors})


def read_index(path: str | os.PathLike) -> GGUFIndex:
    """check_file's index with the array metadata too (the vocabulary, the merges, the token
    types: lists, as GGUFReader's contents() gives them), for the conversion, which reads a
    file through it instead of a GGUFReader (~9 s less per Qwen file). Not remembered."""
    index = check_file(path)
    with open(index.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        metadata = _read_header(_Header(data, index.path), len(data), arrays=True)[0]
    return index._replace(metadata=metadata)


def _read_header(h: _Header, size: int, arrays: bool = False) -> tuple[dict, list[TensorInfo], int, int]:
    """(scalar metadata (and the arrays, as lists, with `arrays`), the tensor table (offsets
    from the data's start), where the header ends, the data's alignment) of the file h reads;
    GGUFFileError where the header is cut short or not a GGUF header."""
    if h.take("<4s", "the magic") != b"GGUF":
        raise GGUFFileError(f"{h.path}: not a GGUF file (no GGUF magic)")
    version = h.take("<I", "the version")
    if version not in _READ_VERSIONS:
        raise GGUFFileError(f"{h.path}: corrupt: GGUF version {version} (readable: 2, 3)")
    count, kvs = h.take("<QQ", "the tensor and metadata counts")
    if count > size or kvs > size:
        raise GGUFFileError(f"{h.path}: corrupt: {count} tensors and {kvs} metadata entries in {size} bytes")
    metadata = {}
    for i in range(kvs):
        key = h.string(f"metadata entry {i}").decode(errors="replace")
        kind = h.take("<I", f"metadata {key!r}")
        value = h.value(kind, f"metadata {key!r}", arrays)
        if value is not None:
            value = value.decode(errors="replace") if kind == 8 else value
            metadata[key] = float(str(np.float32(value))) if kind == 6 else value
    alignment = metadata.get("general.alignment", 32)
    if not (isinstance(alignment, int) and alignment > 0 and alignment & (alignment - 1) == 0):
        raise GGUFFileError(f"{h.path}: corrupt: general.alignment {alignment!r} is not a power of two")
    tensors = []
    for i in range(count):
        name = h.string(f"the tensor table (entry {i})").decode(errors="replace")
        ndims = h.take("<I", f"the tensor table ({name!r})")
        if not 1 <= ndims <= _MAX_DIMS:
            raise GGUFFileError(f"{h.path}: corrupt: tensor {name!r} has {ndims} dimensions")
        dims = h.take(f"<{ndims}Q", f"the tensor table ({name!r})")
        kind, offset = h.take("<IQ", f"the tensor table ({name!r})")
        dims = dims if ndims > 1 else (dims,)
        nbytes = _tensor_bytes(h, name, dims, kind)
        tensors.append(TensorInfo(name, tuple(dims), GGMLQuantizationType(kind), offset, nbytes))
    return metadata, tensors, h.at, alignment


def open_gguf(path_or_reader: PathOrReader) -> GGUFReader:
    """A GGUFReader (memory-mapped; opening parses all metadata, ~9 s for a Qwen vocabulary),
    the file checked first (check_file: GGUFFileError in one line for a truncated or corrupt one).
    A reader or a GGUFIndex (read_index's: what the functions below read too) is returned as it is."""
    if isinstance(path_or_reader, GGUFReader | GGUFIndex):
        return path_or_reader
    check_file(path_or_reader)
    return GGUFReader(os.fspath(path_or_reader), "r")


def metadata_value(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """One metadata value as a Python object (str, int, float, bool, or list of those); reader:
    a GGUFReader or a GGUFIndex (read_index's, for the arrays)."""
    if isinstance(reader, GGUFIndex):
        value = reader.metadata.get(key)
        return default if value is None else value
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


def _tensors(reader: GGUFReader | GGUFIndex) -> dict:
    """{name: tensor} of a GGUFReader's ReaderTensors or a GGUFIndex's TensorInfos (the fields
    stream_params reads are named alike)."""
    return reader.tensors if isinstance(reader, GGUFIndex) else {t.name: t for t in reader.tensors}


def _tensor_data(reader: GGUFReader | GGUFIndex, tensor) -> np.ndarray:
    """A tensor's data as gguf's dequantize takes it (a reader's view, or the index's bytes)."""
    return reader.data(tensor) if isinstance(reader, GGUFIndex) else tensor.data


def read_config(path_or_reader: PathOrReader, name: str | None = None) -> dict:
    """ModelConfig fields (CONFIG_FIELDS) from a GGUF file's metadata and tensor list, read as
    llama.cpp reads them for the file's architecture (SUPPORTED_ARCHS; ValueError naming any
    other, or a setting the decoder does not implement): the shape keys of GGUF_KEYS, what the
    tensor list shows, and what the architecture's family fixes (models.families'
    Family.gguf_fields).

    `ModelConfig(**read_config(path))` builds the config. `name` defaults to `general.name`.
    """
    reader = open_gguf(path_or_reader)
    arch = _require(reader, "general.architecture")
    if arch not in GGUF_ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
    tensors = _tensors(reader)

    def meta(key: str, default: Any = REQUIRED) -> Any:
        if default is REQUIRED:
            return _require(reader, f"{arch}.{key}")
        return metadata_value(reader, f"{arch}.{key}", default)

    shape = {field: kind(meta(key, default)) for field, (key, kind, default) in GGUF_KEYS.items()}
    shape["num_kv_heads"] = int(meta("attention.head_count_kv", shape["num_heads"]))
    shape["head_dim"] = int(meta("attention.key_length", shape["d_model"] // shape["num_heads"]))
    _check_supported(arch, meta, shape["head_dim"])
    fields = dict(qk_norm=False, sandwich_norms=False, embed_scale=False)  # unless the family fixes them
    fields |= FAMILIES[GGUF_ARCHS[arch]].gguf_fields(meta, shape) | shape
    # The file's tensors say whether it has q / k / v biases and an output head, whatever its family.
    return fields | dict(
        vocab_size=_vocab_size(reader, tensors),
        qkv_bias="blk.0.attn_q.bias" in tensors,
        tie_embeddings="output.weight" not in tensors,
        name=name or str(metadata_value(reader, "general.name", arch)),
        family=GGUF_ARCHS[arch],
        rope_freq_divisors=_rope_divisors(reader, arch, tensors, shape["head_dim"]),
    )


def _check_supported(arch: str, meta, head_dim: int) -> None:
    """ValueError naming what the decoder does not implement: partial rotary embeddings, logit
    soft-capping (meta: read_config's metadata reader)."""
    rope_dims = meta("rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise ValueError(f"partial rotary embeddings ({rope_dims} of {head_dim} dims) are not supported")
    softcap = meta("final_logit_softcapping", None)
    if softcap:
        raise ValueError(f"GGUF {arch}: final_logit_softcapping={softcap} is not supported")


def _vocab_size(reader: GGUFReader, tensors: dict) -> int:
    """The embedding's rows (GGUF lists shapes fastest axis first: [D, V]), else the token list's length."""
    if "token_embd.weight" in tensors:
        return int(tensors["token_embd.weight"].shape[1])
    return len(_require(reader, "tokenizer.ggml.tokens"))


def _rope_divisors(reader: GGUFReader, arch: str, tensors: dict, head_dim: int):
    """ModelConfig.rope_freq_divisors as llama.cpp rotates: the `rope_freqs.weight` tensor (Llama
    3's per-frequency factors, which divide the frequencies) times the linear scaling factor
    (`rope.scaling.factor`, frequencies times 1 / factor); None when neither is set."""
    kind = metadata_value(reader, f"{arch}.rope.scaling.type")
    if kind not in (None, "none", "linear"):
        raise ValueError(f"GGUF {arch}: rope scaling type {kind!r} is not supported (none, linear)")
    factor = metadata_value(reader, f"{arch}.rope.scaling.factor")
    if factor is None:
        factor = metadata_value(reader, f"{arch}.rope.scale_linear")  # the key's older name
    divisors = None
    if "rope_freqs.weight" in tensors:
        freqs = tensors["rope_freqs.weight"]
        divisors = np.asarray(dequantize(_tensor_data(reader, freqs), freqs.tensor_type), np.float64).reshape(
            -1
        )
        if divisors.size != head_dim // 2:
            raise ValueError(f"rope_freqs.weight has {divisors.size} entries, expected {head_dim // 2}")
    if factor and float(factor) != 1.0:
        divisors = (np.ones(head_dim // 2) if divisors is None else divisors) * float(factor)
    return None if divisors is None else tuple(float(d) for d in divisors)


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


def _read_rows(fd: int, tensor, r0: int, r1: int, rows: int) -> np.ndarray:
    """Rows [r0, r1) of a 2-D tensor of `rows` rows, dequantized: float32 [r1 - r0, C]. Read with
    pread into memory that is freed with the block, not through the reader's memory map, whose
    pages would stay in the process's resident set until the map is closed."""
    row_bytes = tensor.n_bytes // rows
    n = (r1 - r0) * row_bytes
    raw = os.pread(fd, n, tensor.data_offset + r0 * row_bytes)
    if len(raw) != n:
        raise ValueError(f"tensor {tensor.name!r}: the GGUF file ends inside its data")
    data = np.frombuffer(raw, np.uint8).reshape(r1 - r0, row_bytes)
    return np.asarray(dequantize(data, tensor.tensor_type), np.float32).reshape(r1 - r0, -1)


def _checked_config(reader: GGUFReader, config: ModelConfig | dict | None) -> ModelConfig:
    """`config` (default: the file's own) as a ModelConfig; ValueError if its shapes are not the file's."""
    file_config = read_config(reader)
    cfg = file_config if config is None else config
    cfg = dict(cfg) if isinstance(cfg, dict) else dataclasses.asdict(cfg)
    for key in (*SHAPE_FIELDS, "qkv_bias", "tie_embeddings", "qk_norm", "sandwich_norms"):
        if cfg[key] != file_config[key]:
            raise ValueError(f"config {key}={cfg[key]!r} does not match the GGUF file ({file_config[key]!r})")
    return ModelConfig(**{k: v for k, v in cfg.items() if k in ModelConfig.__dataclass_fields__})


def stream_params(
    path_or_reader: PathOrReader, config: ModelConfig | dict | None = None, progress: bool = True
) -> Iterator[tuple[tuple[str, ...], tuple[int, ...], Iterator[np.ndarray]]]:
    """The parameters of load_params, one leaf at a time and one block of a tensor at a time:
    yields (keys, shape, blocks) for each leaf of models.weights' stacked layout, where keys is
    its path in the pytree, shape its shape, and blocks (consume it before the next leaf)
    yields float32 arrays whose values, raveled and in order, are the leaf's in C order. A
    block is at most BLOCK_BYTES of one GGUF tensor's rows (whole heads of a llama q / k matrix,
    which the un-permutation reorders inside each head), so what is held at once stays near
    one block whatever the model's size."""
    reader = open_gguf(path_or_reader)
    permute = _require(reader, "general.architecture") in PERMUTED_ARCHS
    model_config = _checked_config(reader, config)
    cfg = dataclasses.asdict(model_config)
    tensors = _tensors(reader)
    num_layers = model_config.num_layers
    table = weights.weights_of(model_config)

    def blocks(fd: int, w: weights.Weight, name: str, shape: tuple[int, ...]) -> Iterator[np.ndarray]:
        """Tensor `name` (torch order: [out, in] or [n]) as float32 blocks of the table's shape."""
        if name not in tensors:
            raise ValueError(f"GGUF file has no tensor {name!r}")
        tensor = tensors[name]
        size = math.prod(shape)
        rows = math.prod(shape[: len(shape) - w.contract]) if w.contract else 1
        file_shape = tuple(int(d) for d in reversed(tensor.shape))
        if math.prod(file_shape) != size or (w.contract and file_shape[0] != rows):
            raise ValueError(f"tensor {name!r} has shape {file_shape}, expected {shape} ({w.name})")
        heads = cfg[w.llama_permuted_heads] if permute and w.llama_permuted_heads else None
        if not w.contract:  # a norm or a bias: one small vector
            value = _read_rows(fd, tensor, 0, 1, 1).reshape(-1)
            yield unpermute_llama_rows(value, heads) if heads else value
            return
        cols = size // rows
        granule = rows // heads if heads else 1
        step = max(granule, BLOCK_BYTES // (4 * cols) // granule * granule)
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            block = _read_rows(fd, tensor, r0, r1, rows)
            yield unpermute_llama_rows(block, (r1 - r0) // granule) if heads else block

    total = sum(num_layers if w.per_layer else 1 for w in table)
    with (
        open(reader.path if isinstance(reader, GGUFIndex) else reader.data.filename, "rb") as file,
        tqdm(total=total, unit="tensor", desc="convert gguf", disable=not progress) as bar,
    ):

        def leaf_blocks(w: weights.Weight, shape: tuple[int, ...]) -> Iterator[np.ndarray]:
            for i in range(num_layers) if w.per_layer else [None]:
                yield from blocks(file.fileno(), w, w.gguf.format(i=i), shape)
                bar.update(1)

        for w in table:
            shape = tuple(w.shape(model_config))
            keys = (weights.LAYER_PREFIX, *w.path) if w.per_layer else w.path
            yield keys, (num_layers, *shape) if w.per_layer else shape, leaf_blocks(w, shape)


def load_params(
    path_or_reader: PathOrReader,
    config: ModelConfig | dict | None = None,
    dtype: Any = np.float32,
    progress: bool = True,
) -> dict:
    """Dequantized parameters as a nested dict of numpy arrays, stacked over layers, in the
    layout of models.weights: every entry of its table the config has, read from the table's
    GGUF tensor (its [out, in] matrix reshaped to the table's shape; for arch "llama" the q / k
    rows un-permuted). `dtype` is the numpy dtype of the result (np.float32, or
    ml_dtypes.bfloat16). The whole model in memory: models.convert writes the same stream
    (stream_params) to disk without holding it.
    """
    params: dict = {}
    for keys, shape, blocks in stream_params(path_or_reader, config, progress=progress):
        out = np.empty(shape, dtype)
        flat, at = out.reshape(-1), 0
        for block in blocks:
            flat[at : at + block.size] = block.reshape(-1)
            at += block.size
        node = params
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = out
    return params


def load_block_params(path_or_reader: PathOrReader, config: ModelConfig, progress: bool = True) -> dict:
    """Parameters at a GGUF precision (config.dtype "gguf" or "gguf_q8"), one subtree per layer
    (layers_0, ...): every matrix as the file ships it, a models.precision.BlockWeight over the
    tensor's own rows of blocks (no dequantization; for arch "llama" the q / k rows un-permuted,
    whole rows of blocks); norms and biases dequantized to float32. A matrix stored as F32 is
    kept as a float32 array."""
    if config.dtype not in precision.GGUF_PRECISIONS:
        raise ValueError(
            f"load_block_params: config.dtype must be one of {precision.GGUF_PRECISIONS}, got {config.dtype!r}"
        )
    if isinstance(path_or_reader, GGUFReader):
        reader = path_or_reader
        arch, tensors, data = _require(reader, "general.architecture"), _tensors(reader), lambda t: t.data
    else:  # the header alone (check_file's index): no GGUFReader parse of the vocabulary
        index = check_file(path_or_reader)
        arch, tensors, data = index.metadata.get("general.architecture"), index.tensors, index.data
    permute = arch in PERMUTED_ARCHS
    cfg = dataclasses.asdict(config)
    unstacked = dataclasses.replace(config, scan_layers=False, dtype="float32")
    shapes = weights.param_shapes(unstacked)

    def read(path, spec):
        w, _, _ = weights.entry(path)
        keys = [str(getattr(k, "key", k)) for k in path]
        i = int(keys[0].rsplit("_", 1)[1]) if w.per_layer else None
        name = w.gguf.format(i=i)
        if name not in tensors:
            raise ValueError(f"GGUF file has no tensor {name!r}")
        tensor = tensors[name]
        file_shape = tuple(int(d) for d in reversed(tensor.shape))
        out_shape = spec.shape[: len(spec.shape) - w.contract]
        rows = int(np.prod(out_shape)) if w.contract else 1
        if int(np.prod(file_shape)) != int(np.prod(spec.shape)) or (w.contract and file_shape[0] != rows):
            raise ValueError(f"tensor {name!r} has shape {file_shape}, expected {spec.shape} ({w.name})")
        blocks = w.contract and tensor.tensor_type != GGMLQuantizationType.F32
        raw = np.asarray(data(tensor)).view(np.uint8).reshape(rows if w.contract else 1, -1)
        if blocks:
            value = raw
        else:
            value = np.asarray(dequantize(raw, tensor.tensor_type), np.float32).reshape(rows, -1)
        if permute and w.llama_permuted_heads:
            value = unpermute_llama_rows(value, cfg[w.llama_permuted_heads])
        if not blocks:
            return np.ascontiguousarray(value.reshape(spec.shape), np.float32)
        block = precision.BlockWeight(
            data=np.ascontiguousarray(value).reshape(*out_shape, -1),
            ggml_type=int(tensor.tensor_type),
            in_shape=tuple(spec.shape[len(spec.shape) - w.contract :]),
            quantize_x=precision.of(config.dtype).quantize_x,
        )
        return precision.for_cpu_kernel(block, table=w.init == "embedding")

    leaves = jax.tree_util.tree_flatten_with_path(shapes)[0]
    out = []
    for path, spec in tqdm(leaves, unit="tensor", desc="read gguf blocks", disable=not progress):
        out.append(read(path, spec))
    return jax.tree.unflatten(jax.tree.structure(shapes), out)
