"""Trained drafters and the data they train on: the corpora's training split through the target
(training.features), the drafted token set, where a trained head lives, and loading it as a
drafter for spec_jax.generate.

A head for target T trains into `$SPEC_JAX_CACHE/heads/T/` by default (its orbax checkpoints,
history and plot; the precision whose features it learned is in its metadata, and it drafts
for the target at any precision); `python -m launch.train` writes there, and
`--drafter=head` of `launch.generate`, table 3 and the walltime experiment read from there.
"""

import dataclasses
import pathlib

import numpy as np

import models
from experiments import common, corpora
from models import registry
from spec_jax import head_checkpoint
from training import features


def default_workdir(target: str, cache_dir=None) -> pathlib.Path:
    """Where a head for this target is trained and found by default."""
    return registry.cache_root(cache_dir) / "heads" / target


def token_ids(config, target) -> np.ndarray:
    """The drafted token set: the config.vocab most frequent tokens of the training split (and the
    stop tokens), as VocabTrim's; every token when config.vocab is 0 or covers the vocabulary."""
    vocab = target.config.vocab_size
    if (
        config.vocab == 0
        or config.vocab >= vocab
        or target.tokenizer is None
        or config.target in common.TINY_MODELS
    ):
        return np.arange(vocab, dtype=np.int32)
    stops = list(getattr(target.tokenizer, "stop_ids", ()) or ())
    return np.asarray(
        corpora.frequent_tokens(config.target, target.tokenizer, vocab, config.vocab, always=stops)
    )


def _sequences(config, target, split_index: int) -> list[list[int]]:
    """Tokenized documents of the configured corpora: split_index 0 the training split, 1 the
    held-out one (corpora.TRIM_TEST_FRACTION, the split of table 3 and the trimmed heads)."""
    docs = []
    for task in config.corpora:
        docs += [
            text
            for _, text in corpora.split(corpora.documents(task), corpora.TRIM_TEST_FRACTION)[split_index]
        ]
    return common.encode_all(target.tokenizer, docs)


def feature_sets(config, target, progress: bool = True, cache_dir=None):
    """(train, eval) training.features.FeatureSet for a training config: windows of the corpora's
    training split (config.train_tokens) and of the held-out split (config.eval_tokens) through
    the target, computed once and cached under `$SPEC_JAX_CACHE/features/`."""
    from experiments.common import TINY_MODELS

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
            "tiny": config.target in TINY_MODELS,
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


def load_drafter(
    target, workdir=None, dtype: str | None = None, threshold: float = 0.0, acceptance: bool = False
):
    """(HeadDrafter, HeadParams) of the trained head in workdir (default: default_workdir for
    the target's name), at `dtype` (default the target's), for spec_jax.generate. acceptance:
    also its acceptance head (WORKDIR/acceptance/, experiments/train_acceptance.py), stopping
    each row's draft at the threshold chosen in training. ValueError when there is none, it
    belongs to another target, or the acceptance head belongs to another draft head."""
    from spec_jax.head_drafter import HeadDrafter, head_params

    cfg = target.config
    workdir = pathlib.Path(workdir or default_workdir(cfg.name))
    trained, ids, _ = head_checkpoint.load_head(workdir, target)  # float32: what the hash is of
    dtype = dtype or cfg.dtype
    head = trained if dtype == "float32" else models.cast(trained, dtype)
    trimmed = len(ids) < cfg.vocab_size
    drafter = HeadDrafter(head.config, trimmed=trimmed, threshold=float(threshold))
    params = head_params(target, head, ids if trimmed else None)
    if acceptance:
        stop, meta = load_acceptance(workdir, head_checkpoint.params_hash(trained.params), cfg.d_model)
        drafter = dataclasses.replace(drafter, stop_rejection=float(meta["threshold"]))
        params = params.replace(acceptance=stop)
    return drafter, params


def head_hash(workdir, target) -> str:
    """The sha256 of the trained head's float32 parameters (what an acceptance head is tied to)."""
    return head_checkpoint.params_hash(head_checkpoint.load_head(workdir, target)[0].params)


def load_acceptance(workdir, head_sha256: str, width: int):
    """(AcceptanceParams, meta) from WORKDIR/acceptance/; ValueError if there is none or it was
    trained for another head (head_sha256: head_hash of the draft head in use)."""
    import jax
    import orbax.checkpoint as ocp

    from spec_jax import acceptance

    folder = pathlib.Path(workdir) / "acceptance"
    mngr = head_checkpoint.checkpoint_reader(folder) if folder.is_dir() else None
    step = mngr.latest_step() if mngr is not None else None
    if step is None:
        raise ValueError(
            f"no acceptance head in {folder} (train one with python -m launch.train "
            "--config=launch/configs/acceptance_head.py)"
        )
    meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    if meta["head_params_sha256"] != head_sha256:
        raise ValueError(
            f"the acceptance head in {folder} was trained for another draft head; train it again"
        )
    abstract = jax.tree.map(
        ocp.utils.to_shape_dtype_struct,
        acceptance.init(
            np.zeros((2, width + 2 + acceptance.POSITIONS), np.float32),
            0,
        ),
    )
    params = mngr.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract)))["params"]
    return params, meta
