"""The target's log-probabilities of the tokens a row keeps (what the compiled loop writes beside
Output.tokens: kept_logprobs) and of a prompt's tokens (score_prompt: the scoring call an
`echo` request's prompt logprobs come from), and their host form (TokenLogprobs).

They are RAW log-probabilities: log_softmax of the target's float32 logits, before any warp
(temperature, top-k, top-p), as vLLM's default (its "raw_logprobs"). A sampled row's token was
drawn from the warped distribution; its logprob is still the model's own. Each kept token's
comes from the target call that verified it (the loop's verify call, or the prefill for the
first token), so a draft does not change them: a kept token's logprob with a draft is the one
plain decoding gives it (up to the float rounding of target calls of other widths).

Per row: Output.num_logprobs [B] says what each row asks (-1: nothing; 0: the kept token's
logprob; k in 1..MAX_LOGPROBS: and the k most probable tokens'), an operand of the loop like
the warp, so a request's value compiles nothing new. The work runs under a lax.cond only where
some row asks: the log_softmax where any row asks for logprobs, the top MAX_LOGPROBS (one
static K) where any asks for k >= 1; each row's values come from its own logits alone, and the
host hands a row its first k.
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from models.transformer import forward, init_cache

MAX_LOGPROBS = 20  # the most top logprobs a token may ask for (OpenAI's bound), K of every top array
SCORE_CHUNK = 32  # positions per target call of score_prompt


class Kept(NamedTuple):
    """Log-probabilities of chosen tokens [B, C] and of the K most probable there [B, C, K]."""

    logprobs: jax.Array  # float32 [B, C]: the chosen token's
    top_ids: (
        jax.Array
    )  # int32 [B, C, K]: most probable first (ties: the lower id; -1 past a vocabulary under K)
    top_logprobs: jax.Array  # float32 [B, C, K]


def empty_kept(batch: int, width: int) -> Kept:
    """Kept of zeros, [batch, width] and [batch, width, MAX_LOGPROBS]."""
    return Kept(
        jnp.zeros((batch, width), jnp.float32),
        jnp.zeros((batch, width, MAX_LOGPROBS), jnp.int32),
        jnp.zeros((batch, width, MAX_LOGPROBS), jnp.float32),
    )


def kept_logprobs(logits_fn, tokens_bc, num_logprobs_b) -> Kept:
    """Kept of tokens [B, C] under the raw logits at their positions (logits_fn() -> [B, C, V],
    called only where some row asks): log_softmax of the float32 logits at the token, and the
    top MAX_LOGPROBS there. num_logprobs_b (int32 [B]): each row's ask (module docstring);
    nothing is computed unless some row asks (zeros), the top only where some row asks for
    k >= 1. A row's values depend on its own logits alone."""
    batch, width = tokens_bc.shape

    def some():
        lp = jax.nn.log_softmax(logits_fn().astype(jnp.float32), axis=-1)  # [B, C, V]
        chosen = jnp.take_along_axis(lp, tokens_bc[..., None].astype(jnp.int32), axis=-1)[..., 0]

        def top():
            k = min(MAX_LOGPROBS, lp.shape[-1])  # a vocabulary under K: its every token, then -1s
            values, ids = jax.lax.top_k(lp, k)
            pad = ((0, 0), (0, 0), (0, MAX_LOGPROBS - k))
            return jnp.pad(ids.astype(jnp.int32), pad, constant_values=-1), jnp.pad(values, pad)

        none = empty_kept(batch, width)
        ids, values = jax.lax.cond(
            jnp.any(num_logprobs_b > 0), top, lambda: (none.top_ids, none.top_logprobs)
        )
        return Kept(chosen, ids, values)

    return jax.lax.cond(jnp.any(num_logprobs_b >= 0), some, lambda: empty_kept(batch, width))


def score_prompt(config, params, tokens_bp, prompt_lens_b, num_logprobs_b, chunk: int = SCORE_CHUNK) -> Kept:
    """The prompts' next-token log-probabilities: Kept [B, P] whose position s holds
    log p(token s + 1 | tokens <= s) and the top MAX_LOGPROBS after position s, for s below each
    row's length less one (zeros elsewhere; the first prompt token has none). tokens_bp: the
    prompts, right-padded; num_logprobs_b: as kept_logprobs'. The target reads the prompts in
    calls of `chunk` positions (the logits of one call, [B, chunk, V], are all that is held of
    them), through a cache of P slots, stopping after the longest row's last position."""
    batch, width = tokens_bp.shape
    c = min(chunk, width)
    padded = -(-width // c) * c  # whole calls of c positions
    tokens_bp = jnp.pad(tokens_bp, ((0, 0), (0, padded - width)))
    next_bp = jnp.concatenate([tokens_bp[:, 1:], jnp.zeros((batch, 1), tokens_bp.dtype)], axis=1)
    last = jnp.max(prompt_lens_b) - 1  # positions below it predict a prompt token

    def body(carry):
        start, cache, out = carry
        positions = jnp.broadcast_to(start + jnp.arange(c, dtype=jnp.int32), (batch, c))
        call = forward(config, params, jax.lax.dynamic_slice_in_dim(tokens_bp, start, c, 1), positions, cache)
        targets = jax.lax.dynamic_slice_in_dim(next_bp, start, c, 1)
        kept = kept_logprobs(lambda: call.logits, targets, num_logprobs_b)
        out = jax.tree.map(lambda o, k: jax.lax.dynamic_update_slice_in_dim(o, k, start, 1), out, kept)
        return start + c, call.cache, out

    carry = (jnp.zeros((), jnp.int32), init_cache(config, batch, padded), empty_kept(batch, padded))
    _, _, out = jax.lax.while_loop(lambda carry: carry[0] < last, body, carry)
    out = jax.tree.map(lambda o: o[:, :width], out)
    live = jnp.arange(width)[None, :] < (prompt_lens_b - 1)[:, None]  # [B, P]
    return Kept(
        jnp.where(live, out.logprobs, 0.0),
        jnp.where(live[..., None], out.top_ids, 0),
        jnp.where(live[..., None], out.top_logprobs, 0.0),
    )


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities of consecutive tokens on the host: token_ids, each one's logprob (None
    where nothing predicts it: a prompt's first token) and its top (token id, logprob) pairs,
    most probable first (as many as the request asked; empty for 0)."""

    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float | None, ...] = ()
    top: tuple[tuple[tuple[int, float], ...], ...] = ()

    @classmethod
    def of(cls, token_ids, logprobs, top_ids, top_logprobs, k: int, first_none: bool = False):
        """From host arrays of one row, [T] and [T, MAX_LOGPROBS], each token's first k tops
        (first_none: the first token has no logprob, and no top)."""
        lps = [float(x) for x in np.asarray(logprobs)]
        ids, values = np.asarray(top_ids)[:, :k].tolist(), np.asarray(top_logprobs)[:, :k].tolist()
        top = [
            tuple((a, b) for a, b in zip(i, v, strict=True) if a >= 0)
            for i, v in zip(ids, values, strict=True)
        ]
        if first_none and lps:
            lps[0], top[0] = None, ()
        return cls(tuple(int(t) for t in token_ids), tuple(lps), tuple(top))

    def __len__(self) -> int:
        return len(self.token_ids)

    def __add__(self, other: "TokenLogprobs") -> "TokenLogprobs":
        return TokenLogprobs(
            self.token_ids + other.token_ids, self.logprobs + other.logprobs, self.top + other.top
        )

    def __getitem__(self, s: slice) -> "TokenLogprobs":
        return TokenLogprobs(self.token_ids[s], self.logprobs[s], self.top[s])
