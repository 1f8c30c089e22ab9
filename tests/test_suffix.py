"""Suffix drafting (spec_jax.drafting.suffix): the hashed n-gram table against counting by hand, the
row's own counts, the drafts and their q, and greedy identity to autoregressive decoding."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_speculative import MAX_NEW, PROMPTS

import spec_jax
from spec_jax import drafting
from spec_jax.drafting import suffix, suffix_table
from spec_jax.sampling import SamplingParams

GAMMA = 4


def by_hand(seqs, max_ngram):
    """{context tuple: Counter of the next token} over every n-gram, n = 1 .. max_ngram."""
    counts = collections.defaultdict(collections.Counter)
    for s in seqs:
        for n in range(1, max_ngram + 1):
            for i in range(n, len(s)):
                counts[tuple(s[i - n : i])][s[i]] += 1
    return counts


def corpus_lookup(tables, context, max_ngram):
    buffer = jnp.asarray([list(context) + [0] * 3], jnp.int32)  # garbage past the length
    ngram, ids, counts = suffix_table.corpus_counts(tables, buffer, jnp.asarray([len(context)]), max_ngram)
    return int(ngram[0]), [(int(i), int(c)) for i, c in zip(ids[0], counts[0], strict=True) if c > 0]


def random_sequences(seed, vocab=6, num=30):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=rng.integers(1, 40)).tolist() for _ in range(num)]


def test_the_table_holds_each_frequent_ngrams_top_successors_exactly():
    seqs = random_sequences(0)
    tables = suffix_table.fit_suffix_tables(seqs, 6, 3, slots=3, min_count=2, num_buckets=2**16)
    checked = 0
    for context, nxt in by_hand(seqs, 3).items():
        ngram, got = corpus_lookup(tables, context, len(context))
        if sum(nxt.values()) < 2:  # below min_count: not kept, so a shorter suffix (or none) matches
            assert ngram < len(context)
            continue
        expected = sorted(nxt.items(), key=lambda kv: (-kv[1], kv[0]))[:3]
        assert (ngram, got) == (len(context), expected), context
        checked += 1
    assert checked > 100


def test_where_ngrams_share_a_bucket_the_most_frequent_keeps_it_and_others_never_match_wrongly():
    seqs = random_sequences(1)
    tables = suffix_table.fit_suffix_tables(seqs, 6, 2, slots=2, min_count=1, num_buckets=4)
    counts = by_hand(seqs, 2)
    assert int(np.sum(np.asarray(tables.next_counts)[:, 0] > 0)) == 4, "every bucket is taken"
    for context in counts:
        ngram, got = corpus_lookup(tables, context, len(context))
        if ngram:  # whatever matched is the true successor list of the suffix that matched
            suffix_ctx = context[len(context) - ngram :]
            expected = sorted(counts[suffix_ctx].items(), key=lambda kv: (-kv[1], kv[0]))[:2]
            assert got == expected
    totals = {c: sum(n.values()) for c, n in counts.items()}
    top = max(totals, key=lambda c: (totals[c], -len(c)))
    assert corpus_lookup(tables, top, len(top))[0] == len(top), "the most frequent n-gram kept its bucket"


def test_the_rows_own_counts_follow_every_earlier_occurrence_of_the_longest_suffix():
    rows = [[1, 2, 3, 1, 2, 4, 1, 2, 9, 9], [5, 6, 5, 6, 5, 7, 7, 7, 7, 7], [3, 1, 4, 1, 5, 9, 2, 6, 8, 8]]
    lengths = [8, 5, 6]  # tokens past a row's length are garbage and never read
    ngram, counts = jax.jit(suffix.own_counts, static_argnums=(2, 3))(
        jnp.asarray(rows, jnp.int32), jnp.asarray(lengths), 3, 10
    )
    assert np.asarray(ngram).tolist() == [2, 3, 0]  # "1 2": twice before; "5 6 5": once; "9": never
    expected = np.zeros((3, 10))
    expected[0, [3, 4]] = 1  # "1 2" was followed by 3, then 4
    expected[1, 6] = 1  # "5 6 5" was followed by 6
    np.testing.assert_array_equal(np.asarray(counts), expected)


def test_greedy_drafts_follow_the_most_frequent_successor_and_stop_where_nothing_matches():
    drafter = suffix.SuffixDrafter(10, max_ngram=2)
    prompts = jnp.asarray([[1, 2, 3, 1, 2, 4, 1, 2, 3, 1], [7, 8, 0, 0, 0, 0, 0, 0, 0, 0]])
    buffer = drafter.init(None, prompts, None, 16)
    length = jnp.asarray([10, 2])
    context = jnp.asarray([[3, 1], [7, 8]])
    keys = jax.random.split(jax.random.key(0), 2)
    tokens, q, _ = drafter.propose((), buffer, context, length, 3, SamplingParams(0.0), keys)
    # row 0: "3 1" -> 2, then "1 2" -> 3 (twice, over 4 once), then "2 3" -> 1 (twice)
    assert np.asarray(tokens[0]).tolist() == [2, 3, 1]
    np.testing.assert_array_equal(np.asarray(q[0]), np.eye(10)[[2, 3, 1]])
    assert float(jnp.sum(q[1])) == 0.0, "row 1 has no earlier occurrence: it proposes nothing"


def test_at_temperature_one_q_is_the_empirical_frequencies_and_the_threshold_stops_a_row():
    drafter = suffix.SuffixDrafter(10, max_ngram=1, threshold=0.65)
    prompt = jnp.asarray([[5, 1, 5, 1, 5, 1, 5, 2, 5, 3, 5]])  # after 5: 1 three times, 2 once, 3 once
    buffer = drafter.init(None, prompt, None, 16)
    keys = jax.random.split(jax.random.key(0), 1)
    _, q, _ = drafter.propose((), buffer, prompt[:, -2:], jnp.asarray([11]), 2, SamplingParams(1.0), keys)
    assert float(jnp.sum(q)) == 0.0, "the top frequency 3/5 is below 0.65: the row proposes nothing"
    relaxed = suffix.SuffixDrafter(10, max_ngram=1, threshold=0.5)
    _, q, _ = relaxed.propose((), buffer, prompt[:, -2:], jnp.asarray([11]), 1, SamplingParams(1.0), keys)
    np.testing.assert_allclose(np.asarray(q[0, 0])[[1, 2, 3]], [0.6, 0.2, 0.2], rtol=1e-6)


def test_bad_settings_are_refused(tiny_target):
    with pytest.raises(ValueError, match="max_ngram must be an integer in"):
        suffix.SuffixDrafter(64, max_ngram=0)
    with pytest.raises(ValueError, match="num_buckets must be a power of two"):
        suffix_table.fit_suffix_tables([[1, 2, 3]], 64, 2, num_buckets=3)
    with pytest.raises(ValueError, match="token ids in"):
        suffix_table.fit_suffix_tables([[1, 2, 64]], 64, 2)
    with pytest.raises(ValueError, match="tables must be"):
        drafting.build("suffix", tiny_target, drafting.Settings(tables={"keys": 1}))


pytestmark = pytest.mark.xdist_group("tiny_target")


@pytest.fixture(scope="module")
def greedy_ar(tiny_target):
    return spec_jax.generate(tiny_target, PROMPTS, max_new_tokens=MAX_NEW, temperature=0.0).tokens


@pytest.mark.parametrize("with_tables, threshold", [(False, 0.0), (True, 0.5)])
def test_greedy_output_equals_autoregressive_on_a_ragged_batch(
    tiny_target, greedy_ar, with_tables, threshold
):
    # a session's earlier outputs: the same prompts decoded before, one token shifted
    earlier = [p + out[:-1] for p, out in zip(PROMPTS, greedy_ar, strict=True)]
    tables = suffix_table.fit_suffix_tables(earlier, 64, 3, min_count=1) if with_tables else None
    draft = drafting.build(
        "suffix", tiny_target, drafting.Settings(max_ngram=3, threshold=threshold, tables=tables)
    )
    gen = spec_jax.generate(
        tiny_target, PROMPTS, draft=draft, gamma=GAMMA, max_new_tokens=MAX_NEW, temperature=0.0
    )
    assert gen.tokens == greedy_ar
    s = gen.stats
    assert 0 < s["num_draft_tokens"] < GAMMA * s["num_rounds"], "rows draft fewer than gamma in some rounds"
    if with_tables:
        assert s["acceptance_rate"] > 0.5, "the earlier outputs predict this session's"
