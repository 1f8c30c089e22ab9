"""A round's bodies (spec_jax.speculative.spec_round runs one per round): a chain of gamma
drafts (chain_round: the drafter proposes, the target scores them in one call, the rule accepts
a prefix and draws one more) or a token tree (tree_round), each handing back a RoundResult:
the candidate tokens, what may be committed of them, what the metrics count, the caches.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from models.cache import KVCache
from models.transformer import forward
from spec_jax import tree as tree_lib
from spec_jax.sampling import warp
from spec_jax.state import SpecState, SpecStatic
from spec_jax.verify import draft_lengths, finite_prefix, overlap, verify, verify_logits


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


def chain_round(static: SpecStatic, params, draft_params, state: SpecState, active, draft_keys, verify_keys):
    """The RoundResult of a chain: the drafter proposes up to gamma drafts per row, the target
    scores them in one call (_score_chain), the rule accepts a prefix and draws one more."""
    gamma = static.gamma
    context = jnp.stack([state.prev_token, state.last_token], axis=1)
    drafts, q, draft_state = static.drafter.propose(
        draft_params, state.draft_state, context, state.length, gamma, state.sampling, draft_keys
    )
    q = _capped(q, state.max_drafts, jnp.arange(1, gamma + 1)[None, :])
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
    tree = proposal.tree
    tree = tree.replace(q=_capped(tree.q, state.max_drafts, tree_lib.depths(tree.parents)))
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


def _capped(q_bnv, max_drafts_b, depth_bn):
    """q with each row's drafts (or nodes) deeper than its max_drafts (SpecState.max_drafts;
    None: none is) zeroed: the row does not propose them. depth_bn: int32 [B or 1, N], a draft's
    depth (1: the first draft, a root child)."""
    if max_drafts_b is None:
        return q_bnv
    return jnp.where((depth_bn > max_drafts_b[:, None])[:, :, None], 0.0, q_bnv).astype(q_bnv.dtype)
