"""gamma=auto's host loop over a call's compiled programs (a spec_jax.runner.Runner: its `loop`
in chunks and the drafter's `resume`): one chunk of the gamma (or tree) the controller chose
(auto_chunk), the drafter's state set aside during plain chunks and caught up before it drafts
again (CatchUp), what the controller reads of the loop state between chunks (observed), and a
call's chunks until every row is done (decode_auto, spec_jax.generate's). The engine runs
auto_chunk over its table of requests.
"""

import dataclasses
import time
from typing import Any, NamedTuple

import numpy as np

from spec_jax import sharding
from spec_jax.autogamma.controller import RESUME_WINDOW, Chunk, Controller, arm_shape
from spec_jax.autogamma.costs import RESUME_WIDTH
from spec_jax.speculative import SpecState


class Chunked(NamedTuple):
    """What auto_chunk returns."""

    state: SpecState
    observed: tuple  # observed(state): the host's copies after the chunk
    compile_seconds: float


class Decoded(NamedTuple):
    """What decode_auto returns."""

    state: SpecState
    compile_seconds: float
    decode_seconds: float  # all chunks, catch-ups and the host's work between them, compilation excluded
    timings: dict  # {"gamma_schedule": [[gamma, rounds], ...], "resume_seconds": the catch-ups'}


def observed(state: SpecState):
    """Host copies of what gamma=auto reads between chunks: (done, generated, length, budget,
    overlap sums, scored positions, target calls)."""
    m = state.metrics
    return sharding.fetch(
        (state.out.done, state.out.num_generated, state.length, state.out.budget)
        + (m.row_overlap_sum, m.row_overlap_count, m.target_calls)
    )


def decode_auto(controller: Controller, runner, state: SpecState) -> Decoded:
    """gamma=auto's host loop: auto_chunk until every row is done. Decoded.timings:
    gamma_schedule (consecutive chunks of one gamma merged; a tree chunk's gamma is named
    "treeN") and resume_seconds (what the catch-ups took by timing.work_clock)."""
    catch_up = CatchUp(runner, np.asarray(sharding.fetch(runner.inputs.prompt_lens)).astype(np.int64))
    compile_s = 0.0
    start = time.perf_counter()
    before = observed(state)
    while not bool(np.all(before[0])):
        state, before, c = auto_chunk(controller, runner, catch_up, state, before)
        compile_s += c
    decode_s = time.perf_counter() - start - compile_s
    return Decoded(
        state,
        compile_s,
        decode_s,
        {"gamma_schedule": controller.schedule, "resume_seconds": catch_up.seconds},
    )


def auto_chunk(controller, runner, catch_up: "CatchUp", state: SpecState, before, max_rounds=None) -> Chunked:
    """One chunk of gamma=auto: its gamma (tree="auto": or tree) chosen by the controller
    (spec_jax.autogamma) from the chunks before it, at most max_rounds rounds. Plain chunks
    run without the drafter, whose state waits aside (catch_up); before it drafts again it
    catches up on the text committed meanwhile. before: observed(state). The controller sees
    the chunk's time by work_clock."""
    done, generated, length, budget = before[:4]
    arm, rounds = controller.next_chunk(np.where(done, 0, budget - generated))
    gamma, tree = arm_shape(arm)
    state, c = catch_up.before_chunk(state, gamma, done, length, controller)
    rounds = rounds if max_rounds is None else min(rounds, max_rounds)
    state, c_loop, _, seconds = runner.loop(state, rounds, gamma, tree)
    after = observed(state)
    controller.observe(
        Chunk(
            gamma=gamma,
            rounds=int(after[6] - before[6]),
            seconds=seconds,
            active_b=~done,
            committed_b=after[1] - generated,
            overlap_b=after[4] - before[4],
            scored_b=after[5] - before[5],
            remaining_b=np.where(after[0], 0, after[3] - after[1]),
            tree=tree,
        )
    )
    if gamma:  # its last round began at most gamma + 1 tokens back
        catch_up.synced = np.maximum(catch_up.synced, after[2] - gamma - 1)
    return Chunked(state, after, c + c_loop)


@dataclasses.dataclass
class CatchUp:
    """The drafter's state while plain chunks run without it (stash), and the text it follows:
    every row's committed tokens below `synced` (at prefill: the prompt)."""

    runner: Any  # spec_jax.runner.Runner
    synced: np.ndarray
    stash: Any = None
    seconds: float = 0.0  # work_clock seconds of the catch-ups

    def before_chunk(self, state: SpecState, gamma: int, done, length, controller):
        """(the state a chunk of gamma starts from, compile seconds): a plain chunk sets the
        drafter's state aside; a drafting chunk after plain ones catches it up first."""
        if gamma == 0 and self.stash is None:
            self.stash, state = state.draft_state, state.replace(draft_state=())
        if not gamma or self.stash is None:
            return state, 0.0
        # The drafter catches up on the last RESUME_WINDOW positions at most: a model drafter's
        # cache then holds stale entries before them, which changes its drafts and acceptance
        # but never the output (the rule is exact for any draft).
        self.synced = np.maximum(self.synced, length - 2 - RESUME_WINDOW)
        gap = int(np.max(np.where(done, 0, length - 2 - self.synced), initial=0))
        compile_s = 0.0
        if gap > 0:
            width = min(RESUME_WIDTH, 1 << (gap - 1).bit_length())
            self.stash, compile_s, seconds = self.runner.resume(self.stash, state, self.synced, width)
            self.seconds += seconds
            controller.observe_resume(seconds, -(-gap // width))
        state, self.stash = state.replace(draft_state=self.stash), None
        return state, compile_s
