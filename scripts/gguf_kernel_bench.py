"""Time the GGUF block kernel's paths side by side at precision gguf_q8: y[M, N] = x[M, K] . W^T.

For each block type and shape, every path the kernel (models/kernels/gguf_matmul.cc) has for it
runs on the same weights, timed interleaved (spec_jax.timing.timed_interleaved: one warm-up call
each, then round-robin) for each row count M, medians reported in ms with each path's cost
relative to its own one-row call. Every call reads a different copy of the weight, cycling over
--rotate_mb of copies, so the weight comes from memory as in a model's step.

Paths: Q4_K `interleaved` (what models use on an AVX-512 VNNI CPU, on ggml's block_q4_Kx8
layout: the multi-row kernel with gemv's bits, and for one row of x either it or ggml's gemv,
as gguf_matmul.one_row_own chooses for this CPU; the header says which), `gemm`
(ggml's own prefill product on that layout: rows in groups of 4 through ggml's gemm, which takes
16 rows at a time in its AVX-512 loop and 4 at a time otherwise; a prefill's products take it on
a CPU without the multi-row kernel), `gemv`
(ggml's ggml_gemv_q4_K_8x8_q8_K on the same layout, one call per row of x), `multirow` (the
multi-row kernel on the file's own layout) and `vec_dot` (ggml's vec_dot per (row, column));
Q6_K `interleaved` (what models use on an AVX-512 VNNI CPU: the multi-row kernel on the
kernel's own Q6Kx8 layout, gguf_matmul.interleave_q6k, with vec_dot's bits at every row count),
`multirow` (the multi-row kernel on the file's layout, the path before Q6Kx8 and with
SPEC_JAX_GGUF_Q6K=rows: for one row either it or vec_dot, as for Q4_K) and `vec_dot`. So at M=1
`interleaved` against `gemv` (Q4_K) and `multirow` against `vec_dot` compare the one-row kernels
(SPEC_JAX_GGUF_ONE_ROW=ggml|own fixes the choice).
Shapes are the Qwen2.5-Coder-1.5B matrices. Run it alone: the machine's other load shows in
the figures (read the ratios).

    python scripts/gguf_kernel_bench.py [--rows=1,2,5,9] [--shapes=8960x1536,1536x8960] [--repeats=15]
        [--types=Q4_K,Q6_K] [--paths=gemm,interleaved]
"""

import argparse
import itertools
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType as T

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from models import machine  # noqa: E402
from models.kernels import gguf_matmul  # noqa: E402
from spec_jax import timing  # noqa: E402


def paths(ggml_type: int) -> dict:
    """name -> (ggml_dot, interleaved, bulk) for the kernel's paths of ggml_type."""
    if ggml_type == T.Q4_K.value:
        return {
            "interleaved": (False, True, False),
            "gemm": (True, True, True),
            "gemv": (True, True, False),
            "multirow": (False, False, False),
            "vec_dot": (True, False, False),
        }
    return {
        "interleaved": (False, True, False),
        "multirow": (False, False, False),
        "vec_dot": (True, False, False),
    }


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="1,2,5,9", help="comma-separated M values")
    parser.add_argument("--types", default="Q4_K,Q6_K", help="GGUF block types")
    parser.add_argument("--shapes", default="8960x1536,1536x8960", help="N x K, comma-separated")
    parser.add_argument("--paths", default="", help="only these paths (comma-separated; default all)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rotate_mb", type=int, default=256, help="weight copies cycled per shape (MB)")
    args = parser.parse_args()
    if not gguf_matmul.available():
        parser.error("the GGUF kernel is unavailable here (see the warning above)")
    rows = [int(m) for m in args.rows.split(",")]
    rng = np.random.default_rng(0)
    one_row = "the multi-row kernel" if gguf_matmul.one_row_own() else "ggml's gemv / vec_dot"
    print(f"{jax.local_device_count()} device(s), jax {jax.__version__}; median ms of {args.repeats}")
    print(f"{machine.cpu_model()}; one-row products (M=1) of interleaved and multirow: {one_row}")
    print()
    print("| type | N x K | path | " + " | ".join(f"M={m} ms (x M={rows[0]})" for m in rows) + " |")
    print("|---|---|---|" + "---|" * len(rows))
    for type_name, shape in itertools.product(args.types.split(","), args.shapes.split(",")):
        ggml_type = T[type_name].value
        n, k = (int(v) for v in shape.split("x"))
        data = gguf_matmul.quantize(rng.standard_normal((n, k), dtype=np.float32), ggml_type)
        copies = max(1, args.rotate_mb * 2**20 // data.nbytes)
        layouts = {False: data}
        if any(il for _, il, _ in paths(ggml_type).values()):
            interleave = (
                gguf_matmul.interleave_q4k if ggml_type == T.Q4_K.value else gguf_matmul.interleave_q6k
            )
            layouts[True] = interleave(data)
        stored = {il: [jnp.asarray(d.copy()) for _ in range(copies)] for il, d in layouts.items()}
        fns = {}
        chosen = {n: p for n, p in paths(ggml_type).items() if not args.paths or n in args.paths.split(",")}
        for name, (ggml_dot, il, bulk) in chosen.items():
            call = jax.jit(
                lambda x, w, t=ggml_type, d=ggml_dot, il=il, b=bulk: gguf_matmul.matmul(
                    x, w, t, True, ggml_dot=d, interleaved=il, bulk=b
                )
            )
            for m in rows:
                x = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32))
                turn = itertools.count()
                fns[(name, m)] = lambda c=call, x=x, ws=stored[il], t=turn: c(x, ws[next(t) % len(ws)])
        times = timing.timed_interleaved(
            {key: (lambda f=f: f().block_until_ready()) for key, f in fns.items()}, args.repeats
        )
        for name in chosen:
            ms = [times[(name, m)]["median"] * 1e3 for m in rows]
            cells = " | ".join(f"{v:.3f} ({v / ms[0]:.2f})" for v in ms)
            print(f"| {type_name} | {n} x {k} | {name} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
