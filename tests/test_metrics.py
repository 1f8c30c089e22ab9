"""Pooling the metrics of several runs: one function, by each metric's definition."""

import math

import pytest

from spec_jax import metrics


def stats(rounds, drafted, accepted, scored, alpha_hat, per_position, histogram, new=10, seconds=1.0):
    return {
        "num_rounds": rounds,
        "num_draft_tokens": drafted,
        "num_accepted_tokens": accepted,
        "num_scored_positions": scored,
        "alpha_hat": alpha_hat,
        "per_position_acceptance": per_position,
        "accepted_histogram": histogram,
        "num_committed_tokens": rounds + accepted,
        "target_calls": rounds + 1,
        "draft_calls": drafted + 1,
        "compile_seconds": 0.0,
        "prefill_seconds": seconds / 4,
        "decode_seconds": seconds * 3 / 4,
        "num_new_tokens": new,
    }


def test_alpha_hat_is_pooled_by_scored_positions_not_rounds():
    # alpha_hat is the mean overlap over scored positions: 0.9 * 10 + 0.5 * 40 over 50 = 0.58
    # (weighting by rounds, as the CLI once did, gives 0.7).
    a = stats(10, 20, 9, 10, 0.9, [0.5, 0.4], [5, 1, 4])
    b = stats(10, 20, 20, 40, 0.5, [1.0, 1.0], [0, 0, 10])
    pooled = metrics.pool([a, b])
    assert pooled["alpha_hat"] == pytest.approx((0.9 * 10 + 0.5 * 40) / 50)
    assert pooled["acceptance_rate"] == pytest.approx(29 / 40)
    assert pooled["mean_accepted_length"] == pytest.approx(1 + 29 / 20)
    assert pooled["per_position_acceptance"] == pytest.approx([0.75, 0.7])
    assert pooled["accepted_histogram"] == [5, 1, 14]
    assert pooled["num_rounds"] == 20 and pooled["num_new_tokens"] == 20
    assert pooled["tokens_per_second"] == pytest.approx(20 / 2.0)


def test_a_run_with_no_rounds_adds_nothing_and_gives_no_nan():
    a = stats(10, 20, 9, 10, 0.9, [0.5, 0.4], [5, 1, 4])
    empty = stats(0, 0, 0, 0, float("nan"), [0.0, 0.0], [0, 0, 0], new=1)
    pooled = metrics.pool([a, empty])
    assert pooled["alpha_hat"] == pytest.approx(0.9)
    assert not any(isinstance(v, float) and math.isnan(v) for v in pooled.values())


def test_plain_decoding_stats_pool_without_acceptance():
    plain = {k: v for k, v in stats(5, 0, 0, 0, 0.0, [], [5]).items() if k not in ("num_draft_tokens",)}
    pooled = metrics.pool([plain, plain])
    assert "acceptance_rate" not in pooled and pooled["num_new_tokens"] == 20


def test_pool_needs_a_run():
    with pytest.raises(ValueError, match="at least one"):
        metrics.pool([])
