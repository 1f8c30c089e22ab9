"""spec-jax: speculative decoding in JAX, on top of the models in `models`.

`spec_jax.generate(target, prompts, draft=..., gamma=..., max_new_tokens=...)` is the entry
point; see spec_jax.api. `models` imports nothing from this package.
"""

from spec_jax.api import Generation, generate

__all__ = ["Generation", "generate"]
