"""End to end: speculative sampling draws sequences from exactly the target's distribution.

A tiny vocabulary (V = 8) and a 3-token horizon make the target's joint distribution over
all 512 continuations enumerable. N independent rows (each row's randomness depends on the
seed and its index only) give an empirical joint; a chi-square test compares the two. The
same test must pass for the autoregressive sampler and fail for a broken rejection rule.
"""

import dataclasses
import itertools

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import apply
from scipy import stats

import models
import spec_jax
from spec_jax import executables, rounds, runner
from spec_jax.drafting import model as drafters
from spec_jax.sampling import RowSampling, SamplingParams, warp

V, HORIZON, N = 8, 3, 10_000
PROMPT = [1, 5, 2]
WARPS = [SamplingParams(1.0), SamplingParams(1.0, top_k=3), SamplingParams(0.8, top_p=0.8)]


@pytest.fixture(scope="module")
def pair():
    kw = dict(vocab_size=V, num_layers=1, d_model=16, num_heads=2, num_kv_heads=1)
    return models.random_model(**kw, seed=3), models.random_model(**kw, seed=4)


def exact_joint(model, sampling):
    """[V, V, V]: the target's probability of each 3-token continuation under the warp."""
    width = 16
    prefixes = list(itertools.product(range(V), repeat=HORIZON - 1))
    tokens = np.zeros((len(prefixes), width), np.int32)
    for i, prefix in enumerate(prefixes):
        tokens[i, : len(PROMPT) + HORIZON - 1] = PROMPT + list(prefix)
    logits = apply(
        model,
        jnp.asarray(tokens),
        jnp.broadcast_to(jnp.arange(width), tokens.shape),
        models.init_cache(model.config, len(prefixes), width),
    ).logits
    probs = np.asarray(warp(logits[:, len(PROMPT) - 1 : len(PROMPT) + HORIZON - 1], sampling), np.float64)
    # probs[i, step] = p(x_step | prompt, prefixes[i][:step]); the chain rule gives the joint.
    joint = np.zeros((V,) * HORIZON)
    for i, (a, b) in enumerate(prefixes):
        joint[a, b, :] = probs[i, 0, a] * probs[i, 1, b] * probs[i, 2]
    return joint


def sample_counts(target, draft, sampling, gamma, seed, tree=0):
    """(counts of each 3-token continuation over N rows, stats) of generate (tree: its `tree`)."""
    gen = spec_jax.generate(
        target,
        [PROMPT] * N,
        draft=draft,
        gamma=gamma,
        tree=tree,
        max_new_tokens=HORIZON,
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        seed=seed,
    )
    flat = np.ravel_multi_index(np.array(gen.tokens).T, (V,) * HORIZON)
    return np.bincount(flat, minlength=V**HORIZON), gen.stats


def chi2_pvalue(counts, joint):
    """Pools the cells expected below 5 counts so the chi-square approximation holds."""
    expected = joint.ravel() * counts.sum()
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        assert obs[-1] == 0, "a continuation with zero target probability was sampled"
        obs, exp = obs[:-1], exp[:-1]
    return stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


@pytest.mark.parametrize("sampling", WARPS, ids=["t1", "top_k3", "t0.8_top_p0.8"])
def test_speculative_matches_target_distribution_exactly(pair, sampling):
    target, draft = pair
    counts, s = sample_counts(target, draft, sampling, gamma=2, seed=0)
    assert 0.1 < s["acceptance_rate"] < 0.95, "draft and target must differ for the test to mean anything"
    assert chi2_pvalue(counts, exact_joint(target, sampling)) > 1e-3


@pytest.mark.parametrize(
    "sampling",
    [WARPS[0], *(pytest.param(w, marks=pytest.mark.slow) for w in WARPS[1:])],
    ids=["t1", "top_k3", "t0.8_top_p0.8"],
)  # the warps themselves: the speculative sampler above, at each of them
def test_autoregressive_sampler_matches_target_distribution(pair, sampling):
    target, _ = pair
    counts, _ = sample_counts(target, None, sampling, gamma=2, seed=1)
    assert chi2_pvalue(counts, exact_joint(target, sampling)) > 1e-3


def test_the_exact_joint_is_a_distribution_and_not_uniform(pair):
    joint = exact_joint(pair[0], WARPS[0])
    assert joint.shape == (V,) * HORIZON and np.isclose(joint.sum(), 1.0)
    assert joint.max() > 3 / V**HORIZON


def test_a_broken_rule_that_always_accepts_fails(pair, monkeypatch):
    target, draft = pair

    def always_accept(drafts, q, p, key):
        n = jnp.full(drafts.shape[:1], drafts.shape[1], jnp.int32)
        return n, jnp.argmax(p[:, -1], -1).astype(jnp.int32)

    monkeypatch.setattr(rounds, "verify", always_accept)
    # An empty cache of compiled loops for this test only: the real rule's loops stay for the others.
    monkeypatch.setattr(executables, "_EXECUTABLES", {})
    counts, _ = sample_counts(target, draft, WARPS[0], gamma=2, seed=0)
    assert chi2_pvalue(counts, exact_joint(target, WARPS[0])) < 1e-6


# One loop, rows of three warps: greedy, WARPS[0] (t1) and WARPS[2] (t0.8 top-p 0.8), by row index.
MIXED = [SamplingParams(0.0), WARPS[0], WARPS[2]]
N_MIXED = 5_000  # rows of each warp


def mixed_counts(target, draft, seed=0):
    """generate over 3 * N_MIXED rows whose warps cycle through MIXED: (counts of each sampled
    warp's continuations, the greedy rows' distinct continuations, stats)."""
    warps = MIXED * N_MIXED
    gen = spec_jax.generate(
        target,
        [PROMPT] * len(warps),
        draft=draft,
        gamma=2,
        max_new_tokens=HORIZON,
        temperature=[w.temperature for w in warps],
        top_k=[w.top_k for w in warps],
        top_p=[w.top_p for w in warps],
        seed=seed,
    )
    flat = np.ravel_multi_index(np.array(gen.tokens).T, (V,) * HORIZON)
    counts = [np.bincount(flat[i :: len(MIXED)], minlength=V**HORIZON) for i in (1, 2)]
    return counts, set(flat[:: len(MIXED)].tolist()), gen.stats


def test_rows_sampled_beside_greedy_rows_and_other_warps_match_their_own_distributions(pair):
    """Greedy, plain-sampled and top-p rows in one loop: each sampled row follows its own warp's
    target distribution exactly, and every greedy row makes the greedy continuation."""
    target, draft = pair
    (t1, top_p), greedy, s = mixed_counts(target, draft)
    assert 0.1 < s["acceptance_rate"] < 0.95
    assert chi2_pvalue(t1, exact_joint(target, MIXED[1])) > 1e-3
    assert chi2_pvalue(top_p, exact_joint(target, MIXED[2])) > 1e-3
    joint = exact_joint(target, MIXED[0])
    assert greedy == {int(np.argmax(joint))}


def test_a_warp_that_leaks_one_rows_top_p_to_the_others_fails(pair, monkeypatch):
    """Broken on purpose: every row takes the batch's smallest top-p (a warp shared by the
    chunk, as a static setting would be): the t1 rows no longer follow their distribution."""
    target, draft = pair
    for_rows = RowSampling.for_rows

    def leaked(self, batch):
        rows = for_rows(self, batch)
        return rows.replace(top_p=jnp.broadcast_to(jnp.min(rows.top_p), rows.top_p.shape))

    monkeypatch.setattr(RowSampling, "for_rows", leaked)
    monkeypatch.setattr(executables, "_EXECUTABLES", {})
    (t1, _), _, _ = mixed_counts(target, draft)
    assert chi2_pvalue(t1, exact_joint(target, MIXED[1])) < 1e-6


# Per-row draft caps (SpecState.max_drafts, a request's max_drafts in the engine): row b verifies
# at most CAPS[b % 3] of the round's gamma = 2 drafts (0: plain decoding).
CAPS = (0, 1, 2)


def capped_counts(target, draft, monkeypatch, caps=CAPS):
    """sample_counts at WARPS[0] with each row's cap set after its prefill (caps[b % len(caps)]):
    the counts of each cap's rows, and the stats. A fresh cache of compiled loops: the prefill
    differs."""
    prefill = runner.spec_prefill

    def with_caps(*args, **kwargs):
        state = prefill(*args, **kwargs)
        batch = state.length.shape[0]
        return state.replace(max_drafts=jnp.asarray(caps, jnp.int32)[jnp.arange(batch) % len(caps)])

    monkeypatch.setattr(runner, "spec_prefill", with_caps)
    monkeypatch.setattr(executables, "_EXECUTABLES", {})
    gen = spec_jax.generate(
        target, [PROMPT] * N, draft=draft, gamma=2, max_new_tokens=HORIZON, temperature=1.0, seed=0
    )
    flat = np.ravel_multi_index(np.array(gen.tokens).T, (V,) * HORIZON)
    return [np.bincount(flat[i :: len(caps)], minlength=V**HORIZON) for i in range(len(caps))], gen.stats


def test_rows_sampled_under_draft_caps_match_the_target_distribution(pair, monkeypatch):
    """Rows capped at 0, 1 and 2 drafts in one loop each sample the target's distribution
    exactly (drafts past a row's cap get q = 0: never accepted, the residual is p). That the caps
    bound the drafts: tests/test_engine.py's draft-cap test."""
    target, draft = pair
    counts, s = capped_counts(target, draft, monkeypatch)
    joint = exact_joint(target, WARPS[0])
    for cap, c in zip(CAPS, counts, strict=True):
        assert chi2_pvalue(c, joint) > 1e-3, f"rows capped at {cap}"
    assert 0.1 < s["acceptance_rate"] < 0.95


def test_a_cap_applied_after_the_rule_fails(pair, monkeypatch):
    """Broken on purpose: the cap truncates the rule's accepted count after it ran (q left
    whole), keeping the token the rule drew at the uncapped position (after both drafts were
    accepted: a draw from p given both, committed after the first alone)."""
    target, draft = pair
    real = rounds.verify_logits

    def truncated(*args, **kwargs):
        n, token, terms = real(*args, **kwargs)
        return jnp.minimum(n, 1), token, terms

    monkeypatch.setattr(rounds, "_capped", lambda q, caps, depth: q)
    monkeypatch.setattr(rounds, "verify_logits", truncated)
    (counts,), _ = capped_counts(target, draft, monkeypatch, caps=(1,))
    assert chi2_pvalue(counts, exact_joint(target, WARPS[0])) < 1e-6


# VocabTrim: the draft proposes from 5 of the 8 tokens (q = 0 on the other 3).
TRIMMED_IDS = [0, 2, 3, 5, 6]


@dataclasses.dataclass(frozen=True)
class UntrimmedQDrafter(drafters.ModelDrafter):
    """Broken on purpose: drafts from the trimmed distribution but hands the rule the draft
    model's untrimmed q at the same positions (the full head's softmax)."""

    def propose(self, params, cache, context_b2, length_b, gamma, sampling, keys_b):
        tokens, _, new_cache = super().propose(params, cache, context_b2, length_b, gamma, sampling, keys_b)
        seq = jnp.concatenate([context_b2, tokens[:, :-1]], axis=1)  # [B, G + 1]
        positions = (length_b - 2)[:, None] + jnp.arange(gamma + 1)[None, :]
        logits = models.forward(self.config, params.model, seq, positions, cache).logits
        return tokens, warp(logits[:, 1:], sampling), new_cache


def test_a_vocabulary_trimmed_draft_keeps_the_target_distribution_exact(pair):
    target, draft = pair
    trimmed = drafters.trim_vocabulary(draft, TRIMMED_IDS)
    counts, s = sample_counts(target, trimmed, WARPS[0], gamma=2, seed=0)
    assert 0.1 < s["acceptance_rate"] < 0.95
    joint = exact_joint(target, WARPS[0])
    assert joint[[1, 4, 7]].sum() > 0.2, "the target often wants tokens the draft cannot propose"
    assert chi2_pvalue(counts, joint) > 1e-3


def test_a_trimmed_draft_handing_the_rule_its_untrimmed_q_fails(pair):
    target, draft = pair
    drafter, params = drafters.trim_vocabulary(draft, TRIMMED_IDS)
    broken = UntrimmedQDrafter(drafter.config, trimmed=True)
    counts, _ = sample_counts(target, (broken, params), WARPS[0], gamma=2, seed=0)
    assert chi2_pvalue(counts, exact_joint(target, WARPS[0])) < 1e-6


# Pairing: a draft whose vocabulary is a prefix of the target's (6 of the 8 ids); its q is
# padded with zeros to the target's 8 (ModelDrafter.vocab).
PREFIX_VOCAB = 6


@pytest.fixture(scope="module")
def prefix_draft():
    return models.random_model(
        vocab_size=PREFIX_VOCAB, num_layers=1, d_model=16, num_heads=2, num_kv_heads=1, seed=4
    )


@dataclasses.dataclass(frozen=True)
class ConstantPadDrafter(drafters.ModelDrafter):
    """Broken on purpose: drafts from the zero-padded q but hands the rule q with the pad
    filled with a constant (as if the draft could have proposed the ids it lacks)."""

    def propose(self, params, cache, context_b2, length_b, gamma, sampling, keys_b):
        tokens, q, new_cache = super().propose(params, cache, context_b2, length_b, gamma, sampling, keys_b)
        return tokens, q.at[..., PREFIX_VOCAB:].set(0.25), new_cache


def test_a_prefix_vocabulary_draft_keeps_the_target_distribution_exact(pair, prefix_draft):
    target, _ = pair
    counts, s = sample_counts(target, prefix_draft, WARPS[0], gamma=2, seed=0)
    assert 0.1 < s["acceptance_rate"] < 0.95
    joint = exact_joint(target, WARPS[0])
    own = joint[:PREFIX_VOCAB, :PREFIX_VOCAB, :PREFIX_VOCAB].sum()
    assert 1 - own > 0.2, "the target often wants ids the draft does not have"
    assert chi2_pvalue(counts, joint) > 1e-3


def test_a_prefix_draft_handing_the_rule_a_constant_pad_fails(pair, prefix_draft):
    target, _ = pair
    broken = ConstantPadDrafter(prefix_draft.config, vocab=V)
    counts, _ = sample_counts(target, (broken, prefix_draft.params), WARPS[0], gamma=2, seed=0)
    assert chi2_pvalue(counts, exact_joint(target, WARPS[0])) < 1e-6
