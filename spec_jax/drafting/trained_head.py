"""A draft head's arrays for a target (head_params: the head with the target's input embedding and
output head), and a trained head loaded for spec_jax.drafting.head.HeadDrafter (load_drafter).

A head for target T trains into `$SPEC_JAX_CACHE/heads/T/` by default (default_workdir: its orbax
checkpoints, history and plot; the precision whose features it learned is in its metadata, and
it drafts for the target at any precision); `python -m launch.train` writes there, and
load_drafter (`--drafter=head` of `launch.generate`, the benchmarks) reads from there.
"""

import dataclasses
import pathlib

import jax.numpy as jnp
import numpy as np

import models
import spec_jax.drafting.acceptance_head as acceptance_head
from models import precision, registry
from models.transformer import output_head
from spec_jax.drafting.head import HeadDrafter, HeadParams
from spec_jax.drafting.model import TrimmedHead


def head_params(target, head, token_ids=None) -> HeadParams:
    """The drafter's arrays: `head` (a models.Model of kind draft_head) and the target's (a
    models.Model) embedding and output head, restricted to token_ids when given (distinct ids;
    the drafts then come from those tokens only, as with spec_jax.drafting.model.trim_vocabulary)."""
    if head.config.kind != "draft_head":
        raise ValueError(f"head must be a draft head (models.draft_head), got a {head.config.kind}")
    if head.config.d_model != target.config.d_model or head.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"head {head.config.name!r} (width {head.config.d_model}, vocabulary {head.config.vocab_size}) "
            f"does not fit target {target.config.name!r} (width {target.config.d_model}, "
            f"vocabulary {target.config.vocab_size})"
        )
    weight = output_head(target.config, target.params)
    vocab = target.config.vocab_size
    if token_ids is None:
        ids = jnp.arange(vocab, dtype=jnp.int32)
    else:
        ids = jnp.asarray(sorted({int(i) for i in token_ids}), jnp.int32)
        if ids.size == 0 or int(ids[0]) < 0 or int(ids[-1]) >= vocab:
            raise ValueError(f"token_ids must be a non-empty set of ids in [0, {vocab})")
        weight = precision.take_rows(weight, ids)
    return HeadParams(
        head=head.params, embed=target.params["embed"]["embedding"], out=TrimmedHead(weight, ids)
    )


def default_workdir(target: str, cache_dir=None) -> pathlib.Path:
    """Where a head for this target is trained and found by default."""
    return registry.cache_root(cache_dir) / "heads" / target


def load_drafter(
    target, workdir=None, dtype: str | None = None, threshold: float = 0.0, acceptance: bool = False
):
    """(HeadDrafter, HeadParams) of the trained head in workdir (default: default_workdir for
    the target's name), at `dtype` (default the target's), for spec_jax.generate. acceptance:
    also its acceptance head (WORKDIR/acceptance/, experiments/train_acceptance.py), stopping
    each row's draft at the threshold chosen in training. ValueError when there is none, it
    belongs to another target, or the acceptance head belongs to another draft head."""
    from spec_jax import head_checkpoint  # orbax: ~0.2 s of start-up (-X importtime), only to load a head

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
    from spec_jax import head_checkpoint  # orbax: ~0.2 s of start-up (-X importtime), only to load a head

    return head_checkpoint.params_hash(head_checkpoint.load_head(workdir, target)[0].params)


def load_acceptance(workdir, head_sha256: str, width: int):
    """(AcceptanceParams, meta) from WORKDIR/acceptance/ (head_checkpoint.load_acceptance); width:
    the target's d_model. ValueError if there is none or it was trained for another head
    (head_sha256: head_hash of the draft head in use)."""
    from spec_jax import head_checkpoint  # orbax: ~0.2 s of start-up (-X importtime), only to load a head

    like = acceptance_head.init(np.zeros((2, width + 2 + acceptance_head.POSITIONS), np.float32), 0)
    return head_checkpoint.load_acceptance(workdir, head_sha256, like)
