"""Benchmark: what a round costs beyond its model calls, with draft = target.

With draft = target every draft is accepted, so a round commits gamma + 1 tokens for gamma
draft steps plus one verification call. The model calls of a round (the drafter's T = 2 call
and gamma - 1 T = 1 calls, the target's T = gamma + 1 call) are timed alone with
spec_jax.timing.model_call (in one compiled program, so dispatch is not counted); what a
measured round costs beyond them is the loop's own bookkeeping (the rule, warps, commit).
"""

import statistics

import ml_collections

import spec_jax
from experiments import bench_loop, common, framework
from spec_jax import timing

TITLE = "Benchmark overhead: a round's bookkeeping beyond its model calls (draft = target)"

REPS = 32  # model-call sequences per timed program


MODEL_KEYS = bench_loop.MODEL_KEYS
DTYPE_KEYS = bench_loop.DTYPE_KEYS
INT_RANGES = {**bench_loop.INT_RANGES, "gamma": (1, 16)}


def get_config(quick: bool = False) -> ml_collections.ConfigDict:
    """The loop benchmark's settings and gamma."""
    config = bench_loop.get_config(quick)
    config.gamma = 2 if quick else 4
    return config


def run(config) -> framework.Result:
    model = common.load_model(config.model, config.dtype)
    prompts = bench_loop.synthetic_prompts(config.batch_size)
    n, gamma = config.max_new_tokens, config.gamma
    kwargs = dict(max_new_tokens=n, temperature=0.0)
    runs = timing.interleaved(
        {
            "ar": lambda _: spec_jax.generate(model, prompts, **kwargs),
            "spec": lambda _: spec_jax.generate(model, prompts, draft=model, gamma=gamma, **kwargs),
        },
        [None] * config.repeats,
        [None],
    )
    ar_runs = [g.stats for g in runs["ar"]["results"]]
    spec_runs = [g.stats for g in runs["spec"]["results"]]

    call = dict(batch=len(prompts), cache_slots=2 * (16 + n + gamma), repeat=REPS)
    round_calls = timing.model_call(model, widths=[2] + [1] * (gamma - 1) + [gamma + 1], **call)
    step_call = timing.model_call(model, widths=[1], **call)
    calls = timing.timed_interleaved({"round": round_calls, "step": step_call}, config.repeats)
    round_calls_s, ar_step_s = calls["round"]["median"] / REPS, calls["step"]["median"] / REPS

    def med(runs, key):
        return statistics.median(r[key] for r in runs)

    rounds = spec_runs[0]["target_calls"] - 1
    round_s = med(spec_runs, "decode_seconds") / rounds
    ar_token_s = med(ar_runs, "decode_seconds") / (ar_runs[0]["target_calls"] - 1)
    spec_token_s = med(spec_runs, "decode_seconds") / (spec_runs[0]["num_new_tokens"] - len(prompts))
    rows = [
        {
            "variant": "autoregressive",
            "ms_per_committed_token": 1e3 * ar_token_s,
            "ms_per_step_or_round": 1e3 * ar_token_s,
            "model_calls_ms": 1e3 * ar_step_s,
            "non_model_fraction": 1 - ar_step_s / ar_token_s,  # signed: negative = within noise
        },
        {
            "variant": f"speculative, draft = target, gamma {gamma}",
            "ms_per_committed_token": 1e3 * spec_token_s,
            "ms_per_step_or_round": 1e3 * round_s,
            "model_calls_ms": 1e3 * round_calls_s,
            "non_model_fraction": 1 - round_calls_s / round_s,
            "acceptance_rate": spec_runs[0]["acceptance_rate"],
            "mean_accepted_length": spec_runs[0]["mean_accepted_length"],
        },
    ]
    return framework.Result.from_dicts(rows)
