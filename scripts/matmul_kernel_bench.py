"""Time the CPU matmul kernel's builds side by side: y[M, N] = x[M, K] . w[N, K]^T.

Each build (models/kernels/cpu_matmul.cc compiled for AVX2 + FMA, or for AVX-512) registers its
own ffi targets, so both run in this one process on the same arrays. For every shape, weight
dtype and row count M, the builds are timed interleaved (spec_jax.timing.timed_interleaved:
one warm-up call each, then round-robin with the starting build rotating) and the medians
reported, with each build's cost in its own calls of the first --rows value (1: a decode
row). Every call reads a different copy of the weight, cycling over --rotate_mb of copies,
so that the weight comes from memory as in a model's step, not from the last-level cache. Shapes are the Qwen2.5-Coder-1.5B matrices
(N x K: w_down, w_gate / w_up, the head). Run it alone: the machine's other load shows in the
figures (read the ratios).

With --model, whole model calls instead (spec_jax.timing.model_call, batch 1, a cache of
--context slots, as the roofline experiment times them): the model's call over each of --widths
positions (1: a decode step, gamma + 1: a verification call) compiled once per build (the
config's cpu_isa), all timed interleaved in this one process.

    python scripts/matmul_kernel_bench.py [--rows=1,2,5,9,20] [--dtypes=int8,bfloat16,float32]
        [--shapes=1536x8960,8960x1536,151936x1536] [--isas=avx2,avx512] [--repeats=15]
    python scripts/matmul_kernel_bench.py --model=qwen2.5-coder-1.5b [--dtypes=int8] [--widths=1,5,9]
"""

import argparse
import itertools
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import models  # noqa: E402
from models import machine, precision  # noqa: E402
from models.kernels import cpu_matmul  # noqa: E402
from spec_jax import timing  # noqa: E402
from spec_jax.sampling import SamplingParams  # noqa: E402


def weights(n: int, k: int, dtype: str, copies: int, rng):
    """`copies` random [n, k] weights of dtype: (value, scale or None) each."""
    out = []
    for _ in range(copies):
        w = rng.standard_normal((n, k), dtype=np.float32)
        if dtype == "int8":
            q = precision.quantize_int8(w, 1)
            out.append((jnp.asarray(q.value), jnp.asarray(q.scale)))
        else:
            out.append((jnp.asarray(w, dtype), None))
    return out


def rotating(isa: str, x, ws):
    """A zero-argument call of the isa build on x and the next weight of ws."""
    call = jax.jit(lambda x, w, s: cpu_matmul.matmul(x, w, s, isa))
    turn = itertools.count()
    return lambda: call(x, *ws[next(turn) % len(ws)])


def model_table(args, isas):
    """Model calls of args.model per build and width, timed interleaved; prints a table."""
    widths = [int(w) for w in args.widths.split(",")]
    print(
        "| model | weights | T | "
        + " | ".join(f"{i} ms (x T={widths[0]})" for i in isas)
        + f" | {isas[0]} / {isas[-1]} |"
    )
    print("|---|---|---|" + "---|" * len(isas) + "---|")
    for dtype in args.dtypes.split(","):
        model = models.load(args.model, dtype=dtype, progress=False)
        fns = {}
        for isa in isas:  # the build is the config's: one compiled program per build
            built = model.replace(config=model.config.replace(matmul_impl="cpu_kernel", cpu_isa=isa))
            for w in widths:
                sampling = SamplingParams(0.0) if w == 1 else None  # a decode step warps, as the loop does
                fns[f"{isa} {w}"] = timing.model_call(
                    built, batch=1, widths=[w], cache_slots=args.context, sampling=sampling
                )
        times = timing.timed_interleaved(fns, args.repeats)
        ms = {key: t["median"] * 1e3 for key, t in times.items()}
        for w in widths:
            cells = " | ".join(
                f"{ms[f'{i} {w}']:.1f} ({ms[f'{i} {w}'] / ms[f'{i} {widths[0]}']:.2f})" for i in isas
            )
            ratio = ms[f"{isas[0]} {w}"] / ms[f"{isas[-1]} {w}"]
            print(f"| {args.model} | {dtype} | {w} | {cells} | {ratio:.2f} |", flush=True)
        del model, fns


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="1,2,5,9,20", help="comma-separated M values")
    parser.add_argument("--dtypes", default="int8,bfloat16,float32")
    parser.add_argument("--shapes", default="1536x8960,8960x1536,151936x1536", help="N x K, comma-separated")
    parser.add_argument("--isas", default=",".join(cpu_matmul.ISAS), help="the builds to compare")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rotate_mb", type=int, default=768, help="weight copies cycled per shape (MB)")
    parser.add_argument("--model", help="time this model's calls instead of single products")
    parser.add_argument("--widths", default="1,5,9", help="--model: positions per call, comma-separated")
    parser.add_argument("--context", type=int, default=128, help="--model: KV-cache slots")
    args = parser.parse_args()
    isas = args.isas.split(",")
    for isa in isas:
        if isa not in cpu_matmul.ISAS:
            parser.error(f"--isas: {isa!r} is not one of {', '.join(cpu_matmul.ISAS)}")
        if not cpu_matmul.available(isa):
            parser.error(f"the {isa} build is unavailable here: {cpu_matmul.cpu_supported(isa)}")
    print(
        f"{machine.cpu_model()}, {jax.local_device_count()} device(s), jax {jax.__version__}; median ms of {args.repeats}"
    )
    print()
    if args.model:
        model_table(args, isas)
        return
    rows = [int(r) for r in args.rows.split(",")]
    shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")]
    rng = np.random.default_rng(0)
    print(
        f"{machine.cpu_model()}, {jax.local_device_count()} device(s), jax {jax.__version__}; median ms of {args.repeats}"
    )
    print()
    print(
        "| N x K | weights | M | "
        + " | ".join(f"{i} ms (x M={rows[0]})" for i in isas)
        + f" | {isas[0]} / {isas[-1]} |"
    )
    print("|---|---|---|" + "---|" * len(isas) + "---|")
    for (n, k), dtype in itertools.product(shapes, args.dtypes.split(",")):
        size = n * k * jnp.dtype(dtype).itemsize
        copies = max(1, min(64, args.rotate_mb * 2**20 // size))
        ws = weights(n, k, dtype, copies, rng)
        one_row = {}
        for m in rows:
            x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
            fns = {isa: rotating(isa, x, ws) for isa in isas}
            times = timing.timed_interleaved(fns, args.repeats)
            ms = {isa: times[isa]["median"] * 1e3 for isa in isas}
            if m == rows[0]:
                one_row = dict(ms)
            cells = " | ".join(f"{ms[i]:.2f} ({ms[i] / one_row[i]:.2f})" for i in isas)
            ratio = ms[isas[0]] / ms[isas[-1]]
            print(f"| {n} x {k} | {dtype} | {m} | {cells} | {ratio:.2f} |", flush=True)
        del ws


if __name__ == "__main__":
    main()
