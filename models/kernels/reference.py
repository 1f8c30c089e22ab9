"""Plain-XLA attention: the reference every kernel is tested against."""

import jax
import jax.numpy as jnp
import numpy as np

from models import settings

# Added to masked scores. Finite so that a fully masked row gives zeros, not NaN.
DEFAULT_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# The largest window: an int32 (what a traced window is; the model's global layers pass it).
MAX_WINDOW = int(jnp.iinfo(jnp.int32).max)


def check_window(window) -> None:
    """ValueError unless `window` is None, an int in [1, MAX_WINDOW], or an integer scalar array.

    A Python (or NumPy) int is checked for its range; a jax scalar (traced, e.g. chosen per layer
    inside a scan) only for its shape and dtype: its value is not known while tracing. A traced
    window <= 0 hides every key (each query then returns zeros), as the mask below says.
    """
    if window is None:
        return
    if settings.is_int(window):  # a bool is not (it falls to the dtype check below)
        if not 1 <= window <= MAX_WINDOW:
            raise ValueError(f"window must be None or an integer in [1, {MAX_WINDOW}], got {window}")
        return
    shape, dtype = np.shape(window), getattr(window, "dtype", None)
    if shape != () or dtype is None or not jnp.issubdtype(dtype, jnp.integer):
        got = f"shape {shape} dtype {dtype}" if dtype is not None else repr(window)
        raise ValueError(
            f"window must be None or an integer in [1, {MAX_WINDOW}] (or an integer scalar array), got {got}"
        )


def attention_mask(q_positions, kv_lengths, num_keys, window=None):
    """Boolean [B, T, S]: key s is visible to query t of row b.

    A query at position p sees keys at positions s <= p and s < kv_lengths[b], and, with a
    window (an int32 scalar, see check_window), p - s < window: the sliding-window mask of
    Hugging Face transformers (Mistral, Gemma 3's local layers), the query's own key included.
    """
    s = jnp.arange(num_keys, dtype=jnp.int32)
    causal = s[None, None, :] <= q_positions[:, :, None]
    valid = s[None, None, :] < kv_lengths[:, None, None]
    mask = causal & valid
    if window is None:
        return mask
    # p - s >= 0 wherever causal holds, so the difference cannot wrap there.
    recent = q_positions.astype(jnp.int32)[:, :, None] - s[None, None, :] < jnp.asarray(window, jnp.int32)
    return mask & recent


def attention_reference(q, k, v, q_positions, kv_lengths, window=None):
    """Grouped-query attention over a cache, computed densely.

    Args:
      q: [B, T, H, D] queries.
      k, v: [B, S, KVH, D] keys and values; H is a multiple of KVH and query head h
        reads kv head h // (H // KVH).
      q_positions: [B, T] int, the absolute position of each query.
      kv_lengths: [B] int, keys at positions >= kv_lengths[b] are never read.
      window: None (no limit) or an int32 scalar (a Python int or a traced value): a query at
        position p sees only keys s with p - s < window (check_window).

    Returns:
      [B, T, H, D] in q's dtype; scores, softmax and accumulation in float32. A query
      that sees no key gets zeros.
    """
    check_window(window)
    b, t, h, d = q.shape
    kvh = k.shape[2]
    g = h // kvh
    qg = q.reshape(b, t, kvh, g, d).astype(jnp.float32)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(jnp.float32)) * (d**-0.5)
    mask = attention_mask(q_positions, kv_lengths, k.shape[1], window)[:, None, None]
    scores = jnp.where(mask, scores, DEFAULT_MASK_VALUE)
    weights = jax.nn.softmax(scores, axis=-1)
    weights = jnp.where(mask, weights, 0.0)
    out = jnp.einsum("bkgts,bskd->btkgd", weights, v.astype(jnp.float32))
    return out.reshape(b, t, h, d).astype(q.dtype)
