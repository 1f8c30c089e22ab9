"""models.kernels.gguf_blocks (GGUF block formats dequantized in XLA) vs gguf-py's numpy reference.

Bit equality (assert_bits_equal: the float32 bits compared): every product in these formats is
exact in float32, so the XLA graph and the reference round alike (the module's docstring). Blocks come from
gguf-py's quantizer where it has one, and for every quantized format also from random bytes with
the float16 scale fields overwritten by finite ones (every bit pattern of the quants, including
those the quantizer never writes, e.g. -128 in Q8_0).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from models.kernels import gguf_blocks as gb

T = GGMLQuantizationType
ROWS = 6  # compared as [6, row_bytes] and as [2, 3, row_bytes]
# Byte offsets of the float16 scales (d, and dmin / m) in each quantized block.
SCALE_OFFSETS = {
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q8_0: (0,),
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
}
QUANTIZABLE = (T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)  # gguf.quants.quantize

dequantize = jax.jit(gb.dequantize, static_argnums=(1, 2))


def k_of(ggml_type) -> int:
    return 2 * GGML_QUANT_SIZES[ggml_type][0] if ggml_type in SCALE_OFFSETS else 96


def random_blocks(ggml_type, rows: int, seed: int) -> np.ndarray:
    """uint8 [rows, row_bytes] of random bytes, the float16 scales set to random values in [0.001, 0.1]."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    blocks = rng.integers(0, 256, (rows, 2, type_size), dtype=np.uint8)  # two blocks a row
    for offset in SCALE_OFFSETS[ggml_type]:
        scale = rng.uniform(0.001, 0.1, (rows, 2)).astype(np.float16)
        blocks[..., offset : offset + 2] = scale.view(np.uint8).reshape(rows, 2, 2)
    return blocks.reshape(rows, -1)


def quantized_rows(ggml_type, rows: int, seed: int) -> np.ndarray:
    """gguf-py's quantization of random float rows, as uint8 [rows, row_bytes]."""
    x = np.random.default_rng(seed).standard_normal((rows, k_of(ggml_type))).astype(np.float32)
    return np.ascontiguousarray(quants.quantize(x, ggml_type)).view(np.uint8)


def assert_bits_equal(got: np.ndarray, want: np.ndarray) -> None:
    """Equal float32 arrays, bit for bit (assert_array_equal alone takes -0.0 for 0.0)."""
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def check(data: np.ndarray, ggml_type, fn=dequantize) -> None:
    """fn (default: gb.dequantize under jit) equals gguf-py's dequantize, bit for bit,
    for data [N, row_bytes] and [2, N / 2, row_bytes]."""
    k = k_of(ggml_type)
    want = quants.dequantize(data, ggml_type).reshape(len(data), k)
    assert np.isfinite(want).all()
    got = np.asarray(fn(data, int(ggml_type), k))
    assert got.dtype == np.float32 and got.shape == want.shape
    assert_bits_equal(got, want)
    got = np.asarray(fn(data.reshape(2, len(data) // 2, -1), int(ggml_type), k))
    assert_bits_equal(got, want.reshape(2, len(data) // 2, k))


def test_supported_and_sizes():
    assert {T.Q8_0, T.Q5_0, T.Q4_K, T.Q6_K, T.Q4_0, T.Q5_K, T.F16, T.BF16, T.F32} <= gb.SUPPORTED
    assert set(SCALE_OFFSETS) | {T.F32, T.F16, T.BF16} == gb.SUPPORTED
    for ggml_type, (name, block_size, type_size, _) in gb._FORMATS.items():
        assert (name, (block_size, type_size)) == (T(ggml_type).name, GGML_QUANT_SIZES[T(ggml_type)])


@pytest.mark.parametrize("ggml_type", QUANTIZABLE, ids=lambda t: t.name)
def test_quantized_rows(ggml_type):
    check(quantized_rows(ggml_type, ROWS, seed=int(ggml_type)), ggml_type)


@pytest.mark.parametrize("ggml_type", tuple(SCALE_OFFSETS), ids=lambda t: t.name)
def test_random_blocks(ggml_type):
    check(random_blocks(ggml_type, ROWS, seed=100 + int(ggml_type)), ggml_type)


def test_float_edge_values():
    """Subnormals, infinities, signed zeros and the largest values of the float formats."""
    for ggml_type, dtype in ((T.F32, np.float32), (T.F16, np.float16)):
        info = np.finfo(dtype)
        x = np.array([0.0, -0.0, info.smallest_subnormal, -info.smallest_subnormal, info.tiny, info.max])
        x = np.concatenate([x, -x, [np.inf, -np.inf], np.linspace(-3, 3, 82)]).astype(dtype)
        data = np.ascontiguousarray(x.reshape(1, 96).repeat(ROWS, 0)).view(np.uint8)
        want = x.astype(np.float32).reshape(1, 96).repeat(ROWS, 0)
        assert_bits_equal(np.asarray(dequantize(data, int(ggml_type), 96)), want)
    bf16 = np.array([0x0001, 0x8001, 0x0080, 0x7F7F, 0x7F80, 0xFF80, 0x8000, 0x3F80] * 12, np.uint16)
    want = (bf16.astype(np.uint32) << 16).view(np.float32).reshape(1, 96)
    assert_bits_equal(np.asarray(dequantize(bf16.view(np.uint8).reshape(1, -1), int(T.BF16), 96)), want)


def test_no_rows_and_no_callbacks():
    assert dequantize(np.zeros((0, 144), np.uint8), int(T.Q4_K), 256).shape == (0, 256)
    jaxpr = str(jax.make_jaxpr(gb.dequantize, static_argnums=(1, 2))(random_blocks(T.Q6_K, 2, 0), 14, 512))
    assert "callback" not in jaxpr


def test_errors_name_the_type():
    with pytest.raises(ValueError, match="IQ2_XXS"):
        gb.dequantize(np.zeros((2, 66), np.uint8), int(T.IQ2_XXS), 256)
    with pytest.raises(ValueError, match="ggml type 99"):
        gb.dequantize(np.zeros((2, 66), np.uint8), 99, 256)
    with pytest.raises(ValueError, match="Q4_K.*288 bytes"):
        gb.dequantize(np.zeros((2, 144), np.uint8), int(T.Q4_K), 512)
    with pytest.raises(ValueError, match="Q8_0.*34 bytes"):
        gb.dequantize(np.zeros((3, 35), np.uint8), int(T.Q8_0), 32)
    with pytest.raises(ValueError, match="Q6_K.*whole number"):
        gb.dequantize(np.zeros((3, 210), np.uint8), int(T.Q6_K), 255)
    with pytest.raises(TypeError, match="uint8"):
        gb.dequantize(np.zeros((3, 34), np.int8), int(T.Q8_0), 32)


def _q4_k_mins_high_bits_from_scales(b):
    """Q4_K with get_scale_min's slip: the mins' high bits taken from the scales' bytes."""
    d, m, md = b[:, 4:8], b[:, 8:12], b[:, 12:16]
    sc = jnp.concatenate([d & 63, (md & 15) | ((d >> 2) & 48)], axis=-1)
    mn = jnp.concatenate([m & 63, (md >> 4) | ((d >> 2) & 48)], axis=-1)  # the slip: d for m
    q = gb._bits(b[:, 16:].reshape(-1, 4, 32), 4).reshape(-1, 8, 32).astype(jnp.float32)
    d = (gb._f16(b, 0) * sc.astype(jnp.float32))[..., None]
    dm = (gb._f16(b, 2) * mn.astype(jnp.float32))[..., None]
    return (d * q - dm).reshape(-1, 256)


# Dequantizations with one bug each (blocks [n, type_size] -> values), built from the module's parts.
BROKEN = {
    "Q4_K-high-nibble-first": (
        T.Q4_K,
        lambda b: gb._k_scaled(b, gb._bits(b[:, 16:].reshape(-1, 4, 32), 4)[:, :, ::-1].reshape(-1, 8, 32)),
    ),
    "Q4_K-mins-high-bits": (T.Q4_K, _q4_k_mins_high_bits_from_scales),
    "Q5_K-qh-high-bit-first": (
        T.Q5_K,
        lambda b: gb._k_scaled(
            b,
            gb._bits(b[:, 48:].reshape(-1, 4, 32), 4).reshape(-1, 8, 32)
            | (gb._bits(b[:, 16:48], 1)[:, ::-1] << 4),
        ),
    ),
    "Q6_K-high-nibble-first": (
        T.Q6_K,
        lambda b: gb._q6_k(b.at[:, :128].set((b[:, :128] << 4) | (b[:, :128] >> 4))),
    ),
    "Q5_0-qh-big-endian": (T.Q5_0, lambda b: gb._q5_0(b.at[:, 2:6].set(b[:, 5:1:-1]))),
    "Q8_0-d-big-endian": (T.Q8_0, lambda b: gb._q8_0(b.at[:, 0:2].set(b[:, 1::-1]))),
}


@pytest.mark.parametrize("bug", BROKEN)
def test_check_catches_a_broken_dequantization(bug, monkeypatch):
    """Each broken variant fails `check` on blocks the real one passes: the comparison is known
    to catch bugs of these kinds (nibble or bit order, packed-scale bits, byte order)."""
    ggml_type, broken = BROKEN[bug]
    data = random_blocks(ggml_type, ROWS, seed=7)
    check(data, ggml_type)
    name, block_size, type_size, _ = gb._FORMATS[ggml_type]
    monkeypatch.setitem(gb._FORMATS, int(ggml_type), (name, block_size, type_size, broken))
    with pytest.raises(AssertionError, match="Mismatched elements"):
        check(data, ggml_type, fn=gb.dequantize)  # not the jitted one: it has traced the right one
