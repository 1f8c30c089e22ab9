"""A draft head's training run (EAGLE-1 style) for a target: its settings, the data, the run,
and what it reports (training.report.Report: its learning curves and what it reached).

`python -m launch.train --config=launch/configs/draft_head.py` runs it (so does
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
import numpy as np

from models import corpora, registry
from spec_jax.drafting import trained_head as head_drafting
from spec_jax.drafting.tables import frequent_tokens
from training import features, targets
from training.config import default_config, head_config
from training.config import validate as validate_settings
from training.head import scale_note, train
from training.report import Plot, Report

NAME = "train_head"
TITLE = "Training a draft head on the target's features (EAGLE-1 loss, AdamW, orbax checkpoints)"
ROW_KEYS = (
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


def get_config(quick: bool = False):
    config = default_config()
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
    """ValueError("<key>: ...") for a target that cannot be loaded or a setting out of range."""
    targets.check_target(config)
    validate_settings(config, known_corpora=corpora.TASKS)


def training_config(config):
    """The settings that define the trained head (everything but where it is written)."""
    out = config.copy_and_resolve_references()
    del out["workdir"]
    return out


def token_ids(config, target) -> np.ndarray:
    """The drafted token set: the config.vocab most frequent tokens of the training split (and the
    stop tokens), as VocabTrim's; every token when config.vocab is 0 or covers the vocabulary."""
    vocab = target.config.vocab_size
    if (
        config.vocab == 0
        or config.vocab >= vocab
        or target.tokenizer is None
        or config.target in targets.TINY_MODELS
    ):
        return np.arange(vocab, dtype=np.int32)
    stops = list(getattr(target.tokenizer, "stop_ids", ()) or ())
    return np.asarray(frequent_tokens(config.target, target.tokenizer, vocab, config.vocab, always=stops))


def _sequences(config, target, split_index: int) -> list[list[int]]:
    """Tokenized documents of the configured corpora: split_index 0 the training split, 1 the
    held-out one (corpora.TRIM_TEST_FRACTION, the split of table 3 and the trimmed heads)."""
    docs = []
    for task in config.corpora:
        docs += [
            text
            for _, text in corpora.split(corpora.documents(task), corpora.TRIM_TEST_FRACTION)[split_index]
        ]
    return targets.encode_all(target.tokenizer, docs)


def feature_sets(config, target, progress: bool = True, cache_dir=None):
    """(train, eval) training.features.FeatureSet for a training config: windows of the corpora's
    training split (config.train_tokens) and of the held-out split (config.eval_tokens) through
    the target, computed once and cached under `$SPEC_JAX_CACHE/features/`."""
    if target.tokenizer is None:
        raise ValueError(f"target: {config.target!r} has no tokenizer to read the corpora with")
    sets = []
    for split_index, (name, budget) in enumerate(
        (("train", config.train_tokens), ("eval", config.eval_tokens))
    ):
        data_key = {
            "corpora": list(config.corpora),
            "split": name,
            "tokens": budget,
            "seq_len": config.seq_len,
            "seed": config.seed,
            "tiny": config.target in targets.TINY_MODELS,
        }
        model_key = {"target": config.target, "dtype": config.target_dtype}
        folder = (
            registry.cache_root(cache_dir)
            / "features"
            / f"{config.target}-{features.cache_key(model_key, data_key)}"
        )
        sets.append(
            features.cached(
                folder / name,
                lambda si=split_index, b=budget: features.windows(
                    _sequences(config, target, si), config.seq_len, b, config.seed
                ),
                target.config,
                target.params,
                progress=progress,
            )
        )
    return tuple(sets)


def plot(config, history) -> Plot:
    """The loss curve and the held-out accepted length of a run's history (training.train)."""

    def draw(axes):
        ax_loss, ax_len = axes
        evals = [h for h in history if "eval_length" in h]
        ax_loss.plot([h["step"] for h in history], [h["loss"] for h in history], lw=0.8)
        title = f"loss ({config.regression_weight:g} x smooth L1 + {config.token_weight:g} x CE)"
        ax_loss.set(xlabel="step", ylabel="training loss", yscale="log", title=title)
        ax_len.plot([h["step"] for h in evals], [h["eval_length"] for h in evals], marker="o")
        ax_len.set(
            xlabel="step",
            ylabel="held-out accepted length (gamma 4)",
            title="held-out, greedy, teacher-forced",
        )

    return Plot(9, 3.2, 2, draw)


def run(config) -> Report:
    """Loads the target, computes (or reads) its features, trains the head into the workdir and
    reports every evaluation, the summary and the curves."""
    target = targets.load_model(config.target, config.target_dtype)
    hcfg = head_config(config, target.config)  # a bad head shape fails before any work
    ids = token_ids(config, target)
    load_start = time.perf_counter()
    train_set, eval_set = feature_sets(config, target)
    features_s = time.perf_counter() - load_start
    workdir = config.workdir or str(head_drafting.default_workdir(config.target))
    result = train(training_config(config), workdir, target, ids, train_set, eval_set)
    tokens_per_s = result.steps_run * config.batch_size * (config.seq_len - 1) / max(result.seconds, 1e-9)
    rows = [{k: h[k] for k in ROW_KEYS} for h in result.history if "eval_length" in h]
    scale = scale_note(config, hcfg, tokens_per_s)
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
    markdown = _markdown(config, hcfg, result, summary, tokens_per_s)
    return Report(rows, markdown, summary, plot=plot(config, result.history))


def _markdown(config, hcfg, result, summary: dict, tokens_per_s: float) -> str:
    """The reading: the head's shape and data, what the run trained, the best held-out length."""
    best, workdir = result.best, summary["workdir"]
    return (
        f"Head: {summary['head_parameters']:,} parameters ({hcfg.num_layers} layer(s), {hcfg.num_heads} q / "
        f"{hcfg.num_kv_heads} kv heads, MLP {hcfg.mlp_dim}), drafting over {summary['drafted_tokens']:,} "
        f"tokens. Trained on {summary['train_windows']:,} windows of {config.seq_len} tokens "
        f"({config.train_tokens:,} tokens of {', '.join(config.corpora)}), {result.steps_done} steps of "
        f"{config.batch_size} windows ({summary['tokens_seen']:,} tokens seen); this run trained "
        f"{result.seconds:.0f} s ({tokens_per_s:.0f} tokens/s), the features took "
        f"{summary['feature_seconds']:.0f} s (cached after the first run).\n\n"
        f"Best held-out accepted length at gamma 4 (greedy, teacher-forced): {best.get('eval_length', float('nan')):.3f} "
        f"at step {best.get('step')}; checkpoints in `{workdir}` (params sha256 {result.params_hash[:16]}).\n\n"
        f"Config: `{json.dumps(training_config(config).to_dict(), sort_keys=True, default=list)}`"
    )
