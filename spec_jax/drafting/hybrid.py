"""Prompt lookup with a draft model behind it (HybridDrafter): per row and round, lookup where it
finds a match (spec_jax.drafting.lookup, as many drafts as its match supports), the model where
it does not (at most AUTO_GAMMA_MAX drafts: a longer chain of model calls seldom pays, while a
row that copies may run up to AUTO_COPY_GAMMA_MAX)."""

import dataclasses
from typing import Any, ClassVar

import flax.struct
import jax
import jax.numpy as jnp

from spec_jax.drafting.base import AUTO_COPY_GAMMA_MAX, AUTO_GAMMA_MAX, Drafter, Proposal
from spec_jax.drafting.lookup import PromptLookupDrafter, one_hot_prefix, write_tokens
from spec_jax.drafting.model import ModelDrafter


@flax.struct.dataclass
class HybridState:
    buffer: jax.Array  # int32 [B, S]: prompt + committed tokens (PromptLookupDrafter's state)
    cache: Any  # the draft model's KVCache
    cached: jax.Array  # int32 [B]: the model's cache is exact at positions below this
    model_drafted: jax.Array  # bool [B]: the model served the row's last round
    last_length: jax.Array  # int32 [B]: the length at the last round (unchanged: the row is done)


@dataclasses.dataclass(frozen=True)
class HybridDrafter(Drafter):
    """Prompt lookup first, the draft model for the rows where it finds nothing (per row, per
    round); params are the model's (a TrimmedDraftParams for a trimmed model).

    The model runs in a round only when some active row needs it. Its cache must then hold the
    committed prefix, although it skipped the rounds lookup served (each of which committed up
    to gamma + 1 tokens): it is exact below `cached`, and before drafting it reads the
    committed tokens from `cached` to n-2 out of the lookup's buffer, `catch_up` tokens per
    call (as many calls as the longest gap needs), then drafts as ModelDrafter does (which
    feeds n-2, n-1). After a round it drafted, the cache is exact below n for every row, and
    for the rows it served also below the next round's n'-2 (its own accepted drafts).
    """

    lookup: PromptLookupDrafter
    model: ModelDrafter
    catch_up: int = 8
    prefill_calls: int = 1
    variable_length: ClassVar[bool] = True
    sources: ClassVar[tuple[str, ...]] = ("prompt_lookup", "model")
    resumable: ClassVar[bool] = True
    auto_gamma_max: ClassVar[int] = AUTO_COPY_GAMMA_MAX
    auto_widths: ClassVar[str] = "doubling"

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.model.max_seq_len

    def init(self, params, tokens_bp, prompt_lens_b, cache_len, features_bpd=None):
        return HybridState(
            buffer=self.lookup.init(None, tokens_bp, prompt_lens_b, cache_len),
            cache=self.model.init(params, tokens_bp, prompt_lens_b, cache_len),
            cached=prompt_lens_b.astype(jnp.int32),
            model_drafted=jnp.zeros(prompt_lens_b.shape, jnp.bool_),
            last_length=jnp.zeros(prompt_lens_b.shape, jnp.int32),
        )

    def served(self, state: HybridState, batch: int):
        return state.model_drafted.astype(jnp.int32)

    def resume(self, params, state: HybridState, text_bs, synced_b, length_b, width):
        """The buffer becomes the committed text; the model's cache stays as it is, exact below
        `cached` (and below the last round's length where the model served it), and catches
        up the next time a row needs it."""
        cached = jnp.where(state.model_drafted, jnp.maximum(state.cached, state.last_length), state.cached)
        return state.replace(
            buffer=text_bs.astype(jnp.int32),
            cached=cached,
            model_drafted=jnp.zeros_like(state.model_drafted),
        )

    def propose(self, params, state: HybridState, context_b2, length_b, gamma, sampling, keys_b):
        buffer, count, drafts = self.lookup.lookup(state.buffer, context_b2, length_b, gamma)
        found = count > 0
        # The rows the model served last round have their accepted drafts in its cache.
        cached = jnp.where(state.model_drafted, jnp.maximum(state.cached, length_b - 2), state.cached)
        need = ~found & (length_b != state.last_length)  # a done row keeps its length: never needs it

        def with_model(cache, cached):
            cache = self.model.feed(params, cache, buffer, cached, length_b - 2, self.catch_up)
            tokens, q, cache = self.model.propose(
                params, cache, context_b2, length_b, min(gamma, AUTO_GAMMA_MAX), sampling, keys_b
            )
            pad = gamma - tokens.shape[1]  # the model's chain is at most AUTO_GAMMA_MAX long
            return (
                jnp.pad(tokens, ((0, 0), (0, pad))),
                jnp.pad(q, ((0, 0), (0, pad), (0, 0))),
                cache,
                length_b,
            )

        def without_model(cache, cached):
            batch = length_b.shape[0]
            q = jnp.zeros((batch, gamma, self.vocab_size), jnp.float32)
            return jnp.zeros((batch, gamma), jnp.int32), q, cache, cached

        model_tokens, model_q, cache, cached = jax.lax.cond(
            jnp.any(need), with_model, without_model, state.cache, cached
        )
        tokens = jnp.where(found[:, None], drafts, model_tokens)
        lookup_q = one_hot_prefix(drafts, count, self.vocab_size)
        q = jnp.where(found[:, None, None], lookup_q, model_q)
        new_state = HybridState(
            buffer=write_tokens(buffer, tokens, length_b),
            cache=cache,
            cached=cached,
            model_drafted=need,
            last_length=length_b,
        )
        return Proposal(tokens, q, new_state)

    # The model's placement and costs are the hybrid's (lookup has no arrays and costs nothing).
    def for_mesh(self, mesh):
        return dataclasses.replace(self, model=self.model.for_mesh(mesh))

    def param_shardings(self, params, mesh):
        return self.model.param_shardings(params, mesh)

    def timed_call(self, params):
        return self.model.timed_call(params)

    def without_model(self, params):
        """Prompt lookup alone, which calls no model: where the model's calls would never pay, a
        copied run is still drafted for free."""
        return self.lookup, ()
