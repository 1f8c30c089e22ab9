"""The draft head's loss (EAGLE-1: Li et al. 2024) and the batches it reads.

At every position j of a window the head reads the target's feature f_j (plus Gaussian noise, so
that it learns to continue from its own slightly wrong predictions when drafting) and the
embedding of t_{j+1}, and its output h_j is pulled towards f_{j+1} (smooth L1,
`regression_weight`) and its token distribution softmax(W h_j) towards the target's,
softmax(W f_{j+1}) (cross-entropy, `token_weight`), where W is the target's output head
restricted to the drafted token set.
"""

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from models import draft_head
from models.config import ModelConfig
from models.transformer import output_head
from training.features import FeatureSet, float32_twin


@flax.struct.dataclass
class Frozen:
    """The target's tables the head reads and is scored through (float32 copies)."""

    embed: jax.Array  # [V, D]
    out: jax.Array  # [R, D]: the output head's rows for the drafted tokens
    ids: jax.Array  # int32 [R]: those tokens


def frozen_tables(target, token_ids) -> Frozen:
    cfg, params = float32_twin(
        target.config, {"embed": target.params["embed"], "out": output_head(target.config, target.params)}
    )
    del cfg
    ids = jnp.asarray(token_ids, jnp.int32)
    return Frozen(embed=params["embed"]["embedding"], out=jnp.asarray(params["out"])[ids], ids=ids)


def training_batch(data: FeatureSet, index: np.ndarray):
    """(tokens [B, T], mask [B, T], features float32 [B, T, D]) of the windows `index`, each
    window's tokens with its own features (read in ascending order: the features are
    memory-mapped)."""
    index = np.sort(index)
    return (
        jnp.asarray(data.windows.tokens[index]),
        jnp.asarray(data.windows.mask[index]),
        jnp.asarray(np.asarray(data.features[index], np.float32)),
    )


def training_pairs(tokens_bt, features_btd):
    """(features [B, T-1, D], tokens [B, T-1], goals [B, T-1, D]): at j the head reads f_j and
    the token t_{j+1} and should output f_{j+1}."""
    return features_btd[:, :-1], tokens_bt[:, 1:], features_btd[:, 1:]


def loss_fn(hcfg: ModelConfig, config, params, frozen: Frozen, tokens_bt, mask_bt, features_btd, key):
    """(loss, metrics) of one batch of windows (see the module docstring)."""
    b, t = tokens_bt.shape
    f_in, t_in, goal = training_pairs(tokens_bt, features_btd)
    rms = jnp.sqrt(jnp.mean(jnp.square(f_in)))
    f_in = f_in + config.feature_noise * rms * jax.random.normal(key, f_in.shape, f_in.dtype)
    positions = jnp.broadcast_to(jnp.arange(t - 1, dtype=jnp.int32), (b, t - 1))
    cache = draft_head.new_cache(hcfg, b, t - 1)
    hidden, _ = draft_head.forward(hcfg, params, f_in, t_in, positions, cache, frozen.embed)
    weight = (mask_bt[:, 1:] & mask_bt[:, :-1]).astype(jnp.float32)  # [B, T-1]
    total = jnp.maximum(jnp.sum(weight), 1.0)
    regression = jnp.mean(optax.huber_loss(hidden, goal, delta=1.0), axis=-1)  # smooth L1
    k = config.token_loss_stride  # the token loss on every k-th position: [B, (T-1)/k]
    goal_logits = draft_head.logits(goal[:, ::k], frozen.out, hcfg)
    draft_logits = draft_head.logits(hidden[:, ::k], frozen.out, hcfg)
    token = optax.softmax_cross_entropy(draft_logits, jax.nn.softmax(jax.lax.stop_gradient(goal_logits)))
    agree = (jnp.argmax(draft_logits, -1) == jnp.argmax(goal_logits, -1)).astype(jnp.float32)
    token_weight, token_total = weight[:, ::k], jnp.maximum(jnp.sum(weight[:, ::k]), 1.0)
    loss = (
        config.regression_weight * jnp.sum(weight * regression) / total
        + config.token_weight * jnp.sum(token_weight * token) / token_total
    )
    metrics = {
        "loss": loss,
        "regression": jnp.sum(weight * regression) / total,
        "token_ce": jnp.sum(token_weight * token) / token_total,
        "top1": jnp.sum(token_weight * agree) / token_total,
    }
    return loss, metrics
