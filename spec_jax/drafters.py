"""What can propose draft tokens. A draft model is one kind of drafter.

A drafter is a frozen (hashable) dataclass of static settings, so it can be a static
argument of jax.jit; its arrays (model parameters, n-gram tables) and its state (a KV
cache) are pytrees passed through the loop.

The loop calls `init` once after the prompt and `propose` once per round with the last two
committed tokens. Feeding both, at positions n-2 and n-1, keeps the drafter's cache equal to
the committed prefix in every case: after a fully accepted round the drafter has not yet
seen its own last draft (it is token n-2 now), and after a rejection the rejected entries
past n-2 are overwritten before they can be read.
"""

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.transformer import forward
from spec_jax.decode import prefill, row_keys
from spec_jax.sampling import SamplingParams, draw, warp


class Drafter(Protocol):
    vocab_size: int
    max_seq_len: int

    def init(self, params: Any, tokens_bp, prompt_lens_b, cache_len: int) -> Any:
        """The drafter's state after reading the padded prompts [B, P]."""

    def propose(
        self, params: Any, state: Any, context_b2, length_b, gamma: int, sampling: SamplingParams, key
    ) -> tuple[jax.Array, jax.Array, Any]:
        """Drafts gamma tokens per row.

        context_b2: the last two committed tokens of each row, at positions length-2, length-1.
        Returns (tokens int32 [B, gamma], q float32 [B, gamma, V] the warped distributions
        each token was sampled from, new state).
        """


@dataclasses.dataclass(frozen=True)
class ModelDrafter:
    """A small transformer drafting autoregressively from its own KV cache."""

    config: ModelConfig

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len

    def init(self, params, tokens_bp, prompt_lens_b, cache_len):
        _, cache = prefill(self.config, params, tokens_bp, prompt_lens_b, cache_len)
        return cache

    def propose(self, params, cache, context_b2, length_b, gamma, sampling, key):
        positions = (length_b - 2)[:, None] + jnp.arange(2)[None, :]
        logits, cache = forward(
            self.config, params, context_b2, positions, cache, logits_at=jnp.ones_like(length_b)[:, None]
        )
        keys = jax.random.split(key, gamma)
        q0 = warp(logits[:, 0], sampling)
        x0 = jax.vmap(draw)(row_keys(keys[0], q0.shape[0]), q0)

        def step(carry, step_key):
            token, position, cache = carry
            logits, cache = forward(self.config, params, token[:, None], position[:, None], cache)
            q = warp(logits[:, 0], sampling)
            nxt = jax.vmap(draw)(row_keys(step_key, q.shape[0]), q)
            return (nxt, position + 1, cache), (nxt, q)

        (_, _, cache), (xs, qs) = jax.lax.scan(step, (x0, length_b, cache), keys[1:])
        tokens = jnp.concatenate([x0[:, None], xs.T], axis=1)  # [B, G]
        q = jnp.concatenate([q0[:, None], jnp.swapaxes(qs, 0, 1)], axis=1)  # [B, G, V]
        return tokens, q, cache
