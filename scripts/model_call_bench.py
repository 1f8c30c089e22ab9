"""Time a model's calls over a few positions each (a decode step, verification calls, prefill
chunks) and the prefill of prompts of given lengths, on this machine.

Model calls: spec_jax.timing.model_call, `--calls` calls of W positions per row in one
compiled program (a cache half full; logits at every position, as a verification call has
them), every width's program timed interleaved, the median per call printed in ms. Prefills:
spec_jax.generate with one new token, its prefill_seconds (the prompt read through the first
token), the median over the repeats, for prompts of synthetic tokens of each length.

To compare two versions of the code, run this in separate processes, alternating, a few times
each (the VMs these figures come from are noisy): docs/benchmarks.md has figures from it.

    python scripts/model_call_bench.py [--widths=1,2,3,5,8,16,32] [--prompt_lens=8,16,32,40]
        [--model=qwen2.5-coder-1.5b] [--dtype=gguf_q8] [--repeats=7]
"""

import argparse
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import models  # noqa: E402
import spec_jax  # noqa: E402
from models import machine  # noqa: E402
from spec_jax import timing  # noqa: E402


def ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--widths", type=ints, default=[1, 2, 3, 5, 8, 16, 32], help="positions per model call"
    )
    parser.add_argument("--prompt_lens", type=ints, default=[8, 16, 32, 40], help="prompt lengths to prefill")
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--dtype", default="gguf_q8")
    parser.add_argument("--calls", type=int, default=4, help="model calls per timed program")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    for name in ("calls", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    model = models.load(args.model, dtype=args.dtype, progress=False)
    calls = args.calls
    slots = 2 * max(128, calls * max(args.widths))
    fns = {
        w: timing.model_call(model, batch=1, widths=[w], cache_slots=slots, repeat=calls) for w in args.widths
    }
    runs = timing.timed_interleaved(fns, args.repeats)
    print(f"{args.model} at {args.dtype}, {machine.cpu_model()}; medians of {args.repeats}")
    print("model call, ms: " + " ".join(f"{w}:{1e3 * runs[w]['median'] / calls:.1f}" for w in args.widths))
    prefills = []
    for n in args.prompt_lens:
        prompt = [1 + (7 * j) % 5000 for j in range(n)]
        spec_jax.generate(model, [prompt], max_new_tokens=1, temperature=0.0)  # compiles
        seconds = [
            spec_jax.generate(model, [prompt], max_new_tokens=1, temperature=0.0).stats["prefill_seconds"]
            for _ in range(args.repeats)
        ]
        prefills.append(f"{n}:{1e3 * statistics.median(seconds):.0f}")
    print("prefill of a prompt of N tokens, ms: " + " ".join(prefills), flush=True)


if __name__ == "__main__":
    main()
