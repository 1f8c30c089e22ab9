"""The acceptance head (training.acceptance): logged rounds are labelled right, the classifier
learns where drafts get rejected, the threshold it picks beats every fixed gamma in the
simulation that chose it, and drafting with it stays exact (greedy identity; chi-square at
temperature 1)."""

import dataclasses

import numpy as np
import pytest
from test_distribution import WARPS, chi2_pvalue, exact_joint, pair, sample_counts  # noqa: F401
from test_head import cycle_head, random_head
from test_ngram import cycle_following_target

import spec_jax
from spec_jax.autogamma.costs import Costs
from spec_jax.drafting.head import HeadDrafter
from spec_jax.drafting.trained_head import head_params
from training import acceptance

VOCAB, GAMMA = 16, 6
WRONG = {5: 9, 12: 2}  # the cycle head's draft after reading 5 or 12 is rejected


def expected_accepted(last: int) -> int:
    """Drafts accepted in a round whose last committed token is `last`: the chain of drafts last+1,
    last+2, ... is right until it reads a token in WRONG."""
    for i in range(GAMMA):
        if (last + i) % VOCAB in WRONG:
            return i
    return GAMMA


@pytest.fixture(scope="module")
def cycle_log():
    target = cycle_following_target(VOCAB)
    head = cycle_head(target, WRONG)
    drafter, params = HeadDrafter(head.config), head_params(target, head)
    prompts = [[s, (s + 1) % VOCAB] for s in range(VOCAB)]
    log = acceptance.log_rounds(
        target, drafter, params, prompts, gamma=GAMMA, max_new_tokens=30, batch_size=8, progress=False
    )
    return target, drafter, params, prompts, log


def test_logged_rounds_are_the_rounds_of_the_loop_with_their_acceptances(cycle_log):
    _, _, _, prompts, log = cycle_log
    for i, prompt in enumerate(prompts):  # replay the known text: each round commits accepted + 1 tokens
        expected = []
        last, made = (prompt[-1] + 1) % VOCAB, 1
        while True:
            a = expected_accepted(last)
            if made + a + 1 >= 30:  # the round that reaches max_new_tokens is cut: not logged
                break
            expected.append(a)
            last, made = (last + a + 1) % VOCAB, made + a + 1
        assert log.accepted[log.prompt == i].tolist() == expected, i
    for r, a in enumerate(log.accepted):  # one example per position reached; 1 where rejected
        labels = log.label[log.round == r].tolist()
        assert labels == [0] * a + ([1] if a < GAMMA else [])


def test_the_classifier_learns_where_drafts_are_rejected_and_its_threshold_beats_fixed_gammas(cycle_log):
    _, _, _, _, log = cycle_log
    train, held = log.split(range(12, VOCAB))
    trained = acceptance.train(
        train, held, steps=300, batch_size=64, learning_rate=3e-3, reject_weight=2.0, seed=0, progress=False
    )
    assert trained.history[-1]["held_out_accuracy"] > 0.97
    costs = Costs(
        step_seconds=1.0, draft1=0.05, draft2=0.1, verify=(1.0,) + tuple(1.0 + 0.2 * g for g in range(1, 9))
    )
    threshold, curve = acceptance.choose_threshold(trained.params, held, costs)
    best_fixed = max(c["tokens_per_step"] for c in curve if "gamma" in c)
    chosen = next(c for c in curve if c.get("threshold") == threshold)
    assert chosen["tokens_per_step"] > 1.1 * best_fixed, curve


def stopping(cycle_log, log):
    target, drafter, params, _, _ = cycle_log
    train, held = log.split(range(12, VOCAB))
    trained = acceptance.train(
        train, held, steps=300, batch_size=64, learning_rate=3e-3, reject_weight=2.0, seed=0, progress=False
    )
    return target, dataclasses.replace(drafter, stop_rejection=0.5), params.replace(acceptance=trained.params)


@pytest.fixture(scope="module")
def stopping_head(cycle_log):
    return stopping(cycle_log, cycle_log[-1])


PROMPTS = [[3, 4], [10], [15, 0, 1]]


def cycle_generate(target, drafter, params, widths="auto"):
    gen = spec_jax.generate(
        target,
        PROMPTS,
        draft=(drafter, params),
        gamma=GAMMA,
        max_new_tokens=24,
        temperature=0.0,
        verify_widths=widths,
    )
    for prompt, tokens in zip(PROMPTS, gen.tokens, strict=True):
        assert tokens == [(prompt[-1] + 1 + i) % VOCAB for i in range(24)]
    return gen.stats


@pytest.mark.parametrize("widths", ["ends", "all"])
def test_drafting_with_the_acceptance_stop_is_exact_and_stops_right_before_rejections(
    cycle_log, stopping_head, widths
):
    """It drafts as far as the drafts are accepted, and no further: the same tokens per round as
    drafting gamma every round, with no rejected draft."""
    target, drafter, params, _, _ = cycle_log
    always = cycle_generate(target, drafter, params)
    stats = cycle_generate(*stopping_head, widths)
    assert stats["acceptance_rate"] > 0.95 > always["acceptance_rate"]
    assert stats["mean_accepted_length"] == pytest.approx(always["mean_accepted_length"])


def test_an_acceptance_head_trained_on_labels_one_example_late_stops_in_the_wrong_places(
    cycle_log, stopping_head
):
    """The broken variant: each label moved to the next logged example (an off-by-one in the
    logging). The classifier learns that mapping, so drafting stops where nothing would be
    rejected: rounds commit far fewer tokens."""
    _, _, _, _, log = cycle_log
    good = cycle_generate(*stopping_head)
    broken = cycle_generate(*stopping(cycle_log, dataclasses.replace(log, label=np.roll(log.label, 1))))
    assert broken["mean_accepted_length"] < 0.8 * good["mean_accepted_length"]


@pytest.fixture(scope="module")
def v8_acceptance(pair):  # noqa: F811
    """A random head on the V = 8 target with a random acceptance head: rows stop at 0, 1 or 2."""
    target, _ = pair
    head = random_head(target, seed=11)
    params = head_params(target, head)
    x = np.random.default_rng(0).standard_normal((64, head.config.d_model + 2 + acceptance.POSITIONS))
    stop = acceptance.init(x.astype(np.float32), seed=3)
    return HeadDrafter(head.config, stop_rejection=0.35), params.replace(acceptance=stop)


def test_sampling_with_the_acceptance_stop_matches_target_distribution_exactly(pair, v8_acceptance):  # noqa: F811
    target, _ = pair
    counts, s = sample_counts(target, v8_acceptance, WARPS[0], gamma=2, seed=0)
    assert 0.2 < s["num_draft_tokens"] / (2 * s["num_rounds"]) < 0.9, "rows stop at different lengths"
    assert chi2_pvalue(counts, exact_joint(target, WARPS[0])) > 1e-3
