"""Issue 39: gamma=auto's costs are refreshed by a run instead of measured before it. With none
cached, spec_jax.generate plans from the prior (step_costs.prior_costs, the weights' bytes) at
once, and afterwards caches the prior calibrated by the rounds the run itself timed; the next
run plans from those. Measured costs (the engine's) are kept as they are."""

import dataclasses
import json

import numpy as np
import pytest
from conftest import perturbed

import models
import spec_jax
from spec_jax import autogamma, timing
from spec_jax.autogamma import cost_cache as step_costs
from spec_jax.autogamma.cost_cache import CostSizes
from spec_jax.drafting import NoDrafter, as_drafter
from spec_jax.drafting.model import ModelDrafter

PROMPTS = [[5, 9, 2], [7, 7, 3, 8, 11, 4, 6, 2, 9, 10]]


@pytest.fixture(scope="module")
def small_pair():
    """A target and a draft of about a tenth of its weight bytes (the prior lets it draft)."""
    target = models.random_model(vocab_size=64, num_layers=3, d_model=64, num_heads=4, num_kv_heads=2, seed=0)
    draft = models.random_model(vocab_size=64, num_layers=1, d_model=16, num_heads=2, num_kv_heads=1, seed=1)
    return target, draft


class LightDrafter(ModelDrafter):
    """A draft model priced at a tenth of its weight bytes: the prior lets it draft."""

    def call_bytes(self, params):
        return super().call_bytes(params) // 10


def test_a_run_with_nothing_cached_measures_nothing_first_and_caches_its_timed_rounds(
    small_pair, tmp_path, monkeypatch
):
    target, _ = small_pair
    monkeypatch.setenv("SPEC_JAX_CACHE", str(tmp_path))
    monkeypatch.setattr(step_costs, "measure", lambda *a, **k: pytest.fail("measured before the run"))
    draft = LightDrafter(target.config), perturbed(target, 0.05, seed=7).params  # accepts most drafts
    plain = spec_jax.generate(target, PROMPTS, max_new_tokens=40, temperature=0.0)
    gen = spec_jax.generate(target, PROMPTS, draft=draft, gamma="auto", max_new_tokens=40, temperature=0.0)
    assert gen.tokens == plain.tokens  # the costs choose the schedule, never the output
    drafted = {str(g) for g, _ in gen.stats["gamma_schedule"] if g}
    assert drafted, gen.stats["gamma_schedule"]
    (path,) = (tmp_path / "costs").iterdir()  # one file, no temporary one left beside it
    saved = json.loads(path.read_text())
    assert saved["source"] == "observed" and saved["round_seconds"] and set(saved["round_seconds"]) <= drafted
    prior = step_costs.prior_costs(target, draft[0], draft[1], CostSizes(len(PROMPTS), 64).bucketed())
    assert saved["costs"]["step_seconds"] > 0 and saved["costs"]["verify"] != list(prior.verify), saved
    again = spec_jax.generate(target, PROMPTS, draft=draft, gamma="auto", max_new_tokens=40, temperature=0.0)
    assert again.tokens == plain.tokens


def test_without_measuring_the_entry_is_the_prior_until_a_run_records_its_rounds(small_pair, tmp_path):
    target, draft = small_pair
    drafter, params = as_drafter(draft, target)
    sizes = CostSizes(1, 40)
    entry = step_costs.cost_entry(target, drafter, params, sizes, tmp_path, measure_now=False)
    assert entry.source == "prior" and entry.costs == step_costs.prior_costs(target, drafter, params, sizes)
    assert 0 < entry.costs.draft1 < 0.3 and not (tmp_path / "costs").exists()  # nothing written
    entry.record(0.03, {"2": 1.9})
    entry.record(0.02, {"1": 2.4, "3": 3.5})  # a later run: its arms join the earlier ones
    got = step_costs.cost_entry(target, drafter, params, CostSizes(1, 300), tmp_path, measure_now=False)
    assert got.source == "observed" and got.round_seconds == pytest.approx(
        {"2": 0.057, "1": 0.048, "3": 0.07}
    )
    # Each arm over the fastest plain round of the runs (0.02 s).
    assert got.costs.step_seconds == 0.02 and got.rounds == pytest.approx({"2": 2.85, "1": 2.4, "3": 3.5})
    assert got.costs == entry.costs
    got.record(0.03, {"2": 2.4})  # slower than before (a disturbed run): the fastest is kept
    assert got.round_seconds["2"] == pytest.approx(0.057)
    got.record(0.02, {"2": 2.5})
    assert got.rounds["2"] == pytest.approx(2.5)


def test_a_plain_round_slowed_by_a_passing_load_does_not_price_drafting_low_for_good(small_pair, tmp_path):
    """A run whose plain round a passing load doubled times its drafting rounds at half their
    cost in plain rounds. Each arm keeps its fastest seconds and the plain round its own, so the
    next undisturbed run prices the arm at its cost again; the fastest ratio (what a drafting
    round took over its own run's plain round) would have kept the disturbed 1.1 for good."""
    target, draft = small_pair
    drafter, params = as_drafter(draft, target)
    entry = step_costs.cost_entry(target, drafter, params, CostSizes(1, 40), tmp_path, measure_now=False)
    entry.record(0.02, {"1": 2.2})  # 0.044 s a round
    entry.record(0.04, {"1": 1.1})  # the plain round timed at twice its cost: 0.044 s again
    assert entry.rounds == pytest.approx({"1": 2.2}) and entry.costs.step_seconds == 0.02
    assert entry.costs == dataclasses.replace(
        step_costs.calibrated(entry.prior, {"1": 2.2}), step_seconds=0.02
    )


def test_a_cache_of_ratios_as_kept_before_is_observed_again_from_the_prior(small_pair, tmp_path):
    """Files written before the seconds were kept hold each arm's fastest ratio to its run's
    plain round, which cannot be told apart from a disturbed one: such an entry starts over from
    the prior, and the next run's rounds calibrate it again."""
    target, draft = small_pair
    drafter, params = as_drafter(draft, target)
    sizes = CostSizes(1, 40)
    entry = step_costs.cost_entry(target, drafter, params, sizes, tmp_path, measure_now=False)
    entry.record(0.02, {"1": 2.2})
    payload = json.loads(entry.path.read_text())
    payload["rounds"] = {"1": 0.511, "3": 2.71}
    del payload["round_seconds"]
    entry.path.write_text(json.dumps(payload))
    got = step_costs.cost_entry(target, drafter, params, sizes, tmp_path, measure_now=False)
    assert got.source == "prior" and got.costs == entry.prior and got.round_seconds == {}


class ShareDrafter(ModelDrafter):
    """A draft model priced at a fixed share of the target's weight bytes."""

    def __init__(self, config, share_of, share):
        super().__init__(config)
        self.share_bytes = int(share * timing.tree_bytes(share_of.params))

    def call_bytes(self, params):
        return self.share_bytes


def test_the_cpu_prior_prices_a_gguf_q8_verify_at_the_multirow_kernels_cost(small_pair):
    """At gguf_q8 a CPU verify over more than one token runs the multi-row kernel, not ggml's
    one-row gemv: the prior prices each extra token at 0.35 steps (int8: 0.15). With the Qwen
    pair's share of weight bytes (0.42), drafting could pay at a good draft's acceptance at int8
    but not at gguf_q8, so a gguf_q8 call never runs (or prefills) the draft."""
    target, draft = small_pair
    sizes = CostSizes(1, 64)
    priors = {}
    for dtype in ("int8", "gguf_q8"):
        model = dataclasses.replace(target, config=dataclasses.replace(target.config, dtype=dtype))
        drafter = ShareDrafter(draft.config, model, 0.42)
        priors[dtype] = step_costs.prior_costs(model, drafter, draft.params, sizes)
    assert priors["int8"].verify[1] == pytest.approx(1.15) and priors["gguf_q8"].verify[1] == pytest.approx(
        1.35
    )
    assert autogamma.Controller(priors["int8"], 8).phase == "plain_first"
    assert autogamma.Controller(priors["gguf_q8"], 8).phase == "never"


def test_a_runs_timed_rounds_leave_out_each_arms_first_chunk_and_arms_of_one_chunk():
    """A program's first execution costs more than its later ones: an arm's first chunk (in the
    demo's warm-up run, its program's first run) does not price it, and an arm timed once not
    at all."""
    costs = step_costs.Costs(
        step_seconds=0.01, draft1=0.1, draft2=0.1, verify=tuple(1 + 0.1 * g for g in range(9))
    )
    controller = autogamma.Controller(costs, 8)
    controller.times = {0: [1.0, 1.0], 1: [5.0, 2.0, 3.0], 2: [4.0]}
    assert controller.timed_rounds() == {"1": 2.0}


def test_a_drafter_without_model_calls_drafts_for_free_in_the_prior(small_pair):
    target, _ = small_pair
    prior = step_costs.prior_costs(target, NoDrafter(64), None, CostSizes(1, 512, tree_sizes=(4, 8)))
    assert prior.draft1 == prior.draft2 == prior.resume == 0.0
    assert prior.verify[0] == 1.0 and np.all(np.diff(prior.verify) > 0) and len(prior.verify) == 9
    assert [n for n, _ in prior.tree_verify] == [4, 8]


@pytest.mark.parametrize("factor", [0.5, 1.0, 3.0])
def test_calibration_finds_the_factor_of_rounds_timed_at_a_scaled_prior(small_pair, factor):
    target, draft = small_pair
    drafter, params = as_drafter(draft, target)
    prior = step_costs.prior_costs(target, drafter, params, CostSizes(1, 512, tree_sizes=(4,)))
    timed = {
        "1": 1 + factor * (prior.round_cost(1) - 1),
        "tree4": 1 + factor * (prior.tree_round_cost(4) - 1),
    }
    got = step_costs.calibrated(prior, timed)
    for g in range(9):  # every gamma, those not timed too, at the prior's shape times the factor
        assert got.round_cost(g) == pytest.approx(1 + factor * (prior.round_cost(g) - 1))
    assert got.tree_round_cost(4) == pytest.approx(timed["tree4"])
    assert step_costs.calibrated(prior, {"1": 1e6}).draft1 == pytest.approx(20.0 * prior.draft1)  # bounded


def test_measured_costs_are_not_replaced_by_a_runs_rounds(small_pair, tmp_path, monkeypatch):
    target, _ = small_pair
    fixed = step_costs.Costs(
        step_seconds=0.01, draft1=0.0, draft2=0.0, verify=tuple(1.0 + 0.1 * g for g in range(9))
    )
    monkeypatch.setattr(step_costs, "measure", lambda *a, **k: fixed)
    entry = step_costs.cost_entry(target, NoDrafter(64), None, CostSizes(1, 64), tmp_path)
    (path,) = (tmp_path / "costs").iterdir()
    before = path.read_text()
    entry.record(0.05, {"3": 9.0})
    assert path.read_text() == before and entry.costs == fixed and entry.source == "measured"


@pytest.mark.parametrize(
    "edit",
    [
        {"source": "guessed"},
        {"round_seconds": {"2": -1.0}},
        {"round_seconds": {"2": "x"}},
    ],
)
def test_an_observed_entry_edited_into_nonsense_is_not_used(small_pair, tmp_path, edit):
    target, _ = small_pair
    sizes = CostSizes(1, 64)
    entry = step_costs.cost_entry(target, NoDrafter(64), None, sizes, tmp_path, measure_now=False)
    entry.record(0.02, {"2": 1.5})
    saved = json.loads(entry.path.read_text())
    entry.path.write_text(json.dumps({**saved, **edit}))
    with pytest.warns(UserWarning, match="not usable"):
        got = step_costs.cost_entry(target, NoDrafter(64), None, sizes, tmp_path, measure_now=False)
    assert got.source == "prior"
