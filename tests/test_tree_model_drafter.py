"""The draft model as a tree source (ModelDrafter.propose_tree, EAGLE-2's dynamic tree): the
draft expands its best-scored nodes through the tree mask, the tree's nodes are point masses at
its top-k tokens, and `accepted` moves the path's draft keys and values to a chain's slots."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import apply, loop_by_hand, perturbed
from test_distribution import WARPS, chi2_pvalue, exact_joint, pair, sample_counts  # noqa: F401

import models
import spec_jax
from spec_jax import executables
from spec_jax import tree as tree_lib
from spec_jax.decode import pad_prompts
from spec_jax.drafting import dynamic_tree as dynamic_tree_lib
from spec_jax.drafting.build import Settings, build
from spec_jax.drafting.model import ModelDrafter
from spec_jax.sampling import SamplingParams, row_keys

PROMPTS = [[5, 9, 2], [1], [7, 7, 3, 8, 11, 4, 6, 2, 9, 10], [3, 3, 3, 1, 2, 60]]
NEW = 20


@pytest.fixture(scope="module")
def target(tiny_target):
    return tiny_target


@pytest.fixture(scope="module")
def draft(tiny_draft):
    return tiny_draft


@pytest.fixture(scope="module")
def rough_draft(tiny_target):
    """A draft that agrees with the target less often than tiny_draft: its second choices matter."""
    return perturbed(tiny_target, 0.3, seed=7)


@pytest.fixture(scope="module")
def plain(target):
    return spec_jax.generate(target, PROMPTS, max_new_tokens=NEW, temperature=0.0)


@pytest.mark.slow  # in make test: greedy identity at 8 nodes, with ragged paths (the next test)
@pytest.mark.parametrize("nodes", [16])
def test_greedy_trees_of_the_draft_model_equal_plain_decoding(target, draft, plain, nodes):
    gen = spec_jax.generate(target, PROMPTS, draft=draft, tree=nodes, max_new_tokens=NEW, temperature=0.0)
    assert gen.tokens == plain.tokens
    assert gen.stats["num_draft_tokens"] == nodes * gen.stats["num_rounds"]


@dataclasses.dataclass(frozen=True)
class RecordingDrafter(ModelDrafter):
    """The model drafter that hands each round's tree parents, path and count to the host."""

    def accepted(self, params, state, tree, path_bn, count_b, length_b):
        jax.debug.callback(lambda *a: ROUNDS.append(a), tree.parents, path_bn, count_b, length_b)
        return super().accepted(params, state, tree, path_bn, count_b, length_b)


ROUNDS = []


def test_rows_accept_paths_of_different_depths_through_later_siblings(target, rough_draft, plain):
    """Ragged acceptance in one round, and accepted paths through a node that is not its
    parent's first child (a sibling before it in slot order was rejected)."""
    ROUNDS.clear()
    drafter = RecordingDrafter(rough_draft.config)
    gen = spec_jax.generate(
        target, PROMPTS, draft=(drafter, rough_draft.params), tree=8, max_new_tokens=NEW, temperature=0.0
    )
    assert gen.tokens == plain.tokens
    # One draft call per depth (8 of them at N = 8), after the prefill's one.
    assert gen.stats["draft_calls"] == 1 + 8 * (gen.stats["target_calls"] - 1)
    ragged = later_sibling = 0
    for parents, path, count, length in ROUNDS:
        parents, path, count = np.asarray(parents), np.asarray(path), np.asarray(count)
        live = np.asarray(length) < np.asarray([len(p) + NEW for p in PROMPTS])
        ragged += len(set(count[live])) > 1
        for b in np.flatnonzero(live):
            for node in path[b, : count[b]]:
                later_sibling += bool(np.any(parents[b, :node] == parents[b, node]))
    assert ragged > 0 and later_sibling > 0


def mean_accepted_length(target, draft, **kw):
    gen = spec_jax.generate(target, PROMPTS, draft=draft, max_new_tokens=32, temperature=0.0, **kw)
    return gen.stats["mean_accepted_length"]


@pytest.mark.parametrize("nodes", [8])
def test_a_tree_accepts_more_per_round_than_a_chain_where_the_draft_is_imperfect(target, rough_draft, nodes):
    """Against the chain of as many drafts: the same verified positions and, the tree's depth
    being min(tree_depth, N) = N, as many draft calls."""
    assert min(ModelDrafter.tree_depth, nodes) == nodes
    tree = mean_accepted_length(target, rough_draft, tree=nodes)
    chain = mean_accepted_length(target, rough_draft, gamma=nodes)
    assert tree > chain + 0.2, (tree, chain)


def tree_stepper(target, drafter, draft_params, nodes, width=16):
    """(state after prefill, step) of the greedy tree loop over PROMPTS, one round per step."""
    return loop_by_hand(target, drafter, draft_params, PROMPTS, nodes, NEW, width, tree=nodes)


@dataclasses.dataclass(frozen=True)
class UnmovedDrafter(ModelDrafter):
    """The broken variant: `accepted` leaves the path's keys and values where the expansion
    calls wrote them."""

    def accepted(self, params, state, tree, path_bn, count_b, length_b):
        return state.cache


def draft_cache_mismatches(target, drafter, draft, rounds=3, nodes=8):
    """How many (round, row) pairs of the first rounds leave a draft cache that differs from a
    fresh prefill of the committed text below n - 2 (the next round re-feeds n - 2, n - 1)."""
    state, step = tree_stepper(target, drafter, draft.params, nodes)
    mismatches, deep = 0, 0
    for _ in range(rounds):
        before = np.asarray(state.length)
        state = step(state)
        length = np.asarray(state.length)
        deep += int(np.sum(length - before >= 3))  # paths that moved nodes
        cache = state.draft_state
        text = np.zeros((len(PROMPTS), cache.max_len), np.int32)  # causal: padding reads nothing before it
        for b, p in enumerate(PROMPTS):
            text[b, : length[b]] = list(p) + list(np.asarray(state.out.tokens[b, : length[b] - len(p)]))
        positions = jnp.broadcast_to(jnp.arange(cache.max_len), text.shape)
        fresh = models.init_cache(draft.config, len(PROMPTS), cache.max_len)
        ref = apply(draft, jnp.asarray(text), positions, fresh).cache
        for b in range(len(PROMPTS)):
            n = int(length[b]) - 2
            for got, want in ((cache.k, ref.k), (cache.v, ref.v)):
                mismatches += not np.allclose(
                    np.asarray(got[:, b, :n]), np.asarray(want[:, b, :n]), atol=1e-5
                )
    assert deep > 0, "no round accepted a path of two nodes or more"
    return mismatches


def test_after_tree_rounds_the_draft_cache_holds_the_committed_text(target, draft):
    assert draft_cache_mismatches(target, ModelDrafter(draft.config), draft) == 0


def test_without_moving_the_paths_draft_entries_the_draft_cache_is_wrong(target, draft):
    """The broken variant (UnmovedDrafter): the cache then differs from the text's (later trees
    are worse; the output stays exact, since the draft only proposes)."""
    assert draft_cache_mismatches(target, UnmovedDrafter(draft.config), draft) > 0


def tree_counts(pair, sampling, seed=0):  # noqa: F811
    target, draft = pair
    return (*sample_counts(target, draft, sampling, 6, seed, tree=6), target)


# One warp here (temperature and top-p, on p and on the draft's scores): the rule's point masses
# are checked at every warp in tests/test_tree_loop.py and tests/test_tree.py.
@pytest.mark.slow  # 10,000 rows through the draft's tree; the proposal's point masses: above
@pytest.mark.parametrize("sampling", WARPS[2:], ids=["t0.8_top_p0.8"])
def test_trees_of_the_draft_model_sample_the_targets_distribution_exactly(pair, sampling):  # noqa: F811
    counts, stats, target = tree_counts(pair, sampling)
    assert stats["mean_accepted_length"] > 1.2, "some paths accepted"
    assert chi2_pvalue(counts, exact_joint(target, sampling)) > 1e-3


@pytest.mark.slow  # its cheap twin: test_node_q_of_the_drafts_distribution_is_caught_by_the_proposal_check
def test_top_k_nodes_carrying_the_drafts_q_instead_of_a_point_mass_fail(pair, monkeypatch):  # noqa: F811
    """The broken variant: the tree's nodes are the draft's top-k tokens (deterministic) but
    claim to be draws from the draft's q, so the rule's min(1, p/q) and residuals are wrong."""
    monkeypatch.setattr(dynamic_tree_lib, "node_q", lambda tokens_bn, parent_q_bnv: parent_q_bnv)
    monkeypatch.setattr(executables, "_EXECUTABLES", {})
    counts, _, target = tree_counts(pair, WARPS[0])
    assert chi2_pvalue(counts, exact_joint(target, WARPS[0])) < 1e-6


def propose_both(drafter, params, temperature, nodes=16):
    """(the tree of `nodes` slots, the chain of its spine's length) proposed from PROMPTS with
    the same keys."""
    tokens, lens = pad_prompts(PROMPTS, 16)
    cache = drafter.init(params, jnp.asarray(tokens), jnp.asarray(lens), 16 + 8)
    length = jnp.asarray(lens)
    rows = jnp.arange(len(PROMPTS))
    context = jnp.stack([jnp.asarray(tokens)[rows, length - 2], jnp.asarray(tokens)[rows, length - 1]], 1)
    sampling = SamplingParams(temperature)
    keys = row_keys(jax.random.key(0), [0, 1, 2, 3])
    tree = jax.jit(drafter.propose_tree, static_argnums=(4, 5))(
        params, cache, context, length, nodes, sampling, keys
    )
    spine = drafter.spine_nodes(nodes) if temperature else 0  # a greedy row has no spine
    chain = jax.jit(drafter.propose, static_argnums=(4, 5))(
        params, cache, context, length, max(spine, 1), sampling, keys
    )
    return jax.tree.map(np.asarray, tree.tree), jax.tree.map(np.asarray, chain), spine


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_tree_proposal_is_ancestor_closed_topological_and_siblings_are_distinct(
    target, draft, temperature
):
    """The tree's slots are topological, siblings distinct and the depth within tree_depth. At
    temperature 0 every node is a point mass at its token (the top-k candidates are
    deterministic). At temperature > 0 the first S slots are the spine, the chain `propose`
    draws with the same keys (its tokens, and its q as theirs), in every row whatever it drew
    (so that a drawn node is a draw from q: tests/test_tree.py shows what a spine kept only
    where it scores well does), and the other nodes are point masses (the chi-square tests of
    these trees, slow tier, sample 10,000 rows)."""
    tree, chain, spine = propose_both(ModelDrafter(draft.config), draft.params, temperature)
    assert np.all(tree.parents < np.arange(16)[None]), "a parent comes before its children"
    assert (spine > 0) == (temperature > 0)
    assert np.all(tree.parents[:, :spine] == np.arange(spine) - 1), "the spine in every row"
    np.testing.assert_array_equal(tree.tokens[:, :spine], chain.tokens[:, :spine])
    np.testing.assert_allclose(tree.q[:, :spine], chain.q[:, :spine], atol=1e-5)
    own = np.take_along_axis(tree.q, tree.tokens[..., None], axis=-1)[..., 0]
    rest = slice(spine, None)
    assert np.all(own[:, rest] == 1) and np.all(tree.q[:, rest].sum(-1) == 1), "a point mass at its token"
    for b in range(4):
        for parent in set(tree.parents[b]):
            children = tree.tokens[b][tree.parents[b] == parent]
            assert len(set(children)) == len(children)
    depth = np.asarray(tree_lib.depths(jnp.asarray(tree.parents)))
    assert depth.max() <= ModelDrafter.tree_depth and depth.max() > 1


@pytest.mark.parametrize(
    "settings, match",
    [
        (dict(tree_depth=0), "tree_depth"),
        (dict(tree_width=-1), "tree_width"),
        (dict(tree_width=11), "tree_width"),
    ],
)
def test_bad_tree_settings_are_refused_naming_them(target, draft, settings, match):
    with pytest.raises(ValueError, match=match):
        build("model", target, Settings(draft=draft, **settings))


def test_a_spine_ranked_by_its_score_is_caught_by_the_proposal_check(target, draft, monkeypatch):
    """The broken variant: the drawn spine ranked among the candidates by its own score (so
    whether a drawn node is in the tree depends on what it drew) fails the proposal check."""
    monkeypatch.setattr(dynamic_tree_lib, "tree_rank", lambda score, spine, depth: score)
    with pytest.raises(AssertionError, match="spine"):
        test_the_tree_proposal_is_ancestor_closed_topological_and_siblings_are_distinct(target, draft, 1.0)


def test_node_q_of_the_drafts_distribution_is_caught_by_the_proposal_check(target, draft, monkeypatch):
    """The broken variant of the proposal check: nodes claiming the draft's q (top-k tokens
    handed to the rule as if sampled) fail it at temperature 1."""
    monkeypatch.setattr(dynamic_tree_lib, "node_q", lambda tokens_bn, parent_q_bnv: parent_q_bnv)
    with pytest.raises(AssertionError, match="point mass"):
        test_the_tree_proposal_is_ancestor_closed_topological_and_siblings_are_distinct(target, draft, 1.0)
