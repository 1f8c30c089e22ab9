"""Builds this machine's CPU kernels ahead of the first run: `python -m models.kernels.build`, or
`spec-jax-build-kernels` (the same, a command `pip install .` puts on the path).

What a run on a CPU calls and would otherwise build the first time it needs it: ggml from
llama.cpp's source in the registry's llama-cpp-python sdist (cmake; models.kernels.llama_cpp) and
the GGUF block kernel linked against it (gguf_matmul: `auto` precision's gguf_q8), and the int8 /
float kernel library for this CPU (cpu_matmul). Each is built once per machine and cached under
`$SPEC_JAX_CACHE`; a run that starts while they are being built waits for the build (file locks)
instead of building them again or falling back to another precision.

`make demo` and `make test` run `--background` right after installing the venv: the build runs
in a process of its own while the demo downloads the weights (or the test set-up installs the
compile-only plugins), its output in BUILD_LOG. Why a command and not a step inside `pip install`:
the build is native to this CPU (`-march=native`, GGML_NATIVE) and keyed by its compilers and
flags, it downloads llama.cpp's source from the registry, and it lives in the user's cache, not
in the installed package; a wheel that held it would carry one machine's build to another, and
an editable install runs no build step at all.

Without cmake or a C/C++ compiler the GGUF kernel cannot be built: the command prints one line
naming what is missing and how to install it, and exits 1; `--background` then starts nothing and
says nothing (the run says it, once, and runs GGUF models at int8).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import time

from models import registry
from models.kernels import cpu_matmul, gguf_matmul, libraries

BUILD_LOG = "kernel-build.log"  # under the cache root: what --background's build printed


def log_path(cache_dir=None) -> pathlib.Path:
    return registry.cache_root(cache_dir) / BUILD_LOG


def pending(cache_dir=None) -> list[str]:
    """The kernels not built yet that can be built here, in build order: "gguf" (ggml and the
    GGUF kernel, where gguf_matmul.unbuildable() finds nothing missing) and "cpu" (cpu_matmul for
    this CPU's ISA, where the CPU runs it and a C++ compiler is found). Builds nothing."""
    parts = []
    if not gguf_matmul.built(cache_dir) and gguf_matmul.unbuildable() is None:
        parts.append("gguf")
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if (
        cpu_matmul.cpu_supported() is None
        and compiler
        and not libraries.built(cpu_matmul.library_path(cache_dir))
    ):
        parts.append("cpu")
    return parts


def build(cache_dir=None) -> str | None:
    """Builds every kernel not built yet (one progress line per step that compiles); None, or the
    line that says why one cannot be built here."""
    reasons = []
    try:  # first: a run waits for it before it reads the weights (auto precision asks for it)
        gguf_matmul.build(cache_dir)
    except (gguf_matmul.KernelUnavailable, OSError) as e:
        reasons.append(f"the GGUF block kernel: {e}; precision auto runs GGUF models at int8")
    try:  # a run needs it only when it compiles, after reading the weights
        cpu_matmul.build(cache_dir)
    except (cpu_matmul.KernelUnavailable, OSError) as e:
        reasons.append(f"the CPU matmul kernel: {e}")
    return "; ".join(reasons) or None


WHAT = {"gguf": "ggml and the GGUF kernel (about 2 minutes on 2 cores)", "cpu": "the int8 kernel"}


def start_in_background(cache_dir=None) -> str | None:
    """Starts `python -m models.kernels.build` in a process of its own session (it outlives the
    caller; output appended to log_path()) where pending() names something; the line that says
    so, or None where there is nothing to build."""
    parts = pending(cache_dir)
    if not parts:
        return None
    log = log_path(cache_dir)
    log.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if cache_dir is not None:
        env["SPEC_JAX_CACHE"] = str(cache_dir)
    with open(log, "a") as out:
        out.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}: {sys.executable} -m models.kernels.build\n")
        out.flush()
        subprocess.Popen(
            [sys.executable, "-m", "models.kernels.build"],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # a Ctrl-C of `make` does not cut a cmake build short
        )
    return f"building {' and '.join(WHAT[p] for p in parts)} in the background, once (log: {log})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m models.kernels.build",
        description="Build this machine's CPU kernels (ggml and the GGUF block kernel, the int8 kernel) "
        "now, so that the first run needs no build. Cached under $SPEC_JAX_CACHE (default "
        "~/.cache/spec_jax); needs cmake and a C/C++ compiler (apt-get install cmake g++).",
    )
    parser.add_argument(
        "--background",
        action="store_true",
        help="start the build in a process of its own and return at once (its output in "
        f"$SPEC_JAX_CACHE/{BUILD_LOG}); nothing where everything is built or nothing can be",
    )
    args = parser.parse_args(argv)
    if args.background:
        started = start_in_background()
        if started is not None:
            print(started)
        return 0
    start = time.perf_counter()
    reason = build()
    if reason is not None:
        print(f"spec_jax: {reason}", file=sys.stderr)
        return 1
    print(
        f"the CPU kernels are built ({time.perf_counter() - start:.0f} s), cached under {registry.cache_root()}"
    )
    return 0


def cli() -> None:
    """The `spec-jax-build-kernels` command."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
