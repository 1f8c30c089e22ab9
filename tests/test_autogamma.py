"""gamma=auto: the choice from costs and acceptance, and exactness across gamma changes."""

import pytest
from conftest import perturbed

import models
import spec_jax
from spec_jax import autogamma

PROMPTS = [[5, 9, 2], [1], [7, 7, 3, 8, 11, 4, 6, 2, 9, 10]]
MAX_NEW = 40


def costs(draft, verify_slope=0.1, gamma_max=8):
    return autogamma.Costs(
        step_seconds=0.01,
        draft1=draft,
        draft2=draft,
        verify=(1.0,) + tuple(1.0 + verify_slope * g for g in range(1, gamma_max + 1)),
    )


def test_the_cached_costs_are_keyed_by_the_kernel_build(monkeypatch):
    from models.kernels import cpu_matmul

    keys = {}
    for isa in cpu_matmul.ISAS:  # the key names the build; nothing is built or run
        monkeypatch.setenv(cpu_matmul.ISA_ENV, isa)
        keys[isa] = autogamma.machine_key()
        assert f"-{isa}-" in keys[isa]["cpu_matmul"]
    assert autogamma.cache_path(keys["avx2"]) != autogamma.cache_path(keys["avx512"])


def test_an_expensive_draft_is_never_worth_drafting_with():
    expensive = costs(draft=1.5)
    assert all(expensive.best_gamma(a) == 0 for a in (0.0, 0.5, 0.9, 0.99, 1.0))


def test_a_cheap_draft_drafts_more_as_acceptance_rises_and_never_at_alpha_zero():
    cheap = costs(draft=0.05)
    choices = [cheap.best_gamma(a) for a in (0.0, 0.3, 0.6, 0.8, 0.95)]
    assert choices[0] == 0
    assert choices == sorted(choices) and choices[-1] > choices[1] > 0
    # The choice maximizes the rate it predicts.
    for a in (0.3, 0.8):
        g = cheap.best_gamma(a)
        assert all(cheap.rate(a, g) >= cheap.rate(a, h) for h in range(9))


def test_the_controller_changes_gamma_only_for_a_real_gain_and_never_leaves_plain_decoding():
    controller = autogamma.Controller(costs(draft=0.05), gamma_max=8)
    start = controller.gamma
    assert start > 0
    assert [controller.next_chunk()[1] for _ in range(6)] == [2, 4, 8, 16, 16, 16]
    assert start == controller.costs.best_gamma(autogamma.EXPLORE_ALPHA)
    controller.observe(overlap_sum=0.8 * 10**4, scored=10**4)  # as explored: no change
    assert controller.gamma == start
    controller.observe(overlap_sum=0.98 * 1000, scored=1000)
    assert controller.gamma > start
    controller.observe(overlap_sum=0.0, scored=10**6)  # a draft that is always wrong
    assert controller.gamma == 0
    controller.observe(overlap_sum=10**6, scored=10**6)
    assert controller.gamma == 0


@pytest.fixture(scope="module")
def pair():
    target = models.random_model(vocab_size=64, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, seed=0)
    return target, perturbed(target, 0.1, seed=7)


@pytest.fixture(scope="module")
def greedy_ar(pair):
    return spec_jax.generate(pair[0], PROMPTS, max_new_tokens=MAX_NEW, temperature=0.0).tokens


def test_greedy_output_is_exact_while_gamma_changes_between_chunks(pair, greedy_ar, monkeypatch):
    # Costs under which the first chunk explores gamma 4 and a weak draft's acceptance (well
    # below 0.7) makes a smaller gamma 3-40% better, so the run switches gamma.
    fixed = costs(draft=0.02, verify_slope=0.2)
    assert fixed.best_gamma(autogamma.EXPLORE_ALPHA) == 4 and fixed.best_gamma(0.6) < 4
    monkeypatch.setattr(autogamma, "costs_for", lambda *a, **k: fixed)
    weak = perturbed(pair[0], 0.6, seed=11)
    gen = spec_jax.generate(
        pair[0], PROMPTS, draft=weak, gamma="auto", max_new_tokens=MAX_NEW, temperature=0.0
    )
    assert gen.tokens == greedy_ar
    gammas = [g for g, _ in gen.stats["gamma_schedule"]]
    assert gammas[0] == 4 and len(set(gammas)) >= 2, gen.stats["gamma_schedule"]


def test_auto_measures_a_deliberately_expensive_draft_and_decodes_plainly(
    pair, greedy_ar, tmp_path, monkeypatch
):
    monkeypatch.setenv("SPEC_JAX_CACHE", str(tmp_path))
    # The draft is ~300x the target's compute: no acceptance rate can make it pay.
    expensive = models.random_model(
        vocab_size=64, num_layers=4, d_model=512, num_heads=8, num_kv_heads=2, seed=3
    )
    gen = spec_jax.generate(
        pair[0], PROMPTS, draft=expensive, gamma="auto", max_new_tokens=MAX_NEW, temperature=0.0
    )
    assert gen.tokens == greedy_ar
    assert gen.stats["gamma_schedule"] == [[0, 2**31 - 1]]
    assert gen.stats["num_draft_tokens"] == 0
    assert len(list((tmp_path / "costs").glob("*.json"))) == 1  # measured once, cached
