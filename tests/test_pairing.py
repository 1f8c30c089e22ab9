"""Draft/target pairing: a draft whose vocabulary is a prefix of the target's drafts with q
padded by zeros (exact); any other vocabulary is refused in one line naming the token."""

import pytest

import models
import spec_jax
from models.tokenizer import Tokenizer, build_tokenizer

TARGET_VOCAB, DRAFT_VOCAB = 72, 64
SIZES = dict(num_layers=1, d_model=16, num_heads=2, num_kv_heads=1)


def tokenizer(tokens):
    return Tokenizer(build_tokenizer(tokens, [], None, "gpt2"), bos_id=None, eos_id=None)


def token_strings(n):
    return [f"t{i}" for i in range(n)]


def with_tokens(vocab, tokens, seed):
    return models.random_model(vocab_size=vocab, seed=seed, **SIZES).replace(tokenizer=tokenizer(tokens))


def test_a_prefix_vocabulary_draft_decodes_greedily_like_the_target_alone():
    target = with_tokens(TARGET_VOCAB, token_strings(TARGET_VOCAB), seed=3)
    draft = with_tokens(DRAFT_VOCAB, token_strings(DRAFT_VOCAB), seed=4)
    prompts = [[70, 3, 65], [1, 2, 3, 4], [66]]  # ids past the draft's vocabulary in the prompts
    kw = dict(max_new_tokens=24, temperature=0.0)
    plain = spec_jax.generate(target, prompts, **kw).tokens
    spec = spec_jax.generate(target, prompts, draft=draft, gamma=3, **kw)
    assert spec.tokens == plain
    assert any(t >= DRAFT_VOCAB for row in plain for t in row), "the target must use ids the draft lacks"


def test_a_draft_differing_in_one_token_string_is_refused_naming_it():
    target = with_tokens(TARGET_VOCAB, token_strings(TARGET_VOCAB), seed=3)
    tokens = token_strings(DRAFT_VOCAB)
    tokens[40] = "hi"
    draft = with_tokens(DRAFT_VOCAB, tokens, seed=4)
    with pytest.raises(
        ValueError, match=r"token id 40 is 't40' in the target's and 'hi' in the draft's"
    ) as e:
        spec_jax.generate(target, [[1, 2]], draft=draft, gamma=2, max_new_tokens=4)
    assert "\n" not in str(e.value)


def test_a_draft_larger_than_the_target_is_refused_past_the_targets_end():
    target = with_tokens(DRAFT_VOCAB, token_strings(DRAFT_VOCAB), seed=3)
    draft = with_tokens(TARGET_VOCAB, token_strings(TARGET_VOCAB), seed=4)
    with pytest.raises(ValueError, match=r"token id 64 is past its end \(64 ids\) in the target's and 't64'"):
        spec_jax.generate(target, [[1, 2]], draft=draft, gamma=2, max_new_tokens=4)
