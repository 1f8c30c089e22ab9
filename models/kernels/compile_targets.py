"""Compile the kernels and the model for real TPUs and GPUs on a CPU-only host.

libtpu and XLA's CUDA plugin both offer compile-only devices: `jax.experimental.topologies`
describes a TPU slice or a GPU (from a GpuTargetConfigProto) without the hardware, and compiling
for such a device runs the real device compilers (libtpu's Mosaic compiler and XLA:TPU; XLA:GPU,
Triton -> PTX -> cubin for that compute capability and shared-memory limit), everything but
running. Install (pinned in constraints.txt; `make test` does this):

    pip install --target .venv-compile --no-deps "libtpu==0.0.42.*" jax-cuda12-pjrt==0.10.2 nvidia-cuda-nvcc-cu12==12.9.86

tests/conftest.py and scripts/compile_sweep.py put .venv-compile on their own sys.path before
importing jax. Installed into the venv itself (`pip install -e ".[compile]"`) they work too, but
the CUDA plugin then logs three lines ("cuda_plugin_extension is not found", ...) at every jax
start-up of every program, which breaks the CLI tests' one-line-stderr checks.

XLA:GPU assembles PTX with a ptxas binary: nvidia-cuda-nvcc-cu12 ships CUDA 12.9's, which jax
finds first (a system CUDA 13 toolkit has none for Volta, sm_70). Only the PJRT part of the CUDA
plugin is needed (`jax-cuda12-plugin` adds the CUDA runtime
bindings, which log at every `import jax` on a machine without CUDA). Run with JAX_PLATFORMS=cpu:
the host backend stays the CPU, and libtpu / the CUDA plugin are loaded only for these devices.

`compile_case(case, target_name)` traces, lowers and compiles one `Case` (one attention call, or
one whole-model step) for one named target under `jax.default_device(device)`, which is what the
dispatcher and the kernels read (models.kernels.target.current()); `compile_for(fn, args, device)`
does the same for any function of ShapeDtypeStructs. Used by
tests/test_compile_targets.py (a few cases in `make test`) and scripts/compile_sweep.py (all).
"""

import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
from jax._src import xla_bridge
from jax._src.lib import xla_client
from jax.experimental import topologies

import models.kernels
from models import transformer
from models.config import ModelConfig

INSTALL_HINT = (
    "make .venv-compile/.installed-stamp, or: pip install --target .venv-compile --no-deps "
    '"libtpu==0.0.42.*" jax-cuda12-pjrt==0.10.2 nvidia-cuda-nvcc-cu12==12.9.86'
)

# TPU targets: generation name -> the smallest slice the topology API takes (one device is used).
TPU_TOPOLOGIES = {
    "tpu-v2": "v2:2x2",
    "tpu-v3": "v3:2x2",
    "tpu-v4": "v4:2x2x1",
    "tpu-v5e": "v5e:2x2",
    "tpu-v5p": "v5p:2x2x1",
    "tpu-v6e": "v6e:2x2",
}


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """The facts XLA:GPU compiles against (a stream_executor.GpuTargetConfigProto, in text form)."""

    name: str
    compute_capability: tuple[int, int]
    core_count: int
    shared_memory_per_block_optin: int  # bytes: the most one block may use
    shared_memory_per_core: int
    threads_per_core_limit: int
    device_memory_size: int
    memory_bandwidth: int  # bytes / s
    l2_cache_size: int
    clock_rate_ghz: float

    def target_config(self) -> str:
        major, minor = self.compute_capability
        return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {self.shared_memory_per_core}
  threads_per_core_limit: {self.threads_per_core_limit}
  core_count: {self.core_count}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {self.memory_bandwidth}
  l2_cache_size: {self.l2_cache_size}
  clock_rate_ghz: {self.clock_rate_ghz}
  device_memory_size: {self.device_memory_size}
  shared_memory_per_block_optin: {self.shared_memory_per_block_optin}
  cuda_compute_capability {{
    major: {major}
    minor: {minor}
  }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
}}
platform_name: "CUDA"
device_description_str: "{self.name}"
"""


_KIB, _GIB = 1024, 2**30
# Public specifications (NVIDIA data sheets and the CUDA C Programming Guide's per-compute-
# capability table); shared memory per block is the opt-in maximum.
GPU_SPECS = {
    "h100": GpuSpec("NVIDIA H100 80GB HBM3", (9, 0), 132, 227 * _KIB, 228 * _KIB, 2048, 80 * _GIB,
                    3_352_000_000_000, 50 * 2**20, 1.98),
    "a100": GpuSpec("NVIDIA A100-SXM4-40GB", (8, 0), 108, 163 * _KIB, 164 * _KIB, 2048, 40 * _GIB,
                    1_555_000_000_000, 40 * 2**20, 1.41),
    "rtx-a6000": GpuSpec("NVIDIA RTX A6000", (8, 6), 84, 99 * _KIB, 100 * _KIB, 1536, 48 * _GIB,
                         768_000_000_000, 6 * 2**20, 1.80),
    "l4": GpuSpec("NVIDIA L4", (8, 9), 58, 99 * _KIB, 100 * _KIB, 1536, 24 * _GIB,
                  300_000_000_000, 48 * 2**20, 2.04),
    "v100": GpuSpec("Tesla V100-SXM2-16GB", (7, 0), 80, 96 * _KIB, 96 * _KIB, 2048, 16 * _GIB,
                    898_000_000_000, 6 * 2**20, 1.53),
    "t4": GpuSpec("Tesla T4", (7, 5), 40, 64 * _KIB, 64 * _KIB, 1024, 16 * _GIB,
                  320_000_000_000, 4 * 2**20, 1.59),
}  # fmt: skip
GPU_TARGETS = {f"gpu-{name}": spec for name, spec in GPU_SPECS.items()}
TARGETS = (*TPU_TOPOLOGIES, *GPU_TARGETS)


_PACKAGES = (
    ("libtpu", "libtpu"),
    ("jax_plugins.xla_cuda12", "jax-cuda12-pjrt"),
    ("nvidia.cuda_nvcc", "nvidia-cuda-nvcc-cu12"),
)


# Where `make test` installs the three packages (tests/conftest.py and scripts/compile_sweep.py add
# the same folder to their path before importing jax).
COMPILE_DEPS = os.environ.get(
    "SPEC_JAX_COMPILE_DEPS",
    os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), ".venv-compile"
    ),
)


def add_compile_deps() -> None:
    """Appends COMPILE_DEPS to sys.path (if it exists and is not there): for programs that started
    jax before they knew they would compile for TPUs / GPUs (the experiment launcher). device()
    registers the CUDA plugin itself when jax's plugin discovery ran before it was on the path."""
    if os.path.isdir(COMPILE_DEPS) and COMPILE_DEPS not in sys.path:
        sys.path.append(COMPILE_DEPS)
    # jax finds the pinned ptxas through the package only when it was on the path at import;
    # otherwise XLA looks on PATH, where a system CUDA 13 ptxas has no Volta (sm_70) target.
    nvcc_bin = os.path.join(COMPILE_DEPS, "nvidia", "cuda_nvcc", "bin")
    if os.path.isdir(nvcc_bin) and nvcc_bin not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = nvcc_bin + os.pathsep + os.environ.get("PATH", "")


def missing_packages() -> list[str]:
    """Which packages of the `compile` extra are not installed (empty when all are)."""

    def installed(module: str) -> bool:
        try:
            return importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a parent package (jax_plugins) is absent
            return False

    return [package for module, package in _PACKAGES if not installed(module)]


def skipped_without_backends(name: str) -> bool:
    """For what compiles for TPUs / GPUs on this host (the predicted_speed and pod_pairs
    experiments): puts the compile-only backends on the path (add_compile_deps) and returns
    False; True, having printed `NAME: skipped, ...` with INSTALL_HINT to stderr, where one of
    them is not installed."""
    add_compile_deps()
    if missing := missing_packages():
        print(
            f"{name}: skipped, compile-only TPU/GPU backends not installed ({', '.join(missing)}): {INSTALL_HINT}",
            file=sys.stderr,
        )
        return True
    return False


@functools.cache
def device(target):
    """A compile-only jax Device for a name in TARGETS or a GpuSpec; ValueError naming TARGETS else."""
    if isinstance(target, GpuSpec):
        add_compile_deps()  # the pinned ptxas on PATH, whoever put the packages on sys.path
        config = target.target_config()
        try:
            topology = topologies.get_topology_desc(platform="cuda", target_config=config, topology="1x1x1")
        except NotImplementedError:  # "topology not implemented for cuda": see _register_cuda_plugin
            _register_cuda_plugin()
            topology = topologies.get_topology_desc(platform="cuda", target_config=config, topology="1x1x1")
        return topology.devices[0]
    if target in TPU_TOPOLOGIES:
        # libtpu takes a machine-wide lock unless told that several processes may load it (pytest
        # workers, a sweep beside a test run); compile-only devices share nothing.
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        return topologies.get_topology_desc(TPU_TOPOLOGIES[target], "tpu").devices[0]
    if target in GPU_TARGETS:
        return device(GPU_TARGETS[target])
    raise ValueError(f"target must be one of {TARGETS}, got {target!r}")


def _register_cuda_plugin() -> None:
    """jax registers PJRT plugins once, when it first starts a backend; a process that put the
    CUDA plugin on its path after that (add_compile_deps) registers it here by calling the plugin's
    own initialize(), which is what jax's discovery calls. Re-raises if it is not installed."""
    plugin = importlib.import_module("jax_plugins.xla_cuda12")
    plugin.initialize()


def place(tree, dev):
    """ShapeDtypeStructs (or arrays) -> ShapeDtypeStructs on `dev`."""
    sharding = jax.sharding.SingleDeviceSharding(dev)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def lower_for(fn, args, dev, donate_argnums=()):
    """jax.stages.Lowered of fn(*args) traced for `dev` (under jax.default_device, which the
    dispatcher and the kernels read); args are ShapeDtypeStructs, placed on `dev` here."""
    with jax.default_device(dev):
        return jax.jit(fn, donate_argnums=donate_argnums).trace(*place(args, dev)).lower()


@contextlib.contextmanager
def _not_written_to_persistent_cache():
    """JAX's persistent compilation cache (spec_jax.executables.enable_persistent_cache) writes
    nothing inside: a compile-only executable is written, but reading it back fails ("PjRtCompiler
    must be constructed with a Client to call DeserializeLoadedExecutable", a warning per program)
    and it is compiled again. JAX checks this threshold when it writes, after each compile."""
    key = "jax_persistent_cache_min_compile_time_secs"
    previous = getattr(jax.config, key)
    jax.config.update(key, math.inf)
    try:
        yield
    finally:
        jax.config.update(key, previous)


def compile_for(fn, args, dev, donate_argnums=()):
    """Runs the device compiler on fn(*args) for `dev`; its errors propagate. Returns the
    jax.stages.Compiled (its cost_analysis() is what experiments/predicted_speed.py reads).
    Never written to JAX's persistent compilation cache (it could not be read back)."""
    lowered = lower_for(fn, args, dev, donate_argnums)
    with jax.default_device(dev), _not_written_to_persistent_cache():
        return lowered.compile()


# Head shapes of the registered models (models.registry; the configs come from the GGUF at load
# time, these are the same numbers). Whole-model checks use 2 of the layers: with scan_layers the
# compiled program is one layer body in a loop, the same for 2 layers as for 28.
MODELS = {
    "qwen2.5-coder-1.5b": ModelConfig(
        vocab_size=151936, num_layers=28, d_model=1536, num_heads=12, num_kv_heads=2, head_dim=128,
        mlp_dim=8960, rope_theta=1e6, qkv_bias=True, tie_embeddings=False, max_seq_len=32768,
        name="qwen2.5-coder-1.5b",
    ),
    "qwen2.5-coder-0.5b": ModelConfig(
        vocab_size=151936, num_layers=24, d_model=896, num_heads=14, num_kv_heads=2, head_dim=64,
        mlp_dim=4864, rope_theta=1e6, qkv_bias=True, tie_embeddings=True, max_seq_len=32768,
        name="qwen2.5-coder-0.5b",
    ),
    "smollm2-135m": ModelConfig(
        vocab_size=49152, num_layers=30, d_model=576, num_heads=9, num_kv_heads=3, head_dim=64,
        mlp_dim=1536, rope_theta=1e5, qkv_bias=False, tie_embeddings=True, max_seq_len=8192,
        name="smollm2-135m",
    ),
}  # fmt: skip
CHECK_LAYERS = 2
KINDS = ("kernel", "model")
IMPL_CHOICES = ("auto", "forced")


@dataclasses.dataclass(frozen=True)
class Case:
    """One compile: an attention call ("kernel") or a model step ("model") of a registered model.

    num_queries: T, 1 for decode, gamma + 1 for verification, the bucket for prefill.
    cache_len: S, keys in the cache. impl: "auto" (what the dispatcher picks for the target) or
    "forced" (the target's Pallas impl, even where "auto" would not pick it).
    """

    kind: str
    model: str
    batch: int
    cache_len: int
    num_queries: int
    dtype: str
    impl: str = "forced"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {tuple(MODELS)}, got {self.model!r}")
        if self.impl not in IMPL_CHOICES:
            raise ValueError(f"impl must be one of {IMPL_CHOICES}, got {self.impl!r}")
        if not 1 <= self.num_queries <= self.cache_len:
            raise ValueError(
                f"num_queries must be in [1, cache_len={self.cache_len}], got {self.num_queries}"
            )

    @property
    def step(self) -> str:
        if self.num_queries == 1:
            return "decode"
        return "verify" if self.num_queries <= models.kernels.DECODE_MAX_QUERIES else "prefill"

    @property
    def config(self) -> ModelConfig:
        return dataclasses.replace(MODELS[self.model], dtype=self.dtype, num_layers=CHECK_LAYERS)

    def label(self) -> str:
        impl = "" if self.impl == "forced" else " auto"
        return (
            f"{self.kind} {self.model} {self.step} B={self.batch} S={self.cache_len} "
            f"T={self.num_queries} {self.dtype}{impl}"
        )


@dataclasses.dataclass(frozen=True)
class Result:
    status: str  # "ok"; "refused": a trace-time ValueError of the kernels; "FAIL": the compiler's error
    impl: str  # the attention impl the program was traced with
    seconds: float
    error: str = ""  # first line of the error

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def pallas_impl(target_name: str) -> str:
    return "pallas_tpu" if target_name in TPU_TOPOLOGIES else "pallas_gpu"


def auto_differs(target_name: str) -> bool:
    """Whether impl="auto" picks something other than the target's Pallas impl (pre-Ampere GPUs)."""
    return models.kernels.resolve_impl("auto", device(target_name)) != pallas_impl(target_name)


def case_program(case: Case, target_name: str):
    """(function, abstract arguments, impl) of one case; impl is the config's attention_impl."""
    impl = "auto" if case.impl == "auto" else pallas_impl(target_name)
    cfg = case.config
    b, s, t, dtype = case.batch, case.cache_len, case.num_queries, jnp.dtype(case.dtype)
    ints = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    if case.kind == "kernel":
        args = (
            jax.ShapeDtypeStruct((b, t, cfg.num_heads, cfg.head_dim), dtype),
            jax.ShapeDtypeStruct((b, s, cfg.num_kv_heads, cfg.head_dim), dtype),
            jax.ShapeDtypeStruct((b, s, cfg.num_kv_heads, cfg.head_dim), dtype),
            ints((b, t)),
            ints((b,)),
        )
        return functools.partial(models.kernels.attention, impl=impl), args, impl
    cfg = dataclasses.replace(cfg, attention_impl=impl)
    params = transformer.param_shapes(cfg)
    cache = jax.eval_shape(lambda: transformer.init_cache(cfg, b, s))
    # Prefill asks for the last position's logits only, as the decode loop does.
    logits_at = ints((b, 1)) if case.step == "prefill" else None
    fn = functools.partial(transformer.forward, cfg)
    return fn, (params, ints((b, t)), ints((b, t)), cache, logits_at), impl


def compile_case(case: Case, target_name: str) -> Result:
    """Traces, lowers and compiles `case` for the target; errors become a Result that says which."""
    fn, args, impl = case_program(case, target_name)
    return compile_program(fn, args, impl, target_name)


def compile_program(fn, args, impl: str, target_name: str, donate_argnums=()) -> Result:
    """compile_for(fn, args) for the target as a Result; impl is the attention impl the program's
    configs ask for (reported as what it resolves to on the target)."""
    dev = device(target_name)
    resolved = models.kernels.resolve_impl(impl, dev)
    start = time.perf_counter()
    try:
        compile_for(fn, args, dev, donate_argnums)
    except Exception as e:  # noqa: BLE001 - every error is a result to report
        lines = str(e).strip().splitlines()
        status = "refused" if isinstance(e, ValueError) else "FAIL"
        return Result(
            status, resolved, time.perf_counter() - start, f"{type(e).__name__}: {lines[0] if lines else ''}"
        )
    return Result("ok", resolved, time.perf_counter() - start)


def cost_analysis(compiled) -> dict:
    """{"flops", "bytes accessed"} of a compiled program: XLA's HloCostAnalysis of the program the
    device compiler produced (after fusion; a while loop's body counted once, whatever its trip
    count; a Pallas kernel's custom call at most what its cost estimate says). Where the backend
    does not provide it (the CUDA plugin's compile-only executables: "GetCostAnalysis is not
    supported") the same analysis is run by the host's XLA on the optimized HLO module; on TPU the
    two agree within 0.1%."""
    costs = compiled.cost_analysis()
    if isinstance(costs, list | tuple):
        costs = costs[0] if costs else None
    if not costs:
        (module,) = compiled.runtime_executable().hlo_modules()
        costs = xla_client._xla.hlo_module_cost_analysis(xla_bridge.get_backend("cpu"), module)
    return {key: float(costs.get(key, 0.0)) for key in ("flops", "bytes accessed")}


def has_pallas_kernel(lowered_text: str, impl: str) -> bool:
    """Whether lowered StableHLO holds a Pallas kernel of `impl` (Mosaic or Triton custom call)."""
    marker = {"pallas_tpu": "tpu_custom_call", "pallas_gpu": "__gpu$xla.gpu.triton"}.get(impl)
    return marker is not None and marker in lowered_text
