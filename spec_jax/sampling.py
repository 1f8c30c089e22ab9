"""Logits -> warped probabilities -> tokens. The one warp and the one draw every loop uses.

Speculative sampling is lossless with respect to the *warped* target, so the same warp is
applied to target and draft logits before the rejection rule. Temperature 0 warps to the
one-hot argmax (ties go to the lowest token id), which turns the rejection rule into exact
greedy verification.

Randomness is per row: every loop carries one key per row ([B] keys) and row b draws only
from its own, so a row's sample depends on (seed, the row's id) and never on the other rows
of its batch (spec_jax.api derives the row keys from the seed and each prompt's index).
"""

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from models.settings import is_int

# The most probable tokens whose warp is computed without sorting the vocabulary, where they hold
# a row's top-k or top-p (warp): a sort of 151,936 tokens costs about 55 ms a row on 2 cores.
CANDIDATES = 1024


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One request's warp settings (host side, validated, hashable): temperature >= 0 (0 = greedy;
    any positive value samples, however small), top_k >= 0 (0 = off), top_p in (0, 1]. The loops
    read them per row (for_rows: RowSampling), so requests of different settings share a chunk."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        validate_sampling(self.temperature, self.top_k, self.top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def for_rows(self, batch: int) -> "RowSampling":
        """These settings for each of `batch` rows."""
        return RowSampling.of([self] * batch)


@flax.struct.dataclass
class RowSampling:
    """Each row's warp settings as arrays: operands of the compiled loops, not static settings,
    so greedy and sampled rows run in one chunk and a new value compiles nothing."""

    temperature: jax.Array  # float32 [B]: 0 is greedy
    top_k: jax.Array  # int32 [B]: 0 is off
    top_p: jax.Array  # float32 [B]: 1 is off

    @classmethod
    def of(cls, settings) -> "RowSampling":
        """The rows of settings (a sequence of SamplingParams, one per row), as host arrays."""
        return cls(
            temperature=np.asarray([s.temperature for s in settings], np.float32),
            top_k=np.asarray([s.top_k for s in settings], np.int32),
            top_p=np.asarray([s.top_p for s in settings], np.float32),
        )

    @classmethod
    def greedy_rows(cls, batch: int) -> "RowSampling":
        return SamplingParams(0.0).for_rows(batch)

    def for_rows(self, batch: int) -> "RowSampling":
        if self.temperature.shape != (batch,):
            raise ValueError(f"RowSampling of {self.temperature.shape} rows for a batch of {batch}")
        return self

    @property
    def greedy(self) -> jax.Array:
        """bool [B]: the rows at temperature 0."""
        return self.temperature == 0.0


def validate_sampling(temperature, top_k, top_p):
    """Raises ValueError naming the argument and its allowed range."""
    if not 0.0 <= temperature < float("inf"):
        raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy), got {temperature}")
    if not (is_int(top_k) and top_k >= 0):
        raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def warp(logits, sampling):
    """Probabilities [B, ..., V] float32 from logits [B, ..., V], each row b by its own settings
    (sampling: RowSampling of B rows, or one SamplingParams for every row): temperature, then
    top-k, then top-p.

    Temperature 0 is the one-hot argmax (ties go to the lowest id). top-k keeps exactly k tokens
    (ties broken toward lower ids); top-p keeps the smallest set of most probable tokens whose
    mass reaches p. A row's probabilities are the same bits whatever the other rows ask: the
    work that only some rows need (the sort of top-k and top-p; any sampling at all) runs under
    a lax.cond when some row needs it, and the rows that do not take the values every path
    computes alike (a batch of greedy rows costs the argmax alone).
    """
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    rows = sampling.for_rows(logits.shape[0])

    def per_row(x):  # [B] -> [B, 1, ..., 1], against logits
        return jnp.reshape(x, x.shape + (1,) * (logits.ndim - 1))

    greedy = per_row(rows.greedy)
    one_hot = jax.nn.one_hot(argmax(logits), vocab, dtype=jnp.float32)

    def sampled():
        # Subtract the maximum BEFORE dividing: the top entry is then exactly 0 for any positive
        # temperature and the others <= 0 (-inf at worst), so no entry overflows to +inf. Dividing
        # first let XLA round the two uses of logits / T differently under jit: with T ~ 1e-9 the
        # top entry became inf, the row NaN, and the draw returned token 0. A temperature below
        # float32's smallest normal number would be flushed to 0 (0 / 0 = NaN); it acts as that
        # number instead, which is the same distribution: no two distinct float32 logits are that
        # close, so every token but the exact ties of the maximum gets probability 0 either way.
        temperature = per_row(jnp.maximum(rows.temperature, np.finfo(np.float32).tiny))
        z = (logits - jnp.max(logits, axis=-1, keepdims=True)) / temperature
        plain = jax.nn.softmax(z, axis=-1)
        k = per_row(jnp.where((rows.top_k > 0) & (rows.top_k < vocab), rows.top_k, vocab))
        p = per_row(rows.top_p)
        filters = (k < vocab) | (p < 1.0)

        probs = jax.lax.cond(jnp.any(filters), lambda: _filtered(z, plain, k, p, filters), lambda: plain)
        return jnp.where(greedy, one_hot, probs)

    return jax.lax.cond(jnp.all(greedy), lambda: one_hot, sampled)


def _full_sort(z, k, p):
    """The top-k / top-p warp of z [B, ..., V] (k, p: per row, broadcast against it) over the sorted
    vocabulary."""
    vocab = z.shape[-1]
    order = jnp.argsort(-z, axis=-1, stable=True)  # most probable first, ties: lower id
    positions = jnp.broadcast_to(jnp.arange(vocab, dtype=jnp.int32), z.shape)
    rank = jnp.put_along_axis(jnp.zeros_like(positions), order, positions, axis=-1, inplace=False)
    probs = jax.nn.softmax(jnp.where(rank < k, z, -jnp.inf), axis=-1)
    sorted_probs = jnp.take_along_axis(probs, order, axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    kept = jnp.take_along_axis(mass_before, rank, axis=-1) < p  # keeps the most probable
    nucleus = jnp.where(kept, probs, 0.0)
    nucleus = nucleus / jnp.sum(nucleus, axis=-1, keepdims=True)
    return jnp.where(p < 1.0, nucleus, probs)


def _filtered(z, plain, k, p, filters):
    """warp's filtered probabilities of z (plain: softmax(z); k, p, filters: per row, broadcast):
    from the CANDIDATES most probable tokens where they hold a row's kept set, else the sort."""
    vocab = z.shape[-1]
    # The CANDIDATES most probable tokens (lax.top_k: ties to the lower id, as the sort's)
    # hold the whole kept set of a row whose top-k is at most that many, or whose top-p
    # is reached before the last candidate: the tokens past them could only follow it. That
    # row's warp is computed over them; only another row needs the sort of every token.
    c = min(CANDIDATES, vocab)
    z_c, ids = jax.lax.top_k(z, c)
    in_k = jnp.arange(c) < k
    e = jnp.where(in_k, jnp.exp(z_c), 0.0)
    probs_c = jnp.where(
        k < vocab, e / jnp.sum(e, axis=-1, keepdims=True), jnp.take_along_axis(plain, ids, -1)
    )
    mass_before = jnp.cumsum(probs_c, axis=-1) - probs_c
    nucleus = jnp.where(in_k & (mass_before < p), probs_c, 0.0)
    nucleus = jnp.where(p < 1.0, nucleus / jnp.sum(nucleus, axis=-1, keepdims=True), probs_c)
    from_candidates = jnp.put_along_axis(jnp.zeros_like(z), ids, nucleus, axis=-1, inplace=False)
    whole = jnp.where(p < 1.0, (k <= c) | (mass_before[..., -1:] >= p), k <= c)
    sort = filters & ~whole
    every = jax.lax.cond(jnp.any(sort), lambda: _full_sort(z, k, p), lambda: from_candidates)
    return jnp.where(filters, jnp.where(whole, from_candidates, every), plain)


def argmax(x):
    """int32 [...]: jnp.argmax(x, axis=-1), the first maximum of each row (its first NaN where it
    has one), by plain reductions (a maximum, then the least index holding it), which XLA:CPU
    vectorizes: its argmax is a scalar loop, 10x slower over a 152k vocabulary."""
    top = jnp.max(x, axis=-1, keepdims=True)  # NaN where the row has one
    index = jnp.arange(x.shape[-1], dtype=jnp.int32)
    return jnp.min(jnp.where((x == top) | jnp.isnan(x), index, x.shape[-1]), axis=-1)


def draw(key, probs):
    """One token id per row of probs [..., V] (int32 [...]). Zero-probability tokens never come out."""
    return jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)


def row_keys(key, row_ids_b):
    """[B] keys, key b = fold_in(key, row_ids[b]): a row's randomness depends on (key, its id) alone."""
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.asarray(row_ids_b, jnp.uint32))


def split_rows(keys_b, num: int):
    """Splits each row's key: [num, B] keys (row b's new keys come from keys[b] alone)."""
    return jnp.swapaxes(jax.vmap(lambda k: jax.random.split(k, num))(keys_b), 0, 1)


def draw_rows(keys_b, probs_bv):
    """One token per row of [B, V] probabilities, row b drawn with keys[b]: int32 [B].

    Where every row has exactly one nonzero entry (greedy decoding's one-hot distributions, and
    their residuals), that entry is what the draw returns whatever the key (every other token's
    log-probability is -inf), so it is taken without the draw's V random numbers and logarithms
    (most of a greedy token's sampling time over a 152k vocabulary)."""
    nonzero = probs_bv != 0

    def point_masses():
        index = jnp.arange(probs_bv.shape[-1], dtype=jnp.int32)
        return jnp.min(jnp.where(nonzero, index, probs_bv.shape[-1]), axis=-1)

    single = jnp.all(jnp.sum(nonzero, axis=-1) == 1)
    return jax.lax.cond(single, point_masses, lambda: jax.vmap(draw)(keys_b, probs_bv))
