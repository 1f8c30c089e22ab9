"""Tree rounds in the compiled loop (spec_jax.rounds.tree_round): one target call scores a
token tree per row with the tree mask, verify_tree keeps a path, the path's keys and values move
to where a chain's would be (tree.compact), and the output is exactly the target's."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import apply
from test_distribution import WARPS, V, chi2_pvalue, exact_joint, pair, sample_counts  # noqa: F401

import models
import spec_jax
from spec_jax import executables
from spec_jax import tree as tree_lib
from spec_jax.api import run
from spec_jax.drafting.base import Drafter, TreeProposal
from spec_jax.drafting.model import ModelDrafter

PROMPTS = [[5, 9, 2], [1], [7, 7, 3, 8, 11, 4, 6, 2, 9, 10], [3, 3, 3, 1, 2, 60]]
NEW = 20


@pytest.fixture(scope="module")
def xla_target(tiny_target):
    """The tiny target on its default attention: the CPU kernel, each query's keys gathered in
    slot order (XLA's reference with a tree: tests/test_tree_attention.py)."""
    return tiny_target


@pytest.fixture(scope="module")
def plain(xla_target):
    return spec_jax.generate(xla_target, PROMPTS, max_new_tokens=NEW, temperature=0.0)


@dataclasses.dataclass(frozen=True)
class OracleTreeDrafter(Drafter):
    """Knows each row's greedy text (the state: prompt + plain decoding's tokens [B, S]) and
    proposes, at every depth, a wrong sibling first and then the right token, the right one's
    children continuing; row b's right tokens turn wrong after depth_b[b] levels (a ragged
    batch: rows accept paths of different depths, always through the second branch)."""

    vocab_size: int
    levels: int
    depths: tuple

    def propose(self, params, state, context_b2, length_b, gamma, sampling, keys_b):
        raise NotImplementedError("tree rounds only")

    def propose_tree(self, params, state, context_b2, length_b, nodes, sampling, keys_b):
        b = length_b.shape[0]
        d = jnp.arange(self.levels)
        right = jnp.take_along_axis(state, jnp.minimum(length_b[:, None] + d, state.shape[1] - 1), axis=1)
        wrong = (right + 1) % self.vocab_size
        right = jnp.where(d[None] < jnp.asarray(self.depths)[:, None], right, (right + 2) % self.vocab_size)
        # Slots: level i holds [wrong (slot 2i), right (slot 2i + 1)], both children of the
        # previous level's right node (slot 2i - 1), the root for level 0.
        tokens = jnp.stack([wrong, right], axis=2).reshape(b, 2 * self.levels)
        parent = jnp.repeat(2 * d - 1, 2)
        tokens = jnp.pad(tokens, ((0, 0), (0, nodes - 2 * self.levels)))
        parents = jnp.pad(
            jnp.broadcast_to(parent, (b, 2 * self.levels)),
            ((0, 0), (0, nodes - 2 * self.levels)),
            constant_values=-1,
        )
        q = jax.nn.one_hot(tokens, self.vocab_size) * (jnp.arange(nodes) < 2 * self.levels)[None, :, None]
        return TreeProposal(tree_lib.Tree(tokens.astype(jnp.int32), parents.astype(jnp.int32), q), state)

    @property
    def sources(self):
        return ("oracle",)


@dataclasses.dataclass(frozen=True)
class OracleWithText(OracleTreeDrafter):
    """The oracle whose params are the greedy text, its state from init on."""

    def init(self, params, tokens_bp, prompt_lens_b, cache_len, features_bpd=None):
        return params


def oracle(model, plain_gen, levels=4, depths=(4, 2, 0, 3)):
    """(drafter, params): the oracle of plain_gen's text."""
    s = max(len(p) for p in PROMPTS) + NEW + 16
    text = np.zeros((len(PROMPTS), s), np.int32)
    for i, (p, t) in enumerate(zip(PROMPTS, plain_gen.tokens, strict=True)):
        text[i, : len(p) + len(t)] = p + t
    return OracleWithText(model.config.vocab_size, levels, depths), jnp.asarray(text)


def run_oracle(model, plain_gen, nodes=8):
    return spec_jax.generate(
        model, PROMPTS, draft=oracle(model, plain_gen), tree=nodes, max_new_tokens=NEW, temperature=0.0
    )


def test_greedy_tree_rounds_through_second_branches_equal_plain_decoding(xla_target, plain):
    gen = run_oracle(xla_target, plain)
    assert gen.tokens == plain.tokens
    # Rows accepted paths of different depths: 4, 2, 0, 3 right levels each round (until the end).
    assert gen.stats["accepted_histogram"][0] > 0 and gen.stats["accepted_histogram"][4] > 0
    assert gen.stats["num_draft_tokens"] == 8 * gen.stats["num_rounds"]


def _causal_bits(last, tree, length, real=tree_lib.call_inputs):
    tokens, positions, bits = real(last, tree, length)
    t = bits.shape[1]
    return tokens, positions, jnp.broadcast_to((2 ** (jnp.arange(t) + 1) - 1).astype(jnp.int32), bits.shape)


def _slot_positions(last, tree, length, real=tree_lib.call_inputs):
    tokens, positions, bits = real(last, tree, length)
    return tokens, positions[:, :1] + jnp.arange(positions.shape[1])[None], bits


BROKEN = {
    # the accepted nodes' keys left in their tree slots
    "no_compaction": ("compact", lambda cache, *a: cache),
    # the chain's causal mask on a tree: each node also reads its earlier siblings
    "causal_mask": ("call_inputs", _causal_bits),
    # each node rotated at its slot's position instead of its depth's
    "slot_positions": ("call_inputs", _slot_positions),
}


@pytest.mark.parametrize("broken", list(BROKEN))
def test_a_broken_tree_call_changes_the_greedy_output(xla_target, plain, monkeypatch, broken):
    name, fn = BROKEN[broken]
    monkeypatch.setattr(tree_lib, name, fn)
    monkeypatch.setattr(executables, "_EXECUTABLES", {})
    gen = run_oracle(xla_target, plain)
    assert gen.tokens != plain.tokens


def test_after_a_round_the_cache_holds_the_committed_text_where_plain_decoding_has_it(xla_target, plain):
    """The target cache after tree rounds equals a prefill of the committed text, slot by slot,
    below each row's committed length minus one (the last token is in no cache yet)."""
    state, _ = run(
        xla_target, PROMPTS, draft=oracle(xla_target, plain), tree=8, max_new_tokens=NEW, temperature=0.0
    )
    length = np.asarray(state.length)
    cache = state.target_cache
    # One prefill of every row's committed text, padded to the longest: slots below a row's
    # length hold only its own text's keys and values (causal), whatever the padding after it.
    width = int(length.max())
    texts = [(list(p) + plain.tokens[b] + [0] * width)[:width] for b, p in enumerate(PROMPTS)]
    fresh = models.init_cache(xla_target.config, len(PROMPTS), cache.max_len)
    positions = jnp.broadcast_to(jnp.arange(width), (len(PROMPTS), width))
    ref = apply(xla_target, jnp.asarray(texts), positions, fresh).cache
    for b in range(len(PROMPTS)):
        n = int(length[b]) - 1
        np.testing.assert_allclose(np.asarray(cache.k[:, b, :n]), np.asarray(ref.k[:, b, :n]), atol=1e-5)
        np.testing.assert_allclose(np.asarray(cache.v[:, b, :n]), np.asarray(ref.v[:, b, :n]), atol=1e-5)


def test_the_default_tree_of_a_chain_drafter_is_the_chain_draw_for_draw(tiny_target, tiny_draft):
    """A drafter's default propose_tree is its chain: sampling, tree rounds give the chain
    rounds' tokens and metrics (the same keys, the same rule), on the default attention (the CPU
    kernel, whose verification rows are decode steps' bits). Greedy trees: the oracle tests."""
    nodes, temperature = 3, 1.0
    # tree_width 0: the model drafter without its own tree (spec_jax.drafting.model)
    draft = ModelDrafter(tiny_draft.config, tree_width=0), tiny_draft.params
    kw = dict(draft=draft, max_new_tokens=NEW, temperature=temperature, seed=3)
    chain = spec_jax.generate(tiny_target, PROMPTS, gamma=nodes, **kw)
    tree = spec_jax.generate(tiny_target, PROMPTS, tree=nodes, **kw)
    assert tree.tokens == chain.tokens
    for key in ("num_rounds", "num_draft_tokens", "num_accepted_tokens", "accepted_histogram", "alpha_hat"):
        assert tree.stats[key] == pytest.approx(chain.stats[key]), key


@dataclasses.dataclass(frozen=True)
class FixedTreeDrafter(Drafter):
    """A context-free tree for the distribution test: the root's children are two i.i.d. draws
    from a fixed q0 and a point mass at token 3; each has one child drawn from q0. The three
    kinds of candidate the rule takes, at one parent."""

    vocab_size: int
    q0: tuple

    def propose(self, params, state, context_b2, length_b, gamma, sampling, keys_b):
        raise NotImplementedError

    def propose_tree(self, params, state, context_b2, length_b, nodes, sampling, keys_b):
        b = length_b.shape[0]
        q0 = jnp.asarray(self.q0, jnp.float32)
        draws = jax.vmap(lambda k: jax.random.categorical(k, jnp.log(q0), shape=(5,)))(keys_b)  # [B, 5]
        tokens = jnp.stack(
            [draws[:, 0], draws[:, 1], jnp.full((b,), 3), draws[:, 2], draws[:, 3], draws[:, 4]], 1
        )
        parents = jnp.broadcast_to(jnp.asarray([-1, -1, -1, 0, 1, 2]), (b, 6))
        q = jnp.broadcast_to(q0, (b, 6, self.vocab_size))
        q = q.at[:, 2].set(jax.nn.one_hot(3, self.vocab_size))
        return TreeProposal(tree_lib.Tree(tokens.astype(jnp.int32), parents.astype(jnp.int32), q), state)


def tree_counts(target, sampling, seed):
    q0 = np.random.default_rng(5).dirichlet(np.ones(V)).round(6)
    drafter = FixedTreeDrafter(V, tuple(q0 / np.sum(q0)))
    return sample_counts(target, (drafter, ()), sampling, 6, seed, tree=6)


@pytest.mark.parametrize("sampling", WARPS, ids=["t1", "top_k3", "t0.8_top_p0.8"])
def test_tree_rounds_sample_the_targets_distribution_exactly(pair, sampling):  # noqa: F811
    target = pair[0]
    counts, stats = tree_counts(target, sampling, seed=0)
    assert 1.2 < stats["mean_accepted_length"] < 2.9, "some paths accepted, some not"
    assert chi2_pvalue(counts, exact_joint(target, sampling)) > 1e-3


def test_tree_rounds_reading_each_nodes_continuation_from_its_parents_query_fail(pair, monkeypatch):  # noqa: F811
    """The broken variant: an off-by-one between the call's queries and the tree's slots."""
    target = pair[0]
    real = tree_lib.verify_tree

    def shifted(tree, p, keys):
        return real(tree, jnp.concatenate([p[:, :1], p[:, :-1]], axis=1), keys)

    monkeypatch.setattr(tree_lib, "verify_tree", shifted)
    monkeypatch.setattr(executables, "_EXECUTABLES", {})
    counts, _ = tree_counts(target, WARPS[0], seed=0)
    assert chi2_pvalue(counts, exact_joint(target, WARPS[0])) < 1e-6
