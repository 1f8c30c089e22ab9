"""Prompt lookup, hybrid drafting and per-row adaptive draft lengths sample exactly the target's
distribution at temperature 1 (the chi-square harness of tests/test_distribution.py), and a
deliberately broken variant of each fails the same test."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_distribution import WARPS, chi2_pvalue, exact_joint, pair, sample_counts  # noqa: F401

from spec_jax import drafting, executables, rounds, verify
from spec_jax.drafting import hybrid, lookup, suffix, suffix_table

THRESHOLD = 0.25  # the V = 8 draft's top probability straddles this: rows draft 0, 1 or 2


def fraction(s, source):
    return s["fraction_of_rounds_by_drafter"][source]


def test_prompt_lookup_matches_target_distribution_exactly(pair):  # noqa: F811
    target, _ = pair
    sampling = WARPS[0]
    counts, s = sample_counts(target, drafting.build("prompt_lookup", target), sampling, gamma=2, seed=0)
    assert 0.2 < s["num_draft_tokens"] / (2 * s["num_rounds"]) < 0.8, "rows with and without a match"
    assert s["num_accepted_tokens"] > 100
    assert chi2_pvalue(counts, exact_joint(target, sampling)) > 1e-3


@dataclasses.dataclass(frozen=True)
class SmearedLookup(lookup.PromptLookupDrafter):
    """Broken on purpose: drafts the lookup's token but hands the rule a q that is not one-hot."""

    def propose(self, params, buffer_bs, context_b2, length_b, gamma, sampling, keys_b):
        drafts, q, buffer_bs = super().propose(
            params, buffer_bs, context_b2, length_b, gamma, sampling, keys_b
        )
        found = jnp.sum(q, axis=-1, keepdims=True)  # 1 where proposed, 0 where not
        return drafts, 0.5 * q + 0.5 * found / self.vocab_size, buffer_bs


def test_a_lookup_handing_the_rule_a_non_one_hot_q_fails(pair):  # noqa: F811
    target, _ = pair
    counts, _ = sample_counts(
        target, (SmearedLookup(target.config.vocab_size), ()), WARPS[0], gamma=2, seed=0
    )
    assert chi2_pvalue(counts, exact_joint(target, WARPS[0])) < 1e-6


def test_hybrid_drafting_matches_target_distribution_exactly(pair):  # noqa: F811
    target, draft = pair
    counts, s = sample_counts(
        target, drafting.build("hybrid", target, drafting.Settings(draft=draft)), WARPS[0], gamma=2, seed=0
    )
    assert 0.2 < fraction(s, "prompt_lookup") < 0.8, "lookup and the model both serve rounds"
    assert 0.1 < s["acceptance_rate_by_drafter"]["model"] < 0.95
    assert chi2_pvalue(counts, exact_joint(target, WARPS[0])) > 1e-3


@dataclasses.dataclass(frozen=True)
class HybridHandingModelQ(hybrid.HybridDrafter):
    """Broken on purpose: where lookup drafted, the rule gets the draft model's q at that position."""

    def propose(self, params, state, context_b2, length_b, gamma, sampling, keys_b):
        tokens, q, new_state = super().propose(params, state, context_b2, length_b, gamma, sampling, keys_b)
        _, model_q, _ = self.model.propose(params, state.cache, context_b2, length_b, gamma, sampling, keys_b)
        from_lookup = ~new_state.model_drafted[:, None, None]
        return tokens, jnp.where(from_lookup & (q > 0).any(-1, keepdims=True), model_q, q), new_state


@pytest.mark.slow  # in make test: the lookup and suffix drafters' broken q fail (below)
def test_a_hybrid_handing_lookup_drafts_the_models_q_fails(pair):  # noqa: F811
    target, draft = pair
    hybrid, params = drafting.build("hybrid", target, drafting.Settings(draft=draft))
    broken = HybridHandingModelQ(hybrid.lookup, hybrid.model)
    counts, _ = sample_counts(target, (broken, params), WARPS[0], gamma=2, seed=0)
    assert chi2_pvalue(counts, exact_joint(target, WARPS[0])) < 1e-6


@pytest.fixture(scope="module")
def adaptive(pair):  # noqa: F811
    target, draft = pair
    return drafting.build("model", target, drafting.Settings(draft=draft, threshold=THRESHOLD))


def test_per_row_adaptive_draft_lengths_match_target_distribution_exactly(pair, adaptive):  # noqa: F811
    target, _ = pair
    counts, s = sample_counts(target, adaptive, WARPS[0], gamma=2, seed=0)
    hist = s["accepted_histogram"]
    assert 0.2 < s["num_draft_tokens"] / (2 * s["num_rounds"]) < 0.8, "rows stop at different lengths"
    assert hist[1] > 100 and hist[2] > 100
    assert chi2_pvalue(counts, exact_joint(target, WARPS[0])) > 1e-3


def test_an_adaptive_stop_that_reads_the_targets_p_fails(pair, adaptive, monkeypatch):  # noqa: F811
    """Broken on purpose: a row stops before the first draft the target dislikes (p(x) < q(x) / 2),
    which only the target's p can tell; the token there is then drawn from p."""
    target, _ = pair

    def peeking_verify(drafts, q, p, keys):
        p_x = jnp.take_along_axis(p[:, :-1], drafts[..., None], axis=-1)[..., 0]
        q_x = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
        keep = jnp.cumprod(p_x >= 0.5 * q_x, axis=1)
        return verify.verify(drafts, q * keep[..., None], p, keys)

    monkeypatch.setattr(rounds, "verify", peeking_verify)
    monkeypatch.setattr(executables, "_EXECUTABLES", {})
    counts, _ = sample_counts(target, adaptive, WARPS[0], gamma=2, seed=0)
    assert chi2_pvalue(counts, exact_joint(target, WARPS[0])) < 1e-6


def test_the_draft_confidence_is_the_top_unwarped_probability():
    logits = jnp.asarray([[0.0, jnp.log(3.0)], [1.0, 1.0]])
    from spec_jax.drafting.model import top_probability

    assert jax.device_get(top_probability(logits)).tolist() == pytest.approx([0.75, 0.5])


def suffix_tables():
    """A table over V = 8 fitted on sequences from a random Markov chain: every context has
    several successors with unequal counts, so q is far from one-hot."""
    rng = np.random.default_rng(5)
    transition = rng.dirichlet(np.full(8, 0.7), size=8)
    seqs = []
    for _ in range(40):
        s = [int(rng.integers(8))]
        for _ in range(30):
            s.append(int(rng.choice(8, p=transition[s[-1]])))
        seqs.append(s)
    return suffix_table.fit_suffix_tables(seqs, 8, max_ngram=2, slots=4)


def test_suffix_drafting_matches_target_distribution_exactly(pair):  # noqa: F811
    target, _ = pair
    draft = drafting.build("suffix", target, drafting.Settings(max_ngram=2, tables=suffix_tables()))
    counts, s = sample_counts(target, draft, WARPS[0], gamma=2, seed=0)
    assert 0.1 < s["acceptance_rate"] < 0.95
    assert chi2_pvalue(counts, exact_joint(target, WARPS[0])) > 1e-3


@dataclasses.dataclass(frozen=True)
class FlattenedSuffix(suffix.SuffixDrafter):
    """Broken on purpose: samples from the counts but hands the rule the uniform distribution
    over the successors seen, not the one it sampled from. (Handing it the one-hot of the drawn
    token would not be broken: given the draw, the rule is exact for a deterministic draft.)"""

    def propose(self, params, buffer_bs, context_b2, length_b, gamma, sampling, keys_b):
        tokens, q, buffer_bs = super().propose(
            params, buffer_bs, context_b2, length_b, gamma, sampling, keys_b
        )
        support = (q > 0).astype(q.dtype)
        return tokens, support / jnp.maximum(jnp.sum(support, axis=-1, keepdims=True), 1.0), buffer_bs


def test_a_suffix_drafter_handing_the_rule_another_q_fails(pair):  # noqa: F811
    target, _ = pair
    broken = (FlattenedSuffix(target.config.vocab_size, 2), suffix_tables())
    counts, _ = sample_counts(target, broken, WARPS[0], gamma=2, seed=0)
    assert chi2_pvalue(counts, exact_joint(target, WARPS[0])) < 1e-6


def test_suffix_drafting_with_a_confidence_stop_matches_target_distribution_exactly(pair):  # noqa: F811
    target, _ = pair
    draft = drafting.build(
        "suffix", target, drafting.Settings(max_ngram=2, threshold=0.4, tables=suffix_tables())
    )
    counts, s = sample_counts(target, draft, WARPS[0], gamma=2, seed=0)
    assert 0.2 < s["num_draft_tokens"] / (2 * s["num_rounds"]) < 0.8, "rows stop at different lengths"
    assert chi2_pvalue(counts, exact_joint(target, WARPS[0])) > 1e-3
