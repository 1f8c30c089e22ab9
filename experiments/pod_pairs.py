"""Big pairs on pod slices, proven without hardware: the whole speculative loop compiled sharded.

For each (target, draft) pair and each slice of PAIRS, with abstract parameters
(models.weights.param_shapes: no download, no arrays), the two programs `spec_jax.generate` runs,
`spec_prefill` and `spec_loop` (gamma 4, greedy), are compiled for the slice's compile-only devices
(libtpu / XLA's CUDA plugin, models/kernels/compile_targets.py) with the shardings `generate` gives
them on a mesh of every chip on `model` (spec_jax.sharding: Megatron tensor parallelism, the
divisibility rule). Per (pair, slice, batch, precision) the table gives:
- compiles: "yes", or the compiler's error in one line;
- per-device memory of the compiled loop (`compiled.memory_analysis()`): arguments (weights of
  both models + both KV caches + the loop state, the caches donated), temporaries, outputs not
  aliased to an argument; and whether all of that fits the chip's HBM (SLICES);
- the predicted speedup at gamma 4 for each assumed acceptance rate in `alphas`: the roofline times
  of the target's decode and verify calls and the draft's decode step, each compiled sharded on the
  same mesh (experiments/predicted_speed.analysed_costs with `mesh`), through Theorem 3.8 with the
  verify cost (theory.walltime_speedup(alpha, gamma, c, verify_cost=v)).

The model configs are the published config.json files (HF_CONFIGS) read by
models.hf_config.config_from_hf. Shapes of the run: a prompt of `prompt_tokens` (bucketed as
generate buckets it) and `max_new_tokens` new tokens.

  python -m launch.experiment --experiment=pod_pairs            # the docs/pods.md table
  python -m launch.experiment --experiment=pod_pairs --quick    # the smallest pair, one slice

Assumptions (beyond predicted_speed's: roofline lower bounds, no launch overheads): the
collectives' time over ICI / NVLink is not counted (the cost analysis of a partitioned call counts
its local bytes and flops), and the Pallas attention kernels run on gathered operands under a mesh
(docs/pods.md, known gaps), which the bytes and temporaries include.
"""

import dataclasses
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.experimental import topologies
from jax.sharding import Mesh

from experiments import compile_loop, framework
from experiments import predicted_speed as ps
from models.config import ModelConfig
from models.hf_config import config_from_hf
from models.kernels import compile_targets as ct
from models.weights import param_shapes
from spec_jax import sharding, theory, timing
from spec_jax.decode import layout
from spec_jax.drafting.model import ModelDrafter
from spec_jax.sampling import SamplingParams
from spec_jax.speculative import SpecStatic, spec_loop, spec_prefill

TITLE = "Big pairs on pod slices: the speculative loop compiled sharded, memory per device, predicted speedup"

# The published config.json files (huggingface.co/<repo>/blob/main/config.json), the keys the
# decoder reads plus the identifying ones; tokenizer ids and training-only keys left out.
_LLAMA31_ROPE = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}
_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}
_QWEN25 = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_act": "silu",
    "rope_theta": 1000000.0,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
}
HF_CONFIGS = {
    "meta-llama/Llama-3.1-8B": {
        **_LLAMA,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "rope_scaling": _LLAMA31_ROPE,
        "tie_word_embeddings": False,
    },
    "meta-llama/Llama-3.1-70B": {
        **_LLAMA,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_attention_heads": 64,
        "num_hidden_layers": 80,
        "num_key_value_heads": 8,
        "rope_scaling": _LLAMA31_ROPE,
        "tie_word_embeddings": False,
    },
    "meta-llama/Llama-3.2-1B": {
        **_LLAMA,
        "head_dim": 64,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_attention_heads": 32,
        "num_hidden_layers": 16,
        "num_key_value_heads": 8,
        "rope_scaling": {**_LLAMA31_ROPE, "factor": 32.0},
        "tie_word_embeddings": True,
    },
    "Qwen/Qwen2.5-32B": {
        **_QWEN25,
        "hidden_size": 5120,
        "intermediate_size": 27648,
        "max_position_embeddings": 131072,
        "max_window_layers": 64,
        "num_attention_heads": 40,
        "num_hidden_layers": 64,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "sliding_window": 131072,
        "tie_word_embeddings": False,
        "vocab_size": 152064,
    },
    "Qwen/Qwen2.5-0.5B": {
        **_QWEN25,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "max_position_embeddings": 32768,
        "max_window_layers": 24,
        "num_attention_heads": 14,
        "num_hidden_layers": 24,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "sliding_window": 32768,
        "tie_word_embeddings": True,
        "vocab_size": 151936,
    },
}


def model_config(repo: str, dtype: str, **overrides) -> ModelConfig:
    """The ModelConfig of HF_CONFIGS[repo] (config_from_hf) at this precision."""
    fields = config_from_hf(HF_CONFIGS[repo], repo.split("/")[-1])
    return ModelConfig(**{**fields, "dtype": dtype, **overrides})


_GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Slice:
    """A pod slice as compile-only devices. TPU: `topology` is get_topology_desc's name
    ("v5p:2x4x4": chips in x, y, z) and chips_per_host its chips_per_host_bounds (a slice spans
    chips / prod(chips_per_host) hosts: the devices' process_index). CUDA: `topology` is
    "slices x hosts x devices per host" and the GPU is compile_targets.GPU_SPECS[gpu]."""

    platform: str  # "tpu" or "cuda"
    topology: str
    hbm_bytes: int  # per chip (one device per chip: v5p's devices are megacore chips)
    peak: str  # key of experiments/predicted_speed.PEAKS
    chips_per_host: tuple[int, int, int] = (2, 2, 1)
    gpu: str = ""

    def devices(self) -> list:
        return list(_devices(self))


@functools.cache
def _devices(s: Slice) -> tuple:
    if s.platform == "cuda":
        ct.device(f"gpu-{s.gpu}")  # registers the CUDA plugin where jax started without it
        config = ct.GPU_SPECS[s.gpu].target_config()
        return tuple(
            topologies.get_topology_desc(platform="cuda", target_config=config, topology=s.topology).devices
        )
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # as compile_targets.device
    desc = topologies.get_topology_desc(s.topology, "tpu", chips_per_host_bounds=s.chips_per_host)
    return tuple(desc.devices)


SLICES = {
    # v5litepod-8 / v6e-8: one host with 8 chips (2x4).
    "tpu-v5e-2x4": Slice("tpu", "v5e:2x4", 16 * _GIB, "tpu-v5e", chips_per_host=(2, 4, 1)),
    "tpu-v6e-2x4": Slice("tpu", "v6e:2x4", 32 * _GIB, "tpu-v6e", chips_per_host=(2, 4, 1)),
    # v5p-64 (the accelerator type counts TensorCores): 32 chips, 2x4x4, 8 hosts of 4 chips.
    "tpu-v5p-2x4x4": Slice("tpu", "v5p:2x4x4", 95 * _GIB, "tpu-v5p", chips_per_host=(2, 2, 1)),
    # v5p-32: 16 chips, 2x2x4, 4 hosts of 4 chips.
    "tpu-v5p-2x2x4": Slice("tpu", "v5p:2x2x4", 95 * _GIB, "tpu-v5p", chips_per_host=(2, 2, 1)),
    # One host with 8 H100s (the CUDA plugin's topology "1x1x8": one process, 8 devices).
    "gpu-h100-x8": Slice("cuda", "1x1x8", 80 * _GIB, "gpu-h100", gpu="h100"),
    "gpu-h100-x1": Slice("cuda", "1x1x1", 80 * _GIB, "gpu-h100", gpu="h100"),
}

_L8, _L70, _L1 = "meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-70B", "meta-llama/Llama-3.2-1B"
_Q32, _Q05 = "Qwen/Qwen2.5-32B", "Qwen/Qwen2.5-0.5B"
# (target, draft) -> the slices it is compiled for.
PAIRS = {
    (_L8, _L1): ("tpu-v5e-2x4", "gpu-h100-x8", "gpu-h100-x1"),
    (_L70, _L1): ("tpu-v5p-2x4x4", "tpu-v5p-2x2x4"),
    (_Q32, _Q05): ("tpu-v6e-2x4",),
}


def mesh_of(s: Slice) -> Mesh:
    """Every device of the slice on the `model` axis (data 1): tensor parallelism over the slice."""
    devices = np.array(s.devices()).reshape(1, -1)
    return Mesh(devices, sharding.MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2)


@dataclasses.dataclass(frozen=True)
class Shapes:
    """What shapes the compiled programs: batch, gamma, the prompt and the new tokens."""

    batch: int
    gamma: int = 4
    prompt_tokens: int = 1000
    max_new_tokens: int = 256
    num_stop_ids: int = 1


def pair_programs(target_cfg, draft_cfg, mesh: Mesh, shapes: Shapes) -> dict:
    """{"prefill": (fn, args, out_shardings, donate), "loop": ...}: spec_prefill and spec_loop
    of the pair as spec_jax.api.run builds them on `mesh` (sharding.for_mesh configs, parameters
    by the rule table, inputs and state by state_shardings, the loop's state donated and its
    output sharded as its input), greedy; args are ShapeDtypeStructs carrying their shardings."""
    target_cfg, draft_cfg = sharding.for_mesh(target_cfg, mesh), sharding.for_mesh(draft_cfg, mesh)
    b = shapes.batch
    width, cache_len = layout(
        target_cfg, [[0] * shapes.prompt_tokens] * b, shapes.max_new_tokens, shapes.gamma
    )
    prefix = target_cfg.vocab_size if draft_cfg.vocab_size < target_cfg.vocab_size else 0
    drafter = ModelDrafter(draft_cfg, vocab=prefix)
    static = SpecStatic(target_cfg, drafter, shapes.gamma, shapes.max_new_tokens, cache_len)
    inputs = compile_loop.abstract_inputs(b, width, shapes.num_stop_ids)
    params, draft_params = param_shapes(target_cfg), param_shapes(draft_cfg)
    params = ps.with_shardings(params, sharding.param_shardings(params, mesh))
    draft_params = ps.with_shardings(draft_params, drafter.param_shardings(draft_params, mesh))
    inputs = ps.with_shardings(inputs, sharding.state_shardings(inputs, mesh, b))
    prefill = functools.partial(spec_prefill, static)
    state = jax.eval_shape(prefill, params, draft_params, inputs)
    state_shardings = sharding.state_shardings(state, mesh, b)
    state = ps.with_shardings(state, state_shardings)
    return {
        "prefill": (prefill, (params, draft_params, inputs), state_shardings, ()),
        "loop": (functools.partial(spec_loop, static), (params, draft_params, state, inputs.stop_ids),
                 state_shardings, (2,)),
    }  # fmt: skip


def device_bytes(tree) -> int:
    """Bytes one device holds of a pytree of ShapeDtypeStructs with shardings (its largest shard)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shard = x.sharding.shard_shape(x.shape)
        total += int(np.prod(shard)) * jnp.dtype(x.dtype).itemsize
    return total


def memory(compiled) -> dict:
    """Per-device bytes of a compiled program: arguments, temporaries, outputs not aliased to an
    argument (donated buffers are reused), and their sum (what the program needs resident)."""
    m = compiled.memory_analysis()
    out = m.output_size_in_bytes - m.alias_size_in_bytes
    return {
        "arguments": m.argument_size_in_bytes,
        "temps": m.temp_size_in_bytes,
        "outputs": out,
        "total": m.argument_size_in_bytes + m.temp_size_in_bytes + out,
    }


def compile_pair(target: str, draft: str, slice_name: str, shapes: Shapes, dtype: str, **overrides) -> dict:
    """Compiles prefill and loop of the pair for the slice; one dict of what the table reports.
    overrides: ModelConfig fields for both models (the test's scaled-down configs)."""
    s = SLICES[slice_name]
    mesh = mesh_of(s)
    target_cfg, draft_cfg = model_config(target, dtype, **overrides), model_config(draft, dtype, **overrides)
    programs = pair_programs(target_cfg, draft_cfg, mesh, shapes)
    loop_args = programs["loop"][1]
    row = {
        "target": target_cfg.name,
        "draft": draft_cfg.name,
        "slice": slice_name,
        "devices": mesh.devices.size,
        "hosts": len({d.process_index for d in mesh.devices.flat}),
        "batch": shapes.batch,
        "dtype": dtype,
        "weights_GiB": (timing.tree_bytes(loop_args[0]) + timing.tree_bytes(loop_args[1])) / _GIB,
        "weights_per_device_GiB": (device_bytes(loop_args[0]) + device_bytes(loop_args[1])) / _GIB,
        "caches_per_device_GiB": device_bytes((loop_args[2].target_cache, loop_args[2].draft_state)) / _GIB,
        "hbm_GiB": s.hbm_bytes / _GIB,
    }
    for phase, (fn, args, out_shardings, donate) in programs.items():
        start = time.perf_counter()
        try:
            compiled = ps.compile_sharded(fn, args, mesh, donate, out_shardings)
        except Exception as e:  # noqa: BLE001 - a failed compile is a row of the table
            lines = str(e).strip().splitlines()
            row[f"{phase}_compiles"] = f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]
            row[f"{phase}_compile_s"] = time.perf_counter() - start
            continue
        row[f"{phase}_compiles"] = "yes"
        row[f"{phase}_compile_s"] = time.perf_counter() - start
        for key, value in memory(compiled).items():
            row[f"{phase}_{key}_GiB"] = value / _GIB
        del compiled
    if "loop_total_GiB" in row:
        row["fits"] = max(row["loop_total_GiB"], row.get("prefill_total_GiB", 0.0)) <= row["hbm_GiB"]
    print(
        f"pod_pairs: {row['target']}+{row['draft']} {slice_name} B={shapes.batch} {dtype}: "
        f"prefill {row['prefill_compiles']} ({row['prefill_compile_s']:.0f} s), "
        f"loop {row['loop_compiles']} ({row['loop_compile_s']:.0f} s)",
        file=sys.stderr,
        flush=True,
    )
    return row


def predicted(
    target: str, draft: str, slice_name: str, shapes: Shapes, dtype: str, alphas, **overrides
) -> dict:
    """Roofline times of the target's decode and verify(gamma) calls and the draft's decode step,
    each compiled sharded on the slice's mesh (predicted_speed.analysed_costs), and the speedup
    each alpha predicts (Theorem 3.8 with the verify call's cost)."""
    s = SLICES[slice_name]
    mesh = mesh_of(s)
    peak = ps.PEAKS[s.peak]
    dev = mesh.devices.flat[0]

    def costed(repo):
        cfg = model_config(repo, dtype, **overrides)
        return sharding.for_mesh(dataclasses.replace(cfg, scan_layers=False, attention_impl="auto"), mesh)

    target_cfg, draft_cfg = costed(target), costed(draft)
    slots = layout(target_cfg, [[0] * shapes.prompt_tokens], shapes.max_new_tokens, shapes.gamma)[1]
    greedy = SamplingParams(0.0)
    seconds = {}
    for name, (cfg, width) in {
        "decode": (target_cfg, 1),
        "verify": (target_cfg, shapes.gamma + 1),
        "draft": (draft_cfg, 1),
    }.items():
        flops, bytes_ = ps.analysed_costs(cfg, shapes.batch, width, slots, greedy, dev, True, mesh=mesh)
        call = {"flops": flops, "bytes": bytes_, "floor_bytes": 0.0}
        seconds[name] = ps.roofline(call, peak, dev)["seconds"]
    v, c = seconds["verify"] / seconds["decode"], seconds["draft"] / seconds["decode"]
    out = {"decode_ms": 1e3 * seconds["decode"], "v": v, "c": c}
    for alpha in alphas:
        out[f"speedup_alpha_{alpha:g}"] = theory.walltime_speedup(alpha, shapes.gamma, c, verify_cost=v)
    return out


def get_config(quick: bool = False) -> ml_collections.ConfigDict:
    """Full: every pair of PAIRS on its slices, batch 1 and 8, a 1000-token prompt and 256 new
    tokens, bfloat16. Quick: the Llama 8B / 1B pair on the v5e 2x4 slice at batch 1, a 128-token
    prompt and 64 new tokens (about 20 s: the layers are scanned, so the full depth compiles as
    fast as 2 layers; the prompt's length is what the prefill's compile time grows with)."""
    config = ml_collections.ConfigDict()
    config.pairs = ("llama-8b",) if quick else tuple(PAIR_NAMES)
    config.slices = ("tpu-v5e-2x4",) if quick else ()  # () : each pair's own slices (PAIRS)
    config.batch_sizes = (1,) if quick else (1, 8)
    config.dtypes = ("bfloat16",)  # --set=dtypes=bfloat16,int8: an int8 row beside each (twice the time)
    config.gamma = 4
    config.alphas = (0.6, 0.8)
    config.prompt_tokens = 128 if quick else 1000
    config.max_new_tokens = 64 if quick else 256
    config.num_layers = 0  # 0: the models' own depths; else both models cut to that many layers
    config.predict = True
    return config


PAIR_NAMES = {"llama-8b": (_L8, _L1), "llama-70b": (_L70, _L1), "qwen-32b": (_Q32, _Q05)}
INT_RANGES = {
    "gamma": (1, 16),
    "prompt_tokens": (1, 1 << 17),
    "max_new_tokens": (1, 1 << 17),
    "num_layers": (0, 1024),
}
TUPLE_RANGES = {"batch_sizes": (int, 1, 1024), "alphas": (float, 0.0, 0.999)}


def validate(config) -> None:
    bad = [p for p in config.pairs if p not in PAIR_NAMES]
    if bad or not config.pairs:
        raise ValueError(f"pairs: must be a non-empty list out of {', '.join(PAIR_NAMES)}, got {bad}")
    bad = [s for s in config.slices if s not in SLICES]
    if bad:
        raise ValueError(
            f"slices: must be a list out of {', '.join(SLICES)} (empty: each pair's own), got {bad}"
        )
    bad = [d for d in config.dtypes if d not in ("bfloat16", "int8", "float32")]
    if bad or not config.dtypes:
        raise ValueError(f"dtypes: must be a non-empty list out of bfloat16, int8, float32, got {bad}")


COLUMNS_SHOWN = (
    "target", "draft", "slice", "hosts", "batch", "dtype", "loop_compiles", "prefill_compiles",
    "weights_per_device_GiB", "caches_per_device_GiB", "loop_arguments_GiB", "loop_temps_GiB",
    "loop_outputs_GiB", "prefill_temps_GiB", "hbm_GiB", "fits", "decode_ms", "v", "c",
)  # fmt: skip


def run(config) -> framework.Result | None:
    if ct.skipped_without_backends("pod_pairs"):
        return None
    overrides = {"num_layers": config.num_layers} if config.num_layers else {}
    rows = []
    for pair in config.pairs:
        target, draft = PAIR_NAMES[pair]
        for slice_name in config.slices or PAIRS[target, draft]:
            for batch in config.batch_sizes:
                shapes = Shapes(batch, config.gamma, config.prompt_tokens, config.max_new_tokens)
                for dtype in config.dtypes:
                    row = compile_pair(target, draft, slice_name, shapes, dtype, **overrides)
                    if config.predict:
                        row.update(
                            predicted(target, draft, slice_name, shapes, dtype, config.alphas, **overrides)
                        )
                    rows.append(row)
    shown = [{k: r[k] for k in (*COLUMNS_SHOWN, *_speedup_keys(config)) if k in r} for r in rows]
    return framework.Result.from_dicts(rows, markdown=markdown(shown, config), summary={"rows": shown})


def _speedup_keys(config) -> list[str]:
    return [f"speedup_alpha_{a:g}" for a in config.alphas]


def markdown(shown, config) -> str:
    return "\n".join(
        [
            "## Per pair, slice and batch",
            "",
            f"gamma {config.gamma}, greedy; a {config.prompt_tokens}-token prompt (bucketed) and "
            f"{config.max_new_tokens} new tokens; every chip on the `model` axis. GiB per device from "
            "`compiled.memory_analysis()` of the loop (arguments: both models' weights and KV caches and "
            "the loop state; temps; outputs not aliased to the donated state); fits: loop and prefill "
            "totals within the chip's HBM. Speedups: roofline times of the sharded calls (lower bounds, "
            "collectives' time not counted), Theorem 3.8 with the verify cost, at the stated alpha.",
            "",
            framework.dict_table(shown),
        ]
    )
