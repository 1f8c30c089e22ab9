"""Timing for benchmarks and experiments: warm-up first, then variants interleaved.

Used by `launch.bench` and the model-based experiments, so that every figure the project
reports is measured the same way: each variant runs untimed first (that run compiles), then
the variants are timed in turn, round-robin with the starting variant rotating, so load from
other work on a shared machine falls on all of them alike.
"""

import statistics
import time

import jax


def spread(values) -> dict:
    """{"median", "min", "max"} of a non-empty sequence of numbers."""
    values = list(values)
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def interleaved(fns: dict, inputs: list, warmup_inputs: list) -> dict:
    """Runs every variant on each warm-up input (compiles; not timed), then times the variants
    in turn on inputs[0], inputs[1], ... (round-robin, the starting variant rotating each
    repeat).

    fns: {name: fn(input) -> result}. Returns {name: {"warmup": [results], "results": [...],
    "seconds": [wall seconds per repeat]}}.
    """
    out = {name: {"warmup": [], "results": [], "seconds": []} for name in fns}
    for name, fn in fns.items():
        for x in warmup_inputs:
            out[name]["warmup"].append(jax.block_until_ready(fn(x)))
    names = list(fns)
    for i, x in enumerate(inputs):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            start = time.perf_counter()
            result = jax.block_until_ready(fns[name](x))
            out[name]["seconds"].append(time.perf_counter() - start)
            out[name]["results"].append(result)
    return out


def timed_interleaved(fns: dict, repeats: int) -> dict:
    """interleaved() for argument-free variants, one warm-up call each; returns
    {name: {"median", "min", "max" seconds, "repeats"}}."""
    runs = interleaved({n: (lambda _, f=f: f()) for n, f in fns.items()}, [None] * repeats, [None])
    return {name: {**spread(r["seconds"]), "repeats": repeats} for name, r in runs.items()}


def timed(fn, repeats: int) -> dict:
    """One function: a warm-up call, then `repeats` timed calls; median/min/max seconds."""
    return timed_interleaved({"fn": fn}, repeats)["fn"]
