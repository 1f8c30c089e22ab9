"""gamma=auto: the number of draft tokens per round chosen, chunk by chunk, from the measured time
of whole rounds and each row's running acceptance (Leviathan et al. 2023, Theorem 3.8, with
costs measured instead of assumed).

With acceptance alpha, a round of gamma drafts commits E(alpha, gamma) = (1 - alpha^(gamma+1)) /
(1 - alpha) tokens per row on average; plain decoding (gamma = 0) commits 1. The loop runs in
chunks of rounds (chunking.auto_chunk), and before each chunk the Controller picks the gamma in
0..gamma_max with the most expected tokens per second for the batch: the sum over the rows still
running of each row's E (capped at what the row may still commit) over the seconds of one round.
gamma_max is the drafter's auto_gamma_max: AUTO_GAMMA_MAX (8), or AUTO_COPY_GAMMA_MAX (16) for a
drafter that copies text (prompt lookup, suffix, hybrid), whose rows propose only as many of the
chunk's gamma drafts as their match supports (spec_jax.drafting.lookup.draft_counts); E takes
every row to propose gamma, so it overrates long chains for rows with short matches.

What a round costs. Each chunk's time over its rounds is a measured round of that gamma: the
drafter's and the target's calls and the loop's own work (sampling and the rejection rule over
[gamma + 1, V], the commit, the drafter's state). Chunks are timed by timing.work_clock: the
process's CPU time on a CPU backend, so that other jobs on a shared machine do not sway the
choice, wall time on an accelerator. A gamma is timed as the fastest of its last chunks. A gamma
not yet run is predicted from the model calls measured offline (costs.Costs, once per machine,
pair, batch bucket and cache-length bucket, cached under `$SPEC_JAX_CACHE/costs/` by cost_cache)
at the measured plain round's rate, plus the round's own work as the nearest measured drafting
gamma showed it (what its calls do not explain, taken to grow with gamma), or EXTRA_STEPS per
draft before any drafting round ran. A call starts with PLAIN_FIRST plain round(s), which time
the plain round without costing anything against plain decoding; then it tries the drafting
gamma that pays best at EXPLORE_ALPHA (a short draft), in chunks of 2, then 4 rounds.

What a row accepts. Each row keeps the overlap sum_x min(p, q) of its scored positions (the
metrics' alpha_hat, per row), weighted by recency (half weight HALF_LIFE positions back) after
a weak prior; a chunk far outside what a row's estimate predicts (CHANGE_Z errors) drops the
row's history, so a draft that turns always wrong is seen within a chunk or two.

Falling back and trying again. Drafting stops when plain decoding wins even at an optimistic
acceptance (FALLBACK_Z errors up). A drafter that can catch up (Drafter.resumable) is tried
again later with a short chunk (PROBE_ROUNDS rounds after catching up on the last RESUME_WINDOW
positions: chunking.CatchUp): after at least PROBE_SPACING plain rounds (doubled after each try
that lost time) and only when what the try may lose is covered by what drafting saved so far
plus PROBE_SHARE of the time spent. A draft that would not pay even at GOOD_ALPHA never runs.

Trees (tree="auto"): trees.TreeController weighs token trees beside the chains.

Exactness is untouched: the schedule only chooses each chunk's gamma (or tree); greedy output
equals plain decoding whatever it chooses, and a sampled output is an exact sample (which
sample depends on the chunks: the random stream is consumed per round).

The modules: controller (Controller, Chunk), trees (TreeController), costs (what a round costs:
measured, assumed, calibrated), cost_cache (which costs a run plans with, and their cache),
chunking (the host loop over a Runner's chunks). Drafters say what to time (Drafter.timed_call)
and import nothing of this package. What the planner (spec_jax.plan), the engine and
spec_jax.generate call is exported here, and nothing else.
"""

from spec_jax.autogamma.chunking import CatchUp, auto_chunk, decode_auto, observed
from spec_jax.autogamma.controller import Controller
from spec_jax.autogamma.cost_cache import COST_SLOTS, CostSizes, cost_entry, costs_for
from spec_jax.autogamma.trees import TreeController

__all__ = [
    # the planner (spec_jax.plan): a controller per row bucket, from cached, measured or prior costs
    "COST_SLOTS",
    "Controller",
    "CostSizes",
    "TreeController",
    "cost_entry",
    "costs_for",
    # the engine: one chunk over its table (the table keeps the drafter's CatchUp)
    "CatchUp",
    "auto_chunk",
    "observed",
    # spec_jax.generate: a call's chunks to the end
    "decode_auto",
]
