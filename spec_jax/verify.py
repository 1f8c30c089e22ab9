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

from spec_jax.sampling import draw_rows, split_rows


def verify(draft_tokens_bg, q_bgv, p_bgv, keys_b):
    """Applies the rule to each row.

    Args:
      draft_tokens_bg: int [B, G], the sampled drafts.
      q_bgv: [B, G, V], the (warped) draft distributions the drafts were sampled from.
      p_bgv: [B, G + 1, V], the (warped) target distributions at the same positions plus one.
      keys_b: [B] PRNG keys; row b draws from keys_b[b] only.

    Returns:
      (num_accepted [B] int32 in [0, G], next_token [B] int32): the row commits
      draft_tokens[:num_accepted] and then next_token.
    """
    gamma = draft_tokens_bg.shape[1]
    q = q_bgv.astype(jnp.float32)
    p = p_bgv.astype(jnp.float32)
    uniform_keys, residual_keys = split_rows(keys_b, 2)
    u = jax.vmap(lambda k: jax.random.uniform(k, (gamma,)))(uniform_keys)  # [B, G] in [0, 1)

    p_x = jnp.take_along_axis(p[:, :gamma], draft_tokens_bg[..., None], axis=-1)[..., 0]
    q_x = jnp.take_along_axis(q, draft_tokens_bg[..., None], axis=-1)[..., 0]
    # u < p/q without dividing: a proposed draft has q(x) > 0 since it was sampled from q; an
    # unproposed position (q = 0) is never accepted.
    accepted = (u * q_x < p_x) & (q_x > 0)  # [B, G]
    num_accepted = jnp.sum(jnp.cumprod(accepted, axis=1), axis=1).astype(jnp.int32)

    q_ext = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)  # [B, G + 1, V]
    p_at = jnp.take_along_axis(p, num_accepted[:, None, None], axis=1)[:, 0]  # [B, V]
    q_at = jnp.take_along_axis(q_ext, num_accepted[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(p_at - q_at, 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    # p == q up to rounding leaves no residual mass; the rejection then had probability ~0,
    # and any distribution keeps the rule exact up to that rounding: use p.
    residual = jnp.where(mass > 1e-12, residual / jnp.maximum(mass, 1e-30), p_at)
    next_token = draw_rows(residual_keys, residual)
    return num_accepted, next_token


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


def draft_lengths(q_bgv):
    """int32 [B]: how many leading positions of each row were proposed (q not all zero)."""
    proposed = jnp.sum(q_bgv, axis=-1) > 0  # [B, G]
    return jnp.sum(jnp.cumprod(proposed, axis=1), axis=1).astype(jnp.int32)


def overlap(p_bgv, q_bgv):
    """sum_x min(p(x), q(x)) per position: [B, G]. Its mean over positions is alpha."""
    return jnp.sum(jnp.minimum(p_bgv, q_bgv), axis=-1)
