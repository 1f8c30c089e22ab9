"""The hardware a kernel is traced for, and the facts about it that decide tiling and dispatch.

A Pallas kernel is traced on the host, possibly for a device that is not there (a compile-only
device from `jax.experimental.topologies`). The device in effect while tracing is, in order: the
abstract device of the current abstract mesh, `jax.default_device`, the default backend's first
device. `current()` describes that device as a `Target`; `for_device(d)` describes any device.

What the kernels read from a Target:
  TPU: the generation (v2 and v3 have no bfloat16 matmul: Mosaic rejects a bf16 RHS, so the
    kernels multiply in float32 there) and the VMEM per core (16 MiB on v2-v4, 64 MiB on v5p and
    TPU7x, 128 MiB on v5e and v6e: the VMEM working set of a kernel must fit it).
  GPU: the CUDA compute capability (XLA compiles Triton kernels only for 8.0 and up, so "auto"
    uses the XLA reference on older GPUs) and the shared memory one block may use (the opt-in
    maximum: 163 KiB on sm_80/87, 99 KiB on sm_86/89/120, 227 KiB on sm_90/100).
Unknown values (a CPU host tracing in interpret mode, an abstract device, an unlisted device kind)
resolve to the smallest of the modern parts, so that defaults chosen for them compile anywhere.
"""

import dataclasses
import re

import jax

PLATFORMS = ("cpu", "tpu", "gpu")

# TPU device_kind -> (generation, VMEM bytes per TensorCore); same facts as jax's Pallas tpu_info.
_MIB = 2**20
TPU_KINDS = {
    "TPU v2": (2, 16 * _MIB),
    "TPU v3": (3, 16 * _MIB),
    "TPU v4": (4, 16 * _MIB),
    "TPU v4 lite": (4, 16 * _MIB),
    "TPU v5 lite": (5, 128 * _MIB),
    "TPU v5e": (5, 128 * _MIB),
    "TPU v5": (5, 64 * _MIB),
    "TPU v5p": (5, 64 * _MIB),
    "TPU v6 lite": (6, 128 * _MIB),
    "TPU v6e": (6, 128 * _MIB),
    "TPU7": (7, 64 * _MIB),
    "TPU7x": (7, 64 * _MIB),
}
DEFAULT_TPU_VMEM_BYTES = 16 * _MIB  # the smallest listed
# First TPU generation whose MXU takes bfloat16 operands in Mosaic kernels.
TPU_BF16_MATMUL_GENERATION = 4

# CUDA compute capability -> the most shared memory one thread block may use (opt-in), bytes
# (CUDA C Programming Guide, "Technical Specifications per Compute Capability").
GPU_SHARED_MEMORY_PER_BLOCK = {
    (7, 0): 96 * 1024,
    (7, 5): 64 * 1024,
    (8, 0): 163 * 1024,
    (8, 6): 99 * 1024,
    (8, 7): 163 * 1024,
    (8, 9): 99 * 1024,
    (9, 0): 227 * 1024,
    (10, 0): 227 * 1024,
    (10, 3): 227 * 1024,
    (12, 0): 99 * 1024,
    (12, 1): 99 * 1024,
}
DEFAULT_GPU_SHARED_MEMORY_PER_BLOCK = 99 * 1024  # the smallest from compute capability 8.0 on
# XLA compiles Pallas Triton kernels only from Ampere on.
TRITON_MIN_COMPUTE_CAPABILITY = (8, 0)


@dataclasses.dataclass(frozen=True)
class Target:
    """One device, as far as the kernels care. Frozen and hashable: a static argument of jax.jit.

    platform: "tpu", "gpu" or "cpu" (anything else that is not a TPU or GPU counts as "cpu").
    device_kind: the device's own name, for messages ("TPU v5 lite", "NVIDIA H100 80GB HBM3").
    tpu_generation: TPU only; None when unknown.
    vmem_bytes: TPU VMEM per core; None when unknown (then DEFAULT_TPU_VMEM_BYTES).
    compute_capability: CUDA only, (major, minor); None when unknown or not CUDA (ROCm).
    shared_memory_per_block: GPU bytes per block; None when unknown (from compute_capability,
      else DEFAULT_GPU_SHARED_MEMORY_PER_BLOCK).
    """

    platform: str
    device_kind: str = ""
    tpu_generation: int | None = None
    vmem_bytes: int | None = None
    compute_capability: tuple[int, int] | None = None
    shared_memory_per_block: int | None = None

    def __post_init__(self):
        if self.platform not in PLATFORMS:
            raise ValueError(f"platform must be one of {PLATFORMS}, got {self.platform!r}")

    @property
    def tpu_vmem_bytes(self) -> int:
        return self.vmem_bytes or DEFAULT_TPU_VMEM_BYTES

    @property
    def tpu_bf16_matmul(self) -> bool:
        """False on TPU v2 / v3, whose Mosaic matmul rejects bfloat16 operands."""
        return self.tpu_generation is None or self.tpu_generation >= TPU_BF16_MATMUL_GENERATION

    @property
    def gpu_shared_memory_per_block(self) -> int:
        if self.shared_memory_per_block:
            return self.shared_memory_per_block
        if self.compute_capability in GPU_SHARED_MEMORY_PER_BLOCK:
            return GPU_SHARED_MEMORY_PER_BLOCK[self.compute_capability]
        return DEFAULT_GPU_SHARED_MEMORY_PER_BLOCK

    @property
    def triton_supported(self) -> bool:
        """False for CUDA GPUs older than Ampere (XLA: "Triton support is only enabled for Ampere")."""
        return self.compute_capability is None or self.compute_capability >= TRITON_MIN_COMPUTE_CAPABILITY

    def describe(self, platform: str | None = None) -> str:
        """The device's name for messages; "an unspecified TPU" etc. when tiling for another platform's
        defaults (interpret mode, lowering on a CPU host)."""
        if platform is not None and platform != self.platform:
            return f"an unspecified {platform.upper()}"
        if self.platform == "gpu" and self.compute_capability:
            return (
                f"{self.device_kind or 'GPU'} (sm_{self.compute_capability[0]}{self.compute_capability[1]})"
            )
        return self.device_kind or self.platform


def _compute_capability(device) -> tuple[int, int] | None:
    value = getattr(device, "compute_capability", None)
    match = re.fullmatch(r"(\d+)\.(\d+)", str(value)) if value is not None else None
    return (int(match.group(1)), int(match.group(2))) if match else None


def for_device(device) -> Target:
    """Describes a jax Device (real or compile-only) or a jax.sharding.AbstractDevice."""
    platform = str(getattr(device, "platform", "cpu")).lower()
    kind = str(getattr(device, "device_kind", ""))
    if platform == "tpu":
        generation, vmem = TPU_KINDS.get(kind, (None, None))
        if generation is None and (match := re.search(r"v?(\d+)", kind.removeprefix("TPU"))):
            generation = int(match.group(1))
        return Target("tpu", kind, tpu_generation=generation, vmem_bytes=vmem)
    if platform in ("gpu", "cuda", "rocm"):
        return Target("gpu", kind, compute_capability=_compute_capability(device))
    return Target("cpu", kind)


def current_device():
    """The device a computation traced now is meant for (see the module docstring)."""
    abstract = jax.sharding.get_abstract_mesh().abstract_device
    if abstract is not None:
        return abstract
    default = jax.config.jax_default_device
    if isinstance(default, str):
        return jax.devices(default)[0]
    return default if default is not None else jax.devices()[0]


def current() -> Target:
    """The Target of `current_device()`."""
    return for_device(current_device())
