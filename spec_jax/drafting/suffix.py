"""Suffix drafting: the continuation of the longest suffix of the text that occurred before,
in the row's own prompt + output or in a corpus, sampled from its empirical frequencies.

At each draft position the drafter takes the row's context (committed tokens and the drafts
so far) and finds the longest n <= max_ngram such that its last n tokens occurred before:
  - in the row itself: every earlier occurrence counts (spec_jax.drafting.lookup.occurrences), and the
    counts of the tokens that followed them are the distribution;
  - in a corpus: a fixed-size hashed table of n-grams (n = 1 .. max_ngram) -> the top `slots`
    successors with their counts, fitted on the host (`fit_suffix_tables`: the training split,
    a session's earlier outputs, any token lists) and passed to the loop as parameters.
The longer match wins; on equal length the row's own text does (it is the more specific).
The draft is sampled from q = warp(log counts) (temperature 1: the empirical frequencies;
temperature 0: the most frequent successor, ties toward the lower id), and q is what the rule
gets, so sampling stays exact at any temperature (tests/test_lookup_distribution.py). A row
stops proposing at its first position with no match, or where the top frequency is below
`threshold` (the drafter's confidence: draft-side information only, so still exact); the
positions after that get q = 0.

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

The table is a hash map with one n-gram per bucket: two independent 32-bit rolling hashes of
the n-gram (newest token first) pick the bucket and are stored as its key, so a lookup
matches an n-gram the table holds, never a different one that shares its bucket (unless
all 64 bits collide). Where two n-grams want one bucket, the more frequent keeps it.
"""

import dataclasses
from collections.abc import Iterable, Sequence
from typing import ClassVar

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from models.settings import is_int
from spec_jax.drafting.base import UNBOUNDED_CONTEXT, Drafter, Proposal, TreeProposal
from spec_jax.drafting.lookup import (
    MAX_NGRAM_LIMIT,
    PromptLookupDrafter,
    occurrences,
    write_path,
    write_tokens,
)
from spec_jax.sampling import RowSampling, draw_rows, split_rows, warp
from spec_jax.tree import ROOT, Tree

# Rolling hashes: h <- (h ^ (token + 1)) * prime mod 2^32 (FNV-1a over token ids), two seeds.
_SEEDS = (0x811C9DC5, 0x9E3779B9)
_PRIMES = (0x01000193, 0x85EBCA6B)
DEFAULT_SLOTS = 4
DEFAULT_MIN_COUNT = 2
MAX_BUCKETS = 2**24


@flax.struct.dataclass
class SuffixTables:
    keys: jax.Array  # uint32 [H, 2]: the two hashes of the n-gram in each bucket
    next_ids: jax.Array  # int32 [H, K]: its most frequent successors
    next_counts: jax.Array  # float32 [H, K]: their counts (0: empty slot; an empty bucket is all 0)


def _roll(xp, h, token, which):
    """One rolling-hash step over NumPy or JAX uint32 arrays (wrapping arithmetic)."""
    return (h ^ (token.astype(xp.uint32) + xp.uint32(1))) * xp.uint32(_PRIMES[which])


def _finalize(xp, h):
    """murmur3's finalizer: spreads the rolling hash's bits before taking the bucket."""
    h = h ^ (h >> xp.uint32(16))
    h = h * xp.uint32(0x85EBCA6B)
    h = h ^ (h >> xp.uint32(13))
    h = h * xp.uint32(0xC2B2AE35)
    return h ^ (h >> xp.uint32(16))


def fit_suffix_tables(
    sequences: Iterable[Sequence[int]],
    vocab_size: int,
    max_ngram: int = 4,
    *,
    slots: int = DEFAULT_SLOTS,
    min_count: int = DEFAULT_MIN_COUNT,
    num_buckets: int | None = None,
) -> SuffixTables:
    """The hashed n-gram table of token sequences (no n-gram spans two sequences).

    Keeps the n-grams (n = 1 .. max_ngram) seen at least min_count times, each with its `slots`
    most frequent successors (ties: the lower id). num_buckets: a power of two (default: the
    smallest one at least twice the kept n-grams, at most 2^24).
    """
    if not is_int(vocab_size) or vocab_size < 2:
        raise ValueError(f"vocab_size must be an integer >= 2, got {vocab_size!r}")
    if not is_int(max_ngram) or not 1 <= max_ngram <= MAX_NGRAM_LIMIT:
        raise ValueError(f"max_ngram must be an integer in [1, {MAX_NGRAM_LIMIT}], got {max_ngram!r}")
    if not is_int(slots) or slots < 1:
        raise ValueError(f"slots must be an integer >= 1, got {slots!r}")
    if not is_int(min_count) or min_count < 1:
        raise ValueError(f"min_count must be an integer >= 1, got {min_count!r}")
    keys, nexts = _ngram_successors(_token_arrays(sequences, vocab_size), max_ngram)
    pair_key, pair_next, pair_count, key_index, totals = _successor_counts(keys, nexts)
    keep_key = totals >= min_count
    kept = np.flatnonzero(keep_key)
    if num_buckets is None:
        num_buckets = int(min(MAX_BUCKETS, max(2, 1 << int(np.ceil(np.log2(max(2 * kept.size, 2)))))))
    if not is_int(num_buckets) or num_buckets < 2 or num_buckets & (num_buckets - 1):
        raise ValueError(f"num_buckets must be a power of two >= 2, got {num_buckets!r}")
    # per n-gram: its successors by count (descending), then id; the first `slots` of each kept one
    order = np.lexsort((pair_next, -pair_count, key_index))
    sorted_index = key_index[order]
    rank = np.arange(order.size) - np.searchsorted(sorted_index, sorted_index, side="left")
    chosen = order[(rank < slots) & keep_key[sorted_index]]
    chosen_rank = rank[(rank < slots) & keep_key[sorted_index]]
    unique_keys = pair_key[np.concatenate([[True], pair_key[1:] != pair_key[:-1]])]
    bucket, table_keys, owns = _bucket_owners(unique_keys, totals, kept, num_buckets)
    ids = np.zeros((num_buckets, slots), np.int32)
    counts = np.zeros((num_buckets, slots), np.float32)
    pair_owner = key_index[chosen]
    take = owns[pair_owner]
    rows = bucket[pair_owner[take]]
    ids[rows, chosen_rank[take]] = pair_next[chosen[take]]
    counts[rows, chosen_rank[take]] = pair_count[chosen[take]]
    return SuffixTables(
        keys=jnp.asarray(table_keys), next_ids=jnp.asarray(ids), next_counts=jnp.asarray(counts)
    )


def _token_arrays(sequences, vocab_size: int) -> list[np.ndarray]:
    """The sequences as int64 arrays; ValueError naming the first that is not flat token ids."""
    arrays = [np.asarray(s, np.int64) for s in sequences]
    for i, a in enumerate(arrays):
        if a.ndim != 1 or (a.size and (a.min() < 0 or a.max() >= vocab_size)):
            raise ValueError(f"sequences[{i}] must be a flat list of token ids in [0, {vocab_size})")
    return arrays


def _ngram_successors(arrays, max_ngram: int):
    """(key uint64 [M], next int64 [M]) over every n-gram (n = 1 .. max_ngram) of every array and
    the token after it: key packs the n-gram's two 32-bit hashes (newest token first, _roll).
    ValueError if no array has two tokens."""
    keys1, keys2, nexts = [], [], []
    for a in arrays:
        a32 = a.astype(np.uint32)
        h = [np.full(a.size, _SEEDS[0], np.uint32), np.full(a.size, _SEEDS[1], np.uint32)]
        for n in range(1, max_ngram + 1):  # contexts a[i-n .. i-1] predicting a[i], i >= n
            if a.size <= n:
                break
            # h[w][i] after this step: the hash of a[i-n .. i-1], newest token first
            prev = np.concatenate([np.zeros(n, np.uint32), a32[:-n]])  # a[i - n]
            h = [_roll(np, h[w], prev, w) for w in range(2)]
            keys1.append(h[0][n:])
            keys2.append(h[1][n:])
            nexts.append(a[n:])
    if not nexts:
        raise ValueError("sequences: no sequence has two tokens, so there is nothing to count")
    k1, k2 = np.concatenate(keys1), np.concatenate(keys2)
    return (k1.astype(np.uint64) << np.uint64(32)) | k2.astype(np.uint64), np.concatenate(nexts)


def _successor_counts(key, nx):
    """The distinct (n-gram, successor) pairs, sorted by key then successor: (pair_key,
    pair_next, pair_count [P], key_index [P]: each pair's n-gram's index among the distinct
    keys, totals [K] float64: each n-gram's count)."""
    order = np.lexsort((nx, key))
    key, nx = key[order], nx[order]
    # runs of equal (key, next): one successor and its count
    new_pair = np.concatenate([[True], (key[1:] != key[:-1]) | (nx[1:] != nx[:-1])])
    starts = np.flatnonzero(new_pair)
    pair_key, pair_next = key[starts], nx[starts]
    pair_count = np.diff(np.concatenate([starts, [key.size]]))
    key_index = np.cumsum(np.concatenate([[True], pair_key[1:] != pair_key[:-1]])) - 1
    return pair_key, pair_next, pair_count, key_index, np.bincount(key_index, weights=pair_count)


def _bucket_owners(unique_keys, totals, kept, num_buckets: int):
    """(bucket int64 [K]: each n-gram's bucket, table_keys uint32 [num_buckets, 2]: the two
    hashes of each bucket's owner, owns bool [K]). One n-gram per bucket: the most frequent
    (then the smaller key) of the kept ones that hash to it."""
    h1 = (unique_keys >> np.uint64(32)).astype(np.uint32)
    h2 = (unique_keys & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    bucket = (_finalize(np, h1) & np.uint32(num_buckets - 1)).astype(np.int64)
    by_bucket = kept[np.lexsort((unique_keys[kept], -totals[kept], bucket[kept]))]
    winner = by_bucket[np.concatenate([[True], bucket[by_bucket][1:] != bucket[by_bucket][:-1]])]
    owns = np.zeros(unique_keys.size, bool)
    owns[winner] = True
    table_keys = np.zeros((num_buckets, 2), np.uint32)
    table_keys[bucket[winner], 0] = h1[winner]
    table_keys[bucket[winner], 1] = h2[winner]
    return bucket, table_keys, owns


def context_hashes(buffer_bs, length_b, max_ngram: int):
    """The two hashes of each row's last n tokens, n = 1 .. max_ngram: uint32 [B, N, 2], and
    whether the row has n tokens, bool [B, N]."""
    h = [jnp.full(length_b.shape, _SEEDS[w], jnp.uint32) for w in range(2)]
    out, valid = [], []
    for n in range(1, max_ngram + 1):
        token = jnp.take_along_axis(buffer_bs, jnp.maximum(length_b - n, 0)[:, None], axis=1)[:, 0]
        h = [_roll(jnp, h[w], token, w) for w in range(2)]
        out.append(jnp.stack(h, axis=-1))
        valid.append(length_b - n >= 0)
    return jnp.stack(out, axis=1), jnp.stack(valid, axis=1)


def corpus_counts(tables: SuffixTables, buffer_bs, length_b, max_ngram: int):
    """(ngram int32 [B]: the longest n whose last-n-token context the table holds, 0 if none;
    ids int32 [B, K], counts float32 [B, K]: its successors)."""
    hashes, valid = context_hashes(buffer_bs, length_b, max_ngram)  # [B, N, 2], [B, N]
    num_buckets = tables.keys.shape[0]
    bucket = (_finalize(jnp, hashes[..., 0]) & jnp.uint32(num_buckets - 1)).astype(jnp.int32)  # [B, N]
    stored = tables.keys[bucket]  # [B, N, 2]
    counts = tables.next_counts[bucket]  # [B, N, K]
    hit = valid & jnp.all(stored == hashes, axis=-1) & (counts[..., 0] > 0)
    ngram = jnp.max(jnp.where(hit, jnp.arange(1, max_ngram + 1)[None, :], 0), axis=1)
    best = jnp.take_along_axis(bucket, jnp.maximum(ngram - 1, 0)[:, None], axis=1)[:, 0]
    found = (ngram > 0)[:, None]
    return ngram, tables.next_ids[best], jnp.where(found, tables.next_counts[best], 0.0)


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
    variable_length: ClassVar[bool] = True
    sources: ClassVar[tuple[str, ...]] = ("suffix",)
    resumable: ClassVar[bool] = True

    def __post_init__(self):
        if not (is_int(self.max_ngram) and 1 <= self.max_ngram <= MAX_NGRAM_LIMIT):
            raise ValueError(
                f"max_ngram must be an integer in [1, {MAX_NGRAM_LIMIT}], got {self.max_ngram!r}"
            )
        if not 0.0 <= self.threshold < 1.0:
            raise ValueError(f"threshold must be in [0, 1), got {self.threshold!r}")

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

    def propose(self, params, buffer_bs, context_b2, length_b, gamma, sampling: RowSampling, keys_b):
        buffer_bs = write_tokens(buffer_bs, context_b2, length_b - 2)

        def step(carry, step_keys):
            buffer, position, alive = carry
            counts = self.counts(params, buffer, position)
            total = jnp.sum(counts, axis=-1)
            matched = total > 0
            logits = jnp.where(matched[:, None], jnp.log(counts), 0.0)  # no match: any finite row
            q = warp(logits, sampling)
            token = draw_rows(step_keys, q)
            confidence = jnp.max(counts, axis=-1) / jnp.maximum(total, 1.0)
            alive = alive & matched & (confidence >= self.threshold)
            buffer = write_tokens(buffer, token[:, None], position)
            return (buffer, position + 1, alive), (token, jnp.where(alive[:, None], q, 0.0))

        alive = jnp.ones(length_b.shape, jnp.bool_)
        (buffer_bs, _, _), (tokens, q) = jax.lax.scan(
            step, (buffer_bs, length_b, alive), split_rows(keys_b, gamma)
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
