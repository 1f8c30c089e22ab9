"""gamma=auto: the number of draft tokens per round chosen from measured costs and the running
acceptance rate (Leviathan et al. 2023, Theorem 3.8, with the verify cost measured instead of
assumed to be one target step).

With acceptance rate alpha, a round of gamma drafts commits E(alpha, gamma) = (1 -
alpha^(gamma+1)) / (1 - alpha) tokens on average and costs d(gamma) + v(gamma) target decode
steps: d is the drafter's round (a 2-token draft call, then gamma - 1 one-token calls), v the
target's call over gamma + 1 positions. Plain decoding (gamma = 0) commits 1 token per step. The
choice maximizes E / (d + v) over 0..gamma_max.

Costs are measured once per machine, model pair, precision, batch size and cache size (about a
minute for the Qwen pair on a 2-core CPU) and cached as JSON under `$SPEC_JAX_CACHE/costs/`.
alpha is not remembered: each generate call starts from a weak prior and learns it from its own
rounds (the mean overlap sum_x min(p, q) over scored positions, the metrics' alpha_hat).
"""

import dataclasses
import hashlib
import json
import os
import platform

import jax
import numpy as np

from spec_jax import theory, timing

GAMMA_MAX = 8  # the largest gamma auto considers
PRIOR_ALPHA, PRIOR_WEIGHT = 0.5, 4.0  # the running estimate starts as 4 positions at alpha 0.5
EXPLORE_ALPHA = 0.8  # the first chunk drafts as if alpha were this (a good draft's), to measure it
SWITCH_GAIN = 1.03  # change gamma only for a predicted 3% more tokens per unit time
FIRST_CHUNK, MAX_CHUNK = 2, 16  # rounds between decisions: 2, 4, 8, 16, 16, ...


@dataclasses.dataclass(frozen=True)
class Costs:
    """Measured costs in target decode steps: draft1 / draft2 a drafter call over 1 / 2 tokens
    per row, verify[g] the target's call over g + 1 tokens per row (verify[0] = 1 by definition).
    step_seconds is the target decode step they are relative to."""

    step_seconds: float
    draft1: float
    draft2: float
    verify: tuple[float, ...]

    def round_cost(self, gamma: int) -> float:
        """A round of gamma drafts, in target steps (gamma 0: one decode step)."""
        if gamma == 0:
            return 1.0
        return self.draft2 + (gamma - 1) * self.draft1 + self.verify[gamma]

    def rate(self, alpha: float, gamma: int) -> float:
        """Expected committed tokens per target-step time of rounds of gamma drafts."""
        tokens = 1.0 if gamma == 0 else float(theory.expected_tokens(alpha, gamma))
        return tokens / self.round_cost(gamma)

    def best_gamma(self, alpha: float, gamma_max: int | None = None) -> int:
        """The gamma in 0..gamma_max with the highest rate (the smallest such gamma on ties)."""
        top = len(self.verify) - 1 if gamma_max is None else min(gamma_max, len(self.verify) - 1)
        rates = [self.rate(alpha, g) for g in range(top + 1)]
        return int(np.argmax(rates))


# How measure() turns repeats into a cost; part of the cache key, so a change re-measures.
MEASURE_METHOD = "min of interleaved repeats"


def machine_key() -> dict:
    """What the costs depend on besides the models: the device, the core count, jax, and the
    CPU matmul kernel's build: its source and the instruction set it is built for
    ($SPEC_JAX_CPU_ISA or the CPU's widest; a faster kernel makes the cached costs stale)."""
    from models.kernels import cpu_matmul

    device = jax.devices()[0]
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "backend": jax.default_backend(),
        "device_kind": device.device_kind,
        "cpu": cpu,
        "cores": os.cpu_count(),
        "jax": jax.__version__,
        "cpu_matmul": cpu_matmul.library_path().stem if jax.default_backend() == "cpu" else None,
    }


def model_key(config) -> dict:
    return {
        k: getattr(config, k)
        for k in ("name", "vocab_size", "num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim")
        + ("mlp_dim", "dtype", "attention_impl", "matmul_impl", "scan_layers")
    }


def cache_path(key: dict, cache_dir=None):
    from models.registry import cache_root

    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
    return cache_root(cache_dir) / "costs" / f"{digest}.json"


def measure(
    target,
    drafter,
    draft_params,
    *,
    batch: int,
    cache_slots: int,
    gamma_max: int = GAMMA_MAX,
    repeats: int = 5,
) -> Costs:
    """Times the target's calls over 1..gamma_max + 1 tokens and a model drafter's calls over 1
    and 2 tokens (the fastest of interleaved repeats after a warm-up; spec_jax.timing.model_call).
    A draft head (spec_jax.head_drafter) costs its drafting step (draft1) and a 2-pair call (draft2:
    a round's observe call and first draft). Other drafters (n-gram tables, prompt lookup) count
    as free; a hybrid costs its model's calls."""
    from models import Model
    from spec_jax.drafters import ModelDrafter
    from spec_jax.head_drafter import HeadDrafter

    drafter = getattr(drafter, "model", drafter)  # spec_jax.lookup.HybridDrafter: its model

    slots = max(cache_slots, 2 * (gamma_max + 2))
    repeat = 4  # calls per timed program, so that dispatch is not counted
    fns = {
        ("target", w): timing.model_call(target, batch=batch, widths=[w], cache_slots=slots, repeat=repeat)
        for w in range(1, gamma_max + 2)
    }
    if isinstance(drafter, ModelDrafter):
        model_params, head = (
            (draft_params.model, draft_params.head.weight) if drafter.trimmed else (draft_params, None)
        )
        for w in (1, 2):
            fns[("draft", w)] = timing.model_call(
                Model(config=drafter.config, params=model_params),
                batch=batch,
                widths=[w],
                cache_slots=slots,
                repeat=repeat,
                head=head,
            )
    if isinstance(drafter, HeadDrafter):  # a drafting step, and a 2-pair observe call for the first
        for w in (1, 2):
            fns[("draft", w)] = timing.head_call(
                drafter, draft_params, batch=batch, widths=[w], cache_slots=slots, repeat=repeat
            )
    # The fastest of the interleaved repeats: on a machine shared with other work, each call's
    # least disturbed time, so that the cost ratios do not follow the load of the moment.
    times = timing.timed_interleaved(fns, repeats)
    step = times[("target", 1)]["min"]

    def rel(key):
        return times[key]["min"] / step if key in times else 0.0

    verify = (1.0,) + tuple(rel(("target", g + 1)) for g in range(1, gamma_max + 1))
    return Costs(
        step_seconds=step / repeat, draft1=rel(("draft", 1)), draft2=rel(("draft", 2)), verify=verify
    )


def costs_for(
    target, drafter, draft_params, *, batch: int, cache_slots: int, gamma_max: int = GAMMA_MAX, cache_dir=None
) -> Costs:
    """Cached costs for this machine, pair, batch and cache size (measured on first use).

    target: a models.Model; drafter, draft_params: as spec_jax.api.as_drafter returns them.
    The cache size is rounded up to a power of two, so prompts of similar length share a
    measurement.
    """
    from spec_jax.drafters import ModelDrafter
    from spec_jax.head_drafter import HeadDrafter

    slots = 1 << max(cache_slots - 1, 1).bit_length()
    draft_key = type(drafter).__name__
    drafter = getattr(drafter, "model", drafter)  # spec_jax.lookup.HybridDrafter: its model
    if isinstance(drafter, ModelDrafter):
        rows = int(draft_params.head.ids.shape[0]) if drafter.trimmed else drafter.config.vocab_size
        draft_key = {**model_key(drafter.config), "head_rows": rows}
    elif isinstance(drafter, HeadDrafter):
        draft_key = {
            **model_key(drafter.config),
            "kind": "draft_head",
            "head_rows": int(draft_params.out.ids.shape[0]),
        }
    key = {
        "machine": machine_key(),
        "target": model_key(target.config),
        "draft": draft_key,
        "batch": batch,
        "cache_slots": slots,
        "gamma_max": gamma_max,
        "method": MEASURE_METHOD,
    }
    path = cache_path(key, cache_dir)
    if path.exists():
        try:
            saved = json.loads(path.read_text())["costs"]
            return Costs(**{**saved, "verify": tuple(saved["verify"])})
        except (ValueError, KeyError, TypeError):
            pass  # a stale or damaged file: measure again
    costs = measure(target, drafter, draft_params, batch=batch, cache_slots=slots, gamma_max=gamma_max)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"key": key, "costs": dataclasses.asdict(costs)}, indent=1, default=str))
    os.replace(tmp, path)
    return costs


class Controller:
    """Chooses gamma for the next chunk of rounds from the costs and the acceptance so far.

    The first chunk (2 rounds) drafts with the gamma that would be best at EXPLORE_ALPHA, so that
    a draft that pays only when it is good gets measured; a draft that does not pay even then
    is never run. Afterwards alpha is estimated as (PRIOR_WEIGHT * PRIOR_ALPHA + overlap sum) / (PRIOR_WEIGHT + scored
    positions). gamma changes only when the new choice is predicted SWITCH_GAIN better than the
    current one; plain decoding (gamma 0) is absorbing, since the drafter's state stops following
    the text once it is off. Chunks double from FIRST_CHUNK rounds to MAX_CHUNK.
    """

    def __init__(self, costs: Costs, gamma_max: int):
        self.costs, self.gamma_max = costs, gamma_max
        self.gamma = costs.best_gamma(EXPLORE_ALPHA, gamma_max)
        self.chunk = FIRST_CHUNK
        self.schedule: list[tuple[int, int]] = []  # (gamma, rounds asked for) per chunk

    def alpha(self, overlap_sum: float, scored: int) -> float:
        return (PRIOR_WEIGHT * PRIOR_ALPHA + overlap_sum) / (PRIOR_WEIGHT + scored)

    def next_chunk(self) -> tuple[int, int]:
        """(gamma, rounds) for the next chunk."""
        rounds = self.chunk
        self.schedule.append((self.gamma, rounds))
        self.chunk = min(2 * self.chunk, MAX_CHUNK)
        return self.gamma, rounds

    def observe(self, overlap_sum: float, scored: int) -> None:
        """Updates gamma from the cumulative overlap sum and scored positions of this call."""
        if self.gamma == 0:
            return
        alpha = self.alpha(overlap_sum, scored)
        best = self.costs.best_gamma(alpha, self.gamma_max)
        if self.costs.rate(alpha, best) > SWITCH_GAIN * self.costs.rate(alpha, self.gamma):
            self.gamma = best
