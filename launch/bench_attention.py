"""Benchmark the attention kernels against the XLA reference and the memory-traffic floor.

For each batch size B, cache length S and query count T (queries at the end of a full cache, as in
decode / speculative verification) it reports the median kernel time, the median time of the XLA
reference, and the floor: bytes of K and V that must be read (2 * B * S * KVH * D * itemsize) over
the device bandwidth measured with a large on-device copy. Prints a Markdown table.

Examples:
  python -m launch.bench_attention                       # impl=auto on the default device
  python -m launch.bench_attention --impl=pallas_gpu --seq_lens=8192 --batch_sizes=8
  python -m launch.bench_attention --interpret           # tiny sizes, Pallas interpret mode on CPU

Bad flags exit with code 2 and one line on stderr.
"""

import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from launch import common
from models import kernels

FLAGS = flags.FLAGS

flags.DEFINE_enum(
    "impl", "auto", list(kernels.IMPLS), "Attention implementation to time against the XLA reference."
)
flags.DEFINE_list("seq_lens", ["1024", "8192", "32768"], "Cache lengths S (keys per row).")
flags.DEFINE_list("num_queries", ["1", "5"], "Queries per row T (1 = decode, gamma + 1 = verification).")
flags.DEFINE_list("batch_sizes", ["1", "8"], "Batch sizes B.")
flags.DEFINE_integer("num_heads", 32, "Query heads H.", lower_bound=1)
flags.DEFINE_integer("num_kv_heads", 8, "Key/value heads KVH (H must be a multiple).", lower_bound=1)
flags.DEFINE_integer("head_dim", 128, "Head dimension D.", lower_bound=1)
flags.DEFINE_enum("dtype", "bfloat16", ["float32", "bfloat16"], "Dtype of q, k, v.")
flags.DEFINE_integer("warmup", 3, "Untimed calls before timing (the first one compiles).", lower_bound=1)
flags.DEFINE_integer("repeats", 20, "Timed calls; the median is reported.", lower_bound=1)
flags.DEFINE_integer(
    "bandwidth_mib", 1024, "Size of the on-device copy that measures bandwidth.", lower_bound=1
)
flags.DEFINE_bool(
    "interpret",
    False,
    "Run the Pallas kernels in interpret mode on tiny sizes (CPU): proves the benchmark runs, the "
    "times mean nothing. Size flags left at their defaults shrink; impl=auto means pallas_gpu.",
)

# With --interpret, flags the user did not set take these values.
_INTERPRET_DEFAULTS = dict(
    seq_lens=["128", "300"],
    num_queries=["1", "5"],
    batch_sizes=["1", "2"],
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    dtype="float32",
    warmup=1,
    repeats=3,
    bandwidth_mib=64,
)


def _positive_ints(values) -> bool:
    try:
        return len(values) > 0 and all(int(v) > 0 for v in values)
    except ValueError:
        return False


for _name in ("seq_lens", "num_queries", "batch_sizes"):
    flags.register_validator(
        _name, _positive_ints, message=f"--{_name} must be a comma-separated list of positive integers"
    )
flags.register_multi_flags_validator(
    ["num_heads", "num_kv_heads"],
    lambda f: f["num_heads"] % f["num_kv_heads"] == 0,
    message="--num_heads must be a multiple of --num_kv_heads",
)


def _median_seconds(fn, args, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_bandwidth(num_bytes: int, warmup: int, repeats: int) -> float:
    """Bytes per second of an on-device elementwise copy (reads and writes num_bytes each)."""
    x = jnp.zeros((num_bytes // 4,), jnp.float32)
    copy = jax.jit(lambda a: a + 1.0)  # a real read + write; a bare copy could be elided
    return 2 * x.size * 4 / _median_seconds(copy, (x,), warmup, repeats)


def _inputs(batch, seq_len, num_queries, num_heads, num_kv_heads, head_dim, dtype):
    @jax.jit
    def make(key):
        kq, kk, kv = jax.random.split(key, 3)
        q = jax.random.normal(kq, (batch, num_queries, num_heads, head_dim), dtype)
        k = jax.random.normal(kk, (batch, seq_len, num_kv_heads, head_dim), dtype)
        v = jax.random.normal(kv, (batch, seq_len, num_kv_heads, head_dim), dtype)
        # The last T positions of a full cache: decode (T=1) / verification (T=gamma+1).
        pos = jnp.broadcast_to(
            jnp.arange(seq_len - num_queries, seq_len, dtype=jnp.int32), (batch, num_queries)
        )
        return q, k, v, pos, jnp.full((batch,), seq_len, jnp.int32)

    return make(jax.random.key(0))


def _settings():
    values = {name: FLAGS[name].value for name in _INTERPRET_DEFAULTS}
    if FLAGS.interpret:
        values.update({name: v for name, v in _INTERPRET_DEFAULTS.items() if not FLAGS[name].present})
    for name in ("seq_lens", "num_queries", "batch_sizes"):
        values[name] = [int(v) for v in values[name]]
    impl = FLAGS.impl
    if FLAGS.interpret and impl == "auto":
        impl = "pallas_gpu"
    values["impl"] = kernels.resolve_impl(impl)
    return values


def main(argv):
    if len(argv) > 1:
        raise common.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    cfg = _settings()
    impl, dtype = cfg["impl"], jnp.dtype(cfg["dtype"])
    h, kvh, d = cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"]
    if FLAGS.interpret and impl == "xla":
        raise common.UsageError("--interpret needs a Pallas impl (pallas_gpu or pallas_tpu)")
    if not FLAGS.interpret and impl != "xla" and jax.default_backend() == "cpu":
        raise common.UsageError(f"--impl={impl} cannot run on CPU without --interpret")
    kernel = jax.jit(functools.partial(kernels.attention, impl=impl, interpret=FLAGS.interpret))
    reference = jax.jit(functools.partial(kernels.attention, impl="xla"))
    for batch in cfg["batch_sizes"]:
        for seq_len in cfg["seq_lens"]:
            for t in cfg["num_queries"]:
                # Trace only: unsupported shapes / blocks fail here, before anything is timed.
                shapes = jax.eval_shape(functools.partial(_inputs, batch, seq_len, t, h, kvh, d, dtype))
                jax.eval_shape(kernel, *shapes)
    timing = dict(warmup=cfg["warmup"], repeats=cfg["repeats"])
    bandwidth = measure_bandwidth(cfg["bandwidth_mib"] * 2**20, **timing)

    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), impl={impl}", end="")
    print(" (interpret mode: times are meaningless)" if FLAGS.interpret else "")
    print(f"H={h} KVH={kvh} D={d} dtype={dtype.name}; copy bandwidth {bandwidth / 1e9:.1f} GB/s; ", end="")
    print(f"median of {cfg['repeats']} after {cfg['warmup']} warm-up")
    print()
    print("| B | S | T | kernel ms | xla ms | xla / kernel | floor ms | floor / kernel | max err |")
    print("|---|---|---|---|---|---|---|---|---|")
    for batch in cfg["batch_sizes"]:
        for seq_len in cfg["seq_lens"]:
            for t in cfg["num_queries"]:
                args = _inputs(batch, seq_len, t, h, kvh, d, dtype)
                t_kernel = _median_seconds(kernel, args, **timing)
                t_xla = _median_seconds(reference, args, **timing)
                floor = 2 * batch * seq_len * kvh * d * dtype.itemsize / bandwidth
                out, ref = (np.asarray(f(*args), np.float32) for f in (kernel, reference))
                err = np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-30)
                print(
                    f"| {batch} | {seq_len} | {t} | {t_kernel * 1e3:.3f} | {t_xla * 1e3:.3f} | "
                    f"{t_xla / t_kernel:.2f} | {floor * 1e3:.4f} | {floor / t_kernel:.1%} | {err:.1e} |",
                    flush=True,
                )
                del args


if __name__ == "__main__":
    common.run(main)
