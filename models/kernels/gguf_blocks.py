"""Dequantization of GGUF block formats in XLA (jax.numpy): the C kernel's counterpart for any backend.

A weight kept in its GGUF block format is uint8 [..., row_bytes]: each row k values in blocks of
its ggml type, as stored in the file (gguf.GGUFReader's tensor.data for a quantized tensor), one
row per output unit. `dequantize(data, ggml_type, k)` gives float32 [..., k] inside jit on TPU,
GPU, or a CPU where the C kernel (models/kernels/gguf_matmul.cc, which calls ggml's own
dequantization) cannot be built. Each format follows gguf-py's numpy port of ggml's reference
dequantization (gguf.quants) step for step.

Numerics: the results equal gguf-py's bit for bit. Every product here is exact in float32: a
float16 scale has at most 11 significant bits and the integer sub-block scales and quants it is
multiplied by at most 12 more (Q6_K: an int8 scale, 7 bits, times a quant in -32..31, 5), within
float32's 24; all values are multiples of 2^-24, so no float32 subnormal arises. The one rounding
is the addition of a minimum (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K), done as in the reference,
scale * q -/+ min; so neither the order of the products nor a backend's fusing of a multiply and
an add changes a bit.

Multi-byte fields (float16 scales, Q5_0's 32-bit qh) are assembled little-endian with shifts and
then bitcast at the same width: XLA leaves the byte order of a bitcast between widths to the
implementation.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
from gguf import GGMLQuantizationType
from jax import lax


def _le(b: jax.Array, dtype) -> jax.Array:
    """Little-endian bytes uint8 [..., w] -> dtype [...] (w: the dtype's width in bytes, 2 or 4)."""
    width = b.shape[-1]
    u = b.astype({2: jnp.uint16, 4: jnp.uint32}[width])
    word = u[..., 0]
    for i in range(1, width):
        word = word | (u[..., i] << (8 * i))
    return lax.bitcast_convert_type(word, dtype)


def _f16(b: jax.Array, offset: int) -> jax.Array:
    """The float16 at byte `offset` of each block: uint8 [n, size] -> float32 [n, 1]."""
    return _le(b[:, offset : offset + 2], jnp.float16).astype(jnp.float32)[:, None]


def _bits(x: jax.Array, width: int) -> jax.Array:
    """uint8 [..., m] -> uint8 [..., 8 // width, m]: field i holds bits [i * width, (i + 1) * width)."""
    shifts = jnp.arange(0, 8, width, dtype=jnp.uint8)[:, None]
    return (x[..., None, :] >> shifts) & ((1 << width) - 1)


def _int8(x: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(x, jnp.int8)


# Each format: blocks uint8 [n, type_size] -> float32 [n, block_size]. In the 32-value formats,
# value j of a block is the low nibble of qs[j] and value 16 + j its high nibble (plus, for Q5,
# bit j of qh as the fifth bit).


def _q4_0(b):  # [n, 18]: d, qs[16]
    q = _bits(b[:, 2:], 4).reshape(-1, 32).astype(jnp.int32) - 8
    return _f16(b, 0) * q.astype(jnp.float32)


def _q4_1(b):  # [n, 20]: d, m, qs[16]
    q = _bits(b[:, 4:], 4).reshape(-1, 32)
    return _f16(b, 0) * q.astype(jnp.float32) + _f16(b, 2)


def _q5(b, qh_at: int):  # 5-bit quants 0..31: uint8 [n, 32] from qh (uint32) at qh_at and qs after it
    qh = _le(b[:, qh_at : qh_at + 4], jnp.uint32)[:, None] >> jnp.arange(32, dtype=jnp.uint32)
    return _bits(b[:, qh_at + 4 :], 4).reshape(-1, 32) | ((qh & 1).astype(jnp.uint8) << 4)


def _q5_0(b):  # [n, 22]: d, qh, qs[16]
    return _f16(b, 0) * (_q5(b, 2).astype(jnp.int32) - 16).astype(jnp.float32)


def _q5_1(b):  # [n, 24]: d, m, qh, qs[16]
    return _f16(b, 0) * _q5(b, 4).astype(jnp.float32) + _f16(b, 2)


def _q8_0(b):  # [n, 34]: d, qs int8[32]
    return _int8(b[:, 2:]).astype(jnp.float32) * _f16(b, 0)


# K-quants: super-blocks of 256 values in sub-blocks of 16 (Q2_K, Q3_K, Q6_K) or 32 (Q4_K, Q5_K).


def _q2_k(b):  # [n, 84]: scales[16] (low nibble: scale, high: min), qs[64], d, dmin
    sc = b[:, :16]
    dl = (_f16(b, 80) * (sc & 15).astype(jnp.float32))[..., None]  # [n, 16, 1]
    ml = (_f16(b, 82) * (sc >> 4).astype(jnp.float32))[..., None]
    q = _bits(b[:, 16:80].reshape(-1, 2, 32), 2).reshape(-1, 16, 16)  # [n, 2, 4, 32] -> [n, 16, 16]
    return (dl * q.astype(jnp.float32) - ml).reshape(-1, 256)


def _q3_k(b):  # [n, 110]: hmask[32], qs[64], scales[12] (6-bit, offset 32), d
    s = b[:, 96:108]
    sc = _bits(s[:, :8], 4).reshape(-1, 16) | (_bits(s[:, 8:], 2).reshape(-1, 16) << 4)  # [n, 16]: 0..63
    dl = (_f16(b, 108) * (sc.astype(jnp.int32) - 32).astype(jnp.float32))[..., None]  # [n, 16, 1]
    ql = _bits(b[:, 32:96].reshape(-1, 2, 32), 2).reshape(-1, 16, 16).astype(jnp.int32)
    qh = _bits(b[:, :32], 1).reshape(-1, 16, 16).astype(jnp.int32)  # [n, 8, 32] -> [n, 16, 16]
    q = ql - 4 * (1 - qh)  # a clear hmask bit subtracts 4
    return (dl * q.astype(jnp.float32)).reshape(-1, 256)


def _scale_min(s):  # Q4_K / Q5_K: uint8 [n, 12] -> the 6-bit scales and mins, uint8 [n, 8] each
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = jnp.concatenate([d & 63, (md & 15) | ((d >> 2) & 48)], axis=-1)
    mn = jnp.concatenate([m & 63, (md >> 4) | ((m >> 2) & 48)], axis=-1)
    return sc, mn


def _k_scaled(b, q):  # Q4_K / Q5_K: quants [n, 8, 32] -> d * scale * q - dmin * min, [n, 256]
    sc, mn = _scale_min(b[:, 4:16])
    d = (_f16(b, 0) * sc.astype(jnp.float32))[..., None]  # [n, 8, 1]
    dm = (_f16(b, 2) * mn.astype(jnp.float32))[..., None]
    return (d * q.astype(jnp.float32) - dm).reshape(-1, 256)


def _q4_k(b):  # [n, 144]: d, dmin, scales[12], qs[128]
    return _k_scaled(b, _bits(b[:, 16:].reshape(-1, 4, 32), 4).reshape(-1, 8, 32))


def _q5_k(b):  # [n, 176]: d, dmin, scales[12], qh[32], qs[128]
    ql = _bits(b[:, 48:].reshape(-1, 4, 32), 4).reshape(-1, 8, 32)
    return _k_scaled(b, ql | (_bits(b[:, 16:48], 1) << 4))


def _q6_k(b):  # [n, 210]: ql[128], qh[64], scales int8[16], d
    ql = _bits(b[:, :128].reshape(-1, 2, 64), 4).reshape(-1, 8, 32)
    qh = _bits(b[:, 128:192].reshape(-1, 2, 32), 2).reshape(-1, 8, 32)
    q = ((ql | (qh << 4)).astype(jnp.int32) - 32).reshape(-1, 16, 16)
    d = (_f16(b, 208) * _int8(b[:, 192:208]).astype(jnp.float32))[..., None]  # [n, 16, 1]
    return (d * q.astype(jnp.float32)).reshape(-1, 256)


def _f32(b):  # [n, 4]
    return _le(b, jnp.float32)[:, None]


def _bf16(b):  # [n, 2]: the high half of a float32
    return lax.bitcast_convert_type(_le(b, jnp.uint16).astype(jnp.uint32) << 16, jnp.float32)[:, None]


# ggml type id -> (name, block_size, type_size, blocks -> values), as gguf.constants.GGML_QUANT_SIZES.
_FORMATS: dict[int, tuple[str, int, int, Callable[[jax.Array], jax.Array]]] = {
    0: ("F32", 1, 4, _f32),
    1: ("F16", 1, 2, lambda b: _f16(b, 0)),
    2: ("Q4_0", 32, 18, _q4_0),
    3: ("Q4_1", 32, 20, _q4_1),
    6: ("Q5_0", 32, 22, _q5_0),
    7: ("Q5_1", 32, 24, _q5_1),
    8: ("Q8_0", 32, 34, _q8_0),
    10: ("Q2_K", 256, 84, _q2_k),
    11: ("Q3_K", 256, 110, _q3_k),
    12: ("Q4_K", 256, 144, _q4_k),
    13: ("Q5_K", 256, 176, _q5_k),
    14: ("Q6_K", 256, 210, _q6_k),
    30: ("BF16", 1, 2, _bf16),
}
SUPPORTED: frozenset[int] = frozenset(_FORMATS)


def _type_name(ggml_type: int) -> str:
    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"ggml type {ggml_type}"


def dequantize(data, ggml_type: int, k: int) -> jax.Array:
    """data: uint8 [..., row_bytes], each row k values in blocks of ggml_type -> float32 [..., k].

    Traceable under jax.jit (ggml_type and k static), any leading shape, no host callbacks.
    ValueError, naming the type, for a type outside SUPPORTED or a row_bytes that does not hold k
    values of it; TypeError for data that is not uint8.
    """
    fmt = _FORMATS.get(int(ggml_type))
    if fmt is None:
        supported = ", ".join(f[0] for f in _FORMATS.values())
        raise ValueError(f"{_type_name(int(ggml_type))}: no XLA dequantization (supported: {supported})")
    name, block_size, type_size, blocks_to_values = fmt
    data = jnp.asarray(data)
    row_bytes = k // block_size * type_size
    if k % block_size:
        raise ValueError(f"{name}: a row of {k} values is not a whole number of {block_size}-value blocks")
    if data.ndim == 0 or data.shape[-1] != row_bytes:
        raise ValueError(
            f"{name}: a row of {k} values is {row_bytes} bytes ({k // block_size} blocks of {type_size}),"
            f" not the last axis of data {data.shape}"
        )
    if data.dtype != jnp.uint8:
        raise TypeError(f"{name}: GGUF blocks are uint8, not {data.dtype}")
    lead = data.shape[:-1]
    return blocks_to_values(data.reshape(-1, type_size)).reshape(*lead, k)
