"""tree="auto": the gamma=auto Controller (spec_jax.autogamma.controller) with token trees among
its arms (TreeController).

The arms are plain decoding, chains of 1..gamma_max drafts and token trees of N node slots for N in
AUTO_TREE_SIZES (spec_jax.drafting; spec_jax.tree; each a loop compiled with tree_nodes = N). A
tree's round is predicted, before it ran, from the target's call over N + 1 tokens (measured offline
with the chain widths when trees are on: Costs.tree_verify) and the drafter's calls of a chain of N
drafts (what the default propose_tree makes; none for drafters without a model), plus the round's
own work as the nearest tree that ran showed it (else as for a chain of N); once it ran, as the
fastest of its last chunks. What a tree yields is measured per row from its chunks: committed tokens
per round, weighted by recency (half weight TREE_HALF_LIFE rounds back). Before it ran an optimistic
prior stands in: 1 + TREE_BONUS * (y - 1) where a smaller tree measured y tokens per round (a larger
budget is taken to hold the smaller tree's paths and more), else 1 + TREE_BONUS * (E(alpha, N) - 1)
at the row's chain acceptance (the chain of N's accepted drafts, TREE_BONUS times over). A tree is
tried, with a short chunk (TREE_PROBE_ROUNDS), only when that beats the best other arm by
SWITCH_GAIN. A tree that then loses is dropped: not tried again for TREE_SPACING rounds (doubled
after each loss), its measured yield informing the larger trees' priors meanwhile and forgotten
then, so that its prior decides again. Trees are weighed after drafting chunks only (a chain's
acceptance measured first); plain chunks and renewed tries are the chains' (Controller).
"""

import numpy as np

from spec_jax.autogamma.controller import (
    FIRST_CHUNK,
    MAX_CHUNK,
    SWITCH_GAIN,
    TIMES_KEPT,
    Chunk,
    Controller,
    tree_arm,
)
from spec_jax.autogamma.costs import Costs

TREE_BONUS = 1.5  # an untried tree's prior: its drafts accepted 1.5x a chain of N's (optimistic)
TREE_HALF_LIFE = 4.0  # rounds: a tree's measured yield weighs a round half as much 4 rounds later
TREE_PROBE_ROUNDS = 2  # a tree not measured yet is tried with a chunk of this many rounds
TREE_SPACING = 16  # rounds before a tree that lost is tried again (doubled after each loss)


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

    def timed_rounds(self) -> dict[str, float]:
        """The chains' timed rounds (Controller.timed_rounds) and each tree's that ran at least
        two chunks ("tree8"), alike."""
        step = self.timed_step()
        trees = {tree_arm(n): min(t[1:]) / step for n, t in self.tree_times.items() if len(t) > 1}
        trees = trees if step > 0 else {}
        return {**super().timed_rounds(), **trees}

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
