"""Long drafts for copied text: prompt lookup, suffix and hybrid drafting propose, per row, as many
drafts as the row's match supports (spec_jax.drafting.lookup.draft_counts), up to gamma = 16, and
the output stays exact at every length: greedy output equals plain decoding for gamma 1..16, and
the sampled tokens of a 12-token horizon at gamma = 12 have the target's distribution (a
chi-square test per position), which a deliberately broken drafter fails.

The copy target is a Markov chain over V = 8 tokens (its blocks zeroed, the embedding one-hot, the
head a chosen matrix): its distribution over any horizon is known in closed form, and it follows
the cycle t -> t + 1 that the prompt holds with probability FOLLOW, so lookup's long matches are
accepted for long runs, and broken off at random.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import apply
from test_distribution import chi2_pvalue
from test_speculative import MAX_NEW, PROMPTS

import models
import spec_jax
from spec_jax import autogamma, bounds, drafting, plan, runner
from spec_jax.drafting import lookup
from spec_jax.drafting.base import AUTO_COPY_GAMMA_MAX, AUTO_GAMMA_MAX, Proposal
from spec_jax.state import SpecStatic

V, FOLLOW = 8, 0.75
CYCLE_PROMPT = list(range(V)) * 2 + [0, 1]  # a text that repeats: lookup matches it 16 tokens back
COPY_PROMPTS = [CYCLE_PROMPT, [3], [0, 1, 2, 3, 4, 5, 2, 3, 4, 5, 2], [6] * 5]
COPY_NEW = 40
HORIZON, N, LONG_GAMMA = 12, 4_000, 12
pytestmark = pytest.mark.xdist_group("tiny_target")


def markov_target(transition_vv) -> models.Model:
    """A target whose next-token distribution is transition[t] after token t wherever t stands:
    every block's output is zeroed, the embedding is one-hot and the head reads log transition
    (the final norm scales a one-hot by sqrt(V))."""
    model = models.random_model(vocab_size=V, num_layers=1, d_model=V, num_heads=2, num_kv_heads=1, seed=11)
    head = np.log(transition_vv).T / np.sqrt(V)  # [V out, V features]

    def edit(path, x):
        name = jax.tree_util.keystr(path)
        if "wo" in name or "w_down" in name:
            return jnp.zeros_like(x)
        if "lm_head" in name:
            return jnp.asarray(head, x.dtype)
        if "embed" in name:
            return jnp.eye(V, dtype=x.dtype)
        return x

    return model.replace(params=jax.tree_util.tree_map_with_path(edit, model.params))


@pytest.fixture(scope="module")
def copy_target():
    """(the Markov target, its exact transition matrix [V, V] as the model computes it). It
    follows t -> t + 1 with probability FOLLOW and more (greedy output is the cycle)."""
    rng = np.random.default_rng(0)
    transition = (1 - FOLLOW) * rng.dirichlet(np.ones(V), size=V)
    transition[np.arange(V), (np.arange(V) + 1) % V] += FOLLOW
    target = markov_target(transition)
    tokens = jnp.asarray([list(range(V)) * 2], jnp.int32)
    cache = models.init_cache(target.config, 1, 2 * V)
    logits = apply(target, tokens, jnp.arange(2 * V)[None, :], cache).logits[0]
    probs = np.asarray(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), np.float64)
    np.testing.assert_allclose(probs[:V], probs[V:], atol=1e-6, err_msg="the position changes nothing")
    np.testing.assert_allclose(probs[:V], transition, atol=1e-4)
    return target, probs[:V] / probs[:V].sum(axis=1, keepdims=True)


@pytest.fixture(scope="module")
def copy_greedy(copy_target):
    return spec_jax.generate(copy_target[0], COPY_PROMPTS, max_new_tokens=COPY_NEW, temperature=0.0).tokens


@pytest.fixture(scope="module")
def tiny_greedy(tiny_target):
    prompts = PROMPTS + [CYCLE_PROMPT * 2]
    return prompts, spec_jax.generate(tiny_target, prompts, max_new_tokens=MAX_NEW, temperature=0.0).tokens


# Every length: 1, 2, 3, 5, 9, 12 and 16 in `make test` (each doubling width's edge, and the
# lengths whose rounds accept more than 8 drafts); the others in the slow tier (each gamma compiles
# two loops: about 10 s apiece on 2 cores).
FAST_GAMMAS = (1, 2, 3, 5, 9, 12, 16)


@pytest.mark.parametrize(
    "gamma",
    [
        g if g in FAST_GAMMAS else pytest.param(g, marks=pytest.mark.slow)
        for g in range(1, AUTO_COPY_GAMMA_MAX + 1)
    ],
)
def test_lookup_greedy_output_equals_plain_decoding_at_every_length(
    copy_target, copy_greedy, tiny_target, tiny_greedy, gamma
):
    target = copy_target[0]
    draft = drafting.build("prompt_lookup", target)
    gen = spec_jax.generate(
        target, COPY_PROMPTS, draft=draft, gamma=gamma, max_new_tokens=COPY_NEW, temperature=0.0
    )
    assert gen.tokens == copy_greedy
    s, hist = gen.stats, gen.stats["accepted_histogram"]
    assert sum(hist[1:]) > 0, "drafts are accepted"
    if gamma >= 3:
        assert s["num_draft_tokens"] < gamma * s["num_rounds"], "rows propose fewer than gamma"
    if gamma >= 12:
        assert sum(hist[9:]) > 0, "rounds accept more than 8 drafts"
    prompts, expected = tiny_greedy
    gen = spec_jax.generate(
        tiny_target,
        prompts,
        draft=drafting.build("prompt_lookup", tiny_target),
        gamma=gamma,
        max_new_tokens=MAX_NEW,
        temperature=0.0,
    )
    assert gen.tokens == expected


@pytest.mark.parametrize("gamma", [2, 9, 16])
@pytest.mark.parametrize("kind", ["suffix", "hybrid"])
def test_suffix_and_hybrid_greedy_output_equals_plain_decoding_up_to_16(
    copy_target, copy_greedy, tiny_target, tiny_draft, tiny_greedy, kind, gamma
):
    target = copy_target[0]
    draft = drafting.build(kind, target, drafting.Settings(draft=target))
    gen = spec_jax.generate(
        target, COPY_PROMPTS, draft=draft, gamma=gamma, max_new_tokens=COPY_NEW, temperature=0.0
    )
    assert gen.tokens == copy_greedy
    prompts, expected = tiny_greedy
    draft = drafting.build(kind, tiny_target, drafting.Settings(draft=tiny_draft))
    gen = spec_jax.generate(
        tiny_target, prompts, draft=draft, gamma=gamma, max_new_tokens=MAX_NEW, temperature=0.0
    )
    assert gen.tokens == expected


def sampled(target, drafter, gamma: int = LONG_GAMMA):
    """(tokens int [N, HORIZON] sampled at temperature 1 from N rows of CYCLE_PROMPT, stats)."""
    gen = spec_jax.generate(
        target,
        [CYCLE_PROMPT] * N,
        draft=(drafter, ()),
        gamma=gamma,
        max_new_tokens=HORIZON,
        temperature=1.0,
        seed=0,
    )
    return np.asarray(gen.tokens), gen.stats


def pair_pvalues(tokens_nh, transition_vv, first: int) -> list[float]:
    """The chi-square p-value of each position's pairs (x_i, x_i+1) against the chain's exact
    P(x_i = a, x_i+1 = b) = m_i(a) T(a, b), m_i the distribution of x_i after `first`."""
    marginal = transition_vv[first]
    out = []
    for i in range(tokens_nh.shape[1] - 1):
        cells = np.ravel_multi_index((tokens_nh[:, i], tokens_nh[:, i + 1]), (V, V))
        out.append(chi2_pvalue(np.bincount(cells, minlength=V * V), marginal[:, None] * transition_vv))
        marginal = marginal @ transition_vv
    return out


def test_lookup_with_per_row_lengths_samples_the_target_distribution_at_gamma_12(copy_target):
    target, transition = copy_target
    tokens, s = sampled(target, lookup.PromptLookupDrafter(V))
    hist = s["accepted_histogram"]
    assert 2 < s["num_draft_tokens"] / s["num_rounds"] < LONG_GAMMA - 1, "rows propose mixed lengths"
    assert sum(hist[8:]) > 100 and sum(hist[1:4]) > 100, "long and short runs are accepted"
    pvalues = pair_pvalues(tokens, transition, CYCLE_PROMPT[-1])
    assert min(pvalues) * len(pvalues) > 1e-3, pvalues  # Bonferroni over the positions


@dataclasses.dataclass(frozen=True)
class PaddedLookup(lookup.PromptLookupDrafter):
    """Broken on purpose: the per-row length ignored in q. Every matched row drafts the whole
    continuation, and the positions past its count get a placeholder q (uniform) instead of 0,
    so the rule accepts a draft x there with probability min(1, V p(x)), not p(x)."""

    def propose(self, params, buffer_bs, context_b2, length_b, gamma, sampling, keys_b):
        buffer_bs, count, drafts = self.lookup(buffer_bs, context_b2, length_b, gamma)
        padded = (jnp.arange(gamma)[None, :] >= count[:, None]) & (count > 0)[:, None]
        q = lookup.one_hot_prefix(drafts, count, self.vocab_size) + padded[..., None] / self.vocab_size
        return Proposal(drafts, q, lookup.write_tokens(buffer_bs, drafts, length_b))


def test_a_lookup_handing_the_rule_a_placeholder_q_past_its_count_fails_the_same_test(copy_target):
    target, transition = copy_target
    tokens, _ = sampled(target, PaddedLookup(V))
    assert min(pair_pvalues(tokens, transition, CYCLE_PROMPT[-1])) < 1e-6


def test_gamma_auto_runs_chains_up_to_16_for_the_drafters_that_copy_and_8_for_a_model(
    tiny_target, tiny_draft, tmp_path, monkeypatch
):
    monkeypatch.setenv("SPEC_JAX_CACHE", str(tmp_path))  # the prior: nothing cached, nothing measured
    for kind, longest in [("prompt_lookup", 16), ("suffix", 16), ("hybrid", 16), ("model", 8)]:
        drafter, params = drafting.build(kind, tiny_target, drafting.Settings(draft=tiny_draft))
        policy = plan.GammaPolicy.of("auto", drafter)
        assert (policy.gamma, policy.auto) == (longest, True), kind
        controller = plan.controller_for(tiny_target, drafter, params, policy, 1, 64, measure=False)
        assert controller.gamma_max == longest and len(controller.costs.verify) == longest + 1, kind
        if kind == "prompt_lookup":  # free drafts that are always accepted: the longest chain
            assert controller.best_at(0.99) == longest
    assert bounds.speculation_bound("auto", 0)[0] == AUTO_GAMMA_MAX, "no drafter known: 8"
    assert bounds.speculation_bound("auto", "auto", auto_gamma_max=AUTO_COPY_GAMMA_MAX)[0] == 16


def test_gamma_auto_with_lookup_keeps_greedy_output_exact(copy_target, copy_greedy, tmp_path, monkeypatch):
    monkeypatch.setenv("SPEC_JAX_CACHE", str(tmp_path))
    target = copy_target[0]
    gen = spec_jax.generate(
        target,
        COPY_PROMPTS,
        draft=drafting.build("prompt_lookup", target),
        gamma="auto",
        max_new_tokens=COPY_NEW,
        temperature=0.0,
    )
    assert gen.tokens == copy_greedy


def test_gamma_auto_with_lookup_runs_each_gamma_in_the_program_of_a_power_of_two(
    copy_target, copy_greedy, tmp_path, monkeypatch
):
    """A drafter that calls no model: gamma=auto's chunks of gamma 5 and 3 (forced, 2 rounds
    each, with plain ones) run the loop programs of 8 and 4 (the power of two at least each),
    each row's drafts capped at the chunk's gamma; the output stays plain decoding's, and on the
    cycle, which lookup matches at every round, a chunk drafts its gamma a round, no more (the
    program's 8 or 4 uncapped)."""
    monkeypatch.setenv("SPEC_JAX_CACHE", str(tmp_path))
    arms = iter([5, 0, 3] * 30)
    monkeypatch.setattr(autogamma.Controller, "next_chunk", lambda self, remaining: (next(arms), 2))
    programs, real = [], runner.compiled

    def spy(name, fn, static, *args, **kwargs):
        programs.append((name, getattr(static, "gamma", None)))
        return real(name, fn, static, *args, **kwargs)

    monkeypatch.setattr(runner, "compiled", spy)
    target = copy_target[0]
    lookup_drafter = drafting.build("prompt_lookup", target)
    gen = spec_jax.generate(
        target, [CYCLE_PROMPT], draft=lookup_drafter, gamma="auto", max_new_tokens=COPY_NEW, temperature=0.0
    )
    assert gen.tokens == copy_greedy[:1]
    assert {g for name, g in programs if name == "spec_loop"} == {0, 4, 8}  # 5 -> 8, 3 -> 4
    schedule = gen.stats["gamma_schedule"]
    assert {g for g, _ in schedule} == {0, 5, 3}
    assert 0 < gen.stats["num_draft_tokens"] <= sum(g * r for g, r in schedule)


def test_the_copying_drafters_rounds_verify_as_wide_as_their_power_of_two_counts(tiny_target, tiny_draft):
    def widths(gamma):
        return SpecStatic(None, None, gamma, 1, 1, verify_widths="doubling").widths()

    assert widths(16) == (1, 2, 3, 5, 9, 17) and widths(12) == (1, 2, 3, 5, 9, 13)
    assert widths(1) == (1, 2) and widths(2) == (1, 2, 3) and widths(4) == (1, 2, 3, 5)
    for kind, auto in [("prompt_lookup", "doubling"), ("suffix", "doubling"), ("hybrid", "doubling")]:
        drafter, _ = drafting.build(kind, tiny_target, drafting.Settings(draft=tiny_draft))
        assert plan.resolve_verify_widths("auto", drafter) == auto
        assert plan.resolve_verify_widths("ends", drafter) == "ends"
    model, _ = drafting.build("model", tiny_target, drafting.Settings(draft=tiny_draft))
    assert plan.resolve_verify_widths("auto", model) == "ends"
