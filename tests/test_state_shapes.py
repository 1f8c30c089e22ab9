"""The loop's state and a round's outputs have the shapes their fields say (spec_jax.state,
spec_jax.rounds): chex shape checks over the tiny pair's prefill and one chain round, at a
batch size and a gamma where a swapped axis would show (B = 3, G = 2, N = 5 new tokens)."""

import functools

import chex
import jax
import jax.numpy as jnp
import pytest

from spec_jax import rounds, speculative
from spec_jax.decode import PrefillInputs, pad_prompts
from spec_jax.drafting import as_drafter
from spec_jax.logprobs import MAX_LOGPROBS
from spec_jax.sampling import row_keys, split_rows

B, G, N, WIDTH = 3, 2, 5, 16


@pytest.fixture(scope="module")
def prefilled(tiny_target, tiny_draft):
    drafter, draft_params = as_drafter(tiny_draft, tiny_target)
    cache_len = WIDTH + N + G
    static = speculative.SpecStatic(tiny_target.config, drafter, G, N, cache_len)
    tokens, lens = pad_prompts([[5, 9], [2, 7, 7, 3], [1]], WIDTH)
    keys = row_keys(jax.random.key(0), list(range(B)))
    inputs = PrefillInputs(jnp.asarray(tokens), jnp.asarray(lens), jnp.asarray([-1]), keys)
    prefill = functools.partial(speculative.spec_prefill, static)
    state = jax.eval_shape(prefill, tiny_target.params, draft_params, inputs)
    return static, tiny_target.params, draft_params, state


def check_state(state, config, cache_len):
    rows = (B,)
    chex.assert_shape([state.prev_token, state.last_token, state.length, state.keys], rows)
    chex.assert_shape(
        [state.target_cache.k, state.target_cache.v],
        (config.num_layers, B, cache_len, config.num_kv_heads, config.head_dim),
    )
    out = state.out
    chex.assert_shape([out.num_generated, out.done, out.nonfinite, out.budget, out.num_logprobs], rows)
    chex.assert_equal_shape([out.tokens, out.logprobs])
    assert out.tokens.shape[0] == B and out.tokens.shape[1] >= N
    chex.assert_shape([out.top_ids, out.top_logprobs], (*out.tokens.shape, MAX_LOGPROBS))
    s = state.sampling
    chex.assert_shape([s.temperature, s.top_k, s.top_p], rows)


def test_the_state_after_prefill_has_its_fields_shapes(prefilled, tiny_target):
    static, _, _, state = prefilled
    check_state(state, tiny_target.config, static.cache_len)


def test_a_chain_rounds_outputs_and_the_state_after_it_have_their_fields_shapes(prefilled, tiny_target):
    static, params, draft_params, state = prefilled
    config = tiny_target.config

    def one_round(state):
        _, draft_keys, verify_keys = split_rows(state.keys, 3)
        active = ~state.out.done
        result = rounds.chain_round(static, params, draft_params, state, active, draft_keys, verify_keys)
        return result._replace(logits=result.logits(), observe=None)

    result = jax.eval_shape(one_round, state)
    chex.assert_shape(result.new, (B, G + 1))
    chex.assert_shape([result.usable, result.nonfinite, result.num_drafted, result.num_accepted], (B,))
    chex.assert_shape(result.overlap, (B, G))
    chex.assert_shape(result.logits, (B, G + 1, config.vocab_size))
    after = jax.eval_shape(
        lambda s: speculative.spec_round(static, params, draft_params, s, jnp.asarray([-1])), state
    )
    check_state(after, config, static.cache_len)


def test_the_shape_check_sees_a_swapped_axis(prefilled, tiny_target):
    """The check can fail: a cache with its batch and sequence axes swapped."""
    static, _, _, state = prefilled
    cache = state.target_cache
    swapped = cache.replace(
        k=jax.ShapeDtypeStruct(jnp.swapaxes(jnp.empty(cache.k.shape), 1, 2).shape, cache.k.dtype)
    )
    with pytest.raises(AssertionError):
        check_state(state.replace(target_cache=swapped), tiny_target.config, static.cache_len)
