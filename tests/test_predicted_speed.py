"""experiments/predicted_speed.py --quick: roofline times of model calls compiled for a TPU and a GPU
(compile-only devices, like tests/test_compile_targets.py), and the speedups they predict."""

import csv
import dataclasses
import json

import pytest

from experiments import framework
from experiments import predicted_speed as ps
from models.kernels import compile_targets as ct
from spec_jax import theory
from spec_jax.sampling import SamplingParams

_missing = ct.missing_packages()
if _missing:
    pytest.skip(
        f"compile-only TPU/GPU backends not installed ({', '.join(_missing)}): {ct.INSTALL_HINT}",
        allow_module_level=True,
    )

# One xdist worker runs the module, so the quick run below is computed once.
pytestmark = pytest.mark.xdist_group("predicted_speed")
# The quick run at 1 layer (--set=num_layers=1; quick's own is 2): the calls are unrolled layers,
# so each compile costs about half, and nothing checked below depends on the depth (the
# extrapolation to depth has its own test, test_costs_are_linear_in_depth...).
QUICK_OVERRIDES = {"num_layers": 1}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("predicted_speed")
    result, paths = framework.run_experiment(
        "predicted_speed", quick=True, overrides=QUICK_OVERRIDES, output_dir=str(out), command="cmd"
    )
    return result, paths


def test_quick_writes_table_plot_and_provenance(quick_run):
    result, paths = quick_run
    assert set(paths) == {f"predicted_speed.{ext}" for ext in ("csv", "json", "md", "png")}
    with open(paths["predicted_speed.csv"]) as f:
        rows = list(csv.DictReader(f))
    config = ps.get_config(quick=True)
    assert {(r["target"], int(r["gamma"])) for r in rows} == {
        (t, g) for t in config.targets for g in config.gammas
    }
    with open(paths["predicted_speed.json"]) as f:
        sidecar = json.load(f)
    assert sidecar["config"]["alpha"] == ps.MEASURED_ALPHA
    assert {b["target"] for b in sidecar["summary"]["best"]} == set(config.targets)
    with open(paths["predicted_speed.md"]) as f:
        text = f.read()
    assert "## Predicted speedup at the best gamma" in text and "no measured column" in text


def test_predictions_are_theorem_3_8_with_the_roofline_costs(quick_run):
    result, _ = quick_run
    for row in (dict(zip(result.columns, r, strict=True)) for r in result.rows):
        assert row["v"] == pytest.approx(row["verify_ms"] / row["decode_ms"])
        assert row["c"] == pytest.approx(row["draft_ms"] / row["decode_ms"])
        assert row["predicted_speedup"] == pytest.approx(
            theory.walltime_speedup(row["alpha"], row["gamma"], row["c"], verify_cost=row["v"])
        )
        # A verify call reads the same weights as a decode step and does more work: v >= 1. The
        # draft is the smaller model: 0 < c < 1.
        assert row["v"] >= 1.0 and 0.0 < row["c"] < 1.0


def test_tree_rows_are_measured_tokens_over_draft_calls_and_the_verify_call(quick_run):
    """The trees table: the chain of N pays N draft calls, the tree min(tree_depth, N), both the
    verify call of N + 1 queries (gamma = N's), at their measured tokens per call."""
    result, _ = quick_run
    config = ps.get_config(quick=True)
    calls = {(c["target"], c["call"]): c["seconds"] for c in result.summary["calls"]}
    trees = result.summary["trees"]
    assert {(r["target"], r["nodes"]) for r in trees} == {
        (t, n) for t in config.targets for n in config.tree_nodes
    }
    for row in trees:
        decode, n = calls[row["target"], "decode"], row["nodes"]
        v, c = calls[row["target"], f"verify_{n}"] / decode, calls[row["target"], "draft"] / decode
        calls_tree = min(config.tree_depth, n)
        assert row["chain_speedup"] == pytest.approx(row["chain_tokens"] / (n * c + v))
        assert row["tree_speedup"] == pytest.approx(row["tree_tokens"] / (calls_tree * c + v))
        assert row["tree_draft_calls"] == calls_tree and row["chain_draft_calls"] == n


def test_costs_count_the_weights_and_decode_is_memory_bound(quick_run):
    """The cost analysis saw the whole program: at least the weights are read; a batch-1 decode
    step does ~2 flops per weight, far below any accelerator's flops per byte."""
    result, _ = quick_run
    for call in result.summary["calls"]:
        assert call["bytes"] >= call["weight_bytes"], call
        if call["call"] in ("decode", "draft"):
            assert call["bound"] == "memory", call
    impls = {c["target"]: c["impl"] for c in result.summary["calls"]}
    assert impls == {"tpu-v5e": "pallas_tpu", "gpu-a100": "pallas_gpu"}


def test_costs_are_linear_in_depth_so_two_small_compiles_give_the_whole_depth():
    """analysed_costs extrapolates a deep model's costs from 1- and 2-layer compiles; at 3 layers
    the extrapolation must match a direct compile: the flops exactly, the bytes within 15% (XLA's
    fusion choices, hence the bytes it counts, differ a little from layer to layer: 5% with the
    cache of the quick gammas, 10.2% with the longer one a tree of 8 needs)."""
    config = ps.get_config(quick=True)
    cfg = dataclasses.replace(ps.model_config(config, config.target), num_layers=3)
    slots, dev, greedy = ps.cache_slots(config, cfg), ct.device("tpu-v5e"), SamplingParams(0.0)
    direct = ps.analysed_costs(cfg, 1, 5, slots, greedy, dev, extrapolate=False)
    extrapolated = ps.analysed_costs(cfg, 1, 5, slots, greedy, dev, extrapolate=True)
    assert extrapolated[0] == pytest.approx(direct[0], rel=1e-3)
    assert extrapolated[1] == pytest.approx(direct[1], rel=0.15)
