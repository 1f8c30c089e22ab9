"""The compiled programs of one decoding call on its placed arguments (Runner: the prefill, the
loop in chunks, the drafter's catch-up), and gamma=auto's host loop over them (decode_auto,
auto_chunk, CatchUp). spec_jax.api runs one call's prompts through them; spec_jax.engine its
table of requests.
"""

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax import autogamma, sharding, timing
from spec_jax.decode import PrefillInputs, pad_prompts
from spec_jax.drafting import NoDrafter
from spec_jax.executables import compiled
from spec_jax.logprobs import TokenLogprobs, score_prompt
from spec_jax.speculative import SpecState, SpecStatic, committed_text, spec_loop, spec_prefill


def _prefill_marking_padding_done(static, params, draft_params, inputs, active_b, pool=None) -> SpecState:
    """spec_prefill with the rows where active is False marked done: rows added only to fill the
    data axis never run a round or count in the metrics."""
    state = spec_prefill(static, params, draft_params, inputs, pool)
    return state.replace(out=state.out.replace(done=state.out.done | ~active_b))


def _shardings_of(tree):
    return jax.tree.map(lambda x: x.sharding, tree)


def _resume_drafter(
    static, draft_params, draft_state, tokens_bp, prompt_lens_b, out_tokens_bn, length_b, synced_b
):
    """The drafter's `resume` on the committed text. static: (drafter, cache length, width)."""
    drafter, cache_len, width = static
    text_bs = committed_text(tokens_bp, prompt_lens_b, out_tokens_bn, length_b, cache_len)
    return drafter.resume(draft_params, draft_state, text_bs, synced_b, length_b, width)


@dataclasses.dataclass
class Runner:
    """The compiled programs of one call on its placed arguments: the prefill, the loop (one
    executable per static settings, each chunk's gamma), a drafter's catch-up, and the scoring
    of a prompt (its logprobs)."""

    static: SpecStatic
    mesh: jax.sharding.Mesh
    target_params: Any
    draft_params: Any
    inputs: PrefillInputs

    def prefill(
        self, active, inputs: PrefillInputs | None = None, pool=None
    ) -> tuple[SpecState, float, float]:
        """(state after prefill, compile seconds, prefill seconds) of inputs (default the
        call's; spec_jax.engine prefills one request at a time into its table); pool: the
        prefix cache's, for inputs.prefix_blocks (spec_prefill)."""
        inputs = self.inputs if inputs is None else inputs
        args = (self.target_params, self.draft_params, inputs, active) + (() if pool is None else (pool,))
        batch = inputs.tokens.shape[0]
        fn, compile_s = compiled(
            "spec_prefill",
            _prefill_marking_padding_done,
            self.static,
            args,
            in_shardings=_shardings_of(args),
            out_shardings=lambda state_shape: sharding.state_shardings(state_shape, self.mesh, batch),
        )
        start = time.perf_counter()
        state = jax.block_until_ready(fn(*args))
        return state, compile_s, time.perf_counter() - start

    def loop(self, state: SpecState, max_rounds: int, gamma: int | None = None, tree: int = 0):
        """(state after up to max_rounds rounds, compile seconds, wall seconds, work_clock
        seconds); gamma: this chunk's (0: plain decoding, without the drafter); tree: its tree
        rounds' node slots (0: chains; a tree's gamma is its node count)."""
        static, draft_params = self.static, self.draft_params
        if gamma is not None:
            drafter = static.drafter if gamma else NoDrafter(static.config.vocab_size)
            static = dataclasses.replace(static, drafter=drafter, gamma=gamma, tree_nodes=tree)
            draft_params = draft_params if gamma else None
        rounds = sharding.put(jnp.asarray(max_rounds, jnp.int32), sharding.replicated(self.mesh))
        args = (self.target_params, draft_params, state, self.inputs.stop_ids, rounds)
        in_shardings = _shardings_of(args)
        fn, compile_s = compiled(
            "spec_loop",
            spec_loop,
            static,
            args,
            donate_argnums=(2,),
            in_shardings=in_shardings,
            out_shardings=in_shardings[2],
        )
        start, work = time.perf_counter(), timing.work_clock()
        state = jax.block_until_ready(fn(*args))
        return state, compile_s, time.perf_counter() - start, timing.work_clock() - work

    def score(self, ids: list[int], width: int, k: int) -> tuple[TokenLogprobs, float, float]:
        """(the prompt's logprobs, compile seconds, run seconds): one scoring call over the
        prompt ids padded to width (spec_jax.logprobs.score_prompt), each token's (the first's
        None) and its top k."""
        tokens, lens = pad_prompts([ids], width)
        inputs = (tokens, lens, np.full(1, k, np.int32))
        inputs = sharding.put(inputs, sharding.state_shardings(inputs, self.mesh, 1))
        args = (self.target_params, *inputs)
        fn, compile_s = compiled("score_prompt", score_prompt, self.static.config, args)
        start = time.perf_counter()
        kept = sharding.fetch(fn(*args))
        seconds = time.perf_counter() - start
        n = len(ids)  # position s predicts token s + 1: token t's is at t - 1 (the first has none)
        shift = [np.concatenate([np.zeros_like(a[0, :1]), a[0, : n - 1]]) for a in kept]
        return TokenLogprobs.of(ids, *shift, k, first_none=True), compile_s, seconds

    def resume(self, draft_state, state: SpecState, synced_b, width: int):
        """(the drafter's state caught up on the text committed without it, compile seconds,
        timing.work_clock seconds of the run)."""
        synced = sharding.put(np.asarray(synced_b, np.int32), sharding.batch_sharding(self.mesh, 1))
        inputs = self.inputs
        args = (self.draft_params, draft_state, inputs.tokens, inputs.prompt_lens, state.out.tokens)
        args += (state.length, synced)
        in_shardings = _shardings_of(args)
        fn, compile_s = compiled(
            "drafter_resume",
            _resume_drafter,
            (self.static.drafter, self.static.cache_len, width),
            args,
            in_shardings=in_shardings,
            out_shardings=in_shardings[1],
        )
        start = timing.work_clock()
        draft_state = jax.block_until_ready(fn(*args))
        return draft_state, compile_s, timing.work_clock() - start


def observed(state: SpecState):
    """Host copies of what gamma=auto reads between chunks: (done, generated, length, budget,
    overlap sums, scored positions, target calls)."""
    m = state.metrics
    return sharding.fetch(
        (state.out.done, state.out.num_generated, state.length, state.out.budget)
        + (m.row_overlap_sum, m.row_overlap_count, m.target_calls)
    )


def decode_auto(controller: autogamma.Controller, runner: Runner, state: SpecState):
    """gamma=auto's host loop: auto_chunk until every row is done.

    Returns (state, compile seconds, decode seconds: the wall time of all chunks, catch-ups and
    the host's work between them, compilation excluded, {"gamma_schedule": [[gamma, rounds],
    ...] (consecutive chunks of one gamma merged; a tree chunk's gamma is named "treeN"),
    "resume_seconds": what the catch-ups took by timing.work_clock}).
    """
    catch_up = CatchUp(runner, np.asarray(sharding.fetch(runner.inputs.prompt_lens)).astype(np.int64))
    compile_s = 0.0
    start = time.perf_counter()
    before = observed(state)
    while not bool(np.all(before[0])):
        state, before, c = auto_chunk(controller, runner, catch_up, state, before)
        compile_s += c
    decode_s = time.perf_counter() - start - compile_s
    return (
        state,
        compile_s,
        decode_s,
        {"gamma_schedule": controller.schedule, "resume_seconds": catch_up.seconds},
    )


def auto_chunk(controller, runner: Runner, catch_up: "CatchUp", state: SpecState, before, max_rounds=None):
    """One chunk of gamma=auto: its gamma (tree="auto": or tree) chosen by the controller
    (spec_jax.autogamma) from the chunks before it, at most max_rounds rounds. Plain chunks
    run without the drafter, whose state waits aside (catch_up); before it drafts again it
    catches up on the text committed meanwhile. before: observed(state). The controller sees
    the chunk's time by work_clock. Returns (state, observed(state), compile seconds)."""
    done, generated, length, budget = before[:4]
    arm, rounds = controller.next_chunk(np.where(done, 0, budget - generated))
    gamma, tree = autogamma.arm_shape(arm)
    state, c = catch_up.before_chunk(state, gamma, done, length, controller)
    rounds = rounds if max_rounds is None else min(rounds, max_rounds)
    state, c_loop, _, seconds = runner.loop(state, rounds, gamma, tree)
    after = observed(state)
    controller.observe(
        autogamma.Chunk(
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
    return state, after, c + c_loop


@dataclasses.dataclass
class CatchUp:
    """The drafter's state while plain chunks run without it (stash), and the text it follows:
    every row's committed tokens below `synced` (at prefill: the prompt)."""

    runner: Runner
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
        self.synced = np.maximum(self.synced, length - 2 - autogamma.RESUME_WINDOW)
        gap = int(np.max(np.where(done, 0, length - 2 - self.synced), initial=0))
        compile_s = 0.0
        if gap > 0:
            width = min(autogamma.RESUME_WIDTH, 1 << (gap - 1).bit_length())
            self.stash, compile_s, seconds = self.runner.resume(self.stash, state, self.synced, width)
            self.seconds += seconds
            controller.observe_resume(seconds, -(-gap // width))
        state, self.stash = state.replace(draft_state=self.stash), None
        return state, compile_s
