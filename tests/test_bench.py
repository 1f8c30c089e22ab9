"""The benchmark harness runs (quick mode); its timings are reported, never asserted."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("suite", ["loop", "overhead", "decode"])
def test_bench_suite_runs_and_writes_results(tmp_path, suite):
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-m", "launch.bench", f"--suite={suite}", "--quick", f"--output_dir={tmp_path}"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / f"{suite}-quick.json").read_text())
    assert report["info"]["git_revision"] and report["info"]["devices"]
    assert len(report["rows"]) >= 2
    assert (tmp_path / f"{suite}-quick.md").read_text().count("|") > 10


def test_bench_rejects_an_unknown_suite():
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-m", "launch.bench", "--suite=nope"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
