"""The speculative loop: exact greedy equivalence, per-row progress, metrics, errors."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import apply, loop_by_hand

import models
import spec_jax
from spec_jax import drafting, executables, rounds

# Ragged rows: lengths 3, 1, 10 and 6. The same batch, length and gamma as tests/test_decode.py and
# tests/test_ngram.py (one xdist group): compiling a loop costs ~10 s of CPU, so the tests share
# the loops they can (a loop is compiled per batch shape, max_new_tokens, gamma and warp).
PROMPTS = [[5, 9, 2], [1], [7, 7, 3, 8, 11, 4, 6, 2, 9, 10], [3, 3, 3, 1, 2, 60]]
MAX_NEW = 13  # not a multiple of gamma + 1 for any gamma below
GAMMA = 4
pytestmark = pytest.mark.xdist_group("tiny_target")
OTHER_ROWS = [[60] * 16, [2], [8, 8, 8, 8]]  # neighbours for PROMPTS[0], longer and shorter


@pytest.fixture(scope="module")
def greedy_ar(tiny_target):
    return spec_jax.generate(tiny_target, PROMPTS, max_new_tokens=MAX_NEW, temperature=0.0).tokens


@pytest.mark.parametrize("gamma", [1, GAMMA, 7])
def test_greedy_speculative_equals_autoregressive_token_for_token(tiny_target, tiny_draft, greedy_ar, gamma):
    gen = spec_jax.generate(
        tiny_target, PROMPTS, draft=tiny_draft, gamma=gamma, max_new_tokens=MAX_NEW, temperature=0.0
    )
    assert gen.tokens == greedy_ar
    hist = gen.stats["accepted_histogram"]
    assert hist[0] > 0 and sum(hist[1:]) > 0, "the draft should be partly right, partly wrong"


def test_greedy_equivalence_with_rows_that_stop_at_eos_early(tiny_target, tiny_draft, greedy_ar):
    eos = greedy_ar[1][2]  # row 1 stops at its third token at the latest
    ar = spec_jax.generate(tiny_target, PROMPTS, max_new_tokens=MAX_NEW, temperature=0.0, eos_id=eos)
    spec = spec_jax.generate(
        tiny_target,
        PROMPTS,
        draft=tiny_draft,
        gamma=GAMMA,
        max_new_tokens=MAX_NEW,
        temperature=0.0,
        eos_id=eos,
    )
    assert spec.tokens == ar.tokens
    assert len(spec.tokens[1]) <= 3 and spec.tokens[1][-1] == eos
    assert max(len(t) for t in spec.tokens) > 3, "other rows go on after row 1 stops"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_equal_to_target_accepts_everything(tiny_target, temperature):
    gamma = GAMMA
    gen = spec_jax.generate(
        tiny_target, PROMPTS, draft=tiny_target, gamma=gamma, max_new_tokens=MAX_NEW, temperature=temperature
    )
    s = gen.stats
    assert s["acceptance_rate"] == 1.0
    assert s["mean_accepted_length"] == gamma + 1
    assert s["accepted_histogram"][:gamma] == [0] * gamma
    assert s["alpha_hat"] == pytest.approx(1.0, abs=1e-6)
    # 1 token from prefill, then rounds of gamma + 1, the last one truncated at MAX_NEW.
    assert all(len(t) == MAX_NEW for t in gen.tokens)
    assert s["num_rounds"] == len(PROMPTS) * -(-(MAX_NEW - 1) // (gamma + 1))


def test_stats_add_up(tiny_target, tiny_draft):
    gamma = GAMMA
    gen = spec_jax.generate(
        tiny_target, PROMPTS, draft=tiny_draft, gamma=gamma, max_new_tokens=MAX_NEW, temperature=1.0, seed=5
    )
    s = gen.stats
    hist = s["accepted_histogram"]
    assert len(hist) == gamma + 1 and sum(hist) == s["num_rounds"]
    assert sum(k * h for k, h in enumerate(hist)) == s["num_accepted_tokens"]
    assert s["num_draft_tokens"] == gamma * s["num_rounds"]
    # Every row commits its first token from prefill, then accepted + 1 per round, minus truncation.
    assert s["num_new_tokens"] == len(PROMPTS) + s["num_committed_tokens"]
    assert s["num_committed_tokens"] <= s["num_accepted_tokens"] + s["num_rounds"]
    truncated = s["num_accepted_tokens"] + s["num_rounds"] - s["num_committed_tokens"]
    assert truncated <= len(PROMPTS) * gamma, "only each row's last round is cut"
    per_pos = s["per_position_acceptance"]
    assert len(per_pos) == gamma and all(a >= b for a, b in zip(per_pos, per_pos[1:], strict=False))
    assert s["draft_calls"] == 1 + gamma * (s["target_calls"] - 1)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_row_does_not_depend_on_the_other_rows(tiny_target, tiny_draft, temperature):
    """Rows advance by their own accepted counts: row 0 gives the same tokens in two ragged
    batches whose other rows differ (in content and length; one batch shape, one compiled loop)."""
    kwargs = dict(draft=tiny_draft, gamma=GAMMA, max_new_tokens=MAX_NEW, temperature=temperature, seed=9)
    batched = spec_jax.generate(tiny_target, PROMPTS, **kwargs)
    other = spec_jax.generate(tiny_target, [PROMPTS[0], *OTHER_ROWS], **kwargs)
    assert other.tokens[0] == batched.tokens[0]
    assert other.tokens[1:] != batched.tokens[1:]


def acceptance_vs_alpha(target, draft, gamma):
    prompts = [[i % 60 + 1, (7 * i) % 60 + 1] for i in range(256)]
    gen = spec_jax.generate(
        target, prompts, draft=draft, gamma=gamma, max_new_tokens=24, temperature=1.0, seed=1
    )
    s = gen.stats
    measured = s["num_accepted_tokens"] / s["num_scored_positions"]
    stderr = 0.5 / np.sqrt(s["num_scored_positions"])
    return measured, s["alpha_hat"], stderr, s


@pytest.mark.parametrize("gamma", [1, 4])
def test_measured_acceptance_matches_alpha_hat(tiny_target, tiny_draft, gamma):
    """Each scored position is accepted with probability sum_x min(p, q): the two must agree."""
    measured, alpha, stderr, s = acceptance_vs_alpha(tiny_target, tiny_draft, gamma)
    assert 0.2 < alpha < 0.95
    assert abs(measured - alpha) < 4 * stderr
    if gamma == 1:
        assert s["acceptance_rate"] == measured


def test_an_always_accepting_rule_fails_the_alpha_check(tiny_target, tiny_draft, monkeypatch):
    def always_accept(drafts, q, p, key):
        return jnp.full(drafts.shape[:1], drafts.shape[1], jnp.int32), jnp.argmax(p[:, -1], -1).astype(
            jnp.int32
        )

    monkeypatch.setattr(rounds, "verify", always_accept)
    # An empty cache of compiled loops for this test only: the real rule's loops stay for the others.
    monkeypatch.setattr(executables, "_EXECUTABLES", {})
    measured, alpha, stderr, _ = acceptance_vs_alpha(tiny_target, tiny_draft, 1)
    assert abs(measured - alpha) > 4 * stderr


def test_no_retrace_for_new_prompts_in_the_same_bucket(tiny_target, tiny_draft):
    kwargs = dict(draft=tiny_draft, gamma=GAMMA, max_new_tokens=MAX_NEW, temperature=0.0)
    spec_jax.generate(tiny_target, PROMPTS, **kwargs)
    before = dict(executables.TRACE_COUNTS)
    gen = spec_jax.generate(tiny_target, [[9, 9], [8, 7, 6, 5, 4, 3, 2], [4], [1] * 16], **kwargs)
    assert dict(executables.TRACE_COUNTS) == before
    assert gen.stats["compile_seconds"] == 0.0


@pytest.mark.parametrize(
    "draft_kwargs, kwargs, message",
    [
        ({}, dict(gamma=0), "gamma must be an integer >= 1"),
        ({}, dict(gamma=-2), "gamma"),
        (dict(vocab_size=65), {}, r"draft vocabulary size \(65\) differs from the target's \(64\)"),
        # 3 + 16 + 2 > 20
        (
            dict(max_seq_len=20),
            dict(max_new_tokens=16),
            r"gamma must be in \[1, 1\] .*the draft's context of 20",
        ),
        (dict(max_seq_len=19), dict(max_new_tokens=16), r"no gamma fits: .*the draft's context of 19"),
    ],
)
def test_bad_speculative_input_gets_a_clear_error(tiny_target, draft_kwargs, kwargs, message):
    base = dict(vocab_size=64, num_layers=1, d_model=16, num_heads=2, num_kv_heads=1)
    draft = models.random_model(**{**base, **draft_kwargs})
    kwargs = {"max_new_tokens": 4, "gamma": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        spec_jax.generate(tiny_target, [[1, 2, 3]], draft=draft, **kwargs)


def test_drafter_cache_holds_the_committed_prefix_after_every_round(tiny_target, tiny_draft):
    """After any round, the draft cache up to n-2 equals a fresh prefill of the committed tokens."""
    gen = spec_jax.generate(
        tiny_target, PROMPTS, draft=tiny_draft, gamma=GAMMA, max_new_tokens=MAX_NEW, temperature=0.0
    )
    seq = PROMPTS[0] + gen.tokens[0]  # row 0 of the batch: rows do not depend on each other
    # Re-run the loop by hand for a few rounds and compare caches.
    from spec_jax.drafting.model import ModelDrafter

    drafter = ModelDrafter(tiny_draft.config)
    state, step = loop_by_hand(tiny_target, drafter, tiny_draft.params, PROMPTS[:1], GAMMA, MAX_NEW)
    for _ in range(3):
        state = step(state)
        n = int(state.length[0])
        assert seq[n - 1] == int(state.last_token[0]) and seq[n - 2] == int(state.prev_token[0])
        fresh_tokens = jnp.array([seq[: n - 2] + [0] * (32 - (n - 2))])
        fresh = apply(
            tiny_draft, fresh_tokens, jnp.arange(32)[None], models.init_cache(tiny_draft.config, 1, 32)
        ).cache
        np.testing.assert_allclose(state.draft_state.k[:, 0, : n - 2], fresh.k[:, 0, : n - 2], atol=1e-5)


def test_the_xdist_group_holds_under_make_test(request):
    """Under `make test` (-n 2, --dist=loadgroup) xdist schedules the tests of one xdist_group
    on one worker by the group suffix it puts on their node ids, so the loops compiled here are
    shared with tests/test_decode.py and the drafters' tests. pytest 9.2 with xdist 3.8 dropped
    the suffix without a word and the suite ran 10% longer (constraints.txt pins pytest 9.1.1)."""
    # In an xdist worker, "loadgroup" is the option xdist itself reads to add the suffix.
    if not hasattr(request.config, "workerinput") or not request.config.getoption("loadgroup", False):
        pytest.skip("checks `make test`'s scheduling: runs under pytest -n N --dist=loadgroup only")
    assert request.node.nodeid.endswith("@tiny_target"), request.node.nodeid


@pytest.mark.parametrize("kind", ["prompt_lookup", "suffix", "unigram", "bigram", "model"])
def test_every_drafter_bounds_gamma_by_the_context(tiny_draft, kind):
    """Drafters without a model used to take any gamma (the target's cache grew with it, past its
    context): one rule for all, prompt + max_new_tokens + gamma within the target's context."""
    target = models.random_model(
        vocab_size=64, num_layers=1, d_model=16, num_heads=2, num_kv_heads=1, max_seq_len=32
    )
    draft = drafting.build(
        kind, target, drafting.Settings(draft=tiny_draft, sequences=[[1, 2, 3, 4, 5, 6]] * 3)
    )
    limit = 32 - 3 - 4
    with pytest.raises(ValueError, match=rf"^gamma must be in \[1, {limit}\] .*the target's context of 32"):
        spec_jax.generate(target, [[1, 2, 3]], draft=draft, gamma=limit + 1, max_new_tokens=4)
