"""One digest of the builds of the native libraries that compiled programs call by name.

A program that uses this project's CPU kernel holds an XLA FFI custom call to a target name
(`spec_jax_matmul_int8_avx512`, ...), not the kernel's code: the name is looked up in the
targets registered in the process (cpu_matmul.available()) when the program is loaded. JAX's
persistent compilation cache keys a program by its HLO, which holds the name, so an executable
compiled while one build of a library was registered would be found again after the library is
rebuilt from another source under the same names. `build_digest()` names the builds instead,
and spec_jax.executables keeps its store of compiled programs in a folder per digest.

Each library of FFI targets adds its build's key to `build_digest`'s parts: cpu_matmul's
(products, attention, RMSNorm) and gguf_matmul's (the GGUF block products, linked against
llama_cpp's build of ggml).
"""

import hashlib
import platform

from models.kernels import cpu_matmul, gguf_matmul, llama_cpp


def build_digest() -> str:
    """16 hex digits naming the builds of every kernel library programs may call, and the CPU
    they and XLA's code are built for: cpu_matmul's library names for each ISA (source, compiler
    flags and jax version), gguf_matmul's library name (likewise), llama.cpp's build folder name (its version, compilers, CPU flags and
    cmake options), the machine and its /proc/cpuinfo flags. Nothing is built or loaded."""
    flags = cpu_matmul._cpu_flags()
    parts = [
        *(cpu_matmul.library_path(isa_name=name).name for name in sorted(cpu_matmul.ISAS)),
        llama_cpp.build_dir().name,
        gguf_matmul.library_path().name,
        platform.machine(),
        flags if isinstance(flags, str) else " ".join(sorted(flags)),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
