"""Time a decode step with the weights on transparent huge pages against the same weights where
they were before, side by side in one process.

The model loads twice: as models.load places it on a CPU backend (each weight of 2 MB or more
copied onto memory advised for transparent huge pages, models.convert.on_huge_pages, and used
there in place), and with that copy left out (each weight where the loader had it: the
converted GGUF's memory map, or malloc's memory for the Q4_K weights it interleaves; 4 KB
pages). Both run the same compiled decode step (spec_jax.timing.model_call: `steps` model
calls of one token in one program), interleaved; the medians and minimums are printed per
model call, with how much of each copy's weights the kernel put on huge pages
(/proc/self/smaps).

    python scripts/huge_pages_bench.py [--model=qwen2.5-coder-1.5b] [--dtype=gguf_q8] [--repeats=30]
"""

import argparse
import pathlib
import sys

import jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import models  # noqa: E402
from models import convert  # noqa: E402
from spec_jax import timing  # noqa: E402


def huge_page_bytes(params) -> tuple[int, int]:
    """(bytes of params' leaves on anonymous huge pages, all their bytes): per mapping, the
    smaller of its leaves' bytes and its huge pages' bytes."""
    mappings, current = [], None
    for line in pathlib.Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and ":" not in head:
            current = [int(v, 16) for v in head.split("-")] + [0]
            mappings.append(current)
        elif head == "AnonHugePages:" and current is not None:
            current[2] = int(line.split()[1]) * 1024
    held = {}
    for leaf in jax.tree.leaves(params):
        address = leaf.unsafe_buffer_pointer()
        for i, (start, end, _) in enumerate(mappings):
            if start <= address < end:
                held[i] = held.get(i, 0) + leaf.nbytes
    total = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
    return sum(min(size, mappings[i][2]) for i, size in held.items()), total


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--dtype", default="gguf_q8")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--steps", type=int, default=8, help="model calls per timed program")
    args = parser.parse_args()
    if jax.default_backend() != "cpu":
        parser.error(
            "huge pages are placed for a CPU backend's weights; this backend is " + jax.default_backend()
        )
    copies = {"huge pages (models.load)": models.load(args.model, args.dtype, progress=False)}
    with_huge_pages, convert.on_huge_pages = convert.on_huge_pages, lambda a: a
    try:
        copies["without (where the loader had them)"] = models.load(args.model, args.dtype, progress=False)
    finally:
        convert.on_huge_pages = with_huge_pages
    runs = {
        name: timing.model_call(m, batch=1, widths=[1], cache_slots=128, repeat=args.steps)
        for name, m in copies.items()
    }
    times = timing.timed_interleaved(
        {name: (lambda r=r: r().block_until_ready()) for name, r in runs.items()}, args.repeats
    )
    print(f"{args.model} at {args.dtype}: ms per decode step, {args.repeats} repeats of {args.steps} steps")
    for name, m in copies.items():
        huge, total = huge_page_bytes(m.params)
        t = times[name]
        print(
            f"{name}: median {t['median'] / args.steps * 1e3:.2f}, min {t['min'] / args.steps * 1e3:.2f}"
            f" ({huge / 2**20:.0f} of {total / 2**20:.0f} MB of weights on huge pages)"
        )


if __name__ == "__main__":
    main()
