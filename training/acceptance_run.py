"""An acceptance head's training run (SpecDec++) for a trained draft head: logged rounds of the
real pair, the classifier, and the stop threshold chosen from its held-out curve; its settings
and what it reports (training.report.Report).

`python -m launch.train --config=launch/configs/acceptance_head.py` runs it (so does
`python -m launch.experiment --experiment=train_acceptance`). It reads the draft head from
`head_workdir` (default `$SPEC_JAX_CACHE/heads/TARGET/`), runs the loop greedily round by round
with the head drafting `gamma_max` tokens on prompts cut from the corpora's training split, logs
every draft position up to the first rejection (training.acceptance.log_rounds), trains the
classifier on the rounds of most prompts and chooses the threshold h on the rounds of the
held-out prompts: the h with the most simulated tokens per unit of time, with this machine's
measured call costs (spec_jax.autogamma), beside the best fixed gamma. It writes the acceptance
head into HEAD_WORKDIR/acceptance/ (orbax), where `--drafter=head --acceptance_head` and the
benchmarks find it.
"""

import json
import pathlib

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from models import corpora, settings
from spec_jax.autogamma import cost_cache as step_costs
from spec_jax.drafting import trained_head as head_drafting
from training import acceptance, targets
from training.report import Plot, Report

NAME = "train_acceptance"
TITLE = "Training an acceptance head (SpecDec++) that decides the draft length"

INT_RANGES = {
    "gamma_max": (2, 16),
    "num_prompts": (2, 100_000),
    "prompt_tokens": (4, 4096),
    "max_new_tokens": (4, 4096),
    "batch_size": (1, 1024),
    "steps": (1, 10**7),
    "train_batch_size": (1, 10**6),
    "seed": (0, 2**31 - 1),
}


def get_config(quick: bool = False) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.target = "tiny" if quick else "qwen2.5-coder-1.5b"
    c.target_dtype = "float32" if quick else "int8"
    c.head_workdir = ""  # "": spec_jax.drafting.trained_head.default_workdir(target)
    c.corpora = ("code",) if quick else ("code", "news")
    c.gamma_max = 4 if quick else 8
    c.num_prompts = 8 if quick else 48
    c.held_out_fraction = 0.25
    c.prompt_tokens = 16 if quick else 64
    c.max_new_tokens = 12 if quick else 48
    c.batch_size = 4 if quick else 1
    c.steps = 50 if quick else 2000
    c.train_batch_size = 64 if quick else 256
    c.learning_rate = 3e-3
    c.reject_weight = 1.0
    c.seed = 0
    return c


def validate(config) -> None:
    """ValueError("<key>: ...") for a target that cannot be loaded or a setting out of range."""
    targets.check_target(config)
    settings.check_int_settings(config, INT_RANGES)
    unknown = [c for c in config.corpora if c not in corpora.TASKS]
    if not config.corpora or unknown:
        raise ValueError(
            f"corpora: unknown corpus {unknown[0] if unknown else '(none)'}; known: {', '.join(corpora.TASKS)}"
        )
    if not 0.0 < config.held_out_fraction < 1.0:
        raise ValueError(f"held_out_fraction: must be in (0, 1), got {config.held_out_fraction}")
    if not 0.0 < config.learning_rate < 1.0:
        raise ValueError(f"learning_rate: must be in (0, 1), got {config.learning_rate}")


def training_prompts(config, tokenizer) -> list[list[int]]:
    """num_prompts prompts of prompt_tokens tokens cut from the corpora's training split (the
    draft head trained on these documents too; the benchmarks' prompts are held out)."""
    docs = []
    for task in config.corpora:
        docs += corpora.split(corpora.documents(task), corpora.TRIM_TEST_FRACTION)[0]
    order = np.random.default_rng(config.seed).permutation(len(docs))
    texts = corpora.prompt_texts(
        [docs[i] for i in order], config.num_prompts, 8 * config.prompt_tokens, config.seed
    )
    return [ids[: config.prompt_tokens] for ids in targets.encode_all(tokenizer, texts)]


def save(folder: pathlib.Path, params, meta: dict) -> None:
    """The acceptance head and its metadata into folder (orbax; replaced atomically)."""
    mngr = ocp.CheckpointManager(folder, options=ocp.CheckpointManagerOptions(max_to_keep=1, create=True))
    step = (mngr.latest_step() or 0) + 1
    mngr.save(
        step, args=ocp.args.Composite(params=ocp.args.StandardSave(params), meta=ocp.args.JsonSave(meta))
    )
    mngr.wait_until_finished()


def run(config) -> Report:
    """Loads the target and its draft head, logs rounds, trains the classifier, chooses the
    threshold on held-out rounds, writes the acceptance head beside the draft head and reports
    the threshold curve beside fixed gamma."""
    target = targets.load_model(config.target, config.target_dtype)
    workdir = config.head_workdir or str(head_drafting.default_workdir(config.target))
    drafter, params = head_drafting.load_drafter(target, workdir)
    prompts = training_prompts(config, target.tokenizer)
    log, train_log, held_log, trained = _log_and_train(config, target, drafter, params, prompts)
    cache_len = 2 * (config.prompt_tokens + config.max_new_tokens + config.gamma_max)
    costs = step_costs.costs_for(target, drafter, params, step_costs.CostSizes(config.batch_size, cache_len))
    threshold, curve = acceptance.choose_threshold(trained.params, held_log, costs)
    meta = {
        "threshold": threshold,
        "head_params_sha256": head_drafting.head_hash(workdir, target),
        "gamma_max": config.gamma_max,
        "curve": curve,
        "config": json.loads(config.to_json_best_effort()),
    }
    save(pathlib.Path(workdir) / "acceptance", trained.params, meta)
    fixed = [c for c in curve if "gamma" in c]
    stops_curve = [c for c in curve if "threshold" in c]
    best_fixed = max(fixed, key=lambda c: c["tokens_per_step"])
    best_stop = max(stops_curve, key=lambda c: c["tokens_per_step"])
    rate = float(np.mean(log.label)) if len(log.label) else float("nan")
    summary = {
        "threshold": threshold,
        "rounds_logged": int(len(log.accepted)),
        "examples": int(len(log.label)),
        "rejection_rate": rate,
        "held_out_rounds": int(len(held_log.accepted)),
        "best_fixed_gamma": best_fixed,
        "best_threshold": best_stop,
        "predicted_gain_over_best_fixed": best_stop["tokens_per_step"] / best_fixed["tokens_per_step"],
        "history": trained.history,
        "costs": {"draft1": costs.draft1, "draft2": costs.draft2, "verify": list(costs.verify)},
        "device": jax.devices()[0].device_kind,
    }
    return Report(
        stops_curve,
        _markdown(
            config,
            len(prompts),
            (log, train_log, held_log),
            trained,
            (threshold, best_stop, best_fixed),
            costs,
        ),
        summary,
        sections={"Fixed gamma (the same rounds, cut at gamma)": fixed},
        plot=_plot(stops_curve, best_fixed),
    )


def _log_and_train(config, target, drafter, params, prompts):
    """(log, train_log, held_log, trained): the rounds logged at gamma_max, split by prompt (the
    last held_out_fraction held out) and the classifier trained on the rest."""
    stops = list(getattr(target.tokenizer, "stop_ids", ()) or ()) or None
    log = acceptance.log_rounds(
        target,
        drafter,
        params,
        prompts,
        gamma=config.gamma_max,
        max_new_tokens=config.max_new_tokens,
        batch_size=config.batch_size,
        eos_id=stops,
    )
    held = range(int(round(len(prompts) * (1 - config.held_out_fraction))), len(prompts))
    train_log, held_log = log.split(held)
    trained = acceptance.train(
        train_log,
        held_log,
        steps=config.steps,
        batch_size=config.train_batch_size,
        learning_rate=config.learning_rate,
        reject_weight=config.reject_weight,
        seed=config.seed,
    )
    return log, train_log, held_log, trained


def _plot(stops_curve, best_fixed) -> Plot:
    """Simulated tokens per target step against the stop threshold, beside the best fixed gamma."""

    def draw(axes):
        (ax,) = axes
        ax.plot(
            [c["threshold"] for c in stops_curve],
            [c["tokens_per_step"] for c in stops_curve],
            marker=".",
            label="acceptance head, threshold h",
        )
        ax.axhline(
            best_fixed["tokens_per_step"],
            color="grey",
            ls="--",
            label=f"best fixed gamma ({best_fixed['gamma']})",
        )
        ax.set(
            xlabel="stop threshold h (predicted probability of a rejection so far)",
            ylabel="simulated tokens per target step",
        )
        ax.legend(fontsize=8)

    return Plot(7, 4, 1, draw)


def _markdown(config, num_prompts: int, logs, trained, choice, costs) -> str:
    """What was logged (from num_prompts prompts) and trained, the chosen threshold against the best fixed gamma, the costs."""
    log, train_log, held_log = logs
    threshold, best_stop, best_fixed = choice
    rate = float(np.mean(log.label)) if len(log.label) else float("nan")
    return (
        f"Logged {len(log.accepted)} rounds ({len(log.label)} draft positions, {rate:.1%} rejected) of "
        f"{num_prompts} prompts at gamma {config.gamma_max}; trained on {len(train_log.accepted)} rounds, "
        f"chose the threshold on {len(held_log.accepted)} held-out rounds. Held-out accuracy "
        f"{trained.history[-1]['held_out_accuracy']:.3f}.\n\n"
        f"Chosen threshold h = {threshold:g}: simulated {best_stop['tokens_per_step']:.3f} tokens per target "
        f"step (mean {best_stop['mean_proposed']:.2f} drafts proposed) against {best_fixed['tokens_per_step']:.3f} "
        f"for the best fixed gamma ({best_fixed['gamma']}): "
        f"{best_stop['tokens_per_step'] / best_fixed['tokens_per_step']:.3f}x, before measuring (the decode "
        "benchmark measures it). Costs (target steps): draft step "
        f"{costs.draft1:.3f}, observe + first draft {costs.draft2:.3f}, verify "
        f"{', '.join(f'{v:.2f}' for v in costs.verify[1:])} for gamma 1..{len(costs.verify) - 1}."
    )
