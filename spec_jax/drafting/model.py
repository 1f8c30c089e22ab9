"""A draft model (ModelDrafter): a small transformer drafting autoregressively from its own KV
cache, over the whole vocabulary or, vocabulary-trimmed (VocabTrim, `trim_vocabulary`), over a
subset of it."""

import dataclasses
from typing import Any, ClassVar

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models.transformer import forward, output_head
from spec_jax import sharding
from spec_jax.autogamma import model_key
from spec_jax.decode import prefill
from spec_jax.drafting.base import Drafter, Proposal
from spec_jax.sampling import draw_rows, split_rows, warp


@flax.struct.dataclass
class TrimmedHead:
    """The rows of a draft model's output head for a subset of the vocabulary (VocabTrim)."""

    weight: Any  # [R, D], the head's rows for these tokens (any precision: Int8Weight too)
    ids: jax.Array  # int32 [R], their token ids


@flax.struct.dataclass
class TrimmedDraftParams:
    model: Any  # the draft model's parameters
    head: TrimmedHead


@dataclasses.dataclass(frozen=True)
class ModelDrafter(Drafter):
    """A small transformer drafting autoregressively from its own KV cache.

    trimmed: the params are TrimmedDraftParams and the draft's distribution lives on the
    head's R tokens (VocabTrim, `trim_vocabulary`): each step multiplies by an [R, D] head
    instead of [V, D], and q is 0 on every other token. The rejection rule stays exact for any
    q the drafts are sampled from, this one included: tokens off the set are never proposed,
    and the target's residual max(0, p - q) keeps their whole probability.

    threshold: a per-row adaptive draft length (the `p-min` of HF and llama.cpp). A row stops
    proposing at the first position where the draft's confidence, its top probability before
    the warp (at temperature 1, so that greedy decoding has one too), is below threshold;
    0 proposes all gamma. The stop reads the draft's own distribution only, so the output
    stays exact.

    vocab: the target's vocabulary size where the draft's is a strict prefix of it (checked by
    models.tokenizer.check_pair; 0: the draft's own). q spans the target's ids, 0 past the
    draft's own, so the rule stays exact (those ids are never proposed; the residual keeps
    their probability), and a committed id past the draft's vocabulary reads the draft's
    last embedding row (what the draft reads never changes the output's distribution).
    """

    config: ModelConfig
    prefill_calls: int = 1
    trimmed: bool = False
    threshold: float = 0.0
    vocab: int = 0
    sources: ClassVar[tuple[str, ...]] = ("model",)
    resumable: ClassVar[bool] = True

    @property
    def variable_length(self) -> bool:
        return self.threshold > 0

    @property
    def vocab_size(self) -> int:
        return self.vocab or self.config.vocab_size

    def own_ids(self, tokens):
        """tokens clipped to the draft's own vocabulary (unchanged unless it is a prefix)."""
        return jnp.minimum(tokens, self.config.vocab_size - 1) if self.vocab else tokens

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len

    def split_params(self, params) -> tuple[Any, Any]:
        """(the model's parameters, the trimmed output head's weight [R, D] or None)."""
        return (params.model, params.head.weight) if self.trimmed else (params, None)

    def init(self, params, tokens_bp, prompt_lens_b, cache_len, features_bpd=None):
        return prefill(
            self.config, self.split_params(params)[0], self.own_ids(tokens_bp), prompt_lens_b, cache_len
        ).cache

    def distribution(self, params, tokens_bt, positions_bt, cache, sampling, logits_at=None):
        """(q [B, V] of the last scored position, confidence [B], cache): the warped draft
        distribution and the top probability of the unwarped one."""
        model_params, head = self.split_params(params)
        tokens_bt = self.own_ids(tokens_bt)
        out = forward(self.config, model_params, tokens_bt, positions_bt, cache, logits_at, head=head)
        q = warp(out.logits[:, 0], sampling)  # [B, V_draft], or [B, R] trimmed
        if self.trimmed:
            q = jnp.zeros((q.shape[0], self.vocab_size), q.dtype).at[:, params.head.ids].set(q)
        elif self.vocab:  # [B, V_target]: zeros past the draft's vocabulary
            q = jnp.pad(q, ((0, 0), (0, self.vocab_size - q.shape[1])))
        return q, top_probability(out.logits[:, 0]), out.cache

    def propose(self, params, cache, context_b2, length_b, gamma, sampling, keys_b):
        positions = (length_b - 2)[:, None] + jnp.arange(2)[None, :]
        q0, conf0, cache = self.distribution(
            params, context_b2, positions, cache, sampling, logits_at=jnp.ones_like(length_b)[:, None]
        )
        keys = split_rows(keys_b, gamma)  # [G, B]
        x0 = draw_rows(keys[0], q0)

        def step(carry, step_keys):
            token, position, cache = carry
            q, conf, cache = self.distribution(params, token[:, None], position[:, None], cache, sampling)
            nxt = draw_rows(step_keys, q)
            return (nxt, position + 1, cache), (nxt, q, conf)

        (_, _, cache), (xs, qs, confs) = jax.lax.scan(step, (x0, length_b, cache), keys[1:])
        tokens = jnp.concatenate([x0[:, None], xs.T], axis=1)  # [B, G]
        q = jnp.concatenate([q0[:, None], jnp.swapaxes(qs, 0, 1)], axis=1)  # [B, G, V]
        if self.threshold > 0:
            confidence = jnp.concatenate([conf0[:, None], confs.T], axis=1)  # [B, G]
            keep = jnp.cumprod(confidence >= self.threshold, axis=1)
            q = q * keep[..., None].astype(q.dtype)
        return Proposal(tokens, q, cache)

    def feed(self, params, cache, text_bs, start_b, stop_b, width: int):
        """The cache after reading the committed tokens text[start .. stop-1] of each row (a row
        whose start >= stop reads nothing it needs), `width` positions per call, as many calls
        as the longest gap needs (positions past stop get text padding, written past the
        length and overwritten before they are read)."""
        model_params, head = self.split_params(params)
        first = jnp.zeros((start_b.shape[0], 1), jnp.int32)  # logits of one position (unused)

        def body(carry):
            start, cache = carry
            positions = start[:, None] + jnp.arange(width)[None, :]
            tokens = jnp.take_along_axis(text_bs, jnp.clip(positions, 0, text_bs.shape[1] - 1), axis=1)
            cache = forward(
                self.config, model_params, self.own_ids(tokens), positions, cache, first, head=head
            ).cache
            return jnp.where(start < stop_b, jnp.minimum(start + width, stop_b), start), cache

        _, cache = jax.lax.while_loop(lambda c: jnp.any(c[0] < stop_b), body, (start_b, cache))
        return cache

    def resume(self, params, cache, text_bs, synced_b, length_b, width):
        # propose feeds length-2 and length-1 itself.
        return self.feed(params, cache, text_bs, synced_b, length_b - 2, width)

    def for_mesh(self, mesh):
        return dataclasses.replace(self, config=sharding.for_mesh(self.config, mesh))

    def param_shardings(self, params, mesh):
        """The model's parameters by the rule table; a trimmed head replicated."""
        if not self.trimmed:
            return sharding.param_shardings(params, mesh)
        return params.replace(
            model=sharding.param_shardings(params.model, mesh),
            head=jax.tree.map(lambda _: sharding.replicated(mesh), params.head),
        )

    def cost_calls(self, params, widths, *, batch, cache_slots, repeat):
        from models import Model
        from spec_jax import timing

        model_params, head = self.split_params(params)
        model = Model(config=self.config, params=model_params)
        return {
            w: timing.model_call(
                model, batch=batch, widths=[w], cache_slots=cache_slots, repeat=repeat, head=head
            )
            for w in widths
        }

    def cost_key(self, params):
        rows = int(params.head.ids.shape[0]) if self.trimmed else self.config.vocab_size
        return {**model_key(self.config), "head_rows": rows}


def top_probability(logits_bv):
    """The top probability of softmax(logits), [B] float32."""
    logits = logits_bv.astype(jnp.float32)
    return 1.0 / jnp.sum(jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True)), axis=-1)


def trim_vocabulary(draft, token_ids) -> tuple[ModelDrafter, TrimmedDraftParams]:
    """(drafter, params) drafting with `draft` (a models.Model) over token_ids only (VocabTrim):
    the output head keeps those rows. token_ids: distinct ids in [0, V), e.g. the most frequent
    tokens of a corpus (spec_jax.drafting.ngram.most_frequent) plus the stop tokens."""
    ids = np.asarray(token_ids)
    vocab = draft.config.vocab_size
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"token_ids must be a non-empty list of integer token ids, got shape {ids.shape}")
    if ids.min() < 0 or ids.max() >= vocab or np.unique(ids).size != ids.size:
        raise ValueError(f"token_ids must be distinct ids in [0, {vocab})")
    ids = jnp.asarray(np.sort(ids), jnp.int32)
    weight = jax.tree.map(lambda a: a[ids], output_head(draft.config, draft.params))
    params = TrimmedDraftParams(model=draft.params, head=TrimmedHead(weight=weight, ids=ids))
    return ModelDrafter(draft.config, trimmed=True), params
