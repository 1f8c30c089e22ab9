"""Load time per real model (cold: download + verify + convert + load; warm: from the cache)
and the peak RSS of holding the Qwen pair, in float32 or bfloat16.

Run once per dtype in a fresh process (peak RSS is per process):
  python scripts/load_report.py --dtype=float32
  python scripts/load_report.py --dtype=bfloat16
  python scripts/load_report.py --cold     # into a new temporary cache (downloads 1.6 GB), then removed
"""

import argparse
import os
import resource
import shutil
import tempfile
import time

import models


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--cold", action="store_true", help="time loads into an empty temporary cache")
    args = parser.parse_args()
    cache = None
    if args.cold:
        cache = tempfile.mkdtemp(prefix="spec_jax_cold_")
        os.environ["SPEC_JAX_CACHE"] = cache  # read by models.registry at call time

    try:
        loaded = []
        for name in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"):
            start = time.perf_counter()
            loaded.append(models.load(name, dtype=args.dtype, progress=False))
            kind = "cold" if args.cold else "warm"
            print(f"{name} {args.dtype}: {kind} load {time.perf_counter() - start:.1f} s", flush=True)
        peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        print(f"peak RSS with both loaded ({args.dtype}): {peak_gb:.2f} GB")
    finally:
        if cache:
            shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
