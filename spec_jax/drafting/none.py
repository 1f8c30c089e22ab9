"""NoDrafter: proposes nothing, so that plain autoregressive decoding is the speculative loop
with gamma = 0 (spec_jax.speculative)."""

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from spec_jax.drafting.base import UNBOUNDED_CONTEXT, Drafter, Proposal


@dataclasses.dataclass(frozen=True)
class NoDrafter(Drafter):
    """Proposes nothing: with gamma = 0 the loop is plain autoregressive decoding."""

    vocab_size: int
    max_seq_len: int = UNBOUNDED_CONTEXT
    prefill_calls: int = 0
    sources: ClassVar[tuple[str, ...]] = ()
    resumable: ClassVar[bool] = True

    def propose(self, params, state, context_b2, length_b, gamma, sampling, keys_b):
        if gamma:
            raise ValueError(f"NoDrafter proposes nothing: gamma must be 0, got {gamma}")
        batch = context_b2.shape[0]
        return Proposal(
            jnp.zeros((batch, 0), jnp.int32), jnp.zeros((batch, 0, self.vocab_size), jnp.float32), state
        )

    def resume(self, params, state, text_bs, synced_b, length_b, width):
        return state
