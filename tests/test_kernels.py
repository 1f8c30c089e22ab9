"""Attention kernels vs the XLA reference (CPU only: Pallas runs in interpret mode, always under jit).

The Triton kernels run under the HLO interpreter (interpret=True); the Mosaic kernels under the TPU
interpreter (interpret=True maps to pltpu.InterpretParams(), which models their strided loads and
scalar prefetch). Neither interpreter checks real-hardware constraints, so test_kernels_lower_*
additionally runs the Pallas -> Mosaic / Triton lowering for the real platforms on CPU.
"""

import functools
import itertools
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from models import kernels
from models.kernels import common, cpu_matmul, flash_attention, flash_decoding
from models.kernels import target as target_lib
from models.kernels.flash_attention import FlashBlockSizes
from models.kernels.flash_decoding import DecodeBlockSizes

PALLAS_IMPLS = ("pallas_gpu", "pallas_tpu")
# Max-normalised error: max |out - ref| / max |ref| (elementwise relative error is meaningless
# for outputs that are sums of signed terms close to zero).
TOLERANCE = {jnp.dtype(jnp.float32): 2e-6, jnp.dtype(jnp.bfloat16): 2e-2}


def _inputs(seed, *, b, t, s, h, kvh, d, dtype, lengths, mode):
    """Random q, k, v and the positions of either a decode/verify step or a prefill.

    mode "decode": row b's T queries are its last T positions, lengths[b] - T .. lengths[b] - 1
      (kv_lengths = last position + 1; positions < 0 see no key). mode "prefill": positions 0 .. T-1.
    Built with NumPy: jax.random and eager jnp ops compile a program per new shape (~1 s each).
    """
    rng = np.random.default_rng(seed)
    q, k, v = (
        jnp.asarray(rng.standard_normal(shape, np.float32).astype(dtype))
        for shape in ((b, t, h, d), (b, s, kvh, d), (b, s, kvh, d))
    )
    lens = np.asarray(lengths, np.int32)
    assert lens.shape == (b,)
    steps = np.arange(t, dtype=np.int32)
    pos = lens[:, None] - t + steps if mode == "decode" else np.broadcast_to(steps, (b, t))
    return q, k, v, jnp.asarray(pos), jnp.asarray(lens)


# One compiled program per shape (run eagerly, the reference compiles each of its ops).
_reference = jax.jit(kernels.attention_reference)


def _assert_matches_reference(out, q, k, v, pos, lens):
    ref = _reference(q, k, v, pos, lens)
    chex.assert_equal_shape([out, ref])
    chex.assert_trees_all_equal_dtypes(out, ref)
    out32, ref32 = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out32).all()
    err = np.max(np.abs(out32 - ref32)) / np.max(np.abs(ref32))
    tol = TOLERANCE[jnp.dtype(q.dtype)]
    assert err <= tol, f"max-normalised error {err:.3g} > {tol:g}"
    # A query that sees no key (position < 0 or kv length 0) must give exact zeros.
    no_key = (np.asarray(pos) < 0) | (np.asarray(lens)[:, None] <= 0)
    np.testing.assert_array_equal(out32[no_key], 0.0)


# Pairwise covering set over B x T x G(=H/KVH) x KVH x D x dtype x mode: every pair of values of
# any two factors occurs in some case (12 cases instead of 4 * 3 * 2**5 = 384). S is never a
# multiple of a block size; lengths mix 1, full (S) and in-between.
SWEEP = [
    # b, t, g, kvh, d, dtype, mode, s, lengths
    (1, 1, 1, 1, 64, "float32", "decode", 200, (1,)),
    (3, 1, 7, 2, 128, "float32", "prefill", 200, (200, 1, 77)),
    (3, 1, 2, 2, 64, "bfloat16", "prefill", 300, (300, 1, 150)),
    (1, 2, 2, 2, 64, "bfloat16", "prefill", 200, (200,)),
    (3, 2, 1, 1, 128, "float32", "decode", 300, (1, 300, 129)),
    (3, 2, 7, 1, 64, "float32", "prefill", 200, (2, 200, 64)),
    (1, 5, 2, 1, 128, "float32", "decode", 200, (200,)),
    (1, 5, 7, 1, 128, "float32", "decode", 300, (3,)),
    (3, 5, 1, 2, 64, "bfloat16", "prefill", 200, (1, 200, 100)),
    (1, 64, 7, 1, 64, "bfloat16", "decode", 200, (200,)),
    (3, 64, 2, 1, 128, "bfloat16", "prefill", 300, (300, 1, 31)),
    (3, 64, 1, 2, 128, "float32", "decode", 200, (1, 200, 100)),
]


def test_sweep_covers_every_pair():
    levels = [
        (1, 3),
        (1, 2, 5, 64),
        (1, 2, 7),
        (1, 2),
        (64, 128),
        ("float32", "bfloat16"),
        ("decode", "prefill"),
    ]
    for i, j in itertools.combinations(range(len(levels)), 2):
        seen = {(case[i], case[j]) for case in SWEEP}
        missing = set(itertools.product(levels[i], levels[j])) - seen
        assert not missing, f"factors {i}, {j}: pairs {sorted(missing)} not covered"
    for case in SWEEP:
        b, s, lengths = case[0], case[7], case[8]
        assert s % 16 and s % 64, "S must not be a multiple of a block size"
        assert len(lengths) == b
    assert {"1", "S", "in between"} == {
        "1" if n == 1 else "S" if n == case[7] else "in between" for case in SWEEP for n in case[8]
    }


@pytest.mark.parametrize("impl", PALLAS_IMPLS)
@pytest.mark.parametrize("case", SWEEP, ids=lambda c: "b{}-t{}-g{}-kvh{}-d{}-{}-{}-s{}".format(*c[:8]))
def test_dispatcher_matches_reference(impl, case):
    b, t, g, kvh, d, dtype, mode, s, lengths = case
    q, k, v, pos, lens = _inputs(
        0, b=b, t=t, s=s, h=g * kvh, kvh=kvh, d=d, dtype=jnp.dtype(dtype), lengths=lengths, mode=mode
    )
    out = jax.jit(functools.partial(kernels.attention, impl=impl, interpret=True))(q, k, v, pos, lens)
    _assert_matches_reference(out, q, k, v, pos, lens)


def test_xla_impl_is_the_reference():
    q, k, v, pos, lens = _inputs(
        1, b=3, t=5, s=50, h=4, kvh=2, d=64, dtype=jnp.float32, lengths=(50, 1, 9), mode="decode"
    )
    out = jax.jit(functools.partial(kernels.attention, impl="xla"))(q, k, v, pos, lens)
    chex.assert_trees_all_close(out, kernels.attention_reference(q, k, v, pos, lens), rtol=0, atol=0)


# Small explicit blocks so that several query blocks, key blocks, splits and a ragged last key
# block all occur (the default blocks cover the short test sequences with one or two blocks).
def _small_prefill_blocks(backend, dtype):
    return (
        FlashBlockSizes(16, 32)
        if backend == "gpu"
        else FlashBlockSizes(16 if dtype == jnp.bfloat16 else 8, 128)
    )


def _small_decode_blocks(backend):
    return (
        DecodeBlockSizes(block_k=32, num_splits=3)
        if backend == "gpu"
        else DecodeBlockSizes(block_k=128, num_splits=2)
    )


def _interpret(backend):
    return pltpu.InterpretParams() if backend == "tpu" else True


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.parametrize(
    "mode, dtype", [("decode", jnp.float32), ("prefill", jnp.bfloat16)], ids=["decode-f32", "prefill-bf16"]
)
def test_flash_attention_many_blocks(backend, mode, dtype):
    q, k, v, pos, lens = _inputs(
        2, b=3, t=40, s=300, h=4, kvh=2, d=64, dtype=dtype, lengths=(300, 1, 170), mode=mode
    )
    fn = functools.partial(
        flash_attention.flash_attention,
        backend=backend,
        block_sizes=_small_prefill_blocks(backend, dtype),
        interpret=_interpret(backend),
    )
    _assert_matches_reference(jax.jit(fn)(q, k, v, pos, lens), q, k, v, pos, lens)


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_flash_decoding_many_blocks(backend, dtype):
    # Row 3 has kv length 0: it sees nothing at all (zeros).
    q, k, v, pos, lens = _inputs(
        3, b=4, t=5, s=300, h=4, kvh=2, d=128, dtype=dtype, lengths=(300, 1, 140, 0), mode="decode"
    )
    fn = functools.partial(
        flash_decoding.flash_decoding,
        backend=backend,
        block_sizes=_small_decode_blocks(backend),
        interpret=_interpret(backend),
    )
    _assert_matches_reference(jax.jit(fn)(q, k, v, pos, lens), q, k, v, pos, lens)


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.parametrize("kernel", ["flash_attention", "flash_decoding"])
def test_skipped_blocks_are_never_read(backend, kernel):
    """K/V blocks wholly past every query's limit hold NaN: a kernel that only masked them (instead
    of skipping them) would turn p == 0 times NaN into NaN outputs."""
    s = 300
    if kernel == "flash_attention":
        # Prefill of 32 queries: row 0 is bounded by the causal diagonal (its length is 300), rows
        # 1 and 2 by their lengths too.
        t, mode, lengths, blocks = 32, "prefill", (300, 40, 1), _small_prefill_blocks(backend, jnp.float32)
        block_k, fn = blocks.block_k, flash_attention.flash_attention
    else:
        t, mode, lengths, blocks = 5, "decode", (250, 40, 1), _small_decode_blocks(backend)
        block_k, fn = blocks.block_k, flash_decoding.flash_decoding
    q, k, v, pos, lens = _inputs(
        4, b=3, t=t, s=s, h=4, kvh=2, d=64, dtype=jnp.float32, lengths=lengths, mode=mode
    )
    limit = np.minimum(np.asarray(pos).max(axis=1) + 1, np.asarray(lens))  # [B] largest visible key + 1
    first_unneeded = -(-limit // block_k) * block_k  # [B]
    poison = np.arange(s)[None, :] >= first_unneeded[:, None]  # [B, S]
    assert poison.any(axis=1).all(), "every row must have a skippable block, else the test proves nothing"
    poison = jnp.asarray(poison)[:, :, None, None]
    k_bad, v_bad = jnp.where(poison, jnp.nan, k), jnp.where(poison, jnp.nan, v)
    fn = functools.partial(fn, backend=backend, block_sizes=blocks, interpret=_interpret(backend))
    out = jax.jit(fn)(q, k_bad, v_bad, pos, lens)
    _assert_matches_reference(out, q, k, v, pos, lens)


# ------------------------------------------------------------------------------ sliding window
# Hugging Face's sliding-window mask (Mistral, Gemma 3's local layers): key s is visible to the
# query at position p iff s <= p, s < kv_length and p - s < window.

WINDOW_IMPLS = ("cpu", "pallas_gpu", "pallas_tpu")
# Windows of one key, two keys, a middle value, exactly S, and a global layer's int32 max.
WINDOWS_S300 = (1, 2, 37, 300, kernels.MAX_WINDOW)
# decode (T=1), verification (T = gamma + 1, gamma 4) and prefill (T > DECODE_MAX_QUERIES): row 1
# has one key, row 2 a ragged length; every row's queries are its last T positions.
WINDOW_STEPS = {"decode": 1, "verify": 5, "prefill": 40}


def _window_inputs(seed, t, dtype=jnp.float32, lengths=(300, 1, 170), s=300, h=4, kvh=2):
    return _inputs(
        seed, b=len(lengths), t=t, s=s, h=h, kvh=kvh, d=64, dtype=dtype, lengths=lengths, mode="decode"
    )


def _cpu_isa():
    isa = cpu_matmul.isa()
    if not cpu_matmul.available(isa):
        pytest.skip(f"the CPU kernel library ({isa}) cannot be built here")
    return isa


def _windowed(impl):
    """attention(q, k, v, pos, lens, window) for impl, jitted: the window is a traced int32 scalar."""
    cpu_isa = _cpu_isa() if impl == "cpu" else None
    fn = functools.partial(kernels.attention, impl=impl, interpret=True, cpu_isa=cpu_isa)
    return jax.jit(lambda q, k, v, pos, lens, window: fn(q, k, v, pos, lens, window=window))


def _assert_matches_windowed_reference(out, q, k, v, pos, lens, window):
    ref = np.asarray(_reference(q, k, v, pos, lens, window), np.float32)
    out32 = np.asarray(out, np.float32)
    chex.assert_equal_shape([out, ref])
    err = np.max(np.abs(out32 - ref)) / np.max(np.abs(ref))
    tol = TOLERANCE[jnp.dtype(q.dtype)]
    assert err <= tol, f"window {window}: max-normalised error {err:.3g} > {tol:g}"


def test_window_mask_is_hugging_faces_sliding_window():
    pos = np.array([[-1, 0, 3, 7, 9]], np.int32)
    lens = np.array([8], np.int32)
    for window in (1, 2, 3, 8, kernels.MAX_WINDOW):
        mask = np.asarray(kernels.attention_mask(jnp.asarray(pos), jnp.asarray(lens), 10, window))
        expected = np.array(
            [[[s <= p and s < lens[0] and p - s < window for s in range(10)] for p in pos[0]]]
        )
        np.testing.assert_array_equal(mask, expected, err_msg=f"window {window}")
    # window 1: each query sees only its own key (where it is in the cache).
    one = np.asarray(kernels.attention_mask(jnp.asarray(pos), jnp.asarray(lens), 10, 1))
    assert one.sum(axis=-1).tolist() == [[0, 1, 1, 1, 0]]


def test_reference_window_at_least_the_length_is_no_window_bit_for_bit():
    q, k, v, pos, lens = _window_inputs(10, 5)
    unlimited = np.asarray(_reference(q, k, v, pos, lens))
    for window in (300, 301, kernels.MAX_WINDOW):
        np.testing.assert_array_equal(np.asarray(_reference(q, k, v, pos, lens, window)), unlimited)
    # And a window below the length does change the result (the comparison can fail).
    assert not np.array_equal(np.asarray(_reference(q, k, v, pos, lens, 299)), unlimited)


@pytest.mark.parametrize("impl", WINDOW_IMPLS)
@pytest.mark.parametrize("step", WINDOW_STEPS)
def test_windowed_attention_matches_reference(impl, step):
    """Every impl under a traced window (one compiled program per shape) with windows 1, 2, 37,
    exactly S and the int32 max, ragged lengths (300, 1, 170), on decode, verify and prefill."""
    q, k, v, pos, lens = _window_inputs(11, WINDOW_STEPS[step])
    attend = _windowed(impl)
    for window in WINDOWS_S300:
        out = attend(q, k, v, pos, lens, jnp.int32(window))
        _assert_matches_windowed_reference(out, q, k, v, pos, lens, window)


@pytest.mark.parametrize("impl", WINDOW_IMPLS)
def test_python_int_window_matches_reference(impl):
    q, k, v, pos, lens = _window_inputs(12, 5, dtype=jnp.bfloat16)
    cpu_isa = _cpu_isa() if impl == "cpu" else None
    fn = functools.partial(kernels.attention, window=3, impl=impl, interpret=True, cpu_isa=cpu_isa)
    _assert_matches_windowed_reference(jax.jit(fn)(q, k, v, pos, lens), q, k, v, pos, lens, 3)


@pytest.mark.parametrize("impl", ("xla", *WINDOW_IMPLS))
def test_traced_window_at_most_zero_hides_every_key(impl):
    q, k, v, pos, lens = _window_inputs(13, 5)
    attend = _windowed(impl)
    for window in (0, -1, np.iinfo(np.int32).min):
        np.testing.assert_array_equal(np.asarray(attend(q, k, v, pos, lens, jnp.int32(window))), 0.0)


@pytest.mark.parametrize("impl", ("xla", *WINDOW_IMPLS))
@pytest.mark.parametrize("t", [5, 20], ids=["verify", "prefill"])
def test_per_layer_traced_window_inside_scan(impl, t):
    """Gemma 3's pattern: the window of each layer is jnp.where(is_local[layer], W, MAX_WINDOW),
    chosen inside a lax.scan over layers, so one compiled body serves local and global layers."""
    q, k, v, pos, lens = _window_inputs(14, t, lengths=(150, 1, 77), s=150)
    is_local = jnp.array([True, False, True])
    cpu_isa = _cpu_isa() if impl == "cpu" else None
    fn = functools.partial(kernels.attention, impl=impl, interpret=True, cpu_isa=cpu_isa)

    @jax.jit
    def layers(q, k, v, pos, lens):
        def body(carry, layer):
            window = jnp.where(is_local[layer], 6, kernels.MAX_WINDOW)
            scale = (layer + 1).astype(q.dtype)  # a different query per layer
            return carry, fn(q * scale, k, v, pos, lens, window=window)

        return jax.lax.scan(body, None, jnp.arange(3))[1]

    out = layers(q, k, v, pos, lens)
    for layer, window in enumerate((6, None, 6)):
        ref_args = (q * (layer + 1), k, v, pos, lens)
        _assert_matches_windowed_reference(out[layer], *ref_args, window)


@pytest.mark.parametrize("window", [1, 2, 37])
def test_broken_off_by_one_window_fails_the_comparison(window):
    """The broken twin p - s <= window (one key too many) differs from the mask, and the comparison
    the window tests use rejects its outputs: they would catch a kernel with that mistake."""
    q, k, v, pos, lens = _window_inputs(11, 5)
    broken_mask = kernels.attention_mask(pos, lens, 300, window + 1)  # p - s < w + 1  <=>  p - s <= w
    assert not np.array_equal(
        np.asarray(broken_mask), np.asarray(kernels.attention_mask(pos, lens, 300, window))
    )
    broken = _reference(q, k, v, pos, lens, window + 1)
    with pytest.raises(AssertionError, match=f"window {window}: max-normalised error"):
        _assert_matches_windowed_reference(broken, q, k, v, pos, lens, window)


@pytest.mark.parametrize(
    "window, message",
    [
        (0, r"window must be None or an integer in \[1, 2147483647\], got 0"),
        (-3, r"got -3"),
        (2**31, r"got 2147483648"),
        (True, r"got True"),
        (np.zeros(2, np.int32), r"window must be None or an integer in .* got shape \(2,\)"),
        (np.float32(4.0), r"got shape \(\) dtype float32"),
    ],
    ids=["zero", "negative", "past-int32", "bool", "vector", "float"],
)
@pytest.mark.parametrize("impl", ("xla", "pallas_tpu", "pallas_gpu"))
def test_bad_window_is_a_value_error_naming_window(window, message, impl):
    fn = functools.partial(kernels.attention, window=window, impl=impl, interpret=True)
    with pytest.raises(ValueError, match=message):
        jax.eval_shape(fn, *_shapes())


def test_bad_window_to_a_kernel_directly_is_a_value_error():
    for kernel in (flash_attention.flash_attention, flash_decoding.flash_decoding):
        with pytest.raises(
            ValueError, match=r"window must be None or an integer in \[1, 2147483647\], got 0"
        ):
            kernel(*_window_inputs(1, 5), window=0, backend="gpu", interpret=True)


def test_cpu_kernel_window_keeps_its_bits():
    """None, S and the int32 max give the same bits as before the window existed (the loop starts
    at key 0 for all three), and with a small window a query's result is still the same bits
    whatever the number of queries in the call (verification rows equal decode steps)."""
    isa = _cpu_isa()
    q, k, v, pos, lens = _window_inputs(15, 5)
    attend = jax.jit(functools.partial(cpu_matmul.attention, isa_name=isa))
    unlimited = np.asarray(attend(q, k, v, pos, lens))
    for window in (300, kernels.MAX_WINDOW):
        np.testing.assert_array_equal(
            np.asarray(attend(q, k, v, pos, lens, window=jnp.int32(window))), unlimited
        )
    windowed = np.asarray(attend(q, k, v, pos, lens, window=jnp.int32(3)))
    for t in range(5):
        alone = attend(q[:, t : t + 1], k, v, pos[:, t : t + 1], lens, window=jnp.int32(3))
        np.testing.assert_array_equal(np.asarray(alone)[:, 0], windowed[:, t])


@pytest.mark.parametrize("impl", ["cpu", "xla"])
def test_attention_at_a_layer_of_the_stacked_cache_is_that_layers_attention_bit_for_bit(impl):
    """layer=l with k, v [L, B, S, KVH, D] gives the bits of the call on k[l], v[l] (the CPU
    kernel reads the layer in place; the others slice it), a traced layer too; layers differ."""
    cpu_isa = _cpu_isa() if impl == "cpu" else None
    q, k, v, pos, lens = _window_inputs(16, 3, lengths=(40, 1, 17), s=48)
    stacked_k = jnp.stack([k, 2 * k, k[:, ::-1]])
    stacked_v = jnp.stack([v, v[:, ::-1], 3 * v])
    attend = jax.jit(functools.partial(kernels.attention, impl=impl, cpu_isa=cpu_isa))
    for layer in (0, 1, 2):
        alone = np.asarray(attend(q, stacked_k[layer], stacked_v[layer], pos, lens))
        at_python_int = attend(q, stacked_k, stacked_v, pos, lens, layer=layer)
        at_traced = attend(q, stacked_k, stacked_v, pos, lens, layer=jnp.int32(layer))
        np.testing.assert_array_equal(np.asarray(at_python_int), alone, err_msg=f"layer {layer}")
        np.testing.assert_array_equal(np.asarray(at_traced), alone, err_msg=f"layer {layer}, traced")
    assert not np.array_equal(
        np.asarray(attend(q, stacked_k, stacked_v, pos, lens, layer=1)),
        np.asarray(attend(q, stacked_k, stacked_v, pos, lens, layer=2)),
    )


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.parametrize("kernel", ["flash_attention", "flash_decoding"])
def test_blocks_outside_the_window_are_never_read(backend, kernel):
    """K/V blocks wholly before every query's window (and past every limit) hold NaN: a kernel that
    masked them instead of skipping them would give NaN (p == 0 times NaN). So a long cache with a
    small window reads only the blocks the window reaches."""
    # S = 600: with the small blocks, a chunk of flash_decoding's splits would hold both poisoned
    # and visible blocks if the kernel visited the blocks before the window (a chunk of only
    # invisible blocks contributes nothing, NaN or not).
    s, window = 600, 20
    if kernel == "flash_attention":
        t, blocks, fn = 40, _small_prefill_blocks(backend, jnp.float32), flash_attention.flash_attention
    else:
        t, blocks, fn = 5, _small_decode_blocks(backend), flash_decoding.flash_decoding
    block_k = blocks.block_k
    # Row 2's queries are at negative positions from 1 - t on: only its last queries see a key.
    q, k, v, pos, lens = _window_inputs(16, t, lengths=(600, 450, 3), s=s)
    p, n = np.asarray(pos), np.asarray(lens)
    start = np.maximum(p + 1 - window, 0)
    sees = start < np.minimum(p + 1, n[:, None])
    first = np.where(sees, start, s).min(axis=1) // block_k * block_k  # [B] first key read
    end = -(-np.minimum(p.max(axis=1) + 1, n) // block_k) * block_k  # [B] past the last key read
    keys = np.arange(s)[None, :]
    poison = (keys < first[:, None]) | (keys >= end[:, None])
    assert poison[:2, : s // 2].any(axis=1).all(), "rows 0 and 1 must have a block before the window"
    poison = jnp.asarray(poison)[:, :, None, None]
    k_bad, v_bad = jnp.where(poison, jnp.nan, k), jnp.where(poison, jnp.nan, v)
    fn = functools.partial(
        fn, window=window, backend=backend, block_sizes=blocks, interpret=_interpret(backend)
    )
    out = jax.jit(fn)(q, k_bad, v_bad, pos, lens)
    assert np.isfinite(np.asarray(out)).all()
    _assert_matches_windowed_reference(out, q, k, v, pos, lens, window)


# ------------------------------------------------------------------------------ trace-time errors


def _shapes(b=1, t=5, s=64, h=4, kvh=2, d=64, dtype=jnp.float32, kv_dtype=None):
    kv_dtype = kv_dtype or dtype
    return (
        jax.ShapeDtypeStruct((b, t, h, d), dtype),
        jax.ShapeDtypeStruct((b, s, kvh, d), kv_dtype),
        jax.ShapeDtypeStruct((b, s, kvh, d), kv_dtype),
        jax.ShapeDtypeStruct((b, t), jnp.int32),
        jax.ShapeDtypeStruct((b,), jnp.int32),
    )


@pytest.mark.parametrize("impl", PALLAS_IMPLS)
@pytest.mark.parametrize("t", [5, 64], ids=["decode", "prefill"])
def test_unsupported_head_dim_fails_at_trace_time(impl, t):
    # eval_shape only traces: the error must come from the static-shape checks, not from running.
    fn = functools.partial(kernels.attention, impl=impl, interpret=True)
    with pytest.raises(ValueError, match=r"head dim 96 is not supported.*\(64, 128, 256\)"):
        jax.eval_shape(fn, *_shapes(t=t, d=96))


@pytest.mark.parametrize(
    "fn, backend, blocks, message, shapes",
    [
        (
            flash_attention.flash_attention,
            "gpu",
            FlashBlockSizes(48, 64),
            r"GPU block_q=48 must be a power of two",
            None,
        ),
        (
            flash_attention.flash_attention,
            "gpu",
            FlashBlockSizes(64, 8),
            r"GPU block_k=8 must be a power of two >= 16",
            None,
        ),
        (
            flash_attention.flash_attention,
            "tpu",
            FlashBlockSizes(128, 100),
            r"TPU block_k=100 must be a multiple of 128",
            None,
        ),
        (
            flash_attention.flash_attention,
            "tpu",
            FlashBlockSizes(12, 128),
            r"TPU block_q=12 must be a multiple of 8",
            None,
        ),
        (
            flash_decoding.flash_decoding,
            "tpu",
            DecodeBlockSizes(block_k=200),
            r"TPU block_k=200 must be a multiple",
            None,
        ),
        (
            flash_decoding.flash_decoding,
            "gpu",
            DecodeBlockSizes(block_k=24),
            r"GPU block_k=24 must be a power of two",
            None,
        ),
        (
            flash_attention.flash_attention,
            "cpu",
            None,
            r"backend must be one of \('tpu', 'gpu'\), got 'cpu'",
            None,
        ),
        (
            flash_attention.flash_attention,
            "tpu",
            FlashBlockSizes(1024, 1024),
            r"block_q=1024, block_k=1024, H=32, KVH=8, D=256\) needs about [\d.]+ MiB of VMEM",
            dict(t=4096, s=4096, h=32, kvh=8, d=256),
        ),
    ],
)
def test_block_sizes_that_do_not_tile_fail_at_trace_time(fn, backend, blocks, message, shapes):
    fn = functools.partial(fn, backend=backend, block_sizes=blocks, interpret=True)
    with pytest.raises(ValueError, match=message):
        jax.eval_shape(fn, *_shapes(**(shapes or dict(t=64))))


def test_block_sizes_must_be_positive_integers():
    with pytest.raises(ValueError, match=r"block_q must be a positive integer, got 0"):
        FlashBlockSizes(0, 128)
    with pytest.raises(ValueError, match=r"num_splits must be a positive integer or None, got -1"):
        DecodeBlockSizes(block_k=128, num_splits=-1)


@pytest.mark.parametrize(
    "shapes, message",
    [
        (_shapes(dtype=jnp.float32, kv_dtype=jnp.bfloat16), r"must share one dtype.*float32, bfloat16"),
        (_shapes(dtype=jnp.float16), r"must share one dtype out of float32 / bfloat16, got float16"),
        (_shapes(h=6, kvh=4), r"num query heads 6 is not a multiple of kv heads 4"),
    ],
)
def test_bad_inputs_fail_at_trace_time(shapes, message):
    with pytest.raises(ValueError, match=message):
        jax.eval_shape(functools.partial(kernels.attention, impl="pallas_gpu", interpret=True), *shapes)


# -------------------------------------------------------------------------- lowering for devices


# Mosaic reads the TPU generation, and jax 0.11's Triton lowering the GPU's compute capability,
# from the device traced for: give them an abstract one (jax 0.10's Triton lowering needs none).
_ABSTRACT = {
    "tpu": jax.sharding.AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu"),
    "cuda": jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=None, platform="cuda"),
}


def _lower(fn, platform, args):
    device = _ABSTRACT[platform]
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("backend, platform", [("tpu", "tpu"), ("gpu", "cuda")])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("t", [5, 64], ids=["decode", "prefill"])
@pytest.mark.parametrize("windowed", [False, True], ids=["", "traced-window"])
def test_kernels_lower_for_real_backends(backend, platform, dtype, t, windowed):
    """The Pallas -> Mosaic / Triton lowering (block-shape rules, supported ops) runs on CPU too.
    The device compilers after it (libtpu's Mosaic passes, Triton -> PTX) need the device."""
    impl = "pallas_tpu" if backend == "tpu" else "pallas_gpu"
    fn = functools.partial(kernels.attention, impl=impl)
    shapes = _shapes(b=2, t=t, s=1000, h=8, kvh=2, d=128, dtype=dtype)
    if windowed:
        shapes += (jax.ShapeDtypeStruct((), jnp.int32),)
        fn = functools.partial(lambda attend, *args: attend(*args[:5], window=args[5]), fn)
    text = _lower(fn, platform, shapes)
    assert ("tpu_custom_call" if backend == "tpu" else "triton") in text


# ---------------------------------------------------------------------------------- dispatcher


def test_auto_resolves_to_xla_on_cpu():
    assert jax.default_backend() == "cpu"
    assert kernels.resolve_impl("auto") == "xla"
    for impl in ("xla", "pallas_tpu", "pallas_gpu"):
        assert kernels.resolve_impl(impl) == impl


def test_bad_impl_name_lists_the_allowed_ones():
    with pytest.raises(
        ValueError, match=r"one of \('auto', 'xla', 'cpu', 'pallas_tpu', 'pallas_gpu'\), got 'triton'"
    ):
        kernels.resolve_impl("triton")
    with pytest.raises(ValueError, match=r"got 'cuda'"):
        jax.eval_shape(functools.partial(kernels.attention, impl="cuda"), *_shapes())


@pytest.mark.parametrize("impl", PALLAS_IMPLS)
def test_dispatcher_routes_on_num_queries(monkeypatch, impl):
    calls = []

    def spy(name):
        def fake(q, k, v, q_positions, kv_lengths, *, window, tree, backend, interpret):
            calls.append((name, q.shape[1], backend))
            return q

        return fake

    monkeypatch.setattr(flash_decoding, "flash_decoding", spy("decoding"))
    monkeypatch.setattr(flash_attention, "flash_attention", spy("attention"))
    backend = impl.removeprefix("pallas_")
    for t in (1, kernels.DECODE_MAX_QUERIES, kernels.DECODE_MAX_QUERIES + 1):
        jax.eval_shape(functools.partial(kernels.attention, impl=impl), *_shapes(t=t))
    assert calls == [
        ("decoding", 1, backend),
        ("decoding", kernels.DECODE_MAX_QUERIES, backend),
        ("attention", kernels.DECODE_MAX_QUERIES + 1, backend),
    ]


# pallas_tpu's interpreter runs the loop in 7 s: slow tier; its kernels against the reference
# (test_dispatcher_matches_reference) and compiled for TPUs (tests/test_compile_targets.py) are
# in make test, beside this loop on the GPU kernels.
@pytest.mark.parametrize("impl", [pytest.param("pallas_tpu", marks=pytest.mark.slow), "pallas_gpu"])
def test_greedy_speculative_decoding_is_identical_with_each_impl(impl):
    """The whole loop (prefill, draft steps, verification) under a Pallas impl in interpret mode."""
    import dataclasses

    import models
    import spec_jax

    target = models.random_model(
        vocab_size=64, num_layers=1, d_model=128, num_heads=2, num_kv_heads=1, seed=0
    )
    draft = models.random_model(vocab_size=64, num_layers=1, d_model=128, num_heads=2, num_kv_heads=1, seed=1)
    prompts = [[3, 1, 4, 1, 5], [9, 2]]
    kwargs = dict(draft=draft, gamma=3, max_new_tokens=7, temperature=0.0)
    expected = spec_jax.generate(target, prompts, **kwargs).tokens

    def with_impl(m):
        return m.replace(config=dataclasses.replace(m.config, attention_impl=impl, attention_interpret=True))

    kwargs["draft"] = with_impl(draft)
    assert spec_jax.generate(with_impl(target), prompts, **kwargs).tokens == expected


# ------------------------------------------------------------------------ targets: what "auto" and
# the default tiles depend on. tests/test_compile_targets.py runs the real device compilers.

MIB = 2**20
TPU_V3 = target_lib.Target("tpu", "TPU v3", tpu_generation=3, vmem_bytes=16 * MIB)
TPU_V4 = target_lib.Target("tpu", "TPU v4", tpu_generation=4, vmem_bytes=16 * MIB)
TPU_V5E = target_lib.Target("tpu", "TPU v5 lite", tpu_generation=5, vmem_bytes=128 * MIB)
GPU_A6000 = target_lib.Target("gpu", "NVIDIA RTX A6000", compute_capability=(8, 6))
GPU_A100 = target_lib.Target("gpu", "NVIDIA A100-SXM4-40GB", compute_capability=(8, 0))
GPU_H100 = target_lib.Target("gpu", "NVIDIA H100 80GB HBM3", compute_capability=(9, 0))
GPU_T4 = target_lib.Target("gpu", "Tesla T4", compute_capability=(7, 5))


def _tpu_device(kind):
    return jax.sharding.AbstractDevice(device_kind=kind, num_cores=1, platform="tpu")


def _gpu_device(kind, compute_capability):
    # What a jax GPU device (real or compile-only) exposes; compute_capability is a string there.
    return types.SimpleNamespace(platform="gpu", device_kind=kind, compute_capability=compute_capability)


@pytest.mark.parametrize(
    "device, expected",
    [
        (_tpu_device("TPU v5 lite"), "pallas_tpu"),
        (_tpu_device("TPU v2"), "pallas_tpu"),  # bfloat16 is multiplied in float32 there
        (_gpu_device("NVIDIA H100 80GB HBM3", "9.0"), "pallas_gpu"),
        (_gpu_device("NVIDIA RTX A6000", "8.6"), "pallas_gpu"),
        (_gpu_device("Tesla T4", "7.5"), "xla"),  # XLA compiles Triton only from Ampere (8.0) on
        (_gpu_device("Tesla V100-SXM2-16GB", "7.0"), "xla"),
        (jax.devices("cpu")[0], "xla"),
    ],
    ids=lambda x: x if isinstance(x, str) else x.device_kind,
)
def test_auto_resolves_for_the_device_it_is_given(device, expected):
    assert kernels.resolve_impl("auto", device) == expected
    assert kernels.resolve_impl("auto", target_lib.for_device(device)) == expected
    for impl in ("xla", "pallas_tpu", "pallas_gpu"):
        assert kernels.resolve_impl(impl, device) == impl


def test_auto_follows_the_device_being_traced_for():
    """Without a device argument, "auto" reads the device in effect: an abstract mesh's device (or
    jax.default_device), not jax.default_backend(), which is the CPU when compiling for a TPU here."""
    tpu = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=_tpu_device("TPU v5 lite"))
    with jax.sharding.use_abstract_mesh(tpu):
        assert kernels.resolve_impl("auto") == "pallas_tpu"
        assert target_lib.current().tpu_generation == 5
    assert kernels.resolve_impl("auto") == "xla"
    with jax.default_device(jax.devices("cpu")[0]):
        assert kernels.resolve_impl("auto") == "xla"


def test_target_facts_from_the_device():
    v3, v5e = target_lib.for_device(_tpu_device("TPU v3")), target_lib.for_device(_tpu_device("TPU v5 lite"))
    assert (v3.tpu_generation, v3.tpu_bf16_matmul, v3.tpu_vmem_bytes) == (3, False, 16 * MIB)
    assert (v5e.tpu_generation, v5e.tpu_bf16_matmul, v5e.tpu_vmem_bytes) == (5, True, 128 * MIB)
    a6000 = target_lib.for_device(_gpu_device("NVIDIA RTX A6000", "8.6"))
    assert a6000.compute_capability == (8, 6) and a6000.gpu_shared_memory_per_block == 99 * 1024
    assert target_lib.for_device(_gpu_device("H100", "9.0")).gpu_shared_memory_per_block == 227 * 1024
    assert not target_lib.for_device(_gpu_device("Tesla T4", "7.5")).triton_supported
    # Unknown: the smallest modern part, so that defaults chosen for it compile anywhere.
    cpu = target_lib.for_device(jax.devices("cpu")[0])
    assert (cpu.platform, cpu.tpu_vmem_bytes, cpu.gpu_shared_memory_per_block) == ("cpu", 16 * MIB, 99 * 1024)
    with pytest.raises(ValueError, match=r"platform must be one of \('cpu', 'tpu', 'gpu'\), got 'npu'"):
        target_lib.Target("npu")


# Folded decode tiles of the registered models: (T, G = H / KVH, D), decode and verification.
DECODE_TILES = [(1, 7, 64), (5, 7, 64), (16, 7, 64), (5, 6, 128), (16, 6, 128), (16, 3, 64), (9, 8, 256)]


@pytest.mark.parametrize("gpu", [GPU_A6000, GPU_A100, GPU_H100], ids=lambda g: g.device_kind.split()[-1])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("t, g, d", DECODE_TILES)
def test_gpu_decode_block_is_the_largest_that_fits_shared_memory(gpu, dtype, t, g, d):
    rows = flash_decoding.folded_rows("gpu", t, g, dtype)
    itemsize = jnp.dtype(dtype).itemsize
    if not flash_decoding.fits((1, t, g * 2, d), (1, 1000, 2, d), dtype, "gpu", gpu):
        assert common.gpu_shared_memory_bytes(rows, 16, d, itemsize) > gpu.gpu_shared_memory_per_block
        return
    block_k, _, _ = DecodeBlockSizes().resolve("gpu", 1, 2, 1000, d, dtype, rows, gpu)
    assert common.gpu_shared_memory_bytes(rows, block_k, d, itemsize) <= gpu.gpu_shared_memory_per_block
    # Largest: the next power of two would overflow shared memory or the float32 tile cap.
    double = 2 * block_k
    assert (
        block_k == 128
        or common.gpu_shared_memory_bytes(rows, double, d, itemsize) > gpu.gpu_shared_memory_per_block
        or (dtype == jnp.float32 and rows * double * d > flash_decoding._GPU_MAX_F32_TILE)
    )


def test_gpu_decode_block_counts_the_folded_query_rows():
    """Qwen2.5-0.5B float32 verification (T=5, 14 / 2 heads: 35 rows, padded to 64): the old rule
    (block_k = 128 from D * itemsize alone) asked sm_86 for 114944 bytes of its 101376."""
    rows = flash_decoding.folded_rows("gpu", 5, 7, jnp.float32)
    assert rows == 64
    assert DecodeBlockSizes().resolve("gpu", 1, 2, 1000, 64, jnp.float32, rows, GPU_A6000)[0] <= 64
    assert DecodeBlockSizes(block_k=128).resolve("gpu", 1, 2, 1000, 64, jnp.float32, rows, GPU_A100)[0] == 128
    with pytest.raises(
        ValueError,
        match=r"block_k=128\) needs about 113.0 KiB of shared memory per block \(64 query rows x "
        r"block_k=128, D=64, float32\), more than the 99 KiB of NVIDIA RTX A6000 \(sm_86\)",
    ):
        DecodeBlockSizes(block_k=128).resolve("gpu", 1, 2, 1000, 64, jnp.float32, rows, GPU_A6000)


def test_gpu_float32_decode_tile_is_capped():
    """float32 runs on the FMA units: 128 rows x 128 keys x D=64 took ptxas 28 s for sm_80."""
    rows = flash_decoding.folded_rows("gpu", 16, 7, jnp.float32)
    assert DecodeBlockSizes().resolve("gpu", 1, 2, 1000, 64, jnp.float32, rows, GPU_H100)[0] == 32
    assert DecodeBlockSizes().resolve("gpu", 1, 2, 1000, 64, jnp.bfloat16, rows, GPU_H100)[0] == 128


@pytest.mark.parametrize("gpu", [GPU_A6000, GPU_A100, GPU_H100], ids=lambda g: g.device_kind.split()[-1])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_prefill_default_blocks_fit_shared_memory(gpu, dtype, d):
    blocks = FlashBlockSizes.default("gpu", d, dtype, gpu)
    blocks.check("gpu", dtype)
    need = common.gpu_shared_memory_bytes(blocks.block_q, blocks.block_k, d, jnp.dtype(dtype).itemsize)
    assert need <= gpu.gpu_shared_memory_per_block


def test_dispatcher_sends_decode_tiles_too_big_for_shared_memory_to_flash_attention(monkeypatch):
    calls = []
    for module, name in ((flash_decoding, "flash_decoding"), (flash_attention, "flash_attention")):
        monkeypatch.setattr(module, name, lambda q, *a, name=name, **kw: calls.append(name) or q)
    gpu = jax.sharding.AbstractMesh(
        (1,), ("x",), abstract_device=jax.sharding.AbstractDevice("NVIDIA RTX A6000", 1, "gpu")
    )
    with jax.sharding.use_abstract_mesh(gpu):
        # 16 queries x 8 heads = 128 rows; D=256 float32 needs 169 KiB at block_k=16 (99 KiB here).
        jax.eval_shape(functools.partial(kernels.attention, impl="pallas_gpu"), *_shapes(t=16, h=16, d=256))
        jax.eval_shape(functools.partial(kernels.attention, impl="pallas_gpu"), *_shapes(t=16, h=16, d=64))
    assert calls == ["flash_attention", "flash_decoding"]


@pytest.mark.parametrize("tpu, fits", [(TPU_V4, False), (TPU_V5E, True)], ids=["v4-16MiB", "v5e-128MiB"])
def test_tpu_vmem_budget_follows_the_generation(tpu, fits):
    """block_k=4096 with KVH=2, D=128, float32 needs ~21 MiB of VMEM: XLA:TPU rejects it on v4
    ("Used 21.03M of 16.00M vmem"); the old fixed 48 MiB budget let it through."""
    fn = functools.partial(
        flash_decoding.flash_decoding, backend="tpu", block_sizes=DecodeBlockSizes(block_k=4096), target=tpu
    )
    shapes = _shapes(t=5, s=8192, h=8, kvh=2, d=128)
    if fits:
        jax.eval_shape(fn, *shapes)
        return
    with pytest.raises(
        ValueError, match=r"needs about [\d.]+ MiB of VMEM, more than the 12 MiB budget on TPU v4"
    ):
        jax.eval_shape(fn, *shapes)


@pytest.mark.parametrize("tpu", [TPU_V4, TPU_V5E], ids=["v4", "v5e"])
@pytest.mark.parametrize("kvh, d", [(8, 256), (2, 128)])
def test_tpu_default_blocks_fit_the_vmem_budget(tpu, kvh, d):
    for dtype in (jnp.float32, jnp.bfloat16):
        rows = flash_decoding.folded_rows("tpu", 16, 4, dtype)
        block_k, _, _ = DecodeBlockSizes().resolve("tpu", 1, kvh, 32768, d, dtype, rows, tpu)
        budget = common.tpu_vmem_budget(tpu)
        assert flash_decoding.tpu_vmem_bytes(kvh, rows, d, block_k, dtype) <= budget
        blocks = FlashBlockSizes.default("tpu", d, dtype, tpu, group=4, num_kv_heads=kvh)
        assert flash_attention.tpu_vmem_bytes(kvh, 4 * blocks.block_q, d, blocks.block_k, dtype) <= budget


@pytest.mark.parametrize("kernel", ["flash_decoding", "flash_attention"])
def test_pallas_gpu_refuses_pre_ampere_gpus_at_trace_time(kernel):
    module = flash_decoding if kernel == "flash_decoding" else flash_attention
    fn = functools.partial(getattr(module, kernel), backend="gpu", target=GPU_T4)
    with pytest.raises(
        ValueError,
        match=r"impl='pallas_gpu' needs compute capability >= 8\.0 .*Tesla T4 \(sm_75\) has 7\.5: "
        r"use impl='auto' or 'xla'",
    ):
        jax.eval_shape(fn, *_shapes(t=5 if kernel == "flash_decoding" else 64))
    # Interpret mode runs anywhere.
    jax.eval_shape(functools.partial(fn, interpret=True), *_shapes(t=5))


def test_kernels_refuse_a_device_of_another_platform():
    fn = functools.partial(flash_decoding.flash_decoding, backend="tpu", target=GPU_A100)
    with pytest.raises(ValueError, match=r"pallas_tpu kernels cannot compile for NVIDIA A100.*a gpu device"):
        jax.eval_shape(fn, *_shapes())


@pytest.mark.parametrize(
    "kernel, t, kvh", [("flash_decoding", 5, 2), ("flash_attention", 20, 1)], ids=["decode", "prefill"]
)
def test_tpu_v3_bfloat16_path_matches_reference(kernel, t, kvh):
    """On v2 / v3 the bfloat16 operands are multiplied as float32 (Mosaic: "Unsupported matmul RHS
    type ... bf16" otherwise; tests/test_compile_targets.py shows it). Same results, run in the TPU
    interpreter with the v3 target; KVH 2 and 1 cover both ways the K/V block is read."""
    q, k, v, pos, lens = _inputs(
        5, b=2, t=t, s=150, h=4, kvh=kvh, d=64, dtype=jnp.bfloat16, lengths=(150, 77), mode="decode"
    )
    module = flash_decoding if kernel == "flash_decoding" else flash_attention
    fn = functools.partial(getattr(module, kernel), backend="tpu", interpret=True, target=TPU_V3)
    _assert_matches_reference(jax.jit(fn)(q, k, v, pos, lens), q, k, v, pos, lens)
