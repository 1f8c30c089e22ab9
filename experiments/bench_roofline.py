"""Benchmark: bytes per model call against the machine's measured memory bandwidth, the floor
on a decode step's time.

Times with spec_jax.timing.model_call (params as jit arguments, the cache donated, one call per
timed run): the target's and the draft's T = 1 decode step (model call + warp, as the loop
makes it) and the target's T = gamma + 1 verification call. The floor of a call is the bytes it
must read (every weight once, but of an untied input embedding only the rows looked up, plus
the KV cache at `context` slots) over the bandwidth; step_over_floor uses the copy bandwidth
(read + write counted), step_over_read_floor the read-only one.
"""

import ml_collections

from experiments import common, framework
from launch.loading import load_pair
from models import precision, weights
from spec_jax import timing
from spec_jax.sampling import SamplingParams

TITLE = "Benchmark roofline: model-call time against the memory-bandwidth floor"


def get_config(quick: bool = False) -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.target = "tiny" if quick else "qwen2.5-coder-1.5b"
    config.draft = "tiny-draft" if quick else "qwen2.5-coder-0.5b"
    config.precisions = ("int8",) if quick else ("float32", "bfloat16", "int8")  # both models at each
    config.batch_size = 1
    config.gamma = 2 if quick else 4
    config.context = 32 if quick else 128  # KV-cache slots each call reads
    config.bandwidth_mb = 16 if quick else 1024
    config.repeats = 2 if quick else 10
    return config


MODEL_KEYS = ("target", "draft")
DTYPE_KEYS = ("precisions",)
INT_RANGES = {
    "batch_size": (1, 64),
    "gamma": (1, 16),
    "context": (8, 1 << 20),
    "bandwidth_mb": (1, 1 << 16),
    "repeats": (1, 1000),
}


def validate(config) -> None:
    if config.context < 2 * (config.gamma + 1):
        raise ValueError(
            f"context: must be at least 2 * (gamma + 1) = {2 * (config.gamma + 1)}, got {config.context}"
        )


def step_bytes(model, batch: int, tokens_per_row: int, cache_slots: int) -> dict:
    """Bytes one model call reads: every weight once, but of an untied input embedding table only
    the B * T rows looked up, plus the KV cache at cache_slots positions (the XLA attention reads
    every slot of the cache)."""
    cfg = model.config
    weight_bytes = weights.read_bytes(cfg, model.params, batch * tokens_per_row)
    itemsize = cfg.jnp_dtype.itemsize
    kv = 2 * cfg.num_layers * batch * cache_slots * cfg.num_kv_heads * cfg.head_dim * itemsize
    return {"weights": weight_bytes, "kv": kv}


def precision_rows(config, dtype: str, copy_gbs: float, read_gbs: float) -> list[dict]:
    """The three calls' rows with both models at one precision (timed interleaved)."""
    pair = load_pair(
        config.target, config.draft, target_dtype=dtype, draft_dtype=dtype, load=common.load_model
    )
    target, draft = pair.target, pair.draft
    batch, slots, gamma = config.batch_size, config.context, config.gamma
    greedy = SamplingParams(0.0)
    calls = {  # name: (model, widths, sampling)
        "target decode step (T=1)": (target, 1, greedy),
        "draft decode step (T=1)": (draft, 1, greedy),
        f"target verify call (T={gamma + 1})": (target, gamma + 1, None),
    }
    fns = {
        name: timing.model_call(model, batch=batch, widths=[width], cache_slots=slots, sampling=sampling)
        for name, (model, width, sampling) in calls.items()
    }
    runs = timing.interleaved(
        {n: (lambda _, f=f: f()) for n, f in fns.items()}, [None] * config.repeats, [None] * 2
    )
    rows = []
    for name, (model, width, _) in calls.items():
        nbytes = step_bytes(model, batch, width, slots)
        total = nbytes["weights"] + nbytes["kv"]
        floor_s = total / (copy_gbs * 1e9)
        t = timing.spread(runs[name]["seconds"])
        rows.append(
            {
                "precision": dtype,
                "matmul_impl": "cpu_kernel" if precision.cpu_kernels(model.config) else "xla",
                "call": name,
                "model": model.config.name,
                "batch": batch,
                "cache_slots": slots,
                "weight_mb": nbytes["weights"] / 2**20,
                "kv_mb": nbytes["kv"] / 2**20,
                "floor_ms": 1e3 * floor_s,
                "step_ms": 1e3 * t["median"],
                "step_ms_min": 1e3 * t["min"],
                "step_ms_max": 1e3 * t["max"],
                "step_over_floor": t["median"] / floor_s,
                "step_over_read_floor": t["median"] / (total / (read_gbs * 1e9)),
                "achieved_gb_per_s": total / t["median"] / 1e9,
                "compile_s": fns[name].compile_seconds,
            }
        )
    rows[1]["draft_over_target_step"] = rows[1]["step_ms"] / rows[0]["step_ms"]
    rows[2]["verify_over_target_step"] = rows[2]["step_ms"] / rows[0]["step_ms"]
    return rows


def run(config) -> framework.Result:
    bandwidth = timing.measure_bandwidth(config.bandwidth_mb, max(3, config.repeats // 2))
    copy_gbs = max(r["gb_per_s"] for r in bandwidth if r["kind"] == "copy")
    read_gbs = max(r["gb_per_s"] for r in bandwidth if r["kind"] == "read")
    rows = []
    for dtype in config.precisions:
        rows += precision_rows(config, dtype, copy_gbs, read_gbs)
    return framework.Result.from_dicts(
        rows,
        sections={"memory bandwidth": bandwidth},
        summary={"bandwidth_gb_per_s_used": copy_gbs, "read_gb_per_s": read_gbs},
    )
