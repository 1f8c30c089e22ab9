"""The token-tree rule (spec_jax.tree): the chain case is Leviathan et al.'s rule draw for draw,
greedy takes the argmax path, and at temperature 1 the committed tokens follow the target's
distribution whether the children are i.i.d. samples or point masses; the broken variants
(a rejected sibling leaving r unchanged) fail the same chi-square test."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from spec_jax import tree as tree_lib
from spec_jax.sampling import draw_rows, split_rows
from spec_jax.tree import ROOT, Tree, ancestors, chain, depths, verify_tree

V = 5


def random_dists(rng, *shape, sharp=1.0):
    logits = sharp * rng.standard_normal((*shape, V))
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)).astype(np.float32)


def leviathan_chain_rule(draft_tokens_bg, q_bgv, p_bgv, keys_b):
    """Leviathan et al.'s Algorithm 1 written out for a batch of chains (what spec_jax.verify
    computed before it called the tree rule): accept while u < p/q, then draw from
    norm(max(p - q, 0)) at the first rejection, or from p after the last draft."""
    gamma = draft_tokens_bg.shape[1]
    q, p = q_bgv.astype(jnp.float32), p_bgv.astype(jnp.float32)
    uniform_keys, residual_keys = split_rows(keys_b, 2)
    u = jax.vmap(lambda k: jax.random.uniform(k, (gamma,)))(uniform_keys)
    p_x = jnp.take_along_axis(p[:, :gamma], draft_tokens_bg[..., None], axis=-1)[..., 0]
    q_x = jnp.take_along_axis(q, draft_tokens_bg[..., None], axis=-1)[..., 0]
    accepted = (u * q_x < p_x) & (q_x > 0)
    num_accepted = jnp.sum(jnp.cumprod(accepted, axis=1), axis=1).astype(jnp.int32)
    q_ext = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)
    p_at = jnp.take_along_axis(p, num_accepted[:, None, None], axis=1)[:, 0]
    q_at = jnp.take_along_axis(q_ext, num_accepted[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(p_at - q_at, 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    residual = jnp.where(mass > 1e-12, residual / jnp.maximum(mass, 1e-30), p_at)
    return num_accepted, draw_rows(residual_keys, residual)


def test_a_chain_is_the_chain_rule_draw_for_draw():
    """verify_tree on chain(...) gives spec_jax.verify's accepted count and next token from the
    same keys, including rows that proposed fewer drafts (q = 0 past them)."""
    rng = np.random.default_rng(0)
    b, g = 512, 4
    q = random_dists(rng, b, g)
    p = random_dists(rng, b, g + 1)
    tokens = np.array(
        [[rng.choice(V, p=q[i, j] / q[i, j].sum()) for j in range(g)] for i in range(b)], np.int32
    )
    short = rng.integers(0, g + 1, b)  # rows proposing fewer drafts
    q = np.where(np.arange(g)[None, :, None] < short[:, None, None], q, 0.0).astype(np.float32)
    keys = jax.random.split(jax.random.key(1), b)
    accepted, nxt = leviathan_chain_rule(jnp.asarray(tokens), jnp.asarray(q), jnp.asarray(p), keys)
    path, length, nxt_tree = verify_tree(chain(jnp.asarray(tokens), jnp.asarray(q)), jnp.asarray(p), keys)
    np.testing.assert_array_equal(length, accepted)
    np.testing.assert_array_equal(nxt_tree, nxt)
    expected_path = np.where(np.arange(g)[None] < np.asarray(accepted)[:, None], np.arange(g)[None], ROOT)
    np.testing.assert_array_equal(path, expected_path)
    assert 0 < np.mean(np.asarray(accepted)) < g  # both outcomes occur


def onehot(i, v=V):
    return np.eye(v, dtype=np.float32)[i]


def test_depths_and_ancestors_of_a_branching_tree():
    #      root
    #     /    \
    #    0      1
    #   / \      \
    #  2   3      4
    parents = jnp.asarray([[ROOT, ROOT, 0, 0, 1]], jnp.int32)
    np.testing.assert_array_equal(depths(parents)[0], [1, 1, 2, 2, 2])
    anc = np.asarray(ancestors(parents)[0])
    assert anc[3].tolist() == [True, False, False, True, False]
    assert anc[4].tolist() == [False, True, False, False, True]
    assert anc[0].tolist() == [True, False, False, False, False]


def test_greedy_takes_the_argmax_path_in_any_branch():
    """p a point mass: the accepted path is the branch whose tokens are the argmaxes, wherever
    it sits among the siblings, then the target's own next token."""
    # Candidates: root children 0 (token 1), 1 (token 3); node 2 (token 4) under 1, node 3
    # (token 0) under 1, node 4 (token 2) under 0. The target's argmax: 3 at the root, then 0
    # after 3, then 2 after (3, 0).
    tokens = jnp.asarray([[1, 3, 4, 0, 2]], jnp.int32)
    parents = jnp.asarray([[ROOT, ROOT, 1, 1, 0]], jnp.int32)
    q = jnp.asarray([[onehot(1), onehot(3), onehot(4), onehot(0), onehot(2)]])
    # p[0] after the root, p[1 + n] after node n.
    p = jnp.asarray([[onehot(3), onehot(0), onehot(0), onehot(1), onehot(2), onehot(4)]])
    path, length, nxt = verify_tree(Tree(tokens, parents, q), p, jax.random.split(jax.random.key(0), 1))
    assert int(length[0]) == 2 and path[0, :2].tolist() == [1, 3]
    assert int(nxt[0]) == 2  # the target's argmax after node 3


# The chi-square harness: a target whose next-token distribution depends on the previous token
# only (P0 at the root, P1[x] after x), the committed tokens' first two positions compared with
# the exact joint P0(x1) P1[x1](x2) over many independent rows.


def committed_pairs(tree: Tree, p0, p1, seed):
    """The first two tokens of each row's text: what the round commits, completed (where it
    commits one token) by a draw from the target, as the next round would."""
    b, n = tree.tokens.shape
    p = jnp.concatenate([jnp.broadcast_to(p0, (b, 1, V)), jnp.asarray(p1)[tree.tokens]], axis=1)
    path, length, nxt = verify_tree(tree, p, jax.random.split(jax.random.key(seed), b))
    path, length, nxt = np.asarray(path), np.asarray(length), np.asarray(nxt)
    toks = np.asarray(tree.tokens)
    rng = np.random.default_rng(seed)
    committed = np.full((b, 2), -1)
    for i in range(b):
        seq = [int(toks[i, j]) for j in path[i, : length[i]]] + [int(nxt[i])]
        if len(seq) == 1:
            seq.append(int(rng.choice(V, p=p1[seq[0]] / p1[seq[0]].sum())))
        committed[i] = seq[:2]
    return committed


def chi2_pvalue(pairs, p0, p1):
    assert (pairs >= 0).all()
    counts = np.zeros((V, V))
    np.add.at(counts, (pairs[:, 0], pairs[:, 1]), 1)
    joint = (p0[:, None] * p1).astype(np.float64)
    expected = joint / joint.sum() * len(pairs)  # float32 sums miss 1 by more than scipy allows
    return stats.chisquare(counts.ravel(), expected.ravel()).pvalue


def two_level_tree(rng, b, q0, q1, kind):
    """Per row: two root children and one child under each. "iid": every child drawn from its
    parent's draft distribution (q0 at the root, q1[x] under x). "points": the root's children
    are q0's top two tokens as point masses, their children q1's argmax as point masses.
    "spine" (the draft model's trees at temperature > 0): the first root child and its child
    drawn from q (a chain), the second root child q0's most probable token other than the
    drawn one (a point mass that depends on its earlier sibling), its child q1's argmax."""
    if kind in ("iid", "without_replacement"):
        c = np.array([rng.choice(V, 2, p=q0, replace=kind == "iid") for _ in range(b)])
        g = np.array([[rng.choice(V, p=q1[c[i, k]]) for k in range(2)] for i in range(b)])
        q = np.stack(
            [np.broadcast_to(q0, (b, V)), np.broadcast_to(q0, (b, V)), q1[c[:, 0]], q1[c[:, 1]]], axis=1
        )
    elif kind in ("spine", "spine_kept_by_score"):
        first = rng.choice(V, b, p=q0)
        others = np.where(np.arange(V)[None, :] == first[:, None], -1.0, q0[None, :])
        c = np.stack([first, np.argmax(others, axis=1)], axis=1)
        g = np.stack([[rng.choice(V, p=q1[x]) for x in first], np.argmax(q1[c[:, 1]], axis=-1)], axis=1)
        q = np.stack([np.broadcast_to(q0, (b, V)), onehot(c[:, 1]), q1[c[:, 0]], onehot(g[:, 1])], axis=1)
        if kind == "spine_kept_by_score":  # the drawn child (and its child) kept only if likely
            q[:, [0, 2]] *= (q0[first] >= np.median(q0))[:, None, None]
    else:
        top = np.argsort(-q0)[:2]
        c = np.broadcast_to(top, (b, 2))
        g = np.argmax(q1[c], axis=-1)
        q = np.stack([onehot(c[:, 0]), onehot(c[:, 1]), onehot(g[:, 0]), onehot(g[:, 1])], axis=1)
    tokens = np.stack([c[:, 0], c[:, 1], g[:, 0], g[:, 1]], axis=1).astype(np.int32)
    parents = np.broadcast_to(np.array([ROOT, ROOT, 0, 1], np.int32), (b, 4))
    return Tree(jnp.asarray(tokens), jnp.asarray(parents), jnp.asarray(q, jnp.float32))


@pytest.fixture(scope="module")
def dists():
    rng = np.random.default_rng(3)
    p0, q0 = random_dists(rng, sharp=1.5), random_dists(rng, sharp=1.5)
    p1, q1 = random_dists(rng, V, sharp=1.5), random_dists(rng, V, sharp=1.5)
    return p0, p1, q0, q1


@pytest.mark.parametrize("kind", ["iid", "points", "spine"])
def test_a_tree_round_commits_samples_of_the_target(dists, kind):
    p0, p1, q0, q1 = dists
    rng = np.random.default_rng(4)
    pairs = committed_pairs(two_level_tree(rng, 20000, q0, q1, kind), p0, p1, seed=5)
    assert chi2_pvalue(pairs, p0, p1) > 1e-3


@pytest.mark.parametrize("kind", ["iid", "points"])
def test_a_rejected_sibling_that_leaves_r_unchanged_fails(dists, kind, monkeypatch):
    """The broken rule: after a rejected child the next sibling is tried against the same r
    (no residual), so tokens tried twice are over-represented."""
    p0, p1, q0, q1 = dists
    real = tree_lib._residual
    monkeypatch.setattr(tree_lib, "_residual", lambda r, q: real(r, jnp.zeros_like(q)))
    rng = np.random.default_rng(4)
    pairs = committed_pairs(two_level_tree(rng, 20000, q0, q1, kind), p0, p1, seed=5)
    assert chi2_pvalue(pairs, p0, p1) < 1e-6


def test_siblings_drawn_without_replacement_are_not_exact_under_this_rule(dists):
    """What the module docstring warns about: distinct siblings sampled from one q (without
    replacement) break the independence the proof needs; a drafter proposes such siblings as
    point masses instead."""
    p0, p1, q0, q1 = dists
    rng = np.random.default_rng(4)
    pairs = committed_pairs(two_level_tree(rng, 20000, q0, q1, "without_replacement"), p0, p1, seed=5)
    assert chi2_pvalue(pairs, p0, p1) < 1e-6


def test_a_drawn_child_kept_only_when_its_token_scores_well_is_not_exact():
    """Why the draft model's spine is in every tree whatever it drew (ModelDrafter's docstring):
    a drawn child whose presence depends on its own token is no longer a draw from q. Flatter
    distributions than the fixture's (whose q is nearly a point mass, so that whether the drawn
    child is kept hardly matters): there the spine that is always kept stays exact."""
    rng = np.random.default_rng(4)
    p0, q0 = random_dists(rng), random_dists(rng)
    p1, q1 = random_dists(rng, V), random_dists(rng, V)
    for kind, exact in [("spine", True), ("spine_kept_by_score", False)]:
        tree = two_level_tree(np.random.default_rng(5), 20000, q0, q1, kind)
        pvalue = chi2_pvalue(committed_pairs(tree, p0, p1, seed=6), p0, p1)
        assert pvalue > 1e-3 if exact else pvalue < 1e-6, (kind, pvalue)
