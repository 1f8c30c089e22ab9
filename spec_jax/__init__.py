"""spec-jax: speculative decoding in JAX.

`spec_jax.generate(target, prompts, draft=..., gamma=..., max_new_tokens=...)` is the entry
point; see spec_jax.api. It is loaded lazily so that `models` and `spec_jax` can import
each other's submodules in either order.
"""

_API = ("generate", "Generation")


def __getattr__(name):
    if name in _API:
        from spec_jax import api

        return getattr(api, name)
    raise AttributeError(f"module 'spec_jax' has no attribute {name!r}")


__all__ = list(_API)
