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

import jax.numpy as jnp

from spec_jax import tree


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
