"""Training a draft head (EAGLE-1 style) for a target: the run, its learning curves and what it reached.

`python -m launch.train --config=launch/configs/draft_head.py` runs this experiment (so does
`python -m launch.experiment --experiment=train_head`): the target's features over the
training split of the corpora (computed once, cached), then training.train into the
workdir (default `$SPEC_JAX_CACHE/heads/TARGET/`; a second run with the same settings resumes
there), evaluated on the held-out split. The table lists every evaluation: the head's
held-out accepted length at gamma 4 (teacher-forced; the decode benchmarks measure the real
one), per-position agreement, the losses, and the wall time.
"""

import json
import time

import jax

import training
from experiments import common, framework, heads
from models import corpora
from spec_jax.drafting import trained_head as head_drafting

TITLE = "Training a draft head on the target's features (EAGLE-1 loss, AdamW, orbax checkpoints)"

MODEL_KEYS = ("target",)
DTYPE_KEYS = ("target_dtype",)


def get_config(quick: bool = False):
    config = training.default_config()
    config.workdir = ""  # "": spec_jax.drafting.trained_head.default_workdir(target)
    if quick:  # a tiny random target on the code corpus: seconds
        config.target = "tiny"
        config.target_dtype = "float32"
        config.corpora = ("code",)
        config.train_tokens = 4096
        config.eval_tokens = 1024
        config.seq_len = 32
        config.vocab = 0
        config.head_mlp_dim = 32
        config.batch_size = 4
        config.steps = 12
        config.warmup_steps = 2
        config.eval_every = 6
        config.checkpoint_every = 6
        config.eval_windows = 8
    return config


def validate(config) -> None:
    training.validate(config, known_corpora=corpora.TASKS)


def training_config(config):
    """The settings that define the trained head (everything but where it is written)."""
    out = config.copy_and_resolve_references()
    del out["workdir"]
    return out


def figure(config, history):
    """The loss curve and the held-out accepted length of a run's history (training.train)."""
    evals = [h for h in history if "eval_length" in h]
    fig, (ax_loss, ax_len) = framework.new_figure(9, 3.2, 2)
    ax_loss.plot([h["step"] for h in history], [h["loss"] for h in history], lw=0.8)
    title = f"loss ({config.regression_weight:g} x smooth L1 + {config.token_weight:g} x CE)"
    ax_loss.set(xlabel="step", ylabel="training loss", yscale="log", title=title)
    ax_len.plot([h["step"] for h in evals], [h["eval_length"] for h in evals], marker="o")
    ax_len.set(
        xlabel="step", ylabel="held-out accepted length (gamma 4)", title="held-out, greedy, teacher-forced"
    )
    return fig


def run(config) -> framework.Result:
    target = common.load_model(config.target, config.target_dtype)
    hcfg = training.head_config(config, target.config)  # a bad head shape fails before any work
    ids = heads.token_ids(config, target)
    load_start = time.perf_counter()
    train_set, eval_set = heads.feature_sets(config, target)
    features_s = time.perf_counter() - load_start
    workdir = config.workdir or str(head_drafting.default_workdir(config.target))
    result = training.train(training_config(config), workdir, target, ids, train_set, eval_set)
    tokens_per_s = result.steps_run * config.batch_size * (config.seq_len - 1) / max(result.seconds, 1e-9)
    evals = [h for h in result.history if "eval_length" in h]
    rows = [
        {
            k: h[k]
            for k in (
                "step",
                "loss",
                "regression",
                "token_ce",
                "top1",
                "eval_length",
                "acc_1",
                "acc_2",
                "acc_3",
                "acc_4",
            )
        }
        for h in evals
    ]
    fig = figure(config, result.history)
    scale = training.scale_note(config, hcfg, tokens_per_s)
    summary = {
        "workdir": workdir,
        "steps": result.steps_done,
        "train_seconds_this_run": result.seconds,
        "feature_seconds": features_s,
        "train_windows": len(train_set),
        "eval_windows": len(eval_set),
        "drafted_tokens": int(len(ids)),
        "best": result.best,
        "params_hash": result.params_hash,
        "devices": [d.device_kind for d in jax.devices()],
        **scale,
    }
    best = result.best
    markdown = (
        f"Head: {scale['head_parameters']:,} parameters ({hcfg.num_layers} layer(s), {hcfg.num_heads} q / "
        f"{hcfg.num_kv_heads} kv heads, MLP {hcfg.mlp_dim}), drafting over {len(ids):,} tokens. Trained on "
        f"{len(train_set):,} windows of {config.seq_len} tokens ({config.train_tokens:,} tokens of "
        f"{', '.join(config.corpora)}), {result.steps_done} steps of {config.batch_size} windows "
        f"({scale['tokens_seen']:,} tokens seen); this run trained {result.seconds:.0f} s "
        f"({tokens_per_s:.0f} tokens/s), the features took {features_s:.0f} s (cached after the first run).\n\n"
        f"Best held-out accepted length at gamma 4 (greedy, teacher-forced): {best.get('eval_length', float('nan')):.3f} "
        f"at step {best.get('step')}; checkpoints in `{workdir}` (params sha256 {result.params_hash[:16]}).\n\n"
        f"Config: `{json.dumps(training_config(config).to_dict(), sort_keys=True, default=list)}`"
    )
    return framework.Result.from_dicts(rows, markdown=markdown, summary=summary, figure=fig)
