"""experiments/pod_pairs.py --quick: the speculative loop of the Llama 3.1 8B / 3.2 1B pair compiled
sharded for a TPU v5e 2x4 slice (compile-only devices), at full depth and batch 1 (about 25 s on
2 cores: the layers are scanned, so the depth hardly costs compile time). The test sets a 16-token
prompt and 16 new tokens (--set=prompt_tokens=16,max_new_tokens=16; quick's own are 128 and 64): the
prefill's compile time grows with the prompt, and what is checked (the shardings, the argument and
output bytes, the predicted speedups) does not depend on either."""

import csv
import json

import pytest

from experiments import framework
from experiments import pod_pairs as pp
from models.kernels import compile_targets as ct
from models.weights import param_shapes
from spec_jax import sharding, timing

_missing = ct.missing_packages()
if _missing:
    pytest.skip(
        f"compile-only TPU/GPU backends not installed ({', '.join(_missing)}): {ct.INSTALL_HINT}",
        allow_module_level=True,
    )

pytestmark = pytest.mark.xdist_group("pod_pairs")
QUICK_OVERRIDES = {"prompt_tokens": 16, "max_new_tokens": 16}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("pod_pairs")
    result, paths = framework.run_experiment(
        "pod_pairs", quick=True, overrides=QUICK_OVERRIDES, output_dir=str(out), command="cmd"
    )
    (row,) = [dict(zip(result.columns, r, strict=True)) for r in result.rows]
    return row, paths


def test_loop_compiles_sharded_over_the_slice_and_weights_split_eight_ways(quick_run):
    row, _ = quick_run
    assert row["prefill_compiles"] == "yes" and row["loop_compiles"] == "yes"
    assert (row["slice"], row["devices"], row["hosts"]) == ("tpu-v5e-2x4", 8, 1)
    # Llama's every matrix and the vocabulary divide by 8 (8 kv heads): only the norms replicate.
    assert row["weights_per_device_GiB"] == pytest.approx(row["weights_GiB"] / 8, rel=0.01)
    # The compiled loop's arguments per device are those shards plus both KV caches and the state.
    held = row["weights_per_device_GiB"] + row["caches_per_device_GiB"]
    assert held <= row["loop_arguments_GiB"] <= held * 1.01
    # The state is donated: what the loop outputs reuses its arguments' buffers.
    assert row["loop_outputs_GiB"] < 0.01 * row["loop_arguments_GiB"]
    assert row["fits"] is True


def test_quick_writes_the_table_and_predicts_a_speedup_per_alpha(quick_run):
    row, paths = quick_run
    assert set(paths) == {f"pod_pairs.{ext}" for ext in ("csv", "json", "md")}
    with open(paths["pod_pairs.csv"]) as f:
        assert len(list(csv.DictReader(f))) == 1
    with open(paths["pod_pairs.json"]) as f:
        assert json.load(f)["config"]["alphas"] == [0.6, 0.8]
    assert row["v"] > 1.0 and 0.0 < row["c"] < 1.0
    assert 0.0 < row["speedup_alpha_0.6"] < row["speedup_alpha_0.8"]
    with open(paths["pod_pairs.md"]) as f:
        assert "| Llama-3.1-8B | Llama-3.2-1B | tpu-v5e-2x4 |" in f.read()


@pytest.mark.parametrize(
    "repo, billions",
    [
        ("meta-llama/Llama-3.1-8B", 8.03),
        ("meta-llama/Llama-3.1-70B", 70.55),
        ("meta-llama/Llama-3.2-1B", 1.24),
        ("Qwen/Qwen2.5-32B", 32.76),
        ("Qwen/Qwen2.5-0.5B", 0.49),
    ],
)
def test_configs_have_the_published_parameter_counts(repo, billions):
    cfg = pp.model_config(repo, "bfloat16")
    assert timing.tree_bytes(param_shapes(cfg)) / 2 / 1e9 == pytest.approx(billions, abs=0.01)


def test_auto_attention_means_xla_on_a_multi_device_mesh():
    """Mosaic refuses to partition the Pallas TPU kernels: a pod slice runs XLA's attention."""
    cfg = pp.model_config("meta-llama/Llama-3.2-1B", "bfloat16")
    assert sharding.for_mesh(cfg, pp.mesh_of(pp.SLICES["tpu-v5e-2x4"])).attention_impl == "xla"
    assert sharding.for_mesh(cfg, pp.mesh_of(pp.SLICES["gpu-h100-x1"])) is cfg
