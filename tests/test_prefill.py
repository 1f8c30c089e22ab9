"""Row-wise chunked prefill (spec_jax.row_prefill.prefill_rows): the same logits, cache entries and
features as one call over the padded batch, for every row length and chunk size."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from models.transformer import attention_impl, forward, head_logits, init_cache, output_head
from spec_jax import decode, row_prefill


@pytest.fixture(scope="module")
def model():
    f32 = models.random_model(
        vocab_size=96, num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, scan_layers=False, seed=3
    )
    m = models.cast(f32, "int8")
    assert attention_impl(m.config) == "cpu"  # the path prefill reads row by row
    return m


def _prompts(lengths, width, seed=0):
    rng = np.random.default_rng(seed)
    return decode.pad_prompts([list(rng.integers(1, 96, n)) for n in lengths], width)


def _one_call(config, params, tokens, lens, cache_len):
    batch, width = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
    out = forward(
        config,
        params,
        tokens,
        positions,
        init_cache(config, batch, cache_len),
        logits_at=(lens - 1)[:, None],
        with_features=True,
    )
    return out.replace(logits=out.logits[:, 0])


@pytest.mark.parametrize("chunk", [16, 5, 64])
def test_rows_in_chunks_equal_one_call_bit_for_bit(model, chunk):
    """Lengths around the chunk's multiples (1, chunk - 1, chunk, chunk + 1, the width) and a chunk
    that does not divide the width (its last chunk is moved back, overlapping): logits at each
    row's last token, the cache below each row's length and the features there are the same
    bits. An off-by-one in the positions, the chunk's move back or the last-token pick fails."""
    width, cache_len = 40, 48
    lengths = [1, 15, 16, 17, 40, 23]
    tokens, lens = _prompts(lengths, width)
    run = jax.jit(
        lambda t, n: row_prefill.prefill_rows(
            model.config, model.params, t, n, init_cache(model.config, len(lengths), cache_len), chunk, True
        )
    )
    got = run(jnp.asarray(tokens), jnp.asarray(lens))
    ref = jax.jit(_one_call, static_argnums=(0, 4))(
        model.config, model.params, jnp.asarray(tokens), jnp.asarray(lens), cache_len
    )
    np.testing.assert_array_equal(np.asarray(got.logits), np.asarray(ref.logits))
    for r, n in enumerate(lengths):
        for a, b in ((got.cache.k, ref.cache.k), (got.cache.v, ref.cache.v)):
            np.testing.assert_array_equal(np.asarray(a[:, r, :n]), np.asarray(b[:, r, :n]))
        np.testing.assert_array_equal(np.asarray(got.features[r, :n]), np.asarray(ref.features[r, :n]))


def test_prefill_reads_rows_by_length_on_the_cpu_kernels(model, monkeypatch):
    """decode.prefill takes the row-wise path on the CPU kernels, and a row is read in
    ceil(length / chunk) calls, not the padded width's: counted by the calls of forward traced
    inside the loop and the loop's trip count, seen through a counting callback. Batched
    (prefill_rows(batched=True)), lengths 3, 33 and 17 take one call over the three rows' first
    chunks, then the 33's second chunk alone (one row left of three)."""
    calls = []
    real = row_prefill.forward

    def counting(*args, **kwargs):
        jax.debug.callback(lambda: calls.append(args[2].shape))
        return real(*args, **kwargs)

    monkeypatch.setattr(row_prefill, "forward", counting)
    tokens, lens = _prompts([3, 33, 17], 64)
    jax.block_until_ready(
        decode.prefill(model.config, model.params, jnp.asarray(tokens), jnp.asarray(lens), 80).logits
    )
    by_length = sum(-(-n // row_prefill.PREFILL_CHUNK) for n in (3, 33, 17))  # ceil(n / chunk) a row
    padded = 3 * -(-64 // row_prefill.PREFILL_CHUNK)  # the padded width's: these lengths tell them apart
    assert by_length < padded
    assert calls == [(1, 32)] * by_length
    calls.clear()
    cache = init_cache(model.config, 3, 80)
    jax.block_until_ready(
        row_prefill.prefill_rows(
            model.config, model.params, jnp.asarray(tokens), jnp.asarray(lens), cache, 32, batched=True
        ).logits
    )
    assert calls == [(3, 32), (1, 32)]


def test_live_tokens_takes_one_row_only(model):
    """forward's live_tokens counts the tokens of one row; with two rows it is refused in one
    clear error, not applied to the flattened rows of both."""
    tokens = jnp.ones((2, 4), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(4, dtype=jnp.int32), (2, 4))
    with pytest.raises(ValueError, match="live_tokens needs one row of tokens, got 2"):
        forward(model.config, model.params, tokens, positions, init_cache(model.config, 2, 8), live_tokens=3)


def test_forward_without_logits_gives_the_features_head_logits_reads(model):
    """logits_at="none" (what prefill_rows asks for): no logits, and head_logits over the
    features gives forward's own logits bit for bit; any other string is one clear error."""
    cfg, params = model.config, model.params
    tokens = jnp.asarray(_prompts([7], 8)[0])
    positions = jnp.arange(8, dtype=jnp.int32)[None]
    full = forward(cfg, params, tokens, positions, init_cache(cfg, 1, 8))
    bare = forward(
        cfg, params, tokens, positions, init_cache(cfg, 1, 8), logits_at="none", with_features=True
    )
    assert bare.logits is None
    np.testing.assert_array_equal(
        np.asarray(head_logits(cfg, output_head(cfg, params), bare.features)), np.asarray(full.logits)
    )
    with pytest.raises(ValueError, match="logits_at"):
        forward(cfg, params, tokens, positions, init_cache(cfg, 1, 8), logits_at="last")


@pytest.fixture(scope="module")
def gguf_model():
    """A tiny model at gguf_q8 whose matrices (the head too) are Q4_K interleaved for the CPU
    kernels' repacked products: the multi-row kernel, or, on a build without it, ggml's gemm in
    groups of 4 rows under bulk_products (a prefill's)."""
    f32 = models.random_model(
        vocab_size=96, num_layers=2, d_model=256, num_heads=4, num_kv_heads=2, scan_layers=False, seed=5
    )
    m = models.cast(f32, "gguf_q8")
    assert m.params["lm_head"]["embedding"].interleaved and m.params["layers_0"]["mlp"]["w_up"].interleaved
    assert attention_impl(m.config) == "cpu"
    return m


# (length, cached prefix) of each row of a batch: rows ending in each kind of call (every row's
# chunk together while more than half have chunks left, rows done reading their last chunk
# again; then one row a call), a row of 1 token, a row of 1 token past its prefix, and a
# last chunk moved back to end at the width (120 is not a multiple of the chunk, 32).
ROWS = [(90, 0), (120, 32), (70, 0), (65, 64), (33, 0), (1, 0)]
WIDTH, CACHE_LEN = 120, 128


def _prefill_fn(m, batched):
    return jax.jit(
        lambda tokens, lens, starts, cache: row_prefill.prefill_rows(
            m.config, m.params, tokens, lens, cache, row_prefill.PREFILL_CHUNK, True, starts, batched=batched
        )
    )


def _alone_and_batched(m, batched=True):
    """Each row of ROWS prefilled alone from position 0, and all of them in one batch, each from
    the end of its cached prefix (its entries there copied from its alone prefill, as the prefix
    cache's blocks are): (alone outputs, batched output)."""
    run = _prefill_fn(m, batched)
    tokens, lens = _prompts([n for n, _ in ROWS], WIDTH, seed=1)
    starts = np.array([s for _, s in ROWS], np.int32)
    one = jnp.zeros((1,), jnp.int32)
    alone = [
        run(
            jnp.asarray(tokens[r : r + 1]),
            jnp.asarray(lens[r : r + 1]),
            one,
            init_cache(m.config, 1, CACHE_LEN),
        )
        for r in range(len(ROWS))
    ]
    cache = init_cache(m.config, len(ROWS), CACHE_LEN)
    for r, (_, s) in enumerate(ROWS):
        cache = cache.replace(
            k=cache.k.at[:, r, :s].set(alone[r].cache.k[:, 0, :s]),
            v=cache.v.at[:, r, :s].set(alone[r].cache.v[:, 0, :s]),
        )
    return alone, run(jnp.asarray(tokens), jnp.asarray(lens), jnp.asarray(starts), cache)


def _assert_rows_equal(alone, batched):
    for r, (n, s) in enumerate(ROWS):
        np.testing.assert_array_equal(np.asarray(batched.logits[r]), np.asarray(alone[r].logits[0]))
        for a, b in ((batched.cache.k, alone[r].cache.k), (batched.cache.v, alone[r].cache.v)):
            np.testing.assert_array_equal(np.asarray(a[:, r, :n]), np.asarray(b[:, 0, :n]))
        np.testing.assert_array_equal(
            np.asarray(batched.features[r, s:n]), np.asarray(alone[r].features[0, s:n])
        )


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("precision", ["int8", "gguf_q8"])
def test_a_row_is_the_same_bits_alone_or_batched_with_other_lengths_and_prefixes(
    model, gguf_model, precision, batched
):
    """The engine's promise (a request's output does not depend on what else runs; the prefix
    cache's rows are a fresh prefill's bits): a row's logits, cache entries below its length and
    features are the same bits prefilled alone from position 0 as in a batch of rows of other
    lengths, each read from the end of its own cached prefix, on the int8 kernel and on the GGUF
    kernels (Q4_K), in batched calls ([B, chunk]) and one row a call (decode.prefill's)."""
    _assert_rows_equal(*_alone_and_batched(model if precision == "int8" else gguf_model, batched))


def test_the_bit_identity_check_catches_a_batched_prefill_leaking_positions(gguf_model, monkeypatch):
    """The check above is not vacuous: a batched call whose rows share the first row's positions
    (each row's own start past its cached prefix lost) gives other bits. (A head whose rows are
    not padded to gemm's groups of 4, GEMM_ROWS = 1, fails only where the products take ggml's
    gemm: a build without the multi-row kernels, not the AVX-512 VNNI Xeon these tests ran on.)"""
    real = row_prefill.forward

    def shared(config, params, tokens, positions, cache, **kwargs):
        return real(config, params, tokens, jnp.broadcast_to(positions[:1], positions.shape), cache, **kwargs)

    monkeypatch.setattr(row_prefill, "forward", shared)
    with pytest.raises(AssertionError):
        _assert_rows_equal(*_alone_and_batched(gguf_model))
