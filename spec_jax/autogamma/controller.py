"""gamma=auto's Controller: each chunk's gamma from the measured time of whole rounds and each
row's running acceptance (the package's docstring says what it measures and how it decides),
and what a chunk reports to it (Chunk)."""

import dataclasses

import numpy as np

from spec_jax.autogamma.costs import RESUME_WIDTH, Costs
from spec_jax.autogamma.tries import Try

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
RESUME_WINDOW = 64  # and on the last this many positions only (see Controller)


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

    The host loop (spec_jax.autogamma.chunking.auto_chunk) asks next_chunk(remaining) for
    (gamma, rounds), runs them, and reports the chunk with observe(Chunk); catching a drafter up
    after plain chunks is reported with observe_resume(seconds, calls).
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
        self.tried = Try()  # what this try's drafting rounds measured
        self.bank = 0.0  # seconds drafting saved against plain decoding, less what probes cost
        self.elapsed = 0.0  # seconds of all chunks and resumes
        self.resume_call = None  # seconds of one catch-up call, as last measured
        self.schedule: list[list[int]] = []  # [gamma, rounds] of the chunks run, one gamma merged
        self.cost_entry = None  # a cost_cache.CostEntry that save_rounds refreshes after the run

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
        self.tried = Try()
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
    def timed_step(self) -> float:
        """Seconds of a plain round as timed (the fastest of its chunks but the first, which may
        be the program's first execution, where there are two; not bounded by what the drafting
        rounds imply, as round_seconds(0) is, which would give back the costs' own ratios);
        round_seconds(0) where no plain chunk ran."""
        plain = self.times.get(0, [])
        return min(plain[1:] or plain) if plain else self.round_seconds(0)

    def timed_rounds(self) -> dict[str, float]:
        """Seconds per round of each drafting arm that ran at least two chunks (the fastest of
        its last chunks but its first, which may be its program's first execution, which costs
        more) over timed_step ({"3": ..., "tree8": ...}: cost_cache.CostEntry.record's)."""
        step = self.timed_step()
        return (
            {str(g): min(t[1:]) / step for g, t in self.times.items() if g and len(t) > 1} if step > 0 else {}
        )

    def save_rounds(self) -> None:
        """After the run: its timed rounds go into cost_entry (cost_cache.CostEntry.record:
        the cached costs the next run plans with), if it has one."""
        step = self.timed_step()
        if self.cost_entry is not None and step > 0:  # a clock too coarse to time the plain round: nothing
            resume = None if self.resume_call is None else self.resume_call / step
            self.cost_entry.record(step, self.timed_rounds(), resume)

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
        # stretch of a good draft should not end drafting (coming back costs a catch-up); or
        # when the try's rounds measured a loss (Try.lost).
        optimistic = self.rates(self.alphas(FALLBACK_Z), chunk.remaining_b)
        if np.argmax(optimistic) == 0 or self.tried.lost(chunk, self.times, active):  # next try waits 2x
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
