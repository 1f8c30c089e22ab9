"""Products with weights in their GGUF block formats (gguf_matmul.cc), through jax.ffi.

The block arithmetic is ggml's (llama.cpp's CPU backend), built from the registry's
llama-cpp-python sdist by models.kernels.llama_cpp; this module builds the small FFI library
that lays ggml's calls out over rows and XLA's threads, links it against that ggml, and registers
its targets. `available()` is False, with one warning, where it cannot (no cmake or compiler, no
registry to fetch the source from, not x86-64 Linux): the GGUF precisions then need XLA's path
(models.precision), which dequantizes in the graph.

`matmul(x, data, ggml_type, quantize_x)` is y[M, O] float32 = x[M, I] . W[O, I]^T for a weight
whose O rows of blocks are data [O, Y] (uint8); `rows(indices, data, ggml_type, k)`
dequantizes rows of a table (an embedding); `quantize(w, ggml_type)` quantizes float rows with
ggml (tests, and models cast to a GGUF precision).
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
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from models.kernels import libraries, llama_cpp

SOURCE = pathlib.Path(__file__).with_name("gguf_matmul.cc")
FLAGS = ("-O2", "-march=native", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC", "-w")
MATMUL_TARGET, ROWS_TARGET = "spec_jax_gguf_matmul", "spec_jax_gguf_rows"
# Fixes which kernel a product of one row runs (one_row_own); unset: the kernel decides.
ONE_ROW_ENV, ONE_ROW_CHOICES = "SPEC_JAX_GGUF_ONE_ROW", ("ggml", "own")
# How Q6_K weights at gguf_q8 are laid out for the kernel (interleave_q6k_pays); unset: interleaved
# where it pays. "rows" keeps the file's layout (Q6KRows, the path before Q6Kx8).
Q6K_ENV, Q6K_CHOICES = "SPEC_JAX_GGUF_Q6K", ("interleaved", "rows")
Q4K, Q6K = GGMLQuantizationType.Q4_K.value, GGMLQuantizationType.Q6_K.value


class KernelUnavailable(RuntimeError):
    """The GGUF kernel cannot be built or loaded on this machine."""


def library_path(cache_dir=None) -> pathlib.Path:
    """Where the library for this source, ggml build and jaxlib is cached (inside the ggml build
    folder, whose name already keys the compiler, the CPU and the llama.cpp version)."""
    sources = SOURCE.read_bytes() + SOURCE.with_name("cpu_parallel.h").read_bytes()
    digest = hashlib.sha256(sources + " ".join(FLAGS).encode() + jax.__version__.encode())
    return llama_cpp.build_dir(cache_dir) / "spec_jax" / f"gguf_matmul-{digest.hexdigest()[:16]}.so"


def built(cache_dir=None) -> bool:
    """Whether ggml and this kernel are built for this machine (build() compiles nothing)."""
    return llama_cpp.built(llama_cpp.LIBRARIES, cache_dir) and libraries.built(library_path(cache_dir))


def unbuildable() -> str | None:
    """Why build() cannot work here, found without building or downloading anything (not x86-64
    Linux; no cmake or compiler: llama_cpp.check_tools' line), or None."""
    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return f"built for x86-64 Linux, this is {platform.system()} {platform.machine()}"
    try:
        llama_cpp.check_tools()
    except llama_cpp.Unavailable as e:
        return str(e)
    return None


def build(cache_dir=None) -> pathlib.Path:
    """Builds ggml (models.kernels.llama_cpp) and this kernel against it, if not cached
    (libraries.verified_build: checked against its stored sha256 before each load); each step
    that compiles prints one line first. KernelUnavailable (one line) where it cannot."""
    if not built(cache_dir) and (reason := unbuildable()):
        raise KernelUnavailable(reason)
    try:
        folder = llama_cpp.build(llama_cpp.LIBRARIES, cache_dir)
    except llama_cpp.Unavailable as e:
        raise KernelUnavailable(str(e)) from None
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    src = llama_cpp.source(cache_dir)
    lib = folder / "bin"

    def compile_to(out: str) -> None:
        if compiler is None:
            raise KernelUnavailable("no C++ compiler found (set CXX, or install g++)")
        cmd = [
            compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", f"-I{src / 'ggml' / 'include'}", str(SOURCE),
            f"-L{lib}", "-lggml-cpu", "-lggml-base", f"-Wl,-rpath,{lib}", "-o", out,
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise KernelUnavailable(f"{compiler} gguf_matmul.cc failed: {proc.stderr.strip()[-500:]}")

    return libraries.verified_build(library_path(cache_dir), compile_to)


def one_row_setting() -> str | None:
    """$SPEC_JAX_GGUF_ONE_ROW (None where unset or empty; the kernel then decides), read here
    only and handed to the kernel when it loads; ValueError for any other value."""
    value = os.environ.get(ONE_ROW_ENV) or None
    if value is not None and value not in ONE_ROW_CHOICES:
        raise ValueError(
            f"${ONE_ROW_ENV} must be one of {', '.join(ONE_ROW_CHOICES)} (or unset), got {value!r}"
        )
    return value


@functools.cache
def _library() -> ctypes.CDLL | str:
    """The loaded library with its targets registered, or why it cannot be."""
    fixed = one_row_setting()
    try:
        library = ctypes.cdll.LoadLibrary(str(build()))
    except (KernelUnavailable, OSError) as e:
        return str(e)
    if fixed is not None:  # before the first product, which decides otherwise
        library.SpecJaxGgufFixOneRow(ctypes.c_int(ONE_ROW_CHOICES.index(fixed)))
    jax.ffi.register_ffi_target(MATMUL_TARGET, jax.ffi.pycapsule(library.SpecJaxGgufMatmul), platform="cpu")
    jax.ffi.register_ffi_target(ROWS_TARGET, jax.ffi.pycapsule(library.SpecJaxGgufRows), platform="cpu")
    library.SpecJaxGgufMultirow.restype = ctypes.c_int
    library.SpecJaxGgufOneRowOwn.restype = ctypes.c_int
    library.SpecJaxGgufQuantize.restype = ctypes.c_size_t
    library.SpecJaxGgufQuantize.argtypes = [
        ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
    ]  # fmt: skip
    library.SpecJaxGgufInterleaveQ6K.restype = ctypes.c_size_t
    library.SpecJaxGgufInterleaveQ6K.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
    ]  # fmt: skip
    library.SpecJaxGgufInterleaveQ4K.restype = ctypes.c_size_t
    library.SpecJaxGgufInterleaveQ4K.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
    ]
    return library


def multirow() -> bool:
    """Whether the kernel multiplies several rows of activations with one unpacking of each
    weight block (its AVX-512 VNNI build), rather than one ggml product per row."""
    library = _library()
    return not isinstance(library, str) and bool(library.SpecJaxGgufMultirow())


def one_row_own() -> bool:
    """Whether a product of one row of activations (a decode step's) runs the multi-row kernel
    rather than ggml's own one-row product (gemv for interleaved Q4_K, vec_dot for Q6_K); the
    row's bits are the same either way. The kernel takes its own where this CPU runs 512-bit
    instructions whole (a Zen 5: faster there; a Zen 4 runs them in two passes, and ggml's
    256-bit products were faster), measured once per process, unless $SPEC_JAX_GGUF_ONE_ROW
    (ggml or own) fixes it. False without the multi-row build."""
    library = _library()
    return not isinstance(library, str) and bool(library.SpecJaxGgufOneRowOwn())


@functools.cache
def available() -> bool:
    """Builds (where it is not built yet: one progress line per step), loads and registers the
    kernel once per process; False, with one warning naming why (and, for missing tools, how to
    install them), where it cannot."""
    reason = _library()
    if isinstance(reason, str):
        warnings.warn(
            f"spec_jax: the GGUF block kernel is unavailable: {reason}; precision auto runs GGUF "
            "models at int8 (gguf and gguf_q8 by name dequantize in XLA, far slower)",
            stacklevel=3,
        )
        return False
    return True


def row_bytes(ggml_type: int, k: int) -> int:
    """Bytes of one row of k values in a GGUF block format."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    if k % block:
        raise ValueError(f"a row of {k} values is not a whole number of {block}-value blocks")
    return k // block * size


def quantize(w: np.ndarray, ggml_type: int) -> np.ndarray:
    """float rows w [O, I] in block format ggml_type with ggml's quantizer: uint8 [O, Y]."""
    library = _library()
    if isinstance(library, str):
        raise KernelUnavailable(library)
    w = np.ascontiguousarray(w, np.float32)
    out = np.empty((w.shape[0], row_bytes(ggml_type, w.shape[1])), np.uint8)
    written = library.SpecJaxGgufQuantize(ggml_type, w.ctypes.data, out.ctypes.data, w.shape[0], w.shape[1])
    if written != out.size:
        raise KernelUnavailable(f"ggml quantized {written} bytes, expected {out.size}")
    return out


def interleave_q4k(data_oy: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Q4_K rows [O, Y] (O a multiple of 8) -> the same bytes with each group of 8 rows'
    blocks interleaved (ggml's block_q4_Kx8, as llama.cpp's CPU backend repacks Q4_K): what
    matmul(..., interleaved=True) reads. Written into `out` where given (uint8 of data_oy's
    shape, C-contiguous: models.host_memory's huge pages), else a new array."""
    library = _library()
    if isinstance(library, str):
        raise KernelUnavailable(library)
    data_oy = np.ascontiguousarray(data_oy, np.uint8)
    k = data_oy.shape[1] // 144 * 256
    if (
        data_oy.ndim != 2
        or data_oy.shape[0] % 8
        or row_bytes(GGMLQuantizationType.Q4_K.value, k) != data_oy.shape[1]
    ):
        raise ValueError(
            f"interleave_q4k: Q4_K rows [N, row_bytes] with N a multiple of 8, got {data_oy.shape}"
        )
    out = _out_like(data_oy, out)
    if (
        library.SpecJaxGgufInterleaveQ4K(data_oy.ctypes.data, out.ctypes.data, data_oy.shape[0], k)
        != out.size
    ):
        raise KernelUnavailable("ggml Q4_K interleave wrote the wrong number of bytes")
    return out


def _out_like(data_oy: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """An interleave's destination: `out` (checked: uint8, data_oy's shape, C-contiguous, and not
    data_oy's memory), or a new array like data_oy."""
    if out is None:
        return np.empty_like(data_oy)
    if out.dtype != np.uint8 or out.shape != data_oy.shape or not out.flags.c_contiguous:
        raise ValueError(f"out: uint8 {data_oy.shape}, C-contiguous, got {out.dtype} {out.shape}")
    if np.shares_memory(out, data_oy):
        raise ValueError("out: must not overlap the rows it is interleaved from")
    return out


def prefetch_q4k(on: bool) -> None:
    """Whether the multi-row Q4_K kernel (interleaved layout) asks for its blocks ahead (True, the
    default) or not (the kernel before it did): for benchmarks that time both in one process;
    the bits are the same either way. Takes effect at the next product."""
    library = _library()
    if isinstance(library, str):
        raise KernelUnavailable(library)
    library.SpecJaxGgufPrefetchQ4K(ctypes.c_int(int(bool(on))))


def q6k_setting() -> str:
    """$SPEC_JAX_GGUF_Q6K ("interleaved" where unset or empty); ValueError for any other value."""
    value = os.environ.get(Q6K_ENV) or "interleaved"
    if value not in Q6K_CHOICES:
        raise ValueError(f"${Q6K_ENV} must be one of {', '.join(Q6K_CHOICES)} (or unset), got {value!r}")
    return value


def interleave_q6k_pays() -> bool:
    """Whether Q6_K weights at gguf_q8 (8-bit activations) go into interleave_q6k's layout for
    the CPU kernel: where its multi-row build runs (no other product reads that layout), its own
    kernels run one-row products (one_row_own: a CPU that runs 512-bit instructions whole; on
    a Zen 4 ggml's 256-bit vec_dot was faster for a decode step's row, and an interleaved Q6_K
    slower), and $SPEC_JAX_GGUF_Q6K does not say "rows". The bits of every product are the same
    either way."""
    return q6k_setting() == "interleaved" and multirow() and one_row_own()


def interleave_q6k(data_oy: np.ndarray, back: bool = False, out: np.ndarray | None = None) -> np.ndarray:
    """Q6_K rows [O, Y] (O a multiple of 8) -> the same blocks with each group of 8 rows in the
    kernel's Q6Kx8 layout (gguf_matmul.cc: the 8 columns' 6-bit values 8 at a time, their
    scales and d regrouped; the same bytes a block), which matmul(..., interleaved=True) reads on
    the multi-row build; back: that layout -> the file's rows again (bit for bit). out: as
    interleave_q4k's."""
    library = _library()
    if isinstance(library, str):
        raise KernelUnavailable(library)
    data_oy = np.ascontiguousarray(data_oy, np.uint8)
    k = data_oy.shape[-1] // 210 * 256
    if data_oy.ndim != 2 or data_oy.shape[0] % 8 or row_bytes(Q6K, k) != data_oy.shape[1]:
        raise ValueError(
            f"interleave_q6k: Q6_K rows [N, row_bytes] with N a multiple of 8, got {data_oy.shape}"
        )
    out = _out_like(data_oy, out)
    written = library.SpecJaxGgufInterleaveQ6K(
        data_oy.ctypes.data, out.ctypes.data, data_oy.shape[0], k, int(not back)
    )
    if written != out.size:
        raise KernelUnavailable("the Q6_K interleave wrote the wrong number of bytes")
    return out


def matmul(
    x_mi,
    data_oy,
    ggml_type: int,
    quantize_x: bool,
    ggml_dot: bool = False,
    interleaved: bool = False,
    bulk: bool = False,
    live=None,
):
    """y [M, O] float32 = x [M, I] . W^T for W's rows of blocks data [O, Y]. live: an int32
    scalar (traced or not, default M): rows of x from it on are padding, not computed, their
    outputs 0 (one program for every fill of a prefill's last chunk). ggml_dot:
    every (row, column) by ggml's own calls (to_float + its f32 vec_dot, or its quantized
    vec_dot), not this project's multi-row kernel for Q4_K / Q6_K (tests and benchmarks compare).
    interleaved: data is Q6_K in interleave_q6k's layout (quantize_x only, the multi-row build;
    each row the bits of ggml's vec_dot on the file's layout), or Q4_K in interleave_q4k's
    layout (quantize_x only), multiplied by the
    multi-row kernel that gives each row the bits of ggml's repacked product
    (ggml_gemv_q4_K_8x8_q8_K; ggml_dot calls that gemv, one call per row of x); with bulk, rows
    in groups of 4 by ggml's ggml_gemm_q4_K_8x8_q8_K where the CPU lacks the multi-row kernel
    (faster there, but its bits differ from gemv's: for a prefill only), and with bulk and
    ggml_dot on any CPU (ggml's own prefill product)."""
    out = jax.ShapeDtypeStruct((x_mi.shape[0], data_oy.shape[0]), jnp.float32)
    call = jax.ffi.ffi_call(MATMUL_TARGET, out, vmap_method="sequential")
    return call(
        x_mi.astype(jnp.float32),
        data_oy,
        jnp.asarray(x_mi.shape[0] if live is None else live, jnp.int32),
        ggml_type=np.int64(ggml_type),
        quantize_x=bool(quantize_x),
        ggml_dot=bool(ggml_dot),
        interleaved=bool(interleaved),
        bulk=bool(bulk),
    )


def rows(indices, data_vy, ggml_type: int, k: int):
    """Rows [..., I] float32 of a block-format table data [V, Y] at integer indices [...]."""
    flat = indices.reshape(-1).astype(jnp.int32)
    out = jax.ShapeDtypeStruct((flat.shape[0], k), jnp.float32)
    call = jax.ffi.ffi_call(ROWS_TARGET, out, vmap_method="sequential")
    return call(flat, data_vy, ggml_type=np.int64(ggml_type)).reshape(*indices.shape, k)
