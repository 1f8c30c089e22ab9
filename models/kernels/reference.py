"""Plain-XLA attention: the reference every kernel is tested against."""

import jax
import jax.numpy as jnp

# Added to masked scores. Finite so that a fully masked row gives zeros, not NaN.
DEFAULT_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def attention_mask(q_positions, kv_lengths, num_keys):
    """Boolean [B, T, S]: key s is visible to query t of row b.

    A query at position p sees keys at positions s <= p and s < kv_lengths[b].
    """
    s = jnp.arange(num_keys, dtype=jnp.int32)
    causal = s[None, None, :] <= q_positions[:, :, None]
    valid = s[None, None, :] < kv_lengths[:, None, None]
    return causal & valid


def attention_reference(q, k, v, q_positions, kv_lengths):
    """Grouped-query attention over a cache, computed densely.

    Args:
      q: [B, T, H, D] queries.
      k, v: [B, S, KVH, D] keys and values; H is a multiple of KVH and query head h
        reads kv head h // (H // KVH).
      q_positions: [B, T] int, the absolute position of each query.
      kv_lengths: [B] int, keys at positions >= kv_lengths[b] are never read.

    Returns:
      [B, T, H, D] in q's dtype; scores, softmax and accumulation in float32. A query
      that sees no key gets zeros.
    """
    b, t, h, d = q.shape
    kvh = k.shape[2]
    g = h // kvh
    qg = q.reshape(b, t, kvh, g, d).astype(jnp.float32)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(jnp.float32)) * (d**-0.5)
    mask = attention_mask(q_positions, kv_lengths, k.shape[1])[:, None, None]
    scores = jnp.where(mask, scores, DEFAULT_MASK_VALUE)
    weights = jax.nn.softmax(scores, axis=-1)
    weights = jnp.where(mask, weights, 0.0)
    out = jnp.einsum("bkgts,bskd->btkgd", weights, v.astype(jnp.float32))
    return out.reshape(b, t, h, d).astype(q.dtype)
