"""The workload suite (`launch.bench --suite=workloads`): its prompt sets (six categories, two
disjoint splits), its quick run on tiny models with llama.cpp's fake backend, its figures on
made-up runs (where the answer is known), and its one-line refusals of bad settings."""

import csv
import json
import os
import sys

import pytest
from conftest import cli_case

from experiments import bench_workloads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import workload_prompts  # noqa: E402  (scripts/ is not a package)

sys.path.remove(os.path.join(ROOT, "scripts"))

in_one_process = pytest.mark.xdist_group("bench_workloads_cases")
BAD_FLAGS = [
    (["--config.categories=code_completion,poetry"], "--config.categories"),
    (["--config.categories=chat,chat"], "--config.categories"),
    (["--config.prompt_set=open"], "--config.prompt_set"),
    (["--config.gamma=0"], "--config.gamma"),
    (["--config.drafters=lookahead"], "--config.drafters"),
    (["--config.prompts_per_category=0"], "--config.prompts_per_category"),
    (["--config.prompts_per_category=9"], "--config.prompts_per_category"),  # the files hold 8
    (["--config.llama_draft_n_max=0"], "--config.llama_draft_n_max"),
]


def records(split: str) -> list[dict]:
    with open(os.path.join(bench_workloads.PROMPTS_DIR, f"{split}.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_each_split_holds_every_category_from_its_own_documents():
    sources = {}
    for split in workload_prompts.SPLITS:
        recs = records(split)
        counts = {c: sum(r["category"] == c for r in recs) for c in bench_workloads.CATEGORIES}
        assert counts == dict.fromkeys(bench_workloads.CATEGORIES, workload_prompts.PER_SPLIT)
        assert all(workload_prompts.split_of(r["source"]) == split for r in recs)
        sources[split] = {r["source"] for r in recs}
    assert not sources["bench"] & sources["heldout"]
    assert not {r["prompt"] for r in records("bench")} & {r["prompt"] for r in records("heldout")}


def test_the_split_is_a_function_of_the_source_alone():
    names = [f"doc{i}" for i in range(200)]
    first = [workload_prompts.split_of(n) for n in names]
    assert first == [workload_prompts.split_of(n) for n in names]
    assert 60 < first.count("bench") < 140  # both splits get documents


def test_builder_prompts_hold_what_their_category_asks_for():
    function = (
        "def area(width, height):\n    total = width * height\n"
        + "    total += 0\n" * 5
        + "    return total\n"
    )
    editing = workload_prompts.editing_prompt(function, 0)
    assert editing.endswith("def area(width_value, height):\n") and function.rstrip() in editing
    # Sentences of 60-200 characters: the intro and the harbour one; the middle of them is asked
    # for, by its longest word found once in the passage.
    text = "Intro line that is long enough to stand as one sentence of its own here. "
    text += (
        "The harbour reopened after the storm on a quiet Tuesday morning in March. " + "Filler text. " * 20
    )
    quoting = workload_prompts.quoting_prompt(text)
    assert quoting.endswith('Answer: "') and '"reopened"' in quoting
    assert workload_prompts.plain_sentence("Die Datei wurde nicht gefunden und bleibt leer.")
    assert not workload_prompts.plain_sentence("%s: Datei nicht gefunden, bitte erneut versuchen.")


def test_builder_rejects_a_bad_count_in_one_line(capsys):
    assert workload_prompts.main(["--per_split=0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--per_split" in err[0]


def _runs(plain_tokens, spec_tokens, seconds) -> bench_workloads.Runs:
    """Made-up runs of two prompts (one category each) through the three kinds of system."""
    recs = [{"category": "chat", "source": "a"}, {"category": "translation", "source": "b"}]
    spec = "spec-jax, model, gamma auto"
    results = {
        bench_workloads.PLAIN: [
            {"tokens": t, "num_tokens": 4, "seconds": s, "prefill_seconds": 0.1, "target_calls": 4}
            for t, s in zip(plain_tokens, seconds["plain"], strict=True)
        ],
        spec: [
            {"tokens": t, "num_tokens": 4, "seconds": s, "prefill_seconds": 0.1, "target_calls": 2}
            | {"num_drafted": 4, "num_accepted": 2}
            for t, s in zip(spec_tokens, seconds["spec"], strict=True)
        ],
        bench_workloads.LLAMA_PLAIN: [
            {"text": "", "num_tokens": 4, "seconds": s, "prefill_seconds": 0.1} for s in seconds["llama"]
        ],
    }
    runs = {name: {"results": r} for name, r in results.items()}

    class Tokenizer:
        def decode(self, ids):
            return "".join(chr(97 + i) for i in ids)

    info = {"tokenizer": Tokenizer(), "llama": {}, "prompt_tokens": [3, 3]}
    return bench_workloads.Runs(recs, runs, [0, 1], [bench_workloads.PLAIN, spec], info)


SECONDS = {"plain": [1.0, 2.0], "spec": [0.5, 4.0], "llama": [0.8, 1.0]}


def test_figures_per_category_are_the_runs_own():
    runs = _runs([[1, 2, 3, 4]] * 2, [[1, 2, 3, 4]] * 2, SECONDS)
    rows = {(r["category"], r["system"]): r for r in bench_workloads._rows(runs)}
    spec = rows[("chat", "spec-jax, model, gamma auto")]
    assert spec["over_spec_jax_plain"] == pytest.approx(2.0)  # 4 tokens in 0.5 s vs in 1 s
    assert spec["over_llama_cpp_plain"] == pytest.approx(1.6)
    assert spec["acceptance_rate"] == 0.5 and spec["tokens_per_target_call"] == 2.0
    assert rows[("translation", "spec-jax, model, gamma auto")]["over_spec_jax_plain"] == pytest.approx(0.5)
    assert rows[("all", "spec-jax, model, gamma auto")]["over_spec_jax_plain"] == pytest.approx(
        3 / 4.5
    )  # 8 tokens in 4.5 s vs in 3 s
    by_category = bench_workloads._by_category(list(rows.values()), runs.ours)
    assert [line["category"] for line in by_category] == ["chat", "translation", "all"]
    assert by_category[0]["exact"] == "1/1"


def test_exactness_check_fails_on_a_speculative_output_that_differs():
    runs = _runs([[1, 2, 3, 4]] * 2, [[1, 2, 3, 4], [1, 2, 9, 4]], SECONDS)
    assert bench_workloads._same_as_plain(runs, "spec-jax, model, gamma auto", 0)
    assert not bench_workloads._same_as_plain(runs, "spec-jax, model, gamma auto", 1)
    rows = bench_workloads._rows(runs)
    assert [r["same_as_spec_jax_plain"] for r in rows if r["system"].startswith("spec-jax, model")] == [
        "1/1",
        "0/1",
        "1/2",
    ]


def bench_case(folder, args):
    quick = ["--suite=workloads", "--quick", f"--output_dir={folder}"]
    cases = [quick] + [["--suite=workloads", *a] for a, _ in BAD_FLAGS]
    return cli_case("launch.bench", cases, args)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("workloads")


@in_one_process
def test_quick_run_reports_every_category_and_system_and_is_exact(folder):
    result = bench_case(folder, ["--suite=workloads", "--quick", f"--output_dir={folder}"])
    assert result.returncode == 0, result.stderr
    report = json.loads((folder / "workloads.json").read_text())
    with open(folder / "workloads.csv") as f:
        rows = list(csv.DictReader(f))
    systems = list(dict.fromkeys(r["system"] for r in rows))
    assert systems == [
        "spec-jax, plain",
        "spec-jax, model, gamma 2",
        "llama.cpp, plain",
        "llama.cpp, draft-simple 3",
        "llama.cpp, ngram-simple 3/16",
    ]
    assert list(dict.fromkeys(r["category"] for r in rows)) == [*bench_workloads.CATEGORIES, "all"]
    exact = {r["same_as_spec_jax_plain"] for r in rows if r["system"].startswith("spec-jax")}
    assert exact == {"1/1", "6/6"}  # each category's prompt, and all six
    assert report["summary"]["exact"] is True and report["provenance"]["command"].startswith(
        "python -m launch.bench"
    )
    assert all(float(r["tokens_per_s"]) > 0 and float(r["tokens_per_target_call"]) >= 1 for r in rows)
    assert "by category" in (folder / "workloads.md").read_text()


@pytest.mark.parametrize("args, message", BAD_FLAGS)
@in_one_process
def test_bad_settings_are_refused_in_one_line(folder, args, message):
    result = bench_case(folder, ["--suite=workloads", *args])
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert message in result.stderr
