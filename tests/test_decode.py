"""The autoregressive loop and the generate API around it."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import apply

import models
import spec_jax
from spec_jax import decode, executables

# The batch, length and gamma of tests/test_speculative.py (one xdist group), so that the two
# files share their compiled loops (~10 s of CPU each).
PROMPTS = [[5, 9, 2], [1], [7, 7, 3, 8, 11, 4, 6, 2, 9, 10], [3, 3, 3, 1, 2, 60]]
MAX_NEW = 13
GAMMA = 4
pytestmark = pytest.mark.xdist_group("tiny_target")
OTHER_ROWS = [[60] * 16, [2], [8, 8, 8, 8]]  # neighbours for PROMPTS[0], longer and shorter


def greedy_reference(model, prompt, n, width=32):
    """Step-wise argmax of the full (uncached) forward pass, padded to one width so it compiles once."""
    seq = list(prompt)
    for _ in range(n):
        padded = jnp.array([seq + [0] * (width - len(seq))])
        logits = apply(
            model, padded, jnp.arange(width)[None], models.init_cache(model.config, 1, width)
        ).logits
        seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
    return seq[len(prompt) :]


def test_greedy_autoregressive_equals_stepwise_argmax_of_full_forward(tiny_target):
    gen = spec_jax.generate(tiny_target, PROMPTS, max_new_tokens=MAX_NEW, temperature=0.0)
    for prompt, tokens in zip(PROMPTS, gen.tokens, strict=True):
        assert tokens == greedy_reference(tiny_target, prompt, MAX_NEW)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_row_does_not_depend_on_the_other_rows(tiny_target, temperature):
    """Row 0 gives the same tokens beside other rows, longer and shorter ones. (Same batch shape,
    so one compiled loop; a prompt decoded alone: test_prompts_draw_from_their_row_id_...)"""
    kwargs = dict(max_new_tokens=MAX_NEW, temperature=temperature, seed=3)
    batched = spec_jax.generate(tiny_target, PROMPTS, **kwargs)
    other = spec_jax.generate(tiny_target, [PROMPTS[0], *OTHER_ROWS], **kwargs)
    assert other.tokens[0] == batched.tokens[0]
    assert other.tokens[1:] != batched.tokens[1:]


def test_rows_stop_at_their_own_eos(tiny_target):
    free = spec_jax.generate(tiny_target, PROMPTS, max_new_tokens=MAX_NEW, temperature=0.0)
    eos = free.tokens[0][3]  # row 0 emits this at step 3 (maybe earlier too)
    gen = spec_jax.generate(tiny_target, PROMPTS, max_new_tokens=MAX_NEW, temperature=0.0, eos_id=eos)
    for full, cut in zip(free.tokens, gen.tokens, strict=True):
        expected = full[: full.index(eos) + 1] if eos in full else full
        assert cut == expected
    assert len(gen.tokens[0]) <= 4


def test_sampling_is_reproducible_by_seed(tiny_target):
    a = spec_jax.generate(tiny_target, PROMPTS, max_new_tokens=MAX_NEW, temperature=1.0, seed=11)
    b = spec_jax.generate(tiny_target, PROMPTS, max_new_tokens=MAX_NEW, temperature=1.0, seed=11)
    c = spec_jax.generate(tiny_target, PROMPTS, max_new_tokens=MAX_NEW, temperature=1.0, seed=12)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens


def test_no_retrace_for_a_new_prompt_in_the_same_bucket(tiny_target):
    kwargs = dict(max_new_tokens=MAX_NEW, temperature=0.0)
    spec_jax.generate(tiny_target, PROMPTS, **kwargs)
    before = dict(executables.TRACE_COUNTS)
    gen = spec_jax.generate(tiny_target, [[9, 8, 7, 6, 5], [3], [1] * 16, [2, 2]], **kwargs)
    assert dict(executables.TRACE_COUNTS) == before
    assert gen.stats["compile_seconds"] == 0.0
    xla = tiny_target.replace(config=tiny_target.config.replace(attention_impl="xla"))  # a tight layout
    spec_jax.generate(xla, PROMPTS, **kwargs)
    before = dict(executables.TRACE_COUNTS)
    spec_jax.generate(xla, [[1] * 20, [2], [3], [4]], **kwargs)  # next bucket (no other test uses it)
    assert executables.TRACE_COUNTS["spec_loop"] == before["spec_loop"] + 1


def test_a_prompt_of_a_new_length_compiles_nothing_on_the_cpu_path(tiny_target):
    """On the CPU kernels' path (decode.coarse_layout) prompts in other 16/32 buckets reuse the
    prefill and the loop compiled for the first one. (Batch 2: no other test compiles it.)"""
    kwargs = dict(max_new_tokens=MAX_NEW, temperature=0.0)
    spec_jax.generate(tiny_target, [[5] * 3, [7]], **kwargs)
    before = dict(executables.TRACE_COUNTS)
    for n in (20, 40):
        gen = spec_jax.generate(tiny_target, [[5] * n, [7]], **kwargs)
        assert gen.stats["compile_seconds"] == 0.0
    assert dict(executables.TRACE_COUNTS) == before
    assert decode.coarse_layout(tiny_target.config)  # the path this test is about


def test_layout_is_coarse_on_the_cpu_path_and_tight_elsewhere(tiny_target):
    config = tiny_target.config.replace(max_seq_len=4096)
    n_new, gamma = 64, 4
    assert {decode.layout(config, [[1] * n, [2]], n_new, gamma) for n in (1, 17, 100, 256)} == {(256, 324)}
    assert decode.layout(config, [[1] * 257], n_new, gamma) == (512, 580)
    # a drafter that reads the prompt's features: a tight width, the coarse cache
    assert decode.layout(config, [[1] * 20], n_new, gamma, reads_features=True) == (32, 324)
    xla = config.replace(attention_impl="xla")
    assert decode.layout(xla, [[1] * 20], n_new, gamma) == (32, 32 + n_new + gamma)
    # capped so that the cache fits the context
    assert decode.layout(config.replace(max_seq_len=64), [[1] * 3], 13, gamma) == (51, 51 + 13 + gamma)


def test_bucket_lengths_are_powers_of_two():
    assert [decode.bucket_length(n) for n in (1, 16, 17, 100, 128, 129)] == [16, 16, 32, 128, 128, 256]


def test_stats_report_timings_and_counts(tiny_target):
    gen = spec_jax.generate(tiny_target, PROMPTS, max_new_tokens=MAX_NEW, temperature=0.0)
    assert gen.stats["num_new_tokens"] == len(PROMPTS) * MAX_NEW
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
        ([[1, 2]], dict(eos_id=2.7), "eos_id must be None or integer token ids"),
        ([[1, 2]], dict(eos_id=[3, 2.0]), "eos_id"),
        ([[1, 2]], dict(eos_id=True), "eos_id"),
        ([[1, 2]], dict(temperature=float("inf")), "temperature"),
        ([[1, 2]], dict(row_ids=[0, 1]), "row_ids"),
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
    out, counts = decode.commit(out, new, jnp.array([3, 3, 2]), 5, jnp.asarray([9]))
    np.testing.assert_array_equal(counts, [3, 2, 2])  # row 1 stops after EOS, row 2 asked for 2
    np.testing.assert_array_equal(out.done, [False, True, False])
    out, counts = decode.commit(out, new, jnp.array([3, 3, 3]), 5, jnp.asarray([-1]))
    np.testing.assert_array_equal(counts, [2, 0, 3])  # row 0 hits max_new_tokens, row 1 is done
    np.testing.assert_array_equal(out.done, [True, True, True])
    np.testing.assert_array_equal(out.tokens[0, :5], [1, 2, 3, 1, 2])


# 1e-9 overflowed before the fix; 1e-45 is subnormal (the make test case)
@pytest.mark.parametrize("temperature", [pytest.param(1e-9, marks=pytest.mark.slow), 1e-45])
def test_a_tiny_positive_temperature_decodes_the_greedy_tokens(tiny_target, tiny_draft, temperature):
    """Autoregressive and speculative: temperature 1e-9 used to give [24, 0, 57, ...] (NaN rows)."""
    kwargs = dict(max_new_tokens=MAX_NEW, seed=1)
    greedy = spec_jax.generate(tiny_target, PROMPTS, temperature=0.0, **kwargs).tokens
    ar = spec_jax.generate(tiny_target, PROMPTS, temperature=temperature, **kwargs)
    spec = spec_jax.generate(
        tiny_target, PROMPTS, draft=tiny_draft, gamma=GAMMA, temperature=temperature, **kwargs
    )
    assert ar.tokens == greedy
    assert spec.tokens == greedy


@pytest.mark.parametrize("draft", [False, True])
def test_a_row_stops_at_any_token_of_its_stop_set(tiny_target, tiny_draft, draft):
    """Two end tokens: a row that emits the second one (before the first) stops there, in the
    autoregressive and the speculative loop alike, and both give the same tokens."""
    free = spec_jax.generate(tiny_target, PROMPTS, max_new_tokens=MAX_NEW, temperature=0.0).tokens
    second_end = free[0][2]  # row 0 emits it at step 2, before it emits first_end
    first_end = next(t for t in free[0][3:] if t not in free[0][:3])
    kwargs = dict(max_new_tokens=MAX_NEW, temperature=0.0, eos_id=[first_end, second_end])
    ar = spec_jax.generate(tiny_target, PROMPTS, **kwargs).tokens
    got = (
        spec_jax.generate(tiny_target, PROMPTS, draft=tiny_draft, gamma=GAMMA, **kwargs).tokens
        if draft
        else ar
    )
    for full, cut in zip(free, got, strict=True):
        stops = [i for i, t in enumerate(full) if t in (first_end, second_end)]
        assert cut == (full[: stops[0] + 1] if stops else full)
    assert got[0][-1] == second_end and len(got[0]) <= 3
    assert got == ar


def test_prompts_draw_from_their_row_id_not_their_place_in_the_batch(tiny_target):
    """row_ids name each prompt's randomness: prompt 2 decoded alone with row_id 2 samples what it
    samples as the third row of the batch."""
    kwargs = dict(max_new_tokens=MAX_NEW, temperature=1.0, seed=4)
    batched = spec_jax.generate(tiny_target, PROMPTS, **kwargs).tokens
    alone = spec_jax.generate(tiny_target, PROMPTS[2:3], row_ids=[2], **kwargs).tokens
    assert alone[0] == batched[2]
    repeated = spec_jax.generate(tiny_target, [PROMPTS[0]] * len(PROMPTS), **kwargs).tokens
    assert repeated[0] != repeated[1], "the same prompt in two rows gets two different samples"
