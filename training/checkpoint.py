"""A draft-head run's checkpoints (orbax) and how a run resumes from them.

  WORKDIR/checkpoints/STEP/   the training state (params, optimizer state, step), for resuming
  WORKDIR/best/STEP/          the head with the best held-out accepted length so far
  WORKDIR/history.jsonl       one line per trained step (train and eval metrics)

each checkpoint with `meta` (run_meta: the config, the head's config, the target it was trained
for, the drafted token ids). Orbax writes each checkpoint to a temporary folder and renames it
when complete, so an interrupted save leaves the previous one intact. The best head is read back
for decoding by spec_jax.head_checkpoint.load_head (the reading side of this format).
"""

import json
import pathlib

import jax
import numpy as np
import orbax.checkpoint as ocp

from models import registry
from models.config import ModelConfig
from spec_jax.head_checkpoint import target_identity


def run_meta(config, hcfg: ModelConfig, target, token_ids) -> dict:
    """What a run's checkpoints are of: a resumed run must have the same."""
    return {
        "config": json.loads(config.to_json_best_effort()),
        "head_config": hcfg.portable(),
        "target": target_identity(target),
        "token_ids": [int(i) for i in np.asarray(token_ids)],
    }


def managers(workdir: pathlib.Path) -> tuple[ocp.CheckpointManager, ocp.CheckpointManager]:
    """(latest, best): the resumable state's manager and the best head's (by eval_length)."""
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


def check_same_run(workdir, saved: dict, meta: dict) -> None:
    """ValueError naming the first differing setting unless the saved run's meta is this one's."""
    if saved == meta:
        return
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


def resume(workdir, latest, best, meta: dict, initial_state, history_path: pathlib.Path):
    """(state, history) of the run in `workdir` at its last complete checkpoint (initial_state
    gives the structure), with the best heads and history lines past it dropped (they are redone);
    None if there is no checkpoint. ValueError if the workdir holds a run with other settings."""
    if latest.latest_step() is None:
        return None
    saved = latest.restore(latest.latest_step(), args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    check_same_run(workdir, saved, meta)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, initial_state)
    state = latest.restore(
        latest.latest_step(), args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
    )["state"]
    for later in [st for st in best.all_steps() if st > int(state.step)]:  # redone from here on
        best.delete(later)
    history = (
        [json.loads(line) for line in history_path.read_text().splitlines()] if history_path.exists() else []
    )
    return state, [h for h in history if h["step"] <= int(state.step)]


def save_best(best, step: int, params, meta: dict, eval_length: float) -> None:
    """The head at `step`, kept if its eval_length is the best so far."""
    best.save(
        step,
        args=ocp.args.Composite(params=ocp.args.StandardSave(params), meta=ocp.args.JsonSave(meta)),
        metrics={"eval_length": eval_length},
    )


def save_latest(latest, best, step, state, meta, history, history_path):
    """The resumable state at `step`, after every best/ save before it is complete. The history
    is written first: a run killed after the checkpoint is complete has every step's line up to
    it, and one killed before has lines past the last complete checkpoint, which a resumed run
    trims to the restored step."""
    registry.write_text_atomic(history_path, "".join(json.dumps(h) + "\n" for h in history))
    latest.save(
        step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
    )
    latest.wait_until_finished()
    best.wait_until_finished()
