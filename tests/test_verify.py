"""The rejection rule on its own: the first committed token is distributed exactly as p."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from spec_jax.sampling import draw, draw_rows, row_keys
from spec_jax.verify import overlap, verify

V = 6
N = 200_000


def random_dists(key, shape, sharp=1.5):
    return jax.nn.softmax(sharp * jax.random.normal(key, (*shape, V)), axis=-1)


def keys(seed, rows):
    """[rows] per-row keys, as the loops pass them."""
    return row_keys(jax.random.key(seed), jnp.arange(rows))


def always_accept(drafts, q, p, keys_b):
    """A deliberately broken rule: accepts every draft."""
    gamma = drafts.shape[1]
    return jnp.full(drafts.shape[:1], gamma, jnp.int32), draw_rows(keys_b, p[:, gamma])


def residual_from_p(drafts, q, p, keys_b):
    """A deliberately broken rule: correct acceptance, but resamples from p instead of max(0, p - q)."""
    n, _ = verify(drafts, q, p, keys_b)
    fresh_keys = jax.vmap(lambda k: jax.random.fold_in(k, 1))(keys_b)
    return n, draw_rows(fresh_keys, jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0])


def first_committed_token(rule, gamma, seed):
    """Monte Carlo over N independent rounds sharing one (p, q): returns (counts [V], p_0)."""
    kp, kq, kx, kv = jax.random.split(jax.random.key(seed), 4)
    p = random_dists(kp, (1, gamma + 1))
    q = random_dists(kq, (1, gamma))
    p_n, q_n = jnp.broadcast_to(p, (N, gamma + 1, V)), jnp.broadcast_to(q, (N, gamma, V))
    drafts = jax.vmap(draw)(jax.random.split(kx, N * gamma), q_n.reshape(-1, V)).reshape(N, gamma)
    n, nxt = jax.jit(rule)(drafts, q_n, p_n, row_keys(kv, jnp.arange(N)))
    first = jnp.where(n > 0, drafts[:, 0], nxt)
    return np.bincount(np.asarray(first), minlength=V), np.asarray(p[0, 0])


def chi2_pvalue(counts, probs):
    probs = np.asarray(probs, np.float64)
    return stats.chisquare(counts, probs / probs.sum() * counts.sum()).pvalue


@pytest.mark.parametrize("gamma, seed", [(1, 0), pytest.param(3, 1, marks=pytest.mark.slow), (5, 2)])
def test_first_committed_token_is_distributed_as_p(gamma, seed):
    counts, p0 = first_committed_token(verify, gamma, seed)
    assert chi2_pvalue(counts, p0) > 1e-3


@pytest.mark.parametrize("broken", [always_accept, residual_from_p])
def test_broken_rules_fail_the_same_test(broken):
    counts, p0 = first_committed_token(broken, 3, 1)
    assert chi2_pvalue(counts, p0) < 1e-6


def test_greedy_one_hot_distributions_give_exact_greedy_verification():
    """At temperature 0 both p and q are one-hot: accept while the draft is the target argmax."""
    target = jnp.array([[3, 1, 4, 1]])  # target argmax at positions 0..3 (position 3 is the bonus)
    drafts = jnp.array([[3, 1, 5]])
    p = jax.nn.one_hot(target, V)
    q = jax.nn.one_hot(drafts, V)
    n, nxt = verify(drafts, q, p, keys(0, drafts.shape[0]))
    assert int(n[0]) == 2 and int(nxt[0]) == 4
    n, nxt = verify(target[:, :3], jax.nn.one_hot(target[:, :3], V), p, keys(0, 1))
    assert int(n[0]) == 3 and int(nxt[0]) == 1  # all accepted: the bonus token


def test_identical_distributions_accept_everything_and_never_nan():
    p = random_dists(jax.random.key(5), (64, 4))
    drafts = jax.vmap(draw)(jax.random.split(jax.random.key(6), 64 * 3), p[:, :3].reshape(-1, V)).reshape(
        64, 3
    )
    n, nxt = verify(drafts, p[:, :3], p, keys(7, drafts.shape[0]))
    np.testing.assert_array_equal(n, 3)
    assert np.all((np.asarray(nxt) >= 0) & (np.asarray(nxt) < V))


def test_overlap_is_one_minus_total_variation():
    p = random_dists(jax.random.key(8), (2, 3))
    q = random_dists(jax.random.key(9), (2, 3))
    tv = 0.5 * jnp.abs(p - q).sum(-1)
    np.testing.assert_allclose(overlap(p, q), 1 - tv, atol=1e-6)
