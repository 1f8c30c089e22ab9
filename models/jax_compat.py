"""Every branch on the installed jax's version, in one place.

The project pins jax 0.10.2 (constraints.txt) and also runs on jax 0.11.x, the jax of the GPU
machines at hand (scripts/device_check.py). What differs between the two is named here, so that
the rest of the code asks this module instead of comparing versions itself. Nothing here imports
jax: tests/conftest.py reads it before the backends start.

What else differs under jax 0.11.2 (Python 3.12), found by running the suite's core files and
scripts/device_check.py's dry run there, and needing no branch:
- lowering a Triton (pallas_gpu) kernel on a host without a GPU needs the GPU named: jax 0.11
  reads its compute capability from the device traced for (tests/test_kernels.py traces under an
  abstract H100, which jax 0.10 accepts too); on a GPU nothing changes;
- jax 0.11 warns that Pallas's Triton backend is deprecated in favour of Mosaic GPU (it still
  lowers and runs: models/kernels' GPU kernels are Triton kernels);
- pallas_tpu's interpret mode (pltpu.InterpretParams, CPU tests only) inside the scanned model
  fails flax's nn.scan check ("broadcasted variable has a data dependency on the scan body"):
  tests/test_kernels.py's slow-tier greedy loop under pallas_tpu; a real TPU runs no interpreter.
"""

import importlib.metadata


def jax_version() -> tuple[int, int, int]:
    """The installed jax's (major, minor, patch), read from its package metadata."""
    parts = importlib.metadata.version("jax").split(".")[:3]
    return tuple(int("".join(c for c in p if c.isdigit()) or 0) for p in parts)  # "2rc1" -> 2


def has_cpu_fusion_emitters_flag() -> bool:
    """Whether XLA:CPU takes --xla_cpu_use_fusion_emitters: jax 0.10's does (the MLIR fusion
    emitters can be turned off); jax 0.11's XLA removed the flag (the emitters are the only
    path) and aborts the process at backend start-up on an XLA_FLAGS that names it."""
    return jax_version() < (0, 11, 0)


def fast_compile_xla_flags() -> str:
    """XLA_FLAGS that make XLA:CPU compile the suite's many small programs fastest on this jax
    (tests/conftest.py says what each saves): no LLVM optimizations, each program's machine code
    emitted as one LLVM module rather than split for parallel code generation, and on jax 0.10
    XLA:CPU's older elemental emitters instead of its MLIR fusion emitters."""
    flags = ["--xla_backend_optimization_level=0", "--xla_cpu_parallel_codegen_split_count=1"]
    if has_cpu_fusion_emitters_flag():
        flags.append("--xla_cpu_use_fusion_emitters=false")
    return " ".join(flags)
