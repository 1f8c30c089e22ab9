"""The CPU kernels' row-wise prefill (spec_jax.decode.prefill runs it there): each row read
PREFILL_CHUNK positions per model call, in one lax.while_loop over (row, chunk) that stops at
each row's own length (prefill_rows), from the end of its cached prefix where the prefix cache
holds one (read_prefix: the pool's blocks copied into the row's cache first).
"""

import jax
import jax.numpy as jnp

from models.cache import KVCache
from models.config import ModelConfig
from models.transformer import ForwardOutput, forward, head_logits, output_head

PREFILL_CHUNK = 32  # positions per model call of a row-wise prefill (prefill_rows)


def prefill_rows(
    config: ModelConfig, params, tokens_bp, prompt_lens_b, cache, chunk: int, with_features=False, start_b=None
) -> ForwardOutput:  # fmt: skip
    """prefill's result (a ForwardOutput), computed one row and `chunk` positions per model call,
    in one lax.while_loop over (row, chunk) that stops at each row's own length: a row of n
    tokens costs ceil(n / chunk) calls whatever the batch's longest prompt. A row's last chunk
    is moved back to end at the padded width where it would run past it (its overlap is
    recomputed: the same entries), so that every call has the shape [1, chunk]; a chunk the
    prompt does not fill runs its CPU kernels' products over the prompt's rows only (forward's
    live_tokens). The output head runs in the call holding the row's last prompt token alone (a
    lax.cond: the Qwen 1.5B's head reads 190 MB). Cache slots past a row's prompt hold the
    padding's entries (never read: decoding overwrites them first). start_b (int32 [B],
    multiples of chunk below each row's length; default 0): each row's first position to read,
    the cache holding the ones before (prefill's prefix)."""
    batch, width = tokens_bp.shape
    c = min(chunk, width)
    start_b = jnp.zeros((batch,), jnp.int32) if start_b is None else start_b
    next_start = jnp.concatenate([start_b[1:], jnp.zeros((1,), jnp.int32)])  # after row r: row r + 1's
    config = config.replace(bulk_products=True)  # nothing compares a prefill row with a decode step's
    logits, features = _prefill_outputs(
        config, params, tokens_bp[:1, :c], _row(cache, 0), batch, width, with_features
    )

    def body(carry):
        r, s, cache, logits, features = carry
        start = jnp.minimum(s, width - c)
        last = prompt_lens_b[r] - 1
        out = forward(
            config,
            params,
            jax.lax.dynamic_slice(tokens_bp, (r, start), (1, c)),
            (start + jnp.arange(c, dtype=jnp.int32))[None, :],
            _row(cache, r),
            logits_at="none",
            with_features=True,
            live_tokens=jnp.minimum(prompt_lens_b[r] - start, c),
        )
        row_cache = out.cache
        cache = cache.replace(
            k=jax.lax.dynamic_update_slice_in_dim(cache.k, row_cache.k, r, axis=1),
            v=jax.lax.dynamic_update_slice_in_dim(cache.v, row_cache.v, r, axis=1),
        )
        holds_last = (last >= start) & (last < start + c)
        at = jnp.clip(last - start, 0, c - 1)
        logits = jax.lax.cond(
            holds_last, lambda: logits.at[r].set(_head_at(config, params, out.features, at)), lambda: logits
        )
        if with_features:
            features = jax.lax.dynamic_update_slice(features, out.features, (r, start, 0))
        row_done = s + c >= prompt_lens_b[r]
        return r + row_done, jnp.where(row_done, next_start[r], s + c), cache, logits, features

    zero = jnp.zeros((), jnp.int32)
    _, _, cache, logits, features = jax.lax.while_loop(
        lambda carry: carry[0] < batch, body, (zero, start_b[0], cache, logits, features)
    )
    return ForwardOutput(logits=logits, cache=cache, features=features)


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


def _head_at(config: ModelConfig, params, features_1td, index):
    """The output head's logits [V] at position `index` (traced) of features [1, T, D]."""
    at = jax.lax.dynamic_slice_in_dim(features_1td, index, 1, axis=1)
    return head_logits(config, output_head(config, params), at)[0, 0]


def _row(cache, r):
    """Row r of a [L, B, S, K, E] cache as a batch of one."""
    return cache.replace(
        k=jax.lax.dynamic_slice_in_dim(cache.k, r, 1, axis=1),
        v=jax.lax.dynamic_slice_in_dim(cache.v, r, 1, axis=1),
    )
