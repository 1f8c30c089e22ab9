"""The one warp: temperature, top-k, top-p; and the one draw."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax.sampling import SamplingParams, argmax, draw, draw_rows, row_keys, warp

LOGITS = jax.random.normal(jax.random.key(0), (4, 50)) * 2.0


def test_temperature_zero_is_one_hot_argmax():
    probs = warp(LOGITS, SamplingParams(temperature=0.0))
    np.testing.assert_array_equal(np.argmax(probs, -1), np.argmax(LOGITS, -1))
    np.testing.assert_array_equal(probs.max(-1), 1.0)
    np.testing.assert_array_equal((probs > 0).sum(-1), 1)


def test_temperature_zero_breaks_ties_toward_the_lowest_id():
    logits = jnp.array([[0.0, 3.0, 1.0, 3.0]])
    probs = warp(logits, SamplingParams(temperature=0.0))
    np.testing.assert_array_equal(probs, [[0, 1, 0, 0]])


@pytest.mark.parametrize("k", [1, 5, 49])
def test_top_k_keeps_exactly_k_tokens_the_most_probable(k):
    probs = np.asarray(warp(LOGITS, SamplingParams(temperature=1.0, top_k=k)))
    np.testing.assert_array_equal((probs > 0).sum(-1), k)
    for row, logits in zip(probs, np.asarray(LOGITS), strict=True):
        kept = set(np.nonzero(row)[0])
        assert kept == set(np.argsort(-logits)[:k])
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-6)


def test_top_k_with_ties_still_keeps_exactly_k():
    logits = jnp.array([[1.0, 2.0, 2.0, 2.0, 0.0]])
    probs = warp(logits, SamplingParams(temperature=1.0, top_k=2))
    assert int((probs > 0).sum()) == 2


@pytest.mark.parametrize("p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_keeps_the_smallest_set_reaching_p(p):
    full = np.asarray(warp(LOGITS, SamplingParams(temperature=0.7)))
    probs = np.asarray(warp(LOGITS, SamplingParams(temperature=0.7, top_p=p)))
    for row_full, row in zip(full, probs, strict=True):
        order = np.argsort(-row_full)
        kept = np.nonzero(row)[0]
        n = len(kept)
        assert set(kept) == set(order[:n]), "kept tokens must be the most probable ones"
        assert row_full[order[:n]].sum() >= p - 1e-6, "kept mass reaches p"
        assert n == 1 or row_full[order[: n - 1]].sum() < p, "and no smaller set does"
        np.testing.assert_allclose(row[kept], row_full[kept] / row_full[kept].sum(), rtol=1e-5)
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-6)


def test_probabilities_sum_to_one_for_every_warp():
    for params in [SamplingParams(1.0), SamplingParams(0.3, 10, 0.8), SamplingParams(2.0, 0, 0.5)]:
        np.testing.assert_allclose(warp(LOGITS, params).sum(-1), 1.0, rtol=1e-6)


def test_draw_never_returns_a_zero_probability_token():
    probs = warp(jnp.tile(LOGITS[:1], (4000, 1)), SamplingParams(temperature=1.0, top_k=3))
    tokens = jax.jit(jax.vmap(draw))(jax.random.split(jax.random.key(1), 4000), probs)
    allowed = set(np.nonzero(np.asarray(probs[0]))[0])
    assert set(np.asarray(tokens).tolist()) == allowed


def test_argmax_is_numpys_first_maximum_with_ties_infinities_and_nans():
    rows = np.array(
        [[1, 3, 3, 2], [np.nan, 1, np.nan, 5], [-np.inf] * 4, [1, np.inf, np.inf, 0], [0, -1, np.nan, 7]],
        np.float32,
    )
    rows = np.concatenate([rows, np.asarray(LOGITS[:, :4])])
    np.testing.assert_array_equal(np.asarray(jax.jit(argmax)(rows)), np.argmax(rows, axis=-1))


def test_draw_rows_of_point_masses_returns_what_the_draw_returns():
    """Rows with one nonzero entry (greedy's one-hot rows, or an entry that is inf, NaN or
    negative) skip the draw's random numbers and return its result, for every key; a batch with
    one row that is not a point mass draws every row as before."""
    probs = np.zeros((5, 30), np.float32)
    for row, (col, value) in enumerate([(3, 1.0), (29, np.inf), (0, np.nan), (7, -2.0), (12, 1.0)]):
        probs[row, col] = value
    mixed = probs.copy()
    mixed[4, 20] = 0.5  # row 4: two tokens
    for seed in range(20):
        keys = row_keys(jax.random.key(seed), jnp.arange(5))
        for p in (probs, mixed):
            np.testing.assert_array_equal(
                np.asarray(jax.jit(draw_rows)(keys, p)), np.asarray(jax.vmap(draw)(keys, p))
            )


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
    ],
)
def test_bad_warp_settings_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("temperature", [1e-6, 1e-9, 1e-20, 1e-38, 1e-40, 1e-45])
def test_a_tiny_positive_temperature_is_the_argmax_and_never_nan(temperature):
    """Real logits are around 30: dividing before subtracting the maximum overflowed under jit
    (the top entry became inf, the row NaN, the draw token 0)."""
    logits = 30.0 + jax.random.normal(jax.random.key(3), (8, 64))
    probs = jax.jit(warp, static_argnums=1)(logits, SamplingParams(temperature))
    assert not np.isnan(np.asarray(probs)).any()
    np.testing.assert_array_equal(np.argmax(probs, -1), np.argmax(logits, -1))
    np.testing.assert_allclose(np.asarray(probs).max(-1), 1.0, rtol=1e-6)
    tokens = jax.jit(jax.vmap(draw))(jax.random.split(jax.random.key(4), 8), probs)
    np.testing.assert_array_equal(tokens, np.argmax(logits, -1))


def test_a_tiny_temperature_keeps_exact_ties_of_the_maximum_uniform():
    probs = warp(jnp.array([[2.0, 5.0, 5.0, 1.0]]), SamplingParams(1e-30))
    np.testing.assert_allclose(probs, [[0.0, 0.5, 0.5, 0.0]])


def _nucleus_reference(logits_row, temperature, top_p):
    """The set top-p keeps, by numpy: the smallest set of most probable tokens reaching p."""
    z = (logits_row - logits_row.max()) / temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    before = np.cumsum(probs[order]) - probs[order]
    return set(order[before < top_p].tolist())


def test_top_p_over_a_large_vocabulary_keeps_the_same_set_from_candidates_or_the_full_sort():
    """V = 4 x CANDIDATES: a peaked row's nucleus lies within the candidates (no sort of the
    vocabulary), a flat row's does not (the full sort); both keep exactly the smallest set
    reaching p, and the peaked row's probabilities are the same bits beside the flat row as alone
    (which path another row needs never changes a row's values)."""
    from spec_jax.sampling import CANDIDATES, RowSampling

    vocab = 4 * CANDIDATES
    rng = np.random.default_rng(0)
    peaked = (rng.normal(size=vocab) * 6).astype(np.float32)
    flat = (rng.normal(size=vocab) * 0.01).astype(np.float32)
    both = jnp.asarray(np.stack([peaked, flat]))
    settings = [SamplingParams(0.7, 0, 0.9), SamplingParams(1.0, 0, 0.9)]
    probs = np.asarray(jax.jit(warp)(both, RowSampling.of(settings)))
    for row, logits, s in zip(probs, (peaked, flat), settings, strict=True):
        assert set(np.nonzero(row)[0].tolist()) == _nucleus_reference(logits, s.temperature, s.top_p)
        np.testing.assert_allclose(row.sum(), 1.0, rtol=1e-5)
    alone = np.asarray(jax.jit(warp)(both[:1], RowSampling.of(settings[:1])))
    np.testing.assert_array_equal(alone[0], probs[0])
    assert len(np.nonzero(probs[1])[0]) > CANDIDATES  # the flat row needed the sort


def test_top_k_larger_than_the_candidates_keeps_exactly_k():
    from spec_jax.sampling import CANDIDATES, RowSampling

    logits = jax.random.normal(jax.random.key(5), (2, 3 * CANDIDATES))
    settings = [SamplingParams(1.0, 2 * CANDIDATES), SamplingParams(1.0, 7)]
    probs = np.asarray(jax.jit(warp)(logits, RowSampling.of(settings)))
    for row, lg, s in zip(probs, np.asarray(logits), settings, strict=True):
        assert set(np.nonzero(row)[0].tolist()) == set(np.argsort(-lg, kind="stable")[: s.top_k].tolist())
