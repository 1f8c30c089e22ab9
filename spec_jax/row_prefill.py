"""The CPU kernels' row-wise prefill (spec_jax.decode.prefill runs it there): each row read
PREFILL_CHUNK positions per model call, in one lax.while_loop that stops at each row's own
length (prefill_rows), from the end of its cached prefix where the prefix cache holds one
(read_prefix: the pool's blocks copied into the row's cache first).

prefill_rows(batched=True) reads the next chunk of every row in one call ([B, chunk] positions)
while more than half the rows have chunks left, with the same bits for each row as alone
(tests/test_prefill.py). decode.prefill does not take it: on the 2-core Xeon (AVX-512 VNNI, the
multi-row kernels) a position costs the same in a call of 32 rows as of 256, so a batched call
only adds each short row's padding to a full chunk (scripts/prefill_rows_bench.py; figures in
docs/benchmarks.md, "Batched prefill of rows past a cached prefix").
"""

import jax
import jax.numpy as jnp

from models.cache import KVCache
from models.config import ModelConfig
from models.transformer import ForwardOutput, forward, head_logits, output_head

PREFILL_CHUNK = 32  # positions per model call of a row-wise prefill (prefill_rows)
# Rows of x ggml's many-row Q4_K product (gemm: bulk_products, on a build without the multi-row
# kernels) takes together; a row left over gets gemv's bits (which differ in the last places), so
# a batched prefill's head rows are padded to a multiple of it, a lone row's too.
GEMM_ROWS = 4


def prefill_rows(
    config: ModelConfig, params, tokens_bp, prompt_lens_b, cache, chunk: int, with_features=False, start_b=None,
    batched=False,
) -> ForwardOutput:  # fmt: skip
    """prefill's result (a ForwardOutput), computed `chunk` positions of a row per model call in
    one lax.while_loop that stops at each row's own length: a row of n tokens takes part in
    ceil(n / chunk) calls whatever the batch's longest prompt. A row's last chunk is moved back
    to end at the padded width where it would run past it (its overlap is recomputed: the same
    entries). A call reads the first unfinished row's next chunk alone ([1, chunk]; the CPU
    kernels' products over the prompt's rows only: forward's live_tokens), or, batched (with a
    chunk a multiple of GEMM_ROWS) while more than half the rows have chunks left, every row's
    next chunk ([B, chunk]; a row already done reads its last chunk again, writing the same
    entries; the padding computed). A row's outputs are the same bits either way and whatever
    the batch holds besides it: each row's products, activation quantization and attention are
    its own (ggml's gemm takes a row's positions in the same groups of 4 either way). The output
    head runs where a row's last prompt token is read (a lax.cond: the Qwen 1.5B's head reads
    190 MB); batched, on rows padded to a multiple of GEMM_ROWS. Cache slots past a row's prompt
    hold the padding's entries (never read: decoding overwrites them first). start_b (int32 [B],
    multiples of chunk below each row's length; default 0): each row's first position to read,
    the cache holding the ones before (prefill's prefix)."""
    batch, width = tokens_bp.shape
    c = min(chunk, width)
    start_b = jnp.zeros((batch,), jnp.int32) if start_b is None else start_b
    config = config.replace(bulk_products=True)  # nothing compares a prefill row with a decode step's
    logits, features = _prefill_outputs(
        config, params, tokens_bp[:1, :c], _row(cache, 0), batch, width, with_features
    )
    batched = batched and c % GEMM_ROWS == 0
    step = _Step(config, params, tokens_bp, prompt_lens_b, c, with_features, GEMM_ROWS if batched else 1)

    def body(carry):
        if not batched or batch == 1:
            return step.one_row(carry)
        left = jnp.sum(carry[0] < prompt_lens_b)
        return jax.lax.cond(2 * left > batch, step.all_rows, step.one_row, carry)

    _, cache, logits, features = jax.lax.while_loop(
        lambda carry: jnp.any(carry[0] < prompt_lens_b), body, (start_b, cache, logits, features)
    )
    return ForwardOutput(logits=logits, cache=cache, features=features)


class _Step:
    """prefill_rows' two kinds of model call, each (next_b, cache, logits, features) -> the same
    after it: next_b (int32 [B]) each row's next chunk's first position (>= its length: done)."""

    def __init__(self, config, params, tokens_bp, prompt_lens_b, c: int, with_features: bool, head_rows: int):
        self.config, self.params, self.tokens_bp, self.lens_b = config, params, tokens_bp, prompt_lens_b
        self.c, self.with_features, self.head_rows = c, with_features, head_rows

    def one_row(self, carry):
        """The first unfinished row's next chunk, [1, c] positions (its padding skipped)."""
        next_b, cache, logits, features = carry
        c, width = self.c, self.tokens_bp.shape[1]
        r = jnp.argmax(next_b < self.lens_b)
        start = jnp.minimum(next_b[r], width - c)
        out = forward(
            self.config,
            self.params,
            jax.lax.dynamic_slice(self.tokens_bp, (r, start), (1, c)),
            (start + jnp.arange(c, dtype=jnp.int32))[None, :],
            _row(cache, r),
            logits_at="none",
            with_features=True,
            live_tokens=jnp.minimum(self.lens_b[r] - start, c),
        )
        cache = cache.replace(
            k=jax.lax.dynamic_update_slice_in_dim(cache.k, out.cache.k, r, axis=1),
            v=jax.lax.dynamic_update_slice_in_dim(cache.v, out.cache.v, r, axis=1),
        )
        last = self.lens_b[r] - 1
        at = jnp.clip(last - start, 0, c - 1)
        row_logits = lambda: logits.at[r].set(  # noqa: E731
            self._heads(jax.lax.dynamic_slice_in_dim(out.features[0], at, 1))[0]
        )
        logits = jax.lax.cond(next_b[r] + c > last, row_logits, lambda: logits)
        if self.with_features:
            features = jax.lax.dynamic_update_slice(features, out.features, (r, start, 0))
        return next_b.at[r].add(c), cache, logits, features

    def all_rows(self, carry):
        """Every row's next chunk, [B, c] positions; a finished row reads its last chunk again."""
        next_b, cache, logits, features = carry
        c, (batch, width) = self.c, self.tokens_bp.shape
        left_b = next_b < self.lens_b
        start_b = jnp.minimum(jnp.where(left_b, next_b, next_b - c), width - c)
        positions_bc = start_b[:, None] + jnp.arange(c, dtype=jnp.int32)[None, :]
        tokens_bc = jnp.take_along_axis(self.tokens_bp, positions_bc, axis=1)
        out = forward(
            self.config, self.params, tokens_bc, positions_bc, cache, logits_at="none", with_features=True
        )
        ends_b = left_b & (next_b + c >= self.lens_b)
        at_b = jnp.clip(self.lens_b - 1 - start_b, 0, c - 1)
        rows = jnp.arange(batch)
        logits = jax.lax.cond(
            jnp.any(ends_b),
            lambda: jnp.where(ends_b[:, None], self._heads(out.features[rows, at_b]), logits),
            lambda: logits,
        )
        if self.with_features:
            features = features.at[rows[:, None], positions_bc].set(out.features)
        return jnp.where(left_b, next_b + c, next_b), out.cache, logits, features

    def _heads(self, features_md):
        """The output head's logits [M, V] of features [M, D], its rows padded with zeros to a
        multiple of head_rows (GEMM_ROWS where batched: every row then takes the same path of
        ggml's Q4_K product, whatever M)."""
        m = features_md.shape[0]
        padded = jnp.pad(features_md, ((0, -m % self.head_rows), (0, 0)))
        return head_logits(self.config, output_head(self.config, self.params), padded[:, None])[:m, 0]


def read_prefix(cache: KVCache, pool: KVCache, blocks_bj) -> KVCache:
    """cache [L, B, S, K, E] with row b's positions [C j, C (j + 1)) (C = PREFILL_CHUNK) set from
    pool [L, N, C, K, E] slot blocks[b, j] wherever that is >= 0 (int32 [B, J]: a row's hit)."""
    b, j = blocks_bj.shape

    def one(cache_x, pool_x):
        taken = pool_x[:, jnp.maximum(blocks_bj, 0)]  # [L, B, J, C, K, E]
        taken = taken.reshape(pool_x.shape[0], b, j * PREFILL_CHUNK, *pool_x.shape[3:])
        have = jnp.repeat(blocks_bj >= 0, PREFILL_CHUNK, axis=1)[None, :, :, None, None]
        head = jnp.where(have, taken.astype(cache_x.dtype), cache_x[:, :, : j * PREFILL_CHUNK])
        return jax.lax.dynamic_update_slice_in_dim(cache_x, head, 0, axis=2)

    return KVCache(k=one(cache.k, pool.k), v=one(cache.v, pool.v))


def _prefill_outputs(config, params, tokens_1c, row_cache, batch: int, width: int, with_features: bool):
    """prefill_rows' outputs before its first call, zeros: logits [B, V] and features [B, P, D]
    (None without with_features), of the dtypes a call over tokens_1c gives."""
    c = tokens_1c.shape[1]
    shapes = jax.eval_shape(
        lambda: forward(config, params, tokens_1c, jnp.zeros((1, c), jnp.int32), row_cache,
                        logits_at=jnp.zeros((1, 1), jnp.int32), with_features=with_features)
    )  # fmt: skip
    logits = jnp.zeros((batch, shapes.logits.shape[-1]), shapes.logits.dtype)
    if not with_features:
        return logits, None
    return logits, jnp.zeros((batch, width, shapes.features.shape[-1]), shapes.features.dtype)


def _row(cache, r):
    """Row r of a [L, B, S, K, E] cache as a batch of one."""
    return cache.replace(
        k=jax.lax.dynamic_slice_in_dim(cache.k, r, 1, axis=1),
        v=jax.lax.dynamic_slice_in_dim(cache.v, r, 1, axis=1),
    )
