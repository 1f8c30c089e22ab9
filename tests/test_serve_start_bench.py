"""scripts/serve_start_bench.py: the seconds from launch.serve's start to its first /health 200."""

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "serve_start_bench.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )


def test_a_fresh_start_of_the_tiny_pair_is_timed_to_its_first_health_200():
    out = run("--repeats=1", "--fresh", "--serve_flags=--target=random --draft=random-draft --max_batch=1")
    assert out.returncode == 0, out.stderr[-2000:]
    (ready,) = re.findall(r"start 1: ready in ([\d.]+) s", out.stdout)
    (median,) = re.findall(r"median ([\d.]+) s to ready over 1 starts", out.stdout)
    assert 0 < float(ready) < 600 and median == ready


@pytest.mark.parametrize(
    "args, message",
    [
        (["--repeats=0"], "--repeats: at least 1, got 0"),
        (["--trees=/nonexistent"], "--trees: not a checkout"),
    ],
)
def test_bad_arguments_exit_2_with_one_line_naming_the_flag(args, message):
    out = run(*args)
    assert out.returncode == 2 and message in out.stderr.strip().splitlines()[-1]
    assert "Traceback" not in out.stderr
