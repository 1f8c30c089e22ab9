"""Prompt lookup, hybrid drafting and per-row adaptive draft lengths: the match, the buffer and the
draft model's cache the loop keeps, and greedy identity to autoregressive decoding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import apply, loop_by_hand, perturbed
from test_ngram import cycle_following_target
from test_speculative import MAX_NEW, PROMPTS

import models
import spec_jax
from spec_jax import drafting, verify
from spec_jax.drafting import hybrid, lookup
from spec_jax.sampling import SamplingParams

GAMMA = 4
THRESHOLD = 0.08  # the tiny draft's top probability is around this: rows stop at mixed lengths


def match(rows, lengths, max_ngram, gamma=4):
    """(found, end, ngram, drafts) of spec_jax.drafting.lookup for token rows (padded with 0 to one width)."""
    width = max(len(r) for r in rows)
    buffer = jnp.asarray([r + [0] * (width - len(r)) for r in rows], jnp.int32)
    length = jnp.asarray(lengths, jnp.int32)
    found, end, ngram = jax.jit(lookup.find_match, static_argnums=2)(buffer, length, max_ngram)
    drafts = lookup.continuation(buffer, length, end, gamma)
    return np.asarray(found).tolist(), np.asarray(end).tolist(), np.asarray(ngram).tolist(), drafts.tolist()


def test_the_match_is_the_most_recent_occurrence_and_the_text_repeats_past_the_end():
    found, end, ngram, drafts = match([[1, 2, 3, 9, 1, 2, 4, 7, 1, 2]], [10], max_ngram=2, gamma=6)
    assert (found, end, ngram) == ([True], [5], [2])  # [1, 2] ends at 1 and at 5: the later one
    assert drafts == [[4, 7, 1, 2, 4, 7]]  # t[6..9], then period 4 past the last token


def test_the_longest_ngram_wins_from_max_ngram_down_to_one():
    row = [[5, 1, 2, 8, 3, 2, 9, 5, 1, 2]]  # [5, 1, 2] ends at 2; the later "2" ends at 5
    assert match(row, [10], max_ngram=3)[1:3] == ([2], [3])
    assert match(row, [10], max_ngram=2)[1:3] == ([2], [2])
    assert match(row, [10], max_ngram=1)[1:3] == ([5], [1])
    assert match(row, [10], max_ngram=3)[3] == [[8, 3, 2, 9]]


def test_tokens_past_the_length_are_never_matched_and_rows_are_independent():
    rows = [
        [1, 2, 3, 1, 2, 1, 2, 7],  # length 5: the later "1, 2" (ending at 6) is garbage
        [4, 5, 6],  # "6" occurs nowhere earlier: no match
        [9, 9, 0, 0],  # length 2: "9" ended at 0; padding zeros past it never count
        [0, 0, 3],  # length 3 with zeros inside the row: "3" has no earlier occurrence
    ]
    lengths = [5, 3, 2, 3]
    found, end, ngram, drafts = match(rows, lengths, max_ngram=3)
    assert found == [True, False, True, False]
    assert end == [1, -1, 0, -1] and ngram == [2, 0, 1, 0]
    assert drafts[0] == [3, 1, 2, 3] and drafts[2] == [9, 9, 9, 9]
    for i in range(len(rows)):  # each row alone gives what it gives in the batch
        assert match([rows[i]], [lengths[i]], max_ngram=3) == ([found[i]], [end[i]], [ngram[i]], [drafts[i]])


def test_propose_hands_one_hot_q_where_it_matched_and_zero_where_not():
    drafter = lookup.PromptLookupDrafter(vocab_size=12, max_ngram=2)
    prompts = jnp.asarray([[1, 2, 3, 1, 0, 0], [4, 5, 6, 7, 0, 0]], jnp.int32)
    buffer = drafter.init(None, prompts, jnp.asarray([4, 4]), 12)
    context = jnp.asarray([[1, 2], [7, 8]])  # the committed tokens at positions 3 and 4
    tokens, q, buffer = drafter.propose(
        (), buffer, context, jnp.asarray([5, 5]), 3, SamplingParams(1.0), None
    )
    assert tokens[0].tolist() == [3, 1, 2]
    np.testing.assert_array_equal(q[0], np.eye(12)[[3, 1, 2]])
    assert not np.asarray(q[1]).any(), "no earlier 8: nothing proposed"
    assert buffer[0, :8].tolist() == [1, 2, 3, 1, 2, 3, 1, 2], "the drafts are written past the length"


def test_a_row_proposes_twice_its_whole_match_length_as_a_power_of_two_up_to_gamma_or_nothing():
    rows = [
        [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5],  # "3 4 5" ends at 4; the text before agrees 5 back
        [7, 1, 2, 9, 3, 1, 2, 0, 0, 0, 0],  # "1 2" ends at 2; 7 before it, 3 here: a match of 2
        [4, 5, 6, 0, 0, 0, 0, 0, 0, 0, 0],  # nothing matches "6"
        [2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2],  # a run: the match goes back to the text's start
    ]
    buffer = jnp.asarray(rows, jnp.int32)
    length = jnp.asarray([11, 7, 3, 11], jnp.int32)
    found, end, _ = lookup.find_match(buffer, length, 3)
    m = lookup.match_length(buffer, length, end)
    assert m.tolist() == [5, 2, 0, 10]
    assert lookup.draft_counts(m, 16, 2.0).tolist() == [16, 4, 0, 16]  # 10 and 20 round up
    assert lookup.draft_counts(m, 12, 2.0).tolist() == [12, 4, 0, 12]
    assert lookup.draft_counts(m, 3, 2.0).tolist() == [3, 3, 0, 3]
    assert lookup.draft_counts(m, 16, 0.1).tolist() == [1, 1, 0, 1], "a match proposes at least one"
    assert lookup.draft_counts(jnp.arange(1, 5), 16, 2.0).tolist() == [2, 4, 8, 8]
    assert lookup.draft_counts(m, 16, float("inf")).tolist() == [16, 16, 0, 16]
    drafter = lookup.PromptLookupDrafter(vocab_size=10, max_ngram=3)
    context = jnp.take_along_axis(buffer, length[:, None] - 2 + jnp.arange(2)[None, :], axis=1)
    padded = jnp.pad(buffer, ((0, 0), (0, 16)))
    _, q, _ = drafter.propose((), padded, context, length, 16, SamplingParams(1.0), None)
    assert verify.draft_lengths(q).tolist() == [16, 4, 0, 16], "q = 0 past each row's count"
    with pytest.raises(ValueError, match="match_factor must be a number > 0"):
        lookup.PromptLookupDrafter(vocab_size=10, match_factor=0)


def test_a_bad_max_ngram_is_refused(tiny_target):
    for bad in (0, 17, 2.0):
        with pytest.raises(ValueError, match=r"max_ngram must be an integer in \[1, 16\]"):
            drafting.build("prompt_lookup", tiny_target, drafting.Settings(max_ngram=bad))
    with pytest.raises(ValueError, match=r"threshold must be a number in \[0, 1\)"):
        drafting.build("model", tiny_target, drafting.Settings(draft=tiny_target, threshold=1.0))
    with pytest.raises(ValueError, match="drafter must be one of model, .*, got 'lookahead'") as info:
        drafting.build("lookahead", tiny_target)
    assert all(kind in str(info.value) for kind in drafting.DRAFTERS), "every drafter is named"
    with pytest.raises(ValueError, match="drafter 'hybrid' needs a draft model"):
        drafting.build("hybrid", tiny_target)


def test_lookup_on_a_prompt_that_repeats_itself_drafts_the_continuation_and_it_is_accepted():
    """A target that continues t -> t + 1 and a prompt holding that cycle: every round copies the
    continuation out of the prompt and the target accepts all gamma drafts."""
    vocab = 16
    target = cycle_following_target(vocab)
    prompts = [list(range(16)) + [0, 1, 2], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 5, 6]]
    draft = drafting.build("prompt_lookup", target, drafting.Settings(max_ngram=2))
    gen = spec_jax.generate(target, prompts, draft=draft, gamma=3, max_new_tokens=9, temperature=0.0)
    assert gen.tokens == [[(p[-1] + 1 + i) % vocab for i in range(9)] for p in prompts]
    s = gen.stats
    # Row 1's "5, 6" first matches at the prompt's start (its continuation is right); row 0 at once.
    assert s["acceptance_rate"] == 1.0 and s["mean_accepted_length"] == 4.0
    assert s["fraction_of_rounds_by_drafter"] == {"prompt_lookup": 1.0}


pytestmark = pytest.mark.xdist_group("tiny_target")


@pytest.fixture(scope="module")
def greedy_ar(tiny_target):
    return spec_jax.generate(tiny_target, PROMPTS, max_new_tokens=MAX_NEW, temperature=0.0).tokens


def drafts_of(kind, target, draft, threshold=0.0):
    return drafting.build(kind, target, drafting.Settings(draft=draft, threshold=threshold))


@pytest.mark.parametrize("kind, threshold", [("prompt_lookup", 0.0), ("hybrid", 0.0), ("model", THRESHOLD)])
def test_greedy_output_equals_autoregressive_on_a_ragged_batch(
    tiny_target, tiny_draft, greedy_ar, kind, threshold
):
    gen = spec_jax.generate(
        tiny_target,
        PROMPTS,
        draft=drafts_of(kind, tiny_target, tiny_draft, threshold),
        gamma=GAMMA,
        max_new_tokens=MAX_NEW,
        temperature=0.0,
    )
    assert gen.tokens == greedy_ar
    s = gen.stats
    hist = s["accepted_histogram"]
    assert sum(hist[1:]) > 0, "some drafts are accepted"
    if kind != "hybrid" or threshold:  # (a hybrid without a threshold always drafts gamma)
        assert 0 < s["num_draft_tokens"] < GAMMA * s["num_rounds"], (
            "rows draft fewer than gamma in some rounds"
        )
    assert sum(s["rounds_by_drafter"].values()) == s["num_rounds"]
    assert sum(s["draft_tokens_by_drafter"].values()) == s["num_draft_tokens"]
    if kind == "hybrid":
        assert 0 < s["fraction_of_rounds_by_drafter"]["model"] < 1, "both sources serve rounds"


@pytest.mark.parametrize("kind", ["prompt_lookup", "hybrid"])
def test_greedy_output_equals_autoregressive_one_prompt_at_a_time(tiny_target, tiny_draft, greedy_ar, kind):
    draft = drafts_of(kind, tiny_target, tiny_draft)
    for prompt, expected in zip(PROMPTS, greedy_ar, strict=True):
        gen = spec_jax.generate(
            tiny_target, [prompt], draft=draft, gamma=GAMMA, max_new_tokens=MAX_NEW, temperature=0.0
        )
        assert gen.tokens == [expected]


def test_greedy_equivalence_holds_when_rows_stop_at_eos(tiny_target, tiny_draft, greedy_ar):
    eos = greedy_ar[1][2]
    ar = spec_jax.generate(tiny_target, PROMPTS, max_new_tokens=MAX_NEW, temperature=0.0, eos_id=eos)
    gen = spec_jax.generate(
        tiny_target,
        PROMPTS,
        draft=drafts_of("hybrid", tiny_target, tiny_draft),
        gamma=GAMMA,
        max_new_tokens=MAX_NEW,
        temperature=0.0,
        eos_id=eos,
    )
    assert gen.tokens == ar.tokens and len(gen.tokens[1]) <= 3


def test_the_buffer_and_the_hybrid_models_cache_hold_the_committed_prefix_after_every_round():
    """Stepping the loop by hand: after every round the lookup buffer below the row's length is
    its prompt + output (up to the last token), and the draft model's cache below `cached`
    equals a fresh prefill of those tokens, also after rounds lookup served. The target counts
    t -> t + 1 (mod 16) and the prompt holds 0..9: lookup serves the first rounds (several
    rounds' tokens for the model to catch up on, 2 per call), the model serves past 9."""
    vocab, gamma, max_new = 16, 3, 16
    target = cycle_following_target(vocab)
    draft = perturbed(target, 0.3, seed=1)
    model, _ = drafting.build("model", target, drafting.Settings(draft=draft))
    drafter = hybrid.HybridDrafter(lookup.PromptLookupDrafter(vocab, 2), model, catch_up=2)
    prompt = list(range(10)) + [0, 1]
    slots = 16 + max_new + gamma
    state, step = loop_by_hand(target, drafter, draft.params, [prompt], gamma, max_new)
    rounds, largest_gap = [], 0
    while not bool(jnp.all(state.out.done)):
        before, length = state.draft_state, np.asarray(state.length)
        cached = np.where(before.model_drafted, np.maximum(before.cached, length - 2), before.cached)
        state = step(state)
        if np.asarray(state.draft_state.model_drafted).any():  # the model ran: the row caught up
            largest_gap = max(largest_gap, int(np.max(length - 2 - cached)))
        rounds.append((int(state.length[0]), jax.tree.map(np.asarray, state.draft_state)))
    seq = prompt + [(2 + i) % vocab for i in range(max_new)]
    assert np.asarray(state.out.tokens)[0, :max_new].tolist() == seq[len(prompt) :]
    for n, h in rounds:
        # The last committed token, drawn by the rule, is written when the next round reads it.
        assert h.buffer[0, : n - 1].tolist() == seq[: n - 1]
        c = int(min(h.cached[0], n))
        fresh = apply(
            draft,
            jnp.asarray([seq[:c] + [0] * (slots - c)]),
            jnp.arange(slots)[None],
            models.init_cache(draft.config, 1, slots),
        ).cache
        np.testing.assert_allclose(h.cache.k[:, 0, :c], fresh.k[:, 0, :c], atol=1e-5)
        np.testing.assert_allclose(h.cache.v[:, 0, :c], fresh.v[:, 0, :c], atol=1e-5)
    assert largest_gap > gamma + 1, "the model had to catch up on more than one round's tokens"
