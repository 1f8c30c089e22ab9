"""Issue 39: the command line as a newcomer meets it. --help exits 0 at every entry point; SIGINT
and SIGTERM are one line with exit code 130 / 143 and no half-written --output_json; a missing
--prompt names the prompt used; generated text reaches a terminal with its control characters
escaped; `launch.experiment --list` names the experiments; the persistent compilation cache gets
the kernel folder's ownership and permission checks (one warning, then a private cache)."""

import os
import pathlib
import pty
import select
import signal
import subprocess
import sys
import time

import pytest
from conftest import cache_with_kernels

import experiments
from launch import common
from spec_jax import executables

ROOT = pathlib.Path(__file__).resolve().parent.parent
# gamma 4: auto would first measure the pair's costs (tests/test_newcomer_costs.py)
RANDOM_PAIR = ["--target=random", "--draft=random-draft", "--gamma=4"]
ENTRY_POINTS = ["launch.generate", "launch.experiment", "launch.bench", "launch.train", "launch.tpu"]


def env(**extra):
    return {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", **extra}


def test_every_help_flag_of_every_entry_point_exits_0():
    """absl's --help flags print the usage and exit 1 (absl.app.HelpFlag); launch.common.parse_flags
    makes a help that was asked for exit 0."""
    cases = [(m, "--help") for m in ENTRY_POINTS] + [("launch.generate", f) for f in ("-?", "--helpfull")]
    procs = [
        (
            m,
            flag,
            subprocess.Popen(
                [sys.executable, "-m", m, flag],
                cwd=ROOT,
                env=env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            ),
        )
        for m, flag in cases
    ]
    for module, flag, proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, (module, flag, err[-2000:])
        assert "USAGE" in out.upper() or "flags:" in out, (module, flag, out[:500])


def test_experiment_list_names_each_experiment_on_one_line():
    result = subprocess.run(
        [sys.executable, "-m", "launch.experiment", "--list"],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert [line.split()[0] for line in lines] == experiments.names()
    for line, name in zip(lines, experiments.names(), strict=True):
        assert experiments.load(name).TITLE in line


def test_terminal_text_escapes_control_characters_on_a_pty_only():
    text = "ok\x1b]0;owned\x07\x1b[2J\rline\tend\n\x9bx"
    leader, follower = pty.openpty()
    try:
        with os.fdopen(follower, "w", closefd=False) as tty:
            shown = common.terminal_text(text, tty)
    finally:
        os.close(leader)
        os.close(follower)
    assert "\x1b" not in shown and "\x07" not in shown and "\r" not in shown and "\x9b" not in shown
    assert shown == "ok\\x1b]0;owned\\x07\\x1b[2J\\rline\tend\n\\x9bx"
    read, write = os.pipe()
    with os.fdopen(write, "w") as pipe:
        assert common.terminal_text(text, pipe) == text  # a file or pipe gets the text as generated
    os.close(read)


# A random target whose text is control characters (the ByteTokenizer's decode replaced).
HOSTILE = """
import sys
import models
models.ByteTokenizer.decode = lambda self, ids, **kwargs: "HOSTILE\\x1b]0;owned\\x07\\x1b[2J\\r"
from launch import generate
sys.argv = ["launch.generate", *sys.argv[1:]]
generate.cli()
"""


def _read_all(fd, proc, timeout=300) -> bytes:
    out, deadline = b"", time.time() + timeout
    while time.time() < deadline:
        ready, _, _ = select.select([fd], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # the follower side closed
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    return out


def test_generate_on_a_terminal_escapes_control_characters_and_names_the_default_prompt(tmp_path):
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-c", HOSTILE, "--target=random", "--draft=none", "--max_new_tokens=2"],
        cwd=ROOT,
        env=env(SPEC_JAX_COMPILATION_CACHE="0", SPEC_JAX_CACHE=str(cache_with_kernels(tmp_path / "cache"))),
        stdout=follower,
        stderr=subprocess.PIPE,
    )
    os.close(follower)
    try:
        shown = _read_all(leader, proc)
        err = proc.communicate(timeout=300)[1].decode()
    finally:
        os.close(leader)
    assert proc.returncode == 0, err
    assert b"HOSTILE\\x1b]0;owned\\x07\\x1b[2J\\r" in shown, shown
    assert b"\x1b" not in shown and b"\x07" not in shown
    assert "no --prompt given; using the prompt 'def fibonacci(n):\\n    '" in err.splitlines(), err


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_is_one_line_exit_128_plus_it_and_writes_no_output_file(tmp_path, signum):
    out = tmp_path / "out.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "launch.generate",
            *RANDOM_PAIR,
            "--max_new_tokens=64",
            f"--output_json={out}",
        ],
        cwd=ROOT,
        env=env(SPEC_JAX_COMPILATION_CACHE="0", SPEC_JAX_CACHE=str(cache_with_kernels(tmp_path / "cache"))),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    err = ""
    while "no --prompt given" not in err:  # main has checked the flags and loaded the models
        line = proc.stderr.readline()
        assert line, f"exited early: {proc.wait()} {err}"
        err += line
    time.sleep(1.0)  # into the model's construction or compilation
    proc.send_signal(signum)
    rest, tail = proc.communicate(timeout=300)
    lines = [line for line in (err + tail).splitlines() if line.strip()]
    assert proc.returncode == 128 + signum, err + tail
    assert "Traceback" not in tail and "KeyboardInterrupt" not in tail
    assert lines[-1].endswith(f"interrupted ({signal.Signals(signum).name}); nothing written"), lines
    others = [line for line in lines[:-1] if line != executables.COMPILE_NOTICE]
    assert len(others) == 1 and others[0].startswith("no --prompt given"), lines
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name != "cache"]


SIGNAL_IN_A_GC_CALLBACK = """
import gc, os, signal, time
from launch import common

def in_the_collector(phase, info):  # as jax's _xla_gc_callback: runs whenever Python collects
    if phase == "start" and not fired:
        fired.append(1)
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(10_000):  # the handler runs here, between two bytecodes of the callback
            pass

fired = []

def main(argv):
    gc.callbacks.append(in_the_collector)
    gc.collect()
    time.sleep(3)
    print("finished")

common.run(main, compilation_cache=False)
"""


SIGNAL_IN_A_WEAKREF_CALLBACK = """
import os, signal, time, weakref
from launch import common

class Thing:
    pass

def on_collect(ref):  # a weakref callback: an exception raised in it is printed and dropped
    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(10_000):
        pass

def main(argv):
    thing = Thing()
    ref = weakref.ref(thing, on_collect)
    del thing
    time.sleep(0.5)
    print("finished")

common.run(main, compilation_cache=False)
"""


AN_ERROR_AFTER_THE_SIGNAL = """
import os, signal
from launch import common

def main(argv):
    try:
        os.kill(os.getpid(), signal.SIGINT)  # Interrupted is raised here ...
        for _ in range(10_000):
            pass
    finally:  # ... and a library's cleanup fails on its half-built state, replacing it
        raise AttributeError("'int' object has no attribute '_get_vars'")

common.run(main, compilation_cache=False)
"""


def _interrupted_script(code: str) -> subprocess.CompletedProcess:
    """code run by a fresh Python in the checkout; asserts it ended as a SIGINT ends a run (130)."""
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 128 + signal.SIGINT, proc.stdout + proc.stderr
    return proc


def test_a_signal_swallowed_in_a_weakref_callback_ends_the_run_when_main_returns():
    """Where the handler cannot tell that its exception will be dropped (a weakref callback),
    the run still ends with 130 and the interrupt line once main returns
    (launch.common.raise_if_interrupted; launch.runtime.write_json_atomic calls it too, so no
    output file is written after the signal)."""
    proc = _interrupted_script(SIGNAL_IN_A_WEAKREF_CALLBACK)
    assert proc.stderr.strip().splitlines()[-1].endswith("interrupted (SIGINT); nothing written")


def test_a_signal_that_lands_in_a_gc_callback_still_ends_the_run():
    """An exception raised inside a garbage-collector callback is printed as "Exception ignored"
    and dropped (once in CI: a SIGINT in jax's callback let launch.generate finish with exit 0);
    the handler sends the signal again instead, so the run ends with 130 and one line."""
    proc = _interrupted_script(SIGNAL_IN_A_GC_CALLBACK)
    assert "finished" not in proc.stdout and "Exception ignored" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith("interrupted (SIGINT); nothing written")


def test_an_error_that_follows_a_signal_is_reported_as_the_interruption():
    """Interrupted raised inside jax's lowering (SIGTERM while compiling) can be replaced by an
    error of jax's own half-built state, as a failing cleanup replaces it here; the run still
    ends as the signal ends it (130 and one line, no traceback), not as a crash (exit 1)."""
    proc = _interrupted_script(AN_ERROR_AFTER_THE_SIGNAL)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith("interrupted (SIGINT); nothing written")


# --- the compilation cache ------------------------------------------------------------------------

# Enables the cache as the entry points do (launch.runtime.enable_compilation_cache), compiles a
# program and prints the folder in use. argv[1]: "deny-write" makes the folder read-only to
# this process (os.access; root can write anywhere, so a chmod cannot show it).
COMPILE = """
import os, sys
from absl import flags
from launch import common, runtime
from spec_jax import executables
from models.kernels import libraries
if sys.argv[1] == "deny-write":
    access = os.access
    libraries.os.access = lambda p, mode, **k: False if mode == os.W_OK and "shared" in str(p) else access(p, mode, **k)
flags.FLAGS(["x"])
common.warnings.showwarning = common._warning_line
folder = runtime.enable_compilation_cache()
import jax, jax.numpy as jnp
for i in range(3):
    jax.jit(lambda x: x * (i + 2) + 1)(jnp.arange(4.0)).block_until_ready()
print(folder)
"""


@pytest.mark.parametrize("problem", ["world-writable", "another user's", "read-only"])
def test_a_compilation_cache_failing_the_kernel_folders_checks_is_not_used(tmp_path, problem):
    shared = tmp_path / "shared"
    shared.mkdir()
    if problem == "world-writable":
        shared.chmod(0o777)
    elif problem == "another user's":
        if os.geteuid() != 0:
            pytest.skip("giving a folder to another user needs root")
        os.chown(shared, 65534, 65534)
    result = subprocess.run(
        [sys.executable, "-c", COMPILE, "deny-write" if problem == "read-only" else "-"],
        cwd=ROOT,
        env=env(SPEC_JAX_COMPILATION_CACHE=str(shared)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    used = pathlib.Path(result.stdout.strip().splitlines()[-1])
    assert shared not in used.parents and used.name != "None"
    assert not [p for p in shared.rglob("*") if p.is_file()]  # nothing written into it
    warnings = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(warnings) == 1 and "not using the compilation cache" in warnings[0], result.stderr


def test_a_compilation_cache_of_ones_own_is_used(tmp_path):
    mine = tmp_path / "mine"
    result = subprocess.run(
        [sys.executable, "-c", COMPILE, "-"],
        cwd=ROOT,
        env=env(SPEC_JAX_COMPILATION_CACHE=str(mine)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr
    assert mine in pathlib.Path(result.stdout.strip()).parents
    assert len([p for p in mine.rglob("*") if p.is_file()]) >= 3


def test_failure_modes_doc_shows_the_lines_the_code_prints():
    """docs/failure_modes.md quotes the interrupt line, the rebuilt entry's warning and the GGUF
    refusal as the code writes them (the tests above and in test_cache_safety /
    test_newcomer_gguf check the code's side)."""
    doc = (ROOT / "docs" / "failure_modes.md").read_text()
    assert "interrupted (SIGINT); nothing written" in doc and "130" in doc and "143" in doc
    assert "warning: damaged cache entry PATH: WHAT; rebuilding it" in doc
    assert "truncated or corrupt: tensor 'blk.1.ffn_down.weight' needs bytes up to" in doc
    assert "O_NOFOLLOW" in doc and "private temporary cache" in doc
