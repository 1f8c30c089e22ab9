"""Attention kernels vs the XLA reference (CPU only: Pallas runs in interpret mode, always under jit).

The Triton kernels run under the HLO interpreter (interpret=True); the Mosaic kernels under the TPU
interpreter (interpret=True maps to pltpu.InterpretParams(), which models their strided loads and
scalar prefetch). Neither interpreter checks real-hardware constraints, so test_kernels_lower_*
additionally runs the Pallas -> Mosaic / Triton lowering for the real platforms on CPU.
"""

import functools
import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from models import kernels
from models.kernels import flash_attention, flash_decoding
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
    """
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (b, t, h, d), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (b, s, kvh, d), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (b, s, kvh, d), jnp.float32).astype(dtype)
    lens = jnp.asarray(lengths, jnp.int32)
    assert lens.shape == (b,)
    steps = jnp.arange(t, dtype=jnp.int32)
    pos = lens[:, None] - t + steps if mode == "decode" else jnp.broadcast_to(steps, (b, t))
    return q, k, v, pos, lens


def _assert_matches_reference(out, q, k, v, pos, lens):
    ref = kernels.attention_reference(q, k, v, pos, lens)
    chex.assert_equal_shape([out, ref])
    chex.assert_trees_all_equal_dtypes(out, ref)
    chex.assert_tree_all_finite(out)
    out32, ref32 = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    err = np.max(np.abs(out32 - ref32)) / np.max(np.abs(ref32))
    tol = TOLERANCE[jnp.dtype(q.dtype)]
    assert err <= tol, f"max-normalised error {err:.3g} > {tol:g}"
    # A query that sees no key (position < 0 or kv length 0) must give exact zeros.
    no_key = np.asarray((pos < 0) | (lens[:, None] <= 0))
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


def _lower(fn, platform, args):
    traced = jax.jit(fn).trace(*args)
    if platform != "tpu":
        return traced.lower(lowering_platforms=(platform,)).as_text()
    # Mosaic reads the TPU generation from the current device; give it an abstract TPU instead.
    device = jax.sharding.AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)):
        return traced.lower(lowering_platforms=("tpu",)).as_text()


@pytest.mark.parametrize("backend, platform", [("tpu", "tpu"), ("gpu", "cuda")])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("t", [5, 64], ids=["decode", "prefill"])
def test_kernels_lower_for_real_backends(backend, platform, dtype, t):
    """The Pallas -> Mosaic / Triton lowering (block-shape rules, supported ops) runs on CPU too.
    The device compilers after it (libtpu's Mosaic passes, Triton -> PTX) need the device."""
    impl = "pallas_tpu" if backend == "tpu" else "pallas_gpu"
    fn = functools.partial(kernels.attention, impl=impl)
    text = _lower(fn, platform, _shapes(b=2, t=t, s=1000, h=8, kvh=2, d=128, dtype=dtype))
    assert ("tpu_custom_call" if backend == "tpu" else "triton") in text


# ---------------------------------------------------------------------------------- dispatcher


def test_auto_resolves_to_xla_on_cpu():
    assert jax.default_backend() == "cpu"
    assert kernels.resolve_impl("auto") == "xla"
    for impl in ("xla", "pallas_tpu", "pallas_gpu"):
        assert kernels.resolve_impl(impl) == impl


def test_bad_impl_name_lists_the_allowed_ones():
    with pytest.raises(
        ValueError, match=r"one of \('auto', 'xla', 'pallas_tpu', 'pallas_gpu'\), got 'triton'"
    ):
        kernels.resolve_impl("triton")
    with pytest.raises(ValueError, match=r"got 'cuda'"):
        jax.eval_shape(functools.partial(kernels.attention, impl="cuda"), *_shapes())


@pytest.mark.parametrize("impl", PALLAS_IMPLS)
def test_dispatcher_routes_on_num_queries(monkeypatch, impl):
    calls = []

    def spy(name):
        def fake(q, k, v, q_positions, kv_lengths, *, backend, interpret):
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


@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu"])
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
