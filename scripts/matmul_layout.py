"""Time x[M, I] times a weight stored [I, O] ("in, out") vs stored [O, I] ("out, in").

The evidence for the model's weight layout (models/config.py, docs/design.md): on XLA:CPU
the small-M products of decode (M = 1) and verification (M = gamma + 1) run faster with
the weight in [out, in] order. Shapes are the Qwen2.5-Coder-1.5B matrices. Medians over
interleaved repeats after a warm-up.

    python scripts/matmul_layout.py [--repeats=11] [--rows=1,5]
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

SHAPES = {  # name: (in I, out O)
    "wq / wo 1536x1536": (1536, 1536),
    "wk / wv 1536x256": (1536, 256),
    "w_gate / w_up 1536x8960": (1536, 8960),
    "w_down 8960x1536": (8960, 1536),
    "lm_head 1536x151936": (1536, 151936),
}


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--rows", default="1,5", help="comma-separated M values")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    rng = np.random.default_rng(0)
    in_out = jax.jit(lambda x, w_io: jnp.einsum("mi,io->mo", x, w_io))
    out_in = jax.jit(lambda x, w_oi: jnp.einsum("mi,oi->mo", x, w_oi))
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}")
    print("| matrix | M | [in, out] ms | [out, in] ms | ratio |")
    print("|---|---|---|---|---|")
    for name, (k, n) in SHAPES.items():
        w_oi = rng.standard_normal((n, k), dtype=np.float32)
        w_io = jnp.asarray(np.ascontiguousarray(w_oi.T))
        w_oi = jnp.asarray(w_oi)
        for m in (int(r) for r in args.rows.split(",")):
            x = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32))
            np.testing.assert_allclose(in_out(x, w_io), out_in(x, w_oi), rtol=1e-4, atol=1e-3)
            times = {"in_out": [], "out_in": []}
            for _ in range(args.repeats):
                for label, f, w in (("in_out", in_out, w_io), ("out_in", out_in, w_oi)):
                    t0 = time.perf_counter()
                    f(x, w).block_until_ready()
                    times[label].append(time.perf_counter() - t0)
            a, b = (statistics.median(times[k_]) * 1e3 for k_ in ("in_out", "out_in"))
            print(f"| {name} | {m} | {a:.2f} | {b:.2f} | {a / b:.2f} |", flush=True)


if __name__ == "__main__":
    main()
