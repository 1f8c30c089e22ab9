"""Reading a trained draft head (models.draft_head) from its training workdir: the checkpoint
format that `training` writes and the head drafter reads.

  WORKDIR/best/STEP/   the head with the best held-out accepted length (orbax), with `meta`: the
                       training config, the head's config, the target it was trained for
                       (target_identity) and the drafted token ids
  WORKDIR/acceptance/STEP/  its acceptance head (load_acceptance), with `meta`: the stop
                       threshold and the params_hash of the draft head it was trained for

Decoding reads it here so that `spec_jax` needs nothing from `training` (the layering test).
"""

import hashlib
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging as absl_logging

import models
from models.config import ModelConfig
from models.transformer import init_params


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


def params_hash(params) -> str:
    """sha256 of every parameter's bytes, in pytree order: equal iff the parameters are."""
    digest = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        digest.update(jax.tree_util.keystr(path).encode())
        digest.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    return digest.hexdigest()


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


def load_acceptance(workdir, head_sha256: str, like):
    """(params, meta) of the acceptance head in WORKDIR/acceptance/ (experiments/train_acceptance.py
    writes it), its params restored to the shapes and dtypes of `like` (a pytree of arrays).
    ValueError if there is none, or it was trained for another draft head than the one whose
    parameters hash to head_sha256 (params_hash)."""
    folder = pathlib.Path(workdir) / "acceptance"
    mngr = checkpoint_reader(folder) if folder.is_dir() else None
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
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    params = mngr.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract)))["params"]
    return params, meta
