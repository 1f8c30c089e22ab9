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
    inside the loop (one) and the loop's trip count, seen through a counting callback."""
    calls = []
    real = row_prefill.forward

    def counting(*args, **kwargs):
        jax.debug.callback(lambda: calls.append(1))
        return real(*args, **kwargs)

    monkeypatch.setattr(row_prefill, "forward", counting)
    tokens, lens = _prompts([3, 33, 17], 64)
    jax.block_until_ready(
        decode.prefill(model.config, model.params, jnp.asarray(tokens), jnp.asarray(lens), 80).logits
    )
    by_length = sum(-(-n // row_prefill.PREFILL_CHUNK) for n in (3, 33, 17))  # ceil(n / chunk) a row
    padded = 3 * -(-64 // row_prefill.PREFILL_CHUNK)  # the padded width's: these lengths tell them apart
    assert by_length < padded
    assert len(calls) == by_length


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
