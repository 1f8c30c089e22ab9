"""Drafts copied from the row's own text: prompt lookup (PromptLookupDrafter; with a draft model
behind it: spec_jax.drafting.hybrid.HybridDrafter).

Prompt lookup (as HF's `prompt_lookup_num_tokens` and vLLM's `ngram`): find the most recent
earlier occurrence of the row's last n committed tokens (n from max_ngram down to 1) in its
prompt + generated tokens, and propose the tokens that followed it. When the occurrence is
closer than gamma tokens to the end, the text is taken to repeat with that period (the match
says t[n + i] = t[j + 1 + i] for an occurrence ending at j; where j + 1 + i reaches the draft
itself, it is read from there). A row without a match proposes nothing (q = 0:
spec_jax.verify). The drafts are deterministic, so q is one-hot: the rule accepts draft x with
probability p(x) and otherwise draws from p with x removed, which keeps sampling at any
temperature exact.

How many drafts a row proposes (draft_counts): match_factor * m rounded up to a power of two,
in [1, gamma], m being the match's whole length (match_length: how far the text before the occurrence equals the
text before the row's end, counted up to MATCH_SCAN tokens back, beyond the max_ngram the
search matched). Why: a match of one or two tokens is mostly a coincidence, whose continuation
the target rarely takes past its first token, while a long match says the row is copying (code
edits, quotes, a text repeating with some period), where the copy goes on for tens of tokens;
suffix decoding (Oliaro et al. 2024) caps its speculation at a multiple of the match length for
the same reason. A copy's rounds then grow 2, 4, 8, 16 drafts as its match grows. The count
reads the row's committed text only (draft-side information), so the positions past it get
q = 0 and the rule stays exact (spec_jax.verify). Proposing fewer drafts saves target work only
where the verify call is as wide as the longest row's drafts: verify_widths="auto" gives these
drafters "doubling" widths (1, 2, 3, 5, 9, 17: spec_jax.state.SpecStatic.widths), which the
power-of-two counts fill; with "ends" (every round as wide as gamma + 1) a short count costs the
same call and forgoes the drafts it did not propose. match_factor=inf proposes gamma drafts at
every match.

The state is a token buffer [B, S] (S = the loop's cache length) holding each row's prompt +
committed tokens. The loop hands `propose` only the last two committed tokens, so the buffer
is kept as the model drafter keeps its cache: `propose` writes its drafts at n .. n+G-1 (the
accepted ones are committed as proposed), and the next call writes the two context tokens at
n'-2, n'-1 over them, which also replaces the first rejected draft with the token the rule
drew. Every position below n' is then a committed token; entries at n' and past are garbage
and are masked out of the match. A round the loop truncates (max_new_tokens, a stop token)
ends its row, so a truncated row never proposes again.

A tree round (`propose_tree`, spec_jax.tree) proposes several continuations at once: the
`nodes` best earlier occurrences (`candidates`: the longest match first, then the most recent,
so the occurrences of shorter n-grams come in where the longest has fewer), each continued
`nodes` tokens as above, merged into a trie (`trie`: one node per distinct prefix, so siblings
have distinct tokens) whose `nodes` slots hold the nodes most candidates go through, weighted
by their match lengths (then the shallower, then the better candidate's): suffix decoding's
speculation tree over the candidates, and with one candidate the chain `propose` gives. Every
node is a point mass, exact under the tree rule. The chain's match is the first candidate: one
occurrence search (`occurrence_masks`) serves both. `propose_tree` writes only the context
into the buffer; `accepted` writes the path the row accepted at n .., so below n' the buffer
is again the committed text.
"""

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp

from models.settings import is_int, is_number
from spec_jax.drafting.base import (
    AUTO_COPY_GAMMA_MAX,
    UNBOUNDED_CONTEXT,
    Drafter,
    Proposal,
    TreeProposal,
)
from spec_jax.tree import ROOT, Tree

MAX_NGRAM_LIMIT = 16  # the largest max_ngram accepted (the match is max_ngram shifted compares)
MATCH_SCAN = 16  # how far back match_length counts a match
MATCH_FACTOR = 2.0  # drafts per matched token (draft_counts), the drafters' default


def write_tokens(buffer_bs, tokens_bt, start_b):
    """buffer with tokens [B, T] written at positions start .. start+T-1 of each row (positions
    past the buffer are dropped)."""
    rows = jnp.arange(buffer_bs.shape[0])[:, None]
    positions = start_b[:, None] + jnp.arange(tokens_bt.shape[1])[None, :]
    return buffer_bs.at[rows, positions].set(tokens_bt, mode="drop")


def occurrence_masks(buffer_bs, length_b, max_ngram: int):
    """bool [B, M, S] (M = max_ngram): [b, n - 1, j] whether row b's last n tokens t[L-n .. L-1]
    (L = length) also end at j <= L-2 (an earlier occurrence: its continuation t[j+1] is
    known); positions >= L are never read. An n-gram's occurrences are among the (n-1)-gram's."""
    slots = buffer_bs.shape[1]
    j = jnp.arange(slots)[None, :]  # [1, S]: where an earlier occurrence ends
    n = length_b[:, None]  # [B, 1]
    ok = j <= n - 2
    masks = []
    for d in range(max_ngram):  # the n-gram's tokens, last first: window j - d vs t[L-1-d]
        shifted = jnp.pad(buffer_bs, ((0, 0), (d, 0)), constant_values=-1)[:, :slots]  # [b, j] = t[j-d]
        suffix = jnp.take_along_axis(buffer_bs, jnp.maximum(n - 1 - d, 0), axis=1)  # [B, 1]
        ok = ok & (shifted == suffix) & (n - 1 - d >= 0) & (j >= d)
        masks.append(ok)
    return jnp.stack(masks, axis=1)


def occurrences(buffer_bs, length_b, max_ngram: int):
    """Each row's earlier occurrences of its longest matching suffix (occurrence_masks):
    (ngram int32 [B]: the longest n <= max_ngram that occurs, 0 if none; ok bool [B, S]: the j
    where an occurrence of that n ends, all False if none)."""
    masks = occurrence_masks(buffer_bs, length_b, max_ngram)
    ngram = jnp.sum(jnp.any(masks, axis=2), axis=1).astype(jnp.int32)  # nested: the count is the longest
    ok = jnp.take_along_axis(masks, jnp.maximum(ngram - 1, 0)[:, None, None], axis=1)[:, 0]
    return ngram, ok & (ngram > 0)[:, None]


def occurrence_ranks(buffer_bs, length_b, max_ngram: int):
    """int32 [B, S]: each earlier end j ranked, the longest match first (the n <= max_ngram
    whose occurrence ends there), then the most recent: n * S + j, -1 where none ends."""
    slots = buffer_bs.shape[1]
    ngram_bs = jnp.sum(occurrence_masks(buffer_bs, length_b, max_ngram), axis=1)  # longest n ending at j
    return jnp.where(ngram_bs > 0, ngram_bs * slots + jnp.arange(slots)[None, :], -1).astype(jnp.int32)


def candidates(buffer_bs, length_b, max_ngram: int, count: int):
    """Each row's `count` best earlier occurrences by occurrence_ranks. Returns (end int32
    [B, C]: where each ends, -1 past a row's occurrences; ngram int32 [B, C]: its match length,
    0 there)."""
    slots = buffer_bs.shape[1]
    rank, end = jax.lax.top_k(occurrence_ranks(buffer_bs, length_b, max_ngram), min(count, slots))
    pad = ((0, 0), (0, count - rank.shape[1]))
    rank, end = jnp.pad(rank, pad, constant_values=-1), jnp.pad(end, pad)
    return jnp.where(rank >= 0, end, -1).astype(jnp.int32), jnp.maximum(rank, 0) // slots


def find_match(buffer_bs, length_b, max_ngram: int):
    """The most recent earlier occurrence of each row's longest matching suffix (the best by
    occurrence_ranks, the first of `candidates`): (found bool [B], end int32 [B]: where it
    ends, -1 if none; ngram int32 [B], 0 if none)."""
    rank = jnp.max(occurrence_ranks(buffer_bs, length_b, max_ngram), axis=1)
    slots = buffer_bs.shape[1]
    return rank >= 0, jnp.where(rank >= 0, rank % slots, -1), jnp.maximum(rank, 0) // slots


def continuation(buffer_bs, length_b, end_b, gamma: int):
    """int32 [B, G]: the gamma tokens after an occurrence ending at end, t[end + 1 + (i mod P)]
    with P = L - 1 - end (the text repeating with period P past its last token)."""
    period = jnp.maximum(length_b - 1 - end_b, 1)[:, None]
    idx = end_b[:, None] + 1 + jnp.arange(gamma)[None, :] % period
    return jnp.take_along_axis(buffer_bs, jnp.clip(idx, 0, buffer_bs.shape[1] - 1), axis=1)


def match_length(buffer_bs, length_b, end_b, scan: int = MATCH_SCAN):
    """int32 [B]: the length m of the match ending at end (-1: none, m = 0): t[end - d] =
    t[L - 1 - d] for d < m (L = length), counted up to `scan` and to the text's start."""
    d = jnp.arange(scan)[None, :]
    earlier, later = end_b[:, None] - d, length_b[:, None] - 1 - d  # [B, scan]
    last = buffer_bs.shape[1] - 1
    same = jnp.take_along_axis(buffer_bs, jnp.clip(earlier, 0, last), axis=1) == jnp.take_along_axis(
        buffer_bs, jnp.clip(later, 0, last), axis=1
    )
    same = same & (earlier >= 0) & (end_b[:, None] >= 0)
    return jnp.sum(jnp.cumprod(same, axis=1), axis=1).astype(jnp.int32)


def draft_counts(match_b, gamma: int, factor: float):
    """int32 [B]: the drafts each row proposes for a match of match_b tokens (module docstring):
    factor * match rounded up to a power of two, in [1, gamma]; gamma where factor is inf; 0
    where match is 0."""
    if math.isinf(factor):
        count = jnp.full_like(match_b, gamma)
    else:
        wanted = jnp.maximum(factor * match_b.astype(jnp.float32), 1.0)
        count = jnp.exp2(jnp.ceil(jnp.log2(wanted) - 1e-6)).astype(jnp.int32)
    return jnp.where(match_b > 0, jnp.clip(count, 1, gamma), 0).astype(jnp.int32)


def trie(tokens_bcd, weight_bc, nodes: int, vocab_size: int) -> Tree:
    """The continuations tokens [B, C, D] (candidate c proposes tokens[c, :]; weight int32
    [B, C] > 0, 0: no candidate) merged into a trie of `nodes` slots: a node per distinct
    prefix (siblings have distinct tokens), q its token's point mass.

    The slots hold the nodes of the largest support first, a node's support being the summed
    weight of the candidates through it (its share of the total is the empirical probability
    that the text continues through it: suffix decoding's speculation tree), then the
    shallower, then the one of the better candidate (the lower c). A child's support is at most
    its parent's, so a parent comes first (the slots are in topological order) and the nodes
    kept are a tree; among equal supports it is breadth-first, and one candidate is its chain.
    Slots past the nodes are empty (token 0, parent ROOT, q = 0)."""
    b, c, d = tokens_bcd.shape
    if nodes > c * d:
        raise ValueError(f"a trie of {c} candidates of {d} tokens has at most {c * d} nodes, not {nodes}")
    live = weight_bc > 0
    equal = tokens_bcd[:, :, None, :] == tokens_bcd[:, None, :, :]  # [B, C, C, D]
    equal = equal & live[:, :, None, None] & live[:, None, :, None]
    same = jnp.cumprod(equal, axis=-1).astype(bool)  # [b, c, c', i]: equal prefixes through depth i
    first = jnp.argmax(same, axis=2).astype(jnp.int32)  # [B, C, D]: the first candidate with it
    own = live[:, :, None] & (first == jnp.arange(c)[None, :, None])  # (c, i) is a node
    support = jnp.sum(jnp.where(same, weight_bc[:, None, :, None], 0), axis=2)  # [B, C, D]
    depth = jnp.arange(d)[None, None, :]
    most = c * jnp.max(weight_bc) + 1  # above any support
    key = (most - support) * (c * d) + depth * c + jnp.arange(c)[None, :, None]
    key = jnp.where(own, key, jnp.iinfo(jnp.int32).max).reshape(b, c * d)  # item c * D + i
    order = jnp.argsort(key, axis=1)[:, :nodes]  # [B, N]: the item in each slot
    rows = jnp.arange(b)[:, None]
    present = jnp.take_along_axis(key, order, axis=1) < jnp.iinfo(jnp.int32).max
    slot_of = jnp.zeros((b, c * d), jnp.int32).at[rows, order].set(jnp.arange(nodes, dtype=jnp.int32))
    cand, i = order // d, order % d
    parent_item = first[rows, cand, jnp.maximum(i - 1, 0)] * d + i - 1
    parents = jnp.where(present & (i > 0), slot_of[rows, jnp.maximum(parent_item, 0)], ROOT)
    tokens = jnp.where(present, tokens_bcd[rows, cand, i], 0).astype(jnp.int32)
    q = jax.nn.one_hot(tokens, vocab_size, dtype=jnp.float32) * present[..., None]
    return Tree(tokens=tokens, parents=parents.astype(jnp.int32), q=q)


def write_path(buffer_bs, tree: Tree, path_bn, count_b, length_b):
    """The buffer with the path each row accepted, tree.tokens[path_bn[:count_b]], written at
    length_b .. length_b + count_b - 1 (the rest of the buffer as it is)."""
    rows = jnp.arange(buffer_bs.shape[0])[:, None]
    steps = jnp.arange(path_bn.shape[1])[None, :]
    tokens = jnp.take_along_axis(tree.tokens, jnp.maximum(path_bn, 0), axis=1)
    positions = jnp.where(steps < count_b[:, None], length_b[:, None] + steps, buffer_bs.shape[1])
    return buffer_bs.at[rows, positions].set(tokens, mode="drop")


def one_hot_prefix(drafts_bg, count_b, vocab_size: int):
    """float32 [B, G, V]: the drafts' point masses at each row's first count positions, 0 past."""
    proposed = jnp.arange(drafts_bg.shape[1])[None, :] < count_b[:, None]
    return jax.nn.one_hot(drafts_bg, vocab_size, dtype=jnp.float32) * proposed[..., None]


def check_match_factor(factor) -> None:
    """ValueError unless factor is a number > 0 (inf included)."""
    if not is_number(factor) or not factor > 0:
        raise ValueError(
            f"match_factor must be a number > 0 (inf: gamma drafts at every match), got {factor!r}"
        )


@dataclasses.dataclass(frozen=True)
class PromptLookupDrafter(Drafter):
    """Drafts by prompt lookup (module docstring); no parameters (params: None or ())."""

    vocab_size: int
    max_ngram: int = 3
    max_seq_len: int = UNBOUNDED_CONTEXT
    prefill_calls: int = 0
    match_factor: float = MATCH_FACTOR  # drafts per matched token (draft_counts; inf: always gamma)
    variable_length: ClassVar[bool] = True
    sources: ClassVar[tuple[str, ...]] = ("prompt_lookup",)
    resumable: ClassVar[bool] = True
    auto_gamma_max: ClassVar[int] = AUTO_COPY_GAMMA_MAX
    auto_widths: ClassVar[str] = "doubling"

    def __post_init__(self):
        if not (is_int(self.max_ngram) and 1 <= self.max_ngram <= MAX_NGRAM_LIMIT):
            raise ValueError(
                f"max_ngram must be an integer in [1, {MAX_NGRAM_LIMIT}], got {self.max_ngram!r}"
            )
        check_match_factor(self.match_factor)

    def init(self, params, tokens_bp, prompt_lens_b, cache_len, features_bpd=None):
        """The token buffer [B, cache_len]: the padded prompts (padding past each length is garbage)."""
        return jnp.pad(tokens_bp.astype(jnp.int32), ((0, 0), (0, cache_len - tokens_bp.shape[1])))

    def resume(self, params, buffer_bs, text_bs, synced_b, length_b, width):
        """The buffer is the committed text (below each row's length; garbage past it)."""
        return text_bs.astype(jnp.int32)

    def lookup(self, buffer_bs, context_b2, length_b, gamma: int):
        """(buffer with the context written, count int32 [B]: the drafts each row proposes, 0
        without a match (draft_counts), drafts int32 [B, G]: the match's continuation)."""
        buffer_bs = write_tokens(buffer_bs, context_b2, length_b - 2)
        found, end, _ = find_match(buffer_bs, length_b, self.max_ngram)
        drafts = continuation(buffer_bs, length_b, end, gamma)
        count = draft_counts(match_length(buffer_bs, length_b, end), gamma, self.match_factor)
        return buffer_bs, count, jnp.where(found[:, None], drafts, context_b2[:, 1:])

    def propose(self, params, buffer_bs, context_b2, length_b, gamma, sampling, keys_b):
        buffer_bs, count, drafts = self.lookup(buffer_bs, context_b2, length_b, gamma)
        q = one_hot_prefix(drafts, count, self.vocab_size)
        return Proposal(drafts, q, write_tokens(buffer_bs, drafts, length_b))

    def propose_tree(self, params, buffer_bs, context_b2, length_b, nodes, sampling, keys_b):
        """The trie of the continuations of the `nodes` best occurrences (`candidates`), each
        `nodes` tokens long and weighted by its match length (`trie`). The buffer gets the
        context only: `accepted` writes the path the row took."""
        buffer_bs = write_tokens(buffer_bs, context_b2, length_b - 2)
        end, ngram = candidates(buffer_bs, length_b, self.max_ngram, nodes)
        tokens = jax.vmap(continuation, in_axes=(None, None, 1, None), out_axes=1)(
            buffer_bs, length_b, end, nodes
        )  # [B, C, D]
        return TreeProposal(trie(tokens, ngram, nodes, self.vocab_size), buffer_bs)

    def accepted(self, params, buffer_bs, tree, path_bn, count_b, length_b):
        return write_path(buffer_bs, tree, path_bn, count_b, length_b)
