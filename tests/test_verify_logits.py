"""verify_logits: the rule on raw target logits, whose greedy rows skip the vocabulary passes,
gives what verify gives on warp's one-hot p (the same tokens, the same overlap, bit for bit)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax.sampling import RowSampling, SamplingParams, row_keys, warp
from spec_jax.verify import draft_lengths, overlap, verify, verify_logits

B, G, V = 16, 4, 12


def cases(seed: int):
    """(drafts [B, G], q [B, G, V], logits [B, G + 1, V]) built to expose the edges: small integer
    logits (ties), a NaN row, drafts equal to the target's argmax for a random prefix, q one-hot
    (a greedy draft), a spread q, or zero past a row's proposed length."""
    rng = np.random.default_rng(seed)
    logits = rng.integers(-3, 3, size=(B, G + 1, V)).astype(np.float32)
    logits[0, 2, 5] = np.nan
    logits[1, 0, :] = -np.inf
    top = np.asarray(jax.vmap(lambda x: jnp.argmax(x, -1))(jnp.asarray(np.nan_to_num(logits, nan=9.0))))
    drafts = rng.integers(0, V, size=(B, G))
    for b in range(B):  # a row's drafts follow the target for a random prefix
        k = rng.integers(0, G + 1)
        drafts[b, :k] = top[b, :k]
    q = np.zeros((B, G, V), np.float32)
    for b in range(B):
        proposed = rng.integers(0, G + 1) if b % 3 == 0 else G
        for i in range(proposed):
            if b % 2:  # spread, the draft among its tokens
                q[b, i] = rng.dirichlet(np.ones(V)).astype(np.float32)
                q[b, i, drafts[b, i]] += 0.1
                q[b, i] /= q[b, i].sum()
            else:
                q[b, i, drafts[b, i]] = 1.0
    return jnp.asarray(drafts, jnp.int32), jnp.asarray(q), jnp.asarray(logits)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_verify_logits_greedy_rows_equal_verify_on_the_one_hot_p(seed):
    drafts, q, logits = cases(seed)
    greedy = SamplingParams(0.0).for_rows(B)
    keys = row_keys(jax.random.key(seed), jnp.arange(B))
    p = warp(logits, greedy)
    want_n, want_next = verify(drafts, q, p, keys)
    n, nxt, alpha = jax.jit(verify_logits)(drafts, q, logits, greedy, keys)
    np.testing.assert_array_equal(n, want_n)
    np.testing.assert_array_equal(nxt, want_next)
    np.testing.assert_array_equal(alpha, overlap(p[:, :G], q))
    assert 0 < int(jnp.sum(n)) < B * G  # the cases accept some drafts and reject others


def test_verify_logits_sampled_rows_run_the_rule_on_warped_p():
    drafts, q, logits = cases(3)
    logits = jnp.nan_to_num(logits, nan=0.0)
    mixed = RowSampling.of([SamplingParams(0.0 if b % 2 else 0.7, top_k=3 * (b % 3)) for b in range(B)])
    keys = row_keys(jax.random.key(3), jnp.arange(B))
    p = warp(logits, mixed)
    n, nxt, alpha = verify_logits(drafts, q, logits, mixed, keys)
    want_n, want_next = verify(drafts, q, p, keys)
    np.testing.assert_array_equal(n, want_n)
    np.testing.assert_array_equal(nxt, want_next)
    np.testing.assert_array_equal(alpha, overlap(p[:, :G], q))


def test_draft_lengths_read_at_the_drafts_equal_the_sums_over_the_vocabulary():
    drafts, q, _ = cases(4)
    np.testing.assert_array_equal(draft_lengths(q, drafts), draft_lengths(q))
    # A deliberately wrong draft (a token q gives nothing) reads as unproposed there.
    # A deliberately wrong first draft (a token q gives nothing: the one-hot rows, even) reads
    # as a row that proposed nothing.
    wrong = drafts.at[:, 0].set(jnp.argmin(q[:, 0], axis=-1))
    assert int(jnp.sum(draft_lengths(q, wrong)[::2])) == 0 < int(jnp.sum(draft_lengths(q)[::2]))
