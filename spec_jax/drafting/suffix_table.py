"""The suffix drafter's corpus table (spec_jax.drafting.suffix): n-grams (n = 1 .. max_ngram) of
token sequences with their most frequent successors, fitted on the host (fit_suffix_tables) and
looked up on the device from each row's last tokens (corpus_counts).

The table is a hash map with one n-gram per bucket: two independent 32-bit rolling hashes of
the n-gram (newest token first) pick the bucket and are stored as its key, so a lookup
matches an n-gram the table holds, never a different one that shares its bucket (unless
all 64 bits collide). Where two n-grams want one bucket, the more frequent keeps it.
"""

from collections.abc import Iterable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from models.settings import is_int
from spec_jax.drafting.lookup import MAX_NGRAM_LIMIT

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
