"""What decides a run before anything is placed: the options of spec_jax.generate (Options), each
prompt's warp, the one gamma decision (GammaPolicy), the loop's static settings (spec_static),
the plan of a call (make_plan -> Plan) and gamma=auto's controllers per row bucket
(bucket_controllers). spec_jax.generate and the engine both plan here.
"""

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from models.settings import is_int
from spec_jax import autogamma, rows, sharding
from spec_jax.bounds import check_pairing, speculation_bound, validate
from spec_jax.decode import layout, stop_id_list
from spec_jax.drafting import AUTO_TREE_SIZES, Drafter, NoDrafter, as_drafter
from spec_jax.logprobs import MAX_LOGPROBS
from spec_jax.request import Request
from spec_jax.runner import Runner
from spec_jax.sampling import RowSampling, SamplingParams
from spec_jax.speculative import SpecStatic
from spec_jax.table import row_buckets


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


VERIFY_WIDTHS = ("auto", "ends", "all", "doubling")


def resolve_verify_widths(verify_widths: str, drafter: Drafter) -> str:
    """SpecStatic.verify_widths for generate's setting: "ends" (the target scores 1 or gamma + 1
    positions) or "all" (any width up to gamma + 1: the narrowest that covers the round's
    drafts; one compiled branch per width) or "doubling" (1, 2^k + 1 and gamma + 1). "auto" is
    "all" for a drafter whose learned stop makes short drafts common (a draft head with an
    acceptance head), else the drafter's auto_widths ("doubling" for one that copies text)."""
    if verify_widths not in VERIFY_WIDTHS:
        raise ValueError(f"verify_widths must be one of {', '.join(VERIFY_WIDTHS)}, got {verify_widths!r}")
    if verify_widths == "auto":
        return "all" if drafter.stop_rejection > 0 else drafter.auto_widths
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
        bound, _, _ = speculation_bound(gamma, tree, auto_gamma_max=drafter.auto_gamma_max)
        if tree == "auto":
            return cls(bound, auto=True, trees=AUTO_TREE_SIZES)
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


def make_plan(target, prompts, options: Options) -> Plan:
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
    """gamma=auto's controller for an auto policy (autogamma.TreeController where it weighs
    trees, else autogamma.Controller), from the costs cached for this batch and cache size
    (autogamma.cost_entry, once per machine, pair and size buckets): where none are, measured
    now (measure=True: the engine), or the prior at once, calibrated by the run's own rounds
    afterwards (measure=False: generate; Controller.save_rounds, from its cost_entry)."""
    sizes = autogamma.CostSizes(batch, cache_slots, drafter.auto_gamma_max, tree_sizes=policy.trees)
    kind = autogamma.TreeController if policy.trees else autogamma.Controller
    if measure:
        costs = autogamma.costs_for(target, drafter, draft_params, sizes)
        return kind(costs, policy.gamma, batch=batch, resumable=drafter.resumable)
    entry = autogamma.cost_entry(target, drafter, draft_params, sizes, measure_now=False)
    controller = kind(entry.costs, policy.gamma, batch=batch, resumable=drafter.resumable)
    controller.cost_entry = entry
    return controller


def measured(target, plan: Plan) -> Plan:
    """The plan with gamma=auto's controller (None unless the policy is auto), from the costs
    cached for its batch and cache size, or the prior where none are (controller_for with
    measure=False: nothing is measured before the run); a drafter whose model never pays gives
    way (bucket_controllers)."""
    if not plan.policy.auto:
        return plan
    n = len(plan.prompts)
    found = bucket_controllers(
        target, plan.drafter, plan.draft_params, plan.policy, [n], plan.cache_len, False
    )
    sources = plan.sources if found.drafter is plan.drafter else found.drafter.sources
    changed = dict(drafter=found.drafter, draft_params=found.draft_params, sources=sources)
    return dataclasses.replace(plan, controller=found.controllers[n], **changed)


class BucketControllers(NamedTuple):
    """What bucket_controllers returns: a controller per row bucket, and the drafter and its
    params that run (NoDrafter and None where drafting would never pay)."""

    controllers: dict
    drafter: Drafter
    draft_params: Any


def bucket_controllers(
    target, drafter, draft_params, policy, batches, slots: int, measure: bool = True
) -> BucketControllers:
    """{batch: controller_for(..., batch, slots, measure)} for each of batches. Where drafting
    would not pay at any of them even at a good draft's acceptance (phase "never"), what drafts
    without the model (Drafter.without_model: a hybrid's prompt lookup) takes its place with
    controllers of its own, or else plain decoding (NoDrafter, None)."""
    found = {b: controller_for(target, drafter, draft_params, policy, b, slots, measure) for b in batches}
    if all(c.phase == "never" for c in found.values()):
        if (free := drafter.without_model(draft_params)) is not None:
            return bucket_controllers(target, *free, policy, batches, slots, measure)
        drafter, draft_params = NoDrafter(target.config.vocab_size), None
    return BucketControllers(found, drafter, draft_params)


@dataclasses.dataclass
class EnginePlan:
    """What an Engine runs: its compiled programs on their placed arguments (runner), gamma=auto's
    controller per row bucket ({} without), the row buckets, and a slot's tokens (max_context)
    and a request's most new tokens."""

    runner: Runner
    controllers: dict
    buckets: tuple[int, ...]
    max_context: int
    max_new_tokens: int


def plan_engine(target, draft, mesh, settings: dict) -> EnginePlan:
    """The Engine's plan (its arguments as spec_jax.engine.Engine documents them, settings:
    max_batch, gamma, tree, max_context, max_new_tokens, verify_widths, measure_costs): the
    drafter and its gamma policy, the slot's context, gamma=auto's controllers per row bucket
    (from measured, cached or predicted costs; a drafter that would never pay is dropped), the
    placed models and the loop's static settings."""
    drafter, draft_params = (None, None) if draft is None else as_drafter(draft, target)
    policy = GammaPolicy.of(settings["gamma"], drafter, settings["tree"])
    vocab = target.config.vocab_size
    if drafter is not None:
        check_pairing(vocab, drafter)
    buckets = row_buckets(settings["max_batch"], mesh.shape[sharding.DATA])
    max_context = rows.slot_context(target, drafter, policy.gamma, settings["max_context"])
    max_new_tokens = rows.new_token_bound(settings["max_new_tokens"], max_context)
    drafter = NoDrafter(vocab) if drafter is None else drafter
    cache_len = max_context + policy.gamma
    controllers = {}
    if policy.auto:
        slots = min(cache_len, autogamma.COST_SLOTS)  # full slots: 14-18 GB for the Qwen pair
        found = bucket_controllers(
            target, drafter, draft_params, policy, buckets, slots, settings["measure_costs"]
        )
        controllers, drafter, draft_params = found  # the drafter dropped where it never pays
    target_params = sharding.placed_params(target, mesh)
    draft_params = sharding.put_once(draft_params, drafter.param_shardings(draft_params, mesh))
    drafter = drafter.for_mesh(mesh)
    options = Options(
        max_new_tokens=max_new_tokens, verify_widths=settings["verify_widths"], tree=settings["tree"]
    )
    static = spec_static(target, mesh, drafter, policy, options, cache_len)
    runner = Runner(static, mesh, target_params, draft_params, None)
    return EnginePlan(runner, controllers, buckets, max_context, max_new_tokens)
