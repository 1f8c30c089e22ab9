"""The CPU matrix-product kernel (cpu_matmul.cc), built on first use and called through jax.ffi.

`available()` builds the shared library with the system's C++ compiler (once per source and
jaxlib version, cached under `$SPEC_JAX_CACHE/kernels/`), loads it and registers its three
targets with XLA; it returns False, with one warning, where it cannot (not x86-64, no AVX2 or
FMA, no compiler), and the models then use XLA's own products. `matmul(x, w, scale)` is
y[M, N] = x[M, K] . w[N, K]^T (* scale[N] for int8 weights), float32 out.
"""

import ctypes
import functools
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import warnings

import jax
import jax.numpy as jnp

SOURCE = pathlib.Path(__file__).with_name("cpu_matmul.cc")
FLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC", "-w")
TARGETS = {  # weight dtype -> (ffi target name, exported symbol)
    "float32": ("spec_jax_matmul_f32", "SpecJaxMatmulF32"),
    "bfloat16": ("spec_jax_matmul_bf16", "SpecJaxMatmulBF16"),
    "int8": ("spec_jax_matmul_int8", "SpecJaxMatmulInt8"),
}


class KernelUnavailable(RuntimeError):
    """The kernel cannot be built or loaded on this machine."""


def cpu_supported() -> str | None:
    """None when this CPU can run the kernel, else why not."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the CPU is {platform.machine()}, the kernel is written for x86-64 (AVX2 + FMA)"
    try:
        flags = pathlib.Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return "cannot read /proc/cpuinfo to check for AVX2 and FMA"
    missing = [f for f in ("avx2", "fma") if f not in flags]
    return f"the CPU lacks {' and '.join(missing)}" if missing else None


def library_path(cache_dir=None) -> pathlib.Path:
    """Where the built library for this source, these flags and this jaxlib is cached."""
    from models.registry import cache_root

    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + jax.__version__.encode())
    return cache_root(cache_dir) / "kernels" / f"cpu_matmul-{digest.hexdigest()[:16]}.so"


def build(cache_dir=None) -> pathlib.Path:
    """Compiles cpu_matmul.cc (if not cached) and returns the library's path."""
    path = library_path(cache_dir)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError:  # a cache folder that cannot be written: the user's temporary folder instead
        path = pathlib.Path(tempfile.gettempdir()) / f"spec_jax-{os.getuid()}" / "kernels" / path.name
    if path.exists():
        return path
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise KernelUnavailable("no C++ compiler found (set CXX, or install g++)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".so")
    os.close(fd)
    try:
        cmd = [compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise KernelUnavailable(f"{' '.join(cmd)} failed: {proc.stderr.strip()[-500:]}")
        os.replace(tmp, path)  # atomic: a concurrent build of the same source is harmless
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


@functools.cache
def available() -> bool:
    """Builds, loads and registers the kernel once per process; False (one warning) if it cannot."""
    reason = cpu_supported()
    if reason is None:
        try:
            library = ctypes.cdll.LoadLibrary(str(build()))
            for target, symbol in TARGETS.values():
                jax.ffi.register_ffi_target(
                    target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu"
                )
            return True
        except (KernelUnavailable, OSError) as e:
            reason = str(e)
    warnings.warn(
        f"spec_jax: the CPU matmul kernel is unavailable ({reason}); using XLA's products", stacklevel=2
    )
    return False


def matmul(x_mk, w_nk, scale_n=None):
    """y [M, N] float32 = x [M, K] . w [N, K]^T (* scale [N] when w is int8), on the CPU kernel."""
    target, _ = TARGETS[jnp.dtype(w_nk.dtype).name]
    out = jax.ShapeDtypeStruct((x_mk.shape[0], w_nk.shape[0]), jnp.float32)
    args = (x_mk.astype(jnp.float32), w_nk) + (() if scale_n is None else (scale_n.astype(jnp.float32),))
    # Under vmap (per-prompt decoding) the kernel runs once per batch element.
    return jax.ffi.ffi_call(target, out, vmap_method="sequential")(*args)
