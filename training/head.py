"""Training a draft head (models.draft_head) on the target's features, with optax and orbax.

The loss is EAGLE-1's (training.loss); the optimizer AdamW with linear warm-up and cosine decay
and global-norm gradient clipping (optax); held-out evaluation is training.evaluation's.

Reproducible and resumable: batch b of epoch e is a fixed slice of a permutation drawn from
(seed, e), and step s's noise from fold_in(key(seed), s), so the same config and seed give the
same parameters bit for bit on one machine, and a run resumed from its last checkpoint
(training.checkpoint) equals an uninterrupted one. spec_jax.head_checkpoint.load_head(WORKDIR,
target) reads the best head back as a models.Model, refusing a head trained for another target.
"""

import dataclasses
import math
import pathlib
import time
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from models.config import ModelConfig
from models.transformer import init_params
from spec_jax.head_checkpoint import params_hash
from training import checkpoint
from training.config import head_config, validate
from training.evaluation import evaluate
from training.features import FeatureSet, float32_twin
from training.loss import frozen_tables, loss_fn, training_batch


class TrainState(flax.struct.PyTreeNode):
    step: jax.Array
    params: Any
    opt_state: Any


def optimizer(config) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.learning_rate,
        warmup_steps=config.warmup_steps,
        decay_steps=max(config.steps, config.warmup_steps + 1),
        end_value=config.learning_rate * config.end_learning_rate_factor,
    )
    return optax.chain(
        optax.clip_by_global_norm(config.clip_norm) if config.clip_norm > 0 else optax.identity(),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=config.weight_decay),
    )


def initial_params(config, hcfg: ModelConfig, target) -> Any:
    """Random head parameters (seeded), with the layers copied from the target's last layers
    where init_from_target and the shapes allow (a head of the target's own layer shape)."""
    params = init_params(hcfg, config.seed)
    if config.init_from_target:
        params = _copy_target_layers(params, hcfg, target)
    return identity_start(params, hcfg) if config.identity_init else params


def _copy_target_layers(params, hcfg: ModelConfig, target):
    _, tparams = float32_twin(target.config, target.params)
    tcfg = target.config
    for i in range(hcfg.num_layers):
        src = tcfg.num_layers - hcfg.num_layers + i
        layer = (
            tparams[f"layers_{src}"]
            if not tcfg.scan_layers
            else jax.tree.map(lambda x, s=src: x[s], tparams["layers"])
        )
        if jax.tree.map(jnp.shape, layer) == jax.tree.map(jnp.shape, params[f"layers_{i}"]):
            params[f"layers_{i}"] = jax.tree.map(jnp.asarray, layer)
    return params


def identity_start(params, hcfg: ModelConfig):
    """The head started as the identity on the feature: fc = [I, 0] and every layer's output
    projections (attention `wo`, MLP `w_down`) zero, so that h_j = f_j before training and the
    head learns the change from one feature to the next (Medusa's zero-initialized residual)."""
    params = dict(params)
    d = hcfg.d_model
    params["fc"] = {"weight": jnp.concatenate([jnp.eye(d), jnp.zeros((d, d))], axis=1)}
    for i in range(hcfg.num_layers):
        layer = params[f"layers_{i}"]
        params[f"layers_{i}"] = {
            **layer,
            "attn": {**layer["attn"], "wo": jnp.zeros_like(layer["attn"]["wo"])},
            "mlp": {**layer["mlp"], "w_down": jnp.zeros_like(layer["mlp"]["w_down"])},
        }
    return params


def make_step(hcfg, config, tx):
    def step(state: TrainState, frozen, tokens, mask, features, key):
        grad_fn = jax.value_and_grad(
            lambda p: loss_fn(hcfg, config, p, frozen, tokens, mask, features, key), has_aux=True
        )
        (_, metrics), grads = grad_fn(state.params)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics["grad_norm"] = optax.tree.norm(grads)
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return jax.jit(step, donate_argnums=0)


def batch_indices(config, num_windows: int, step: int) -> np.ndarray:
    """The window indices of training step `step`: batch (step mod B) of epoch (step div B) (B
    batches per epoch), a slice of a permutation drawn from (seed, epoch)."""
    per_epoch = max(num_windows // config.batch_size, 1)
    epoch, i = divmod(step, per_epoch)
    perm = np.random.default_rng([config.seed, epoch]).permutation(num_windows)
    if num_windows < config.batch_size:
        perm = np.resize(perm, config.batch_size)
    return perm[i * config.batch_size : (i + 1) * config.batch_size]


@dataclasses.dataclass
class RunResult:
    steps_done: int  # the state's step when this call returned
    steps_run: int  # steps this call trained (fewer than steps_done when it resumed)
    history: list  # one dict per logged step (train and eval metrics)
    best: dict  # the best evaluation so far
    seconds: float  # this call's training time (not loading)
    params_hash: str


def train(
    config,
    workdir,
    target,
    token_ids,
    train_set: FeatureSet,
    eval_set: FeatureSet,
    *,
    progress: bool = True,
    stop_at: int | None = None,
) -> RunResult:
    """Trains (or resumes, from WORKDIR/checkpoints) a head for `target` (a models.Model) on
    train_set, evaluating on eval_set; stops at config.steps, or at stop_at (a step) to
    simulate an interruption. ValueError if the workdir holds a run with other settings."""
    validate(config)
    workdir = pathlib.Path(workdir)
    hcfg = head_config(config, target.config)
    frozen = frozen_tables(target, token_ids)
    meta = checkpoint.run_meta(config, hcfg, target, token_ids)
    tx = optimizer(config)
    latest, best = checkpoint.managers(workdir)
    history_path = workdir / "history.jsonl"
    params0 = initial_params(config, hcfg, target)
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params0, opt_state=tx.init(params0))
    resumed = checkpoint.resume(workdir, latest, best, meta, state, history_path)
    state, history = resumed if resumed is not None else (state, [])
    step_fn = make_step(hcfg, config, tx)
    key = jax.random.key(config.seed)
    end = config.steps if stop_at is None else min(stop_at, config.steps)
    start_step = int(state.step)
    best_eval = max((h for h in history if "eval_length" in h), key=lambda h: h["eval_length"], default={})
    began = time.perf_counter()
    with tqdm(
        total=config.steps, initial=start_step, unit="step", desc="train head", disable=not progress
    ) as bar:
        for s in range(start_step, end):
            batch = training_batch(train_set, batch_indices(config, len(train_set), s))
            state, metrics = step_fn(state, frozen, *batch, jax.random.fold_in(key, s))
            done = s + 1
            record = {"step": done, **{k: float(v) for k, v in metrics.items()}}
            history.append(record)
            if done % config.eval_every == 0 or done == config.steps:
                record.update(evaluate(hcfg, state.params, frozen, eval_set, config.eval_windows))
                checkpoint.save_best(best, done, state.params, meta, record["eval_length"])
                if record["eval_length"] > best_eval.get("eval_length", -1):
                    best_eval = record
            if done % config.checkpoint_every == 0 or done == end:
                checkpoint.save_latest(latest, best, done, state, meta, history, history_path)
            bar.set_postfix(loss=f"{record['loss']:.3f}", best_len=f"{best_eval.get('eval_length', 0):.2f}")
            bar.update(1)
    latest.wait_until_finished()
    best.wait_until_finished()
    return RunResult(
        steps_done=int(state.step),
        steps_run=int(state.step) - start_step,
        history=history,
        best=best_eval,
        seconds=time.perf_counter() - began,
        params_hash=params_hash(state.params),
    )


def scale_note(config, hcfg: ModelConfig, tokens_per_second: float) -> dict:
    """How this run's size relates to the method's usual scale (for the README and results)."""
    params = sum(math.prod(np.shape(x)) for x in jax.tree.leaves(init_params(hcfg, 0)))
    return {
        "head_parameters": int(params),
        "tokens_seen": int(config.steps * config.batch_size * config.seq_len),
        "train_tokens": int(config.train_tokens),
        "tokens_per_second": float(tokens_per_second),
    }
