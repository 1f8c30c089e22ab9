"""Draft-head training (the training package, launch.train): it learns what it should, the same config
and seed give the same parameters, a resumed run equals an uninterrupted one (also after a
SIGKILL), and bad settings get one clear error."""

import csv
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import CLI_TRAINING_FLAGS, cli_case
from test_ngram import cycle_following_target

import models
import training
from spec_jax import head_checkpoint
from training import features, head_run, loss
from training.head import initial_params

ROOT = pathlib.Path(__file__).resolve().parent.parent
VOCAB = 16


def cycle_sets(seq_len=16):
    """(train, eval) FeatureSets of the cycle target (its next token is always token + 1 mod 16)
    over random text: the target's feature at j says which token is at j, not which comes next,
    so the head can only predict f_{j+1} by reading the token t_{j+1} it is given."""
    target = cycle_following_target(VOCAB)
    rng = np.random.default_rng(0)
    seqs = [list(rng.integers(0, VOCAB, 40)) for _ in range(24)]
    sets = []
    for part in (seqs[:20], seqs[20:]):
        w = features.windows(part, seq_len, 10**6, seed=0)
        f, g = features.extract(target.config, target.params, w, batch_size=8, progress=False)
        sets.append(features.FeatureSet(w, f, g))
    return target, sets


@pytest.fixture(scope="module")
def cycle():
    return cycle_sets()


def config(**changes):
    c = training.default_config()
    c.target, c.target_dtype, c.vocab, c.seq_len = "cycle", "float32", 0, 16
    c.batch_size, c.steps, c.warmup_steps, c.learning_rate = 4, 60, 5, 1e-2
    c.eval_every = c.checkpoint_every = 20
    c.eval_windows = 8
    c.init_from_target = c.identity_init = False
    c.token_weight = 0.1
    for k, v in changes.items():
        c[k] = v
    return c


def run(cycle, workdir, stop_at=None, **changes):
    target, (train_set, eval_set) = cycle
    ids = np.arange(VOCAB)
    return training.train(
        config(**changes), workdir, target, ids, train_set, eval_set, progress=False, stop_at=stop_at
    )


def test_a_head_trained_on_the_cycle_drafts_it_and_a_misaligned_loss_does_not(cycle, tmp_path, monkeypatch):
    """The cycle target's features are one-hot: the head must learn to map (f_j, e(t_{j+1})) to
    f_{j+1} from the token it is given. Trained, its drafts agree (a chain of 4 mostly all);
    with the regression target shifted by one position (predicting f_j, a classic
    misalignment) the first draft does not."""
    result = run(cycle, tmp_path / "ok", steps=200)
    assert result.best["acc_1"] > 0.9 and result.best["eval_length"] > 4.0
    assert result.history[-1]["loss"] < 0.2 * result.history[0]["loss"]

    def misaligned(tokens, feats):  # the goal one position early: f_j where f_{j+1} belongs
        return feats[:, :-1], tokens[:, 1:], feats[:, :-1]

    monkeypatch.setattr(loss, "training_pairs", misaligned)
    broken = run(cycle, tmp_path / "broken", steps=200)
    assert broken.best["acc_1"] < 0.3


def test_a_training_batch_pairs_each_windows_tokens_with_its_own_features():
    """Windows whose every token and feature is the window's index: the batch must keep them
    together, whatever order the indices come in."""
    n, t = 6, 4
    tokens = np.repeat(np.arange(n, dtype=np.int32)[:, None], t, axis=1)
    feats = np.broadcast_to(np.arange(n, dtype=np.float16)[:, None, None], (n, t, 3)).copy()
    data = features.FeatureSet(features.Windows(tokens, np.ones((n, t), bool)), feats, tokens)
    tok, mask, f = loss.training_batch(data, np.array([4, 1, 3]))
    np.testing.assert_array_equal(np.asarray(f)[:, :, 0], np.asarray(tok))
    assert bool(np.all(mask))


def test_the_same_config_and_seed_give_the_same_parameters_and_another_seed_does_not(cycle, tmp_path):
    a = run(cycle, tmp_path / "a", steps=20)
    b = run(cycle, tmp_path / "b", steps=20)
    c = run(cycle, tmp_path / "c", steps=20, seed=1)
    assert a.params_hash == b.params_hash != c.params_hash


def test_resuming_with_other_settings_is_refused(cycle, tmp_path):
    run(cycle, tmp_path / "w", steps=20)
    with pytest.raises(ValueError, match="config.learning_rate differs"):
        run(cycle, tmp_path / "w", steps=20, learning_rate=2e-2)


def test_a_trained_head_loads_for_its_target_only(cycle, tmp_path):
    target, _ = cycle
    run(cycle, tmp_path / "w", steps=20)
    head, ids, meta = head_checkpoint.load_head(tmp_path / "w", target)
    assert head.config.kind == "draft_head" and ids.tolist() == list(range(VOCAB))
    assert meta["target"]["name"] == target.config.name
    other = models.random_model(
        vocab_size=VOCAB, num_layers=1, d_model=VOCAB, num_heads=2, num_kv_heads=1, name="other"
    )
    wider = models.random_model(
        vocab_size=VOCAB, num_layers=1, d_model=2 * VOCAB, num_heads=2, num_kv_heads=1
    )
    for wrong in (other, wider):
        with pytest.raises(ValueError, match="was trained for target"):
            head_checkpoint.load_head(tmp_path / "w", wrong)
    with pytest.raises(ValueError, match="no trained head"):
        head_checkpoint.load_head(tmp_path / "empty", target)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"head_mlp_dim": 10**6}, "head_mlp_dim: must be an integer in"),
        ({"head_layers": 5}, "head_layers: must be an integer in"),
        ({"learning_rate": 0.0}, "learning_rate: must be positive"),
        ({"batch_size": 0}, r"batch_size: must be an integer in \[1, 4096\]"),
    ],
)
def test_bad_training_settings_get_one_clear_error(cycle, tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        run(cycle, tmp_path / "w", **changes)


def cli(*args, workdir, output_dir, **kw):
    cmd = [sys.executable, "-m", "launch.train", "--config=launch/configs/draft_head.py:quick"]
    cmd += [f"--workdir={workdir}", f"--output_dir={output_dir}", *args]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def summary_hash(output_dir) -> str:
    return json.loads((pathlib.Path(output_dir) / "train_head.json").read_text())["summary"]["params_hash"]


def test_the_cli_refuses_bad_settings_with_one_line(tmp_path):
    refusals = [
        (["--config.corpora=poetry"], "corpora: unknown corpus poetry"),
        (["--config.head_mlp_dim=100000"], "head_mlp_dim: must be an integer in [1, 96]"),
        (["--config.nosuch=3"], "--config.nosuch: not a setting of this config (settings: batch_size,"),
        (["--config.target_dtype=fp8"], "target_dtype: each value must be one of float32,"),
    ]
    common = ["--config=launch/configs/draft_head.py:quick", f"--workdir={tmp_path / 'w'}"]
    common.append(f"--output_dir={tmp_path / 'out'}")
    cases = [[*common, *args] for args, _ in refusals]
    for case, (_, message) in zip(cases, refusals, strict=True):
        result = cli_case("launch.train", cases, case)  # the three in one process
        assert result.returncode == 2, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr, result.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.xdist_group("cli_trained_head")
def test_a_killed_training_leaves_a_checkpoint_that_resumes_to_the_uninterrupted_result(
    tmp_path, cli_trained_head
):
    """The run of CLI_TRAINING_FLAGS (24 steps, a checkpoint every 2) killed with SIGKILL after
    its sixth step's checkpoint, then run again: the same parameters as the uninterrupted run."""
    _, whole_out = cli_trained_head
    flags = CLI_TRAINING_FLAGS[1:]  # after the config, which cli() names
    killed = cli(
        *flags, workdir=tmp_path / "killed", output_dir=tmp_path / "killed_out", start_new_session=True
    )
    checkpoints = tmp_path / "killed" / "checkpoints"
    deadline = time.time() + 240
    while time.time() < deadline and killed.poll() is None:
        done = [p for p in checkpoints.glob("*") if p.name.isdigit()] if checkpoints.exists() else []
        if any(int(p.name) >= 6 for p in done):
            break
        time.sleep(0.05)
    assert killed.poll() is None, "the run ended before it could be killed: " + killed.communicate()[1][-500:]
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    resumed = cli(*flags, workdir=tmp_path / "killed", output_dir=tmp_path / "killed_out")
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    written = [f"wrote {tmp_path / 'killed_out' / 'train_head'}.{e}" for e in ("csv", "json", "md", "png")]
    assert out.splitlines() == written, out
    assert summary_hash(tmp_path / "killed_out") == summary_hash(whole_out)
    history = [json.loads(line)["step"] for line in (tmp_path / "killed" / "history.jsonl").open()]
    assert history == list(range(1, 25)), "the history continues where the checkpoint was"


@pytest.mark.xdist_group("cli_trained_head")
def test_the_cli_writes_the_runs_table_provenance_summary_and_plot(cli_trained_head):
    """launch.train's outputs (launch.results, the experiments' writer): train_head.csv a row per
    evaluation, .json the provenance, the settings and the summary, .md the provenance then the
    table and the reading, .png the curves."""
    workdir, out = cli_trained_head
    names = ["train_head.csv", "train_head.json", "train_head.md", "train_head.png"]
    assert sorted(p.name for p in out.iterdir()) == names
    with (out / "train_head.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == list(head_run.ROW_KEYS) and [int(r["step"]) for r in rows] == [6, 12, 18, 24]
    sidecar = json.loads((out / "train_head.json").read_text())
    assert (sidecar["experiment"], sidecar["title"], sidecar["quick"]) == (
        "train_head",
        head_run.TITLE,
        False,
    )
    assert sidecar["provenance"]["command"].split()[1:] == [
        "-m",
        "launch.train",
        *CLI_TRAINING_FLAGS,
        f"--workdir={workdir}",
        f"--output_dir={out}",
    ]
    config = sidecar["config"]
    assert (config["target"], config["steps"], config["workdir"]) == ("random", 24, str(workdir))
    assert "kind" not in config and sidecar["columns"] == list(head_run.ROW_KEYS)
    summary = sidecar["summary"]
    assert (
        summary["steps"] == 24
        and summary["workdir"] == str(workdir)
        and summary["best"]["step"] in (6, 12, 18, 24)
    )
    markdown = (out / "train_head.md").read_text()
    assert markdown.startswith(f"# train_head: {head_run.TITLE}\n\n- command: `")
    assert "\n| step | loss | regression |" in markdown and "Best held-out accepted length" in markdown
    assert markdown.rstrip().endswith("![train_head](train_head.png)")
    assert (out / "train_head.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # 20 s; in make test: tests/test_acceptance.py drafts with acceptance heads in-process
def test_an_acceptance_head_trains_for_a_draft_head_and_loads_with_it_only(tmp_path, monkeypatch):
    """The quick experiments end to end: a draft head, then its acceptance head (logged rounds,
    classifier, threshold), loaded as one drafter; retraining the draft head invalidates it."""
    from experiments import common, framework
    from spec_jax.drafting import trained_head as heads

    workdir = str(tmp_path / "head")
    framework.run_experiment(
        "train_head", quick=True, overrides={"workdir": workdir}, output_dir=str(tmp_path / "o")
    )
    result, paths = framework.run_experiment(
        "train_acceptance", quick=True, overrides={"head_workdir": workdir}, output_dir=str(tmp_path / "o")
    )
    assert set(paths) == {f"train_acceptance.{e}" for e in ("csv", "json", "md", "png")}
    target = common.load_model("tiny")
    drafter, params = heads.load_drafter(target, workdir, acceptance=True)
    assert drafter.stop_rejection == result.summary["threshold"] and params.acceptance is not None
    # The decode benchmark runs it, gamma auto included (a fixed cap, no gamma schedule).
    monkeypatch.setattr(heads, "default_workdir", lambda name: workdir)
    bench, _ = framework.run_experiment(
        "decode",
        quick=True,
        overrides={"drafters": ("head_acceptance",), "batch_sizes": (1,), "repeats": 1},
        output_dir=str(tmp_path / "bench"),
    )
    rows = [dict(zip(bench.columns, r, strict=True)) for r in bench.rows]
    assert {r["gamma"] for r in rows if r["drafter"] == "head_acceptance"} == {2, "auto"}
    assert all(r["identical_to_ar"] == "1/1" for r in rows if r["drafter"] == "head_acceptance")
    for part in ("checkpoints", "best"):  # a new draft head in the same folder; acceptance/ stays
        shutil.rmtree(pathlib.Path(workdir) / part)
    framework.run_experiment(
        "train_head", quick=True, overrides={"workdir": workdir, "seed": 1}, output_dir=str(tmp_path / "o")
    )
    with pytest.raises(ValueError, match="trained for another draft head"):
        heads.load_drafter(target, workdir, acceptance=True)


def test_an_identity_started_head_outputs_the_feature_it_reads(cycle):
    """identity_init: before training h_j = f_j exactly, whatever the token and layer weights."""
    from models import draft_head

    target, (train_set, _) = cycle
    c = config(identity_init=True, init_from_target=True)
    hcfg = training.head_config(c, target.config)
    params = initial_params(c, hcfg, target)
    tokens, _, feats = loss.training_batch(train_set, np.arange(2))
    positions = np.broadcast_to(np.arange(feats.shape[1]), tokens.shape)
    cache = draft_head.new_cache(hcfg, 2, feats.shape[1])
    hidden, _ = draft_head.forward(
        hcfg, params, feats, tokens, positions, cache, target.params["embed"]["embedding"]
    )
    np.testing.assert_allclose(np.asarray(hidden), np.asarray(feats), rtol=0, atol=1e-6)
    plain = initial_params(config(init_from_target=True), hcfg, target)
    hidden, _ = draft_head.forward(
        hcfg, plain, feats, tokens, positions, cache, target.params["embed"]["embedding"]
    )
    assert not np.allclose(np.asarray(hidden), np.asarray(feats), atol=1e-3), (
        "without it the head is not the identity"
    )
