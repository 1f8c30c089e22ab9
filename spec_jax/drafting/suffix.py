"""Suffix drafting: the continuation of the longest suffix of the text that occurred before,
in the row's own prompt + output or in a corpus, sampled from its empirical frequencies.

At each draft position the drafter takes the row's context (committed tokens and the drafts
so far) and finds the longest n <= max_ngram such that its last n tokens occurred before:
  - in the row itself: every earlier occurrence counts (spec_jax.drafting.lookup.occurrences), and the
    counts of the tokens that followed them are the distribution;
  - in a corpus: a fixed-size hashed table of n-grams (n = 1 .. max_ngram) -> the top `slots`
    successors with their counts, fitted on the host (spec_jax.drafting.suffix_table's
    `fit_suffix_tables`: the training split, a session's earlier outputs, any token lists) and
    passed to the loop as parameters.
The longer match wins; on equal length the row's own text does (it is the more specific).
The draft is sampled from q = warp(log counts) (temperature 1: the empirical frequencies;
temperature 0: the most frequent successor, ties toward the lower id), and q is what the rule
gets, so sampling stays exact at any temperature (tests/test_lookup_distribution.py). A row
stops proposing at its first position with no match, or where the top frequency is below
`threshold` (the drafter's confidence: draft-side information only, so still exact), and after
as many drafts as the match supports: ceil(match_factor * m) (spec_jax.drafting.lookup's
draft_counts and its why), m the whole length of the row's match before the first draft (its own
text's, counted up to MATCH_SCAN tokens back, or the corpus's n); the positions after that get
q = 0.

A tree round (`propose_tree`, spec_jax.tree) builds suffix decoding's speculation tree
(Oliaro et al. 2024): a node's children are the successors by the counts of the text through
it (the committed text and the node's path, matched as above), each with its count fraction;
a node's score is the product of the fractions on its path (the empirical probability that
the text goes through it), and `nodes` times the candidate child of the largest score joins
the tree (ties: the earlier node's, then the more frequent, then the lower id), so the slots
hold the top scores in topological order. A child whose fraction is below `threshold` never
joins (the chain's confidence stop, per child). The children are the most frequent
successors as point masses at any temperature, which the tree rule keeps exact; where every
context has one successor, the tree is the greedy chain.
"""

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from models.settings import is_int
from spec_jax.drafting.base import AUTO_COPY_GAMMA_MAX, UNBOUNDED_CONTEXT, Drafter, Proposal, TreeProposal
from spec_jax.drafting.lookup import (
    MATCH_FACTOR,
    MAX_NGRAM_LIMIT,
    PromptLookupDrafter,
    check_match_factor,
    draft_counts,
    find_match,
    match_length,
    occurrences,
    write_path,
    write_tokens,
)
from spec_jax.drafting.suffix_table import SuffixTables, corpus_counts
from spec_jax.sampling import RowSampling, draw_rows, split_rows, warp
from spec_jax.tree import ROOT, Tree


def own_counts(buffer_bs, length_b, max_ngram: int, vocab_size: int):
    """(ngram int32 [B]: the longest n whose last n tokens occurred earlier in the row, 0 if
    none; counts float32 [B, V]: how often each token followed those occurrences)."""
    ngram, ok = occurrences(buffer_bs, length_b, max_ngram)  # ok [B, S]: occurrences ending at j
    successors = jnp.pad(buffer_bs[:, 1:], ((0, 0), (0, 1)))  # t[j + 1]
    rows = jnp.arange(buffer_bs.shape[0])[:, None]
    counts = jnp.zeros((buffer_bs.shape[0], vocab_size), jnp.float32)
    return ngram, counts.at[rows, successors].add(ok.astype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class SuffixDrafter(Drafter):
    """Drafts by suffix matching (module docstring). params: SuffixTables, or () to match the
    row's own text only. State: PromptLookupDrafter's token buffer."""

    vocab_size: int
    max_ngram: int = 4
    threshold: float = 0.0
    max_seq_len: int = UNBOUNDED_CONTEXT
    prefill_calls: int = 0
    match_factor: float = MATCH_FACTOR  # drafts per matched token (lookup.draft_counts; inf: no cap)
    variable_length: ClassVar[bool] = True
    sources: ClassVar[tuple[str, ...]] = ("suffix",)
    resumable: ClassVar[bool] = True
    auto_gamma_max: ClassVar[int] = AUTO_COPY_GAMMA_MAX
    auto_widths: ClassVar[str] = "doubling"

    def __post_init__(self):
        if not (is_int(self.max_ngram) and 1 <= self.max_ngram <= MAX_NGRAM_LIMIT):
            raise ValueError(
                f"max_ngram must be an integer in [1, {MAX_NGRAM_LIMIT}], got {self.max_ngram!r}"
            )
        if not 0.0 <= self.threshold < 1.0:
            raise ValueError(f"threshold must be in [0, 1), got {self.threshold!r}")
        check_match_factor(self.match_factor)

    def init(self, params, tokens_bp, prompt_lens_b, cache_len, features_bpd=None):
        return PromptLookupDrafter(self.vocab_size).init(None, tokens_bp, prompt_lens_b, cache_len)

    def resume(self, params, buffer_bs, text_bs, synced_b, length_b, width):
        """The buffer is the committed text (PromptLookupDrafter's)."""
        return text_bs.astype(jnp.int32)

    def counts(self, params, buffer_bs, length_b):
        """float32 [B, V]: the successor counts of the longest match (all 0: no match)."""
        n_own, own = own_counts(buffer_bs, length_b, self.max_ngram, self.vocab_size)
        if not isinstance(params, SuffixTables):
            return own
        n_corpus, ids, counts = corpus_counts(params, buffer_bs, length_b, self.max_ngram)
        rows = jnp.arange(buffer_bs.shape[0])[:, None]
        corpus = jnp.zeros_like(own).at[rows, ids].add(counts)
        return jnp.where((n_own >= n_corpus)[:, None], own, corpus)

    def match(self, params, buffer_bs, length_b):
        """int32 [B]: the whole length of each row's match (its own text's by match_length,
        or the corpus's n where longer), 0 without one."""
        _, end, _ = find_match(buffer_bs, length_b, self.max_ngram)
        match = match_length(buffer_bs, length_b, end)
        if isinstance(params, SuffixTables):
            match = jnp.maximum(match, corpus_counts(params, buffer_bs, length_b, self.max_ngram)[0])
        return match

    def propose(self, params, buffer_bs, context_b2, length_b, gamma, sampling: RowSampling, keys_b):
        buffer_bs = write_tokens(buffer_bs, context_b2, length_b - 2)
        count = draft_counts(self.match(params, buffer_bs, length_b), gamma, self.match_factor)

        def step(carry, xs):
            step_keys, i = xs
            buffer, position, alive = carry
            counts = self.counts(params, buffer, position)
            total = jnp.sum(counts, axis=-1)
            matched = total > 0
            logits = jnp.where(matched[:, None], jnp.log(counts), 0.0)  # no match: any finite row
            q = warp(logits, sampling)
            token = draw_rows(step_keys, q)
            confidence = jnp.max(counts, axis=-1) / jnp.maximum(total, 1.0)
            alive = alive & matched & (confidence >= self.threshold) & (i < count)
            buffer = write_tokens(buffer, token[:, None], position)
            return (buffer, position + 1, alive), (token, jnp.where(alive[:, None], q, 0.0))

        alive = jnp.ones(length_b.shape, jnp.bool_)
        (buffer_bs, _, _), (tokens, q) = jax.lax.scan(
            step, (buffer_bs, length_b, alive), (split_rows(keys_b, gamma), jnp.arange(gamma))
        )
        return Proposal(tokens.T, jnp.swapaxes(q, 0, 1), buffer_bs)

    def propose_tree(self, params, buffer_bs, context_b2, length_b, nodes, sampling, keys_b):
        """Suffix decoding's speculation tree (module docstring): `nodes` times, the candidate
        child (a node's successor by the counts of the text through it) of the largest
        score joins the tree, its score its parent's times its count fraction; a child whose
        fraction is below `threshold` never does. Point masses at any temperature. The buffer
        gets the context only: `accepted` writes the path the row took."""
        buffer_bs = write_tokens(buffer_bs, context_b2, length_b - 2)
        batch = buffer_bs.shape[0]
        k = min(nodes, self.vocab_size)  # a node never gets more children than the tree has slots
        rows = jnp.arange(batch)

        def children(path_bn, depth_b):
            """(ids int32 [B, K], fractions float32 [B, K]: the top-k successors of the text
            through the node whose path is path_bn[:depth_b], 0 where none or below threshold)."""
            counts = self.counts(params, write_tokens(buffer_bs, path_bn, length_b), length_b + depth_b)
            top, ids = jax.lax.top_k(counts, k)  # ties: the lower id first, as warp at temperature 0
            fraction = top / jnp.maximum(jnp.sum(counts, axis=-1, keepdims=True), 1.0)
            return ids, jnp.where((top > 0) & (fraction >= self.threshold), fraction, 0.0)

        # Per node (0: the root, 1 + i: slot i): its candidate children, score, path and depth.
        root_ids, root_fraction = children(jnp.zeros((batch, nodes), jnp.int32), jnp.zeros_like(length_b))
        ids = jnp.zeros((batch, nodes + 1, k), jnp.int32).at[:, 0].set(root_ids)
        fraction = jnp.zeros((batch, nodes + 1, k), jnp.float32).at[:, 0].set(root_fraction)
        score = jnp.zeros((batch, nodes + 1), jnp.float32).at[:, 0].set(1.0)
        paths = jnp.zeros((batch, nodes + 1, nodes), jnp.int32)
        depth = jnp.zeros((batch, nodes + 1), jnp.int32)

        def step(carry, i):
            ids, fraction, score, paths, depth = carry
            value = (score[:, :, None] * fraction).reshape(batch, -1)
            best = jnp.argmax(value, axis=1)  # ties: the earlier node, then the more frequent child
            grown = value[rows, best] > 0
            node, rank = best // k, best % k
            token = ids[rows, node, rank]
            path = paths[rows, node].at[rows, depth[rows, node]].set(token)
            child_ids, child_fraction = children(path, depth[rows, node] + 1)
            carry = (
                ids.at[:, 1 + i].set(child_ids),
                fraction.at[rows, node, rank].set(0.0).at[:, 1 + i].set(child_fraction * grown[:, None]),
                score.at[:, 1 + i].set(jnp.where(grown, value[rows, best], 0.0)),
                paths.at[:, 1 + i].set(path),
                depth.at[:, 1 + i].set(depth[rows, node] + 1),
            )
            return carry, (jnp.where(grown, token, 0), jnp.where(grown, node - 1, ROOT), grown)

        _, (tokens, parents, grown) = jax.lax.scan(
            step, (ids, fraction, score, paths, depth), jnp.arange(nodes)
        )
        tokens, parents, grown = tokens.T, parents.T, grown.T  # [B, N]
        q = jax.nn.one_hot(tokens, self.vocab_size, dtype=jnp.float32) * grown[..., None]
        return TreeProposal(Tree(tokens=tokens, parents=parents, q=q), buffer_bs)

    def accepted(self, params, buffer_bs, tree, path_bn, count_b, length_b):
        return write_path(buffer_bs, tree, path_bn, count_b, length_b)
