"""The compiled programs of one decoding call on its placed arguments (Runner: the prefill, the
loop in chunks, the drafter's catch-up, a prompt's scoring). spec_jax.api runs one call's prompts
through them and spec_jax.engine its table of requests, each with gamma=auto's host loop
(spec_jax.autogamma: decode_auto, auto_chunk) where the gamma is auto.
"""

import dataclasses
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax import sharding, timing
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


def capped_program(drafter, draft_params) -> bool:
    """Whether a chunk of gamma runs in the program of the smallest power of two at least gamma
    (at most the loop's gamma), each row's drafts capped at the chunk's (SpecState.max_drafts):
    gamma=auto's 1..16 then compile 5 programs at most (0, 2, 4, 8, 16; each is 20-50 s at
    gguf_q8 on 2 cores), where each gamma compiled its own, and a short chunk's arrays stay
    short (a round of the 16 program costs about 15% more than one of 2's). For a drafter that
    calls no model (a longer proposal costs it nothing) and whose rounds are verified only as
    wide as their longest row's drafts (auto_widths "doubling": prompt lookup, suffix)."""
    doubling = drafter.variable_length and drafter.auto_widths == "doubling"
    return doubling and drafter.timed_call(draft_params) is None  # the class checks first: per chunk


def _shardings_of(tree):
    return jax.tree.map(lambda x: x.sharding, tree)


def _resume_drafter(
    static, draft_params, draft_state, tokens_bp, prompt_lens_b, out_tokens_bn, length_b, synced_b
):
    """The drafter's `resume` on the committed text. static: (drafter, cache length, width)."""
    drafter, cache_len, width = static
    text_bs = committed_text(tokens_bp, prompt_lens_b, out_tokens_bn, length_b, cache_len)
    return drafter.resume(draft_params, draft_state, text_bs, synced_b, length_b, width)


class Prefilled(NamedTuple):
    """What Runner.prefill returns."""

    state: SpecState
    compile_seconds: float
    prefill_seconds: float


class Looped(NamedTuple):
    """What Runner.loop returns: the wall seconds of the chunk and its seconds by
    timing.work_clock (the process's CPU time where the loop runs on this CPU)."""

    state: SpecState
    compile_seconds: float
    seconds: float
    work_seconds: float


class Scored(NamedTuple):
    """What Runner.score returns."""

    logprobs: TokenLogprobs
    compile_seconds: float
    seconds: float


class Resumed(NamedTuple):
    """What Runner.resume returns."""

    draft_state: Any
    compile_seconds: float
    work_seconds: float


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

    def prefill(self, active, inputs: PrefillInputs | None = None, pool=None) -> Prefilled:
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
        return Prefilled(state, compile_s, time.perf_counter() - start)

    def loop(self, state: SpecState, max_rounds: int, gamma: int | None = None, tree: int = 0) -> Looped:
        """(state after up to max_rounds rounds, compile seconds, wall seconds, work_clock
        seconds); gamma: this chunk's (0: plain decoding, without the drafter); tree: its tree
        rounds' node slots (0: chains; a tree's gamma is its node count)."""
        static, draft_params, capped, caps = self.static, self.draft_params, False, None
        program = min(static.gamma, 1 << (gamma - 1).bit_length()) if gamma else 0
        if gamma and not tree and gamma < program and capped_program(static.drafter, draft_params):
            capped, caps = True, state.max_drafts  # the rows' own caps, back after the chunk
            state = state.replace(max_drafts=self._chunk_caps(caps, gamma, state.length.shape[0]))
            gamma = program
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
        state = state.replace(max_drafts=caps) if capped else state
        return Looped(state, compile_s, time.perf_counter() - start, timing.work_clock() - work)

    def _chunk_caps(self, caps, gamma: int, batch: int):
        """int32 [B]: each row's most drafts in a chunk of `gamma` run in the loop's own program
        (capped_program); caps: the rows' own (None: none)."""
        if caps is None:
            return sharding.put(np.full(batch, gamma, np.int32), sharding.batch_sharding(self.mesh, 1))
        return jnp.minimum(caps, gamma)

    def score(self, ids: list[int], width: int, k: int) -> Scored:
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
        return Scored(TokenLogprobs.of(ids, *shift, k, first_none=True), compile_s, seconds)

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
        return Resumed(draft_state, compile_s, timing.work_clock() - start)
