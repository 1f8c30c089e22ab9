"""Warm load time per real model and peak RSS of loading the Qwen pair, float32 and bfloat16.

Run once per dtype in a fresh process (peak RSS is per process):
  python scripts/load_report.py --dtype=float32
"""

import argparse
import resource
import time

import models


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    loaded = []
    for name in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"):
        start = time.perf_counter()
        loaded.append(models.load(name, dtype=args.dtype, progress=False))
        print(f"{name} {args.dtype}: warm load {time.perf_counter() - start:.1f} s")
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"peak RSS with both loaded ({args.dtype}): {peak_gb:.2f} GB")


if __name__ == "__main__":
    main()
