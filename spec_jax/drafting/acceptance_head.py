"""The acceptance head's classifier (SpecDec++; trained by training.acceptance): at each draft
position, the probability that the draft is rejected given that every draft before it was
accepted, from what the draft head knows there. spec_jax.drafting.head.HeadDrafter reads it to
stop a row's draft (stop_rejection)."""

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

POSITIONS = 8  # draft positions told apart (later ones share the last)
HIDDEN = 128  # the classifier's width


@flax.struct.dataclass
class AcceptanceParams:
    mean: jax.Array  # [F] input standardization
    scale: jax.Array  # [F]
    w1: jax.Array  # [F, H]
    b1: jax.Array  # [H]
    w2: jax.Array  # [H]
    b2: jax.Array  # []


def signals(hidden_bd, confidence_b, entropy_b, position) -> jax.Array:
    """[B, F] float32 classifier inputs: the hidden state, log top probability, entropy, and a
    one-hot of the draft position (position: int or traced int)."""
    pos = jax.nn.one_hot(jnp.minimum(position, POSITIONS - 1), POSITIONS, dtype=jnp.float32)
    batch = hidden_bd.shape[0]
    extra = jnp.stack([jnp.log(jnp.maximum(confidence_b, 1e-30)), entropy_b], axis=-1).astype(jnp.float32)
    return jnp.concatenate(
        [hidden_bd.astype(jnp.float32), extra, jnp.broadcast_to(pos, (batch, POSITIONS))], -1
    )


def logit(params: AcceptanceParams, x_bf):
    h = jax.nn.gelu(((x_bf - params.mean) * params.scale) @ params.w1 + params.b1)
    return h @ params.w2 + params.b2


def reject_probability(params: AcceptanceParams, x_bf):
    """[B]: the predicted probability that the draft is rejected (given the ones before were not)."""
    return jax.nn.sigmoid(logit(params, x_bf))


def init(x_nf: np.ndarray, seed: int) -> AcceptanceParams:
    """Random parameters with the input standardized by the training examples' statistics."""
    rng = np.random.default_rng(seed)
    features = x_nf.shape[1]
    mean = x_nf.mean(axis=0)
    scale = 1.0 / np.maximum(x_nf.std(axis=0), 1e-3)
    return AcceptanceParams(
        mean=jnp.asarray(mean, jnp.float32),
        scale=jnp.asarray(scale, jnp.float32),
        w1=jnp.asarray(rng.standard_normal((features, HIDDEN)) / np.sqrt(features), jnp.float32),
        b1=jnp.zeros((HIDDEN,), jnp.float32),
        w2=jnp.asarray(rng.standard_normal((HIDDEN,)) / np.sqrt(HIDDEN), jnp.float32),
        b2=jnp.zeros((), jnp.float32),
    )
