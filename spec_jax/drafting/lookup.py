"""Drafts copied from the row's own text: prompt lookup (PromptLookupDrafter; with a draft model
behind it: spec_jax.drafting.hybrid.HybridDrafter).

Prompt lookup (as HF's `prompt_lookup_num_tokens` and vLLM's `ngram`): find the most recent
earlier occurrence of the row's last n committed tokens (n from max_ngram down to 1) in its
prompt + generated tokens, and propose the tokens that followed it. When the occurrence is
closer than gamma tokens to the end, the text is taken to repeat with that period (the match
says t[n + i] = t[j + 1 + i] for an occurrence ending at j; where j + 1 + i reaches the draft
itself, it is read from there), so a match always proposes gamma tokens. A row without a
match proposes nothing (q = 0: spec_jax.verify). The drafts are deterministic, so q is
one-hot: the rule accepts draft x with probability p(x) and otherwise draws from p with x
removed, which keeps sampling at any temperature exact.

The state is a token buffer [B, S] (S = the loop's cache length) holding each row's prompt +
committed tokens. The loop hands `propose` only the last two committed tokens, so the buffer
is kept as the model drafter keeps its cache: `propose` writes its drafts at n .. n+G-1 (the
accepted ones are committed as proposed), and the next call writes the two context tokens at
n'-2, n'-1 over them, which also replaces the first rejected draft with the token the rule
drew. Every position below n' is then a committed token; entries at n' and past are garbage
and are masked out of the match. A round the loop truncates (max_new_tokens, a stop token)
ends its row, so a truncated row never proposes again.
"""

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from models.settings import is_int
from spec_jax.drafting.base import UNBOUNDED_CONTEXT, Drafter, Proposal

MAX_NGRAM_LIMIT = 16  # the largest max_ngram accepted (the match is max_ngram shifted compares)


def write_tokens(buffer_bs, tokens_bt, start_b):
    """buffer with tokens [B, T] written at positions start .. start+T-1 of each row (positions
    past the buffer are dropped)."""
    rows = jnp.arange(buffer_bs.shape[0])[:, None]
    positions = start_b[:, None] + jnp.arange(tokens_bt.shape[1])[None, :]
    return buffer_bs.at[rows, positions].set(tokens_bt, mode="drop")


def occurrences(buffer_bs, length_b, max_ngram: int):
    """Each row's earlier occurrences of its longest matching suffix.

    For n = max_ngram down to 1 the last n tokens t[L-n .. L-1] (L = length) are compared with
    every window ending at j <= L-2 (an earlier occurrence: its continuation t[j+1] is known);
    positions >= L are never read. Returns (ngram int32 [B]: the longest n that occurs, 0 if
    none; ok bool [B, S]: the j where an occurrence of that n ends, all False if none).
    """
    batch, slots = buffer_bs.shape
    j = jnp.arange(slots)[None, :]  # [1, S]: where an earlier occurrence ends
    n = length_b[:, None]  # [B, 1]
    ok = j <= n - 2
    best = jnp.zeros((batch, slots), jnp.bool_)
    ngram = jnp.zeros((batch,), jnp.int32)
    for d in range(max_ngram):  # the n-gram's tokens, last first: window j - d vs t[L-1-d]
        shifted = jnp.pad(buffer_bs, ((0, 0), (d, 0)), constant_values=-1)[:, :slots]  # [b, j] = t[j-d]
        suffix = jnp.take_along_axis(buffer_bs, jnp.maximum(n - 1 - d, 0), axis=1)  # [B, 1]
        ok = ok & (shifted == suffix) & (n - 1 - d >= 0) & (j >= d)
        found_d = jnp.any(ok, axis=1)
        best = jnp.where(found_d[:, None], ok, best)
        ngram = jnp.where(found_d, d + 1, ngram)
    return ngram, best


def find_match(buffer_bs, length_b, max_ngram: int):
    """The most recent earlier occurrence of each row's longest matching suffix (occurrences):
    (found bool [B], end int32 [B]: where it ends, -1 if none; ngram int32 [B], 0 if none)."""
    ngram, ok = occurrences(buffer_bs, length_b, max_ngram)
    end = jnp.max(jnp.where(ok, jnp.arange(buffer_bs.shape[1])[None, :], -1), axis=1).astype(jnp.int32)
    return end >= 0, end, ngram


def continuation(buffer_bs, length_b, end_b, gamma: int):
    """int32 [B, G]: the gamma tokens after an occurrence ending at end, t[end + 1 + (i mod P)]
    with P = L - 1 - end (the text repeating with period P past its last token)."""
    period = jnp.maximum(length_b - 1 - end_b, 1)[:, None]
    idx = end_b[:, None] + 1 + jnp.arange(gamma)[None, :] % period
    return jnp.take_along_axis(buffer_bs, jnp.clip(idx, 0, buffer_bs.shape[1] - 1), axis=1)


@dataclasses.dataclass(frozen=True)
class PromptLookupDrafter(Drafter):
    """Drafts by prompt lookup (module docstring); no parameters (params: None or ())."""

    vocab_size: int
    max_ngram: int = 3
    max_seq_len: int = UNBOUNDED_CONTEXT
    prefill_calls: int = 0
    variable_length: ClassVar[bool] = True
    sources: ClassVar[tuple[str, ...]] = ("prompt_lookup",)
    resumable: ClassVar[bool] = True

    def __post_init__(self):
        if not (is_int(self.max_ngram) and 1 <= self.max_ngram <= MAX_NGRAM_LIMIT):
            raise ValueError(
                f"max_ngram must be an integer in [1, {MAX_NGRAM_LIMIT}], got {self.max_ngram!r}"
            )

    def init(self, params, tokens_bp, prompt_lens_b, cache_len, features_bpd=None):
        """The token buffer [B, cache_len]: the padded prompts (padding past each length is garbage)."""
        return jnp.pad(tokens_bp.astype(jnp.int32), ((0, 0), (0, cache_len - tokens_bp.shape[1])))

    def resume(self, params, buffer_bs, text_bs, synced_b, length_b, width):
        """The buffer is the committed text (below each row's length; garbage past it)."""
        return text_bs.astype(jnp.int32)

    def lookup(self, buffer_bs, context_b2, length_b, gamma: int):
        """(buffer with the context written, found [B], drafts int32 [B, G]): the match."""
        buffer_bs = write_tokens(buffer_bs, context_b2, length_b - 2)
        found, end, _ = find_match(buffer_bs, length_b, self.max_ngram)
        drafts = continuation(buffer_bs, length_b, end, gamma)
        return buffer_bs, found, jnp.where(found[:, None], drafts, context_b2[:, 1:])

    def propose(self, params, buffer_bs, context_b2, length_b, gamma, sampling, keys_b):
        buffer_bs, found, drafts = self.lookup(buffer_bs, context_b2, length_b, gamma)
        q = jax.nn.one_hot(drafts, self.vocab_size, dtype=jnp.float32) * found[:, None, None]
        return Proposal(drafts, q, write_tokens(buffer_bs, drafts, length_b))
