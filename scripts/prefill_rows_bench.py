"""Time the CPU kernels' prefill of k rows, each reading N new tokens past a cached prefix (a
chat's later turns behind a shared system prompt: the prefix cache holds the prompt's first
blocks), one row per model call ("rows": spec_jax.row_prefill.prefill_rows(batched=False), what
decode.prefill ran before 2026-12-07) against every row's next chunk in one call ("batched").

Each (variant, k) is one compiled program, as decode.prefill runs it with a prefix: a fresh
cache, the pool's blocks of the prefix copied in (row_prefill.read_prefix), then prefill_rows
from the end of the prefix. Every (variant, k, N) is timed interleaved with the others
(spec_jax.timing.timed_interleaved: one warm-up call each, then the repeats round-robin); the
median wall seconds are printed side by side, with the load average before and after (the
machine these figures come from is shared). The prompts are synthetic tokens; every row shares
the prefix's blocks, as the rows of one system prompt do.

    python scripts/prefill_rows_bench.py [--model=qwen2.5-coder-1.5b] [--dtype=gguf_q8]
        [--rows=1,2,4,8] [--new=24,96] [--prefix=576] [--repeats=3] [--variants=rows,batched]

--model=random: a random model at the Qwen2.5 1.5B's shapes (no weights needed), cast to --dtype.
"""

import argparse
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import models  # noqa: E402
from models import machine  # noqa: E402
from models.cache import KVCache  # noqa: E402
from models.transformer import init_cache  # noqa: E402
from spec_jax import decode, timing  # noqa: E402
from spec_jax.row_prefill import PREFILL_CHUNK, prefill_rows, read_prefix  # noqa: E402

VARIANTS = {"rows": False, "batched": True}  # name -> prefill_rows' batched


def ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def variants(text: str) -> list[str]:
    names = [v for v in text.split(",") if v]
    if not names or any(n not in VARIANTS for n in names):
        raise argparse.ArgumentTypeError(f"expected some of {', '.join(VARIANTS)}, got {text!r}")
    return names


def load(name: str, dtype: str) -> models.Model:
    """The model `name` at dtype, or (random) a random model at the Qwen2.5 1.5B's shapes."""
    if name != "random":
        return models.load(name, dtype=dtype, progress=False)
    f32 = models.random_model(
        vocab_size=151936, num_layers=28, d_model=1536, num_heads=12, num_kv_heads=2, mlp_dim=8960,
        scan_layers=False, seed=0,
    )  # fmt: skip
    return models.cast(f32, dtype)


def program(model, k: int, width: int, cache_len: int, prefix: int, batched: bool):
    """fn(tokens [k, width], lens [k]) -> logits: decode.prefill's CPU path with the first
    `prefix` positions of every row read from a pool of blocks (random entries)."""
    cfg = model.config
    blocks = prefix // PREFILL_CHUNK
    shape = (cfg.num_layers, blocks, PREFILL_CHUNK, cfg.num_kv_heads, cfg.head_dim)
    rng = np.random.default_rng(0)
    pool = KVCache(
        k=jnp.asarray(rng.standard_normal(shape), cfg.jnp_dtype),
        v=jnp.asarray(rng.standard_normal(shape), cfg.jnp_dtype),
    )
    table = np.full((k, width // PREFILL_CHUNK), -1, np.int32)
    table[:, :blocks] = np.arange(blocks)
    table = jnp.asarray(table)
    start_b = jnp.full((k,), prefix, jnp.int32)

    @jax.jit
    def run(params, pool, tokens, lens):
        cache = read_prefix(init_cache(cfg, k, cache_len), pool, table)
        out = prefill_rows(cfg, params, tokens, lens, cache, PREFILL_CHUNK, False, start_b, batched=batched)
        return out.logits

    return lambda tokens, lens: run(model.params, pool, tokens, lens)


def cpu_timed(run, tokens, lens, seconds: list):
    """run(tokens, lens), its process CPU seconds (both threads' work, less what the call waited
    for other jobs on a shared machine) appended to `seconds`."""

    def timed():
        start = time.process_time()
        out = jax.block_until_ready(run(tokens, lens))
        seconds.append(time.process_time() - start)
        return out

    return timed


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="a model name or path, or random")
    parser.add_argument("--dtype", default="gguf_q8")
    parser.add_argument("--rows", type=ints, default=[1, 2, 4, 8], help="rows prefilled together (k)")
    parser.add_argument("--new", type=ints, default=[24, 96], help="new tokens per row past the prefix (N)")
    parser.add_argument("--prefix", type=int, default=576, help="cached prefix (a multiple of 32)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", type=variants, default=list(VARIANTS))
    args = parser.parse_args(argv)
    if args.prefix % PREFILL_CHUNK or args.prefix < 0:
        parser.error(f"--prefix must be a multiple of {PREFILL_CHUNK}")
    model = load(args.model, args.dtype)
    width = decode.bucket_length(args.prefix + max(args.new))
    cache_len, rng = width + 128, np.random.default_rng(1)
    fns, cpu = {}, {}
    for name in args.variants:
        for k in args.rows:
            run = program(model, k, width, cache_len, args.prefix, VARIANTS[name])
            for n in args.new:
                tokens, lens = decode.pad_prompts(
                    [list(rng.integers(10, 1000, args.prefix + n)) for _ in range(k)], width
                )
                fns[(name, k, n)] = cpu_timed(
                    run, jnp.asarray(tokens), jnp.asarray(lens), cpu.setdefault((name, k, n), [])
                )
    load_before = os.getloadavg()
    runs = timing.timed_interleaved(fns, args.repeats)
    load_after = os.getloadavg()
    print(f"{args.model} at {args.dtype}, {machine.cpu_model()}, {os.cpu_count()} CPUs; prefix {args.prefix}")
    print(f"load average (1, 5, 15 min) before {load_before}, after {load_after}")
    print(
        f"medians of {args.repeats} (min-max) seconds, wall and process CPU; k rows, each N new tokens past the prefix"
    )
    for clock in ("wall", "CPU"):
        for k in args.rows:
            for n in args.new:
                spreads = {
                    v: runs[(v, k, n)]
                    if clock == "wall"
                    else timing.spread(cpu[(v, k, n)][1:])  # [0]: warm-up
                    for v in args.variants
                }
                cells = [f"{v} {s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f})" for v, s in spreads.items()]
                ratio = ""
                if len(args.variants) == 2:
                    a, b = (s["median"] for s in spreads.values())
                    ratio = f"  {args.variants[1]}/{args.variants[0]} {b / a:.2f}x"
                print(f"{clock} k={k} N={n}: " + "  ".join(cells) + ratio)


if __name__ == "__main__":
    main()
