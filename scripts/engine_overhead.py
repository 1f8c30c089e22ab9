"""The engine's host work between chunks, as a share of its decode time (issue 37's goal: <= 5%
at concurrency 8).

  .venv/bin/python scripts/engine_overhead.py [--target=random] [--draft=random-draft] \
      [--requests=16] [--max_batch=8] [--max_tokens=48] [--gamma=3] [--max_context=0]

Submits --requests greedy requests of 40-token prompts at once to an Engine of --max_batch
slots (after a warm-up that compiles everything) and drains it. Prints one JSON line: tokens,
wall seconds, tokens/s, the engine's step / decode (chunk wall time) / prefill seconds, and the
host's own work (step - decode - prefill - compile: admissions, reading the rows, text) as a
share of the decode time.
"""

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import models  # noqa: E402
from spec_jax.engine import Engine  # noqa: E402
from spec_jax.request import Request  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="random")
    parser.add_argument("--draft", default="random-draft")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max_batch", type=int, default=8)
    parser.add_argument("--max_tokens", type=int, default=48)
    parser.add_argument("--gamma", default="3")
    parser.add_argument("--max_context", type=int, default=0, help="tokens per slot (0: prompt + max_tokens)")
    args = parser.parse_args()
    target = models.load(args.target, dtype=args.dtype)
    draft = None if args.draft == "none" else models.load(args.draft, dtype=args.dtype)
    gamma = args.gamma if args.gamma == "auto" else int(args.gamma)
    vocab = target.config.vocab_size
    prompts = [tuple((i * 37 + j * 11) % (vocab - 1) + 1 for j in range(40)) for i in range(args.requests)]
    engine = Engine(
        target,
        draft,
        max_batch=args.max_batch,
        gamma=gamma,
        max_context=args.max_context or 40 + args.max_tokens,
    )
    for p in prompts[: args.max_batch]:  # warm-up: every program compiled
        engine.submit(Request(prompt_ids=p, max_tokens=8, stop_ids=()))
    list(engine.drain())
    before = engine.stats()
    start = time.perf_counter()
    for p in prompts:
        engine.submit(Request(prompt_ids=p, max_tokens=args.max_tokens, stop_ids=()))
    tokens = sum(len(u.token_ids) for u in engine.drain())
    wall = time.perf_counter() - start
    after = engine.stats()
    spent = {
        k: after[k] - before.get(k, 0)
        for k in ("step_seconds", "decode_seconds", "prefill_seconds", "table_seconds", "chunks")
    }
    host = spent["step_seconds"] - spent["decode_seconds"] - spent["prefill_seconds"] - spent["table_seconds"]
    host -= after["compile_seconds"] - before["compile_seconds"]
    result = dict(tokens=tokens, wall_seconds=wall, tokens_per_second=tokens / wall, **spent)
    result.update(host_seconds=host, host_share_of_decode=host / spent["decode_seconds"])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
