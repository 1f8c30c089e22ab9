"""scripts/device_check.py's dry run: every table of the GPU check, at tiny shapes on the CPU.

The check waits for the first GPU machine (docs/benchmarks.md, "Measured on an H100/H200"); this
runs it the way that machine will, in a subprocess, so that a change that breaks it fails here.
"""

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "device_check.py")
TABLES = {
    "exactness": ["exactness"],
    "serve": ["serve"],
    "costs": [
        "step against the HBM floor",
        "verify in target steps",
        "Theorem 3.8: measured costs beside predicted_speed's H100",
        "memory bandwidth",
    ],
    "walltime": ["walltime"],
    "attention": ["attention"],
    "prefill": ["prefill"],
    "batch": ["batch"],
}


# The tests that read the dry run share one worker under `pytest -n` (pyproject's loadgroup), so
# that the minute-long dry run runs once, not once per worker.
DRY_RUN_GROUP = pytest.mark.xdist_group("device_check_dry_run")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """The dry run in a subprocess, as on the GPU machine (the XLA flags of tests/conftest.py)."""
    out = tmp_path_factory.mktemp("device_check")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, SCRIPT, f"--out={out}", "--dry_run", "--budget_s=1000"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with open(out / "results.json") as f:
        return json.load(f), (out / "results.md").read_text()


@DRY_RUN_GROUP
def test_the_dry_run_writes_every_table_with_finite_numbers(dry_run):
    results, _ = dry_run
    assert results["dry_run"] is True
    for section, tables in TABLES.items():
        s = results["sections"][section]
        assert s["status"] == "ok", (section, s.get("error"), s.get("traceback"))
        assert sorted(s["tables"]) == sorted(tables), section
        for title, rows in s["tables"].items():
            assert rows, f"{section}: table {title!r} is empty"
            numbers = {k: v for row in rows for k, v in row.items() if isinstance(v, float)}
            assert numbers, title
            # nan only where predicted_speed has no H100 figure (gammas 5 and 7, trees)
            assert all(math.isfinite(v) for k, v in numbers.items() if "h100" not in k), (title, rows)


@DRY_RUN_GROUP
def test_the_dry_runs_exactness_checks_pass_and_cover_every_drafter_and_kernel(dry_run):
    results, _ = dry_run
    checks = results["sections"]["exactness"]["checks"]
    assert checks and all(checks.values()), checks
    names = " ".join(checks)
    for what in (
        "model drafter, gamma",
        "prompt lookup",
        "tree of 8",
        "chi-square",
        "flash_decoding",
        "flash_attention",
    ):
        assert what in names, what
    walltime = results["sections"]["walltime"]["checks"]
    assert walltime and all(walltime.values()), walltime


@DRY_RUN_GROUP
def test_results_md_holds_each_table_and_the_goals(dry_run):
    results, md = dry_run
    for tables in TABLES.values():
        for title in tables:
            if title != "memory bandwidth":
                assert f"### {title}" in md, title
    assert "## Goals (issue 38)" in md and len(results["goals"]) == 6


def _script():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import device_check
    finally:
        sys.path.remove(os.path.join(ROOT, "scripts"))
    return device_check


def test_a_failing_section_is_recorded_and_the_rest_still_run(monkeypatch):
    """One section's exception is its result; the budget skips what is left, with a note."""
    device_check = _script()

    def broken(plan, state):
        raise RuntimeError("no such kernel\nsecond line")

    def fine(plan, state):
        return {"tables": {"t": [{"x": 1.0}]}, "checks": {}}

    monkeypatch.setattr(device_check, "section_exactness", broken)
    monkeypatch.setattr(device_check, "section_prefill", fine)
    out = device_check.run_sections(None, ["exactness", "prefill"], budget_s=1000)
    assert (
        out["exactness"]["status"] == "failed" and out["exactness"]["error"] == "RuntimeError: no such kernel"
    )
    assert out["prefill"]["status"] == "ok"
    skipped = device_check.run_sections(None, ["prefill"], budget_s=-1.0)
    assert skipped["prefill"]["status"] == "skipped" and "budget" in skipped["prefill"]["notes"][0]


@pytest.mark.parametrize(
    "flag, message",
    [
        ("--sections=costs,nope", "--sections: each one of exactness, serve, costs"),
        ("--num_layers=99", "--num_layers must be in [0, 64], got 99"),
        ("--budget_s=0", "--budget_s must be > 0, got 0.0"),
        ("--vocab_size=8", "--vocab_size must be 0 or in [256, 1048576], got 8"),
    ],
)
def test_bad_flags_exit_2_with_one_line_naming_the_flag(tmp_path, capsys, flag, message):
    with pytest.raises(SystemExit) as exit_info:
        _script().parse([f"--out={tmp_path}", flag])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]
