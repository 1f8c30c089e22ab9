"""llama.cpp from the package registry's source: ggml's CPU kernels for the GGUF precisions, and
the peer programs (`llama-completion`, `llama-speculative-simple`, `llama-bench`).

The registry holds llama.cpp's source inside the `llama-cpp-python` sdist (its `vendor/llama.cpp`
folder; MIT). `source()` downloads that pinned sdist with pip once, checks its sha256 and
extracts it; `build(targets)` runs cmake (Release, `GGML_NATIVE=ON`: the build is for this
CPU, and its flags are in the build folder's key) and ninja or make for the targets. Everything
is cached under `$SPEC_JAX_CACHE/llama.cpp/` and guarded by a file lock, so two processes that
need it at once build it once. Never installed as a Python package: only its C/C++ is used.

Raises `Unavailable` (one line: what is missing and how to get it) where it cannot: no network
to the registry, no cmake, no C++ compiler.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile

from models import machine, registry

PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"
# The sdist's sha256 as the registry served it (recorded once; checked after every download).
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=ON",
    "-DGGML_OPENMP=OFF",  # the ggml kernels run on XLA's threads; the peers use ggml's own pool
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
)
LIBRARIES = ("ggml-base", "ggml-cpu")  # what the GGUF matmul kernel links
# `llama-server` (the serving peer, experiments/bench_serve.py) is built in a folder of its own with
# the server on, so the libraries' folder above (and what was compiled against it) stays as it is.
SERVER_OPTIONS = tuple(o.replace("LLAMA_BUILD_SERVER=OFF", "LLAMA_BUILD_SERVER=ON") for o in CMAKE_OPTIONS)


class Unavailable(RuntimeError):
    """llama.cpp's source cannot be fetched or built here."""


def root(cache_dir=None) -> pathlib.Path:
    return registry.cache_root(cache_dir) / "llama.cpp"


def source(cache_dir=None) -> pathlib.Path:
    """The vendored llama.cpp source folder of the pinned sdist (downloaded and extracted once)."""
    base = root(cache_dir)
    folder = base / f"src-{VERSION}"
    done = folder / ".complete"
    if done.exists():
        return folder / "vendor" / "llama.cpp"
    with registry.file_lock(base / ".lock-source"):
        if done.exists():
            return folder / "vendor" / "llama.cpp"
        shutil.rmtree(folder, ignore_errors=True)
        registry.remove_dead_tmp(base, "sdist")  # a killed download's or extraction's leftovers
        with tempfile.TemporaryDirectory(dir=base, prefix=registry.tmp_prefix("sdist")) as tmp:
            try:
                registry.pip_download([f"{PACKAGE}=={VERSION}"], pathlib.Path(tmp), sdist=True)
            except registry.DownloadError as e:
                raise Unavailable(str(e)) from None
            archives = sorted(pathlib.Path(tmp).glob("*.tar.gz"))
            if len(archives) != 1:
                raise Unavailable(
                    f"pip download {PACKAGE}=={VERSION} gave {len(archives)} source archives, expected 1"
                )
            digest = hashlib.sha256(archives[0].read_bytes()).hexdigest()
            if digest != SDIST_SHA256:
                raise Unavailable(f"{archives[0].name}: sha256 {digest}, expected {SDIST_SHA256}")
            staging = pathlib.Path(tmp) / "x"
            with tarfile.open(archives[0]) as tar:
                tar.extractall(staging, filter="data")
            (top,) = list(staging.iterdir())
            if not (top / "vendor" / "llama.cpp" / "CMakeLists.txt").exists():
                raise Unavailable(f"{archives[0].name} holds no vendor/llama.cpp source")
            (top / ".complete").write_text(digest + "\n")
            os.replace(top, folder)
    return folder / "vendor" / "llama.cpp"


def _compiler_key(options=CMAKE_OPTIONS) -> str:
    """What a build depends on besides the source: the compilers and the CPU it is native for."""
    parts = []
    for tool in ("cc", "c++"):
        exe = shutil.which(os.environ.get(tool.upper().replace("+", "X"), tool)) or ""
        parts.append(exe)
    info = machine.cpuinfo()
    if info is not None:  # the line as /proc/cpuinfo writes it (the key of existing builds)
        parts.append(f"flags\t\t: {info['flags']}" if "flags" in info else "")
    parts.extend(options)
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


def build_dir(cache_dir=None, server: bool = False) -> pathlib.Path:
    """The build folder (server: the one configured with SERVER_OPTIONS)."""
    return root(cache_dir) / f"build-{VERSION}-{_compiler_key(SERVER_OPTIONS if server else CMAKE_OPTIONS)}"


def built(targets=LIBRARIES, cache_dir=None, server: bool = False) -> bool:
    """Whether every one of the cmake targets is already built (build() will not compile)."""
    return all((build_dir(cache_dir, server) / f".built-{t}").exists() for t in targets)


# How to get what check_tools finds missing (Debian and Ubuntu; g++ brings gcc, the C compiler).
INSTALL_HINT = "apt-get install cmake g++"


def check_tools() -> str:
    """The cmake executable, once it and a C and a C++ compiler ($CC / $CXX, else cc / c++) are
    on the PATH (cmake also beside this Python: a `pip install cmake` into the venv counts);
    Unavailable (one line naming everything missing and how to install it) otherwise. Looks
    only: nothing is downloaded or run."""
    cmake = shutil.which("cmake") or shutil.which("cmake", path=os.path.dirname(sys.executable))
    compilers = [shutil.which(os.environ.get(var, tool)) for var, tool in (("CC", "cc"), ("CXX", "c++"))]
    missing = ([] if cmake else ["cmake"]) + ([] if all(compilers) else ["a C/C++ compiler"])
    if missing:
        pip = ", or pip install cmake" if missing == ["cmake"] else ""
        raise Unavailable(f"{' and '.join(missing)} not found on the PATH ({INSTALL_HINT}{pip})")
    return cmake


def build(targets=LIBRARIES, cache_dir=None, server: bool = False) -> pathlib.Path:
    """Builds the cmake targets (once each; cached) and returns the folder holding their outputs
    (`bin/`: the programs and the shared libraries). Targets already built need no cmake. server:
    in the folder configured with SERVER_OPTIONS (the only one that has the `llama-server` target)."""
    folder = build_dir(cache_dir, server)
    if built(targets, cache_dir, server):
        return folder

    cmake = check_tools()
    src = source(cache_dir)  # a download another process has begun is waited for silently: seconds
    waiting = "waiting for another process's build of llama.cpp (such as `python -m models.kernels.build`)"
    with registry.file_lock(root(cache_dir) / ".lock-build", waiting=waiting):
        missing = [t for t in targets if not (folder / f".built-{t}").exists()]
        if not missing:
            return folder
        print(
            f"building llama.cpp's {', '.join(missing)} with cmake (once: about 2 minutes on 2 cores)",
            file=sys.stderr,
            flush=True,
        )
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        if not (folder / "CMakeCache.txt").exists():
            options = SERVER_OPTIONS if server else CMAKE_OPTIONS
            _run([cmake, "-S", str(src), "-B", str(folder), *generator, *options])
        jobs = str(os.cpu_count() or 2)
        _run([cmake, "--build", str(folder), "--parallel", jobs, "--target", *missing])
        for t in missing:
            (folder / f".built-{t}").touch()
    return folder


def _run(cmd) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise Unavailable(f"{' '.join(cmd[:4])} ... failed: {' | '.join(tail)}")
