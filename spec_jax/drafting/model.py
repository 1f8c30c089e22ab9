"""A draft model (ModelDrafter): a small transformer drafting autoregressively from its own KV
cache, over the whole vocabulary or, vocabulary-trimmed (VocabTrim, `trim_vocabulary`), over a
subset of it; in tree rounds, a dynamic token tree (EAGLE-2, Li et al. 2024) read through the
tree mask (ModelDrafter.propose_tree)."""

import dataclasses
import functools
from typing import Any, ClassVar

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from models import precision
from models.config import ModelConfig
from models.transformer import forward, init_cache, output_head
from spec_jax import sharding
from spec_jax import tree as tree_lib
from spec_jax.decode import prefill
from spec_jax.drafting.base import Drafter, Proposal, TimedCall, TreeProposal
from spec_jax.drafting.dynamic_tree import DynamicTree
from spec_jax.sampling import draw_rows, split_rows, warp


@flax.struct.dataclass
class TrimmedHead:
    """The rows of a draft model's output head for a subset of the vocabulary (VocabTrim)."""

    weight: Any  # [R, D], the head's rows for these tokens (any precision: Int8Weight too)
    ids: jax.Array  # int32 [R], their token ids


@flax.struct.dataclass
class TrimmedDraftParams:
    model: Any  # the draft model's parameters
    head: TrimmedHead


@flax.struct.dataclass
class TreeDraft:
    """ModelDrafter's state between propose_tree and accepted (the loop carries the cache): the
    draft cache after the tree calls and, per tree slot, its expanded index e (the last tree
    call wrote the node at slot length + e; -1: never expanded)."""

    cache: Any  # models.cache.KVCache
    expanded: jax.Array  # int32 [B, N]


def on_ids(probs, ids, vocab_size: int):
    """[..., V]: probabilities over a trimmed head's R tokens ([..., R], ids [R]) as the whole
    vocabulary of vocab_size, zero off the ids."""
    zeros = jnp.zeros(probs.shape[:-1] + (vocab_size,), probs.dtype)
    return zeros.at[..., ids].set(probs)


@dataclasses.dataclass(frozen=True)
class ModelDrafter(DynamicTree, Drafter):
    """A small transformer drafting autoregressively from its own KV cache.

    trimmed: the params are TrimmedDraftParams and the draft's distribution lives on the
    head's R tokens (VocabTrim, `trim_vocabulary`): each step multiplies by an [R, D] head
    instead of [V, D], and q is 0 on every other token. The rejection rule stays exact for any
    q the drafts are sampled from, this one included: tokens off the set are never proposed,
    and the target's residual max(0, p - q) keeps their whole probability.

    threshold: a per-row adaptive draft length (the `p-min` of HF and llama.cpp). A row stops
    proposing at the first position where the draft's confidence, its top probability before
    the warp (at temperature 1, so that greedy decoding has one too), is below threshold;
    0 proposes all gamma. The stop reads the draft's own distribution only, so the output
    stays exact.

    vocab: the target's vocabulary size where the draft's is a strict prefix of it (checked by
    models.tokenizer.check_pair; 0: the draft's own). q spans the target's ids, 0 past the
    draft's own, so the rule stays exact (those ids are never proposed; the residual keeps
    their probability), and a committed id past the draft's vocabulary reads the draft's
    last embedding row (what the draft reads never changes the output's distribution).

    tree_depth (D), tree_width (K): the dynamic tree of a tree round (propose_tree, EAGLE-2):
    the root's K most probable tokens, then at each depth below D the K best-scored nodes of
    that depth expanded into their K most probable children; the tree is the N best-scored
    nodes (threshold does not prune it). At temperature > 0 the tree's main path, its spine, is
    a chain drawn from q (the chain `propose` draws with the same keys) over the first
    S = min(D, N, ceil(3N / 4)) depths (spine_nodes), in every tree whatever it drew, ranked
    before all other candidates; each spine node's other children are q's most probable other
    tokens, and every node off the spine is a point mass (the rule's proof: spec_jax.tree). A
    tree of point masses alone loses to the chain at temperature 1 (0.63-0.78x its tokens per
    call, docs/benchmarks.md): the rule accepts a top-k node with the target's probability of
    its token, a drawn one with min(1, p / q). tree_width 0: the chain of `propose` (Drafter's
    default tree). The draft's cache has K * (D - 1) slots (tree_queries) more than the loop
    asks for, so that the widest tree call fits past any committed length. The defaults
    (D = 16, K = 2: deep and narrow): a tree of N <= 16 nodes reaches as deep as the chain of N
    drafts, and costs as many draft calls (min(D, N)); at N = 8, (8, 2) measured best of (8,
    2), (6, 2) and (4, 4) for the Qwen pair on four bench prompts at temperature 0: 4.59, 4.40
    and 3.78 tokens per verify call against the chain's 4.00 (docs/benchmarks.md); a good
    draft's tree is nearly a chain with a few side branches.
    """

    config: ModelConfig
    prefill_calls: int = 1
    trimmed: bool = False
    threshold: float = 0.0
    vocab: int = 0
    tree_depth: int = 16
    tree_width: int = 2
    sources: ClassVar[tuple[str, ...]] = ("model",)
    resumable: ClassVar[bool] = True

    @property
    def variable_length(self) -> bool:
        return self.threshold > 0

    @property
    def vocab_size(self) -> int:
        return self.vocab or self.config.vocab_size

    def own_ids(self, tokens):
        """tokens clipped to the draft's own vocabulary (unchanged unless it is a prefix)."""
        return jnp.minimum(tokens, self.config.vocab_size - 1) if self.vocab else tokens

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len

    def split_params(self, params) -> tuple[Any, Any]:
        """(the model's parameters, the trimmed output head's weight [R, D] or None)."""
        return (params.model, params.head.weight) if self.trimmed else (params, None)

    def init(self, params, tokens_bp, prompt_lens_b, cache_len, features_bpd=None):
        slots = cache_len + self.tree_queries  # room for a tree call past the loop's cache
        return prefill(
            self.config, self.split_params(params)[0], self.own_ids(tokens_bp), prompt_lens_b, slots
        ).cache

    def on_target_vocab(self, params, probs):
        """[..., V]: probabilities over the draft's head ([..., V_draft], or [..., R] trimmed) as
        the target's vocabulary: zeros off the trimmed set and past a prefix vocabulary."""
        if self.trimmed:
            return on_ids(probs, params.head.ids, self.vocab_size)
        if self.vocab:
            return jnp.pad(probs, [(0, 0)] * (probs.ndim - 1) + [(0, self.vocab_size - probs.shape[-1])])
        return probs

    def distribution(self, params, tokens_bt, positions_bt, cache, sampling, logits_at=None):
        """(q [B, V] of the last scored position, confidence [B], cache): the warped draft
        distribution and the top probability of the unwarped one."""
        model_params, head = self.split_params(params)
        tokens_bt = self.own_ids(tokens_bt)
        out = forward(self.config, model_params, tokens_bt, positions_bt, cache, logits_at, head=head)
        q = self.on_target_vocab(params, warp(out.logits[:, 0], sampling))  # [B, V]
        return q, top_probability(out.logits[:, 0]), out.cache

    def propose(self, params, cache, context_b2, length_b, gamma, sampling, keys_b):
        positions = (length_b - 2)[:, None] + jnp.arange(2)[None, :]
        q0, conf0, cache = self.distribution(
            params, context_b2, positions, cache, sampling, logits_at=jnp.ones_like(length_b)[:, None]
        )
        keys = split_rows(keys_b, gamma)  # [G, B]
        x0 = draw_rows(keys[0], q0)

        def step(carry, step_keys):
            token, position, cache = carry
            q, conf, cache = self.distribution(params, token[:, None], position[:, None], cache, sampling)
            nxt = draw_rows(step_keys, q)
            return (nxt, position + 1, cache), (nxt, q, conf)

        (_, _, cache), (xs, qs, confs) = jax.lax.scan(step, (x0, length_b, cache), keys[1:])
        tokens = jnp.concatenate([x0[:, None], xs.T], axis=1)  # [B, G]
        q = jnp.concatenate([q0[:, None], jnp.swapaxes(qs, 0, 1)], axis=1)  # [B, G, V]
        if self.threshold > 0:
            confidence = jnp.concatenate([conf0[:, None], confs.T], axis=1)  # [B, G]
            keep = jnp.cumprod(confidence >= self.threshold, axis=1)
            q = q * keep[..., None].astype(q.dtype)
        return Proposal(tokens, q, cache)

    def propose_tree(self, params, cache, context_b2, length_b, nodes, sampling, keys_b):
        """EAGLE-2's dynamic tree (DynamicTree.dynamic_tree) of `nodes` slots per row.

        The draft reads t_{n-2}, t_{n-1} (the root) as `propose` does; each expansion is one
        draft call over the nodes expanded so far, at the slots length .. length + E - 1 and the
        positions of their depths (length - 1 + depth). keys_b is unused (the candidates are
        top-k). The state returned is a TreeDraft for `accepted`."""
        if not self.tree_width:
            return super().propose_tree(params, cache, context_b2, length_b, nodes, sampling, keys_b)
        model_params, head = self.split_params(params)

        def call(tokens_bt, positions_bt, cache, logits_at, tree=None):
            out = forward(
                self.config,
                model_params,
                self.own_ids(tokens_bt),
                positions_bt,
                cache,
                logits_at,
                head,
                tree=tree,
            )
            return out.logits, out.cache

        def expand(cache, tokens, parents, depths, bits, newest):
            # Expanded node e sits at slot length + e, at the position of its depth.
            return call(tokens, (length_b - 1)[:, None] + depths[None, :], cache, newest, tree=bits)

        positions = (length_b - 2)[:, None] + jnp.arange(2)[None, :]
        logits, cache = call(context_b2, positions, cache, jnp.ones_like(length_b)[:, None])
        to_vocab = functools.partial(self.on_target_vocab, params)
        tree, expanded, cache = self.dynamic_tree(logits, expand, cache, nodes, sampling, to_vocab, keys_b)
        return TreeProposal(tree, TreeDraft(cache=cache, expanded=expanded))

    def accepted(self, params, state, tree, path_bn, count_b, length_b):
        """The draft cache with the accepted path's keys and values where a chain's would be: the
        path's nodes above its last were expanded (they have a child), so the last tree call
        wrote them at length + their expanded index; they move to length + their depth - 1
        (tree.compact). The last path node and the next token are re-fed by the next round."""
        if not self.tree_width:
            return state
        moved = jnp.take_along_axis(state.expanded, jnp.maximum(path_bn, 0), axis=1)
        return tree_lib.compact(state.cache, length_b - 1, moved, jnp.maximum(count_b - 1, 0))

    def feed(self, params, cache, text_bs, start_b, stop_b, width: int):
        """The cache after reading the committed tokens text[start .. stop-1] of each row (a row
        whose start >= stop reads nothing it needs), `width` positions per call, as many calls
        as the longest gap needs (positions past stop get text padding, written past the
        length and overwritten before they are read)."""
        model_params, head = self.split_params(params)
        first = jnp.zeros((start_b.shape[0], 1), jnp.int32)  # logits of one position (unused)

        def body(carry):
            start, cache = carry
            positions = start[:, None] + jnp.arange(width)[None, :]
            tokens = jnp.take_along_axis(text_bs, jnp.clip(positions, 0, text_bs.shape[1] - 1), axis=1)
            cache = forward(
                self.config, model_params, self.own_ids(tokens), positions, cache, first, head=head
            ).cache
            return jnp.where(start < stop_b, jnp.minimum(start + width, stop_b), start), cache

        _, cache = jax.lax.while_loop(lambda c: jnp.any(c[0] < stop_b), body, (start_b, cache))
        return cache

    def resume(self, params, cache, text_bs, synced_b, length_b, width):
        # propose feeds length-2 and length-1 itself.
        return self.feed(params, cache, text_bs, synced_b, length_b - 2, width)

    def for_mesh(self, mesh):
        return dataclasses.replace(self, config=sharding.for_mesh(self.config, mesh))

    def param_shardings(self, params, mesh):
        """The model's parameters by the rule table; a trimmed head replicated."""
        if not self.trimmed:
            return sharding.param_shardings(params, mesh)
        return params.replace(
            model=sharding.param_shardings(params.model, mesh),
            head=jax.tree.map(lambda _: sharding.replicated(mesh), params.head),
        )

    def timed_call(self, params):
        """One drafting call of the model (one per draft), over its (trimmed) head's rows."""
        rows = int(params.head.ids.shape[0]) if self.trimmed else self.config.vocab_size

        def call(params, cache, positions_bw):
            model_params, head = self.split_params(params)
            tokens = jnp.ones(positions_bw.shape, jnp.int32)
            out = forward(self.config, model_params, tokens, positions_bw, cache, head=head)
            return out.logits, out.cache

        new_cache = functools.partial(init_cache, self.config)
        return TimedCall(self.config, params, call, new_cache, rows, key={"head_rows": rows})


def top_probability(logits_bv):
    """The top probability of softmax(logits), [B] float32."""
    logits = logits_bv.astype(jnp.float32)
    return 1.0 / jnp.sum(jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True)), axis=-1)


def trim_vocabulary(draft, token_ids) -> tuple[ModelDrafter, TrimmedDraftParams]:
    """(drafter, params) drafting with `draft` (a models.Model) over token_ids only (VocabTrim):
    the output head keeps those rows. token_ids: distinct ids in [0, V), e.g. the most frequent
    tokens of a corpus (spec_jax.drafting.ngram.most_frequent) plus the stop tokens."""
    ids = np.asarray(token_ids)
    vocab = draft.config.vocab_size
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"token_ids must be a non-empty list of integer token ids, got shape {ids.shape}")
    if ids.min() < 0 or ids.max() >= vocab or np.unique(ids).size != ids.size:
        raise ValueError(f"token_ids must be distinct ids in [0, {vocab})")
    ids = jnp.asarray(np.sort(ids), jnp.int32)
    weight = precision.take_rows(output_head(draft.config, draft.params), ids)
    params = TrimmedDraftParams(model=draft.params, head=TrimmedHead(weight=weight, ids=ids))
    return ModelDrafter(draft.config, trimmed=True), params
