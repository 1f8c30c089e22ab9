"""The autoregressive loop and the generate API around it."""

import jax.numpy as jnp
import numpy as np
import pytest

import models
import spec_jax
from spec_jax import decode

PROMPTS = [[5, 9, 2], [1], [7, 7, 3, 8, 11, 4, 6, 2, 9, 10]]


def greedy_reference(model, prompt, n, width=32):
    """Step-wise argmax of the full (uncached) forward pass, padded to one width so it compiles once."""
    seq = list(prompt)
    for _ in range(n):
        padded = jnp.array([seq + [0] * (width - len(seq))])
        logits, _ = model.apply(
            model.params, padded, jnp.arange(width)[None], models.init_cache(model.config, 1, width)
        )
        seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
    return seq[len(prompt) :]


def test_greedy_autoregressive_equals_stepwise_argmax_of_full_forward(tiny_target):
    gen = spec_jax.generate(tiny_target, PROMPTS, max_new_tokens=9, temperature=0.0)
    for prompt, tokens in zip(PROMPTS, gen.tokens, strict=True):
        assert tokens == greedy_reference(tiny_target, prompt, 9)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_row_does_not_depend_on_the_other_rows(tiny_target, temperature):
    """Row 0 decoded alone and batched with longer/shorter rows gives the same tokens."""
    alone = spec_jax.generate(tiny_target, PROMPTS[:1], max_new_tokens=12, temperature=temperature, seed=3)
    batched = spec_jax.generate(tiny_target, PROMPTS, max_new_tokens=12, temperature=temperature, seed=3)
    assert batched.tokens[0] == alone.tokens[0]


def test_rows_stop_at_their_own_eos(tiny_target):
    free = spec_jax.generate(tiny_target, PROMPTS, max_new_tokens=12, temperature=0.0)
    eos = free.tokens[0][3]  # row 0 emits this at step 3 (maybe earlier too)
    gen = spec_jax.generate(tiny_target, PROMPTS, max_new_tokens=12, temperature=0.0, eos_id=eos)
    for full, cut in zip(free.tokens, gen.tokens, strict=True):
        expected = full[: full.index(eos) + 1] if eos in full else full
        assert cut == expected
    assert len(gen.tokens[0]) <= 4


def test_sampling_is_reproducible_by_seed(tiny_target):
    a = spec_jax.generate(tiny_target, PROMPTS, max_new_tokens=10, temperature=1.0, seed=11)
    b = spec_jax.generate(tiny_target, PROMPTS, max_new_tokens=10, temperature=1.0, seed=11)
    c = spec_jax.generate(tiny_target, PROMPTS, max_new_tokens=10, temperature=1.0, seed=12)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens


def test_no_retrace_for_a_new_prompt_in_the_same_bucket(tiny_target):
    spec_jax.generate(tiny_target, [[1, 2, 3], [4, 5]], max_new_tokens=6, temperature=0.0)
    before = dict(decode.TRACE_COUNTS)
    gen = spec_jax.generate(tiny_target, [[9, 8, 7, 6, 5], [3]], max_new_tokens=6, temperature=0.0)
    assert dict(decode.TRACE_COUNTS) == before
    assert gen.stats["compile_seconds"] == 0.0
    spec_jax.generate(tiny_target, [[1] * 20, [2]], max_new_tokens=6, temperature=0.0)  # next bucket
    assert decode.TRACE_COUNTS["ar_loop"] == before["ar_loop"] + 1


def test_bucket_lengths_are_powers_of_two():
    assert [decode.bucket_length(n) for n in (1, 16, 17, 100, 128, 129)] == [16, 16, 32, 128, 128, 256]


def test_stats_report_timings_and_counts(tiny_target):
    gen = spec_jax.generate(tiny_target, PROMPTS, max_new_tokens=5, temperature=0.0)
    assert gen.stats["num_new_tokens"] == 15
    assert gen.stats["tokens_per_second"] > 0
    for key in ("compile_seconds", "prefill_seconds", "decode_seconds"):
        assert gen.stats[key] >= 0


@pytest.mark.parametrize(
    "prompts, kwargs, message",
    [
        ([], {}, "prompts"),
        ([[1, 2], []], {}, r"prompts\[1\] is empty"),
        ([[1, 2]], dict(max_new_tokens=0), "max_new_tokens"),
        ([[1, 2]], dict(max_new_tokens=-3), "max_new_tokens"),
        ([[1] * 60], dict(max_new_tokens=10), "context of 64"),
        ([[1, 2]], dict(temperature=-1.0), "temperature"),
        ([[1, 2]], dict(top_p=0.0), "top_p"),
        ([[1, 2]], dict(top_p=1.01), "top_p"),
        ([[1, 2]], dict(top_k=-2), "top_k"),
        ([[1, 64]], {}, r"outside the vocabulary \[0, 64\)"),
        ([[-1, 2]], {}, "outside the vocabulary"),
        ([[1, 2]], dict(eos_id=99), "eos_id"),
    ],
)
def test_bad_input_gets_a_clear_error_naming_the_argument(prompts, kwargs, message):
    model = models.random_model(
        vocab_size=64, num_layers=1, d_model=16, num_heads=2, num_kv_heads=1, max_seq_len=64
    )
    kwargs = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        spec_jax.generate(model, prompts, **kwargs)


def test_commit_stops_rows_at_eos_and_max_tokens():
    out = decode.new_output(3, 5, 4)
    new = jnp.array([[1, 2, 3], [4, 9, 6], [7, 8, 9]])
    out, counts = decode.commit(out, new, jnp.array([3, 3, 2]), 5, jnp.asarray(9))
    np.testing.assert_array_equal(counts, [3, 2, 2])  # row 1 stops after EOS, row 2 asked for 2
    np.testing.assert_array_equal(out.done, [False, True, False])
    out, counts = decode.commit(out, new, jnp.array([3, 3, 3]), 5, jnp.asarray(-1))
    np.testing.assert_array_equal(counts, [2, 0, 3])  # row 0 hits max_new_tokens, row 1 is done
    np.testing.assert_array_equal(out.done, [True, True, True])
    np.testing.assert_array_equal(out.tokens[0, :5], [1, 2, 3, 1, 2])
