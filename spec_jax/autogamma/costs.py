"""What a round of gamma=auto costs (Costs: each model call of a round in target decode steps):
`measure` times the calls (the target's, and the drafter's as the drafter describes them:
Drafter.timed_call), `calibrated` fits a prior (cost_cache.prior_costs, from the weights' bytes)
to the rounds a run timed, `checked_costs` reads saved ones back. Which costs a run plans with,
and their cache, is cost_cache's.
"""

import dataclasses
import math

import numpy as np

from spec_jax import theory, timing

RESUME_WIDTH = 32  # a drafter catches up on at most this many positions per call


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


def measure(target, drafter, draft_params, sizes, repeats: int = 5) -> Costs:
    """Times the target's calls over 1..gamma_max + 1 tokens (and N + 1 for each N of
    tree_sizes) and the drafter's calls over 1, 2 and RESUME_WIDTH tokens, those it has
    (Drafter.timed_call: a draft model all three, a draft head a drafting step and a 2-pair
    call, drafters without a model none: they count as free), the fastest of interleaved repeats
    after a warm-up (spec_jax.timing.model_call, call_runner), at `sizes` (a
    cost_cache.CostSizes) as they are."""
    batch, gamma_max, tree_sizes = sizes.batch, sizes.gamma_max, sizes.tree_sizes
    widest = max((gamma_max, *tree_sizes)) + 1
    slots = max(sizes.cache_slots, 2 * (widest + 1), 2 * RESUME_WIDTH)
    repeat = 4  # calls per timed program, so that dispatch is not counted
    fns = {
        ("target", w): timing.model_call(target, batch=batch, widths=[w], cache_slots=slots, repeat=repeat)
        for w in sorted({*range(1, gamma_max + 2), *(n + 1 for n in tree_sizes)})
    }
    timed = drafter.timed_call(draft_params)
    for w in () if timed is None else (1, 2, RESUME_WIDTH):
        if timed.widths is None or w in timed.widths:
            fns[("draft", w)] = timing.call_runner(
                timed, batch=batch, widths=[w], cache_slots=slots, repeat=repeat
            )
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


def _arm_cost(costs: Costs, arm: str) -> float:
    """What costs say a round of `arm` (a chain's gamma "3", a tree "tree8") costs, in steps."""
    return costs.tree_round_cost(int(arm[4:])) if arm.startswith("tree") else costs.round_cost(int(arm))


def calibrated(prior: Costs, rounds: dict[str, float], resume: float | None = None) -> Costs:
    """The prior with its cost beyond a plain step (every drafter call, and each verify and tree
    call's cost above 1) scaled by the one factor that fits the timed rounds best (least
    squares: rounds[arm] = a round of arm's seconds over a plain round's; arms the prior does
    not price are left out); resume: a catch-up
    call's seconds over a plain round's, as timed, where one ran. step_seconds stays the prior's
    (the caller sets the timed one)."""
    trees = {f"tree{n}" for n, _ in prior.tree_verify}
    priced = [arm for arm in rounds if arm in trees or (arm.isdigit() and 0 < int(arm) < len(prior.verify))]
    excess = {arm: _arm_cost(prior, arm) - 1.0 for arm in priced}
    weight = sum(e * e for e in excess.values())
    scale = sum((rounds[a] - 1.0) * e for a, e in excess.items()) / weight if weight > 0 else 1.0
    scale = min(max(scale, 0.05), 20.0)  # a chunk timed under a passing load moves it this far at most

    def up(v: float) -> float:
        return 1.0 + scale * (v - 1.0)

    return dataclasses.replace(
        prior,
        draft1=scale * prior.draft1,
        draft2=scale * prior.draft2,
        verify=tuple(up(v) for v in prior.verify),
        resume=scale * prior.resume if resume is None else resume,
        tree_verify=tuple((n, up(v)) for n, v in prior.tree_verify),
    )


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
