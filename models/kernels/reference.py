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


# The most queries a tree call may have: one bit per query in an int32 (bit 31 is the sign bit).
MAX_TREE_QUERIES = 32


def check_tree(tree, q_shape) -> None:
    """ValueError unless `tree` is None or an integer [B, T] array with T <= MAX_TREE_QUERIES
    matching the queries [B, T, H, D]."""
    if tree is None:
        return
    b, t = q_shape[:2]
    dtype = getattr(tree, "dtype", None)
    if np.shape(tree) != (b, t) or dtype is None or not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(
            f"tree must be None or an integer [B, T] = [{b}, {t}] array, got shape {np.shape(tree)}"
        )
    if t > MAX_TREE_QUERIES:
        raise ValueError(f"tree: a tree call takes at most {MAX_TREE_QUERIES} queries, got T = {t}")


def mask_bits(mask_btj) -> jax.Array:
    """int32 [B, T]: a boolean mask over the call's own keys [B, T, J] (J <= MAX_TREE_QUERIES) as
    `tree` bits, bit j of query t set where mask[b, t, j] (bit 31 is the sign bit)."""
    weights = jnp.left_shift(jnp.int32(1), jnp.arange(mask_btj.shape[-1], dtype=jnp.int32))
    return jnp.sum(mask_btj.astype(jnp.int32) * weights, axis=-1, dtype=jnp.int32)  # distinct bits


def tree_window_bits(q_positions, window) -> jax.Array:
    """int32 [B, T]: bit j of query t set where p_t - p_j < window, for the queries' own keys in a
    tree call (the window on the tree's keys, by their positions, to and with a tree's bits)."""
    p = q_positions.astype(jnp.int32)
    return mask_bits((p[:, :, None] - p[:, None, :]) < jnp.asarray(window, jnp.int32))


def attention_mask(q_positions, kv_lengths, num_keys, window=None, tree=None):
    """Boolean [B, T, S]: key s is visible to query t of row b.

    A query at position p sees keys at positions s <= p and s < kv_lengths[b], and, with a
    window (an int32 scalar, see check_window), p - s < window: the sliding-window mask of
    Hugging Face transformers (Mistral, Gemma 3's local layers), the query's own key included.

    With a tree (int32 [B, T], check_tree) the T queries are the nodes of a token tree whose keys
    sit in the call's last T slots, kv_lengths[b] - T + j for query j: a key s below them (the
    committed text) is visible by the rule above, and key kv_lengths[b] - T + j is visible to
    query t exactly when bit j of tree[b, t] is set (the window does not apply to those keys: the
    caller folds it into the bits). A chain (positions equal to the slots, tree[b, t] the bits
    0..t) is the causal mask itself.
    """
    s = jnp.arange(num_keys, dtype=jnp.int32)
    p = q_positions.astype(jnp.int32)[:, :, None]
    kv_lengths = kv_lengths.astype(jnp.int32)
    causal = s[None, None, :] <= p
    if tree is not None:
        first = (kv_lengths - q_positions.shape[1])[:, None, None]  # the tree's first slot
        causal = causal & (s[None, None, :] < first)
    valid = s[None, None, :] < kv_lengths[:, None, None]
    mask = causal & valid
    if window is not None:
        # p - s >= 0 wherever causal holds, so the difference cannot wrap there.
        mask = mask & (p - s[None, None, :] < jnp.asarray(window, jnp.int32))
    if tree is None:
        return mask
    j = s[None, None, :] - first  # the key's node index within the tree, where 0 <= j < T
    in_tree = (j >= 0) & (j < q_positions.shape[1]) & valid
    bit = (tree.astype(jnp.int32)[:, :, None] >> jnp.clip(j, 0, 31)) & 1
    return mask | (in_tree & (bit == 1))


def attention_reference(q, k, v, q_positions, kv_lengths, window=None, tree=None):
    """Grouped-query attention over a cache, computed densely.

    Args:
      q: [B, T, H, D] queries.
      k, v: [B, S, KVH, D] keys and values; H is a multiple of KVH and query head h
        reads kv head h // (H // KVH).
      q_positions: [B, T] int, the absolute position of each query.
      kv_lengths: [B] int, keys at positions >= kv_lengths[b] are never read.
      window: None (no limit) or an int32 scalar (a Python int or a traced value): a query at
        position p sees only keys s with p - s < window (check_window).
      tree: None or int32 [B, T]: the queries are a token tree's nodes (attention_mask).

    Returns:
      [B, T, H, D] in q's dtype; scores, softmax and accumulation in float32. A query
      that sees no key gets zeros.
    """
    check_window(window)
    check_tree(tree, q.shape)
    b, t, h, d = q.shape
    kvh = k.shape[2]
    g = h // kvh
    qg = q.reshape(b, t, kvh, g, d).astype(jnp.float32)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(jnp.float32)) * (d**-0.5)
    mask = attention_mask(q_positions, kv_lengths, k.shape[1], window, tree)[:, None, None]
    scores = jnp.where(mask, scores, DEFAULT_MASK_VALUE)
    weights = jax.nn.softmax(scores, axis=-1)
    weights = jnp.where(mask, weights, 0.0)
    out = jnp.einsum("bkgts,bskd->btkgd", weights, v.astype(jnp.float32))
    return out.reshape(b, t, h, d).astype(q.dtype)
