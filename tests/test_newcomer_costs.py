"""Issue 39, item 2: gamma=auto's measured costs do not depend on the prompt's length. One
measurement per pair, precision and batch bucket serves every prompt of an ordinary length (it
was keyed on the cache length rounded to a power of two: a prompt of a new length measured every
call again, 150 s before the first token), and measuring is announced in one line."""

import pytest

import models
from spec_jax.autogamma import cost_cache as step_costs
from spec_jax.autogamma.cost_cache import CostSizes
from spec_jax.drafting import NoDrafter


@pytest.fixture
def measured(monkeypatch):
    """measure() replaced by fixed costs; the list of (batch, cache_slots) it was called with."""
    calls = []

    def measure(target, drafter, params, sizes, **kwargs):
        calls.append((sizes.batch, sizes.cache_slots))
        verify = (1.0,) + tuple(1.0 + 0.1 * g for g in range(1, sizes.gamma_max + 1))
        return step_costs.Costs(step_seconds=0.01, draft1=0.0, draft2=0.0, verify=verify, resume=0.0)

    monkeypatch.setattr(step_costs, "measure", measure)
    return calls


def test_prompts_of_new_lengths_reuse_one_measurement(tmp_path, measured, capsys):
    target = models.random_model(vocab_size=64, num_layers=1, d_model=16, num_heads=2, num_kv_heads=1, seed=0)
    for cache_slots in (20, 70, 133, 300, 511):  # prompts of five lengths, batch 1
        step_costs.costs_for(target, NoDrafter(64), None, CostSizes(1, cache_slots), cache_dir=tmp_path)
    assert measured == [(1, step_costs.COST_SLOTS)]
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("gamma=auto: measuring") and " s " in lines[0]


def test_batches_share_a_power_of_two_bucket_and_long_caches_a_coarse_one(tmp_path, measured):
    target = models.random_model(vocab_size=64, num_layers=1, d_model=16, num_heads=2, num_kv_heads=1, seed=0)
    for batch in (3, 4):
        step_costs.costs_for(target, NoDrafter(64), None, CostSizes(batch, 64), cache_dir=tmp_path)
    for cache_slots in (600, 4000):
        step_costs.costs_for(target, NoDrafter(64), None, CostSizes(1, cache_slots), cache_dir=tmp_path)
    assert measured == [(4, 512), (1, 4096)]
