"""The rejection rule of speculative sampling (Leviathan et al. 2023, Algorithm 1), batched.

Draft x_i ~ q_i is accepted while u_i < p_i(x_i) / q_i(x_i). At the first rejection i the
next token comes from norm(max(0, p_i - q_i)); if all gamma drafts are accepted, a bonus
token comes from p_{gamma+1}. The committed tokens are then distributed exactly as the
target's. Appending a zero "draft distribution" after the last draft makes the bonus draw
the same formula as the residual draw, so there is one code path.

Rows may draft fewer than G tokens (per-row adaptive lengths, a lookup that found nothing): a
position whose q is all zeros was not proposed. Nothing is accepted from there on, and the
next token is drawn from max(0, p - 0) = p itself, as after the last draft. The proposed
positions of a row are a prefix of its G; whether a row stops may depend on draft-side
information only (never on p or on the uniforms), which keeps every position exact.
"""

import jax
import jax.numpy as jnp

from spec_jax import tree
from spec_jax.sampling import argmax, warp


def verify(draft_tokens_bg, q_bgv, p_bgv, keys_b):
    """Applies the rule to each row: spec_jax.tree's rule on the chain (one rule for chains and
    trees; tests/test_tree.py checks it against the rule above written out for a chain).

    Args:
      draft_tokens_bg: int [B, G], the sampled drafts.
      q_bgv: [B, G, V], the (warped) draft distributions the drafts were sampled from.
      p_bgv: [B, G + 1, V], the (warped) target distributions at the same positions plus one.
      keys_b: [B] PRNG keys; row b draws from keys_b[b] only.

    Returns:
      (num_accepted [B] int32 in [0, G], next_token [B] int32): the row commits
      draft_tokens[:num_accepted] and then next_token.
    """
    _, num_accepted, next_token = tree.verify_tree(tree.chain(draft_tokens_bg, q_bgv), p_bgv, keys_b)
    return num_accepted, next_token


def verify_logits(draft_tokens_bg, q_bgv, logits_bgv, sampling, keys_b, rule=None):
    """verify (or `rule`, its signature: a test swaps in a broken one) on the target's raw logits
    [B, G + 1, V] warped by each row's settings (sampling: spec_jax.sampling.RowSampling), and
    the overlap of p and q at the drafts' positions.

    Returns (num_accepted [B], next_token [B], overlap [B, G]: sum_x min(p, q), alpha's terms).
    Where every row is greedy (a lax.cond), p is the one-hot of the argmax a_i and the rule
    reduces to what it gives then without any pass over the vocabulary beyond the argmax: a
    proposed draft (q(x_i) > 0) is accepted while x_i = a_i (u q(x_i) < p(x_i) = 1), the next
    token is a at the first position not accepted (the residual max(0, p - q) of a one-hot p is
    a point mass at a, or p itself), and sum_x min(p, q) = q(a_i). The same tokens as verify
    on warp's one-hot p, bit for bit (tests/test_verify.py)."""
    g = draft_tokens_bg.shape[1]

    def greedy():
        top = argmax(logits_bgv)  # [B, G + 1], warp's argmax (ties and NaN alike)
        drafts = draft_tokens_bg.astype(jnp.int32)
        q_x = jnp.take_along_axis(q_bgv, drafts[..., None], axis=-1)[..., 0]
        accepted = (drafts == top[:, :g]) & (q_x > 0)
        num_accepted = jnp.sum(jnp.cumprod(accepted, axis=1), axis=1).astype(jnp.int32)
        next_token = jnp.take_along_axis(top, num_accepted[:, None], axis=1)[:, 0]
        q_top = jnp.take_along_axis(q_bgv, top[:, :g, None], axis=-1)[..., 0]
        return num_accepted, next_token, jnp.minimum(q_top.astype(jnp.float32), 1.0)

    def sampled():
        p = warp(logits_bgv, sampling)
        num_accepted, next_token = (rule or verify)(draft_tokens_bg, q_bgv, p, keys_b)
        return num_accepted, next_token, overlap(p[:, :g], q_bgv)

    rows = sampling.for_rows(logits_bgv.shape[0])
    return jax.lax.cond(jnp.all(rows.greedy), greedy, sampled)


def finite_prefix(finite_bg1, num_accepted_b):
    """int32 [B] in [0, num_accepted + 1]: how many of the row's num_accepted + 1 tokens were
    drawn from finite target logits.

    finite_bg1: bool [B, G + 1], whether the target's logits at each position were all finite.
    Token i of the round (a draft accepted by p_i, or the last token drawn from p_i at
    i = num_accepted) depends on p_0 .. p_i only, so the tokens before the first non-finite
    position stand; a count below num_accepted + 1 means the row reached non-finite logits.
    A non-finite position past num_accepted (after a rejected draft) changes nothing the row
    commits.
    """
    leading = jnp.sum(jnp.cumprod(finite_bg1, axis=1), axis=1).astype(jnp.int32)
    return jnp.minimum(leading, num_accepted_b + 1)


def draft_lengths(q_bgv, draft_tokens_bg=None):
    """int32 [B]: how many leading positions of each row were proposed (q not all zero). With
    the drafts [B, G] (drawn from q, so q(x) > 0 where q is not all zero), q(x) > 0 is read
    at each draft instead of q's sum over the vocabulary."""
    if draft_tokens_bg is None:
        proposed = jnp.sum(q_bgv, axis=-1) > 0  # [B, G]
    else:
        drafts = draft_tokens_bg.astype(jnp.int32)[..., None]
        proposed = jnp.take_along_axis(q_bgv, drafts, axis=-1)[..., 0] > 0
    return jnp.sum(jnp.cumprod(proposed, axis=1), axis=1).astype(jnp.int32)


def overlap(p_bgv, q_bgv):
    """sum_x min(p(x), q(x)) per position: [B, G]. Its mean over positions is alpha."""
    return jnp.sum(jnp.minimum(p_bgv, q_bgv), axis=-1)
