"""Attention behind one contract, with a dispatcher over implementations.

`attention(q[B,T,H,D], k[B,S,KVH,D], v[B,S,KVH,D], q_positions[B,T], kv_lengths[B])`:
query at position q_positions[b,t] attends keys at positions s <= q_positions[b,t] and
s < kv_lengths[b]; H is a multiple of KVH; float32 or bfloat16 in, same dtype out,
accumulation in float32.
"""

from spec_jax.kernels.reference import DEFAULT_MASK_VALUE, attention_mask, attention_reference

IMPLS = ("auto", "xla")


def resolve_impl(impl: str) -> str:
    """Maps "auto" to the implementation for the default backend."""
    if impl not in IMPLS:
        raise ValueError(f"attention impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "xla"
    return impl


def attention(q, k, v, q_positions, kv_lengths, *, impl: str = "auto", interpret: bool = False):
    """Returns [B, T, H, D]; see the module docstring for the masking contract."""
    del interpret  # used by the Pallas implementations
    impl = resolve_impl(impl)
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"num query heads {q.shape[2]} is not a multiple of kv heads {k.shape[2]}")
    return attention_reference(q, k, v, q_positions, kv_lengths)


__all__ = [
    "DEFAULT_MASK_VALUE",
    "IMPLS",
    "attention",
    "attention_mask",
    "attention_reference",
    "resolve_impl",
]
