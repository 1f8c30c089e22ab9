"""Drafting with a draft head on the target's features (models.draft_head; EAGLE-1).

The head needs the target's feature at every committed position, and the target computes them
anyway: the verification call of each round returns its features beside its logits (one call,
no extra target pass). The drafter therefore has one more hook than the others, `observe`,
which the loop calls after the rule with the features of the positions the target scored and
the tokens the row committed after them:

  prefill   the target's features f_0 .. f_{P-1} of the prompt: `init` runs the head over the
            pairs (f_j, t_{j+1}) into its cache; the last pair waits for the first new token,
            which `observe` then feeds (position P-1).
  round     the target scores t_{n-1}, d_0 .. d_{G-1} at n-1 .. n-1+G and returns f_{n-1} ..
            f_{n-1+G}; the row commits c tokens t_n .. t_{n+c-1}, so the pairs (f_{n-1+i},
            t_{n+i}) for i < c are real: `observe` runs the head over all G + 1 (one shape) at
            positions n-1 .. n-1+G and keeps its output at i = c - 1 (position n'-2, n' = n + c),
            the prediction of f_{n'-1}. Pairs past c hold rejected drafts; they sit at positions
            >= n'-1, which `propose` overwrites before anything reads them.
  propose   draft 0 comes from the kept prediction through the target's output head; draft i
            feeds (prediction of f_{n'-2+i}, d_{i-1}) at position n'-2+i and reads the next.

So after `observe` the head's cache holds, below n'-1, exactly what a run of the head over the
committed text with the target's true features would hold (tests/test_head.py checks it
against a fresh prefill after every round), whatever was accepted or rejected. The draft
distribution q is the head's (over the output head's token subset, 0 elsewhere, as a
vocabulary-trimmed draft), and the drafts are sampled from it, so the rule stays exact.
"""

import dataclasses
from typing import Any, ClassVar

import flax.struct
import jax
import jax.numpy as jnp

from models import draft_head
from models.cache import KVCache
from models.config import ModelConfig
from models.transformer import output_head
from spec_jax.decode import PAD_ID
from spec_jax.drafters import TrimmedHead, top_probability
from spec_jax.sampling import SamplingParams, draw_rows, split_rows, warp


@flax.struct.dataclass
class HeadParams:
    head: Any  # the head's parameters (models.draft_head, any precision)
    embed: Any  # the target's input embedding [V, D]
    out: TrimmedHead  # the target's output head, its rows for the drafted tokens (all: ids = 0..V-1)


@flax.struct.dataclass
class HeadState:
    cache: KVCache  # the head's cache: exact below length - 1 after observe
    hidden: jax.Array  # [B, D]: the head's prediction of the target's feature at length - 1


def head_params(target, head, token_ids=None) -> HeadParams:
    """The drafter's arrays: `head` (a models.Model of kind draft_head) and the target's (a
    models.Model) embedding and output head, restricted to token_ids when given (distinct ids;
    the drafts then come from those tokens only, as with spec_jax.drafters.trim_vocabulary)."""
    if head.config.kind != "draft_head":
        raise ValueError(f"head must be a draft head (models.draft_head), got a {head.config.kind}")
    if head.config.d_model != target.config.d_model or head.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"head {head.config.name!r} (width {head.config.d_model}, vocabulary {head.config.vocab_size}) "
            f"does not fit target {target.config.name!r} (width {target.config.d_model}, "
            f"vocabulary {target.config.vocab_size})"
        )
    weight = output_head(target.config, target.params)
    vocab = target.config.vocab_size
    if token_ids is None:
        ids = jnp.arange(vocab, dtype=jnp.int32)
    else:
        ids = jnp.asarray(sorted({int(i) for i in token_ids}), jnp.int32)
        if ids.size == 0 or int(ids[0]) < 0 or int(ids[-1]) >= vocab:
            raise ValueError(f"token_ids must be a non-empty set of ids in [0, {vocab})")
        weight = jax.tree.map(lambda a: a[ids], weight)
    return HeadParams(
        head=head.params, embed=target.params["embed"]["embedding"], out=TrimmedHead(weight, ids)
    )


@dataclasses.dataclass(frozen=True)
class HeadDrafter:
    """Drafts with a draft head (models.draft_head) from the target's features.

    config: the head's config. trimmed: the output head holds a subset of the vocabulary
    (HeadParams.out.ids) and q is 0 off it. threshold: a row stops drafting at the first
    position whose top probability (before the warp) is below it, as ModelDrafter's.
    """

    config: ModelConfig
    trimmed: bool = False
    threshold: float = 0.0
    prefill_calls: int = 1
    sources: ClassVar[tuple[str, ...]] = ("head",)
    reads_features: ClassVar[bool] = True

    @property
    def variable_length(self) -> bool:
        return self.threshold > 0

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len

    def init(self, params: HeadParams, tokens_bp, prompt_lens_b, cache_len: int, features_bpd) -> HeadState:
        """The head over the prompt's pairs (f_j, t_{j+1}); the pair at each row's last prompt
        position holds padding until observe feeds the first new token there."""
        batch, width = tokens_bp.shape
        next_tokens = jnp.concatenate(
            [tokens_bp[:, 1:], jnp.full((batch, 1), PAD_ID, tokens_bp.dtype)], axis=1
        )
        positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
        cache = draft_head.new_cache(self.config, batch, cache_len)
        _, cache = draft_head.forward(
            self.config, params.head, features_bpd, next_tokens, positions, cache, params.embed
        )
        hidden = jnp.zeros((batch, self.config.d_model), self.config.jnp_dtype)
        return HeadState(cache=cache, hidden=hidden)

    def observe(
        self, params: HeadParams, state: HeadState, features_bcd, tokens_bc, start_b, count_b
    ) -> HeadState:
        """Feeds the pairs (features[:, i], tokens[:, i]) at positions start + i (C of them, one
        shape) and keeps the head's output at i = count - 1 (count in [1, C]: the pairs that are
        real; the rest are overwritten before they are read)."""
        width = tokens_bc.shape[1]
        positions = start_b[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
        hidden, cache = draft_head.forward(
            self.config, params.head, features_bcd, tokens_bc, positions, state.cache, params.embed
        )
        last = jnp.take_along_axis(hidden, (count_b - 1)[:, None, None], axis=1)[:, 0]
        return HeadState(cache=cache, hidden=last)

    def distribution(self, params: HeadParams, hidden_bd, sampling: SamplingParams):
        """(q [B, V] warped, confidence [B]: the unwarped top probability) of the token after a
        hidden state, through the (trimmed) output head."""
        logits = draft_head.logits(hidden_bd[:, None], params.out.weight, self.config.matmul_impl)[:, 0]
        q = warp(logits, sampling)
        if self.trimmed:
            q = jnp.zeros((q.shape[0], self.vocab_size), q.dtype).at[:, params.out.ids].set(q)
        return q, top_probability(logits)

    def propose(self, params: HeadParams, state: HeadState, context_b2, length_b, gamma, sampling, keys_b):
        keys = split_rows(keys_b, gamma)  # [G, B]
        q0, conf0 = self.distribution(params, state.hidden, sampling)
        x0 = draw_rows(keys[0], q0)

        def step(carry, step_keys):
            token, hidden, position, cache = carry
            out, cache = draft_head.forward(
                self.config,
                params.head,
                hidden[:, None],
                token[:, None],
                position[:, None],
                cache,
                params.embed,
            )
            q, conf = self.distribution(params, out[:, 0], sampling)
            nxt = draw_rows(step_keys, q)
            return (nxt, out[:, 0], position + 1, cache), (nxt, q, conf)

        carry = (x0, state.hidden, length_b - 1, state.cache)
        (_, _, _, cache), (xs, qs, confs) = jax.lax.scan(step, carry, keys[1:])
        tokens = jnp.concatenate([x0[:, None], xs.T], axis=1)  # [B, G]
        q = jnp.concatenate([q0[:, None], jnp.swapaxes(qs, 0, 1)], axis=1)  # [B, G, V]
        if self.threshold > 0:
            confidence = jnp.concatenate([conf0[:, None], confs.T], axis=1)  # [B, G]
            keep = jnp.cumprod(confidence >= self.threshold, axis=1)
            q = q * keep[..., None].astype(q.dtype)
        return tokens, q, state.replace(cache=cache)
