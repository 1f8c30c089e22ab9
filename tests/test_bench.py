"""The benchmark harness runs (quick mode); its timings are reported, never asserted."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}


def bench(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "launch.bench", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=ENV,
        timeout=timeout,
    )


def read_report(folder, suite):
    report = json.loads((folder / f"{suite}-quick.json").read_text())
    assert report["info"]["git_revision"] and report["info"]["devices"]
    assert report["info"]["peak_rss_mb"] > 0
    assert (folder / f"{suite}-quick.md").read_text().count("|") > 10
    assert (folder / f"{suite}-quick.csv").read_text().count("\n") == len(report["rows"]) + 1
    return report


@pytest.mark.parametrize("suite", ["loop", "overhead"])
def test_bench_suite_runs_and_writes_results(tmp_path, suite):
    result = bench(f"--suite={suite}", "--quick", f"--output_dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    assert len(read_report(tmp_path, suite)["rows"]) >= 2


def test_peer_decode_roofline_suites_run_together_on_tiny_models(tmp_path):
    # One process, so the loops compiled for the peer suite are reused by decode. The HF side
    # is the worker's --fake backend (no torch), driven over the real JSON-lines protocol.
    result = bench(
        "--suite=peer,decode,roofline",
        "--quick",
        f"--output_dir={tmp_path}",
        f"--peer_python={sys.executable}",
    )
    assert result.returncode == 0, result.stderr

    peer = read_report(tmp_path, "peer")
    systems = [r["system"] for r in peer["rows"]]
    assert systems[:2] == ["HF transformers, plain", "HF transformers, assisted"]
    assert all(r["tokens_per_s"] > 0 for r in peer["rows"][:4])
    assert peer["rows"][-1]["greedy_outputs_agree"].endswith("/2 prompts")
    assert peer["info"]["peer_worker"]["versions"]["backend"] == "fake"
    assert len(peer["sections"]["greedy agreement per prompt"]) == 2

    decode = read_report(tmp_path, "decode")
    assert {(r["batch"], r["gamma"]) for r in decode["rows"]} == {(1, 0), (1, 2), (2, 0), (2, 2)}
    for row in decode["rows"]:
        assert row["per_repeat_tokens_per_s_min"] <= row["per_repeat_tokens_per_s"]
        assert row["ttft_ms"] > 0
    # Greedy speculative decoding reproduces the AR tokens, on every prompt at every batch size.
    identity = decode["sections"]["greedy identity"][0]
    assert identity["identical_rows"] == "6/6" and identity["prompts_covered"] == "2/2"

    roofline = read_report(tmp_path, "roofline")
    calls = [r["call"] for r in roofline["rows"]]
    assert calls == ["target decode step (T=1)", "draft decode step (T=1)", "target verify call (T=3)"]
    assert all(r["floor_ms"] > 0 and r["step_over_floor"] > 0 for r in roofline["rows"])
    assert all(r["gb_per_s"] > 0 for r in roofline["sections"]["memory bandwidth"])
    assert {r["kind"] for r in roofline["sections"]["memory bandwidth"]} == {"copy", "read"}


def test_peer_suite_without_its_interpreter_skips_cleanly_and_writes_nothing(tmp_path):
    result = bench("--suite=peer", "--quick", f"--output_dir={tmp_path}", "--peer_python=/nonexistent/python")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and "skipped" in lines[0] and "pip install torch==2.13.0" in lines[0]
    assert not tmp_path.exists() or not list(tmp_path.iterdir())


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None, reason="this interpreter has torch")
def test_peer_suite_without_torch_skips_before_loading_any_model(tmp_path):
    # Not --quick: the real path probes the interpreter for torch/transformers first.
    result = bench("--suite=peer", f"--output_dir={tmp_path}", f"--peer_python={sys.executable}", timeout=120)
    assert result.returncode == 0, result.stderr
    assert "skipped" in result.stdout and "cannot import" in result.stdout
    assert not tmp_path.exists() or not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "flag", ["--suite=nope", "--gammas=0", "--batch_sizes=x", "--temperatures=-1", "--num_prompts=9"]
)
def test_bench_rejects_bad_flags_in_one_line(flag):
    suite = [] if flag.startswith("--suite") else ["--suite=decode"]
    result = bench(flag, *suite, timeout=120)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert flag.split("=")[0].lstrip("-") in result.stderr
