"""What logprobs cost the decoding loop: CPU seconds per new token of spec_jax.generate on a random
model (plain decoding and a perturbed copy as the draft, gamma 3; greedy; 4 prompts), with
logprobs off (None) and on (0: the kept tokens' alone; 5: and the top 5, which computes the top
20), every variant interleaved in each repeat, after a warm-up (compilation) round.

The clock is this process's CPU time (all threads), less sensitive than wall time to other jobs
on a shared machine; prefill included (short prompts, 64 new tokens: the decode dominates). To
compare the no-logprobs path with a checkout from before logprobs existed, run it there with
--modes=none (in separate processes, alternating, a few times each).

    python scripts/logprobs_cost.py [--modes=none,0,5] [--vocab=151936] [--repeats=5]
"""

import argparse
import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from conftest import perturbed  # noqa: E402

import models  # noqa: E402
import spec_jax  # noqa: E402


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--modes", default="none,0,5", help="logprobs values: none or an integer, by commas")
    parser.add_argument(
        "--vocab", type=int, default=151936, help="the Qwen's by default: the head's share is real"
    )
    parser.add_argument("--d_model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    modes = args.modes.split(",")
    target = models.random_model(vocab_size=args.vocab, num_layers=args.layers, d_model=args.d_model, seed=0)
    draft = perturbed(target, 0.05, seed=7)
    prompts = [[1 + (7 * i + j) % 50 for j in range(8 + 3 * i)] for i in range(4)]
    times = {}
    for rep in range(args.repeats + 1):
        for name, d in (("plain", None), ("gamma3", draft)):
            for mode in modes:
                extra = {} if mode == "none" else {"logprobs": int(mode)}
                start = time.process_time()
                gen = spec_jax.generate(
                    target,
                    prompts,
                    draft=d,
                    gamma=3,
                    max_new_tokens=args.new,
                    temperature=0.0,
                    eos_id=None,
                    **extra,
                )
                seconds = time.process_time() - start
                if rep:  # the first round compiles
                    times.setdefault((name, mode), []).append(seconds / gen.stats["num_new_tokens"] * 1e3)
    for (name, mode), values in times.items():
        print(
            f"{name:7s} logprobs={mode:5s} CPU ms/token: min {min(values):.3f}  median {statistics.median(values):.3f}"
        )


if __name__ == "__main__":
    main()
