"""Time x[M, K] times a weight stored [K, N] ("in, out") vs stored [N, K] ("out, in").

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

SHAPES = {  # name: (in K, out N)
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
    in_out = jax.jit(lambda x, w_kn: jnp.einsum("mk,kn->mn", x, w_kn))
    out_in = jax.jit(lambda x, w_nk: jnp.einsum("mk,nk->mn", x, w_nk))
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}")
    print("| matrix | M | [in, out] ms | [out, in] ms | ratio |")
    print("|---|---|---|---|---|")
    for name, (k, n) in SHAPES.items():
        w_nk = rng.standard_normal((n, k), dtype=np.float32)
        w_kn = jnp.asarray(np.ascontiguousarray(w_nk.T))
        w_nk = jnp.asarray(w_nk)
        for m in (int(r) for r in args.rows.split(",")):
            x = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32))
            np.testing.assert_allclose(in_out(x, w_kn), out_in(x, w_nk), rtol=1e-4, atol=1e-3)
            times = {"in_out": [], "out_in": []}
            for _ in range(args.repeats):
                for label, f, w in (("in_out", in_out, w_kn), ("out_in", out_in, w_nk)):
                    t0 = time.perf_counter()
                    f(x, w).block_until_ready()
                    times[label].append(time.perf_counter() - t0)
            a, b = (statistics.median(times[k_]) * 1e3 for k_ in ("in_out", "out_in"))
            print(f"| {name} | {m} | {a:.2f} | {b:.2f} | {a / b:.2f} |", flush=True)


if __name__ == "__main__":
    main()
