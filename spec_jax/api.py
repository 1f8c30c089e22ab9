"""`spec_jax.generate`: the one entry point for autoregressive and speculative decoding.

One path: the drafter is chosen up front (None -> NoDrafter with gamma 0, plain decoding), and
"no mesh" is a 1x1 mesh on the default device, so every call places its arguments by the same
sharding rules and runs the same two compiled programs (prefill, loop). `run` reads as its
steps: validate, plan (the layout and one gamma policy, fixed or auto), place, compile and run
the prefill, run the loop in chunks (one chunk unless gamma is auto).
"""

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models import kernels
from models.settings import is_int
from spec_jax import autogamma, sharding, step_costs, tree_auto
from spec_jax.decode import PrefillInputs, layout, pad_prompts, stop_id_list
from spec_jax.drafting import Drafter, NoDrafter, as_drafter, check_gamma
from spec_jax.executables import compiled
from spec_jax.metrics import NONFINITE, nonfinite_rows
from spec_jax.sampling import SamplingParams, row_keys
from spec_jax.speculative import SpecState, SpecStatic, committed_text, spec_loop, spec_prefill


@dataclasses.dataclass
class Generation:
    """tokens: the new tokens of each prompt (the stop token included when hit); stats: the
    metrics of spec_jax.metrics and timings."""

    tokens: list[list[int]]
    stats: dict[str, Any]

    @property
    def nonfinite_rows(self) -> list[int]:
        """The prompts whose target logits became non-finite (NaN or inf): each stopped there,
        its tokens are those before (spec_jax.metrics.NONFINITE)."""
        return nonfinite_rows(self.stats)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    """generate's (and run's) keyword arguments, as generate documents them."""

    draft: Any = None
    gamma: int | str = 4
    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    row_ids: Any = None
    eos_id: Any = None
    mesh: jax.sharding.Mesh | None = None
    verify_widths: str = "auto"
    tree: int | str = 0


def validate(target, prompts, drafter, gamma, max_new_tokens, eos_id, tree=0):
    """Raises ValueError naming the argument and its allowed range (drafter: a drafter or None)."""
    if not isinstance(prompts, list | tuple) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    vocab = target.config.vocab_size
    for i, p in enumerate(prompts):
        if isinstance(p, str) or (isinstance(p, list | tuple) and any(isinstance(m, dict) for m in p)):
            what = "a text" if isinstance(p, str) else "a conversation"
            raise ValueError(
                f"prompts[{i}] is {what}; prompts are token ids: target.tokenizer.encode(text), or "
                "target.tokenizer.encode_chat(messages) for a conversation in the model's chat template"
            )
        if len(p) == 0:
            raise ValueError(f"prompts[{i}] is empty; every prompt needs at least one token")
        arr = np.asarray(p)
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"prompts[{i}] must be a flat list of integer token ids")
        if arr.min() < 0 or arr.max() >= vocab:
            raise ValueError(
                f"prompts[{i}] has token ids outside the vocabulary [0, {vocab}): "
                f"min {arr.min()}, max {arr.max()}"
            )
    if not is_int(max_new_tokens) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > target.config.max_seq_len:
        raise ValueError(
            f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the target's "
            f"context of {target.config.max_seq_len} tokens"
        )
    stop_id_list(eos_id, vocab)
    if tree != "auto" and (not is_int(tree) or not 0 <= tree <= MAX_TREE_NODES):
        raise ValueError(
            f"tree must be 0 (chains), a node count in [1, {MAX_TREE_NODES}] or 'auto', got {tree!r}"
        )
    if drafter is None:
        return
    shown = gamma
    if tree == "auto":  # gamma is auto too; the longest path is the largest tree's or chain's
        gamma, shown = autogamma.TREE_AUTO_MAX, f"'auto' (up to {autogamma.TREE_AUTO_MAX})"
    elif tree:
        gamma, shown = tree, None
    elif gamma == "auto":
        gamma, shown = autogamma.GAMMA_MAX, f"'auto' (up to {autogamma.GAMMA_MAX})"
    elif not is_int(gamma) or gamma < 1:
        raise ValueError(f"gamma must be an integer >= 1 or 'auto', got {gamma!r}")
    if drafter.vocab_size != vocab:
        raise ValueError(
            f"draft vocabulary size ({drafter.vocab_size}) differs from the target's ({vocab}); "
            "speculative decoding needs one shared vocabulary"
        )
    contexts = {"the target's": target.config.max_seq_len, "the draft's": drafter.max_seq_len}
    check_gamma(gamma, longest, max_new_tokens, contexts, name="tree" if tree else "gamma", shown=shown)


VERIFY_WIDTHS = ("auto", "ends", "all")
# A tree call scores the root and N nodes, one bit each in the attention's int32 mask.
MAX_TREE_NODES = kernels.MAX_TREE_QUERIES - 1


def resolve_verify_widths(verify_widths: str, drafter: Drafter) -> str:
    """SpecStatic.verify_widths for generate's setting: "ends" (the target scores 1 or gamma + 1
    positions) or "all" (any width up to gamma + 1: the narrowest that covers the round's
    drafts; one compiled branch per width). "auto" is "all" for a drafter whose learned stop
    makes short drafts common (a draft head with an acceptance head), else "ends"."""
    if verify_widths not in VERIFY_WIDTHS:
        raise ValueError(f"verify_widths must be one of {', '.join(VERIFY_WIDTHS)}, got {verify_widths!r}")
    if verify_widths == "auto":
        return "all" if drafter.stop_rejection > 0 else "ends"
    return verify_widths


@dataclasses.dataclass(frozen=True)
class GammaPolicy:
    """The one gamma decision of a call: the loop's static gamma (the cache and the metrics are
    sized for it; 0: plain decoding), whether gamma=auto's Controller picks each chunk's
    gamma up to it (spec_jax.autogamma), and the tree sizes it weighs too (tree="auto":
    TreeController; the static gamma then covers the largest)."""

    gamma: int
    auto: bool = False
    trees: tuple[int, ...] = ()

    @classmethod
    def of(cls, gamma, drafter: Drafter | None, tree: int | str = 0) -> "GammaPolicy":
        if drafter is None:
            return cls(0)
        if tree == "auto":
            return cls(autogamma.TREE_AUTO_MAX, auto=True, trees=autogamma.TREE_SIZES)
        if tree:  # a tree round's paths are at most its node count long
            return cls(tree)
        if gamma == "auto":  # with a learned stop (an acceptance head), gamma is its fixed cap
            return cls(autogamma.GAMMA_MAX, auto=drafter.stop_rejection <= 0)
        return cls(gamma)


@dataclasses.dataclass
class Plan:
    """What a call runs, decided before anything is placed: the drafter (NoDrafter for plain
    decoding) and its unplaced params, the gamma policy and its controller (None: one chunk
    to the end), the prompts and row ids padded to a multiple of the mesh's data axis, and the
    layout (prompt width, cache length)."""

    drafter: Drafter
    draft_params: Any
    policy: GammaPolicy
    controller: autogamma.Controller | None
    sampling: SamplingParams
    mesh: jax.sharding.Mesh
    num_rows: int  # the caller's prompts; rows past them pad the data axis
    prompts: list
    row_ids: np.ndarray
    width: int
    cache_len: int
    stop_ids: list[int]


def _plan(target, prompts, options: Options) -> Plan:
    """Validates the call and decides what runs (Plan)."""
    drafter, draft_params = (None, None) if options.draft is None else as_drafter(options.draft, target)
    validate(target, prompts, drafter, options.gamma, options.max_new_tokens, options.eos_id, options.tree)
    num_rows = len(prompts)
    row_ids = np.arange(num_rows) if options.row_ids is None else np.asarray(options.row_ids)
    if row_ids.shape != (num_rows,) or not np.issubdtype(row_ids.dtype, np.integer) or row_ids.min() < 0:
        raise ValueError(f"row_ids must be {num_rows} non-negative integers (one per prompt), got {row_ids}")
    policy = GammaPolicy.of(options.gamma, drafter, options.tree)
    drafter = NoDrafter(target.config.vocab_size) if drafter is None else drafter
    mesh = sharding.default_mesh() if options.mesh is None else options.mesh
    sharding.check_mesh(mesh)
    padding = -num_rows % mesh.shape[sharding.DATA]
    prompts = list(prompts) + [prompts[0]] * padding
    row_ids = np.concatenate([row_ids, np.zeros(padding, row_ids.dtype)])
    width, cache_len = layout(
        sharding.for_mesh(target.config, mesh),
        prompts,
        options.max_new_tokens,
        policy.gamma,
        drafter.reads_features,
    )
    controller = None
    if policy.auto:
        batch = len(prompts)
        costs = step_costs.costs_for(
            target, drafter, draft_params, batch=batch, cache_slots=cache_len, tree_sizes=policy.trees
        )
        kind = tree_auto.TreeController if policy.trees else autogamma.Controller
        controller = kind(costs, policy.gamma, batch=batch, resumable=drafter.resumable)
        if controller.phase == "never":  # drafting would not pay even with a good draft: never run it
            drafter, draft_params = NoDrafter(target.config.vocab_size), None
    sampling = SamplingParams(float(options.temperature), options.top_k, float(options.top_p))
    stop_ids = stop_id_list(options.eos_id, target.config.vocab_size)
    return Plan(
        drafter,
        draft_params,
        policy,
        controller,
        sampling,
        mesh,
        num_rows,
        prompts,
        row_ids,
        width,
        cache_len,
        stop_ids,
    )


def _place(target, plan: Plan, seed: int):
    """(target params, draft params, PrefillInputs, active [B]) on the plan's mesh, and the
    drafter as it runs there: the models by the rule table (each drafter says how its params
    are placed), the inputs' rows over the data axis."""
    mesh, batch = plan.mesh, len(plan.prompts)
    tokens, lens = pad_prompts(plan.prompts, plan.width)
    inputs = PrefillInputs(
        tokens=jnp.asarray(tokens),
        prompt_lens=jnp.asarray(lens),
        stop_ids=jnp.asarray(plan.stop_ids or [-1], jnp.int32),
        keys=row_keys(jax.random.key(seed), plan.row_ids),
    )
    inputs = sharding.put(inputs, sharding.state_shardings(inputs, mesh, batch))
    active = sharding.put(np.arange(batch) < plan.num_rows, sharding.batch_sharding(mesh, 1))
    target_params = sharding.placed_params(target, mesh)
    draft_params = sharding.put_once(plan.draft_params, plan.drafter.param_shardings(plan.draft_params, mesh))
    return target_params, draft_params, inputs, active, plan.drafter.for_mesh(mesh)


def _prefill_marking_padding_done(static, params, draft_params, inputs, active_b) -> SpecState:
    """spec_prefill with the rows where active is False marked done: rows added only to fill the
    data axis never run a round or count in the metrics."""
    state = spec_prefill(static, params, draft_params, inputs)
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
    executable per static settings, each chunk's gamma), and a drafter's catch-up."""

    static: SpecStatic
    mesh: jax.sharding.Mesh
    target_params: Any
    draft_params: Any
    inputs: PrefillInputs

    def prefill(self, active) -> tuple[SpecState, float, float]:
        """(state after prefill, compile seconds, prefill seconds)."""
        args = (self.target_params, self.draft_params, self.inputs, active)
        batch = self.inputs.tokens.shape[0]
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
        start, work = time.perf_counter(), step_costs.work_clock()
        state = jax.block_until_ready(fn(*args))
        return state, compile_s, time.perf_counter() - start, step_costs.work_clock() - work

    def resume(self, draft_state, state: SpecState, synced_b, width: int):
        """(the drafter's state caught up on the text committed without it, compile seconds,
        step_costs.work_clock seconds of the run)."""
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
        start = step_costs.work_clock()
        draft_state = jax.block_until_ready(fn(*args))
        return draft_state, compile_s, step_costs.work_clock() - start


def run(target, prompts, **options) -> tuple[SpecState, dict]:
    """What generate does (the same arguments), returning the final loop state as device arrays
    (caches included, with their shardings; rows past len(prompts) pad the data axis) and the
    timings dict."""
    options = Options(**options)
    plan = _plan(target, prompts, options)
    target_params, draft_params, inputs, active, drafter = _place(target, plan, options.seed)
    config = sharding.for_mesh(target.config, plan.mesh)
    widths = resolve_verify_widths(options.verify_widths, drafter)
    static = SpecStatic(
        config,
        drafter,
        plan.sampling,
        plan.policy.gamma,
        options.max_new_tokens,
        plan.cache_len,
        widths,
        tree_nodes=options.tree if plan.policy.gamma and not plan.policy.auto else 0,
    )
    runner = Runner(static, plan.mesh, target_params, draft_params, inputs)
    state, prefill_compile_s, prefill_s = runner.prefill(active)
    if plan.controller is None:
        state, loop_compile_s, decode_s, _ = runner.loop(state, np.iinfo(np.int32).max)
        timings = {}
    else:
        state, loop_compile_s, decode_s, timings = _decode_auto(plan.controller, runner, state)
    timings = dict(
        compile_seconds=prefill_compile_s + loop_compile_s,
        prefill_seconds=prefill_s,
        decode_seconds=decode_s,
        **timings,
    )
    return state, timings


def _observed(state: SpecState):
    """Host copies of what gamma=auto reads between chunks: (done, generated, length, overlap
    sums, scored positions, target calls)."""
    m = state.metrics
    return sharding.fetch(
        (state.out.done, state.out.num_generated, state.length)
        + (m.row_overlap_sum, m.row_overlap_count, m.target_calls)
    )


def _decode_auto(controller: autogamma.Controller, runner: Runner, state: SpecState):
    """gamma=auto's host loop: chunks of rounds, each gamma (tree="auto": or tree) chosen by the
    controller (spec_jax.autogamma) from the chunks before it. Plain chunks run without the drafter, whose
    state waits aside; before it drafts again it catches up on the text committed meanwhile.

    Returns (state, compile seconds, decode seconds: the wall time of all chunks, catch-ups and
    the host's work between them, compilation excluded, {"gamma_schedule": [[gamma, rounds],
    ...] (consecutive chunks of one gamma merged; a tree chunk's gamma is named "treeN"), "resume_seconds": what the catch-ups took by
    step_costs.work_clock}). The controller sees each chunk's time by work_clock.
    """
    max_new = runner.static.max_new_tokens
    catch_up = _CatchUp(runner, np.asarray(sharding.fetch(runner.inputs.prompt_lens)).astype(np.int64))
    compile_s = 0.0
    start = time.perf_counter()
    before = _observed(state)
    while not bool(np.all(before[0])):
        done, generated, length = before[:3]
        arm, rounds = controller.next_chunk(np.where(done, 0, max_new - generated))
        gamma, tree = autogamma.arm_shape(arm)
        state, c = catch_up.before_chunk(state, gamma, done, length, controller)
        state, c_loop, _, seconds = runner.loop(state, rounds, gamma, tree)
        compile_s += c + c_loop
        after = _observed(state)
        controller.observe(
            autogamma.Chunk(
                gamma=gamma,
                rounds=int(after[5] - before[5]),
                seconds=seconds,
                active_b=~done,
                committed_b=after[1] - generated,
                overlap_b=after[3] - before[3],
                scored_b=after[4] - before[4],
                remaining_b=np.where(after[0], 0, max_new - after[1]),
                tree=tree,
            )
        )
        if gamma:  # its last round began at most gamma + 1 tokens back
            catch_up.synced = np.maximum(catch_up.synced, after[2] - gamma - 1)
        before = after
    decode_s = time.perf_counter() - start - compile_s
    return (
        state,
        compile_s,
        decode_s,
        {"gamma_schedule": controller.schedule, "resume_seconds": catch_up.seconds},
    )


@dataclasses.dataclass
class _CatchUp:
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


def generate(target, prompts, **options) -> Generation:
    """Generates up to max_new_tokens after each prompt, speculatively when a draft is given.

    Args:
      target: a models.Model.
      prompts: list of token-id lists (ragged lengths are fine); a conversation is
        target.tokenizer.encode_chat(messages), its text in the model's chat template (messages:
        [{"role": str, "content": str}, ...]) with no second BOS.
      draft: None (plain autoregressive decoding), a models.Model, or a (drafter, params) pair
        such as spec_jax.drafting.ngram.fit_bigram returns (see as_drafter).
      gamma: draft tokens per round (static: a new gamma compiles a new loop), or "auto"
        (spec_jax.autogamma; with a draft head's acceptance head, the most it may draft, 8).
      temperature, top_k, top_p: the warp, applied identically to target and draft; any
        positive temperature samples (0 is greedy).
      seed, row_ids: row b draws its randomness from fold_in(key(seed), row_ids[b]) alone
        (row_ids default 0..B-1), so a prompt's sample does not depend on the other prompts of
        its batch: pass each prompt's index in a larger list to make batching invisible.
      eos_id: None, one token id, or a sequence of them (e.g. tokenizer.stop_ids): a row stops
        after generating any of them.
      mesh: None (one device: a 1x1 mesh) or a Mesh with axes ("data", "model")
        (spec_jax.sharding.make_mesh): both models and both caches are sharded by
        spec_jax.sharding's rule table and the loop runs under one jit with explicit in/out
        shardings. The batch is padded to a multiple of the data axis with rows that are done
        from the start. Place models once with spec_jax.sharding.place(model, mesh); unplaced
        models are placed on first use and cached. Tokens equal the unsharded run's (up to
        float reassociation in the sharded matmuls).
      verify_widths: for drafters that may propose fewer than gamma drafts, which widths the
        target's verification call may take (resolve_verify_widths): "auto", "ends", "all".
      tree: 0 (each round verifies a chain of gamma drafts) or N in [1, MAX_TREE_NODES]: each
        round verifies the drafter's token tree of up to N nodes (Drafter.propose_tree; by
        default the chain of N drafts; a draft model's is EAGLE-2's dynamic tree, shaped by
        its tree_depth and tree_width: spec_jax.drafting.model.ModelDrafter) in one target call
        with a tree mask (spec_jax.tree); gamma is then not used. "auto": each chunk of rounds
        runs plain decoding, a chain of 1..8 drafts or a tree of 4, 8 or 16 nodes, whichever
        promises the most tokens per second (spec_jax.tree_auto.TreeController); gamma is then
        auto, whatever it says.

    Returns:
      Generation(tokens, stats). stats holds the metrics schema of spec_jax.metrics, the
      timings compile_seconds, prefill_seconds, decode_seconds, tokens_per_second (new tokens
      over prefill + decode), and num_new_tokens; stats["nonfinite_logits"] flags, per prompt,
      a row that stopped early because the target's logits became NaN or infinite
      (Generation.nonfinite_rows lists them).
    """
    state, timings = run(target, prompts, **options)
    num_rows = len(prompts)
    out, counts, nonfinite, metrics = sharding.fetch(
        (state.out.tokens, state.out.num_generated, state.out.nonfinite, state.metrics)
    )
    new_tokens = [out[i, : counts[i]].tolist() for i in range(num_rows)]
    total = int(counts[:num_rows].sum())
    draft = options.get("draft")
    stats = metrics.to_dict(() if draft is None else as_drafter(draft)[0].sources)
    stats.update(
        timings,
        num_new_tokens=total,
        tokens_per_second=total / (timings["prefill_seconds"] + timings["decode_seconds"]),
    )
    stats[NONFINITE] = nonfinite[:num_rows].tolist()
    return Generation(tokens=new_tokens, stats=stats)
