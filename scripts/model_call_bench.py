"""Time a model's calls over a few positions each (a decode step, verification calls, prefill
chunks) and the prefill of prompts of given lengths, on this machine.

Model calls: spec_jax.timing.model_call, `--calls` calls of W positions per row in one
compiled program (a cache half full; logits at every position, as a verification call has
them), every width's program timed interleaved, the median per call printed in ms. Prefills:
spec_jax.generate with one new token, its prefill_seconds (the prompt read through the first
token), the median over the repeats, for prompts of synthetic tokens of each length.

To compare two versions of the code, run this in separate processes, alternating, a few times
each (the VMs these figures come from are noisy): docs/benchmarks.md has figures from it.
--variants times versions of the GGUF kernel's paths in one process, every (variant, width)
program interleaved, the same weights moved and the same bits out: "before" (the Q6_K matrices,
the lm head and half the down projections, in the file's own rows: the multi-row kernel Q6KRows,
or vec_dot for one row; the interleaved Q4_K kernel without prefetching, though with its loops
unrolled since 2026-12-07, which cannot be switched off), "q4k_prefetch" (the
same with the Q4_K kernel prefetching) and "after" (Q6_K in gguf_matmul.interleave_q6k's Q6Kx8
as well). --prompt_lens= (empty) skips the prefills.

    python scripts/model_call_bench.py [--widths=1,2,3,5,8,16,32] [--prompt_lens=8,16,32,40]
        [--model=qwen2.5-coder-1.5b] [--dtype=gguf_q8] [--repeats=7] [--variants=before,after]
"""

import argparse
import pathlib
import statistics
import sys
import time

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import models  # noqa: E402
import spec_jax  # noqa: E402
from models import convert, machine, precision  # noqa: E402
from models.kernels import gguf_matmul  # noqa: E402
from spec_jax import timing  # noqa: E402

# variant -> (the Q6_K matrices' layout, whether the Q4_K kernel prefetches)
VARIANTS = {"before": ("rows", False), "q4k_prefetch": ("rows", True), "after": ("interleaved", True)}


def ints(text: str, allow_empty: bool = False) -> list[int]:
    values = [int(v) for v in text.split(",") if v]
    if (not values and not allow_empty) or (values and min(values) < 1):
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def variants(text: str) -> list[str]:
    names = [v for v in text.split(",") if v]
    if any(n not in VARIANTS for n in names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"expected some of {', '.join(VARIANTS)} separated by commas, got {text!r}"
        )
    return names


def with_q6k_layout(model, layout: str):
    """model with each Q6_K matrix at 8-bit activations (rows a multiple of 8) in `layout`, moved
    bit for bit (gguf_matmul.interleave_q6k), on transparent huge pages as models.load puts them."""

    def move(w):
        if not isinstance(w, precision.BlockWeight) or w.ggml_type != gguf_matmul.Q6K or not w.quantize_x:
            return w
        host = np.asarray(w.data)
        rows = host.reshape(-1, host.shape[-1])
        if rows.shape[0] % 8 or w.interleaved == (layout == "interleaved"):
            return w
        data = gguf_matmul.interleave_q6k(rows, back=layout == "rows").reshape(host.shape)
        return w.replace(
            data=jax.device_put(convert.on_huge_pages(data)), interleaved=layout == "interleaved"
        )

    params = jax.tree.map(move, model.params, is_leaf=lambda x: isinstance(x, precision.BlockWeight))
    return model.replace(params=params)


def time_calls(chosen: dict, args) -> None:
    """Times every (variant, width) program interleaved (timing.timed_interleaved) and prints,
    per variant, the median wall ms of a call and the median process CPU ms (both threads' time:
    on a machine that other jobs share, what the call itself cost, less what it waited for), each
    with its ratio to the variant's first width. chosen: name -> (model, whether the Q4_K kernel
    prefetches, None: as it is)."""
    calls, slots = args.calls, 2 * max(128, args.calls * max(args.widths))
    cpu = {}

    def call(name, m, prefetch, w):
        run = timing.model_call(m, batch=1, widths=[w], cache_slots=slots, repeat=calls)
        cpu[(name, w)] = []

        def timed():
            if prefetch is not None:
                gguf_matmul.prefetch_q4k(prefetch)
            start = time.process_time()
            out = jax.block_until_ready(run())
            cpu[(name, w)].append(time.process_time() - start)
            return out

        return timed

    fns = {(n, w): call(n, m, prefetch, w) for n, (m, prefetch) in chosen.items() for w in args.widths}
    runs = timing.timed_interleaved(fns, args.repeats)
    if any(prefetch is not None for _, prefetch in chosen.values()):
        gguf_matmul.prefetch_q4k(True)
    print(
        f"{args.model} at {args.dtype}, {machine.cpu_model()}; medians of {args.repeats}, {calls} calls each"
    )
    for name in chosen:
        for clock, seconds in (
            ("wall", {w: runs[(name, w)]["median"] for w in args.widths}),
            ("CPU", {w: statistics.median(cpu[(name, w)][1:]) for w in args.widths}),  # [0]: warm-up
        ):
            ms = {w: 1e3 * s / calls for w, s in seconds.items()}
            label = f"model call{f' ({name})' if name else ''}, {clock} ms"
            print(f"{label}: " + " ".join(f"{w}:{ms[w]:.1f}" for w in args.widths), end="")
            first = ms[args.widths[0]]
            print("  (x width 1: " + " ".join(f"{w}:{ms[w] / first:.2f}" for w in args.widths) + ")")


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--widths", type=ints, default=[1, 2, 3, 5, 8, 16, 32], help="positions per model call"
    )
    parser.add_argument(
        "--prompt_lens",
        type=lambda t: ints(t, allow_empty=True),
        default=[8, 16, 32, 40],
        help="prompt lengths to prefill (empty: none)",
    )
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--dtype", default="gguf_q8")
    parser.add_argument("--calls", type=int, default=4, help="model calls per timed program")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--variants",
        type=variants,
        default=[],
        help=f"time these versions of the GGUF kernel's paths side by side ({', '.join(VARIANTS)}); "
        "default: the model as models.load gives it",
    )
    args = parser.parse_args()
    for name in ("calls", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.variants and not gguf_matmul.multirow():
        parser.error("--variants needs the GGUF kernel's multi-row build (AVX-512 VNNI), not found here")
    model = models.load(args.model, dtype=args.dtype, progress=False)
    chosen = {n: (with_q6k_layout(model, VARIANTS[n][0]), VARIANTS[n][1]) for n in args.variants}
    time_calls(chosen or {"": (model, None)}, args)
    prefills = []
    for n in args.prompt_lens:
        prompt = [1 + (7 * j) % 5000 for j in range(n)]
        spec_jax.generate(model, [prompt], max_new_tokens=1, temperature=0.0)  # compiles
        seconds = [
            spec_jax.generate(model, [prompt], max_new_tokens=1, temperature=0.0).stats["prefill_seconds"]
            for _ in range(args.repeats)
        ]
        prefills.append(f"{n}:{1e3 * statistics.median(seconds):.0f}")
    if prefills:
        print("prefill of a prompt of N tokens, ms: " + " ".join(prefills), flush=True)


if __name__ == "__main__":
    main()
