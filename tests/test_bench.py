"""The benchmark suites run (quick mode: tiny models) and write the experiments' outputs; their
timings are reported, never asserted."""

import csv
import json
import subprocess
import sys

import pytest
from conftest import cli_case

# Every run below is a case of one `launch.bench` process (conftest.cli_case: Python, jax and the
# tiny models' compiled loops shared, each case as `python -m launch.bench ARGS` sees it); the
# tests reading it are one xdist group, so that one pytest worker runs it.
in_one_process = pytest.mark.xdist_group("bench_cases")
QUICK_SUITES = ["loop", "overhead", "profile", "attention"]


def runs(folder) -> dict:
    """{name: the arguments of one run of launch.bench}, each writing under folder/NAME."""
    peer = ["--suite=peer", "--config.peers=hf,ov"]
    return {
        "quick": [f"--suite={','.join(QUICK_SUITES)}", "--quick", f"--output_dir={folder / 'quick'}"],
        # run in the registry's order: peer, decode, roofline
        "together": ["--suite=roofline,decode,peer", "--quick", f"--output_dir={folder / 'together'}"]
        + [f"--config.peer_python={sys.executable}"],
        "no_interpreter": [*peer, "--quick", f"--output_dir={folder / 'no_interpreter'}"]
        + ["--config.peer_python=/nonexistent/python"],
        # Not --quick: the real path probes the interpreter for each library's packages first. The
        # interpreter: a bare venv (this one has torch: the `hf` test extra).
        "no_library": [*peer, f"--output_dir={folder / 'no_library'}"]
        + [f"--config.peer_python={folder / 'bare' / 'bin' / 'python'}"],
        "alone": ["--suite=peer", "--quick", f"--output_dir={folder / 'alone'}"]
        + ["--config.peer_python=/nonexistent/python", "--config.peers=llama,ov"]
        + ["--config.llama_draft_n_max=1,3", "--config.repeats=1"],
    }


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The runs' folder, with the bare venv (no pip, no packages) that no_library names."""
    folder = tmp_path_factory.mktemp("bench")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder / "bare")], check=True)
    return folder


def bench_case(folder, args):
    """`python -m launch.bench *args`'s result, args one of runs(folder)'s or BAD_FLAGS's."""
    return cli_case("launch.bench", [*runs(folder).values(), *[a for a, _ in BAD_FLAGS]], args)


def bench(folder, name):
    """(result, output folder) of runs(folder)[name]."""
    return bench_case(folder, runs(folder)[name]), folder / name


def read_report(folder, suite):
    """The sidecar, checked against the CSV and the Markdown of the same run."""
    report = json.loads((folder / f"{suite}.json").read_text())
    prov = report["provenance"]
    assert prov["git_revision"] and prov["machine"]["devices"] and prov["peak_rss_mb"] > 0
    assert prov["command"].startswith("python -m launch.bench --suite=")
    markdown = (folder / f"{suite}.md").read_text()
    assert markdown.count("|") > 10 and "peak RSS" in markdown
    with open(folder / f"{suite}.csv") as f:
        report["rows"] = list(csv.DictReader(f))
    assert report["columns"] == list(report["rows"][0])
    return report


@pytest.mark.parametrize("suite", ["loop", "overhead", "profile"])
@in_one_process
def test_bench_suite_runs_and_writes_results(folder, suite):
    result, out = bench(folder, "quick")
    assert result.returncode == 0, result.stderr
    assert len(read_report(out, suite)["rows"]) >= 2


@in_one_process
def test_peer_decode_roofline_suites_run_together_on_tiny_models(folder):
    # One run, so the loops compiled for the peer suite are reused by decode. The peers are
    # their workers' fake backends (no torch, no openvino, no llama.cpp build), driven over the
    # real JSON-lines protocol.
    result, out = bench(folder, "together")
    assert result.returncode == 0, result.stderr
    written = [line.rsplit("/", 1)[-1] for line in result.stdout.splitlines() if line.endswith(".json")]
    assert written == ["peer.json", "decode.json", "roofline.json"]

    peer = read_report(out, "peer")
    systems = [r["system"] for r in peer["rows"]]
    assert systems == [
        "spec-jax, autoregressive",
        "spec-jax, speculative gamma 2",
        "spec-jax, speculative gamma auto",  # the main job's default
        "HF transformers, plain",
        "HF transformers, assisted",
        "OpenVINO GenAI, plain",
        "OpenVINO GenAI, speculative gamma 2",
        "llama.cpp, plain",
        "llama.cpp, speculative gamma 2",  # llama_draft_n_max: (2,) in quick mode
        "summary",
    ]
    assert all(float(r["tokens_per_s"]) > 0 for r in peer["rows"][:9])
    # The fake workers answer other tokens (llama.cpp's: other text) than the tiny model: only
    # spec-jax agrees with itself.
    agree = [r["greedy_same_as_spec_jax_ar"] for r in peer["rows"][1:9]]
    assert agree == ["2/2 prompts"] * 2 + ["0/2 prompts"] * 6
    for key in ("hf", "ov", "llama"):
        assert peer["summary"][f"{key}_worker"]["versions"]["backend"] == "fake"
    # Prefill and decode per phase where a system reports them: spec-jax's and llama.cpp's rows.
    phases = [r["system"] for r in peer["rows"] if r["prefill_ms"] and float(r["decode_tokens_per_s"]) > 0]
    assert phases == [systems[i] for i in (0, 1, 2, 7, 8)]
    assert float(peer["rows"][8]["acceptance_rate"]) == 0.5 and peer["rows"][-1]["best_llama_cpp"]
    assert len(peer["summary"]["sections"]["greedy agreement with spec-jax autoregressive, per prompt"]) == 2

    decode = read_report(out, "decode")
    assert {(r["batch"], r["gamma"]) for r in decode["rows"]} == {
        ("1", "0"),
        ("1", "2"),
        ("1", "auto"),  # gamma=auto in the first cell
        ("2", "0"),
        ("2", "2"),
    }
    for row in decode["rows"]:
        assert float(row["per_repeat_tokens_per_s_min"]) <= float(row["per_repeat_tokens_per_s"])
        assert float(row["ttft_ms"]) > 0
    # Greedy speculative decoding reproduces the AR tokens, on every prompt at every batch size.
    identity = decode["summary"]["sections"]["greedy identity"][0]
    # 2 repeats of batch 1 at gamma 2 and at auto, 2 repeats of batch 2 at gamma 2: 8 rows.
    assert identity["identical_rows"] == "8/8" and identity["prompts_covered"] == "2/2"
    assert decode["passed"] is True

    roofline = read_report(out, "roofline")
    calls = [r["call"] for r in roofline["rows"]]
    assert calls == ["target decode step (T=1)", "draft decode step (T=1)", "target verify call (T=3)"]
    assert all(float(r["floor_ms"]) > 0 and float(r["step_over_floor"]) > 0 for r in roofline["rows"])
    assert {r["precision"] for r in roofline["rows"]} == {"int8"}
    bandwidth = roofline["summary"]["sections"]["memory bandwidth"]
    assert all(r["gb_per_s"] > 0 for r in bandwidth) and {r["kind"] for r in bandwidth} == {"copy", "read"}


@in_one_process
def test_attention_suite_runs_the_kernels_in_interpret_mode(folder):
    result, out = bench(folder, "quick")
    assert result.returncode == 0, result.stderr
    rows = read_report(out, "attention")["rows"]
    assert len(rows) == 8 and all(float(r["max_rel_error"]) < 1e-5 for r in rows)


@in_one_process
def test_peer_suite_without_its_interpreter_skips_cleanly_and_writes_nothing(folder):
    result, out = bench(folder, "no_interpreter")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and "skipped" in lines[0] and "pip install torch==2.13.0" in lines[0]
    assert "openvino-genai==2026.4.1.0" in lines[0]
    assert not out.exists() or not list(out.iterdir())


@in_one_process
def test_peer_suite_without_any_peer_library_skips_before_loading_any_model(folder):
    result, out = bench(folder, "no_library")
    assert result.returncode == 0, result.stderr
    hf, ov, last = result.stdout.strip().splitlines()
    assert "HF transformers skipped" in hf and "cannot import" in hf and "torch==2.13.0" in hf
    assert "OpenVINO GenAI skipped" in ov and "cannot import" in ov and "openvino-genai==2026.4.1.0" in ov
    assert "peer suite skipped" in last
    assert not out.exists() or not list(out.iterdir())


@in_one_process
def test_the_peers_asked_for_run_alone_and_llama_cpp_needs_no_reference_interpreter(folder):
    """Two peers of four: llama.cpp's worker needs only the standard library, so it runs in this
    interpreter at every llama_draft_n_max, while OpenVINO's, which needs peer_python, is
    skipped in one line; the peers not asked for leave no trace."""
    result, out = bench(folder, "alone")
    assert result.returncode == 0, result.stderr
    (skipped,) = [line for line in result.stdout.splitlines() if "skipped" in line]
    assert "OpenVINO GenAI skipped" in skipped and "no such interpreter" in skipped
    peer = read_report(out, "peer")
    assert [r["system"] for r in peer["rows"]][3:] == [
        "llama.cpp, plain",
        "llama.cpp, speculative gamma 1",
        "llama.cpp, speculative gamma 3",
        "summary",
    ]
    assert peer["summary"]["llama_worker"]["versions"]["backend"] == "fake"
    assert "hf_worker" not in peer["summary"] and "best_hf" not in peer["rows"][-1]


BAD_FLAGS = [
    (["--suite=nope"], "--suite"),
    (["--suite=table1"], "--suite"),
    (["--suite=decode", "--gammas=0"], "--gammas"),
    (["--suite=decode", "--config.batch_sizes=x"], "--config.batch_sizes"),
    (["--suite=decode", "--config.temperatures=-1"], "--config.temperatures"),
    (["--suite=decode", "--config.num_prompts=9"], "--config.num_prompts"),
    (["--suite=decode", "--config.drafters=model,lookahead"], "--config.drafters"),
    (["--suite=decode", "--config.suffix_threshold=-0.1"], "--config.suffix_threshold"),
    (["--suite=decode", "--config.prompt_set=closed"], "--config.prompt_set"),
    (["--suite=decode", "--config.max_ngram=0"], "--config.max_ngram"),
    (["--suite=decode", "--config.draft_threshold=1.0"], "--config.draft_threshold"),
    (["--suite=loop", "--config.no_such=1"], "--config.no_such"),
    (["--suite=peer", "--config.hf_dtype=float16"], "--config.hf_dtype"),
    (["--suite=peer", "--config.peers=hf,vllm"], "--config.peers"),
    (["--suite=peer", "--config.llama_draft_n_max=0"], "--config.llama_draft_n_max"),
    (["--suite=peer", "--config.llama_draft_n_max=2,2"], "--config.llama_draft_n_max"),
    (["--suite=peer", "--config.prompt_set=closed"], "--config.prompt_set"),
]


@pytest.mark.parametrize("args, message", BAD_FLAGS)
@in_one_process
def test_bench_rejects_bad_flags_in_one_line(folder, args, message):
    result = bench_case(folder, args)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert message in result.stderr
