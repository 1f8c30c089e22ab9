"""The n-gram drafters: fitted tables, what they propose, and exactness inside the sampler."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import models
import spec_jax
from experiments import per_prompt
from spec_jax.drafting import ngram
from spec_jax.sampling import SamplingParams, row_keys

PROMPTS = [[5, 9, 2], [1], [7, 7, 3, 8, 11, 4, 6, 2, 9, 10], [3, 3, 3, 1, 2, 60]]
MAX_NEW = 13


def skewed_sequences(vocab, seed=0, n=3, length=400):
    """Random token sequences with uneven frequencies and repeated pairs (so counts tie)."""
    rng = np.random.default_rng(seed)
    return [np.minimum(rng.integers(0, vocab, length), rng.integers(0, vocab, length)) for _ in range(n)]


def brute_force_bigram(sequences, vocab, add_k, prior):
    """[V, V] float64 from the definition, by loops over the text."""
    counts = np.zeros((vocab, vocab))
    uni = np.zeros(vocab)
    for s in sequences:
        for a, b in zip(s[:-1], s[1:], strict=True):
            counts[a, b] += 1
        for a in s:
            uni[a] += 1
    u = (uni + add_k) / (uni.sum() + add_k * vocab)
    return (counts + prior * u) / (counts.sum(1, keepdims=True) + prior), u


def test_bigram_tables_equal_the_smoothed_counts_and_rows_sum_to_one():
    vocab, seqs = 24, skewed_sequences(24)
    drafter, tables = ngram.fit_bigram(seqs, vocab, add_k=0.5, prior=2.0)
    expected, u = brute_force_bigram(seqs, vocab, 0.5, 2.0)
    rows = np.asarray(jax.jit(drafter.probs)(tables, jnp.arange(vocab)))  # [V, V], in JAX
    np.testing.assert_allclose(rows, expected, rtol=1e-5)
    np.testing.assert_allclose(rows.sum(1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(ngram.dense_bigram(tables, range(vocab)), expected, rtol=1e-6)
    _, uni = ngram.fit_unigram(seqs, vocab, add_k=0.5)
    np.testing.assert_allclose(np.exp(np.asarray(uni.log_probs)), u, rtol=1e-5)
    # A context never seen backs off to the unigram exactly; bigrams never cross sequences.
    drafter, tables = ngram.fit_bigram([[1, 2, 3], [7, 1, 2]], 10, add_k=1.0, prior=1.0)
    np.testing.assert_allclose(
        ngram.dense_bigram(tables, [9])[0], (np.bincount([1, 2, 3, 7, 1, 2], minlength=10) + 1) / 16
    )
    contexts, nexts, counts = ngram.bigram_counts([[1, 2, 3], [7, 1, 2]], 10)
    assert list(zip(contexts, nexts, counts, strict=True)) == [(1, 2, 2), (2, 3, 1), (7, 1, 1)]


def test_propose_returns_the_table_rows_it_drew_from():
    """q[b, 0] = p(. | last committed token), q[b, i] = p(. | draft i - 1), warped; tokens follow q."""
    vocab = 24
    drafter, tables = ngram.fit_bigram(skewed_sequences(vocab), vocab)
    context = jnp.array([[0, 3], [5, 7], [1, 1]])
    length = jnp.array([4, 4, 4])
    propose = jax.jit(drafter.propose, static_argnums=(4, 5))
    tokens, q, state = propose(
        tables,
        (),
        context,
        length,
        3,
        SamplingParams(1.0),
        row_keys(jax.random.key(0), jnp.arange(context.shape[0])),
    )
    assert tokens.shape == (3, 3) and tokens.dtype == jnp.int32 and q.shape == (3, 3, vocab) and state == ()
    contexts = np.concatenate([np.asarray(context[:, 1:]), np.asarray(tokens[:, :-1])], axis=1)  # [B, G]
    for b in range(3):
        np.testing.assert_allclose(np.asarray(q[b]), ngram.dense_bigram(tables, contexts[b]), rtol=1e-5)
    tokens0, q0, _ = propose(
        tables,
        (),
        context,
        length,
        3,
        SamplingParams(0.0),
        row_keys(jax.random.key(0), jnp.arange(context.shape[0])),
    )
    dense = ngram.dense_bigram(tables, range(vocab))
    for b in range(3):
        c = int(context[b, 1])
        for i in range(3):
            assert int(tokens0[b, i]) == dense[c].argmax()  # greedy follows the most likely successor
            assert np.asarray(q0[b, i]).tolist() == np.eye(vocab)[dense[c].argmax()].tolist()
            c = int(tokens0[b, i])
    unigram, uni = ngram.fit_unigram(skewed_sequences(vocab), vocab)
    tokens, q, _ = jax.jit(unigram.propose, static_argnums=(4, 5))(
        uni, (), context, length, 2, SamplingParams(1.0), row_keys(jax.random.key(1), jnp.arange(3))
    )
    np.testing.assert_allclose(
        np.asarray(q), np.broadcast_to(np.exp(uni.log_probs), (3, 2, vocab)), rtol=1e-5
    )


def chi2_pvalue(counts, probs):
    """Chi-square of counts against probs, pooling the cells expected below 5 counts."""
    expected = probs / probs.sum() * counts.sum()
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    return stats.chisquare(obs, exp).pvalue


def test_bigram_drafts_are_distributed_as_the_q_it_returns():
    """Chi-square over many rows: draft 0 follows p(. | c), draft 1 follows p(. | draft 0)."""
    vocab, rows = 24, 6000
    drafter, tables = ngram.fit_bigram(skewed_sequences(vocab, seed=3), vocab)
    context = jnp.tile(jnp.array([[0, 5]]), (rows, 1))
    tokens, q, _ = jax.jit(drafter.propose, static_argnums=(4, 5))(
        tables,
        (),
        context,
        jnp.full((rows,), 4),
        2,
        SamplingParams(1.0),
        row_keys(jax.random.key(2), jnp.arange(rows)),
    )
    tokens, q = np.asarray(tokens), np.asarray(q, np.float64)
    first = np.bincount(tokens[:, 0], minlength=vocab)
    assert chi2_pvalue(first, q[0, 0]) > 1e-3
    mode = first.argmax()
    second = np.bincount(tokens[tokens[:, 0] == mode, 1], minlength=vocab)
    row = ngram.dense_bigram(tables, [mode])[0]
    assert chi2_pvalue(second, row) > 1e-3


def cycle_following_target(vocab: int) -> models.Model:
    """A target whose next token is always (token + 1) % vocab: every block's output is zeroed,
    the embedding is one-hot and the head maps token t to t + 1."""
    model = models.random_model(vocab_size=vocab, num_layers=1, d_model=vocab, num_heads=2, num_kv_heads=1)
    eye = np.eye(vocab, dtype=np.float32)

    def edit(path, x):
        name = jax.tree_util.keystr(path)
        if "wo" in name or "w_down" in name:
            return jnp.zeros_like(x)
        if "lm_head" in name:
            return jnp.asarray(20.0 * np.roll(eye, 1, axis=0))  # row v reads feature v - 1
        if "embed" in name:
            return jnp.asarray(eye)
        return x

    return model.replace(params=jax.tree_util.tree_map_with_path(edit, model.params))


def test_bigram_fitted_on_a_cycle_drafts_it_and_a_cycle_target_accepts_every_draft():
    vocab, gamma = 16, 3
    target = cycle_following_target(vocab)
    draft = ngram.fit_bigram([np.arange(200) % vocab], vocab)
    prompts = [[3, 4], [10], [15, 0, 1]]
    gen = spec_jax.generate(target, prompts, draft=draft, gamma=gamma, max_new_tokens=9, temperature=0.0)
    for prompt, tokens in zip(prompts, gen.tokens, strict=True):
        assert tokens == [(prompt[-1] + 1 + i) % vocab for i in range(9)]
    assert gen.stats["acceptance_rate"] == 1.0 and gen.stats["alpha_hat"] == 1.0
    assert gen.stats["mean_accepted_length"] == gamma + 1


@pytest.mark.xdist_group("tiny_target")  # shares the greedy loop of tests/test_decode.py
def test_greedy_speculative_with_a_bigram_draft_equals_autoregressive_also_per_prompt(tiny_target):
    """Through spec_jax.generate, and through experiments.per_prompt (the same loop, one row per
    prompt under vmap): tokens equal greedy decoding, and the per-prompt metrics add up to the
    batched run's."""
    ar = spec_jax.generate(tiny_target, PROMPTS, max_new_tokens=MAX_NEW, temperature=0.0).tokens
    # A bigram fitted partly on the target's own greedy output is often right, so rounds accept partly.
    own = [p + t for p, t in zip(PROMPTS, ar, strict=True)]
    draft = ngram.fit_bigram(skewed_sequences(64, seed=1) + own * 5, 64)
    kwargs = dict(gamma=3, max_new_tokens=MAX_NEW, temperature=0.0)
    gen = spec_jax.generate(tiny_target, PROMPTS, draft=draft, **kwargs)
    assert gen.tokens == ar
    hist = gen.stats["accepted_histogram"]
    assert hist[0] > 0 and sum(hist[1:]) > 0, "the draft should be partly right, partly wrong"
    tokens, rows, _ = per_prompt.run(tiny_target, draft, PROMPTS, **kwargs)
    assert tokens == ar
    for key in ("num_rounds", "num_accepted_tokens", "num_scored_positions", "num_draft_tokens"):
        assert sum(r[key] for r in rows) == gen.stats[key], key
    assert [r["num_scored_positions"] for r in rows] != [rows[0]["num_scored_positions"]] * len(rows)


@pytest.mark.parametrize(
    "draft, message",
    [
        (
            ngram.fit_unigram([[1, 2, 3]], 65),
            r"draft vocabulary size \(65\) differs from the target's \(64\)",
        ),
        (ngram.fit_bigram([[1, 2, 3]], 63), r"draft vocabulary size \(63\) differs"),
        ("bigram", "draft must be None, a models.Model or a"),
    ],
)
def test_mismatched_or_unknown_drafts_are_refused(tiny_target, draft, message):
    with pytest.raises(ValueError, match=message):
        spec_jax.generate(tiny_target, [[1, 2, 3]], draft=draft, gamma=2, max_new_tokens=4)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(sequences=[[1, 2, 99]]), r"outside \[0, 10\)"),
        (dict(sequences=[[1], [2]]), "no bigrams"),
        (dict(sequences=[[]]), "no tokens"),
        (dict(sequences=[[1, 2]], add_k=0.0), "add_k must be > 0"),
        (dict(sequences=[[1, 2]], prior=-1.0), "prior must be > 0"),
    ],
)
def test_bad_fitting_input_gets_a_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ngram.fit_bigram(vocab_size=10, **kwargs)
