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

import jax
import jax.numpy as jnp

from spec_jax.decode import PAD_ID, PrefillInputs, commit, first_token, prefill
from spec_jax.logprobs import kept_logprobs
from spec_jax.metrics import SpecMetrics
from spec_jax.rounds import RoundResult, chain_round, tree_round
from spec_jax.sampling import split_rows
from spec_jax.state import SpecState, SpecStatic


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


def spec_round(static: SpecStatic, params, draft_params, state: SpecState, stop_ids) -> SpecState:
    """One round for every row (rows already done compute but commit nothing): a chain of gamma
    drafts (chain_round) or, with tree_nodes, a token tree (tree_round); then the commit."""
    keys, draft_keys, verify_keys = split_rows(state.keys, 3)
    active = ~state.out.done
    body = tree_round if static.tree_nodes else chain_round
    result = body(static, params, draft_params, state, active, draft_keys, verify_keys)
    return _finish_round(static, state, stop_ids, active, keys, result)


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
        max_drafts=state.max_drafts,
    )


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
