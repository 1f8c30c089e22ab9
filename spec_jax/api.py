"""`spec_jax.generate`: the one entry point for autoregressive and speculative decoding.

One path: the drafter is chosen up front (None -> NoDrafter with gamma 0, plain decoding), and
"no mesh" is a 1x1 mesh on the default device, so every call places its arguments by the same
sharding rules and runs the same two compiled programs (prefill, loop). `run` reads as its
steps: validate, plan (the layout and one gamma policy, fixed or auto), place, compile and run
the prefill, run the loop in chunks (one chunk unless gamma is auto).
"""

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.settings import is_int
from spec_jax import autogamma, sharding, step_costs, tree_auto
from spec_jax.decode import PrefillInputs, layout, pad_prompts, stop_id_list
from spec_jax.drafting import Drafter, NoDrafter, as_drafter
from spec_jax.logprobs import MAX_LOGPROBS, TokenLogprobs
from spec_jax.metrics import NONFINITE, nonfinite_rows
from spec_jax.request import Request, encode_prompt, request_for, speculation_bound, stop_row, validate
from spec_jax.runner import Runner, decode_auto
from spec_jax.sampling import RowSampling, SamplingParams, row_keys
from spec_jax.speculative import SpecState, SpecStatic


@dataclasses.dataclass
class Generation:
    """tokens: the new tokens of each prompt (the stop token included when hit); stats: the
    metrics of spec_jax.metrics and timings."""

    tokens: list[list[int]]
    stats: dict[str, Any]
    text: list[str] | None = None  # each prompt's new text (special tokens skipped); None: no tokenizer
    # each prompt's new tokens' log-probabilities (generate's logprobs; None: not asked)
    logprobs: list[TokenLogprobs] | None = None

    @property
    def nonfinite_rows(self) -> list[int]:
        """The prompts whose target logits became non-finite (NaN or inf): each stopped there,
        its tokens are those before (spec_jax.metrics.NONFINITE)."""
        return nonfinite_rows(self.stats)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    """generate's (and run's) keyword arguments, as generate documents them."""

    draft: Any = None
    gamma: int | str = "auto"
    max_new_tokens: int = Request.max_tokens
    temperature: float | Sequence[float] = Request.temperature  # a sequence: one per prompt
    top_k: int | Sequence[int] = Request.top_k
    top_p: float | Sequence[float] = Request.top_p
    seed: int = Request.seed
    row_ids: Any = None
    eos_id: Any = "auto"
    mesh: jax.sharding.Mesh | None = None
    verify_widths: str = "auto"
    tree: int | str = 0
    logprobs: int | None = None


VERIFY_WIDTHS = ("auto", "ends", "all")


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
        bound, _, _ = speculation_bound(gamma, tree)
        if tree == "auto":
            return cls(bound, auto=True, trees=autogamma.TREE_SIZES)
        # A tree round's paths are at most its node count long; with a learned stop (an
        # acceptance head), gamma=auto's gamma is its fixed cap.
        return cls(bound, auto=not tree and gamma == "auto" and drafter.stop_rejection <= 0)


def spec_static(target, mesh, drafter: Drafter, policy: GammaPolicy, options, cache_len: int) -> SpecStatic:
    """The loop's static settings: the target's config for the mesh, the placed drafter, the
    policy's static gamma, options' max_new_tokens and verify_widths (resolve_verify_widths) and
    tree (its node slots only for a fixed gamma with a drafter; options: Options or any object
    with those fields), the cache length."""
    return SpecStatic(
        sharding.for_mesh(target.config, mesh),
        drafter,
        policy.gamma,
        options.max_new_tokens,
        cache_len,
        resolve_verify_widths(options.verify_widths, drafter),
        tree_nodes=options.tree if policy.gamma and not policy.auto else 0,
    )


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
    sampling: RowSampling  # each row's warp, the padding rows' included
    mesh: jax.sharding.Mesh
    num_rows: int  # the caller's prompts; rows past them pad the data axis
    prompts: list
    row_ids: np.ndarray
    width: int
    cache_len: int
    stop_ids: list[int]
    sources: tuple = ()  # the drafter's sources (the metrics' names), as given


def _plan(target, prompts, options: Options) -> Plan:
    """Validates the call and decides what runs (Plan; its controller: `measured`)."""
    drafter, draft_params = (None, None) if options.draft is None else as_drafter(options.draft, target)
    validate(target, prompts, drafter, options.gamma, options.max_new_tokens, options.eos_id, options.tree)
    if options.logprobs is not None and (
        not is_int(options.logprobs) or not 0 <= options.logprobs <= MAX_LOGPROBS
    ):
        raise ValueError(
            f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {options.logprobs!r}"
        )
    num_rows = len(prompts)
    row_ids = np.arange(num_rows) if options.row_ids is None else np.asarray(options.row_ids)
    if row_ids.shape != (num_rows,) or not np.issubdtype(row_ids.dtype, np.integer) or row_ids.min() < 0:
        raise ValueError(f"row_ids must be {num_rows} non-negative integers (one per prompt), got {row_ids}")
    policy = GammaPolicy.of(options.gamma, drafter, options.tree)
    sources = () if drafter is None else drafter.sources
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
    warps = row_warps(options, num_rows)
    sampling = RowSampling.of(warps + warps[:1] * padding)
    stop_ids = stop_id_list(options.eos_id, target.config.vocab_size)
    return Plan(
        drafter,
        draft_params,
        policy,
        None,
        sampling,
        mesh,
        num_rows,
        prompts,
        row_ids,
        width,
        cache_len,
        stop_ids,
        sources,
    )


def row_warps(options: Options, num_rows: int) -> list[SamplingParams]:
    """Each prompt's warp: options' temperature, top_k and top_p are each one value for every
    prompt or a sequence of one per prompt (greedy and sampled rows run in one loop). ValueError
    naming the argument and its allowed range."""

    def each(name):
        value = getattr(options, name)
        if not isinstance(value, list | tuple | np.ndarray):
            return [value] * num_rows
        if len(value) != num_rows:
            raise ValueError(
                f"{name} must be one value or {num_rows} values (one per prompt), got {len(value)}"
            )
        return list(value)

    values = zip(each("temperature"), each("top_k"), each("top_p"), strict=True)
    return [SamplingParams(float(t), k, float(p)) for t, k, p in values]


def controller_for(
    target,
    drafter: Drafter,
    draft_params,
    policy: GammaPolicy,
    batch: int,
    cache_slots: int,
    measure: bool = True,
):
    """gamma=auto's controller for an auto policy (tree_auto.TreeController where it weighs
    trees, else autogamma.Controller), from the costs cached for this batch and cache size
    (step_costs.cost_entry, once per machine, pair and size buckets): where none are, measured
    now (measure=True: the engine), or the prior at once, calibrated by the run's own rounds
    afterwards (measure=False: generate; Controller.save_rounds, from its cost_entry)."""
    sizes = step_costs.CostSizes(batch, cache_slots, tree_sizes=policy.trees)
    kind = tree_auto.TreeController if policy.trees else autogamma.Controller
    if measure:
        costs = step_costs.costs_for(target, drafter, draft_params, sizes)
        return kind(costs, policy.gamma, batch=batch, resumable=drafter.resumable)
    entry = step_costs.cost_entry(target, drafter, draft_params, sizes, measure_now=False)
    controller = kind(entry.costs, policy.gamma, batch=batch, resumable=drafter.resumable)
    controller.cost_entry = entry
    return controller


def measured(target, plan: Plan) -> Plan:
    """The plan with gamma=auto's controller (None unless the policy is auto), from the costs
    cached for its batch and cache size, or the prior where none are (controller_for with
    measure=False: nothing is measured before the run); a drafter that would not pay even
    with a good draft is dropped (plain decoding)."""
    if not plan.policy.auto:
        return plan
    n = len(plan.prompts)
    controllers, drafter, draft_params = bucket_controllers(
        target, plan.drafter, plan.draft_params, plan.policy, [n], plan.cache_len, False
    )
    return dataclasses.replace(plan, controller=controllers[n], drafter=drafter, draft_params=draft_params)


def bucket_controllers(target, drafter, draft_params, policy, batches, slots: int, measure: bool = True):
    """({batch: controller_for(..., batch, slots, measure)} for each of batches, drafter,
    draft_params): the drafter dropped (NoDrafter, None) where drafting would not pay at any of
    them even at a good draft's acceptance (controller phase "never"): it never runs."""
    found = {b: controller_for(target, drafter, draft_params, policy, b, slots, measure) for b in batches}
    if all(c.phase == "never" for c in found.values()):
        drafter, draft_params = NoDrafter(target.config.vocab_size), None
    return found, drafter, draft_params


def _place(target, plan: Plan, seed: int, max_new_tokens: int, logprobs: int | None = None):
    """(target params, draft params, PrefillInputs, active [B]) on the plan's mesh, and the
    drafter as it runs there: the models by the rule table (each drafter says how its params
    are placed), the inputs' rows over the data axis.

    The inputs have the engine's form (spec_jax.rows.group_inputs): each row's stop ids
    ([B, MAX_STOP_IDS] at least, -1 padded: stop_row) and budget (max_new_tokens), so that a call and
    the engine's requests of one bucket run the same programs (a --stream run after `make demo`
    finds its prefill in the compilation cache)."""
    mesh, batch = plan.mesh, len(plan.prompts)
    tokens, lens = pad_prompts(plan.prompts, plan.width)
    stops = np.tile(stop_row(plan.stop_ids), (batch, 1))
    inputs = PrefillInputs(
        tokens=jnp.asarray(tokens),
        prompt_lens=jnp.asarray(lens),
        stop_ids=jnp.asarray(stops),
        keys=row_keys(jax.random.key(seed), plan.row_ids),
        budgets=jnp.full(batch, max_new_tokens, jnp.int32),
        sampling=plan.sampling.for_rows(batch),
        num_logprobs=np.full(batch, -1 if logprobs is None else logprobs, np.int32),
    )
    inputs = sharding.put(inputs, sharding.state_shardings(inputs, mesh, batch))
    active = sharding.put(np.arange(batch) < plan.num_rows, sharding.batch_sharding(mesh, 1))
    target_params = sharding.placed_params(target, mesh)
    draft_params = sharding.put_once(plan.draft_params, plan.drafter.param_shardings(plan.draft_params, mesh))
    return target_params, draft_params, inputs, active, plan.drafter.for_mesh(mesh)


def run(target, prompts, **options) -> tuple[SpecState, dict]:
    """What generate does (the same arguments; prompts as token ids), returning the final loop
    state as device arrays (caches included, with their shardings; rows past len(prompts) pad
    the data axis) and the timings dict."""
    state, timings, _ = _run(target, prompts, Options(**options))
    return state, timings


def _run(target, prompts, options: Options) -> tuple[SpecState, dict, Plan]:
    """run's (state, timings), and the Plan it ran."""
    if options.eos_id == "auto":  # the model's stop tokens
        options = dataclasses.replace(options, eos_id=model_stop_ids(target))
    plan = measured(target, _plan(target, prompts, options))
    target_params, draft_params, inputs, active, drafter = _place(
        target, plan, options.seed, options.max_new_tokens, options.logprobs
    )
    static = spec_static(target, plan.mesh, drafter, plan.policy, options, plan.cache_len)
    runner = Runner(static, plan.mesh, target_params, draft_params, inputs)
    state, prefill_compile_s, prefill_s = runner.prefill(active)
    if plan.controller is None:
        state, loop_compile_s, decode_s, _ = runner.loop(state, np.iinfo(np.int32).max)
        timings = {}
    else:
        state, loop_compile_s, decode_s, timings = decode_auto(plan.controller, runner, state)
        plan.controller.save_rounds()  # the costs the next run plans with
    timings = dict(
        compile_seconds=prefill_compile_s + loop_compile_s,
        prefill_seconds=prefill_s,
        decode_seconds=decode_s,
        **timings,
    )
    return state, timings, plan


def model_stop_ids(target) -> list[int] | None:
    """The target tokenizer's stop tokens (eos, eot, the family's end tokens), or None without one."""
    tokenizer = getattr(target, "tokenizer", None)
    return None if tokenizer is None else list(tokenizer.stop_ids)


def one_or_many(prompts):
    """[prompts] where prompts is one prompt (a text, or a conversation: a list of message
    dicts); anything else (a list of prompts) as it is."""
    one = isinstance(prompts, str) or (
        isinstance(prompts, list | tuple) and prompts and isinstance(prompts[0], dict)
    )
    return [prompts] if one else prompts


def token_prompts(target, prompts) -> list:
    """generate's prompts as token-id lists: a text (or a list of them) by the target's
    tokenizer, a conversation ([{"role", "content"}, ...], or a list of them) through its chat
    template (spec_jax.request.encode_prompt), token-id lists as they are (validate checks
    them). RequestError naming the prompt where the model has no tokenizer (or no chat
    template) to read it."""
    prompts = one_or_many(prompts)
    if not isinstance(prompts, list | tuple):
        return prompts  # validate names it
    is_text = [
        isinstance(p, str) or (isinstance(p, list | tuple) and any(isinstance(m, dict) for m in p))
        for p in prompts
    ]
    return [
        encode_prompt(target, request_for(p)) if text else p for p, text in zip(prompts, is_text, strict=True)
    ]


def generate(target, prompts, **options) -> Generation:
    """Generates up to max_new_tokens after each prompt, speculatively when a draft is given.

    Args:
      target: a models.Model.
      prompts: a text, a conversation ([{"role": str, "content": str}, ...], rendered with the
        target's chat template: target.tokenizer.encode_chat), or a list of texts,
        conversations and token-id lists (ragged lengths are fine); texts need the target's
        tokenizer.
      draft: None (plain autoregressive decoding), a models.Model, or a (drafter, params) pair
        such as spec_jax.drafting.ngram.fit_bigram returns (see as_drafter).
      gamma: draft tokens per round (static: a new gamma compiles a new loop), or "auto"
        (the default; spec_jax.autogamma; with a draft head's acceptance head, the most it
        may draft, 8).
      max_new_tokens: new tokens per prompt at most (default 64).
      temperature, top_k, top_p: the warp, applied identically to target and draft; any
        positive temperature samples (0, the default, is greedy). Each is one value for every
        prompt, or a sequence of one value per prompt: each row is warped by its own settings
        (operands of the one compiled loop: a new value compiles nothing).
      seed, row_ids: row b draws its randomness from fold_in(key(seed), row_ids[b]) alone
        (row_ids default 0..B-1), so a prompt's sample does not depend on the other prompts of
        its batch: pass each prompt's index in a larger list to make batching invisible.
      eos_id: "auto" (the default: the target tokenizer's stop_ids, none without a tokenizer),
        None, one token id, or a sequence of them: a row stops after generating any of them.
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
      logprobs: None, or k in [0, 20]: Generation.logprobs holds each new token's
        log-probability under the target (raw: log_softmax of its logits before the warp, from
        the call that verified the token; spec_jax.logprobs) and the k most probable tokens'.

    Returns:
      Generation(tokens, stats, text, logprobs): text, each prompt's new text (special tokens
      skipped; None without a tokenizer); logprobs, each prompt's TokenLogprobs (None unless
      asked). stats holds the metrics schema of spec_jax.metrics, the
      timings compile_seconds, prefill_seconds, decode_seconds, tokens_per_second (new tokens
      over prefill + decode), and num_new_tokens; stats["nonfinite_logits"] flags, per prompt,
      a row that stopped early because the target's logits became NaN or infinite
      (Generation.nonfinite_rows lists them).
    """
    prompts = token_prompts(target, prompts)
    options = Options(**options)
    state, timings, plan = _run(target, prompts, options)
    return _generation(target, state, timings, plan, len(prompts), options.logprobs)


def _generation(
    target, state: SpecState, timings: dict, plan: Plan, num_rows: int, logprobs: int | None = None
) -> Generation:
    """generate's Generation of the final loop state for its first num_rows rows (the rest pad
    the data axis): the new tokens, the metrics, timings and rates, the text."""
    out, counts, nonfinite, metrics = sharding.fetch(
        (state.out.tokens, state.out.num_generated, state.out.nonfinite, state.metrics)
    )
    new_tokens = [out[i, : counts[i]].tolist() for i in range(num_rows)]
    total = int(counts[:num_rows].sum())
    stats = metrics.to_dict(plan.sources)
    stats.update(
        timings,
        num_new_tokens=total,
        tokens_per_second=total / (timings["prefill_seconds"] + timings["decode_seconds"]),
    )
    stats[NONFINITE] = nonfinite[:num_rows].tolist()
    kept = None
    if logprobs is not None:
        lp, ids, values = sharding.fetch((state.out.logprobs, state.out.top_ids, state.out.top_logprobs))
        kept = [
            TokenLogprobs.of(t, lp[i, : len(t)], ids[i, : len(t)], values[i, : len(t)], logprobs)
            for i, t in enumerate(new_tokens)
        ]
    return Generation(tokens=new_tokens, stats=stats, text=decoded(target, new_tokens), logprobs=kept)


def decoded(target, tokens: list[list[int]]) -> list[str] | None:
    """Each token list's text by the target's tokenizer (special tokens skipped), or None
    without one."""
    tokenizer = getattr(target, "tokenizer", None)
    return None if tokenizer is None else [tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
