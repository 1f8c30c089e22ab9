"""Non-finite numbers: a row whose target logits become NaN stops there and is flagged; the other
rows are untouched; a NaN draft is only ever rejected."""

import jax
import jax.numpy as jnp
import pytest

import spec_jax
from spec_jax import metrics

PROMPTS = [[5, 9, 2], [7, 3, 8, 11, 4]]
MAX_NEW = 8
GAMMA = 3
pytestmark = pytest.mark.xdist_group("tiny_target")


def poisoned(model, token: int):
    """The model with a NaN embedding row for `token`: the logits go NaN from the position that
    reads it on."""
    params = dict(model.params)
    params["embed"] = {"embedding": model.params["embed"]["embedding"].at[token].set(jnp.nan)}
    return model.replace(params=params)


def run(target, draft, temperature, **kwargs):
    gamma = GAMMA if draft is not None else 4
    return spec_jax.generate(
        target,
        PROMPTS,
        draft=draft,
        gamma=gamma,
        max_new_tokens=MAX_NEW,
        temperature=temperature,
        seed=5,
        **kwargs,
    )


def token_only_row_1_reads(clean) -> tuple[int, int]:
    """(token, k): row 1's k-th generated token (k >= 1), read by nothing of row 0 and nothing
    before it in row 1: poisoning it makes row 1's logits NaN from the step after it on, and
    row 0's never."""
    seen = set(PROMPTS[0] + PROMPTS[1] + clean.tokens[0])
    for k, token in enumerate(clean.tokens[1][: MAX_NEW - 1]):
        if token not in seen and k >= 1:
            return token, k
        seen.add(token)
    raise AssertionError("pick other prompts: row 1 generates no token that row 0 never reads")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_a_row_whose_logits_turn_nan_mid_decode_stops_flagged_and_the_other_row_is_unchanged(
    tiny_target, tiny_draft, temperature, speculative
):
    draft = tiny_draft if speculative else None
    clean = run(tiny_target, draft, temperature)
    assert clean.stats["nonfinite_logits"] == [False, False] and clean.nonfinite_rows == []
    token, k = token_only_row_1_reads(clean)
    bad = run(poisoned(tiny_target, token), draft, temperature)
    assert bad.nonfinite_rows == [1]
    assert bad.stats["nonfinite_logits"] == [False, True]
    assert bad.tokens[0] == clean.tokens[0]
    # Row 1 keeps what it drew from finite logits (the poisoned token included) and nothing more.
    assert bad.tokens[1] == clean.tokens[1][: k + 1]
    assert bad.stats["num_new_tokens"] == len(clean.tokens[0]) + k + 1


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_a_prompt_that_makes_the_first_logits_nan_gives_no_tokens(tiny_target, tiny_draft, speculative):
    draft = tiny_draft if speculative else None
    clean = run(tiny_target, draft, 0.0)
    bad = run(poisoned(tiny_target, PROMPTS[1][1]), draft, 0.0)  # read by row 1's prompt only
    assert bad.nonfinite_rows == [1]
    assert bad.tokens == [clean.tokens[0], []]


def test_a_nan_row_counts_no_rounds(tiny_target):
    """Plain decoding: every round of a live row commits one token; row 1 stops at prefill, so
    the rounds are row 0's alone."""
    bad = run(poisoned(tiny_target, PROMPTS[1][1]), None, 0.0)
    assert bad.stats["num_rounds"] == MAX_NEW - 1 and bad.stats["num_committed_tokens"] == MAX_NEW - 1


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_nan_draft_is_always_rejected_and_the_output_stays_exact(tiny_target, temperature):
    """A draft whose every distribution is NaN: no draft is accepted (greedy proposes argmax NaN;
    sampling's NaN rows count as proposing nothing), every round commits the target's own token,
    the target's rows are not flagged, and greedy output equals plain decoding."""
    nan_draft = tiny_target.replace(
        params=jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), tiny_target.params)
    )
    spec = run(tiny_target, nan_draft, temperature)
    assert spec.stats["num_accepted_tokens"] == 0
    assert spec.stats["num_draft_tokens"] > 0 or temperature > 0
    assert spec.nonfinite_rows == []
    assert [len(t) for t in spec.tokens] == [MAX_NEW, MAX_NEW]
    if temperature == 0.0:
        assert spec.tokens == run(tiny_target, None, 0.0).tokens


def test_pool_concatenates_the_per_row_flags_in_order():
    a = {"num_rounds": 1, "nonfinite_logits": [False, True]}
    b = {"num_rounds": 2, "nonfinite_logits": [True]}
    pooled = metrics.pool([a, b])
    assert pooled["nonfinite_logits"] == [False, True, True]
    assert metrics.nonfinite_rows(pooled) == [1, 2]
