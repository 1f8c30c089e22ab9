"""Training a draft head (models.draft_head) on the target's features, with optax and orbax.

The loss is EAGLE-1's (Li et al. 2024): at every position j of a window the head reads the
target's feature f_j (plus Gaussian noise, so that it learns to continue from its own slightly
wrong predictions when drafting) and the embedding of t_{j+1}, and its output h_j is pulled
towards f_{j+1} (smooth L1, `regression_weight`) and its token distribution softmax(W h_j)
towards the target's, softmax(W f_{j+1}) (cross-entropy, `token_weight`), where W is the target's
output head restricted to the drafted token set. Optimizer: AdamW with linear warm-up and
cosine decay, global-norm gradient clipping (optax).

Reproducible and resumable: batch b of epoch e is a fixed slice of a permutation drawn from
(seed, e), and step s's noise from fold_in(key(seed), s), so the same config and seed give the
same parameters bit for bit on one machine, and a run resumed from its last checkpoint equals
an uninterrupted one. Checkpoints (orbax, written to a temporary folder and renamed when
complete, so an interrupted save leaves the previous one intact):
  WORKDIR/checkpoints/STEP/   the training state (params, optimizer state, step), for resuming
  WORKDIR/best/STEP/          the head with the best held-out accepted length so far
each with `meta` (the config, the head's config, the target it was trained for, the drafted
token ids). `load_head(WORKDIR, target)` reads the best one back as a models.Model, refusing a
head trained for another target.

Held-out evaluation (`evaluate`): from a few positions j of every evaluation window the head
drafts 4 tokens as it would in the loop (step 1 from the target's true feature, later steps
from its own predictions, fed the text's tokens) and each draft is compared with the target's
greedy token there. `eval_length` = 1 + the mean number of leading drafts that agree: the mean
accepted length at gamma 4, temperature 0, on text the head never trained on.
"""

import dataclasses
import hashlib
import json
import math
import pathlib
import time
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
from absl import logging as absl_logging
from tqdm.auto import tqdm

import models
from models import draft_head
from models.config import ModelConfig
from models.transformer import init_params, output_head
from spec_jax.features import FeatureSet, float32_twin

EVAL_STEPS = 4  # drafts per evaluated position (gamma)
EVAL_OFFSETS = 4  # evaluated positions per window


def default_config() -> ml_collections.ConfigDict:
    """The settings of a draft-head training run (launch/configs/draft_head.py starts from here)."""
    c = ml_collections.ConfigDict()
    c.target = "qwen2.5-coder-1.5b"
    c.target_dtype = "int8"  # the precision whose features the head learns (models.precision)
    c.corpora = ("code", "news")  # experiments.corpora tasks; their training split only
    c.train_tokens = 150_000
    c.eval_tokens = 16_384  # from the held-out split
    c.seq_len = 256
    c.vocab = 32768  # drafted token set: the most frequent training tokens (0: the whole vocabulary)
    c.head_layers = 1  # the head's shape; 0 below means the target's own
    c.head_heads = 0
    c.head_kv_heads = 0
    c.head_mlp_dim = 0
    c.init_from_target = True  # start the head's layers from the target's last layers where shapes allow
    c.identity_init = True  # start the head as h_j = f_j (fc = [I, 0], output projections zero)
    c.batch_size = 8
    c.steps = 300
    c.learning_rate = 5e-4
    c.warmup_steps = 30
    c.end_learning_rate_factor = 0.05
    c.weight_decay = 0.01
    c.clip_norm = 0.5
    c.regression_weight = 1.0
    c.token_weight = 1.0
    c.feature_noise = 0.1  # Gaussian noise on input features, relative to their RMS
    c.token_loss_stride = (
        4  # the cross-entropy at every k-th position (its output head dominates a step's cost)
    )
    c.eval_every = 50
    c.checkpoint_every = 50
    c.eval_windows = 32
    c.seed = 0
    return c


INT_RANGES = {
    "train_tokens": (16, 10**9),
    "eval_tokens": (16, 10**8),
    "seq_len": (16, 8192),
    "vocab": (0, 10**7),
    "batch_size": (1, 4096),
    "steps": (1, 10**8),
    "warmup_steps": (0, 10**8),
    "eval_every": (1, 10**8),
    "checkpoint_every": (1, 10**8),
    "eval_windows": (1, 10**6),
    "token_loss_stride": (1, 4096),
    "seed": (0, 2**31 - 1),
}
FLOAT_RANGES = {
    "learning_rate": (0.0, 1.0),
    "end_learning_rate_factor": (0.0, 1.0),
    "weight_decay": (0.0, 1.0),
    "clip_norm": (0.0, 1e6),
    "regression_weight": (0.0, 1e6),
    "token_weight": (0.0, 1e6),
    "feature_noise": (0.0, 10.0),
}


def validate(config, known_corpora=None) -> None:
    """ValueError("<key>: ...") for a setting out of range (the head's shape is checked against
    the target by head_config)."""
    for key, (low, high) in INT_RANGES.items():
        v = config[key]
        if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
            raise ValueError(f"{key}: must be an integer in [{low}, {high}], got {v!r}")
    for key, (low, high) in FLOAT_RANGES.items():
        v = config[key]
        if isinstance(v, bool) or not isinstance(v, int | float) or not low <= v <= high:
            raise ValueError(f"{key}: must be a number in [{low}, {high}], got {v!r}")
    if config.learning_rate <= 0:
        raise ValueError(f"learning_rate: must be positive, got {config.learning_rate}")
    if config.regression_weight + config.token_weight <= 0:
        raise ValueError("regression_weight, token_weight: at least one must be positive")
    if known_corpora is not None:
        corpora = tuple(config.corpora)
        unknown = [c for c in corpora if c not in known_corpora]
        if not corpora or unknown:
            raise ValueError(
                f"corpora: unknown corpus {unknown[0] if unknown else '(none given)'}; known corpora: "
                f"{', '.join(known_corpora)}"
            )
    for key in ("head_layers", "head_heads", "head_kv_heads", "head_mlp_dim"):
        v = config[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{key}: must be an integer >= 0 (0: the target's), got {v!r}")


def head_config(config, target: ModelConfig) -> ModelConfig:
    """The head's ModelConfig (float32, XLA products: differentiable) from the training config;
    ValueError naming the head_* key of a head wider or deeper than the target."""
    keys = {"num_layers": "head_layers", "num_heads": "head_heads", "num_kv_heads": "head_kv_heads"}
    keys["mlp_dim"] = "head_mlp_dim"
    try:
        return draft_head.config_for(
            target,
            num_layers=config.head_layers or 1,
            num_heads=config.head_heads or None,
            num_kv_heads=config.head_kv_heads or None,
            mlp_dim=config.head_mlp_dim or None,
            dtype="float32",
            matmul_impl="xla",
        )
    except ValueError as e:
        name, _, rest = str(e).partition(" ")
        raise ValueError(f"{keys.get(name, name)}: {rest}") from None


def target_identity(target) -> dict:
    """What a head is tied to: the target's name and shapes, and a fingerprint of its norm
    scales (never quantized; rounded to bfloat16, so the same target at any precision has the
    same one)."""
    cfg = target.config
    digest = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(target.params)[0]:
        if "norm" in jax.tree_util.keystr(path):
            digest.update(np.asarray(jnp.asarray(leaf, jnp.bfloat16).astype(jnp.float32)).tobytes())
    return {
        "name": cfg.name,
        "vocab_size": cfg.vocab_size,
        "d_model": cfg.d_model,
        "num_layers": cfg.num_layers,
        "norms_sha256": digest.hexdigest()[:16],
    }


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
    goal_logits = draft_head.logits(goal[:, ::k], frozen.out, "xla")
    draft_logits = draft_head.logits(hidden[:, ::k], frozen.out, "xla")
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
        draft = frozen.ids[jnp.argmax(draft_head.logits(hidden[:, None], frozen.out, "xla")[:, 0], axis=-1)]
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


def params_hash(params) -> str:
    """sha256 of every parameter's bytes, in pytree order: equal iff the parameters are."""
    digest = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        digest.update(jax.tree_util.keystr(path).encode())
        digest.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    return digest.hexdigest()


def _config_json(config) -> dict:
    return json.loads(config.to_json_best_effort())


def _managers(workdir: pathlib.Path):
    latest = ocp.CheckpointManager(
        workdir / "checkpoints",
        options=ocp.CheckpointManagerOptions(max_to_keep=1, create=True, cleanup_tmp_directories=True),
    )
    best = ocp.CheckpointManager(
        workdir / "best",
        options=ocp.CheckpointManagerOptions(
            max_to_keep=1,
            create=True,
            best_fn=lambda m: m["eval_length"],
            best_mode="max",
            keep_checkpoints_without_metrics=False,
            cleanup_tmp_directories=True,
        ),
    )
    return latest, best


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
    identity = target_identity(target)
    meta = {
        "config": _config_json(config),
        "head_config": dataclasses.asdict(hcfg),
        "target": identity,
        "token_ids": [int(i) for i in np.asarray(token_ids)],
    }
    tx = optimizer(config)
    latest, best = _managers(workdir)
    history_path = workdir / "history.jsonl"
    if latest.latest_step() is not None:
        saved = latest.restore(latest.latest_step(), args=ocp.args.Composite(meta=ocp.args.JsonRestore()))[
            "meta"
        ]
        if saved != meta:
            diff = next((k for k in meta if saved.get(k) != meta[k]), "config")
            if diff == "config":
                diff = next(
                    (f"config.{k}" for k in meta["config"] if saved["config"].get(k) != meta["config"][k]),
                    diff,
                )
            raise ValueError(
                f"workdir {workdir} holds a run with other settings ({diff} differs); resume it with the "
                "same config or train into another workdir"
            )
        params0 = initial_params(config, hcfg, target)
        abstract = TrainState(step=jnp.zeros((), jnp.int32), params=params0, opt_state=tx.init(params0))
        state = latest.restore(
            latest.latest_step(),
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract))
            ),
        )["state"]
        for later in [st for st in best.all_steps() if st > int(state.step)]:  # redone from here on
            best.delete(later)
        history = (
            [json.loads(line) for line in history_path.read_text().splitlines()]
            if history_path.exists()
            else []
        )
        history = [h for h in history if h["step"] <= int(state.step)]
    else:
        params0 = initial_params(config, hcfg, target)
        state = TrainState(step=jnp.zeros((), jnp.int32), params=params0, opt_state=tx.init(params0))
        history = []
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
                best.save(
                    done,
                    args=ocp.args.Composite(
                        params=ocp.args.StandardSave(state.params), meta=ocp.args.JsonSave(meta)
                    ),
                    metrics={"eval_length": record["eval_length"]},
                )
                if record["eval_length"] > best_eval.get("eval_length", -1):
                    best_eval = record
            if done % config.checkpoint_every == 0 or done == end:
                _save_latest(latest, best, done, state, meta, history, history_path)
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


def _save_latest(latest, best, step, state, meta, history, history_path):
    """The resumable state at `step`, after every best/ save before it is complete. The history
    is written first: a run killed after the checkpoint is complete has every step's line up to
    it, and one killed before has lines past the last complete checkpoint, which a resumed run
    trims to the restored step."""
    tmp = history_path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(h) + "\n" for h in history))
    tmp.replace(history_path)
    latest.save(
        step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
    )
    latest.wait_until_finished()
    best.wait_until_finished()


def checkpoint_reader(folder) -> ocp.CheckpointManager:
    """A read-only orbax CheckpointManager of `folder`, opened without orbax's warnings about
    being read-only (three lines on stderr, before any error a CLI prints as its one line)."""
    verbosity = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.ERROR)
    try:
        return ocp.CheckpointManager(folder, options=ocp.CheckpointManagerOptions(read_only=True))
    finally:
        absl_logging.set_verbosity(verbosity)


def load_head(workdir, target, step: int | None = None):
    """(head models.Model in float32, as trained, token ids, meta) from a training workdir's best
    checkpoint (or `step`), for `target` (a models.Model); models.cast makes it another precision.
    ValueError if there is none, or if it was trained for another target."""
    folder = pathlib.Path(workdir).expanduser() / "best"
    if not folder.is_dir():
        raise ValueError(
            f"no trained head in {workdir} (no best/ checkpoint; train one with python -m launch.train)"
        )
    mngr = checkpoint_reader(folder)
    step = mngr.best_step() if step is None else step
    if step is None:
        step = mngr.latest_step()
    if step is None:
        raise ValueError(f"no trained head in {workdir} (best/ holds no checkpoint)")
    meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    identity = target_identity(target)
    if meta["target"] != identity:
        raise ValueError(
            f"the head in {workdir} was trained for target {meta['target']['name']!r} "
            f"({meta['target']}), not for {identity['name']!r} ({identity}); train one for this target"
        )
    hcfg = ModelConfig(**meta["head_config"])
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, init_params(hcfg, 0))
    params = mngr.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract)))["params"]
    head = models.Model(config=hcfg.replace(matmul_impl="auto"), params=params)
    return head, np.asarray(meta["token_ids"], np.int32), meta


def scale_note(config, hcfg: ModelConfig, tokens_per_second: float) -> dict:
    """How this run's size relates to the method's usual scale (for the README and results)."""
    params = sum(math.prod(np.shape(x)) for x in jax.tree.leaves(init_params(hcfg, 0)))
    return {
        "head_parameters": int(params),
        "tokens_seen": int(config.steps * config.batch_size * config.seq_len),
        "train_tokens": int(config.train_tokens),
        "tokens_per_second": float(tokens_per_second),
    }
