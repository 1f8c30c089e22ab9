"""Closed forms of Leviathan, Kalman & Matias 2023 (arXiv 2211.17192), Section 3.

alpha is the acceptance rate E[sum_x min(p(x), q(x))] (Corollary 3.6), gamma the number of
draft tokens per round, c the walltime of one draft step relative to one target step (the
cost coefficient of Section 3.4), c_hat the draft's arithmetic operations per token relative
to the target's (Section 3.5). All formulas assume acceptances are i.i.d. with probability
alpha, as the paper does, and that the target's pass over gamma + 1 positions costs one step.

Corollary 3.9 follows from walltime_speedup at gamma = 1: if alpha > c, speculation helps,
by a factor of at least (1 + alpha) / (1 + c).

Every function takes Python scalars or NumPy arrays (broadcast together) and returns a
Python float/int for scalar inputs, an ndarray of the broadcast shape otherwise. Bad input
raises ValueError naming the argument and its allowed range.
"""

import numpy as np

from models.settings import is_int

DEFAULT_MAX_GAMMA = 128
TIE_TOLERANCE = 1e-12  # optimal_gamma: relative speedup differences below this are ties


def _out(x):
    return x.item() if np.ndim(x) == 0 else x


def _as_float(value, name: str, allowed: str) -> np.ndarray:
    try:
        return np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be {allowed}, got {value!r}") from None


def _check_alpha(alpha) -> np.ndarray:
    a = _as_float(alpha, "alpha", "in [0, 1]")
    if not np.all((a >= 0.0) & (a <= 1.0)):  # NaN fails too
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    return a


def _check_gamma(gamma) -> np.ndarray:
    g = np.asarray(gamma)
    if g.dtype == np.bool_ or not np.issubdtype(g.dtype, np.number):
        raise ValueError(f"gamma must be an integer >= 1, got {gamma}")
    g = g.astype(np.float64)
    if not np.all(np.isfinite(g) & (g >= 1) & (g == np.floor(g))):
        raise ValueError(f"gamma must be an integer >= 1, got {gamma}")
    return g.astype(np.int64)


def _check_cost(value, name: str) -> np.ndarray:
    v = _as_float(value, name, "a finite number >= 0")
    if not np.all((v >= 0.0) & np.isfinite(v)):
        raise ValueError(f"{name} must be a finite number >= 0, got {value}")
    return v


def _geometric_sum(a: np.ndarray, g: np.ndarray) -> np.ndarray:
    """sum_{k=0}^{g} a^k = (1 - a^(g+1)) / (1 - a), shape broadcast(a, g); g + 1 at a = 1.

    Written as -expm1((g+1) log a) / (1 - a): near a = 1 both factors keep full precision
    (1 - a is exact there), where 1 - a^(g+1) would cancel.
    """
    a, g = np.broadcast_arrays(a, g)
    with np.errstate(divide="ignore", invalid="ignore"):  # log(0) = -inf is right; a = 1 is 0/0
        closed = -np.expm1((g + 1.0) * np.log(a)) / (1.0 - a)
    return np.where(a == 1.0, g + 1.0, closed)


def expected_tokens(alpha, gamma):
    """Expected tokens committed per round, (1 - alpha^(gamma+1)) / (1 - alpha) (Eq. 1).

    Between 1 (alpha = 0) and gamma + 1 (alpha = 1, the limit of the closed form).
    Returns a float (scalar inputs) or an array of the broadcast shape.
    """
    return _out(_geometric_sum(_check_alpha(alpha), _check_gamma(gamma)))


def walltime_speedup(alpha, gamma, c, verify_cost=1.0):
    """Expected walltime improvement over plain decoding (Theorem 3.8).

    (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma * c + 1)): a round costs gamma draft steps
    plus one target step and commits expected_tokens(alpha, gamma) tokens. verify_cost is
    what the target's call over gamma + 1 positions costs in target steps, v(gamma); the
    theorem takes 1, and with a measured or predicted v the denominator is gamma * c + v
    (experiments/walltime.py, experiments/predicted_speed.py). Returns a float or an array of
    the broadcast shape.
    """
    a, g, c = _check_alpha(alpha), _check_gamma(gamma), _check_cost(c, "c")
    v = _check_cost(verify_cost, "verify_cost")
    if not np.all(v > 0.0):
        raise ValueError(f"verify_cost must be a finite number > 0, got {verify_cost}")
    return _out(_geometric_sum(a, g) / (g * c + v))


def operations_factor(alpha, gamma, c_hat):
    """Expected factor by which arithmetic operations grow (Theorem 3.11).

    (1 - alpha)(gamma * c_hat + gamma + 1) / (1 - alpha^(gamma+1)): a round runs the target
    on gamma + 1 positions and the draft on gamma, for expected_tokens(alpha, gamma) tokens.
    At alpha = 1 it is (gamma * c_hat + gamma + 1) / (gamma + 1). Returns a float or an array.
    """
    a, g, ch = _check_alpha(alpha), _check_gamma(gamma), _check_cost(c_hat, "c_hat")
    return _out((g * ch + g + 1.0) / _geometric_sum(a, g))


def optimal_gamma(alpha, c, max_gamma: int = DEFAULT_MAX_GAMMA):
    """The integer gamma in [1, max_gamma] that maximizes walltime_speedup(alpha, gamma, c).

    The paper plots it against alpha for several c (Section 3.4). It is the smallest gamma
    whose speedup is within a relative TIE_TOLERANCE of the best, so ties and differences
    at rounding level go to the shorter draft: at alpha = 0 every gamma gives the same
    speedup when c = 0 and the answer is 1; with c = 0 and a small alpha the speedup stops
    growing, in floating point, after a few tokens. When alpha = 1 and c = 0 it grows without
    bound and the answer is max_gamma. Returns an int for scalar inputs, an int64 array of the
    broadcast shape otherwise.
    """
    a, c = _check_alpha(alpha), _check_cost(c, "c")
    if not is_int(max_gamma) or max_gamma < 1:
        raise ValueError(f"max_gamma must be an integer >= 1, got {max_gamma}")
    a, c = np.broadcast_arrays(a, c)
    gammas = np.arange(1, max_gamma + 1)  # [G]
    powers = a[..., None] ** np.arange(max_gamma + 1)  # [..., G + 1]
    tokens = np.cumsum(powers, axis=-1)[..., 1:]  # [..., G]: expected_tokens at gamma = 1..G
    speedup = tokens / (gammas * c[..., None] + 1.0)
    near_best = speedup >= speedup.max(axis=-1, keepdims=True) * (1.0 - TIE_TOLERANCE)
    return _out(gammas[np.argmax(near_best, axis=-1)])  # argmax: the first True
