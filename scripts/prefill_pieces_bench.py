"""Seconds to a long prompt's first token where it is read into the engine's prefix cache in
pieces of N tokens first (spec_jax.prefiller.Prefiller.read_piece, what the engine does while
rows decode, here without their chunks), against the same prompt prefilled in one call (an
Engine with no rows running admits it whole).

Each piece size reads a new prompt of synthetic token ids (so no piece finds the last one's
blocks), the sizes round-robin over --repeats; the first round compiles and is not counted. The
medians are printed with the load average before and after.

    python scripts/prefill_pieces_bench.py [--model=qwen2.5-coder-1.5b] [--dtype=gguf_q8]
        [--tokens=2000] [--pieces=64,128,256,whole] [--repeats=2]
"""

import argparse
import os
import pathlib
import random
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import models  # noqa: E402
from spec_jax import prefiller  # noqa: E402
from spec_jax.engine import Engine  # noqa: E402
from spec_jax.request import Request  # noqa: E402


def admit(engine: Engine, ids: list[int], start: float) -> float:
    """Seconds from start to the engine's admission of ids (its first token; no row running:
    one prefill call from the end of its cached prefix)."""
    engine.submit(Request(prompt_ids=tuple(ids), max_tokens=2, stop_ids=()))
    engine.step()
    seconds = time.perf_counter() - start
    list(engine.drain())
    return seconds


def read_in_pieces(engine: Engine, ids: list[int], piece: int) -> float:
    """Seconds to the first token of ids read into the prefix cache `piece` tokens at a time,
    the rest then admitted (what the engine does while rows decode, without their chunks)."""
    pf, saved = engine._prefiller, prefiller.PREFILL_PIECE
    prefiller.PREFILL_PIECE = piece
    try:
        start, width = time.perf_counter(), pf.width(ids, 8)
        while len(ids) - pf.prefix.cached_tokens(ids) > piece:
            pf.read_piece(ids, width)
        return admit(engine, ids, start)
    finally:
        prefiller.PREFILL_PIECE = saved


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--dtype", default="gguf_q8")
    parser.add_argument("--tokens", type=int, default=2000, help="the long prompt's tokens (>= 64)")
    parser.add_argument("--pieces", default="64,128,256,whole", help="piece sizes, comma-separated, or whole")
    parser.add_argument("--repeats", type=int, default=2, help="timed rounds (>= 1)")
    args = parser.parse_args(argv)
    sizes = args.pieces.split(",")
    if any(s != "whole" and not (s.isdigit() and int(s) >= 1) for s in sizes):
        parser.error(f"--pieces: positive integers or 'whole', comma-separated, got {args.pieces!r}")
    if args.tokens < 64 or args.repeats < 1:
        parser.error(f"--tokens: at least 64 and --repeats: at least 1, got {args.tokens} and {args.repeats}")
    target = models.load(args.model, dtype=args.dtype, progress=False)
    engine = Engine(target, None, gamma=0, max_context=args.tokens + 64, measure_costs=False)
    if engine._prefiller.prefix is None:
        parser.error(f"--dtype: {args.dtype} runs no prefix cache on this machine (pieces need one)")
    print(f"load average before: {os.getloadavg()}", flush=True)
    times, rng = {s: [] for s in sizes}, random.Random(0)
    for r in range(args.repeats + 1):  # round 0 compiles
        for s in sizes:
            ids = [rng.randrange(1, target.config.vocab_size) for _ in range(args.tokens)]
            seconds = (
                admit(engine, ids, time.perf_counter())
                if s == "whole"
                else read_in_pieces(engine, ids, int(s))
            )
            if r:
                times[s].append(seconds)
            print(f"round {r} pieces {s}: {seconds:.2f} s", flush=True)
    print(f"load average after: {os.getloadavg()}")
    for s, values in times.items():
        print(f"{args.tokens} tokens, pieces of {s}: median {statistics.median(values):.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
