"""Timing for benchmarks and experiments: warm-up first, then variants interleaved.

Used by `launch.bench` and the model-based experiments, so that every figure the project
reports is measured the same way: each variant runs untimed first (that run compiles), then
the variants are timed in turn, round-robin with the starting variant rotating, so load from
other work on a shared machine falls on all of them alike.
"""

import concurrent.futures
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from models.transformer import forward, init_cache
from spec_jax.sampling import warp


def work_clock() -> float:
    """The clock gamma=auto times chunks with, in seconds: this process's CPU time on a CPU
    backend (the work of all its threads, not the time other jobs on a shared machine take from
    it, so that the choice does not follow their load), wall time on an accelerator (whose work
    the host does not see)."""
    return time.process_time() if jax.default_backend() == "cpu" else time.perf_counter()


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


def tree_bytes(tree) -> int:
    """Bytes of every array leaf of a pytree (host or device arrays; 0 for None)."""
    return sum(int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def model_call(model, *, batch: int, widths, cache_slots: int, sampling=None, repeat: int = 1, head=None):
    """A zero-argument function timing what the loops' model calls cost, nothing else.

    It runs, `repeat` times inside one compiled program (so per-call dispatch is not counted),
    the calls of `widths` in order: call i feeds widths[i] tokens per row at the next positions
    of a cache of cache_slots slots about half full (the cache is donated and carried from call
    to call), and warps the logits with `sampling` when given, as the loops do. Returns the
    logits of the last call, consumed so that nothing is dead code. The usual widths: [1] a
    decode step, [gamma + 1] a verify call, [2] + [1] * (gamma - 1) a model drafter's round.
    head: an output weight used instead of the model's own (a vocabulary-trimmed draft).
    Time the function with `timed` / `timed_interleaved` and divide by `repeat`; its attribute
    compile_seconds says what compiling it took. The program is model_calls(...) (its cost
    without running it: experiments/predicted_speed.py).
    """
    calls = model_calls(
        model.config,
        batch=batch,
        widths=widths,
        cache_slots=cache_slots,
        sampling=sampling,
        repeat=repeat,
        head=head,
    )
    return _runner(calls, model.params, lambda: init_cache(model.config, batch, cache_slots))


def _runner(calls, params, new_cache):
    """Compiles calls(params, cache) -> (cache, logits) with the cache donated; returns the
    zero-argument run() that carries the cache from call to call (run.compile_seconds)."""
    start_compile = time.perf_counter()
    executable = jax.jit(calls, donate_argnums=1).lower(params, new_cache()).compile()
    compile_seconds = time.perf_counter() - start_compile
    box = {"cache": new_cache()}

    def run():
        box["cache"], logits = executable(params, box["cache"])
        return logits

    run.compile_seconds = compile_seconds
    return run


def _repeated(one_call, *, batch: int, widths, cache_slots: int, out_width: int, sampling, repeat: int):
    """calls(params, cache) -> (cache, logits [B, out_width] of the last call): `repeat` times,
    each width in turn at the next positions from half the cache; one_call(params, cache,
    positions [B, width]) -> (logits [B, width or 1, out_width], cache)."""
    widths = tuple(int(w) for w in widths)
    start = cache_slots // 2
    if start + sum(widths) > cache_slots:
        raise ValueError(f"cache_slots={cache_slots} cannot hold half a cache plus {sum(widths)} new tokens")

    def calls(params, cache):
        def body(_, carry):
            cache, _ = carry
            position = start
            for width in widths:
                positions = jnp.broadcast_to(position + jnp.arange(width, dtype=jnp.int32), (batch, width))
                logits, cache = one_call(params, cache, positions)
                logits = logits if sampling is None else warp(logits, sampling)
                position += width
            return cache, logits[:, -1]

        logits0 = jnp.zeros((batch, out_width), jnp.float32)
        return jax.lax.fori_loop(0, repeat, body, (cache, logits0))

    return calls


def model_calls(config, *, batch: int, widths, cache_slots: int, sampling=None, repeat: int = 1, head=None):
    """The pure function model_call times: calls(params, cache) -> (cache, logits of the last
    call [B, V]) (see model_call for what it runs); jit it with the cache donated."""

    def one_call(params, cache, positions):
        out = forward(config, params, jnp.ones(positions.shape, jnp.int32), positions, cache, head=head)
        return out.logits, out.cache

    vocab = config.vocab_size if head is None else head.shape[0]
    return _repeated(
        one_call,
        batch=batch,
        widths=widths,
        cache_slots=cache_slots,
        out_width=vocab,
        sampling=sampling,
        repeat=repeat,
    )


def call_runner(timed, *, batch: int, widths, cache_slots: int, sampling=None, repeat: int = 1):
    """model_call for a call described as data (a drafter's spec_jax.drafting.TimedCall: its
    call, the arrays it reads, its cache and its logits' width): same contract. gamma=auto times
    a drafter's calls with it."""
    calls = _repeated(
        timed.call,
        batch=batch,
        widths=widths,
        cache_slots=cache_slots,
        out_width=timed.out_width,
        sampling=sampling,
        repeat=repeat,
    )
    return _runner(calls, timed.params, lambda: timed.new_cache(batch, cache_slots))


def head_call(drafter, params, *, batch: int, widths, cache_slots: int, sampling=None, repeat: int = 1):
    """call_runner of a drafter's own model call (Drafter.timed_call; a draft head's, fed
    widths[i] (feature, token) pairs per row: [1] a drafting step, [g + 1] the observe call of a
    round and its first draft). Same contract as model_call."""
    timed = drafter.timed_call(params)
    return call_runner(
        timed, batch=batch, widths=widths, cache_slots=cache_slots, sampling=sampling, repeat=repeat
    )


def measure_bandwidth(megabytes: int, repeats: int) -> list[dict]:
    """Memory bandwidth of the default device, two ways: a large array copy (read + write
    counted) and a large array sum (read only). A decode step mostly reads (its weights), so
    the read figure is the tighter ceiling for it; the copy is the classic STREAM-style measure.

    On a CPU backend NumPy does the work on one thread and on every core (it releases the GIL);
    on an accelerator jax does it on the device (x + 1, which a compiler cannot elide, and a
    sum). Returns one dict per method: method, kind ("copy" / "read"), array_mb, gb_per_s
    (median) with _min / _max.
    """
    if jax.default_backend() == "cpu":
        src = np.ones(megabytes * 2**20 // 8, np.float64)
        dst = np.zeros_like(src)  # written once, so no page faults inside the timed copies
        threads = os.cpu_count() or 1
        step = -(-src.size // threads)
        bounds = [(i, min(i + step, src.size)) for i in range(0, src.size, step)]
        pool = concurrent.futures.ThreadPoolExecutor(threads)
        methods = {  # name: (fn, bytes moved per call)
            "numpy copy, 1 thread": (lambda: np.copyto(dst, src), 2 * src.nbytes),
            f"numpy copy, {threads} threads": (
                lambda: list(pool.map(lambda b: np.copyto(dst[b[0] : b[1]], src[b[0] : b[1]]), bounds)),
                2 * src.nbytes,
            ),
            "numpy sum (read only), 1 thread": (src.sum, src.nbytes),
            f"numpy sum (read only), {threads} threads": (
                lambda: list(pool.map(lambda b: src[b[0] : b[1]].sum(), bounds)),
                src.nbytes,
            ),
        }
    else:
        pool = None
        x = jnp.zeros((megabytes * 2**20 // 4,), jnp.float32)
        copy, total = jax.jit(lambda a: a + 1.0), jax.jit(jnp.sum)
        methods = {
            "device copy (x + 1)": (lambda: copy(x), 2 * x.nbytes),
            "device sum (read only)": (lambda: total(x), x.nbytes),
        }
    runs = timed_interleaved({name: fn for name, (fn, _) in methods.items()}, repeats)
    if pool is not None:
        pool.shutdown()
    rows = []
    for name, t in runs.items():
        gb = methods[name][1] / 1e9
        rows.append(
            {
                "method": name,
                "kind": "read" if "sum" in name else "copy",
                "array_mb": megabytes,
                "gb_per_s": gb / t["median"],
                "gb_per_s_min": gb / t["max"],
                "gb_per_s_max": gb / t["min"],
            }
        )
    return rows
