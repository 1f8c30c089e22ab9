"""Benchmark: a speculative round, part by part, against the same model calls timed alone.

For each gamma (and gamma 0, plain decoding, with `plain`): the loop the main job compiles
(spec_loop with the draft model, greedy, no stop token) runs `rounds` rounds from a prefilled
prompt of `prompt_tokens` tokens, timed per round and profiled part by part (ROUND_PARTS, from
bench_profile's per-thunk profile of XLA's CPU runtime). The round's model calls are then
timed alone, each in a program of its own that runs them `rounds` times and nothing else:
  target   one call over gamma + 1 positions, logits at each (spec_jax.timing.model_calls, the
           verify call; scripts/model_call_bench.py times the same program);
  draft    the drafter's calls of a round: one over 2 positions (the draft's catch-up on the
           last two committed tokens, logits at the last), then gamma - 1 over 1 position;
and profiled the same way. The table sets each part of a round beside the same part alone, and
the round's wall time beside the sum of its calls' wall times alone (issue 53: within 5%).
"""

import functools
import statistics
import time

import jax
import jax.numpy as jnp
import ml_collections

from experiments import bench_profile, common, framework
from models.transformer import forward, init_cache
from spec_jax import timing
from spec_jax.decode import PrefillInputs, layout, pad_prompts
from spec_jax.drafting import NoDrafter
from spec_jax.drafting.model import ModelDrafter
from spec_jax.sampling import row_keys
from spec_jax.speculative import SpecStatic, spec_loop, spec_prefill

TITLE = "Benchmark overhead: a speculative round, part by part, against its model calls alone"

ROUND_PARTS = (
    "target call: products, attention, norms",
    "target call: KV cache writes",
    "target call: lm head",
    "draft calls: products, attention, norms",
    "draft calls: KV cache writes",
    "draft calls: lm head",
    "draft: warp, draw and confidence",
    "target warp and the rule",
    "logprobs",
    "copies XLA inserted",
    "commit, metrics, loop control",
    "thunk dispatch (XLA's executor between thunks)",
    "host (dispatch, arguments, waiting for the result)",
)
MODEL_KINDS = bench_profile.KINDS[:9]  # the kinds of work inside a model call

MODEL_KEYS = ("target", "draft")
DTYPE_KEYS = ("dtype",)
INT_RANGES = {"prompt_tokens": (2, 1 << 12), "rounds": (1, 256), "repeats": (1, 1000)}
TUPLE_RANGES = {"gammas": (int, 1, 16)}


def get_config(quick: bool = False) -> ml_collections.ConfigDict:
    """The Qwen pair at the defaults' precision, gamma 1-4 and plain; tiny models when quick."""
    config = ml_collections.ConfigDict()
    config.target = "tiny" if quick else "qwen2.5-coder-1.5b"
    config.draft = "tiny-draft" if quick else "qwen2.5-coder-0.5b"
    config.dtype = "float32" if quick else "gguf_q8"  # both models' (models.precision.PRECISIONS)
    config.gammas = (2,) if quick else (1, 2, 3, 4)
    config.plain = True  # also gamma 0: plain decoding against one call over 1 position
    config.prompt_tokens = 16 if quick else 64
    config.rounds = 2 if quick else 8  # rounds per timed run
    config.repeats = 1 if quick else 5
    return config


def part_of(instr: dict, model: str = "target") -> str:
    """The ROUND_PARTS entry of one HLO instruction (bench_profile.instructions()): a model
    call's work is the draft's where the drafter made the call (or `model` is "draft": a
    program of draft calls alone)."""
    kind = bench_profile.kind_of(instr)
    files = {f for f, _ in instr["stack"]}
    draft = model == "draft" or any("spec_jax/drafting/" in f for f in files)
    if instr["op"] == "copy":
        return ROUND_PARTS[9]
    if kind in MODEL_KINDS:
        part = {bench_profile.KINDS[3]: 1, bench_profile.KINDS[8]: 2}.get(kind, 0)
        return ROUND_PARTS[part + (3 if draft else 0)]
    if draft:
        return ROUND_PARTS[6]
    if kind == bench_profile.KINDS[9]:
        return ROUND_PARTS[7]
    if any(f.endswith("spec_jax/logprobs.py") for f in files):
        return ROUND_PARTS[8]
    return ROUND_PARTS[10]


def draft_calls(config, gamma: int, cache_slots: int, rounds: int):
    """calls(params, cache) -> (cache, logits [1, gamma, V]): a drafter's round of calls `rounds`
    times (one over 2 positions with the logits of the last, gamma - 1 over 1), from half the
    cache; every call's logits are kept (the loop reads each: a call whose logits nothing read
    would lose its output head to dead-code elimination)."""
    start = cache_slots // 2

    def calls(params, cache):
        def body(_, carry):
            cache, _ = carry
            positions = start + jnp.arange(2, dtype=jnp.int32)[None, :]
            tokens, logits_at = jnp.ones((1, 2), jnp.int32), jnp.ones((1, 1), jnp.int32)
            out = forward(config, params, tokens, positions, cache, logits_at)
            logits, cache = [out.logits[:, -1]], out.cache
            for i in range(gamma - 1):
                position = jnp.full((1, 1), start + 2 + i, jnp.int32)
                out = forward(config, params, jnp.ones((1, 1), jnp.int32), position, cache)
                logits, cache = logits + [out.logits[:, -1]], out.cache
            return cache, jnp.stack(logits, axis=1)

        logits0 = jnp.zeros((1, gamma, config.vocab_size), jnp.float32)
        return jax.lax.fori_loop(0, rounds, body, (cache, logits0))

    return calls


def alone_row(name: str, model, calls, cache_slots: int, config, who: str) -> dict:
    """The profile row (ms per round) of a program of model calls alone."""
    params = model.params
    compiled = (
        jax.jit(calls, donate_argnums=1).lower(params, init_cache(model.config, 1, cache_slots)).compile()
    )
    box = {}

    def run():
        cache, logits = compiled(params, box.pop("cache"))
        return logits

    def fresh():
        box["cache"] = init_cache(model.config, 1, cache_slots)

    return bench_profile.profile_program(
        name,
        compiled,
        run,
        config.repeats,
        config.rounds,
        fresh,
        functools.partial(part_of, model=who),
        ROUND_PARTS,
    )


def loop_row(target, draft, gamma: int, config) -> tuple[dict, dict]:
    """(the profile row of `rounds` rounds of the loop, ms per round; its metrics)."""
    prompt = [1 + (7 * j) % 50 for j in range(config.prompt_tokens)]
    n = config.rounds * (gamma + 1) + 2  # no row finishes within the rounds
    width, cache_len = layout(target.config, [prompt], n, gamma)
    drafter = ModelDrafter(draft.config) if gamma else NoDrafter(target.config.vocab_size)
    static = SpecStatic(target.config, drafter, gamma, n, cache_len)
    tokens, lens = pad_prompts([prompt], width)
    stop_ids = jnp.asarray([-1], jnp.int32)
    inputs = PrefillInputs(
        jnp.asarray(tokens), jnp.asarray(lens), stop_ids, row_keys(jax.random.key(0), jnp.arange(1))
    )
    params, draft_params = target.params, (draft.params if gamma else None)
    prefill = jax.jit(functools.partial(spec_prefill, static)).lower(params, draft_params, inputs).compile()
    state = prefill(params, draft_params, inputs)
    rounds = jnp.asarray(config.rounds, jnp.int32)
    args = (params, draft_params, state, stop_ids, rounds)
    loop = jax.jit(functools.partial(spec_loop, static), donate_argnums=(2,)).lower(*args).compile()
    box = {}

    def run():
        box["after"] = loop(params, draft_params, box.pop("state"), stop_ids, rounds)
        return box["after"].length

    def fresh():
        box["state"] = jax.block_until_ready(prefill(params, draft_params, inputs))

    name = f"round, gamma {gamma}" if gamma else "plain step"
    row = bench_profile.profile_program(
        name, loop, run, config.repeats, config.rounds, fresh, part_of, ROUND_PARTS
    )
    metrics = box["after"].metrics
    return row, {
        "accepted_per_round": float(metrics.num_accepted_tokens) / max(int(metrics.target_calls) - 1, 1)
    }


def one_gamma(target, draft, gamma: int, config) -> tuple[list[dict], dict]:
    """(the part-by-part rows of one gamma, its summary row)."""
    loop, metrics = loop_row(target, draft, gamma, config)
    slots = 2 * config.prompt_tokens
    verify = timing.model_calls(
        target.config, batch=1, widths=[gamma + 1], cache_slots=slots, repeat=config.rounds
    )
    alone = [alone_row(f"target call over {gamma + 1}", target, verify, slots, config, "target")]
    if gamma:
        calls = draft_calls(draft.config, gamma, slots, config.rounds)
        alone.append(alone_row(f"draft calls 2 + {gamma - 1} x 1", draft, calls, slots, config, "draft"))
    rows = []
    for part in (*ROUND_PARTS, "remainder_ms", "wall_ms", "cpu_ms"):
        in_loop, by_itself = loop[part], sum(a[part] for a in alone)
        rows.append(
            {
                "gamma": gamma,
                "part": {
                    "remainder_ms": "remainder (profiler's own cost)",
                    "wall_ms": "wall",
                    "cpu_ms": "CPU time",
                }.get(part, part),
                "in the loop (ms a round)": in_loop,
                "alone (ms a round)": by_itself,
                "loop - alone (ms)": in_loop - by_itself,
            }
        )
    summary = {"gamma": gamma}
    for clock in ("wall", "cpu"):
        summary[f"round ({clock} ms)"] = loop[f"{clock}_ms"]
        summary[f"target call alone ({clock} ms)"] = alone[0][f"{clock}_ms"]
        summary[f"draft calls alone ({clock} ms)"] = alone[1][f"{clock}_ms"] if gamma else 0.0
        summary[f"round / its calls alone ({clock})"] = loop[f"{clock}_ms"] / sum(
            a[f"{clock}_ms"] for a in alone
        )
    summary["accepted drafts a round"] = metrics["accepted_per_round"]
    return rows, summary


def run(config) -> framework.Result:
    target = common.load_model(config.target, config.dtype)
    draft = common.load_model(config.draft, config.dtype)
    start = time.perf_counter()
    rows, summaries = [], []
    for gamma in ((0,) if config.plain else ()) + tuple(config.gammas):
        part_rows, summary = one_gamma(target, draft, gamma, config)
        print(summary, flush=True)
        rows += part_rows
        summaries.append(summary)
    note = (
        f"A round of the loop (spec_loop, greedy, batch 1, after a {config.prompt_tokens}-token prompt): "
        f"{config.rounds} rounds per timed run; each part's ms a round is the median of "
        f"{config.repeats} profiled runs (thunk self times); the walls are unprofiled runs. "
        f"Alone: the round's calls in programs of their own. {time.perf_counter() - start:.0f} s."
    )
    return framework.Result.from_dicts(
        summaries,
        markdown=note,
        sections={"each part of a round, in the loop and alone": rows},
        summary={"ratio_median": statistics.median(s["round / its calls alone (cpu)"] for s in summaries)},
    )
