"""Predicted speedup of speculative decoding on TPUs and GPUs, from their compilers (no hardware).

For each compile-only TPU / GPU target of models.kernels.compile_targets and each batch size:
1. Compile for that device the model calls the walltime experiment times
   (spec_jax.timing.model_calls: the forward pass and the warp at temperature 0, against a cache
   of the demo's length about half full), with attention impl "auto" (the device's Pallas kernels;
   XLA attention on pre-Ampere GPUs):
     the target's decode step (T = 1), its verify call (T = gamma + 1) for each gamma, and the
     draft's decode step (T = 1).
2. Read each executable's cost (compile_targets.cost_analysis: XLA's HloCostAnalysis of the
   optimized program): flops and bytes accessed.
3. Roofline time t = max(bytes / bandwidth, flops / peak), with the device's published HBM
   bandwidth and dense matmul peak (PEAKS below, sources cited).
4. v(gamma) = t_verify(gamma) / t_decode, c = t_draft / t_decode, and the predicted speedup
   theory.walltime_speedup(alpha, gamma, c, verify_cost=v): Theorem 3.8 with the verify call's
   cost, the walltime experiment's "verify-corrected" model. Theorem 3.8 itself (v = 1) beside it.
alpha is a setting: the Qwen pair's measured acceptance rate on code at temperature 0, 0.879
(experiments/results/table3.md, the 0.5B draft row), rounded to 0.88.

Token trees (config.tree_nodes, spec_jax.tree): a tree of N nodes is verified by one target call
of N + 1 queries with a tree mask, whose dense work is the chain's of N drafts (the mask only
selects what each query reads), so its cost is v(N), the verify call of gamma = N. The draft
model's EAGLE-2 tree costs min(tree_depth, N) draft calls per round (one per depth, the widest
over tree_width * (depth - 1) queries, memory-bound like the verify calls of the chain up to
gamma 8 on every device here), costed as c each; the chain of N costs N. With the measured mean
accepted tokens per verify call L of each (config.chain_lengths, config.tree_lengths: the pair's
draft model on code at temperature 0, experiments/results/trees/table3.md), the predicted
speedup over plain decoding is L / (draft calls * c + v(N)).

Assumptions (what a roofline is and is not):
- The roofline time is a lower bound on a call's time: it assumes the call streams its bytes at
  the full published bandwidth or runs its flops at the full dense peak, whichever takes longer.
  It ignores kernel launch and dispatch overheads (a decode step of a small model on a GPU is
  hundreds of kernels), the kernels' efficiency, the loop's own work between calls (the rejection
  rule, committing, the while_loop) and the host. Real steps are slower, and the small draft's
  step is the most overhead-bound, so the real c is larger and the real speedup smaller.
- bfloat16 weights and activations (config.dtype). The peak is the dense bfloat16 matmul rate;
  V100 and T4 have no bfloat16 matmul units, and XLA runs their bfloat16 dots in float32, so
  theirs is the float32 rate.
- The bytes and flops are XLA's estimate for the program the device compiler produced: every
  fusion reads its operands and writes its output once, through HBM; the Pallas attention
  kernels' custom calls count (almost) nothing, which at the demo's short cache (88 slots) is
  a few MB out of GB of weights. The layers are compiled unrolled (scan_layers=False) because
  the analysis counts a while loop's body once, whatever its trip count; the programs the loop
  runs scan them (the same fusions, in a loop). A full-depth call's costs are extrapolated from
  1- and 2-layer compiles of it (analysed_costs: flops exact, bytes within 15% at 3 layers).
- The model is the paper's: i.i.d. acceptances with probability alpha per token (the measured
  tokens per round match it within 2% up to gamma 5 on this pair: experiments/results/walltime.md).
- A compile-only TPU v2, v3 or v4 device is one TensorCore (half a chip): its bandwidth and peak
  are half the chip's. The ratios v and c, hence the speedups, do not depend on that scaling.
No accelerator is lent to the sessions that produced the committed results, so there is no
measured column: these are predictions only.
"""

import dataclasses
import functools
import sys
import time

import jax
import ml_collections
import numpy as np

import models.kernels
from experiments import bench_roofline, framework
from experiments.compile_loop import DEMO
from models.kernels import compile_targets as ct
from models.transformer import init_cache
from models.weights import param_shapes
from spec_jax import sharding, theory
from spec_jax.decode import layout
from spec_jax.sampling import SamplingParams
from spec_jax.timing import model_calls

TITLE = "Predicted speedup on TPUs and GPUs: roofline times of the compiled model calls, Theorem 3.8"

# alpha of the Qwen pair on code at temperature 0 (experiments/results/table3.md: 0.879 [0.833, 0.922]).
MEASURED_ALPHA = 0.88
# Mean accepted tokens per verify call of the Qwen pair's 0.5B draft on code at temperature 0, a
# chain of N drafts and the EAGLE-2 tree of N nodes (experiments/results/trees/table3.md).
MEASURED_TREE_LENGTHS = {8: (4.889, 5.173)}
TREE_DEPTH = (
    16  # spec_jax.drafting.model.ModelDrafter.tree_depth: the tree's draft calls per round are min(D, N)
)


@dataclasses.dataclass(frozen=True)
class Peak:
    """Published figures of one accelerator chip."""

    bandwidth: float  # HBM / device memory bytes per second
    flops: float  # dense matmul FLOP/s with bfloat16 operands (float32 where there is no bf16 unit)
    source: str
    tensorcores: int = 1  # TPU TensorCores per chip; a compile-only device may be one of them


_G, _T = 1e9, 1e12
PEAKS = {
    "tpu-v2": Peak(700 * _G, 46 * _T, "Jouppi et al., CACM 63(7) 2020 (TPUv2: 46 TFLOPS bf16, 700 GB/s)", 2),
    "tpu-v3": Peak(900 * _G, 123 * _T, "cloud.google.com/tpu/docs/v3 (123 TFLOPS bf16, 900 GBps)", 2),
    "tpu-v4": Peak(1200 * _G, 275 * _T, "cloud.google.com/tpu/docs/v4 (275 TFLOPS bf16, 1200 GBps)", 2),
    "tpu-v5e": Peak(819 * _G, 197 * _T, "cloud.google.com/tpu/docs/v5e (197 TFLOPS bf16, 819 GBps)"),
    "tpu-v5p": Peak(2765 * _G, 459 * _T, "cloud.google.com/tpu/docs/v5p (459 TFLOPS bf16, 2765 GBps)", 2),
    "tpu-v6e": Peak(1638 * _G, 918 * _T, "cloud.google.com/tpu/docs/v6e (918 TFLOPS bf16, 1638 GBps)"),
    # GPUs: bandwidth from the compile target's own spec (compile_targets.GPU_SPECS); dense peaks
    # (the data sheets' tensor figures marked "with sparsity" are twice these).
    "gpu-h100": Peak(ct.GPU_SPECS["h100"].memory_bandwidth, 989 * _T,
                     "NVIDIA H100 data sheet, SXM5 (989 TFLOPS bf16 dense, 3.35 TB/s)"),
    "gpu-a100": Peak(ct.GPU_SPECS["a100"].memory_bandwidth, 312 * _T,
                     "NVIDIA A100 data sheet, SXM4 40 GB (312 TFLOPS bf16, 1555 GB/s)"),
    "gpu-rtx-a6000": Peak(ct.GPU_SPECS["rtx-a6000"].memory_bandwidth, 154.8 * _T,
                          "NVIDIA RTX A6000 data sheet (154.8 TFLOPS bf16 dense, 768 GB/s)"),
    "gpu-l4": Peak(ct.GPU_SPECS["l4"].memory_bandwidth, 121 * _T,
                   "NVIDIA L4 data sheet (121 TFLOPS bf16 dense, 300 GB/s)"),
    "gpu-v100": Peak(ct.GPU_SPECS["v100"].memory_bandwidth, 15.7 * _T,
                     "NVIDIA V100 data sheet, SXM2 (15.7 TFLOPS fp32: no bf16 units; 900 GB/s)"),
    "gpu-t4": Peak(ct.GPU_SPECS["t4"].memory_bandwidth, 8.1 * _T,
                   "NVIDIA T4 data sheet (8.1 TFLOPS fp32: no bf16 units; 320 GB/s)"),
}  # fmt: skip

COLUMNS = (
    "target",
    "batch",
    "gamma",
    "alpha",
    "decode_ms",
    "verify_ms",
    "draft_ms",
    "verify_bound",
    "v",
    "c",
    "expected_tokens",
    "theorem_3_8_speedup",
    "predicted_speedup",
    "ar_tokens_per_s",
    "spec_tokens_per_s",
    "v_floor",
    "c_floor",
    "predicted_speedup_floor",
)


def get_config(quick: bool = False) -> ml_collections.ConfigDict:
    """Full: the Qwen pair, every TPU and GPU target, gamma 1..8, batch 1 and 8. Quick: the pair's
    head shapes cut to 2 layers and a 1024-token vocabulary, TPU v5e and A100, gamma 1 and 4."""
    config = ml_collections.ConfigDict()
    config.target = DEMO.model  # names in models.kernels.compile_targets.MODELS
    config.draft = DEMO.draft
    config.targets = ("tpu-v5e", "gpu-a100") if quick else tuple(PEAKS)
    config.gammas = (1, 4) if quick else tuple(range(1, 9))
    config.batch_sizes = (1,) if quick else (1, 8)
    config.alpha = MEASURED_ALPHA
    config.dtype = "bfloat16"
    config.num_layers = 2 if quick else 0  # 0: the models' own depths
    # Costs of the full depth from 1- and 2-layer compiles (analysed_costs): exact for identical
    # unrolled layers, and minutes instead of hours for every target.
    config.extrapolate_layers = True
    config.vocab_size = 1024 if quick else 0  # 0: the models' own
    # The cache of `make demo`: the prompt bucket of DEMO.prompt_tokens, max_new_tokens, the gammas.
    config.prompt_tokens = DEMO.prompt_tokens
    config.max_new_tokens = DEMO.max_new_tokens
    # Token trees: node counts N and the measured tokens per verify call of the chain of N and the
    # tree of N (MEASURED_TREE_LENGTHS; empty: no trees table).
    nodes = tuple(MEASURED_TREE_LENGTHS)
    config.tree_nodes = nodes
    config.chain_lengths = tuple(MEASURED_TREE_LENGTHS[n][0] for n in nodes)
    config.tree_lengths = tuple(MEASURED_TREE_LENGTHS[n][1] for n in nodes)
    config.tree_depth = TREE_DEPTH
    return config


INT_RANGES = {
    "num_layers": (0, 1024),
    "vocab_size": (0, 1 << 20),
    "prompt_tokens": (1, 1 << 16),
    "max_new_tokens": (1, 1 << 16),
    "tree_depth": (1, 31),
}
TUPLE_RANGES = {
    "gammas": (int, 1, 16),
    "batch_sizes": (int, 1, 1024),
    "tree_nodes": (int, 1, 31),
    "chain_lengths": (float, 1.0, 32.0),
    "tree_lengths": (float, 1.0, 32.0),
}


def validate(config) -> None:
    """Raises ValueError starting with the offending key."""
    for key in ("target", "draft"):
        if config[key] not in ct.MODELS:
            raise ValueError(f"{key}: must be one of {', '.join(ct.MODELS)}, got {config[key]!r}")
    bad = [t for t in config.targets if t not in PEAKS]
    if bad or not config.targets:
        raise ValueError(f"targets: must be a non-empty list out of {', '.join(PEAKS)}, got {bad}")
    if not 0.0 <= config.alpha < 1.0:
        raise ValueError(f"alpha: must be in [0, 1), got {config.alpha}")
    if config.dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype: must be float32 or bfloat16, got {config.dtype!r}")
    n = len(config.tree_nodes)
    for key in ("chain_lengths", "tree_lengths"):
        if len(config[key]) != n:
            raise ValueError(f"{key}: one per tree_nodes entry ({n}), got {len(config[key])}")
        for nodes, length in zip(config.tree_nodes, config[key], strict=True):
            if length > nodes + 1:
                raise ValueError(f"{key}: at most N + 1 tokens per verify call, got {length} at N = {nodes}")


def model_config(config, name: str):
    """The registered model's config as costed: config.dtype, layers unrolled (the cost analysis
    counts a scanned body once), attention "auto", depth / vocabulary cut when the config says."""
    cfg = dataclasses.replace(ct.MODELS[name], dtype=config.dtype, scan_layers=False, attention_impl="auto")
    if config.num_layers:
        cfg = dataclasses.replace(cfg, num_layers=config.num_layers)
    if config.vocab_size:
        cfg = dataclasses.replace(cfg, vocab_size=config.vocab_size)
    return cfg


def verify_widths(config) -> list[int]:
    """The gammas and the tree node counts: each one's verify call is compiled."""
    return sorted({*config.gammas, *config.tree_nodes})


def cache_slots(config, target_cfg) -> int:
    """The demo's cache length (spec_jax.decode.layout) for the largest gamma or tree."""
    prompt = [[0] * config.prompt_tokens]
    return layout(target_cfg, prompt, config.max_new_tokens, max(verify_widths(config)))[1]


def call_costs(config, target_name: str, batch: int) -> list[dict]:
    """Compiles the target's decode step and verify calls and the draft's decode step for the
    device; one dict per call: name, tokens, flops, bytes, weight_bytes, compile seconds."""
    target_cfg, draft_cfg = model_config(config, config.target), model_config(config, config.draft)
    slots = cache_slots(config, target_cfg)
    greedy = SamplingParams(0.0)
    dev = ct.device(target_name)
    calls = {"decode": (target_cfg, 1), "draft": (draft_cfg, 1)}
    calls.update({f"verify_{g}": (target_cfg, g + 1) for g in verify_widths(config)})
    out = []
    for name, (cfg, width) in calls.items():
        start = time.perf_counter()
        flops, bytes_ = analysed_costs(cfg, batch, width, slots, greedy, dev, config.extrapolate_layers)
        seconds = time.perf_counter() - start
        print(
            f"predicted_speed: {target_name} B={batch} {name}: {seconds:.1f} s", file=sys.stderr, flush=True
        )
        params = param_shapes(cfg)
        floor = bench_roofline.step_bytes(_Shapes(cfg, params), batch, width, slots)
        out.append(
            {
                "target": target_name,
                "batch": batch,
                "call": name,
                "model": cfg.name,
                "tokens": batch * width,
                "impl": models.kernels.resolve_impl("auto", dev),
                "flops": flops,
                "bytes": bytes_,
                "weight_bytes": floor["weights"],
                "floor_bytes": floor["weights"] + floor["kv"],
                "compile_s": seconds,
            }
        )
    return out


def analysed_costs(
    cfg, batch, width, slots, sampling, dev, extrapolate: bool, mesh=None
) -> tuple[float, float]:
    """(flops, bytes accessed) of one call of cfg's model compiled for dev. With extrapolate and
    more than 2 layers, the program is compiled with 1 and 2 layers and the per-layer difference
    is scaled to the model's depth: the layers are unrolled identical blocks, so the flops are
    linear in the depth; the bytes XLA counts vary a little with its fusion choices from layer to
    layer (within 15%: tests/test_predicted_speed.py checks both at 3 layers). Two small
    compiles replace one of the whole depth. mesh: None (one device, dev), or a Mesh of compile-only
    devices: the call compiled sharded as spec_jax.generate shards it there (sharding.param_shardings,
    state_shardings), and the costs are one device's (the partitioned program's)."""

    def one(c):
        fn = model_calls(c, batch=batch, widths=[width], cache_slots=slots, sampling=sampling)
        cache = jax.eval_shape(functools.partial(init_cache, c, batch, slots))
        if mesh is None:
            compiled = ct.compile_for(fn, (param_shapes(c), cache), dev, donate_argnums=(1,))
        else:
            params = param_shapes(c)
            args = (
                with_shardings(params, sharding.param_shardings(params, mesh)),
                with_shardings(cache, sharding.state_shardings(cache, mesh, batch)),
            )
            compiled = compile_sharded(fn, args, mesh, donate_argnums=(1,))
        costs = ct.cost_analysis(compiled)
        return np.array([costs["flops"], costs["bytes accessed"]], np.float64)

    if not extrapolate or cfg.num_layers <= 2:
        flops, bytes_ = one(cfg)
    else:
        one_layer = one(dataclasses.replace(cfg, num_layers=1))
        two_layers = one(dataclasses.replace(cfg, num_layers=2))
        flops, bytes_ = one_layer + (cfg.num_layers - 1) * (two_layers - one_layer)
    return float(flops), float(bytes_)


def with_shardings(tree, shardings):
    """ShapeDtypeStructs (or arrays) -> ShapeDtypeStructs carrying the matching shardings."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def compile_sharded(fn, args, mesh, donate_argnums=(), out_shardings=None):
    """compile_targets.compile_for for a mesh of compile-only devices: fn(*args) compiled with the
    shardings its ShapeDtypeStruct args carry (with_shardings), traced under the mesh's first device
    (which the kernel dispatcher reads); out_shardings None lets the partitioner choose."""
    dev = mesh.devices.flat[0]
    kwargs = {} if out_shardings is None else {"out_shardings": out_shardings}
    with jax.default_device(dev):
        lowered = jax.jit(fn, donate_argnums=donate_argnums, **kwargs).trace(*args).lower()
        with ct._not_written_to_persistent_cache():
            return lowered.compile()


@dataclasses.dataclass(frozen=True)
class _Shapes:
    """What bench_roofline.step_bytes reads of a models.Model: its config and (abstract) params."""

    config: object
    params: object


def roofline(call: dict, peak: Peak, dev) -> dict:
    """Adds to one call_costs() dict the roofline time in seconds from the cost analysis's bytes
    ("seconds", and what bounds it) and from the HBM floor's ("floor_seconds", same flops)."""
    share = getattr(dev, "num_cores", peak.tensorcores) / peak.tensorcores  # of the chip
    compute_s = call["flops"] / (peak.flops * share)
    memory_s = call["bytes"] / (peak.bandwidth * share)
    return {
        **call,
        "seconds": max(memory_s, compute_s),
        "bound": "memory" if memory_s >= compute_s else "compute",
        "floor_seconds": max(call["floor_bytes"] / (peak.bandwidth * share), compute_s),
    }


def by_device(calls: list[dict], config):
    """(target, batch, {call name: call}, c) for each target and batch of the config: the calls
    of that device and batch, and c = t_draft / t_decode."""
    for target in config.targets:
        for batch in config.batch_sizes:
            mine = {c["call"]: c for c in calls if (c["target"], c["batch"]) == (target, batch)}
            yield target, batch, mine, mine["draft"]["seconds"] / mine["decode"]["seconds"]


def predict(calls: list[dict], config) -> list[dict]:
    """One row per (target, batch, gamma) from the calls of that target and batch."""
    rows = []
    for target, batch, by_call, c in by_device(calls, config):
        decode, draft = by_call["decode"], by_call["draft"]
        c_floor = draft["floor_seconds"] / decode["floor_seconds"]
        for g in config.gammas:
            verify = by_call[f"verify_{g}"]
            v = verify["seconds"] / decode["seconds"]
            v_floor = verify["floor_seconds"] / decode["floor_seconds"]
            speedup = theory.walltime_speedup(config.alpha, g, c, verify_cost=v)
            ar_rate = batch / decode["seconds"]
            rows.append(
                {
                    "target": target,
                    "batch": batch,
                    "gamma": g,
                    "alpha": config.alpha,
                    "decode_ms": 1e3 * decode["seconds"],
                    "verify_ms": 1e3 * verify["seconds"],
                    "draft_ms": 1e3 * draft["seconds"],
                    "verify_bound": verify["bound"],
                    "v": v,
                    "c": c,
                    "expected_tokens": theory.expected_tokens(config.alpha, g),
                    "theorem_3_8_speedup": theory.walltime_speedup(config.alpha, g, c),
                    "predicted_speedup": speedup,
                    "ar_tokens_per_s": ar_rate,
                    "spec_tokens_per_s": ar_rate * speedup,
                    "v_floor": v_floor,
                    "c_floor": c_floor,
                    "predicted_speedup_floor": theory.walltime_speedup(
                        config.alpha, g, c_floor, verify_cost=v_floor
                    ),
                }
            )
    return rows


def predict_trees(calls: list[dict], config) -> list[dict]:
    """One row per (target, batch, N): the chain of N drafts and the draft model's tree of N nodes,
    each at its measured tokens per verify call, through the same verify call v(N) (module
    docstring)."""
    rows = []
    for target, batch, by_call, c in by_device(calls, config):
        for n, chain, tree in zip(config.tree_nodes, config.chain_lengths, config.tree_lengths, strict=True):
            v = by_call[f"verify_{n}"]["seconds"] / by_call["decode"]["seconds"]
            calls_tree = min(config.tree_depth, n)
            chain_speedup, tree_speedup = chain / (n * c + v), tree / (calls_tree * c + v)
            rows.append(
                {
                    "target": target,
                    "batch": batch,
                    "nodes": n,
                    "v": v,
                    "c": c,
                    "chain_tokens": chain,
                    "tree_tokens": tree,
                    "chain_draft_calls": n,
                    "tree_draft_calls": calls_tree,
                    "chain_speedup": chain_speedup,
                    "tree_speedup": tree_speedup,
                    "tree_vs_chain": tree_speedup / chain_speedup,
                }
            )
    return rows


def best_rows(rows: list[dict]) -> list[dict]:
    """Per (target, batch): v at gamma 4 (the demo's) if computed, c, the best gamma and its speedup."""
    out = []
    for key in dict.fromkeys((r["target"], r["batch"]) for r in rows):
        group = [r for r in rows if (r["target"], r["batch"]) == key]
        best = max(group, key=lambda r: r["predicted_speedup"])
        best_floor = max(group, key=lambda r: r["predicted_speedup_floor"])
        at4 = next((r for r in group if r["gamma"] == DEMO.gamma), None)
        out.append(
            {
                "target": key[0],
                "batch": key[1],
                "decode_ms": best["decode_ms"],
                f"v({DEMO.gamma})": at4["v"] if at4 else "",
                "c": best["c"],
                "best_gamma": best["gamma"],
                "predicted_speedup": best["predicted_speedup"],
                "theorem_3_8_at_best": best["theorem_3_8_speedup"],
                "theorem_3_8_optimal_gamma": theory.optimal_gamma(
                    best["alpha"], best["c"], max_gamma=max(r["gamma"] for r in group)
                ),
                "spec_tokens_per_s": best["spec_tokens_per_s"],
                "floor: c": best_floor["c_floor"],
                "floor: best_gamma": best_floor["gamma"],
                "floor: predicted_speedup": best_floor["predicted_speedup_floor"],
            }
        )
    return out


def figure(rows, config):
    batches = list(config.batch_sizes)
    fig, axes = framework.new_figure(5.5 * len(batches), 4.5, columns=len(batches))
    for ax, batch in zip(axes, batches, strict=True):
        for i, target in enumerate(config.targets):
            group = [r for r in rows if r["target"] == target and r["batch"] == batch]
            style = "-" if target.startswith("tpu") else "--"
            ax.plot(
                [r["gamma"] for r in group],
                [r["predicted_speedup"] for r in group],
                style,
                marker=".",
                color=f"C{i % 10}",
                label=target,
            )
        gammas = list(config.gammas)
        c_mean = float(np.mean([r["c"] for r in rows if r["batch"] == batch]))
        ax.plot(
            gammas,
            [theory.walltime_speedup(config.alpha, g, c_mean) for g in gammas],
            ":",
            color="black",
            label=f"Theorem 3.8, v = 1, c = {c_mean:.2f}",
        )
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xticks(gammas)
        ax.set_xlabel("gamma (draft tokens per round)")
        ax.set_ylabel("predicted speedup (roofline)")
        ax.set_title(f"batch {batch}, alpha = {config.alpha:g}")
        ax.legend(fontsize=6, ncol=2)
    return fig


def pivot(rows, config) -> str:
    """Markdown: one row per (target, batch), one column per gamma: "speedup (v)"."""
    table = []
    for target in config.targets:
        for batch in config.batch_sizes:
            cells = {r["gamma"]: r for r in rows if r["target"] == target and r["batch"] == batch}
            table.append(
                [target, batch]
                + [f"{cells[g]['predicted_speedup']:.2f} ({cells[g]['v']:.2f})" for g in config.gammas]
            )
    return framework.markdown_table(["target", "batch", *(f"gamma {g}" for g in config.gammas)], table)


def markdown(rows, best, calls, config, trees=()) -> str:
    tree_lines = []
    if trees:
        tree_lines = [
            "## Token trees: the draft model's chain and tree of N, at the same verify call",
            "",
            f"Measured tokens per verify call (the pair on code at temperature 0, "
            f"experiments/results/trees/table3.md); the tree's draft calls are min({config.tree_depth}, N), "
            "the chain's N, each costed as c; speedup = tokens / (draft calls * c + v(N)).",
            "",
            framework.dict_table(trees),
            "",
        ]
    lines = [
        "## Predicted speedup at the best gamma",
        "",
        f"alpha = {config.alpha:g} (the pair on code at temperature 0, experiments/results/table3.md); "
        f"{config.dtype} weights; the cache of `make demo` "
        f"({cache_slots(config, model_config(config, config.target))} slots, about half full). Roofline times are lower bounds (no launch overheads, kernels at "
        "peak): read the speedups as what the hardware's bandwidth and flops allow, not as measurements. "
        "No accelerator was lent to this session: there is no measured column.",
        "",
        framework.dict_table(best),
        "",
        "## By gamma",
        "",
        "Each cell: predicted speedup (v(gamma)); c is per row above.",
        "",
        pivot(rows, config),
        "",
        *tree_lines,
        "## Peaks used",
        "",
        _peaks_table(config.targets),
        "",
        "## Model calls (per compile-only device)",
        "",
        "bytes and flops: XLA's cost analysis of the compiled call; weight_bytes: the parameters one "
        "call must read (models.weights.read_bytes); bytes / weight_bytes above 1 is the activations, "
        "the cache, the warp over the vocabulary and whatever the compiler's fusions re-read.",
        "",
        _calls_table(calls),
    ]
    return "\n".join(lines)


def _peaks_table(targets) -> str:
    """Each target's peak bandwidth and flops (PEAKS) and where they come from."""
    return framework.dict_table(
        [
            {
                "target": t,
                "GB/s": PEAKS[t].bandwidth / 1e9,
                "TFLOP/s": PEAKS[t].flops / 1e12,
                "TensorCores per chip": PEAKS[t].tensorcores,
                "source": PEAKS[t].source,
            }
            for t in targets
        ]
    )


def _calls_table(calls) -> str:
    """Each compiled model call's flops, bytes, share of weight bytes, roofline time and bound."""
    return framework.dict_table(
        [
            {
                "target": c["target"],
                "batch": c["batch"],
                "call": c["call"],
                "impl": c["impl"],
                "GFLOP": c["flops"] / 1e9,
                "GB": c["bytes"] / 1e9,
                "bytes / weight_bytes": c["bytes"] / c["weight_bytes"],
                "roofline_ms": 1e3 * c["seconds"],
                "bound": c["bound"],
            }
            for c in calls
        ]
    )


def run(config) -> framework.Result | None:
    if ct.skipped_without_backends("predicted_speed"):
        return None
    calls = []
    for target in config.targets:
        dev = ct.device(target)
        for batch in config.batch_sizes:
            calls += [roofline(c, PEAKS[target], dev) for c in call_costs(config, target, batch)]
    rows = predict(calls, config)
    best = best_rows(rows)
    trees = predict_trees(calls, config)
    return framework.Result(
        columns=COLUMNS,
        rows=[[r[k] for k in COLUMNS] for r in rows],
        markdown=markdown(rows, best, calls, config, trees),
        summary={
            "best": best,
            "trees": trees,
            "calls": calls,
            "peaks": {t: dataclasses.asdict(PEAKS[t]) for t in config.targets},
        },
        figure=figure(rows, config),
        passed=None,
    )
