"""Benchmark: the attention kernels against the XLA reference and the memory-traffic floor.

For each batch size B, cache length S and query count T (queries at the end of a full cache, as
in decode / speculative verification): the median kernel time, the median time of the XLA
reference, and the floor: the bytes of K and V that must be read (2 * B * S * KVH * D *
itemsize) over the device's copy bandwidth (spec_jax.timing.measure_bandwidth). On a CPU the
Pallas kernels only run in interpret mode (`interpret=True`, tiny sizes: the times then prove
the benchmark runs and mean nothing); run it on a TPU or GPU for real figures.
"""

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from experiments import framework
from models import kernels
from spec_jax import timing

TITLE = "Benchmark attention: Pallas kernels against the XLA reference and the bandwidth floor"


def get_config(quick: bool = False) -> ml_collections.ConfigDict:
    """Full: impl auto on the default device, a GPU-sized grid. Quick: interpret mode, tiny sizes."""
    config = ml_collections.ConfigDict()
    config.impl = "auto"
    config.interpret = quick
    config.seq_lens = (128, 300) if quick else (1024, 8192, 32768)
    config.num_queries = (1, 5)  # 1 = decode, gamma + 1 = verification
    config.batch_sizes = (1, 2) if quick else (1, 8)
    config.num_heads = 4 if quick else 32
    config.num_kv_heads = 2 if quick else 8
    config.head_dim = 64 if quick else 128
    config.dtype = "float32" if quick else "bfloat16"
    config.repeats = 3 if quick else 20
    config.bandwidth_mb = 64 if quick else 1024
    return config


INT_RANGES = {
    "num_heads": (1, 1024),
    "num_kv_heads": (1, 1024),
    "head_dim": (1, 1024),
    "repeats": (1, 10_000),
    "bandwidth_mb": (1, 1 << 16),
}
TUPLE_RANGES = {key: (int, 1, 1 << 20) for key in ("seq_lens", "num_queries", "batch_sizes")}


def validate(config) -> None:
    if config.impl not in kernels.IMPLS:
        raise ValueError(f"impl: must be one of {kernels.IMPLS}, got {config.impl!r}")
    if config.num_heads % config.num_kv_heads:
        raise ValueError(
            f"num_heads: must be a multiple of num_kv_heads ({config.num_kv_heads}), got {config.num_heads}"
        )
    if config.dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype: must be float32 or bfloat16, got {config.dtype!r}")
    impl = "pallas_gpu" if config.interpret and config.impl == "auto" else kernels.resolve_impl(config.impl)
    if config.interpret and impl == "xla":
        raise ValueError("impl: interpret mode needs a Pallas impl (pallas_gpu or pallas_tpu)")
    if not config.interpret and impl != "xla" and jax.default_backend() == "cpu":
        raise ValueError(f"impl: {impl} cannot run on CPU without interpret=True")


def inputs(batch, seq_len, num_queries, num_heads, num_kv_heads, head_dim, dtype):
    """q, k, v, positions, lengths: the last T positions of a full cache."""

    @jax.jit
    def make(key):
        kq, kk, kv = jax.random.split(key, 3)
        q = jax.random.normal(kq, (batch, num_queries, num_heads, head_dim), dtype)
        k = jax.random.normal(kk, (batch, seq_len, num_kv_heads, head_dim), dtype)
        v = jax.random.normal(kv, (batch, seq_len, num_kv_heads, head_dim), dtype)
        pos = jnp.broadcast_to(
            jnp.arange(seq_len - num_queries, seq_len, dtype=jnp.int32), (batch, num_queries)
        )
        return q, k, v, pos, jnp.full((batch,), seq_len, jnp.int32)

    return make(jax.random.key(0))


def run(config) -> framework.Result:
    impl = "pallas_gpu" if config.interpret and config.impl == "auto" else kernels.resolve_impl(config.impl)
    dtype = jnp.dtype(config.dtype)
    h, kvh, d = config.num_heads, config.num_kv_heads, config.head_dim
    kernel = jax.jit(functools.partial(kernels.attention, impl=impl, interpret=config.interpret))
    reference = jax.jit(functools.partial(kernels.attention, impl="xla"))
    cells = [(b, s, t) for b in config.batch_sizes for s in config.seq_lens for t in config.num_queries]
    for b, s, t in cells:  # trace only: unsupported shapes fail here, before anything is timed
        jax.eval_shape(kernel, *jax.eval_shape(functools.partial(inputs, b, s, t, h, kvh, d, dtype)))
    bandwidth = timing.measure_bandwidth(config.bandwidth_mb, config.repeats)
    copy_gbs = max(r["gb_per_s"] for r in bandwidth if r["kind"] == "copy")
    rows = []
    for b, s, t in cells:
        args = inputs(b, s, t, h, kvh, d, dtype)
        fns = {"kernel": functools.partial(kernel, *args), "xla": functools.partial(reference, *args)}
        times = timing.timed_interleaved(fns, config.repeats)
        floor = 2 * b * s * kvh * d * dtype.itemsize / (copy_gbs * 1e9)
        out, ref = (np.asarray(f(), np.float32) for f in fns.values())
        rows.append(
            {
                "B": b,
                "S": s,
                "T": t,
                "kernel_ms": 1e3 * times["kernel"]["median"],
                "xla_ms": 1e3 * times["xla"]["median"],
                "xla_over_kernel": times["xla"]["median"] / times["kernel"]["median"],
                "floor_ms": 1e3 * floor,
                "floor_over_kernel": floor / times["kernel"]["median"],
                "max_rel_error": float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-30)),
            }
        )
    note = (
        f"device {jax.devices()[0].device_kind} ({jax.default_backend()}), impl {impl}"
        + (" in interpret mode: the times are meaningless" if config.interpret else "")
        + f"; H={h} KVH={kvh} D={d} {dtype.name}; copy bandwidth {copy_gbs:.1f} GB/s; medians of {config.repeats}."
    )
    return framework.Result.from_dicts(rows, markdown=note, sections={"memory bandwidth": bandwidth})
