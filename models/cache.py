"""The KV cache: a pytree of stacked keys and values, written by position.

A model call writes the keys/values of its T new tokens at their absolute positions and
attends with the causal bound, so "rolling back" rejected tokens is simply not counting
them: the decode loops keep each row's committed length and always write the next tokens
from there, overwriting whatever a rejected draft left behind before it can be read.
"""

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class KVCache:
    """Keys and values of every layer.

    k, v: [L, B, S, K, E] (K kv heads, E head dim). Slot s holds the token at absolute position s.
    """

    k: jax.Array
    v: jax.Array

    @classmethod
    def zeros(cls, num_layers, batch, max_len, num_kv_heads, head_dim, dtype=jnp.float32) -> "KVCache":
        shape = (num_layers, batch, max_len, num_kv_heads, head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

    @property
    def max_len(self) -> int:
        return self.k.shape[2]


def write_layer(cache_lbske, layer, new_btke, positions_bt):
    """Writes new [B, T, K, E] into layer `layer` of a [L, B, S, K, E] cache at positions [B, T].

    Positions outside [0, S) are dropped rather than clamped, so a row that runs past the
    cache can never overwrite a committed entry.
    """
    b_idx = jnp.arange(new_btke.shape[0])[:, None]
    return cache_lbske.at[layer, b_idx, positions_bt].set(new_btke.astype(cache_lbske.dtype), mode="drop")
