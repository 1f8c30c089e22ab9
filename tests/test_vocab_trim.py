"""VocabTrim: the token set, the trimmed head, greedy exactness (the distribution test is in
tests/test_distribution.py)."""

import jax
import numpy as np
import pytest
from conftest import perturbed

import models
import spec_jax
from spec_jax.drafting import model as drafters
from spec_jax.drafting import ngram

PROMPTS = [[5, 9, 2], [1], [7, 7, 3, 8, 11, 4, 6, 2, 9, 10]]


def test_most_frequent_takes_the_top_counts_ties_by_id_and_always_the_stop_tokens():
    seqs = [[3, 3, 3, 1, 1, 2, 2, 7], [3, 5]]
    assert ngram.most_frequent(seqs, 10, 3).tolist() == [1, 2, 3]  # 3 x4, then 1 and 2 (x2)
    assert ngram.most_frequent(seqs, 10, 3, always=[9]).tolist() == [1, 3, 9]
    assert ngram.most_frequent(seqs, 10, 10).tolist() == list(range(10))
    with pytest.raises(ValueError, match=r"count must be an integer in \[1, 10\]"):
        ngram.most_frequent(seqs, 10, 11)
    with pytest.raises(ValueError, match="always"):
        ngram.most_frequent(seqs, 10, 1, always=[1, 2])


@pytest.fixture(scope="module")
def pair():
    target = models.random_model(vocab_size=64, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, seed=0)
    return target, perturbed(target, 0.1, seed=7)


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_the_trimmed_head_is_the_full_heads_rows(pair, dtype):
    draft = pair[1] if dtype == "float32" else models.cast(pair[1], dtype)
    ids = [40, 3, 17]
    drafter, params = drafters.trim_vocabulary(draft, ids)
    assert drafter.trimmed and params.head.ids.tolist() == [3, 17, 40]
    full = models.transformer.output_head(draft.config, draft.params)
    for got, want in zip(jax.tree.leaves(params.head.weight), jax.tree.leaves(full), strict=True):
        np.testing.assert_array_equal(got, np.asarray(want)[[3, 17, 40]])


def test_trim_vocabulary_refuses_bad_ids(pair):
    for bad in ([], [1, 1], [64], [-1]):
        with pytest.raises(ValueError, match="token_ids"):
            drafters.trim_vocabulary(pair[1], bad)


def test_greedy_speculative_with_a_trimmed_draft_equals_autoregressive(pair):
    target, draft = pair
    kw = dict(max_new_tokens=13, temperature=0.0)
    ar = spec_jax.generate(target, PROMPTS, **kw)
    ids = ngram.most_frequent(ar.tokens, 64, 24)  # most of what the target says, not all
    spec = spec_jax.generate(target, PROMPTS, draft=drafters.trim_vocabulary(draft, ids), gamma=3, **kw)
    assert spec.tokens == ar.tokens
    assert 0 < spec.stats["num_accepted_tokens"] < spec.stats["num_draft_tokens"]
