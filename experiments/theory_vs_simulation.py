"""Eq. 1 against the rejection rule itself: expected tokens per round, theory vs simulation.

For each (alpha, gamma) cell, synthetic draft/target distributions q_i, p_i over a small
vocabulary are built with sum_x min(p_i(x), q_i(x)) = alpha exactly at every position. Drafts
are drawn from q with spec_jax.sampling.draw and judged by spec_jax.verify.verify, the code the
speculative loop runs; tokens per round = num_accepted + 1. Under the rule each draft is
accepted with probability alpha independently (the distributions do not depend on the
prefix), so the mean must match expected_tokens(alpha, gamma) = (1 - alpha^(gamma+1)) /
(1 - alpha) up to sampling noise.

The distributions make the rule work for its answer: the uniform u matters (on half the
vocabulary 0 < p/q < 1, at varying ratios), some tokens have p > q, and every position has
its own random p_i, q_i, so comparing draft i with the wrong position's p would change the
acceptance rate.
"""

import functools

import jax
import jax.numpy as jnp
import matplotlib
import ml_collections
import numpy as np
import scipy.stats
from matplotlib.figure import Figure

from experiments import framework
from models import settings
from spec_jax import theory
from spec_jax import verify as verify_lib  # looked up at call time, so a patched rule is what runs
from spec_jax.sampling import draw, row_keys

TITLE = "Expected tokens per round (Eq. 1): theory vs simulation of the rejection rule"
MAX_GAMMA = 64  # bounds the per-call memory, chunk_size * (gamma + 1) * vocab_size floats

COLUMNS = (
    "alpha",
    "gamma",
    "rounds",
    "overlap_max_deviation",
    "expected_tokens",
    "measured_tokens",
    "std_error",
    "relative_error",
    "z_score",
    "alpha_mle",
    "accepted_histogram",
)


def get_config(quick: bool = False) -> ml_collections.ConfigDict:
    """Full: alpha {0.5..0.95} x gamma 1..10, 400k rounds per cell; quick: alpha {0.5, 0.7, 0.95}
    x gamma {1, 3, 10}, 100k rounds.

    The rounds are chosen so that 1% (the tolerance) is at least 4 standard errors in the
    noisiest cell (alpha 0.7, gamma 10: standard deviation 0.77 of the mean per round):
    0.77 / sqrt(100k) = 0.24%; 0.77 / sqrt(400k) = 0.12%.
    """
    config = ml_collections.ConfigDict()
    config.alphas = (0.5, 0.7, 0.95) if quick else (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
    config.gammas = (1, 3, 10) if quick else tuple(range(1, 11))
    config.num_rounds = 100_000 if quick else 400_000
    config.chunk_size = 20_000  # rounds per verify call (one lax.scan step)
    config.vocab_size = 8
    config.tolerance = 0.01  # |measured / expected - 1| allowed in every cell
    config.seed = 0
    return config


def validate(config) -> None:
    """Raises ValueError starting with the offending key for values out of range."""
    alphas, gammas = tuple(config.alphas), tuple(config.gammas)
    if not alphas:
        raise ValueError("alphas: give at least one alpha")
    for a in alphas:
        if not settings.is_number(a) or not 0.0 <= a <= 1.0:
            raise ValueError(f"alphas: each alpha must be in [0, 1], got {a}")
    if not gammas:
        raise ValueError("gammas: give at least one gamma")
    for g in gammas:
        if not settings.is_int(g) or not 1 <= g <= MAX_GAMMA:
            raise ValueError(f"gammas: each gamma must be an integer in [1, {MAX_GAMMA}], got {g}")
    for key, low in (("num_rounds", 2), ("chunk_size", 1), ("vocab_size", 4)):
        if not settings.is_int(config[key]) or config[key] < low:
            raise ValueError(f"{key}: must be an integer >= {low}, got {config[key]}")
    if not 0.0 < config.tolerance < 1.0:
        raise ValueError(f"tolerance: must be in (0, 1), got {config.tolerance}")


def distributions_with_overlap(rng: np.random.Generator, alpha: float, num_positions: int, vocab_size: int):
    """Random (p, q), each [num_positions, V] float64, with sum_x min(p, q) = alpha at every position.

    Per position, a random half A of the vocabulary gets q mass m = alpha/2 and p = q + (1 -
    alpha) v >= q (v a random distribution on A); the other half B gets q mass 1 - m and
    p = q r with ratios r in [0, 1] whose q-weighted mean is rho = (alpha - m) / (1 - m). Then
    sum min(p, q) = q(A) + p(B) = m + (alpha - m) = alpha, and both sum to one.
    """
    m = alpha / 2.0
    rho = (alpha - m) / (1.0 - m)
    spread = 0.0 if rho == 0.0 else min(0.9, (1.0 - rho) / rho)  # keeps r = rho (1 + spread z) in [0, 1]
    p = np.zeros((num_positions, vocab_size))
    q = np.zeros((num_positions, vocab_size))
    half = vocab_size // 2
    for i in range(num_positions):
        order = rng.permutation(vocab_size)
        a, b = order[:half], order[half:]
        q[i, a] = m * rng.dirichlet(np.ones(len(a)))
        q[i, b] = (1.0 - m) * rng.dirichlet(np.ones(len(b)))
        p[i, a] = q[i, a] + (1.0 - alpha) * rng.dirichlet(np.ones(len(a)))
        z = rng.uniform(-1.0, 1.0, len(b))
        z -= np.dot(q[i, b], z) / q[i, b].sum()  # q-weighted mean 0, so p(B) = rho q(B)
        z /= np.abs(z).max()
        p[i, b] = q[i, b] * rho * (1.0 + spread * z)
    return p, q


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _accepted_histogram(verify_fn, gamma: int, chunk: int, num_chunks: int, key, p_gv, q_gv):
    """int32 [gamma + 1]: how many of chunk * num_chunks rounds accepted exactly k drafts.

    p_gv: [G + 1, V] target distributions; q_gv: [G, V] draft distributions, the same for
    every round (each round draws fresh drafts and uniforms).
    """

    def one_chunk(histogram, i):
        draft_key, verify_key = jax.random.split(jax.random.fold_in(key, i))
        q_bgv = jnp.broadcast_to(q_gv, (chunk, *q_gv.shape))
        p_bgv = jnp.broadcast_to(p_gv, (chunk, *p_gv.shape))
        drafts_bg = draw(draft_key, q_bgv)
        num_accepted_b, _ = verify_fn(drafts_bg, q_bgv, p_bgv, row_keys(verify_key, jnp.arange(chunk)))
        return histogram + jnp.bincount(num_accepted_b, length=gamma + 1), None

    histogram, _ = jax.lax.scan(one_chunk, jnp.zeros(gamma + 1, jnp.int32), jnp.arange(num_chunks))
    return histogram


def simulate_cell(alpha: float, gamma: int, config, verify_fn=None) -> dict:
    """Runs config.num_rounds (rounded up to whole chunks) rounds of the rule at one (alpha, gamma).

    verify_fn defaults to spec_jax.verify.verify as it is at call time. Returns a dict with
    the CSV's columns for this cell.
    """
    verify_fn = verify_lib.verify if verify_fn is None else verify_fn
    cell_id = (config.seed, gamma, round(alpha * 1_000_000))
    p, q = distributions_with_overlap(np.random.default_rng(cell_id), alpha, gamma + 1, config.vocab_size)
    p_gv = jnp.asarray(p, jnp.float32)
    q_gv = jnp.asarray(q[:gamma], jnp.float32)
    overlap_g = np.asarray(verify_lib.overlap(p_gv[None, :gamma], q_gv[None]))[0]
    deviation = float(np.max(np.abs(overlap_g - alpha)))
    if deviation > 1e-5:  # a construction bug, not noise
        raise AssertionError(f"built distributions have overlap {overlap_g}, not alpha = {alpha}")

    chunk = min(config.chunk_size, config.num_rounds)
    num_chunks = -(-config.num_rounds // chunk)
    key = jax.random.key(config.seed)
    for salt in cell_id[1:]:
        key = jax.random.fold_in(key, salt)
    histogram = np.asarray(
        _accepted_histogram(verify_fn, gamma, chunk, num_chunks, key, p_gv, q_gv), np.int64
    )

    rounds = int(histogram.sum())
    tokens = np.arange(1, gamma + 2)  # a round that accepts k drafts commits k + 1 tokens
    mean = float(np.dot(histogram, tokens) / rounds)
    variance = float(np.dot(histogram, (tokens - mean) ** 2) / (rounds - 1))
    std_error = (variance / rounds) ** 0.5
    expected = theory.expected_tokens(alpha, gamma)
    accepted = int(np.dot(histogram, tokens - 1))
    stopped = int(histogram[:gamma].sum())  # rounds ending in a rejection: the geometric's failures
    return {
        "alpha": alpha,
        "gamma": gamma,
        "rounds": rounds,
        "overlap_max_deviation": deviation,
        "expected_tokens": expected,
        "measured_tokens": mean,
        "std_error": std_error,
        "relative_error": mean / expected - 1.0,
        "z_score": (mean - expected) / std_error if std_error > 0 else 0.0,
        "alpha_mle": accepted / (accepted + stopped) if accepted + stopped else 1.0,
        "accepted_histogram": " ".join(str(int(n)) for n in histogram),
    }


def failing_cells(cells: list[dict], tolerance: float) -> list[dict]:
    """The cells whose |measured / expected - 1| exceeds tolerance (empty = the check passes)."""
    return [c for c in cells if not abs(c["relative_error"]) <= tolerance]


def simulate(config, verify_fn=None) -> list[dict]:
    """simulate_cell over the config's grid, gamma-major (one compilation per gamma)."""
    return [simulate_cell(a, g, config, verify_fn) for g in config.gammas for a in config.alphas]


def plot(cells: list[dict], config) -> Figure:
    """Left: tokens per round vs gamma, theory lines and simulated points per alpha.

    Right: relative error in percent with +-2 standard errors and the tolerance band.
    """
    figure, (ax_tokens, ax_error) = framework.new_figure(11, 4.4, 2)
    cmap = matplotlib.colormaps["viridis"]
    alphas = list(config.alphas)
    gamma_line = np.arange(1, max(config.gammas) + 1)
    for index, alpha in enumerate(alphas):
        color = cmap(index / max(1, len(alphas) - 1) * 0.9)
        mine = sorted((c for c in cells if c["alpha"] == alpha), key=lambda c: c["gamma"])
        gammas = np.array([c["gamma"] for c in mine])
        ax_tokens.plot(
            gamma_line, theory.expected_tokens(alpha, gamma_line), color=color, label=f"alpha = {alpha}"
        )
        ax_tokens.plot(gammas, [c["measured_tokens"] for c in mine], "o", color=color, markersize=5)
        offset = (index - (len(alphas) - 1) / 2) * 0.06  # side by side, so error bars do not overlap
        ax_error.errorbar(
            gammas + offset,
            [100 * c["relative_error"] for c in mine],
            yerr=[200 * c["std_error"] / c["expected_tokens"] for c in mine],
            fmt="o",
            color=color,
            markersize=4,
            capsize=2,
        )
    ax_tokens.set(
        xlabel="gamma (draft tokens per round)",
        ylabel="tokens per round",
        title="lines: (1 - alpha^(gamma+1)) / (1 - alpha); points: simulated",
    )
    ax_tokens.legend(loc="upper left", fontsize=8)
    ax_tokens.grid(alpha=0.3)
    band = 100 * config.tolerance
    ax_error.axhspan(-band, band, color="0.9", zorder=0, label=f"+-{band:g}% tolerance")
    ax_error.axhline(0.0, color="0.4", linewidth=0.8)
    ax_error.set(
        xlabel="gamma",
        ylabel="measured / theory - 1  (%)",
        title=f"relative error, +-2 standard errors ({cells[0]['rounds']:,} rounds per cell)",
    )
    ax_error.legend(loc="upper right", fontsize=8)
    ax_error.grid(alpha=0.3)
    return figure


def run(config, verify_fn=None) -> framework.Result:
    """Simulates the grid; passed = every cell within config.tolerance of Eq. 1."""
    cells = simulate(config, verify_fn)
    failures = failing_cells(cells, config.tolerance)
    worst = max(cells, key=lambda c: abs(c["relative_error"]))
    worst_rel_se = max(c["std_error"] / c["expected_tokens"] for c in cells)
    rounds = cells[0]["rounds"]
    passed = not failures
    # Beyond the 1% check: if the rule is right, the z-scores are standard normal, so their
    # squares sum to a chi-square with one degree of freedom per cell.
    chi_square = float(sum(c["z_score"] ** 2 for c in cells))
    chi_square_p = float(scipy.stats.chi2.sf(chi_square, len(cells)))
    markdown = _markdown(cells, config, failures, chi_square, chi_square_p)
    summary = {
        "passed": passed,
        "cells": len(cells),
        "rounds_per_cell": rounds,
        "tolerance": config.tolerance,
        "max_abs_relative_error": abs(worst["relative_error"]),
        "worst_cell": {"alpha": worst["alpha"], "gamma": worst["gamma"], "z_score": worst["z_score"]},
        "max_relative_std_error": worst_rel_se,
        "max_abs_z_score": max(abs(c["z_score"]) for c in cells),
        "chi_square_of_z_scores": chi_square,
        "chi_square_p_value": chi_square_p,
        "failing_cells": [(c["alpha"], c["gamma"]) for c in failures],
    }
    rows = [tuple(c[k] for k in COLUMNS) for c in cells]
    return framework.Result(
        columns=COLUMNS,
        rows=rows,
        markdown=markdown,
        summary=summary,
        figure=plot(cells, config),
        passed=passed,
    )


def _markdown(cells, config, failures, chi_square: float, chi_square_p: float) -> str:
    """The verdict, the worst cell against the standard errors, the chi-square of the z-scores,
    and measured / theory per (gamma, alpha)."""
    passed = not failures
    worst = max(cells, key=lambda c: abs(c["relative_error"]))
    worst_rel_se = max(c["std_error"] / c["expected_tokens"] for c in cells)
    rounds = cells[0]["rounds"]
    alphas = list(config.alphas)
    by_cell = {(c["alpha"], c["gamma"]): c for c in cells}
    pivot = framework.markdown_table(
        ("gamma", *(f"alpha {a}" for a in alphas)),
        [
            (
                g,
                *(
                    f"{by_cell[a, g]['measured_tokens']:.3f} / {by_cell[a, g]['expected_tokens']:.3f} "
                    f"({100 * by_cell[a, g]['relative_error']:+.2f}%)"
                    for a in alphas
                ),
            )
            for g in config.gammas
        ],
    )
    verdict = (
        f"**PASS**: every one of the {len(cells)} cells is within {100 * config.tolerance:g}% of Eq. 1."
        if passed
        else f"**FAIL**: {len(failures)} of {len(cells)} cells are off by more than {100 * config.tolerance:g}%."
    )
    reading = (
        "the points sit on the lines, and the relative errors (right) scatter around zero within"
        " their error bars, far inside the tolerance band."
        if passed
        else "points off the lines, outside the tolerance band on the right, are the failing cells."
    )
    markdown = f"""Each cell: {rounds:,} rounds of `spec_jax.verify.verify` on drafts from
`spec_jax.sampling.draw`, vocabulary {config.vocab_size}, distributions built so that
sum_x min(p, q) = alpha exactly at every position (largest deviation in float32:
{max(c["overlap_max_deviation"] for c in cells):.1e}). Measured = mean of num_accepted + 1.

{verdict} Largest |relative error| {100 * abs(worst["relative_error"]):.3f}% (alpha {worst["alpha"]},
gamma {worst["gamma"]}, {worst["z_score"]:+.1f} standard errors); the largest relative standard
error of a cell is {100 * worst_rel_se:.3f}%, so the {100 * config.tolerance:g}% tolerance is
{config.tolerance / worst_rel_se:.1f} standard errors or more in every cell. Sum of squared
z-scores {chi_square:.1f} over {len(cells)} cells (chi-square test of "the deviations are pure
noise": p = {chi_square_p:.2f}).

Measured / theory (relative error):

{pivot}

Reading the plot: {reading} Tokens per round grow with gamma but
saturate at 1 / (1 - alpha) (2 for alpha 0.5, 20 for alpha 0.95), so a long draft only pays
when alpha is high.
"""
    return markdown
