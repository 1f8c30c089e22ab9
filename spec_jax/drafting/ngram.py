"""The n-gram drafters (UnigramDrafter, BigramDrafter), fitted by counting. They keep no state
between rounds (the loop carries an empty tuple) and read any context length.

Counting is NumPy on the host. The result of each fit is a `(drafter, params)` pair that
`spec_jax.generate(target, prompts, draft=pair, ...)` takes as it is.

Smoothing (every token keeps some mass, so the draft can propose anything and log q is finite):
  unigram  u(x) = (n(x) + add_k) / (N + add_k V)                       (add-k)
  bigram   p(x | c) = (n(c, x) + prior u(x)) / (n(c) + prior)          (Dirichlet prior on u)
The bigram backs off to the unigram in proportion prior / (n(c) + prior): a context never seen
gets u itself, a frequent one is nearly its own relative frequencies. Counts are stored
sparsely (only the bigrams that occur), which is exact: a dense [V, V] table would take
151936^2 floats for the Qwen vocabulary.
"""

import dataclasses
from collections.abc import Iterable, Sequence
from typing import ClassVar

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from models.settings import is_int
from spec_jax.drafting.base import UNBOUNDED_CONTEXT, Drafter, Proposal
from spec_jax.sampling import draw_rows, split_rows, warp

DEFAULT_ADD_K = 0.01
DEFAULT_PRIOR = 1.0


@flax.struct.dataclass
class UnigramTables:
    log_probs: jax.Array  # float32 [V]: log u(x), smoothed so every token has mass


@dataclasses.dataclass(frozen=True)
class UnigramDrafter(Drafter):
    """Drafts every token from one fixed distribution u (unigram frequencies), ignoring context.

    Temperature, top-k and top-p warp log u like a model's logits; temperature 0 proposes
    argmax u (the most frequent token) at every position.
    """

    vocab_size: int
    max_seq_len: int = UNBOUNDED_CONTEXT
    prefill_calls: int = 0
    sources: ClassVar[tuple[str, ...]] = ("unigram",)
    resumable: ClassVar[bool] = True

    def resume(self, params, state, text_bs, synced_b, length_b, width):
        return state

    def propose(self, params: UnigramTables, state, context_b2, length_b, gamma, sampling, keys_b):
        batch = context_b2.shape[0]
        q_bv = warp(jnp.broadcast_to(params.log_probs, (batch, self.vocab_size)), sampling)  # each row's warp
        tokens = jnp.stack([draw_rows(k, q_bv) for k in split_rows(keys_b, gamma)], axis=1)  # [B, G]
        q = jnp.broadcast_to(q_bv[:, None], (batch, gamma, self.vocab_size))
        return Proposal(tokens, q, state)


@flax.struct.dataclass
class BigramTables:
    """A smoothed bigram p(x | c) = (n(c, x) + s(x)) / d(c), stored sparsely (exact).

    The nonzero counts n(c, .) of context c are next_ids / next_counts[row_start[c] :
    row_start[c + 1]] (sorted by context, then padded with max_row_len zeros so a fixed-size
    slice from any row start stays in bounds). s = prior * u is the backoff mass spread by the
    unigram u, and d(c) = n(c) + prior, so an unseen context falls back to u exactly.
    """

    smoothing: jax.Array  # float32 [V]: prior * u(x)
    denominator: jax.Array  # float32 [V]: n(c) + prior, per context c
    row_start: jax.Array  # int32 [V + 1]
    next_ids: jax.Array  # int32 [nnz + max_row_len]
    next_counts: jax.Array  # float32 [nnz + max_row_len]


@dataclasses.dataclass(frozen=True)
class BigramDrafter(Drafter):
    """Drafts from p(x | previous token): the first draft conditions on the last committed
    token (context[:, 1]), each later one on the draft before it.

    max_row_len: the most distinct successors any context has in the tables (a static slice
    width). Temperature 0 proposes argmax_x p(x | c): the most frequent successor, ties
    broken by the unigram, then toward the lower id (as warp does).
    """

    vocab_size: int
    max_row_len: int
    max_seq_len: int = UNBOUNDED_CONTEXT
    prefill_calls: int = 0
    sources: ClassVar[tuple[str, ...]] = ("bigram",)
    resumable: ClassVar[bool] = True

    def resume(self, params, state, text_bs, synced_b, length_b, width):
        return state

    def probs(self, params: BigramTables, context_b):
        """p(. | c) for each context token c [B]: float32 [B, V]."""

        def row(c):
            start = params.row_start[c]
            ids = jax.lax.dynamic_slice(params.next_ids, (start,), (self.max_row_len,))
            counts = jax.lax.dynamic_slice(params.next_counts, (start,), (self.max_row_len,))
            counts = jnp.where(jnp.arange(self.max_row_len) < params.row_start[c + 1] - start, counts, 0.0)
            return params.smoothing.at[ids].add(counts) / params.denominator[c]

        return jax.vmap(row)(context_b)

    def propose(self, params: BigramTables, state, context_b2, length_b, gamma, sampling, keys_b):
        def step(prev_b, step_keys):
            q_bv = warp(jnp.log(self.probs(params, prev_b)), sampling)
            token_b = draw_rows(step_keys, q_bv)
            return token_b, (token_b, q_bv)

        _, (tokens_gb, q_gbv) = jax.lax.scan(step, context_b2[:, 1], split_rows(keys_b, gamma))
        return Proposal(tokens_gb.T, jnp.swapaxes(q_gbv, 0, 1), state)


def _as_arrays(sequences: Iterable[Sequence[int]], vocab_size: int) -> list[np.ndarray]:
    arrays = [np.asarray(s, np.int64) for s in sequences]
    for i, a in enumerate(arrays):
        if a.ndim != 1:
            raise ValueError(f"sequences[{i}] must be a flat sequence of token ids")
        if a.size and (a.min() < 0 or a.max() >= vocab_size):
            raise ValueError(f"sequences[{i}] has token ids outside [0, {vocab_size})")
    if not any(a.size for a in arrays):
        raise ValueError("sequences: no tokens to count")
    return arrays


def _check(vocab_size, add_k, prior):
    if not is_int(vocab_size) or vocab_size < 2:
        raise ValueError(f"vocab_size must be an integer >= 2, got {vocab_size!r}")
    if not add_k > 0:
        raise ValueError(f"add_k must be > 0, got {add_k}")
    if not prior > 0:
        raise ValueError(f"prior must be > 0, got {prior}")


def unigram_probs(sequences, vocab_size: int, add_k: float = DEFAULT_ADD_K) -> np.ndarray:
    """u [V] float64: add-k smoothed token frequencies over all sequences."""
    _check(vocab_size, add_k, DEFAULT_PRIOR)
    arrays = _as_arrays(sequences, vocab_size)
    counts = np.bincount(np.concatenate(arrays), minlength=vocab_size).astype(np.float64)
    return (counts + add_k) / (counts.sum() + add_k * vocab_size)


def bigram_counts(sequences, vocab_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The bigrams (c, x) inside each sequence (none across sequence boundaries), as sorted
    (contexts int64 [nnz], next ids int64 [nnz], counts int64 [nnz]), unique pairs."""
    arrays = _as_arrays(sequences, vocab_size)
    pairs = [a[:-1] * vocab_size + a[1:] for a in arrays if a.size >= 2]
    if not pairs:
        raise ValueError("sequences: no sequence has two tokens, so there are no bigrams")
    keys, counts = np.unique(np.concatenate(pairs), return_counts=True)
    return keys // vocab_size, keys % vocab_size, counts


def fit_unigram(
    sequences, vocab_size: int, add_k: float = DEFAULT_ADD_K
) -> tuple[UnigramDrafter, UnigramTables]:
    """A UnigramDrafter and its table, fitted on token sequences (lists of ids)."""
    u = unigram_probs(sequences, vocab_size, add_k)
    return UnigramDrafter(vocab_size), UnigramTables(log_probs=jnp.asarray(np.log(u), jnp.float32))


def fit_bigram(
    sequences, vocab_size: int, add_k: float = DEFAULT_ADD_K, prior: float = DEFAULT_PRIOR
) -> tuple[BigramDrafter, BigramTables]:
    """A BigramDrafter and its sparse tables, fitted on token sequences (lists of ids).

    add_k smooths the unigram the bigram backs off to; prior is the backoff's pseudo-count.
    """
    _check(vocab_size, add_k, prior)
    sequences = list(sequences)
    u = unigram_probs(sequences, vocab_size, add_k)
    contexts, next_ids, counts = bigram_counts(sequences, vocab_size)
    per_context = np.bincount(contexts, minlength=vocab_size)  # distinct successors
    totals = np.bincount(contexts, weights=counts, minlength=vocab_size)  # n(c)
    max_row_len = int(per_context.max())
    row_start = np.concatenate([[0], np.cumsum(per_context)])
    pad = np.zeros(max_row_len, np.int64)
    tables = BigramTables(
        smoothing=jnp.asarray(prior * u, jnp.float32),
        denominator=jnp.asarray(totals + prior, jnp.float32),
        row_start=jnp.asarray(row_start, jnp.int32),
        next_ids=jnp.asarray(np.concatenate([next_ids, pad]), jnp.int32),
        next_counts=jnp.asarray(np.concatenate([counts, pad]), jnp.float32),
    )
    return BigramDrafter(vocab_size, max_row_len), tables


def dense_bigram(tables: BigramTables, contexts: Sequence[int]) -> np.ndarray:
    """p(. | c) for each given context, float64 [len(contexts), V], computed from the stored
    tables on the host (a reference for tests; the drafter computes the same rows in JAX)."""
    smoothing = np.asarray(tables.smoothing, np.float64)
    start = np.asarray(tables.row_start)
    ids, counts = np.asarray(tables.next_ids), np.asarray(tables.next_counts, np.float64)
    rows = np.zeros((len(contexts), smoothing.size))
    for i, c in enumerate(contexts):
        rows[i] = smoothing
        np.add.at(rows[i], ids[start[c] : start[c + 1]], counts[start[c] : start[c + 1]])
        rows[i] /= float(np.asarray(tables.denominator)[c])
    return rows


def most_frequent(sequences, vocab_size: int, count: int, always: Sequence[int] = ()) -> np.ndarray:
    """The `count` most frequent token ids of the sequences (ties: the smaller id first), plus
    every id of `always` (e.g. the stop tokens) in place of the least frequent: int64 [count],
    sorted. The token set of a vocabulary-trimmed draft (spec_jax.drafting.model.trim_vocabulary)."""
    if not is_int(count) or not 1 <= count <= vocab_size:
        raise ValueError(f"count must be an integer in [1, {vocab_size}], got {count!r}")
    always = np.unique(np.asarray(always, np.int64))
    if always.size > count or (always.size and (always.min() < 0 or always.max() >= vocab_size)):
        raise ValueError(f"always: at most {count} ids in [0, {vocab_size})")
    counts = np.bincount(np.concatenate(_as_arrays(sequences, vocab_size)), minlength=vocab_size)
    counts[always] = -1  # taken first, below
    ranked = np.lexsort((np.arange(vocab_size), -counts))  # most frequent first, ties by id
    chosen = ranked[: count - always.size]
    return np.sort(np.concatenate([always, chosen]))
