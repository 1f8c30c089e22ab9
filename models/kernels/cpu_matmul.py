"""The CPU kernels (cpu_matmul.cc, cpu_rowwise.cc), built on first use and called through jax.ffi.

One source, two builds: `avx512` (16 lanes, 32 zmm registers, more activation rows per pass)
and `avx2` (8 lanes, 16 ymm registers). `isa()` picks the build for this process: the one named
by $SPEC_JAX_CPU_ISA (`avx2` or `avx512`; anything else is an error), else the widest this CPU
runs (/proc/cpuinfo flags), read when a model config is made: ModelConfig.cpu_isa names the
build a model's programs call. Each build registers its own ffi targets, so both can be loaded
in one process (the tests and scripts/matmul_kernel_bench.py compare them). The two builds sum
in different orders (8 or 16 lanes), so they differ in the last bits from each other, but within
one build a row's result is bit-identical whatever the number of rows in the call.

`available()` builds the shared library with the system's C++ compiler (once per source, ISA
and jaxlib version, cached under `$SPEC_JAX_CACHE/kernels/` with its sha256 beside it, checked
before each load: models.kernels.libraries.verified_build), loads it and registers its three
targets with XLA; it returns False, with one warning, where it cannot (not x86-64, a CPU without
the ISA's instructions, no compiler), and the models then use XLA's own products.
`matmul(x, w, scale, isa)` is y[M, O] = x[M, I] . w[O, I]^T (* scale[O] for int8 weights), float32
out; `attention(q, k, v, q_positions, kv_lengths, isa, window, tree)` is models.kernels' attention contract, each
query computed alone (so a verification call's rows equal decode steps' bit for bit, and a tree node's
equal its path decoded in order).
"""

import ctypes
import functools
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from models import (
    machine,
    registry,  # read through the module: tests patch its cache_root
)
from models.kernels import libraries

SOURCE = pathlib.Path(__file__).with_name("cpu_matmul.cc")
ROWWISE_SOURCE = SOURCE.with_name("cpu_rowwise.cc")  # in the same library: attention, RMSNorm
PARALLEL_HEADER = SOURCE.with_name("cpu_parallel.h")  # included by both (and by gguf_matmul.cc)
ISA_ENV = "SPEC_JAX_CPU_ISA"
# ISA -> (the /proc/cpuinfo flags it needs, the compiler flags that enable them). The source
# picks its code path from the compiler's __AVX512F__ etc.
ISAS = {
    "avx2": (("avx2", "fma"), ("-mavx2", "-mfma")),
    "avx512": (
        ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"),
        ("-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"),
    ),
}
COMMON_FLAGS = ("-O3", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC", "-w")
DTYPES = {  # weight dtype -> exported symbol (its ffi target: spec_jax_matmul_<dtype>_<isa>)
    "float32": "SpecJaxMatmulF32",
    "bfloat16": "SpecJaxMatmulBF16",
    "int8": "SpecJaxMatmulInt8",
}


class KernelUnavailable(RuntimeError):
    """The kernel cannot be built or loaded on this machine."""


@functools.cache
def _cpu_flags() -> frozenset | str:
    """The CPU's feature flags, or why they cannot be read."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the CPU is {platform.machine()}, the kernel is written for x86-64 (AVX2 + FMA or AVX-512)"
    flags = machine.cpu_flags()
    return "cannot read /proc/cpuinfo to check the CPU's instruction sets" if flags is None else flags


def isa() -> str:
    """The build this process uses: $SPEC_JAX_CPU_ISA when set (ValueError unless it names one
    of ISAS), else "avx512" where the CPU has AVX-512 F/BW/VL/DQ, else "avx2". Read when a
    model config is made (models.config.this_cpu_isa, the default of ModelConfig.cpu_isa), never
    while a program is traced: a config names its build, so the build is in the compiled
    program's key; ModelConfig.replace(cpu_isa=...) switches it."""
    forced = os.environ.get(ISA_ENV, "").strip()
    if forced:
        if forced not in ISAS:
            raise ValueError(f"${ISA_ENV} must be one of {', '.join(ISAS)} (or unset), got {forced!r}")
        return forced
    flags = _cpu_flags()
    return "avx512" if not isinstance(flags, str) and flags.issuperset(ISAS["avx512"][0]) else "avx2"


def cpu_supported(isa_name: str | None = None) -> str | None:
    """None when this CPU can run the build of isa_name (default: isa()), else why not."""
    isa_name = isa_name or isa()
    flags = _cpu_flags()
    if isinstance(flags, str):
        return flags
    missing = [f for f in ISAS[isa_name][0] if f not in flags]
    return f"the CPU lacks {', '.join(missing)} for the {isa_name} build" if missing else None


def compiler_flags(isa_name: str | None = None) -> tuple:
    return COMMON_FLAGS + ISAS[isa_name or isa()][1]


def library_path(cache_dir=None, isa_name: str | None = None) -> pathlib.Path:
    """Where the built library for this source, ISA, these flags and this jaxlib is cached."""
    isa_name = isa_name or isa()
    flags = " ".join(compiler_flags(isa_name))
    sources = SOURCE.read_bytes() + ROWWISE_SOURCE.read_bytes() + PARALLEL_HEADER.read_bytes()
    digest = hashlib.sha256(sources + flags.encode() + jax.__version__.encode())
    return registry.cache_root(cache_dir) / "kernels" / f"cpu_matmul-{isa_name}-{digest.hexdigest()[:16]}.so"


def build(cache_dir=None, isa_name: str | None = None) -> pathlib.Path:
    """Compiles cpu_matmul.cc for isa_name (default: isa()), if not cached; the library's path
    (libraries.verified_build: checked against its stored sha256; a private temporary folder
    where the cache folder cannot be used)."""
    isa_name = isa_name or isa()
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")

    def compile_to(out: str) -> None:
        if compiler is None:
            raise KernelUnavailable("no C++ compiler found (set CXX, or install g++)")
        cmd = [
            compiler,
            *compiler_flags(isa_name),
            f"-I{jax.ffi.include_dir()}",
            str(SOURCE),
            str(ROWWISE_SOURCE),
            "-o",
            out,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise KernelUnavailable(f"{' '.join(cmd)} failed: {proc.stderr.strip()[-500:]}")

    return libraries.verified_build(library_path(cache_dir, isa_name), compile_to)


def target_name(dtype: str, isa_name: str) -> str:
    return f"spec_jax_matmul_{dtype}_{isa_name}"


def rowwise_target(op: str, isa_name: str) -> str:
    return f"spec_jax_{op}_{isa_name}"


def available(isa_name: str | None = None) -> bool:
    """Builds, loads and registers the build of isa_name (default: isa()) once per process;
    False (one warning) if it cannot. ValueError for an unknown $SPEC_JAX_CPU_ISA."""
    return _load(isa_name or isa())


@functools.cache
def _load(isa_name: str) -> bool:
    reason = cpu_supported(isa_name)
    if reason is None:
        try:
            library = ctypes.cdll.LoadLibrary(str(build(isa_name=isa_name)))
            for dtype, symbol in DTYPES.items():
                jax.ffi.register_ffi_target(
                    target_name(dtype, isa_name), jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu"
                )
            for name, symbol in (("attention", "SpecJaxAttention"), ("rms_norm", "SpecJaxRmsNorm")):
                jax.ffi.register_ffi_target(
                    rowwise_target(name, isa_name),
                    jax.ffi.pycapsule(getattr(library, symbol)),
                    platform="cpu",
                )
            return True
        except (KernelUnavailable, OSError) as e:
            reason = str(e)
    warnings.warn(
        f"spec_jax: the CPU matmul kernel ({isa_name}) is unavailable ({reason}); using XLA's products",
        stacklevel=3,
    )
    return False


def matmul(x_mi, w_oi, scale_o, isa_name: str, live=None):
    """y [M, O] float32 = x [M, I] . w [O, I]^T (* scale [O] when w is int8), on the CPU kernel
    built for isa_name (the model's ModelConfig.cpu_isa); that build must be available().
    live: an int32 scalar (traced or not, default M): rows of x from it on are padding, not
    computed, their outputs 0; the rows before it are the bits of a call over all M rows."""
    target = target_name(jnp.dtype(w_oi.dtype).name, isa_name)
    out = jax.ShapeDtypeStruct((x_mi.shape[0], w_oi.shape[0]), jnp.float32)
    args = (x_mi.astype(jnp.float32), w_oi) + (() if scale_o is None else (scale_o.astype(jnp.float32),))
    args += (jnp.asarray(x_mi.shape[0] if live is None else live, jnp.int32),)
    # Under vmap (per-prompt decoding) the kernel runs once per batch element.
    return jax.ffi.ffi_call(target, out, vmap_method="sequential")(*args)


def attention(
    q_bthd, k_bskd, v_bskd, q_positions_bt, kv_lengths_b, isa_name: str, window=None, tree=None, layer=None
):
    """The attention contract of models.kernels (float32 inside; out in q's dtype), each query
    computed alone in one fixed order (cpu_rowwise.cc): a query's result is the same bits
    whatever the number of queries in the call. window: None or an int32 scalar (Python or
    traced), an operand of the call; None passes the largest int32, which leaves every query's
    keys (and so its bits) as without a window. tree: None or int32 [B, T] ancestor bits
    (models.kernels' `tree`), an operand of the call (empty for None): a tree node's result is the
    same bits as the same query decoded with its path laid out contiguously. layer: None (k and
    v [B, S, KVH, D]) or an int32 scalar (Python or traced): k and v are a model's stacked cache
    [L, B, S, KVH, D], read at that layer in place (no copy of the layer's slice). The build of
    isa_name must be available()."""
    out = jax.ShapeDtypeStruct(q_bthd.shape, jnp.float32)
    call = jax.ffi.ffi_call(rowwise_target("attention", isa_name), out, vmap_method="sequential")
    if layer is None:
        k_bskd, v_bskd, layer = k_bskd[None], v_bskd[None], 0
    f32 = (x.astype(jnp.float32) for x in (q_bthd, k_bskd, v_bskd))
    window = jnp.iinfo(jnp.int32).max if window is None else window
    tree = jnp.zeros((0,), jnp.int32) if tree is None else tree
    ints = (q_positions_bt, kv_lengths_b, window, tree, layer)
    return call(*f32, *(jnp.asarray(x).astype(jnp.int32) for x in ints)).astype(q_bthd.dtype)


def rms_norm(x, scale, eps: float, isa_name: str):
    """x [..., D] * rsqrt(mean(x^2) + eps) * scale [D], float32, each row alone in one fixed order
    (cpu_rowwise.cc); the build of isa_name must be available()."""
    x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    out = jax.ShapeDtypeStruct(x2.shape, jnp.float32)
    call = jax.ffi.ffi_call(rowwise_target("rms_norm", isa_name), out, vmap_method="sequential")
    return call(x2, scale.astype(jnp.float32), eps=np.float32(eps)).reshape(x.shape)
