"""JAX's persistent compilation cache at the entry points (launch.runtime.enable_compilation_cache):
a second process loads every program the first compiled, the off switches write nothing, and a
rebuilt kernel library gets a folder of its own.

tests/conftest.py turns the cache off for the suite ($SPEC_JAX_COMPILATION_CACHE=0, inherited by
the CLI subprocesses); the tests here turn it on for their own subprocesses, in tmp_path.
"""

import json
import os
import subprocess
import sys
import zlib

import pytest

from models.kernels import builds, compile_targets, cpu_matmul
from spec_jax import executables

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The random pair, speculative and plain: a spec loop, a plain loop and their prefills.
ARGS = (
    "--target=random",
    "--draft=random-draft",
    "--gamma=2",
    "--max_new_tokens=4",
    "--compare_autoregressive",
)


def run_generate(*args, env):
    """launch.generate in a subprocess with jax._src.compiler's debug log on stderr (a line per
    persistent cache hit and per miss)."""
    env = {
        **os.environ,
        "PYTHONPATH": ROOT,
        "JAX_PLATFORMS": "cpu",
        "JAX_DEBUG_LOG_MODULES": "jax._src.compiler",
        **env,
    }
    result = subprocess.run(
        [sys.executable, "-m", "launch.generate", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def hits(stderr: str) -> list[str]:
    return [line.split("'")[1] for line in stderr.splitlines() if "Persistent compilation cache hit" in line]


def misses(stderr: str) -> list[str]:
    return [line.split("'")[1] for line in stderr.splitlines() if "PERSISTENT COMPILATION CACHE MISS" in line]


def test_a_second_process_loads_every_program_from_the_persistent_cache(tmp_path):
    """The speculative and plain loops (jitted with a donated state; on an x86-64 CPU with AVX2
    they call the CPU kernel, an FFI custom call) are written by the first run and found by the
    second, which compiles nothing."""
    env = {"SPEC_JAX_COMPILATION_CACHE": str(tmp_path / "compiled")}
    first = run_generate(*ARGS, f"--output_json={tmp_path / 'first.json'}", env=env)
    (folder,) = (tmp_path / "compiled").iterdir()
    assert folder.name == builds.build_digest()
    written = sorted(p.name for p in folder.iterdir())
    assert not hits(first.stderr)
    assert misses(first.stderr).count("jit_spec_loop") == 2  # gamma 2 and plain decoding
    assert misses(first.stderr).count("jit__prefill_marking_padding_done") == 2
    assert len(written) == len(misses(first.stderr))  # every program is written, however small

    second = run_generate(*ARGS, f"--output_json={tmp_path / 'second.json'}", env=env)
    assert not misses(second.stderr), misses(second.stderr)
    assert sorted(hits(second.stderr)) == sorted(misses(first.stderr))
    assert sorted(p.name for p in folder.iterdir()) == written
    reports = [json.loads((tmp_path / f"{run}.json").read_text()) for run in ("first", "second")]
    assert reports[0]["outputs"] == reports[1]["outputs"]
    assert reports[1]["identical_to_autoregressive"]

    if cpu_matmul.available():  # the loops found again are the ones that call the kernel
        loops = [zlib.decompress(p.read_bytes()) for p in folder.glob("jit_spec_loop-*")]
        assert all(b"spec_jax_matmul_" in loop for loop in loops)


@pytest.mark.parametrize(
    "switch, setting", [(["--nocompilation_cache"], "{folder}"), ([], "0")], ids=["flag", "env"]
)
def test_the_off_switches_turn_the_cache_off(tmp_path, switch, setting):
    folder = tmp_path / "compiled"
    env = {"SPEC_JAX_COMPILATION_CACHE": setting.format(folder=folder)}
    result = run_generate("--target=random", "--draft=none", "--max_new_tokens=2", *switch, env=env)
    assert not hits(result.stderr) and not misses(result.stderr)  # JAX never looked
    assert not folder.exists()


def test_the_default_folder_is_under_spec_jax_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEC_JAX_CACHE", str(tmp_path))
    assert executables.persistent_cache_dir() == tmp_path / "compilation" / builds.build_digest()
    assert executables.persistent_cache_dir(tmp_path / "x") == tmp_path / "x" / builds.build_digest()


def test_a_rebuilt_kernel_library_gets_a_folder_of_its_own(tmp_path, monkeypatch):
    """Programs hold the kernel's target name, not its code: a library built from another source,
    or with other flags, under the same names must not meet executables compiled beside the old one."""
    folders = {executables.persistent_cache_dir(tmp_path)}
    changed = tmp_path / "cpu_matmul.cc"
    changed.write_bytes(cpu_matmul.SOURCE.read_bytes() + b"\n// changed\n")
    monkeypatch.setattr(cpu_matmul, "SOURCE", changed)
    folders.add(executables.persistent_cache_dir(tmp_path))
    monkeypatch.setattr(cpu_matmul, "COMMON_FLAGS", (*cpu_matmul.COMMON_FLAGS, "-O2"))
    folders.add(executables.persistent_cache_dir(tmp_path))
    assert len(folders) == 3


COMPILE_ONLY_PROGRAM = """
import sys
import warnings

import jax
import jax.numpy as jnp

from spec_jax import executables

executables.enable_persistent_cache(sys.argv[1])
from models.kernels import compile_targets as ct  # noqa: E402

ct.add_compile_deps()
jnp.ones(3).sum().block_until_ready()  # a CPU program first: JAX decides then that the cache is used
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    ct.compile_for(lambda x: jnp.sin(x) @ x.T, (jax.ShapeDtypeStruct((128, 128), jnp.float32),), ct.device("tpu-v5e"))
print("warnings:", [str(w.message) for w in caught])
"""


@pytest.mark.skipif(
    "libtpu" in compile_targets.missing_packages(), reason="libtpu (compile-only TPU) not installed"
)
def test_compile_only_programs_are_not_written(tmp_path):
    """A compile-only TPU executable can be written but not read back (a warning per program on
    every later run): compile_targets.compile_for keeps it out of the persistent cache."""
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    for _ in range(2):
        result = subprocess.run(
            [sys.executable, "-c", COMPILE_ONLY_PROGRAM, str(tmp_path)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=env,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert "warnings: []" in result.stdout, result.stdout
    written = [p.name.partition("-")[0] for p in tmp_path.iterdir()]
    assert written and "jit__lambda" not in written, written
