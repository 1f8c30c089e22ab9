"""gamma=auto: the number of draft tokens per round chosen, chunk by chunk, from the measured time
of whole rounds and each row's running acceptance (Leviathan et al. 2023, Theorem 3.8, with
costs measured instead of assumed).

With acceptance alpha, a round of gamma drafts commits E(alpha, gamma) = (1 - alpha^(gamma+1)) /
(1 - alpha) tokens per row on average; plain decoding (gamma = 0) commits 1. The loop runs in
chunks of rounds (spec_jax.api), and before each chunk the Controller picks the gamma in
0..gamma_max with the most expected tokens per second for the batch: the sum over the rows still
running of each row's E (capped at what the row may still commit) over the seconds of one round.

What a round costs. Each chunk's time over its rounds is a measured round of that gamma: the
drafter's and the target's calls and the loop's own work (sampling and the rejection rule over
[gamma + 1, V], the commit, the drafter's state). Chunks are timed by work_clock: the process's
CPU time on a CPU backend, so that other jobs on a shared machine do not sway the choice, wall
time on an accelerator. A gamma is timed as the fastest of its last chunks. A gamma not yet run is predicted from the
model calls measured offline (`Costs`, once per machine, pair, batch bucket and cache-length bucket, cached
under `$SPEC_JAX_CACHE/costs/`) at the measured plain round's rate, plus the round's own work as
the nearest measured drafting gamma showed it (what its calls do not explain, taken to grow
with gamma), or EXTRA_STEPS per draft before any drafting round ran. A call starts with
PLAIN_FIRST plain round(s), which time the plain round without costing anything against plain
decoding; then it tries the drafting gamma that pays best at EXPLORE_ALPHA (a short draft), in
chunks of 2, then 4 rounds.

What a row accepts. Each row keeps the overlap sum_x min(p, q) of its scored positions (the
metrics' alpha_hat, per row), weighted by recency (half weight HALF_LIFE positions back) after
a weak prior; a chunk far outside what a row's estimate predicts (CHANGE_Z errors) drops the
row's history, so a draft that turns always wrong is seen within a chunk or two.

Falling back and trying again. Drafting stops when plain decoding wins even at an optimistic
acceptance (FALLBACK_Z errors up). A drafter that can catch up (Drafter.resumable)
is tried again later with a short chunk (PROBE_ROUNDS rounds after catching up on the last
RESUME_WINDOW positions): after at least PROBE_SPACING plain rounds (doubled after each try that
lost time) and only when what the try may lose is covered by what drafting saved so far plus
PROBE_SHARE of the time spent. A draft that would not pay even at GOOD_ALPHA never runs.

Trees (tree="auto": TreeController). The arms are then plain decoding, chains of 1..gamma_max
drafts and token trees of N node slots for N in TREE_SIZES (spec_jax.tree; each a loop compiled
with tree_nodes = N). A tree's round is predicted, before it ran, from the target's call over
N + 1 tokens (measured offline with the chain widths when trees are on: Costs.tree_verify) and
the drafter's calls of a chain of N drafts (what the default propose_tree makes; none for
drafters without a model), plus the round's own work as the nearest tree that ran showed it
(else as for a chain of N); once it ran, as the fastest of its last chunks. What a tree yields
is measured per row from its chunks: committed tokens per round, weighted by recency (half
weight TREE_HALF_LIFE rounds back). Before it ran an optimistic prior stands in: 1 + TREE_BONUS
* (y - 1) where a smaller tree measured y tokens per round (a larger budget is taken to hold
the smaller tree's paths and more), else 1 + TREE_BONUS * (E(alpha, N) - 1) at the row's chain
acceptance (the chain of N's accepted drafts, TREE_BONUS times over). A tree is tried, with a
short chunk (TREE_PROBE_ROUNDS), only when that beats the best other arm by SWITCH_GAIN. A tree
that then loses is dropped: not tried again for TREE_SPACING rounds (doubled after each loss),
its measured yield informing the larger trees' priors meanwhile and forgotten then, so that its
prior decides again. Trees are weighed after drafting chunks only (a chain's acceptance
measured first); plain chunks and renewed tries are the chains' as above.

Exactness is untouched: the schedule only chooses each chunk's gamma (or tree); greedy output
equals plain decoding whatever it chooses, and a sampled output is an exact sample (which
sample depends on the chunks: the random stream is consumed per round).
"""

import dataclasses
import hashlib
import json
import math
import os
import sys
import time
import warnings

import jax
import numpy as np

from models import machine, registry
from spec_jax import theory, timing

GAMMA_MAX = 8  # the largest gamma auto considers
PRIOR_ALPHA, PRIOR_WEIGHT = 0.5, 2.0  # a row's estimate starts as 2 positions at alpha 0.5
HALF_LIFE = 6.0  # scored positions: a row's acceptance weighs a position half as much 6 later
FALLBACK_Z = 0.5  # back to plain decoding when drafting loses even at alpha this many errors up
CHANGE_Z = 3.0  # a chunk this many errors from a row's estimate drops the row's history
GOOD_ALPHA = 0.8  # a draft that would not pay even at this acceptance (a good draft's) never runs
EXPLORE_ALPHA = 0.5  # a first (or renewed) try drafts the gamma that pays best at this alpha
SWITCH_GAIN = 1.03  # change between drafting gammas only for a predicted 3% more tokens per second
EXTRA_STEPS = 0.05  # a drafting round's own work per draft, in target steps, until measured
PLAIN_FIRST = 1  # rounds of plain decoding that time the plain round before any drafting
FIRST_CHUNK, MAX_CHUNK = 2, 4  # drafting rounds between decisions: 2, then 4
TIMES_KEPT = 8  # a gamma's round time: the fastest of its last 8 chunks
PROBE_ROUNDS = 2  # a renewed try after plain decoding drafts this many rounds, then decides
PROBE_SPACING = 16  # plain rounds before a renewed try, at least (doubled after each that failed)
PROBE_SHARE = 0.02  # renewed tries may lose this share of the time so far, plus what drafting saved
PROBE_MIN_REMAINING = 8  # no renewed try for a row with fewer tokens left than this
RESUME_WIDTH = 32  # a drafter catches up on at most this many positions per call
RESUME_WINDOW = 64  # and on the last this many positions only (see Controller)
TREE_SIZES = (4, 8, 16)  # tree="auto": the node budgets of its tree arms
TREE_AUTO_MAX = max(GAMMA_MAX, *TREE_SIZES)  # the longest path tree="auto" may commit past the text
TREE_BONUS = 1.5  # an untried tree's prior: its drafts accepted 1.5x a chain of N's (optimistic)
TREE_HALF_LIFE = 4.0  # rounds: a tree's measured yield weighs a round half as much 4 rounds later
TREE_PROBE_ROUNDS = 2  # a tree not measured yet is tried with a chunk of this many rounds
TREE_SPACING = 16  # rounds before a tree that lost is tried again (doubled after each loss)


@dataclasses.dataclass(frozen=True)
class Costs:
    """Measured costs in target decode steps: draft1 / draft2 a drafter call over 1 / 2 tokens
    per row, verify[g] the target's call over g + 1 tokens per row (verify[0] = 1 by definition),
    resume a drafter call over RESUME_WIDTH tokens per row (catching up after plain decoding; 0
    for drafters without a model), tree_verify the target's call over N + 1 tokens per row for
    each tree size N of tree="auto" ((N, cost) pairs; empty for chains alone). step_seconds is the
    target decode step they are relative to."""

    step_seconds: float
    draft1: float
    draft2: float
    verify: tuple[float, ...]
    resume: float = 0.0  # a drafter call catching up on RESUME_WIDTH positions per row
    tree_verify: tuple[tuple[int, float], ...] = ()

    def draft_cost(self, gamma: int) -> float:
        """The drafter's calls of a chain of gamma drafts, in target steps."""
        return self.draft2 + (gamma - 1) * self.draft1 if gamma else 0.0

    def round_cost(self, gamma: int) -> float:
        """A round of gamma drafts, in target steps (gamma 0: one decode step)."""
        if gamma == 0:
            return 1.0
        return self.draft_cost(gamma) + self.verify[gamma]

    def tree_round_cost(self, nodes: int) -> float:
        """A tree round of `nodes` node slots, in target steps: the target's call over nodes + 1
        tokens (timed as a causal call of that width: what the tree mask adds shows once the
        tree ran) and the drafter's calls of a chain of `nodes` drafts, what the default
        propose_tree makes. For a drafter that builds its tree otherwise this is an
        approximation: the draft model's EAGLE-2 tree makes min(tree_depth, N) calls (N at the
        default depth of 16), wider than a chain's (up to tree_width nodes per depth above), so
        it is priced low until it ran (and then by its measured rounds)."""
        return self.draft_cost(nodes) + dict(self.tree_verify)[nodes]

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
    """What the costs depend on besides the models: the device, the core count, jax, and the
    CPU matmul kernel's build: its source and the instruction set it is built for
    ($SPEC_JAX_CPU_ISA or the CPU's widest; a faster kernel makes the cached costs stale). A
    model's own build (ModelConfig.cpu_isa) is in model_key."""
    from models.kernels import cpu_matmul

    device = jax.devices()[0]
    return {
        "backend": jax.default_backend(),
        "device_kind": device.device_kind,
        "cpu": machine.cpu_model(),
        "cores": os.cpu_count(),
        "jax": jax.__version__,
        "cpu_matmul": cpu_matmul.library_path().stem if jax.default_backend() == "cpu" else None,
    }


def model_key(config) -> dict:
    return {
        k: getattr(config, k)
        for k in ("name", "vocab_size", "num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim")
        + ("mlp_dim", "dtype", "attention_impl", "matmul_impl", "cpu_isa", "scan_layers")
    }


def cache_path(key: dict, cache_dir=None):
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
    return registry.cache_root(cache_dir) / "costs" / f"{digest}.json"


def measure(
    target,
    drafter,
    draft_params,
    *,
    batch: int,
    cache_slots: int,
    gamma_max: int = GAMMA_MAX,
    tree_sizes: tuple[int, ...] = (),
    repeats: int = 5,
) -> Costs:
    """Times the target's calls over 1..gamma_max + 1 tokens (and N + 1 for each N of
    tree_sizes) and the drafter's calls over 1, 2 and RESUME_WIDTH tokens, those it has
    (Drafter.cost_calls: a draft model all three, a draft head a drafting step and a 2-pair
    call, drafters without a model none: they count as free), the fastest of interleaved repeats
    after a warm-up (spec_jax.timing.model_call)."""
    widest = max((gamma_max, *tree_sizes)) + 1
    slots = max(cache_slots, 2 * (widest + 1), 2 * RESUME_WIDTH)
    repeat = 4  # calls per timed program, so that dispatch is not counted
    fns = {
        ("target", w): timing.model_call(target, batch=batch, widths=[w], cache_slots=slots, repeat=repeat)
        for w in sorted({*range(1, gamma_max + 2), *(n + 1 for n in tree_sizes)})
    }
    calls = drafter.cost_calls(
        draft_params, (1, 2, RESUME_WIDTH), batch=batch, cache_slots=slots, repeat=repeat
    )
    fns.update({("draft", w): fn for w, fn in calls.items()})
    # The fastest of the interleaved repeats: on a machine shared with other work, each call's
    # least disturbed time, so that the cost ratios do not follow the load of the moment.
    times = timing.timed_interleaved(fns, repeats)
    step = times[("target", 1)]["min"]

    def rel(key):
        return times[key]["min"] / step if key in times else 0.0

    verify = (1.0,) + tuple(rel(("target", g + 1)) for g in range(1, gamma_max + 1))
    return Costs(
        step_seconds=step / repeat,
        draft1=rel(("draft", 1)),
        draft2=rel(("draft", 2)),
        verify=verify,
        resume=rel(("draft", RESUME_WIDTH)),
        tree_verify=tuple((n, rel(("target", n + 1))) for n in tree_sizes),
    )


def costs_for(
    target,
    drafter,
    draft_params,
    *,
    batch: int,
    cache_slots: int,
    gamma_max: int = GAMMA_MAX,
    tree_sizes: tuple[int, ...] = (),
    cache_dir=None,
) -> Costs:
    """Cached costs for this machine, pair, batch and cache size (measured on first use), with
    the tree sizes' verify calls where tree_sizes is given (tree="auto"; part of the key).

    target: a models.Model; drafter, draft_params: as spec_jax.drafting.as_drafter returns them.
    The costs are measured at a batch of cost_batch(batch) and a cache of cost_slots(cache_slots)
    (one length for every prompt of an ordinary length: a prompt of a new length measures
    nothing again), announced by one line on stderr. A cached file is used only when it holds this key and costs that checked_costs
    accepts; otherwise (with a warning) the costs are measured again. The file is written
    atomically (registry.atomic_write: a temporary file of a unique name, renamed into place);
    a cache that cannot be written is a warning, and the measured costs are used all the same.
    """
    slots, batch = cost_slots(cache_slots), cost_batch(batch)
    draft_key = drafter.cost_key(draft_params)
    key = {
        "machine": machine_key(),
        "target": model_key(target.config),
        "draft": draft_key,
        "batch": batch,
        "cache_slots": slots,
        "gamma_max": gamma_max,
        "method": MEASURE_METHOD,
    }
    if tree_sizes:  # only then, so that the chains' cached costs keep their key
        key["tree_sizes"] = list(tree_sizes)
    path = cache_path(key, cache_dir)
    if path.exists():
        try:
            saved = json.loads(path.read_text())
            if saved["key"] != json.loads(json.dumps(key, default=str)):
                raise ValueError("it was measured for another key")
            return checked_costs(saved["costs"], gamma_max, tree_sizes)
        except (OSError, ValueError, KeyError, TypeError) as e:  # stale, damaged or edited
            warnings.warn(
                f"gamma=auto: cached costs {path} are not usable ({e}); measuring again", stacklevel=2
            )
    print(
        f"gamma=auto: measuring {target.config.name}'s model calls at batch {batch} (once for this pair "
        f"and precision; about {COST_MEASURE_SECONDS} s on a 2-core CPU; cached in {path.parent})",
        file=sys.stderr,
        flush=True,
    )
    costs = measure(
        target,
        drafter,
        draft_params,
        batch=batch,
        cache_slots=slots,
        gamma_max=gamma_max,
        tree_sizes=tree_sizes,
    )
    try:
        payload = json.dumps({"key": key, "costs": dataclasses.asdict(costs)}, indent=1, default=str)
        path.parent.mkdir(parents=True, exist_ok=True)
        registry.atomic_write(path, lambda f: f.write(payload.encode()))
    except OSError as e:  # the costs are measured: use them, and measure again next time
        warnings.warn(f"gamma=auto: could not cache the measured costs in {path} ({e})", stacklevel=2)
    return costs


def checked_costs(saved: dict, gamma_max: int, tree_sizes: tuple[int, ...] = ()) -> Costs:
    """Costs from their saved fields, or ValueError where they cannot be measured costs: a
    verify list of other than gamma_max + 1 entries or not starting at 1, tree verify costs of
    other sizes than tree_sizes, a step time or verify cost that is not finite and positive, a
    drafter cost that is not finite and non-negative."""
    trees = tuple((int(n), float(v)) for n, v in saved.get("tree_verify", ()))
    costs = Costs(**{**saved, "verify": tuple(float(v) for v in saved["verify"]), "tree_verify": trees})
    if len(costs.verify) != gamma_max + 1 or costs.verify[0] != 1.0:
        raise ValueError(f"verify has {len(costs.verify)} entries, not 1.0 and {gamma_max} more")
    if tuple(n for n, _ in trees) != tuple(tree_sizes):
        raise ValueError(f"tree_verify is for trees of {[n for n, _ in trees]} nodes, not {list(tree_sizes)}")
    positive = (costs.step_seconds, *costs.verify, *(v for _, v in trees))
    free = (costs.draft1, costs.draft2, costs.resume)
    if not all(isinstance(v, float | int) and math.isfinite(v) for v in positive + free):
        raise ValueError("a cost is not a finite number")
    if min(positive) <= 0 or min(free) < 0:
        raise ValueError("a cost is not positive")
    return costs


def work_clock() -> float:
    """The clock gamma=auto times chunks with, in seconds: this process's CPU time on a CPU
    backend (the work of all its threads, not the time other jobs on a shared machine take from
    it, so that the choice does not follow their load), wall time on an accelerator (whose work
    the host does not see)."""
    return time.process_time() if jax.default_backend() == "cpu" else time.perf_counter()


@dataclasses.dataclass(frozen=True)
class Chunk:
    """What one chunk of rounds did, as gamma=auto's host loop saw it (arrays are [B])."""

    gamma: int  # the loop's gamma (a tree's: its node count)
    rounds: int  # rounds run (batched: one round is one step of every row)
    seconds: float  # work_clock seconds: the model calls and the loop's own work, not compilation
    active_b: np.ndarray  # bool: rows not done when the chunk began
    committed_b: np.ndarray  # tokens each row committed
    overlap_b: np.ndarray  # each row's sum of sum_x min(p, q) over the positions it had scored
    scored_b: np.ndarray  # how many positions of each row the target scored (spec_jax.metrics)
    remaining_b: np.ndarray  # tokens each row may still commit (0: done)
    tree: int = 0  # tree rounds of this many node slots (0: chain or plain rounds)


END = 2**31 - 1  # rounds of a chunk that runs to the end


class Controller:
    """Chooses gamma for each chunk of rounds from measured round times and each row's running
    acceptance (module docstring: what it measures and how it decides).

    The host loop (spec_jax.api.run) asks next_chunk(remaining) for (gamma, rounds), runs them,
    and reports the chunk with observe(Chunk); catching a drafter up after plain chunks is
    reported with observe_resume(seconds, calls).
    """

    def __init__(self, costs: Costs, gamma_max: int, batch: int = 1, resumable: bool = True):
        self.costs, self.gamma_max, self.resumable = costs, min(gamma_max, len(costs.verify) - 1), resumable
        self.times: dict[int, list[float]] = {}  # gamma -> seconds per round of its last chunks
        # Each row's overlap sum and scored positions, decayed (HALF_LIFE), from a prior.
        self.overlap = np.full(batch, PRIOR_WEIGHT * PRIOR_ALPHA)
        self.weight = np.full(batch, PRIOR_WEIGHT)
        self.gamma = self.probe_gamma()
        if self.best_at(GOOD_ALPHA) == 0:  # not even a good draft's acceptance would pay
            self.phase = "never"
        else:  # resumable: a plain round is timed first
            self.phase = "plain_first" if resumable else "draft"
        self.chunk = FIRST_CHUNK
        self.plain_rounds = 0  # plain rounds since the drafter last ran
        self.spacing = PROBE_SPACING  # plain rounds before the next probe, at least
        self.bank_at_try = 0.0  # the bank when drafting last began
        self.bank = 0.0  # seconds drafting saved against plain decoding, less what probes cost
        self.elapsed = 0.0  # seconds of all chunks and resumes
        self.resume_call = None  # seconds of one catch-up call, as last measured
        self.schedule: list[list[int]] = []  # [gamma, rounds] of the chunks run, one gamma merged

    # --- estimates -------------------------------------------------------------------------
    def round_seconds(self, gamma: int) -> float:
        """Seconds per round of gamma: the fastest of its recent chunks where it has run.
        Otherwise its model calls (offline, in target steps) at the rate of a plain round as
        timed, plus the round's own work: as the nearest drafting gamma measured it (the time
        its calls do not explain), taken to grow with gamma and never to shrink, or, before any
        drafting round ran, EXTRA_STEPS per draft."""
        drafted = [h for h in self.times if h]
        if gamma == 0:
            # A drafting round's own work is at least a plain round's in proportion to its
            # calls, so a plain round costs no more than the drafting rounds imply: a plain
            # chunk timed under a passing load must not make drafting look better.
            implied = [min(self.times[h]) / self.costs.round_cost(h) for h in drafted]
            if 0 in self.times:
                return min([min(self.times[0])] + implied)
            if drafted:  # a drafter that cannot resume never times a plain round
                return min(min(self.times[h]) / (self.costs.round_cost(h) + EXTRA_STEPS * h) for h in drafted)
            return self.costs.step_seconds
        if gamma in self.times:
            return min(self.times[gamma])
        return self.predicted_seconds(self.costs.round_cost(gamma), gamma)

    def predicted_seconds(self, steps: float, size: int) -> float:
        """Seconds of a round not run yet whose model calls take `steps` target steps and which
        drafts `size` tokens (a tree: node slots): the calls at the rate of a plain round, plus
        the round's own work as the nearest drafting gamma measured it (what its calls do not
        explain, growing with size, never shrinking), or EXTRA_STEPS per draft before any
        drafting round ran."""
        drafted = [h for h in self.times if h]
        step = self.round_seconds(0)
        calls = step * steps
        if not drafted:
            return calls + step * EXTRA_STEPS * size
        h = min(drafted, key=lambda h: (abs(h - size), h))
        extra = max(min(self.times[h]) - step * self.costs.round_cost(h), 0.0)
        return calls + extra * max(1.0, size / h)

    def alphas(self, z: float = 0.0) -> np.ndarray:
        """Each row's acceptance: the overlap of its scored positions, each weighted by recency
        (half as much HALF_LIFE positions back), after a prior of PRIOR_WEIGHT positions at
        PRIOR_ALPHA (decayed alike); with z, z standard errors above that (an optimistic
        bound). [B]"""
        alpha = self.overlap / self.weight
        return np.clip(alpha + z * np.sqrt(alpha * (1.0 - alpha) / self.weight), 0.0, 1.0)

    def forget(self, rows) -> None:
        """Drops the history of the rows (a bool mask [B]): back to the prior."""
        self.overlap = np.where(rows, PRIOR_WEIGHT * PRIOR_ALPHA, self.overlap)
        self.weight = np.where(rows, PRIOR_WEIGHT, self.weight)

    def rates(self, alphas, remaining_b) -> np.ndarray:
        """Expected tokens per second of the batch for gamma = 0..gamma_max: the active rows'
        expected committed tokens per round (capped at what each may still commit) over the
        round's seconds. [gamma_max + 1]"""
        alphas, remaining = np.asarray(alphas, float), np.asarray(remaining_b)
        active = remaining > 0
        powers = alphas[active, None] ** np.arange(self.gamma_max + 1)[None, :]  # [rows, G + 1]
        out = np.zeros(self.gamma_max + 1)
        for g in range(self.gamma_max + 1):
            upto = np.minimum(g, remaining[active] - 1)  # E[min(1 + accepted, remaining)]
            tokens = np.sum(np.where(np.arange(self.gamma_max + 1)[None, :] <= upto[:, None], powers, 0.0))
            out[g] = tokens / self.round_seconds(g)
        return out

    def best_at(self, alpha: float) -> int:
        """The gamma with the most tokens per second at acceptance alpha (0: plain decoding)."""
        return int(np.argmax(self.rates(np.full(1, alpha), np.full(1, END))))

    def probe_gamma(self) -> int:
        """What a first or a renewed try drafts with: the drafting gamma that pays best at
        EXPLORE_ALPHA (a short draft, cheap to try with a draft that turns out poor); 0 when not
        even a good draft's acceptance would pay."""
        if self.best_at(GOOD_ALPHA) == 0:
            return 0
        return 1 + int(np.argmax(self.rates(np.full(1, EXPLORE_ALPHA), np.full(1, END))[1:]))

    # --- the schedule ----------------------------------------------------------------------
    def next_chunk(self, remaining_b) -> tuple[int, int]:
        """(gamma, rounds) for the next chunk; remaining_b: tokens each row may still commit."""
        remaining_b = np.asarray(remaining_b)
        if self.phase == "never":
            return 0, END
        if self.phase == "plain_first":
            return 0, PLAIN_FIRST
        if self.phase == "draft":
            rounds, self.chunk = self.chunk, min(2 * self.chunk, MAX_CHUNK)
            return self.gamma, rounds
        wait = self.rounds_until_probe(remaining_b)
        if wait:
            return 0, wait
        self.gamma, self.phase, self.bank_at_try = self.probe_gamma(), "draft", self.bank
        self.forget(np.ones_like(self.weight, bool))  # the probe asks what the acceptance is now
        self.chunk = 2 * PROBE_ROUNDS
        return self.gamma, PROBE_ROUNDS

    def resume_seconds(self, gap: int) -> float:
        """Seconds to catch the drafter up on `gap` positions (at most RESUME_WINDOW of them,
        RESUME_WIDTH per call): as the last catch-up took per call, or as measured offline."""
        calls = -(-min(gap, RESUME_WINDOW) // RESUME_WIDTH)
        per_call = self.resume_call
        if per_call is None:
            per_call = self.costs.resume * self.round_seconds(0)
        return calls * per_call

    def probe_cost(self, gamma: int, gap: int) -> float:
        """Seconds a probe may lose against plain decoding: catching the drafter up on `gap`
        positions and PROBE_ROUNDS rounds of gamma that accept nothing."""
        loss = PROBE_ROUNDS * max(self.round_seconds(gamma) - self.round_seconds(0), 0.0)
        return loss + self.resume_seconds(gap)

    def rounds_until_probe(self, remaining_b) -> int:
        """Plain rounds before drafting is tried again (0: now; END: not in this call). A probe
        waits at least `spacing` plain rounds (doubled after each try that lost time) and
        until what it may lose is covered by the budget: what drafting saved so far, plus
        PROBE_SHARE of the time spent."""
        gamma = self.probe_gamma()
        left = int(np.max(remaining_b, initial=0))
        if not self.resumable or gamma == 0 or left < PROBE_MIN_REMAINING:
            return END
        # Each further plain round adds PROBE_SHARE of its time to the budget; the catch-up
        # costs at most RESUME_WINDOW positions' worth.
        short = self.probe_cost(gamma, RESUME_WINDOW) - self.bank - PROBE_SHARE * self.elapsed
        wait = max(self.spacing - self.plain_rounds, 0)
        if short > 0:
            wait = max(wait, int(np.ceil(short / (PROBE_SHARE * self.round_seconds(0)))))
        return END if wait > left - PROBE_MIN_REMAINING else wait

    # --- what happened ---------------------------------------------------------------------
    def observe_resume(self, seconds: float, calls: int) -> None:
        """The drafter caught up in `seconds`, with `calls` calls of its model (or none)."""
        self.elapsed += seconds
        self.bank -= seconds
        self.resume_call = seconds / max(calls, 1)

    def record(self, gamma: int, rounds: int) -> None:
        """Adds a chunk to the schedule (consecutive chunks of one gamma merged)."""
        if self.schedule and self.schedule[-1][0] == gamma:
            self.schedule[-1][1] += rounds
        else:
            self.schedule.append([gamma, rounds])

    def observe(self, chunk: Chunk) -> None:
        """Takes in a chunk's time and acceptance and decides what the next chunk does."""
        self.record(chunk.gamma, chunk.rounds)
        self.elapsed += chunk.seconds
        if chunk.rounds > 0:
            kept = self.times.setdefault(chunk.gamma, [])
            kept.append(chunk.seconds / chunk.rounds)
            del kept[:-TIMES_KEPT]
        if chunk.gamma == 0:
            self.plain_rounds += chunk.rounds
            if self.phase == "plain_first":
                self.phase = "draft" if (gamma := self.probe_gamma()) else "never"
                self.gamma = gamma or self.gamma
            return
        self.plain_rounds = 0
        scored = np.asarray(chunk.scored_b, float)
        # A row whose chunk is far from what its estimate predicts has changed (a draft that was
        # right turned wrong, or the text turned predictable): its history is dropped.
        alpha = self.alphas()
        spread = np.sqrt(scored * alpha * (1.0 - alpha) + 0.25)
        self.forget(np.abs(chunk.overlap_b - scored * alpha) > CHANGE_Z * spread)
        decay = 0.5 ** (scored / HALF_LIFE)
        self.overlap = decay * self.overlap + chunk.overlap_b
        self.weight = decay * self.weight + scored
        active = max(int(np.sum(chunk.active_b)), 1)
        self.bank += float(np.sum(chunk.committed_b)) / active * self.round_seconds(0) - chunk.seconds
        rates = self.rates(self.alphas(), chunk.remaining_b)
        # Plain decoding only when even an optimistic acceptance says drafting loses: a noisy
        # stretch of a good draft should not end drafting (coming back costs a catch-up).
        optimistic = self.rates(self.alphas(FALLBACK_Z), chunk.remaining_b)
        if np.argmax(optimistic) == 0:  # a try that lost time makes the next one wait twice as long
            self.spacing = 2 * self.spacing if self.bank < self.bank_at_try else PROBE_SPACING
            self.phase, self.chunk, self.plain_rounds = "plain", FIRST_CHUNK, 0
        else:
            best = 1 + int(np.argmax(rates[1:]))
            if rates[best] > SWITCH_GAIN * rates[self.gamma]:
                self.gamma = best


def tree_arm(nodes: int) -> str:
    """The name of the arm of trees of `nodes` node slots (in the schedule: "tree8")."""
    return f"tree{nodes}"


def arm_shape(arm) -> tuple[int, int]:
    """(the loop's gamma, tree nodes) of an arm next_chunk names: a chain's gamma g (0: plain
    decoding) runs (g, 0), a tree "treeN" (N, N)."""
    if isinstance(arm, str):
        nodes = int(arm.removeprefix("tree"))
        return nodes, nodes
    return int(arm), 0


class TreeController(Controller):
    """tree="auto": the Controller's arms (plain decoding, chains of 1..gamma_max) and trees of N
    node slots for each N of costs.tree_verify (module docstring: what a tree costs, what it
    yields, when it is tried and dropped). next_chunk names a tree arm "treeN" (arm_shape)."""

    def __init__(self, costs: Costs, gamma_max: int, batch: int = 1, resumable: bool = True):
        super().__init__(costs, gamma_max, batch, resumable)
        self.tree_sizes = tuple(n for n, _ in costs.tree_verify)
        self.tree = 0  # the tree the drafting chunks run (0: the chains' gamma)
        self.tree_times: dict[int, list[float]] = {}  # nodes -> seconds per round of its last chunks
        # Each row's committed tokens and rounds in each tree's chunks, decayed (TREE_HALF_LIFE).
        self.tree_tokens = {n: np.zeros(batch) for n in self.tree_sizes}
        self.tree_rounds = {n: np.zeros(batch) for n in self.tree_sizes}
        self.rounds_done = 0
        self.dropped: set[int] = set()  # trees that lost, waiting until tree_retry
        self.tree_retry = dict.fromkeys(self.tree_sizes, 0)  # rounds_done from which a tree may run
        self.tree_spacing = dict.fromkeys(self.tree_sizes, TREE_SPACING)

    # --- estimates -------------------------------------------------------------------------
    def tree_round_seconds(self, nodes: int) -> float:
        """Seconds per round of trees of `nodes` slots: the fastest of its recent chunks where it
        has run; else its calls (Costs.tree_round_cost) at the plain round's rate plus the
        round's own work as the nearest tree that ran showed it (what its calls do not explain:
        the tree mask, the compaction; growing with the node count, never shrinking), or, before
        any tree ran, as a chain's would be predicted (predicted_seconds)."""
        if nodes in self.tree_times:
            return min(self.tree_times[nodes])
        calls = self.costs.tree_round_cost(nodes)
        if not self.tree_times:
            return self.predicted_seconds(calls, nodes)
        step = self.round_seconds(0)
        m = min(self.tree_times, key=lambda m: (abs(m - nodes), m))
        extra = max(min(self.tree_times[m]) - step * self.costs.tree_round_cost(m), 0.0)
        return step * calls + extra * max(1.0, nodes / m)

    def tree_yields(self, nodes: int) -> np.ndarray:
        """Each row's expected committed tokens per tree round: as measured (recency-weighted)
        where the tree ran for the row, else an optimistic prior: 1 + TREE_BONUS * (y - 1) where
        a smaller tree measured y tokens per round (the largest such), else 1 + TREE_BONUS *
        (E(alpha, nodes) - 1) at the row's chain acceptance. [B]"""
        alphas = self.alphas()
        expected = np.sum(alphas[:, None] ** np.arange(nodes + 1)[None, :], axis=1)
        prior = 1.0 + TREE_BONUS * (expected - 1.0)
        for smaller in (n for n in self.tree_sizes if n < nodes):  # the largest that ran counts
            ran = self.tree_rounds[smaller] > 0
            measured = self.tree_tokens[smaller] / np.maximum(self.tree_rounds[smaller], 1e-9)
            prior = np.where(ran, 1.0 + TREE_BONUS * (measured - 1.0), prior)
        rounds = self.tree_rounds[nodes]
        return np.where(rounds > 0, self.tree_tokens[nodes] / np.maximum(rounds, 1e-9), prior)

    def tree_rate(self, nodes: int, remaining_b) -> float:
        """Expected tokens per second of the batch in tree rounds of `nodes` slots: the active
        rows' yields (capped at what each may still commit) over the round's seconds."""
        remaining = np.asarray(remaining_b)
        active = remaining > 0
        tokens = np.sum(np.minimum(self.tree_yields(nodes)[active], remaining[active]))
        return float(tokens) / self.tree_round_seconds(nodes)

    def measured(self, nodes: int) -> bool:
        return bool(np.any(self.tree_rounds[nodes] > 0))

    # --- the schedule ----------------------------------------------------------------------
    def next_chunk(self, remaining_b):
        """(arm, rounds): a tree arm's name while a tree runs, else the chains' (gamma, rounds)."""
        if self.tree:
            rounds, self.chunk = self.chunk, min(2 * self.chunk, MAX_CHUNK)
            return tree_arm(self.tree), rounds
        return super().next_chunk(remaining_b)

    def observe(self, chunk: Chunk) -> None:
        """Takes in a chunk (a tree's or the chains') and, after a drafting chunk, weighs the
        trees against the chains' choice."""
        self.rounds_done += chunk.rounds
        if chunk.tree:
            self.observe_tree(chunk)
        else:
            super().observe(chunk)
        if chunk.gamma and np.any(np.asarray(chunk.remaining_b) > 0):
            self.decide(chunk.remaining_b)

    def observe_tree(self, chunk: Chunk) -> None:
        n = chunk.tree
        self.record(tree_arm(n), chunk.rounds)
        self.elapsed += chunk.seconds
        self.plain_rounds = 0
        if chunk.rounds > 0:
            kept = self.tree_times.setdefault(n, [])
            kept.append(chunk.seconds / chunk.rounds)
            del kept[:-TIMES_KEPT]
        # A row's yield from the chunks it ran through: a row that finished in the chunk
        # committed fewer tokens than its rounds would have (cut at its last token).
        full = np.asarray(chunk.active_b) & (np.asarray(chunk.remaining_b) > 0)
        decay = 0.5 ** (chunk.rounds / TREE_HALF_LIFE)
        committed = np.asarray(chunk.committed_b, float)
        self.tree_tokens[n] = np.where(full, decay * self.tree_tokens[n] + committed, self.tree_tokens[n])
        self.tree_rounds[n] = np.where(full, decay * self.tree_rounds[n] + chunk.rounds, self.tree_rounds[n])
        active = max(int(np.sum(chunk.active_b)), 1)
        self.bank += float(np.sum(committed)) / active * self.round_seconds(0) - chunk.seconds

    def decide(self, remaining_b) -> None:
        """Moves to the arm with the most expected tokens per second when it beats the current
        one by SWITCH_GAIN: a tree (tried for TREE_PROBE_ROUNDS rounds where not measured yet;
        one waiting after a loss is not a candidate), or, leaving a tree, the chains' best gamma
        or plain decoding; the tree left is dropped."""
        for n in [n for n in self.dropped if self.rounds_done >= self.tree_retry[n]]:
            self.dropped.discard(n)  # its wait is over: its prior decides again
            self.tree_tokens[n], self.tree_rounds[n] = (
                np.zeros_like(self.tree_tokens[n]),
                np.zeros_like(self.tree_rounds[n]),
            )
        chains = self.rates(self.alphas(), remaining_b)
        if self.tree:
            current = self.tree_rate(self.tree, remaining_b)
        else:
            current = chains[self.gamma if self.phase == "draft" else 0]
        trees = {
            n: self.tree_rate(n, remaining_b)
            for n in self.tree_sizes
            if n == self.tree or n not in self.dropped
        }
        best_tree = max(trees, key=lambda n: (trees[n], -n), default=0)
        best_chain = int(np.argmax(chains))
        if (
            best_tree
            and best_tree != self.tree
            and trees[best_tree] > SWITCH_GAIN * max(current, chains[best_chain])
        ):
            if self.tree:
                self.drop(self.tree)
            self.tree, self.phase = best_tree, "draft"
            self.chunk = FIRST_CHUNK if self.measured(best_tree) else TREE_PROBE_ROUNDS
        elif self.tree and chains[best_chain] > SWITCH_GAIN * current:
            self.drop(self.tree)
            self.tree, self.chunk, self.plain_rounds = 0, FIRST_CHUNK, 0
            if best_chain:
                self.gamma, self.phase = best_chain, "draft"
            else:
                self.phase = "plain"

    def drop(self, nodes: int) -> None:
        """A tree that lost: not tried again for its spacing (doubled after each loss); its
        yields inform the larger trees' priors until then, and are forgotten then."""
        self.dropped.add(nodes)
        self.tree_retry[nodes] = self.rounds_done + self.tree_spacing[nodes]
        self.tree_spacing[nodes] *= 2
