"""The costs gamma=auto (spec_jax.autogamma) plans with (costs.Costs: each model call of a round
in target decode steps), once per machine, model pair, precision, batch bucket and cache-length
bucket, cached under `$SPEC_JAX_CACHE/costs/` (chunks are timed by spec_jax.timing.work_clock).

Where they come from (CostEntry.source):
- "measured": `measure` timed every call offline (costs_for: on first use, before the run; the
  engine and scripts/device_check.py do that);
- "prior": nothing is cached yet and the run must not wait (`cost_entry(..., measure_now=False)`,
  what spec_jax.generate does): `prior_costs`, from the models' weight bytes;
- "observed": the prior calibrated by the rounds earlier runs timed (CostEntry.record, after a
  run): the run's own chunks are the measurement, so nothing is measured before the first token
  and nothing runs beside the run to skew its timings (on 2 cores a concurrent measurement would
  share the cores and the memory bandwidth with the very rounds it is meant to price).

This module keys, assumes (the prior) and caches; it chooses nothing (spec_jax.autogamma's
controllers choose).
"""

import dataclasses
import hashlib
import json
import math
import os
import pathlib
import sys
import warnings

import jax

from models import machine, registry
from models.kernels import builds, cpu_matmul
from spec_jax import timing
from spec_jax.autogamma.costs import RESUME_WIDTH, Costs, calibrated, checked_costs, measure
from spec_jax.drafting.base import AUTO_GAMMA_MAX

# How measure() turns repeats into a cost; part of the cache key, so a change re-measures.
MEASURE_METHOD = "min of interleaved repeats; resume call"
# The cache lengths costs are measured at: COST_SLOTS, or COST_SLOTS times a power of
# COST_SLOTS_STEP for a longer cache (cost_slots). A call's cost hardly moves with the cache below
# a few thousand slots (the weights' products dominate), so every prompt of an ordinary length
# shares one measurement; a chunk's measured time corrects what is left once it runs.
COST_SLOTS = 512
COST_SLOTS_STEP = 8
# What measuring the default pair's costs took on the 2-core EPYC (for the line that announces it).
COST_MEASURE_SECONDS = 60


def cost_slots(cache_slots: int) -> int:
    """The cache length costs are measured at for a run of `cache_slots`: the smallest of
    COST_SLOTS * COST_SLOTS_STEP^k (k >= 0) that holds it."""
    slots = COST_SLOTS
    while slots < cache_slots:
        slots *= COST_SLOTS_STEP
    return slots


def cost_batch(batch: int) -> int:
    """The batch costs are measured at for a run of `batch` rows: the next power of two."""
    return 1 << max(batch - 1, 0).bit_length()


def machine_key() -> dict:
    """What the costs depend on besides the models: the device, the core count, jax, and on a CPU
    the kernels' builds (the instruction set the CPU matmul kernel runs, $SPEC_JAX_CPU_ISA or the
    CPU's widest, and builds.build_digest: a faster kernel makes the cached costs stale)."""
    cpu = jax.default_backend() == "cpu"
    return {
        "backend": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind,
        "cpu": machine.cpu_model(),
        "cores": os.cpu_count(),
        "jax": jax.__version__,
        "cpu_matmul": cpu_matmul.library_path().stem if cpu else None,
        "kernels": builds.build_digest() if cpu else None,
    }


def cache_path(key: dict, cache_dir=None):
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
    return registry.cache_root(cache_dir) / "costs" / f"{digest}.json"


@dataclasses.dataclass(frozen=True)
class CostSizes:
    """The sizes a pair's calls are measured at: `batch` rows, a cache of `cache_slots`, the
    target's verify calls of chains of 1..gamma_max drafts and of trees of each size in
    tree_sizes (tree="auto"; empty for chains alone)."""

    batch: int
    cache_slots: int
    gamma_max: int = AUTO_GAMMA_MAX  # the longest chain whose verify call is measured
    tree_sizes: tuple[int, ...] = ()

    def bucketed(self) -> "CostSizes":
        """The sizes costs_for measures a run of these at: cost_batch(batch) rows and a cache of
        cost_slots(cache_slots), so that runs of nearby sizes share one measurement."""
        return dataclasses.replace(
            self, batch=cost_batch(self.batch), cache_slots=cost_slots(self.cache_slots)
        )


def model_key(config) -> dict:
    """What a call of the model of `config` costs depends on (part of the key measured costs are
    cached under, for the target and a drafter's timed call)."""
    return {
        k: getattr(config, k)
        for k in ("name", "vocab_size", "num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim")
        + ("mlp_dim", "dtype", "attention_impl", "matmul_impl", "cpu_isa", "scan_layers")
    }


def drafter_key(drafter, draft_params):
    """What a drafter's costs depend on: its timed call's model and TimedCall.key, or for a
    drafter without one Drafter.cost_key."""
    timed = drafter.timed_call(draft_params)
    return drafter.cost_key(draft_params) if timed is None else {**model_key(timed.config), **timed.key}


def cost_key(target, drafter, draft_params, sizes: CostSizes) -> dict:
    """What costs at `sizes` (bucketed) depend on: the machine, both models, the sizes and the
    measuring method; the cache file is named by its hash (cache_path)."""
    key = {
        "machine": machine_key(),
        "target": model_key(target.config),
        "draft": drafter_key(drafter, draft_params),
        "batch": sizes.batch,
        "cache_slots": sizes.cache_slots,
        "gamma_max": sizes.gamma_max,
        "method": MEASURE_METHOD,
    }
    if sizes.tree_sizes:  # only then, so that the chains' cached costs keep their key
        key["tree_sizes"] = list(sizes.tree_sizes)
    return key


def costs_for(target, drafter, draft_params, sizes: CostSizes, cache_dir=None) -> Costs:
    """Cached costs for this machine, pair, batch and cache size, measured on first use (before
    the run: `cost_entry` with measure_now; the engine and the device check use this)."""
    return cost_entry(target, drafter, draft_params, sizes, cache_dir).costs


def cost_entry(target, drafter, draft_params, sizes: CostSizes, cache_dir=None, measure_now: bool = True):
    """The CostEntry for this machine, pair, batch and cache size, with the tree sizes' verify
    calls where sizes.tree_sizes is given (tree="auto"; part of the key).

    target: a models.Model; drafter, draft_params: as spec_jax.drafting.as_drafter returns them.
    Costs are for sizes.bucketed() (a prompt of a new length finds them cached). A cached file is
    used only when it holds this key and costs that checked_costs accepts, else (with a warning)
    it counts as absent. Absent: with `measure_now`, they are measured now (announced by one line on
    stderr) and written atomically (registry.atomic_write; a cache that cannot be written is a
    warning, and the measured costs are used all the same); without, the entry holds
    prior_costs at once (source "prior"), which the run's own rounds calibrate afterwards
    (CostEntry.record)."""
    sizes = sizes.bucketed()
    key = cost_key(target, drafter, draft_params, sizes)
    path = cache_path(key, cache_dir)
    prior = prior_costs(target, drafter, draft_params, sizes)
    cached = _cached_entry(path, key, sizes, prior)
    if cached is not None:
        return cached
    if not measure_now:
        return CostEntry(prior, "prior", path, key, prior)
    print(
        f"gamma=auto: measuring {target.config.name}'s model calls at batch {sizes.batch} (once for this "
        f"pair and precision; about {COST_MEASURE_SECONDS} s on a 2-core CPU; cached in {path.parent})",
        file=sys.stderr,
        flush=True,
    )
    entry = CostEntry(measure(target, drafter, draft_params, sizes), "measured", path, key, prior)
    entry.save()
    return entry


def _cached_entry(path, key: dict, sizes: CostSizes, prior: Costs) -> "CostEntry | None":
    """The CostEntry cached at path for key, or None (with a warning where a file is there but
    stale, damaged or edited)."""
    if not path.exists():
        return None
    try:
        saved = json.loads(path.read_text())
        if saved["key"] != json.loads(json.dumps(key, default=str)):
            raise ValueError("it was measured for another key")
        costs = checked_costs(saved["costs"], sizes.gamma_max, sizes.tree_sizes)
        source = saved.get("source", "measured")  # files written before priors were all measured
        seconds = {str(k): float(v) for k, v in saved.get("round_seconds", {}).items()}
        if source not in ("measured", "observed") or not all(
            math.isfinite(v) and v > 0 for v in seconds.values()
        ):
            raise ValueError(f"its source {source!r} or its rounds are not ones this project writes")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # stale, damaged or edited
        warnings.warn(f"gamma=auto: cached costs {path} are not usable ({e}); not using them", stacklevel=3)
        return None
    if source == "observed" and not seconds:  # ratios to a run's plain round, as kept before: anew
        return CostEntry(prior, "prior", path, key, prior)
    return CostEntry(costs, source, path, key, prior, seconds)


# The prior (prior_costs): a verify call over g + 1 tokens costs 1 + g * PRIOR_VERIFY_STEP target
# steps (by backend, and precision where the CPU kernels' rows cost differently; others:
# ACCELERATOR_VERIFY_STEP), a drafter's call over w tokens its weight bytes over the target's,
# times the same growth. On the 2-core EPYC the int8 Qwen pair measured 1.3-1.45 steps over 5
# tokens (docs/design.md); at gguf_q8 (ggml's gemv for one row, the multi-row kernel for more)
# 1.35-1.47 over 2 and 2.25-2.57 over 4 (2026-11-28). Accelerators: about one step.
PRIOR_VERIFY_STEP = {"cpu": 0.15, ("cpu", "gguf_q8"): 0.35}
ACCELERATOR_VERIFY_STEP = 0.02


def prior_costs(target, drafter, draft_params, sizes: CostSizes) -> Costs:
    """Costs to plan with before any were measured or observed, from the weights alone: the
    target's call over g + 1 tokens 1 + g * slope steps (PRIOR_VERIFY_STEP, by backend and the
    target's precision), a drafter call over w tokens (Drafter.call_bytes over the target's
    weight bytes) * (1 + (w - 1) * slope), nothing for a drafter without model calls. step_seconds
    is a placeholder (the controller times the plain round before it uses it)."""
    key = (jax.default_backend(), target.config.dtype)
    slope = PRIOR_VERIFY_STEP.get(key, PRIOR_VERIFY_STEP.get(key[0], ACCELERATOR_VERIFY_STEP))
    share = drafter.call_bytes(draft_params) / max(timing.tree_bytes(target.params), 1)

    def call(width: int) -> float:
        return 1.0 + (width - 1) * slope

    return Costs(
        step_seconds=0.01,
        draft1=share,
        draft2=share * call(2),
        verify=tuple(call(g + 1) for g in range(sizes.gamma_max + 1)),
        resume=share * call(RESUME_WIDTH),
        tree_verify=tuple((n, call(n + 1)) for n in sizes.tree_sizes),
    )


@dataclasses.dataclass
class CostEntry:
    """The costs a controller plans with and their cache file: `source` is "measured",
    "observed" or "prior" (module docstring); `round_seconds` each arm's fastest seconds a round
    over the runs (arms as in _arm_cost), `rounds` those over costs.step_seconds."""

    costs: Costs
    source: str
    path: pathlib.Path
    key: dict
    prior: Costs
    round_seconds: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def rounds(self) -> dict[str, float]:
        return {a: v / self.costs.step_seconds for a, v in self.round_seconds.items()}

    def record(self, step_seconds: float, rounds: dict[str, float], resume: float | None = None) -> None:
        """After a run: takes in its timed rounds (seconds per round over its plain round's, per
        arm that drafted; step_seconds: its plain round; resume: a catch-up call over a plain
        round, where one ran) and caches the prior calibrated by them and earlier runs'. Each arm
        and the plain round keep their fastest seconds over the runs (the least disturbed), and
        an arm is priced by their ratio (the fastest ratio kept for good a run whose plain round a
        passing load slowed). Measured costs stay as they are; a run with no drafting arm timed
        changes nothing."""
        rounds = {str(k): float(v) for k, v in rounds.items() if math.isfinite(v) and v > 0}
        if self.source == "measured" or not rounds or not (math.isfinite(step_seconds) and step_seconds > 0):
            return
        fastest = min(step_seconds, self.costs.step_seconds) if self.source == "observed" else step_seconds
        for a, v in rounds.items():
            self.round_seconds[a] = min(v * step_seconds, self.round_seconds.get(a, v * step_seconds))
        ratios = {a: v / fastest for a, v in self.round_seconds.items()}
        costs = calibrated(self.prior, ratios, resume if resume is None or math.isfinite(resume) else None)
        self.costs, self.source = dataclasses.replace(costs, step_seconds=float(fastest)), "observed"
        self.save()

    def save(self) -> None:
        """Writes the entry to its file atomically (registry.atomic_write: never half-written);
        a cache that cannot be written is a warning."""
        payload = {"key": self.key, "source": self.source, "costs": dataclasses.asdict(self.costs)}
        if self.round_seconds:
            payload["round_seconds"] = self.round_seconds
        text = json.dumps(payload, indent=1, default=str)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            registry.atomic_write(self.path, lambda f: f.write(text.encode()))
        except OSError as e:  # the costs are in hand: use them, and measure or observe again next time
            warnings.warn(f"gamma=auto: could not cache the costs in {self.path} ({e})", stacklevel=3)
