"""The decoding loop: prefill both models, then one lax.while_loop of draft -> verify -> commit.

Each round, per row with n committed tokens (the last one, t_{n-1}, not yet in any cache):
  1. the drafter reads t_{n-2}, t_{n-1} and proposes up to gamma tokens with their
     distributions q (q = 0 where a row proposes nothing more: spec_jax.verify);
  2. the target scores [t_{n-1}, d_0 .. d_{gamma-1}] at positions n-1 .. n-1+gamma in ONE call
     (t_{n-1} alone when the drafter may stop early and no row proposed anything);
  3. the rejection rule accepts a prefix of a drafts and draws one more token;
  4. the row commits a + 1 tokens (fewer at a stop token or max_new_tokens) and n advances by
     that, independently of the other rows.
Plain autoregressive decoding is this loop with gamma = 0 and spec_jax.drafting.NoDrafter: the
target scores [t_{n-1}] and the rule draws the next token from p (there is nothing to reject).

A row that reaches non-finite target logits (NaN or inf at a position the rule reads; at
prefill, the first token's) commits the tokens drawn before them (spec_jax.verify.finite_prefix)
and stops, flagged in Output.nonfinite: plain decoding stops at the same token. The other rows
go on unchanged.
"""

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp

from models.cache import KVCache
from models.config import ModelConfig
from models.transformer import forward
from spec_jax import tree as tree_lib
from spec_jax.decode import PAD_ID, Output, PrefillInputs, commit, first_token, prefill
from spec_jax.drafting.base import Drafter
from spec_jax.logprobs import kept_logprobs
from spec_jax.metrics import SpecMetrics
from spec_jax.sampling import RowSampling, split_rows, warp
from spec_jax.verify import draft_lengths, finite_prefix, overlap, verify, verify_logits


@flax.struct.dataclass
class SpecState:
    target_cache: KVCache
    draft_state: Any
    out: Output
    prev_token: jax.Array  # int32 [B], committed token n-2 (in the target cache)
    last_token: jax.Array  # int32 [B], committed token n-1 (in no cache yet)
    length: jax.Array  # int32 [B], n: committed tokens, prompt included
    keys: jax.Array  # [B] PRNG keys, one chain per row
    metrics: SpecMetrics
    sampling: RowSampling  # each row's warp (temperature, top-k, top-p [B]), read every round
    # bool [B] or None: rows that decode plainly inside a drafting loop (their drafts' q is
    # zeroed, so the rule draws from p alone, with the keys plain decoding uses: the same
    # tokens as gamma = 0). spec_jax.engine sets it per request (Request.speculate).
    plain: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class SpecStatic:
    """The static settings of one compiled loop (hashable: a static argument of jax.jit)."""

    config: ModelConfig
    drafter: Drafter
    gamma: int  # 0: plain autoregressive decoding (with NoDrafter)
    max_new_tokens: int
    cache_len: int
    # Target call widths for drafters that propose fewer than gamma drafts in some rounds (each
    # compiles a branch of the loop): "ends" 1 and gamma + 1; "all" every width 1..gamma + 1,
    # so that a round verifies only as many positions as its longest draft needs.
    verify_widths: str = "ends"
    # 0: chain rounds. N > 0: tree rounds (spec_jax.tree), the drafter's propose_tree of N node
    # slots verified in one target call of N + 1 queries; gamma is then N (the cache and the
    # metrics are sized for paths of up to N tokens).
    tree_nodes: int = 0

    def widths(self) -> tuple[int, ...]:
        if self.verify_widths == "all":
            return tuple(range(1, self.gamma + 2))
        if self.verify_widths == "ends":
            return (1, self.gamma + 1)
        raise ValueError(f"verify_widths must be 'ends' or 'all', got {self.verify_widths!r}")


def spec_prefill(static: SpecStatic, params, draft_params, inputs: PrefillInputs, pool=None) -> SpecState:
    """Both models read the prompts; the first new token is drawn from the target's logits.
    pool: the prefix cache's (spec_jax.prefix_cache), whose blocks inputs.prefix_blocks names:
    the target reads each row from the end of its cached prefix."""
    drafter = static.drafter
    prefix = None if pool is None or inputs.prefix_blocks is None else (pool, inputs.prefix_blocks)
    # The target's features of the prompt for a drafter that reads them (else None).
    target = prefill(
        static.config,
        params,
        inputs.tokens,
        inputs.prompt_lens,
        static.cache_len,
        with_features=drafter.reads_features,
        prefix=prefix,
    )
    target_cache, features = target.cache, target.features
    draft_state = drafter.init(draft_params, inputs.tokens, inputs.prompt_lens, static.cache_len, features)
    sampling = inputs.row_sampling()
    out, token, keys = first_token(target.logits, inputs, sampling, static.max_new_tokens)
    if features is not None:  # the last prompt position's pair waited for the first token
        last = (inputs.prompt_lens - 1)[:, None]
        f_last = jnp.take_along_axis(features, last[:, :, None], axis=1)  # [B, 1, D]
        ones = jnp.ones_like(inputs.prompt_lens)
        draft_state = drafter.observe(draft_params, draft_state, f_last, token[:, None], last[:, 0], ones)
    prev = jnp.take_along_axis(inputs.tokens, (inputs.prompt_lens - 1)[:, None], axis=1)[:, 0]
    batch = inputs.tokens.shape[0]
    metrics = SpecMetrics.zeros(static.gamma, len(drafter.sources), batch).replace(
        target_calls=jnp.ones((), jnp.int32),
        draft_calls=jnp.asarray(drafter.prefill_calls, jnp.int32),
    )
    return SpecState(
        target_cache=target_cache,
        draft_state=draft_state,
        out=out,
        prev_token=prev,
        last_token=token,
        length=inputs.prompt_lens + 1,
        keys=keys,
        metrics=metrics,
        sampling=sampling,
    )


def committed_text(tokens_bp, prompt_lens_b, out_tokens_bn, length_b, slots: int):
    """int32 [B, slots]: each row's committed tokens at their positions, the prompt (tokens_bp
    [B, P], right-padded) then the generated tokens (Output.tokens [B, N]), PAD_ID from the
    row's length on."""
    j = jnp.arange(slots)[None, :]
    start = prompt_lens_b[:, None]
    prompt = jnp.take_along_axis(tokens_bp, jnp.clip(j, 0, tokens_bp.shape[1] - 1), axis=1)
    generated = jnp.take_along_axis(out_tokens_bn, jnp.clip(j - start, 0, out_tokens_bn.shape[1] - 1), axis=1)
    text = jnp.where(j < start, prompt, generated)
    return jnp.where(j < length_b[:, None], text, PAD_ID).astype(jnp.int32)


class RoundResult(NamedTuple):
    """What a round body (chain_round, tree_round) hands _finish_round: per row, C candidate
    tokens of which the first `usable` may be committed, what the metrics count, and the
    caches after the round."""

    new: jax.Array  # int32 [B, C]: the accepted drafts, then the token the rule drew
    usable: jax.Array  # int32 [B]: how many of `new` were drawn from finite target logits
    nonfinite: jax.Array  # bool [B]: active rows that reached non-finite logits (they stop)
    num_drafted: jax.Array  # int32 [B]: drafts proposed (a tree: its nodes)
    num_accepted: jax.Array  # int32 [B]
    overlap: jax.Array  # float32 [B, G]: sum_x min(p, q) at each scored draft position
    # () -> float32 [B, C, V]: the target's raw logits each of `new` was drawn or accepted under
    # (the kept tokens' logprobs: spec_jax.logprobs; called only where some row asks for them)
    logits: Callable[[], jax.Array]
    target_cache: KVCache
    draft_state: Any
    # committed int32 [B] -> the drafter's state after it observed the round's target features
    # (a drafter that reads_features; None: draft_state stands).
    observe: Callable[[jax.Array], Any] | None = None
    num_scored: jax.Array | None = None  # int32 [B]: a tree's depths that enter alpha (None: a chain's)
    draft_steps: int | None = None  # the drafter's batched calls this round (None: gamma, a chain's)


def spec_round(static: SpecStatic, params, draft_params, state: SpecState, stop_ids) -> SpecState:
    """One round for every row (rows already done compute but commit nothing): a chain of gamma
    drafts (chain_round) or, with tree_nodes, a token tree (tree_round); then the commit."""
    keys, draft_keys, verify_keys = split_rows(state.keys, 3)
    active = ~state.out.done
    body = tree_round if static.tree_nodes else chain_round
    result = body(static, params, draft_params, state, active, draft_keys, verify_keys)
    return _finish_round(static, state, stop_ids, active, keys, result)


def chain_round(static: SpecStatic, params, draft_params, state: SpecState, active, draft_keys, verify_keys):
    """The RoundResult of a chain: the drafter proposes up to gamma drafts per row, the target
    scores them in one call (_score_chain), the rule accepts a prefix and draws one more."""
    gamma = static.gamma
    context = jnp.stack([state.prev_token, state.last_token], axis=1)
    drafts, q, draft_state = static.drafter.propose(
        draft_params, state.draft_state, context, state.length, gamma, state.sampling, draft_keys
    )
    q = _unproposed(q, state.plain)
    num_drafted = draft_lengths(q, drafts) if gamma else jnp.zeros_like(state.length)
    logits, finite, target_cache, target_features = _score_chain(
        static, params, state, drafts, num_drafted, active
    )
    num_accepted, next_token, alpha_terms = verify_logits(
        drafts, q, logits, state.sampling, verify_keys, rule=verify
    )
    usable, nonfinite = _finite_tokens(finite, num_accepted, active)

    idx = jnp.arange(gamma + 1)[None, :]
    drafts_ext = jnp.concatenate([drafts, next_token[:, None]], axis=1)  # [B, G + 1]
    new = jnp.where(idx < num_accepted[:, None], drafts_ext, next_token[:, None])  # [B, G + 1]
    observe = None
    if static.drafter.reads_features:  # the pairs (feature at n-1+i, token at n+i), i < committed, are real

        def observe(committed):
            return static.drafter.observe(
                draft_params, draft_state, target_features, new, state.length - 1, jnp.maximum(committed, 1)
            )

    return RoundResult(
        new=new,
        usable=usable,
        nonfinite=nonfinite,
        num_drafted=num_drafted,
        num_accepted=num_accepted,
        overlap=alpha_terms,
        logits=lambda: logits,
        target_cache=target_cache,
        draft_state=draft_state,
        observe=observe,
    )


def _score_chain(static: SpecStatic, params, state: SpecState, drafts, num_drafted, active):
    """(the raw logits [B, G + 1, V], finite [B, G + 1] (the logits at the position were all
    finite), the target cache, features [B, G + 1, D] or None): the target
    scores [t_{n-1}, drafts] at n-1 .. n-1+G, in the narrowest call that covers every active
    row's drafts where the drafter proposes variable lengths (a round where no row proposed
    anything is one decode step)."""
    gamma = static.gamma
    tokens = jnp.concatenate([state.last_token[:, None], drafts], axis=1)  # [B, G + 1]
    positions = (state.length - 1)[:, None] + jnp.arange(gamma + 1)[None, :]
    features = static.drafter.reads_features

    def score(width, cache):
        """A target call over the first `width` positions, the last one repeated up to G + 1:
        every active row proposed at most width - 1 drafts, so the rule reads nothing past
        position width - 1 and the row commits at most width tokens."""
        out = forward(
            static.config, params, tokens[:, :width], positions[:, :width], cache, with_features=features
        )
        pad = ((0, 0), (0, gamma + 1 - width), (0, 0))
        logits = jnp.pad(out.logits, pad, mode="edge")
        finite = jnp.pad(jnp.all(jnp.isfinite(out.logits), axis=-1), pad[:2], mode="edge")
        f = jnp.pad(out.features, pad, mode="edge") if features else None
        return logits, finite, out.cache, f

    if not (gamma and static.drafter.variable_length):
        return score(gamma + 1, state.target_cache)
    widths = static.widths()
    needed = jnp.max(jnp.where(active, num_drafted, 0)) + 1
    branch = jnp.searchsorted(jnp.asarray(widths), needed)
    return jax.lax.switch(branch, [lambda cache, w=w: score(w, cache) for w in widths], state.target_cache)


def tree_round(static: SpecStatic, params, draft_params, state: SpecState, active, draft_keys, verify_keys):
    """The RoundResult of a tree: the drafter's tree of N slots (spec_jax.tree), scored in one
    target call with the tree mask, verified by verify_tree, the accepted path's keys and values
    moved to where a chain's would be (tree.compact), the drafter told the path
    (Drafter.accepted); a drafter that reads_features observes the target's features along the
    path, as after a chain of the path's tokens."""
    n, drafter = static.tree_nodes, static.drafter
    context = jnp.stack([state.prev_token, state.last_token], axis=1)
    proposal = drafter.propose_tree(
        draft_params, state.draft_state, context, state.length, n, state.sampling, draft_keys
    )
    tree = proposal.tree.replace(q=_unproposed(proposal.tree.q, state.plain))
    tokens, positions, bits = tree_lib.call_inputs(state.last_token, tree, state.length)
    features = drafter.reads_features
    out = forward(
        static.config, params, tokens, positions, state.target_cache, with_features=features, tree=bits
    )
    p = warp(out.logits, state.sampling)  # [B, N + 1, V]: after the root, then after each node
    path, num_accepted, next_token = tree_lib.verify_tree(tree, p, verify_keys)
    # The rule read p at the root and along the path: the chain's positions, in path order.
    finite = tree_lib.path_rows(jnp.all(jnp.isfinite(out.logits), axis=-1), path, num_accepted)
    usable, nonfinite = _finite_tokens(finite, num_accepted, active)
    new = tree_lib.path_tokens(tree, path, num_accepted, next_token)
    root = state.length - 1
    target_cache = tree_lib.compact(out.cache, root, path, num_accepted)
    draft_state = drafter.accepted(draft_params, proposal.state, tree, path, num_accepted, state.length)
    observe = None
    if features:  # the path's pairs (feature at n-1+i, committed token at n+i), as a chain's

        def observe(committed):
            path_features = tree_lib.path_rows(out.features, path, num_accepted)  # [B, N + 1, D]
            return drafter.observe(
                draft_params, draft_state, path_features, new, root, jnp.maximum(committed, 1)
            )

    # alpha along the path: each scored depth's p against the q of the node taken there.
    q_taken, num_scored = tree_lib.taken_q(tree, path, num_accepted)
    p_path = tree_lib.path_rows(p, path, num_accepted)[:, :n]
    return RoundResult(
        new=new,
        usable=usable,
        nonfinite=nonfinite,
        num_drafted=jnp.sum(tree.present, axis=1).astype(jnp.int32),
        num_accepted=num_accepted,
        overlap=overlap(p_path, q_taken),
        logits=lambda: tree_lib.path_rows(out.logits, path, num_accepted),  # a chain's, in path order
        target_cache=target_cache,
        draft_state=draft_state,
        observe=observe,
        num_scored=num_scored,
        draft_steps=drafter.tree_calls(n),
    )


def _finite_tokens(finite_bc, num_accepted_b, active_b):
    """(usable [B], nonfinite [B]): a row that reached non-finite target logits commits the
    tokens drawn before them (spec_jax.verify.finite_prefix) and stops; finite_bc: bool [B, C],
    the logits the rule read at each of the row's positions were all finite."""
    usable = finite_prefix(finite_bc, num_accepted_b)
    return usable, active_b & (usable <= num_accepted_b)


def _finish_round(
    static: SpecStatic, state: SpecState, stop_ids, active, keys, result: RoundResult
) -> SpecState:
    """What every round ends with: the row commits the first `usable` of its new tokens [B, C]
    (commit), then the last two committed tokens, the length and the metrics move on.
    active: bool [B], the rows not done before the round; keys: the rows' keys after it."""
    new, draft_state = result.new, result.draft_state
    kept = kept_logprobs(result.logits, new, state.out.num_logprobs)
    out, committed = commit(state.out, new, result.usable, state.out.budget, stop_ids, result.nonfinite, kept)
    if result.observe is not None:
        draft_state = result.observe(committed)

    # The new last two committed tokens; a row that committed nothing keeps its own.
    last = jnp.take_along_axis(new, jnp.maximum(committed - 1, 0)[:, None], axis=1)[:, 0]
    before_last = jnp.take_along_axis(new, jnp.maximum(committed - 2, 0)[:, None], axis=1)[:, 0]
    prev = jnp.where(committed >= 2, before_last, state.last_token)
    moved = committed > 0
    metrics = state.metrics.update(
        active & ~result.nonfinite,  # a row's round that met non-finite logits counts no acceptance
        result.num_drafted,
        result.num_accepted,
        result.overlap,
        committed,
        static.gamma if result.draft_steps is None else result.draft_steps,
        # A plain round (gamma 0, as gamma=auto may end with) is served by no drafter source.
        static.drafter.served(draft_state, new.shape[0]) if static.gamma else jnp.full_like(state.length, -1),
        result.num_scored,
    )
    return SpecState(
        target_cache=result.target_cache,
        draft_state=draft_state,
        out=out,
        prev_token=jnp.where(moved, prev, state.prev_token),
        last_token=jnp.where(moved, last, state.last_token),
        length=state.length + committed,
        keys=keys,
        metrics=metrics,
        sampling=state.sampling,
        plain=state.plain,
    )


def _unproposed(q_bnv, plain_b):
    """q with the rows of plain_b (SpecState.plain; None: none) zeroed: they propose nothing."""
    return q_bnv if plain_b is None else jnp.where(plain_b[:, None, None], 0.0, q_bnv).astype(q_bnv.dtype)


def spec_loop(
    static: SpecStatic, params, draft_params, state: SpecState, stop_ids, max_rounds=None
) -> SpecState:
    """Runs rounds until every row is done, or for max_rounds rounds (an int32 scalar; gamma=auto
    runs the loop in chunks), as one lax.while_loop."""
    limit = jnp.iinfo(jnp.int32).max if max_rounds is None else max_rounds

    def body(carry):
        s, i = carry
        return spec_round(static, params, draft_params, s, stop_ids), i + 1

    state, _ = jax.lax.while_loop(
        lambda c: ~jnp.all(c[0].out.done) & (c[1] < limit), body, (state, jnp.zeros((), jnp.int32))
    )
    return state


def stepper(static: SpecStatic, params, draft_params, inputs: PrefillInputs):
    """(state after prefill, step): the loop one round at a time, each round a compiled call
    (step(state) -> state), for what inspects the state between rounds (tests; training.acceptance
    logs rounds with it). generate runs the same rounds inside one while_loop."""
    state = jax.jit(spec_prefill, static_argnums=0)(static, params, draft_params, inputs)
    round_fn = jax.jit(spec_round, static_argnums=0)
    return state, lambda state: round_fn(static, params, draft_params, state, inputs.stop_ids)
