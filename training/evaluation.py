"""Held-out evaluation of a draft head (`evaluate`): from a few positions j of every evaluation
window the head drafts 4 tokens as it would in the loop (step 1 from the target's true feature,
later steps from its own predictions, fed the text's tokens) and each draft is compared with the
target's greedy token there. `eval_length` = 1 + the mean number of leading drafts that agree:
the mean accepted length at gamma 4, temperature 0, on text the head never trained on.
"""

import jax
import jax.numpy as jnp
import numpy as np

from models import draft_head
from training.features import FeatureSet
from training.loss import Frozen

EVAL_STEPS = 4  # drafts per evaluated position (gamma)
EVAL_OFFSETS = 4  # evaluated positions per window


def chain_agreement(hcfg, params, frozen: Frozen, tokens_bt, features_btd, greedy_bt, mask_bt, offset: int):
    """[B, EVAL_STEPS] bool: whether each of the head's drafts from position `offset` agrees with
    the target's greedy token (drafted as in the loop; fed the text's tokens), and [B, EVAL_STEPS]
    bool validity (inside the window's real tokens)."""
    b, t = tokens_bt.shape
    j = offset
    cache = draft_head.new_cache(hcfg, b, j + EVAL_STEPS + 1)
    positions = jnp.broadcast_to(jnp.arange(j + 1, dtype=jnp.int32), (b, j + 1))
    h, cache = draft_head.forward(
        hcfg, params, features_btd[:, : j + 1], tokens_bt[:, 1 : j + 2], positions, cache, frozen.embed
    )
    hidden = h[:, j]
    agree, valid = [], []
    for s in range(EVAL_STEPS):
        if s:
            pos = jnp.full((b, 1), j + s, jnp.int32)
            out, cache = draft_head.forward(
                hcfg, params, hidden[:, None], tokens_bt[:, j + 1 + s, None], pos, cache, frozen.embed
            )
            hidden = out[:, 0]
        draft = frozen.ids[jnp.argmax(draft_head.logits(hidden[:, None], frozen.out, hcfg)[:, 0], axis=-1)]
        agree.append(draft == greedy_bt[:, j + 1 + s])
        valid.append(mask_bt[:, j + 2 + s])
    return jnp.stack(agree, 1), jnp.stack(valid, 1)


def eval_offsets(seq_len: int) -> list[int]:
    last = seq_len - EVAL_STEPS - 3
    return sorted({max(0, (last * (2 * i + 1)) // (2 * EVAL_OFFSETS)) for i in range(EVAL_OFFSETS)})


def evaluate(hcfg, params, frozen: Frozen, data: FeatureSet, num_windows: int) -> dict:
    """Held-out metrics: per-step agreement acc_1..acc_4 (each among positions whose earlier
    drafts all agreed: the acceptance rate of that draft position) and eval_length."""
    n = min(num_windows, len(data))
    tokens = jnp.asarray(data.windows.tokens[:n])
    mask = jnp.asarray(data.windows.mask[:n])
    greedy = jnp.asarray(data.greedy[:n])
    features = jnp.asarray(np.asarray(data.features[:n], np.float32))
    fn = jax.jit(chain_agreement, static_argnums=(0, 7))
    accepted, counted = [], []
    for j in eval_offsets(tokens.shape[1]):
        agree, valid = fn(hcfg, params, frozen, tokens, features, greedy, mask, j)
        ok = np.asarray(jnp.all(valid, axis=1))
        accepted.append(np.cumprod(np.asarray(agree), axis=1)[ok])
        counted.append(ok.sum())
    chains = np.concatenate(accepted)  # [chains, EVAL_STEPS] 1 while every draft so far agreed
    out = {"eval_length": float(1.0 + chains.sum(axis=1).mean()), "eval_chains": int(chains.shape[0])}
    reached = np.concatenate([np.ones((chains.shape[0], 1)), chains[:, :-1]], axis=1)
    for s in range(EVAL_STEPS):
        out[f"acc_{s + 1}"] = float(chains[:, s].sum() / max(reached[:, s].sum(), 1))
    return out
