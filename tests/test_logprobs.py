"""Log-probabilities (spec_jax.logprobs): each kept token's is the target's raw log_softmax at it,
taken from the call that verified it, so a draft does not change it; the top k are the k largest,
sorted; a prompt's (echo) are a plain forward's; a row that asks changes no other row's tokens;
n samples of one prompt are a batch of generate's rows. All against a plain forward of the tiny
float32 target over the prompt and the generated text."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spec_jax
from models.transformer import forward, init_cache
from spec_jax.engine import Engine
from spec_jax.logprobs import MAX_LOGPROBS
from spec_jax.request import Request, RequestError

pytestmark = pytest.mark.xdist_group("tiny_target")

GAMMA = 3
CONTEXT = 64
TOL = 1e-5  # float32 logits of magnitude ~1: calls of other widths round differently, a little
PROMPTS = [[5, 9, 2], [7, 3, 8, 11, 4], [30], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]
MAX_NEW = 10


def reference(model, text: list[int]) -> np.ndarray:
    """float32 [T, V]: log_softmax of the target's logits at each position of a plain forward over
    text (position t's row: the distribution of token t + 1)."""
    tokens = jnp.asarray([text], jnp.int32)
    out = forward(
        model.config,
        model.params,
        tokens,
        jnp.arange(len(text))[None],
        init_cache(model.config, 1, len(text)),
    )
    return np.asarray(jax.nn.log_softmax(out.logits[0].astype(jnp.float32), axis=-1))


def expected(model, prompt, new_tokens, k: int):
    """(each new token's logprob [N], its top k ids [N, k], their logprobs [N, k]) from a plain
    forward over prompt + new_tokens; the top sorted by logprob (ties: the lower id)."""
    lp = reference(model, list(prompt) + list(new_tokens))[len(prompt) - 1 : -1]  # [N, V]
    chosen = lp[np.arange(len(new_tokens)), new_tokens]
    order = np.lexsort((np.arange(lp.shape[1])[None].repeat(len(lp), 0), -lp), axis=1)[:, :k]
    return chosen, order, np.take_along_axis(lp, order, axis=1)


def check_against_forward(model, prompt, tokens, kept, k: int):
    want, want_ids, want_lp = expected(model, prompt, tokens, k)
    assert list(kept.token_ids) == list(tokens)
    np.testing.assert_allclose(kept.logprobs, want, atol=TOL, rtol=0)
    got_ids = np.asarray([[i for i, _ in top] for top in kept.top]).reshape(len(tokens), k)
    got_lp = np.asarray([[v for _, v in top] for top in kept.top]).reshape(len(tokens), k)
    np.testing.assert_allclose(got_lp, want_lp, atol=TOL, rtol=0)
    # the top k by value, most probable first; ids may differ only between near-equal values
    assert np.all(np.diff(got_lp, axis=1) <= 0)
    assert np.all((got_ids == want_ids) | (np.abs(got_lp - want_lp) < TOL))


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_kept_logprobs_are_the_targets_raw_log_softmax_of_a_plain_forward(tiny_target, temperature):
    """Raw: a sampled row's logprobs are of the unwarped logits (temperature 0.8 would change them)."""
    gen = spec_jax.generate(
        tiny_target, PROMPTS, max_new_tokens=MAX_NEW, temperature=temperature, seed=3, eos_id=None, logprobs=5
    )
    for prompt, tokens, kept in zip(PROMPTS, gen.tokens, gen.logprobs, strict=True):
        check_against_forward(tiny_target, prompt, tokens, kept, 5)


@pytest.mark.parametrize("shape", [dict(gamma=GAMMA), dict(gamma=4, tree=4)], ids=["chain", "tree"])
def test_with_a_draft_the_logprobs_equal_those_without_and_greedy_tokens_are_unchanged(
    tiny_target, tiny_draft, shape
):
    """A chain of gamma 3, and a token tree of 4 nodes (its path's logits, in path order)."""
    kwargs = dict(max_new_tokens=MAX_NEW, temperature=0.0, eos_id=None)
    plain = spec_jax.generate(tiny_target, PROMPTS, **kwargs)
    asked = spec_jax.generate(tiny_target, PROMPTS, logprobs=3, **kwargs)
    spec = spec_jax.generate(tiny_target, PROMPTS, draft=tiny_draft, logprobs=3, **shape, **kwargs)
    assert (
        spec.stats["num_accepted_tokens"] > 0
        and spec.stats["num_accepted_tokens"] < spec.stats["num_draft_tokens"]
    )
    assert asked.tokens == plain.tokens == spec.tokens
    for a, s, prompt, tokens in zip(asked.logprobs, spec.logprobs, PROMPTS, plain.tokens, strict=True):
        np.testing.assert_allclose(s.logprobs, a.logprobs, atol=TOL, rtol=0)
        np.testing.assert_allclose(
            [v for top in s.top for _, v in top], [v for top in a.top for _, v in top], atol=TOL
        )
        check_against_forward(tiny_target, prompt, tokens, s, 3)


def test_top_logprobs_are_the_k_largest_sorted_and_k_zero_gives_none(tiny_target):
    gen = spec_jax.generate(
        tiny_target, PROMPTS[:2], max_new_tokens=4, temperature=0.0, eos_id=None, logprobs=MAX_LOGPROBS
    )
    for prompt, tokens, kept in zip(PROMPTS[:2], gen.tokens, gen.logprobs, strict=True):
        check_against_forward(tiny_target, prompt, tokens, kept, MAX_LOGPROBS)
        # greedy: each token is its position's most probable, with the top's first logprob
        assert [top[0][0] for top in kept.top] == tokens
        assert [top[0][1] for top in kept.top] == list(kept.logprobs)
    none = spec_jax.generate(
        tiny_target, PROMPTS[:1], max_new_tokens=4, temperature=0.0, eos_id=None, logprobs=0
    )
    assert none.logprobs[0].top == ((),) * 4 and len(none.logprobs[0].logprobs) == 4
    assert spec_jax.generate(tiny_target, PROMPTS[:1], max_new_tokens=2, eos_id=None).logprobs is None
    with pytest.raises(ValueError, match="logprobs must be None or an integer in"):
        spec_jax.generate(tiny_target, PROMPTS[:1], max_new_tokens=2, logprobs=21)


def run(engine: Engine, requests, row_ids=None):
    """{index: (tokens, TokenLogprobs or None, prompt TokenLogprobs or None, finish reason)} of
    the requests submitted together and drained."""
    handles = [engine.submit(r, row_id=(row_ids or [0] * len(requests))[i]) for i, r in enumerate(requests)]
    index = {h.id: i for i, h in enumerate(handles)}
    out = {i: [[], None, None, None] for i in range(len(requests))}
    for u in engine.drain():
        o = out[index[u.handle.id]]
        o[0] += u.token_ids
        if u.logprobs is not None:
            o[1] = u.logprobs if o[1] is None else o[1] + u.logprobs
        if u.prompt_logprobs is not None:
            assert o[2] is None, "the prompt's logprobs come once"
            o[2] = u.prompt_logprobs
        if u.finished:
            o[3] = u.finish_reason
    return out


@pytest.fixture(scope="module")
def engine(tiny_target, tiny_draft):
    return Engine(tiny_target, tiny_draft, max_batch=4, gamma=GAMMA, max_context=CONTEXT)


def test_a_row_asking_logprobs_leaves_the_other_rows_tokens_unchanged(engine, tiny_target):
    """Greedy and sampled rows beside one that asks: each one's tokens are those it gets alone;
    the asking row's logprobs are the forward's, its tokens those it gets without asking."""
    warps = [dict(temperature=0.0), dict(temperature=1.0, seed=4), dict(temperature=0.7, top_k=5, seed=5), {}]
    base = [
        Request(prompt_ids=tuple(p), max_tokens=MAX_NEW, stop_ids=(), **w)
        for p, w in zip(PROMPTS, warps, strict=True)
    ]
    alone = {i: run(engine, [r])[0][0] for i, r in enumerate(base)}
    asking = [
        base[0],
        dataclasses.replace(base[1], logprobs=4),
        base[2],
        dataclasses.replace(base[3], logprobs=0),
    ]
    together = run(engine, asking)
    for i in range(4):
        assert together[i][0] == alone[i], i
    assert together[0][1] is None and together[2][1] is None
    check_against_forward(tiny_target, PROMPTS[1], together[1][0], together[1][1], 4)
    check_against_forward(tiny_target, PROMPTS[3], together[3][0], together[3][1], 0)


def test_echo_prompt_logprobs_equal_a_forward_and_max_tokens_0_takes_no_slot(engine, tiny_target):
    prompt = PROMPTS[3]
    lp = reference(tiny_target, prompt)
    before = engine.stats()
    out = run(engine, [Request(prompt_ids=tuple(prompt), max_tokens=0, prompt_logprobs=2)])[0]
    after = engine.stats()
    assert out[0] == [] and out[1] is None and out[3] == "length"
    assert after.get("prefill_calls", 0) == before.get("prefill_calls", 0)  # no slot, no prefill
    assert after.get("rounds", 0) == before.get("rounds", 0)
    scored = out[2]
    assert list(scored.token_ids) == prompt and scored.logprobs[0] is None and scored.top[0] == ()
    want = [lp[t - 1, prompt[t]] for t in range(1, len(prompt))]
    np.testing.assert_allclose(scored.logprobs[1:], want, atol=TOL, rtol=0)
    for t in range(1, len(prompt)):
        order = np.argsort(-lp[t - 1], kind="stable")[:2]
        assert [i for i, _ in scored.top[t]] == order.tolist()
        np.testing.assert_allclose([v for _, v in scored.top[t]], lp[t - 1, order], atol=TOL)
    # echo with generation: the prompt's logprobs in the first Update, the tokens' as asked
    both = run(
        engine, [Request(prompt_ids=tuple(prompt), max_tokens=4, stop_ids=(), prompt_logprobs=1, logprobs=1)]
    )[0]
    np.testing.assert_allclose(both[2].logprobs[1:], want, atol=TOL, rtol=0)
    check_against_forward(tiny_target, prompt, both[0], both[1], 1)
    with pytest.raises(RequestError, match="max_tokens"):
        Request(prompt_ids=(1,), max_tokens=0).validate()  # 0 only to score the prompt
    with pytest.raises(RequestError, match="prompt_logprobs"):
        Request(prompt_ids=(1,), prompt_logprobs=21).validate()


def test_n_samples_of_a_prompt_equal_a_batch_of_generate_rows(engine, tiny_target, tiny_draft):
    """The engine's rows of row ids 0, 1, 2 (one prompt, one seed: a server's n = 3) are
    spec_jax.generate's batch of the prompt three times (row ids 0..2): three different samples."""
    prompt, seed = PROMPTS[1], 11
    request = Request(prompt_ids=tuple(prompt), max_tokens=MAX_NEW, stop_ids=(), temperature=1.0, seed=seed)
    out = run(engine, [request] * 3, row_ids=[0, 1, 2])
    gen = spec_jax.generate(
        tiny_target,
        [prompt] * 3,
        draft=tiny_draft,
        gamma=GAMMA,
        max_new_tokens=MAX_NEW,
        temperature=1.0,
        seed=seed,
        eos_id=None,
    )
    assert [out[i][0] for i in range(3)] == gen.tokens
    assert len({tuple(t) for t in gen.tokens}) == 3
