"""spec-jax: speculative decoding in JAX, on top of the models in `models`.

`spec_jax.generate(target, prompts, draft=...)` runs a batch (texts, conversations or token
ids; spec_jax.api); `spec_jax.stream(...)` yields each prompt's text as it comes (on an Engine), and
`spec_jax.Engine` serves requests (`spec_jax.Request`) that come and go (spec_jax.engine).
`models` imports nothing from this package.
"""

from spec_jax.api import Generation, generate, stream
from spec_jax.engine import Engine, Update
from spec_jax.request import Request, RequestError

__all__ = ["Engine", "Generation", "Request", "RequestError", "Update", "generate", "stream"]
