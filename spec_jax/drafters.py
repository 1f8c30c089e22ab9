"""What can propose draft tokens: nothing (NoDrafter: plain autoregressive decoding), a draft
model (ModelDrafter), n-gram tables (UnigramDrafter, BigramDrafter; fitted by spec_jax.ngram),
the row's own prompt and output (spec_jax.lookup.PromptLookupDrafter) or lookup with a model
behind it (spec_jax.lookup.HybridDrafter).

A drafter is a frozen (hashable) dataclass of static settings, so it can be a static
argument of jax.jit; its arrays (model parameters, n-gram tables) and its state (a KV
cache) are pytrees passed through the loop.

The loop calls `init` once after the prompt and `propose` once per round with the last two
committed tokens. Feeding both, at positions n-2 and n-1, keeps the drafter's cache equal to
the committed prefix in every case: after a fully accepted round the drafter has not yet
seen its own last draft (it is token n-2 now), and after a rejection the rejected entries
past n-2 are overwritten before they can be read.

A drafter may propose fewer than gamma tokens in a row: the positions it does not propose get
q = 0 (spec_jax.verify), and then `variable_length` is True, so that the loop checks for a
round where no row proposed anything (the target then scores one position, not gamma + 1).
`sources` names what served a row's round (a HybridDrafter has two and says which served each
row with `served(state)`); the metrics count rounds, drafts and acceptances per source.

gamma=auto runs plain chunks (gamma 0, no drafter) between drafting chunks; a drafter that has
`resume` then catches up on the text committed without it (`resumable`); one without (a draft
head, which reads the target's features) makes plain decoding final for the call.
"""

import dataclasses
from typing import Any, ClassVar, Protocol

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models.transformer import forward, output_head
from spec_jax.decode import prefill
from spec_jax.sampling import SamplingParams, draw_rows, split_rows, warp


class Drafter(Protocol):
    vocab_size: int
    max_seq_len: int
    prefill_calls: int  # batched calls `init` makes (counted in the metrics' draft_calls)

    def init(self, params: Any, tokens_bp, prompt_lens_b, cache_len: int) -> Any:
        """The drafter's state after reading the padded prompts [B, P]."""

    def propose(
        self, params: Any, state: Any, context_b2, length_b, gamma: int, sampling: SamplingParams, keys_b
    ) -> tuple[jax.Array, jax.Array, Any]:
        """Drafts gamma tokens per row.

        context_b2: the last two committed tokens of each row, at positions length-2, length-1.
        keys_b: [B] PRNG keys; row b's drafts may depend on keys_b[b] only.
        Returns (tokens int32 [B, gamma], q float32 [B, gamma, V] the warped distributions
        each token was sampled from, all zero from the first position not proposed, new state).
        """

    def resume(self, params: Any, state: Any, text_bs, synced_b, length_b, width: int) -> Any:
        """Optional (`resumable`): the state after the loop committed text without the drafter.

        text_bs: int32 [B, S] every row's committed tokens at their positions (below length_b,
        padding past it); synced_b: the state followed the text below this position; width: a
        static size for catching up (the longest gap length - 2 - synced, rounded up to a power
        of two and capped). The result must be a state `propose` can continue from at length_b.
        """


def reads_features(drafter) -> bool:
    """Whether a drafter reads the target's features (spec_jax.head_drafter.HeadDrafter): its
    `init` then takes the prompt's features [B, P, D] too, and the loop calls its `observe`
    with each round's features and committed tokens."""
    return bool(getattr(drafter, "reads_features", False))


def resumable(drafter) -> bool:
    """Whether a drafter can catch up on text committed without it (it has `resume`), so that
    gamma=auto may decode plainly for a while and then draft again."""
    return hasattr(drafter, "resume")


def sources_of(drafter) -> tuple[str, ...]:
    """The names of what can serve a drafter's rounds (one name for most drafters)."""
    return tuple(getattr(drafter, "sources", (type(drafter).__name__,)))


def served(drafter, state, batch: int):
    """int32 [B]: the index in sources_of(drafter) of the source that served each row's last
    round (0 for a drafter with one source)."""
    if hasattr(drafter, "served"):
        return drafter.served(state)
    return jnp.zeros((batch,), jnp.int32)


def check_gamma(
    gamma: int,
    longest_prompt: int,
    max_new_tokens: int,
    contexts: dict[str, int],
    *,
    name="gamma",
    shown=None,
) -> None:
    """The one upper bound on gamma, for every drafter: ValueError naming `name` and the allowed
    range unless 1 <= gamma <= the largest gamma that fits.

    A round writes up to gamma drafts past the committed text, into the target's KV cache (and
    a draft model's), at positions up to prompt + max_new_tokens + gamma; so that must fit
    every context in `contexts` ({"the target's": its max_seq_len, "the draft's": the
    drafter's max_seq_len}). A drafter without a model (prompt lookup, suffix, n-gram tables)
    has no context of its own (UNBOUNDED_CONTEXT): the target's bounds its gamma. shown: what
    the message says was asked for (default gamma itself)."""
    owner, context = min(contexts.items(), key=lambda item: item[1])
    limit = context - longest_prompt - max_new_tokens
    if 1 <= gamma <= limit:
        return
    need = (
        f"the longest prompt ({longest_prompt} tokens) + max_new_tokens ({max_new_tokens}) + {name} "
        f"must fit {owner} context of {context} tokens"
    )
    shown = gamma if shown is None else shown
    if limit < 1:
        raise ValueError(f"no {name} fits: {need}, which leaves no room for drafts; got {shown}")
    raise ValueError(f"{name} must be in [1, {limit}] here ({need}), got {shown}")


@dataclasses.dataclass(frozen=True)
class NoDrafter:
    """Proposes nothing: with gamma = 0 the loop is plain autoregressive decoding."""

    vocab_size: int
    max_seq_len: int = 2**31 - 1
    prefill_calls: int = 0
    sources: ClassVar[tuple[str, ...]] = ()

    def init(self, params, tokens_bp, prompt_lens_b, cache_len):
        return ()

    def propose(self, params, state, context_b2, length_b, gamma, sampling, keys_b):
        if gamma:
            raise ValueError(f"NoDrafter proposes nothing: gamma must be 0, got {gamma}")
        batch = context_b2.shape[0]
        return jnp.zeros((batch, 0), jnp.int32), jnp.zeros((batch, 0, self.vocab_size), jnp.float32), state

    def resume(self, params, state, text_bs, synced_b, length_b, width):
        return state


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
class ModelDrafter:
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
    """

    config: ModelConfig
    prefill_calls: int = 1
    trimmed: bool = False
    threshold: float = 0.0
    sources: ClassVar[tuple[str, ...]] = ("model",)

    @property
    def variable_length(self) -> bool:
        return self.threshold > 0

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len

    def init(self, params, tokens_bp, prompt_lens_b, cache_len):
        model_params = params.model if self.trimmed else params
        return prefill(self.config, model_params, tokens_bp, prompt_lens_b, cache_len).cache

    def distribution(self, params, tokens_bt, positions_bt, cache, sampling, logits_at=None):
        """(q [B, V] of the last scored position, confidence [B], cache): the warped draft
        distribution and the top probability of the unwarped one."""
        if not self.trimmed:
            out = forward(self.config, params, tokens_bt, positions_bt, cache, logits_at)
            return warp(out.logits[:, 0], sampling), top_probability(out.logits[:, 0]), out.cache
        out = forward(
            self.config, params.model, tokens_bt, positions_bt, cache, logits_at, head=params.head.weight
        )
        q_r = warp(out.logits[:, 0], sampling)  # [B, R]
        q = jnp.zeros((q_r.shape[0], self.vocab_size), q_r.dtype)
        return q.at[:, params.head.ids].set(q_r), top_probability(out.logits[:, 0]), out.cache

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
        return tokens, q, cache

    def feed(self, params, cache, text_bs, start_b, stop_b, width: int):
        """The cache after reading the committed tokens text[start .. stop-1] of each row (a row
        whose start >= stop reads nothing it needs), `width` positions per call, as many calls
        as the longest gap needs (positions past stop get text padding, written past the
        length and overwritten before they are read)."""
        model_params, head = (params.model, params.head.weight) if self.trimmed else (params, None)
        first = jnp.zeros((start_b.shape[0], 1), jnp.int32)  # logits of one position (unused)

        def body(carry):
            start, cache = carry
            positions = start[:, None] + jnp.arange(width)[None, :]
            tokens = jnp.take_along_axis(text_bs, jnp.clip(positions, 0, text_bs.shape[1] - 1), axis=1)
            cache = forward(self.config, model_params, tokens, positions, cache, first, head=head).cache
            return jnp.where(start < stop_b, jnp.minimum(start + width, stop_b), start), cache

        _, cache = jax.lax.while_loop(lambda c: jnp.any(c[0] < stop_b), body, (start_b, cache))
        return cache

    def resume(self, params, cache, text_bs, synced_b, length_b, width):
        # propose feeds length-2 and length-1 itself.
        return self.feed(params, cache, text_bs, synced_b, length_b - 2, width)


def top_probability(logits_bv):
    """The top probability of softmax(logits), [B] float32."""
    logits = logits_bv.astype(jnp.float32)
    return 1.0 / jnp.sum(jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True)), axis=-1)


def trim_vocabulary(draft, token_ids) -> tuple[ModelDrafter, TrimmedDraftParams]:
    """(drafter, params) drafting with `draft` (a models.Model) over token_ids only (VocabTrim):
    the output head keeps those rows. token_ids: distinct ids in [0, V), e.g. the most frequent
    tokens of a corpus (spec_jax.ngram.most_frequent) plus the stop tokens."""
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


# Drafters that need no model: n-gram tables, fitted by spec_jax.ngram. They keep no state
# between rounds (the loop carries an empty tuple) and can read any context length.
UNBOUNDED_CONTEXT = 2**31 - 1


@flax.struct.dataclass
class UnigramTables:
    log_probs: jax.Array  # float32 [V]: log u(x), smoothed so every token has mass


@dataclasses.dataclass(frozen=True)
class UnigramDrafter:
    """Drafts every token from one fixed distribution u (unigram frequencies), ignoring context.

    Temperature, top-k and top-p warp log u like a model's logits; temperature 0 proposes
    argmax u (the most frequent token) at every position.
    """

    vocab_size: int
    max_seq_len: int = UNBOUNDED_CONTEXT
    prefill_calls: int = 0
    sources: ClassVar[tuple[str, ...]] = ("unigram",)

    def init(self, params, tokens_bp, prompt_lens_b, cache_len):
        return ()

    def resume(self, params, state, text_bs, synced_b, length_b, width):
        return state

    def propose(self, params: UnigramTables, state, context_b2, length_b, gamma, sampling, keys_b):
        batch = context_b2.shape[0]
        q_bv = jnp.broadcast_to(warp(params.log_probs, sampling), (batch, self.vocab_size))  # one warp
        tokens = jnp.stack([draw_rows(k, q_bv) for k in split_rows(keys_b, gamma)], axis=1)  # [B, G]
        q = jnp.broadcast_to(q_bv[:, None], (batch, gamma, self.vocab_size))
        return tokens, q, state


@flax.struct.dataclass
class BigramTables:
    """A smoothed bigram p(x | c) = (n(c, x) + s(x)) / d(c), stored sparsely (exact).

    The nonzero counts n(c, .) of context c are next_ids / next_counts[row_start[c] :
    row_start[c + 1]] (sorted by context, then padded with max_row_len zeros so a fixed-size
    slice from any row start stays in bounds). s = prior * u is the backoff mass spread by the
    unigram u, and d(c) = n(c) + prior, so an unseen context falls back to u exactly.
    """

    smoothing: jax.Array  # float32 [V]: prior * u(x)
    denominator: jax.Array  # float32 [V]: n(c) + prior, per context c
    row_start: jax.Array  # int32 [V + 1]
    next_ids: jax.Array  # int32 [nnz + max_row_len]
    next_counts: jax.Array  # float32 [nnz + max_row_len]


@dataclasses.dataclass(frozen=True)
class BigramDrafter:
    """Drafts from p(x | previous token): the first draft conditions on the last committed
    token (context[:, 1]), each later one on the draft before it.

    max_row_len: the most distinct successors any context has in the tables (a static slice
    width). Temperature 0 proposes argmax_x p(x | c): the most frequent successor, ties
    broken by the unigram, then toward the lower id (as warp does).
    """

    vocab_size: int
    max_row_len: int
    max_seq_len: int = UNBOUNDED_CONTEXT
    prefill_calls: int = 0
    sources: ClassVar[tuple[str, ...]] = ("bigram",)

    def init(self, params, tokens_bp, prompt_lens_b, cache_len):
        return ()

    def resume(self, params, state, text_bs, synced_b, length_b, width):
        return state

    def probs(self, params: BigramTables, context_b):
        """p(. | c) for each context token c [B]: float32 [B, V]."""

        def row(c):
            start = params.row_start[c]
            ids = jax.lax.dynamic_slice(params.next_ids, (start,), (self.max_row_len,))
            counts = jax.lax.dynamic_slice(params.next_counts, (start,), (self.max_row_len,))
            counts = jnp.where(jnp.arange(self.max_row_len) < params.row_start[c + 1] - start, counts, 0.0)
            return params.smoothing.at[ids].add(counts) / params.denominator[c]

        return jax.vmap(row)(context_b)

    def propose(self, params: BigramTables, state, context_b2, length_b, gamma, sampling, keys_b):
        def step(prev_b, step_keys):
            q_bv = warp(jnp.log(self.probs(params, prev_b)), sampling)
            token_b = draw_rows(step_keys, q_bv)
            return token_b, (token_b, q_bv)

        _, (tokens_gb, q_gbv) = jax.lax.scan(step, context_b2[:, 1], split_rows(keys_b, gamma))
        return tokens_gb.T, jnp.swapaxes(q_gbv, 0, 1), state
