"""The closed forms of spec_jax.theory: hand values, limits, bad input, optimal gamma, Table 1."""

import fractions
import itertools

import numpy as np
import pytest

from experiments.table1 import PUBLISHED
from spec_jax import theory


@pytest.mark.parametrize(
    "alpha, gamma, tokens",
    [
        (0.5, 1, 1.5),
        (0.5, 2, 1.75),
        (0.8, 3, 1 + 0.8 + 0.64 + 0.512),
        (0.6, 2, 1.96),
        (0.9, 10, (1 - 0.9**11) / 0.1),
        (0.25, 4, 1 + 0.25 + 0.0625 + 0.015625 + 0.00390625),
    ],
)
def test_expected_tokens_matches_hand_computed_values(alpha, gamma, tokens):
    assert theory.expected_tokens(alpha, gamma) == pytest.approx(tokens, rel=1e-14)


def test_walltime_and_operations_match_hand_computed_values():
    # alpha 0.8, gamma 3: E = 2.952 tokens per round; a round costs 3 c + 1 target steps.
    assert theory.walltime_speedup(0.8, 3, 0.1) == pytest.approx(2.952 / 1.3, rel=1e-14)
    assert theory.walltime_speedup(0.8, 3, 0.0) == pytest.approx(2.952, rel=1e-14)
    # A verify call costing 1.5 target steps instead of one: the round costs 3 c + 1.5.
    assert theory.walltime_speedup(0.8, 3, 0.1, verify_cost=1.5) == pytest.approx(2.952 / 1.8, rel=1e-14)
    # operations: target on 4 positions + draft 3 c_hat, per 2.952 tokens.
    assert theory.operations_factor(0.8, 3, 0.1) == pytest.approx(4.3 / 2.952, rel=1e-14)
    assert theory.operations_factor(0.5, 1, 0.0) == pytest.approx(2 / 1.5, rel=1e-14)


def test_expected_tokens_equals_the_closed_form_away_from_the_limits():
    rng = np.random.default_rng(0)
    for alpha, gamma in zip(rng.uniform(0.01, 0.99, 50), rng.integers(1, 40, 50), strict=True):
        closed = (1 - alpha ** (gamma + 1)) / (1 - alpha)
        assert theory.expected_tokens(alpha, int(gamma)) == pytest.approx(closed, rel=1e-12)


@pytest.mark.parametrize("gamma", [1, 2, 7, 30])
def test_limits_alpha_one_and_alpha_zero(gamma):
    assert theory.expected_tokens(1.0, gamma) == gamma + 1
    assert theory.expected_tokens(0.0, gamma) == 1.0
    # Continuous at the ends: the closed form's 0/0 at alpha = 1 is not a jump.
    assert theory.expected_tokens(1 - 1e-9, gamma) == pytest.approx(gamma + 1, rel=1e-6)
    assert theory.walltime_speedup(1.0, gamma, 0.0) == gamma + 1
    assert theory.walltime_speedup(0.0, gamma, 0.5) == pytest.approx(1 / (0.5 * gamma + 1))
    assert theory.operations_factor(1.0, gamma, 0.0) == 1.0
    assert theory.operations_factor(1.0, gamma, 0.2) == pytest.approx((0.2 * gamma + gamma + 1) / (gamma + 1))
    assert theory.operations_factor(0.0, gamma, 0.2) == pytest.approx(0.2 * gamma + gamma + 1)


def test_precision_near_alpha_one_and_for_long_drafts():
    # 1 - alpha^(gamma+1) would cancel near alpha = 1; the sum is 6 - 15e-12 to first order.
    assert theory.expected_tokens(1 - 1e-12, 5) == pytest.approx(6 - 15e-12, abs=1e-13)
    assert theory.expected_tokens(0.5, 10**9) == pytest.approx(2.0)  # no [gamma]-sized arrays
    assert theory.walltime_speedup(0.9, 10**6, 0.0) == pytest.approx(10.0)


def test_numpy_arrays_broadcast_like_scalars():
    alphas = np.array([0.0, 0.3, 0.9, 1.0])  # [4]
    gammas = np.array([[1], [5]])  # [2, 1]
    tokens = theory.expected_tokens(alphas, gammas)
    assert isinstance(tokens, np.ndarray) and tokens.shape == (2, 4)
    for i, j in itertools.product(range(2), range(4)):
        assert tokens[i, j] == theory.expected_tokens(float(alphas[j]), int(gammas[i, 0]))
    speed = theory.walltime_speedup(alphas, 3, np.array([[0.0], [0.1]]))
    assert speed.shape == (2, 4)
    assert speed[1, 2] == theory.walltime_speedup(0.9, 3, 0.1)
    ops = theory.operations_factor(alphas, 4, 0.05)
    assert ops.shape == (4,) and ops[1] == theory.operations_factor(0.3, 4, 0.05)
    assert isinstance(theory.expected_tokens(0.5, 3), float)
    assert isinstance(theory.optimal_gamma(0.5, 0.1), int)


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: theory.expected_tokens(-0.1, 3), "alpha"),
        (lambda: theory.expected_tokens(1.1, 3), "alpha"),
        (lambda: theory.expected_tokens(float("nan"), 3), "alpha"),
        (lambda: theory.expected_tokens(np.array([0.5, 1.5]), 3), "alpha"),
        (lambda: theory.expected_tokens("high", 3), "alpha"),
        (lambda: theory.walltime_speedup(0.5, 3, None), "c"),
        (lambda: theory.expected_tokens(0.5, 0), "gamma"),
        (lambda: theory.expected_tokens(0.5, -2), "gamma"),
        (lambda: theory.expected_tokens(0.5, 2.5), "gamma"),
        (lambda: theory.expected_tokens(0.5, True), "gamma"),
        (lambda: theory.expected_tokens(0.5, "3"), "gamma"),
        (lambda: theory.walltime_speedup(0.5, 3, -0.01), "c"),
        (lambda: theory.walltime_speedup(0.5, 3, float("inf")), "c"),
        (lambda: theory.walltime_speedup(2.0, 3, 0.1), "alpha"),
        (lambda: theory.walltime_speedup(0.5, 3, 0.0, verify_cost=0.0), "verify_cost"),
        (lambda: theory.walltime_speedup(0.5, 3, 0.1, verify_cost=float("nan")), "verify_cost"),
        (lambda: theory.operations_factor(0.5, 3, -1.0), "c_hat"),
        (lambda: theory.operations_factor(0.5, 0, 0.0), "gamma"),
        (lambda: theory.optimal_gamma(0.5, -0.1), "c"),
        (lambda: theory.optimal_gamma(-0.5, 0.1), "alpha"),
        (lambda: theory.optimal_gamma(0.5, 0.1, max_gamma=0), "max_gamma"),
    ],
)
def test_bad_input_raises_value_error_naming_the_argument_and_range(call, name):
    with pytest.raises(ValueError, match=rf"^{name} must be") as info:
        call()
    assert any(word in str(info.value) for word in ("[0, 1]", ">= 1", ">= 0", "> 0"))


def test_integer_valued_float_gamma_is_accepted():
    assert theory.expected_tokens(0.5, 3.0) == theory.expected_tokens(0.5, 3)


def brute_force_optimal_gamma(alpha, c, max_gamma):
    """Exact rational speedups; the smallest gamma within a relative TIE_TOLERANCE of the best."""
    alpha, c = fractions.Fraction(alpha), fractions.Fraction(c)
    speeds, tokens, power = [], fractions.Fraction(1), fractions.Fraction(1)
    for gamma in range(1, max_gamma + 1):
        power *= alpha
        tokens += power
        speeds.append(tokens / (gamma * c + 1))
    best = max(speeds)
    return next(
        g for g, s in enumerate(speeds, 1) if s >= best * (1 - fractions.Fraction(theory.TIE_TOLERANCE))
    )


def test_optimal_gamma_agrees_with_brute_force():
    for alpha in [0.0, 0.05, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0]:
        for c in [0.0, 0.001, 0.01, 0.05, 0.1, 0.2, 0.5, 1.0]:
            assert theory.optimal_gamma(alpha, c, max_gamma=64) == brute_force_optimal_gamma(alpha, c, 64), (
                alpha,
                c,
            )


def test_optimal_gamma_edge_cases_and_arrays():
    assert theory.optimal_gamma(0.0, 0.0) == 1  # every gamma gives 1x: the tie goes to the smallest
    assert theory.optimal_gamma(0.0, 0.3) == 1
    assert theory.optimal_gamma(1.0, 0.0, max_gamma=17) == 17  # unbounded: the cap
    assert (
        theory.optimal_gamma(0.8, 0.05) == 8
    )  # by hand: E = (1 - 0.8^9) / 0.2 = 4.3289, / 1.4 = 3.0921; 3.0823 at 7, 3.0780 at 9
    alphas = np.array([0.5, 0.8, 0.95])
    got = theory.optimal_gamma(alphas, 0.05)
    assert got.tolist() == [theory.optimal_gamma(float(a), 0.05) for a in alphas]


def test_corollary_3_9_speculation_helps_iff_alpha_exceeds_c():
    for alpha, c in itertools.product([0.1, 0.3, 0.5, 0.7, 0.9], [0.05, 0.2, 0.4, 0.6, 0.8]):
        best = theory.walltime_speedup(alpha, theory.optimal_gamma(alpha, c), c)
        if alpha > c:
            assert best >= (1 + alpha) / (1 + c) * (1 - 1e-12) and best > 1.0  # gamma = 1 gives the bound
        else:  # E <= 1 + gamma alpha <= 1 + gamma c: no gamma helps
            assert best <= 1.0


@pytest.mark.parametrize("alpha, gamma, ops, speed", PUBLISHED)
def test_table1_cell_reproduced_to_two_decimals_with_a_free_draft(alpha, gamma, ops, speed):
    assert f"{theory.operations_factor(alpha, gamma, 0.0):.2f}" == f"{ops:.2f}"
    assert f"{theory.walltime_speedup(alpha, gamma, 0.0):.2f}" == f"{speed:.2f}"


def test_table1_is_not_reproduced_with_a_draft_that_costs_one_percent():
    # The check above can fail: a 1% draft cost changes cells in both columns.
    speed_cells = [f"{theory.walltime_speedup(a, g, 0.01):.2f}" == f"{s:.2f}" for a, g, _, s in PUBLISHED]
    ops_cells = [f"{theory.operations_factor(a, g, 0.01):.2f}" == f"{o:.2f}" for a, g, o, _ in PUBLISHED]
    assert not all(speed_cells) and not all(ops_cells)
