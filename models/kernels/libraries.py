"""The native libraries that compiled programs call by name, and one digest of their builds.

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

`verified_build` is the one way a library is built and found again: in its cache folder only
when that folder is this user's own (owned by them, writable by no one else), else in a private
temporary folder of this process (never a shared, predictable path another user could plant a
library in); the library's sha256 is stored beside it (`NAME.so.sha256`, written after it) and
checked before every load, and a library that does not match is built again.
"""

import atexit
import functools
import hashlib
import os
import pathlib
import platform
import shutil
import tempfile
from collections.abc import Callable


def build_digest() -> str:
    """16 hex digits naming the builds of every kernel library programs may call, and the CPU
    they and XLA's code are built for: cpu_matmul's library names for each ISA (source, compiler
    flags and jax version), gguf_matmul's library name (likewise), llama.cpp's build folder name (its version, compilers, CPU flags and
    cmake options), the machine and its /proc/cpuinfo flags. Nothing is built or loaded."""
    from models.kernels import cpu_matmul, gguf_matmul, llama_cpp

    flags = cpu_matmul._cpu_flags()
    parts = [
        *(cpu_matmul.library_path(isa_name=name).name for name in sorted(cpu_matmul.ISAS)),
        llama_cpp.build_dir().name,
        gguf_matmul.library_path().name,
        platform.machine(),
        flags if isinstance(flags, str) else " ".join(sorted(flags)),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


class LibraryMismatch(OSError):
    """A library's bytes do not match the sha256 stored beside it, even after building it again."""


def verified_build(path: pathlib.Path, compile_to: Callable[[str], None]) -> pathlib.Path:
    """The path of a library named path.name whose sha256 matches the one stored beside it,
    built with compile_to(output path) where there is none (or it does not match).

    It lives in path's folder when that folder is usable (_own_folder), else in a private
    temporary folder of this process. The build holds the library's file_lock (a second process
    waits, then finds it built) and removes what killed builds left. LibraryMismatch if the
    library still does not match after one build; compile_to's errors propagate."""
    from models import registry

    folder = path.parent if _own_folder(path.parent) else _private_folder()
    path = folder / path.name
    if _matches(path):
        return path
    label = path.stem
    with registry.file_lock(folder / f".lock-{label}"):
        if _matches(path):  # built by another process meanwhile
            return path
        registry.remove_dead_tmp(folder, label)
        with registry.atomic_path(path, label=label, suffix=path.suffix) as tmp:
            compile_to(str(tmp))
            digest = registry.sha256_file(tmp)
        registry.write_text_atomic(_digest_path(path), digest + "\n")  # after the library
    if not _matches(path):
        raise LibraryMismatch(f"{path}: its sha256 does not match {_digest_path(path)} after building it")
    return path


def _digest_path(path: pathlib.Path) -> pathlib.Path:
    return path.with_name(path.name + ".sha256")


def _matches(path: pathlib.Path) -> bool:
    from models import registry

    try:
        return _digest_path(path).read_text().strip() == registry.sha256_file(path)
    except OSError:
        return False


def _own_folder(folder: pathlib.Path) -> bool:
    """Whether folder can be created and is safe to load libraries from: owned by this user and
    writable by no one else (so no one else can put a library, or its digest, there)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        st = folder.stat()
    except OSError:
        return False
    return st.st_uid == os.getuid() and not st.st_mode & 0o022 and os.access(folder, os.W_OK)


@functools.cache
def _private_folder() -> pathlib.Path:
    """A temporary folder only this process uses (mkdtemp: mode 0700, an unpredictable name),
    removed at exit; libraries built there are built again by the next process."""
    folder = pathlib.Path(tempfile.mkdtemp(prefix="spec_jax-kernels-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder
