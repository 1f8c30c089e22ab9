"""Prefill, the per-row commit, and the autoregressive loop (one jit-compiled lax.while_loop).

Every loop keeps, per row, `length` = committed tokens (prompt + generated). The last
committed token is not yet in any cache; everything before it is. A model call feeds tokens
from there at their absolute positions, so each row advances by its own count and whatever
a rejected draft wrote past a row's length is overwritten before it can be read.
"""

import collections
import dataclasses
import functools
import time
from collections.abc import Callable, Hashable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from models.cache import KVCache
from models.config import ModelConfig
from models.transformer import forward, init_cache
from spec_jax.sampling import SamplingParams, draw, warp

MIN_BUCKET = 16
PAD_ID = 0

# How many times each loop body was traced (a retrace means a recompile); tests read it.
TRACE_COUNTS: collections.Counter = collections.Counter()
_EXECUTABLES: dict = {}


def bucket_length(n: int, minimum: int = MIN_BUCKET) -> int:
    """The power-of-two bucket (>= minimum) that a prompt of n tokens is padded to."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


def compiled(
    name: str,
    fn: Callable,
    static: Hashable,
    args: tuple,
    donate_argnums=(),
    in_shardings=None,
    out_shardings=None,
) -> tuple[Any, float]:
    """Returns (executable, compile_seconds) for fn(static, *args), compiling once per shape.

    The key is the static configuration plus the shapes, dtypes and shardings of args (and
    the requested out_shardings), so a new prompt in the same bucket reuses the executable
    (compile_seconds = 0). in_shardings / out_shardings (pytrees of jax.sharding.Sharding
    matching args / the result) are passed to jax.jit when given: the sharded loop.
    """
    leaves, treedef = jax.tree.flatten(args)
    out_key = None if out_shardings is None else jax.tree.flatten(out_shardings)
    out_key = out_key and (tuple(out_key[0]), out_key[1])
    key = (
        name,
        static,
        treedef,
        tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves),
        out_key,
    )
    if key in _EXECUTABLES:
        return _EXECUTABLES[key], 0.0
    start = time.perf_counter()
    shardings = {}
    if in_shardings is not None:
        shardings["in_shardings"] = tuple(in_shardings)
    if out_shardings is not None:
        shardings["out_shardings"] = out_shardings
    jitted = jax.jit(functools.partial(fn, static), donate_argnums=donate_argnums, **shardings)
    executable = jitted.lower(*args).compile()
    _EXECUTABLES[key] = executable
    return executable, time.perf_counter() - start


def clear_compiled() -> None:
    """Forgets every compiled loop (tests that patch a rule use it so nothing stale is reused)."""
    _EXECUTABLES.clear()


def row_keys(key, batch: int):
    """[B] independent keys: row b's randomness depends on (key, b) alone, not on other rows."""
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(batch))


def draw_rows(key, probs_bv):
    """Draws one token per row of [B, V] probabilities with per-row keys."""
    return jax.vmap(draw)(row_keys(key, probs_bv.shape[0]), probs_bv)


def prefill(config: ModelConfig, params, tokens_bp, prompt_lens_b, cache_len: int):
    """Runs the padded prompts [B, P] through the model into a fresh cache of cache_len slots.

    Returns (logits at each row's last prompt token [B, V], cache).
    """
    batch, width = tokens_bp.shape
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
    cache = init_cache(config, batch, cache_len)
    logits, cache = forward(
        config, params, tokens_bp, positions, cache, logits_at=(prompt_lens_b - 1)[:, None]
    )
    return logits[:, 0], cache


@flax.struct.dataclass
class Output:
    """Generated tokens so far. tokens: [B, N + slack] (PAD_ID past each row's count)."""

    tokens: jax.Array  # int32 [B, N + slack]
    num_generated: jax.Array  # int32 [B]
    done: jax.Array  # bool [B]


def new_output(batch: int, max_new_tokens: int, slack: int) -> Output:
    return Output(
        tokens=jnp.full((batch, max_new_tokens + slack), PAD_ID, jnp.int32),
        num_generated=jnp.zeros((batch,), jnp.int32),
        done=jnp.zeros((batch,), jnp.bool_),
    )


def commit(out: Output, new_bk, counts_b, max_new_tokens: int, eos_id) -> tuple[Output, jax.Array]:
    """Appends the first counts[b] of new [B, K] tokens to each row that is not done.

    A row stops at max_new_tokens and after its first EOS (eos_id < 0 disables EOS). Returns
    (output, committed [B]): how many tokens each row really committed.
    """
    k = new_bk.shape[1]
    idx = jnp.arange(k)[None, :]
    counts = jnp.where(out.done, 0, jnp.minimum(counts_b, max_new_tokens - out.num_generated))
    is_eos = (new_bk == eos_id) & (idx < counts[:, None]) & (eos_id >= 0)
    first_eos = jnp.argmax(is_eos, axis=1)
    hit_eos = jnp.any(is_eos, axis=1)
    counts = jnp.where(hit_eos, first_eos + 1, counts)
    b_idx = jnp.arange(new_bk.shape[0])[:, None]
    dest = jnp.where(idx < counts[:, None], out.num_generated[:, None] + idx, out.tokens.shape[1])
    tokens = out.tokens.at[b_idx, dest].set(new_bk, mode="drop")
    num_generated = out.num_generated + counts
    done = out.done | hit_eos | (num_generated >= max_new_tokens)
    return Output(tokens=tokens, num_generated=num_generated, done=done), counts


@flax.struct.dataclass
class ARState:
    cache: KVCache
    out: Output
    last_token: jax.Array  # int32 [B], committed but not yet in the cache
    length: jax.Array  # int32 [B], committed tokens including last_token
    key: jax.Array
    steps: jax.Array  # int32 [], model calls made by the loop


@flax.struct.dataclass
class PrefillInputs:
    tokens: jax.Array  # int32 [B, P]
    prompt_lens: jax.Array  # int32 [B]
    eos_id: jax.Array  # int32 [], -1 for none
    key: jax.Array


def first_token(logits_bv, inputs: PrefillInputs, sampling: SamplingParams, max_new_tokens: int):
    """Draws the first new token from the prefill logits; returns (Output, token [B], key)."""
    key, sub = jax.random.split(inputs.key)
    token = draw_rows(sub, warp(logits_bv, sampling))
    out, _ = commit(
        new_output(token.shape[0], max_new_tokens, 0),
        token[:, None],
        jnp.ones_like(token),
        max_new_tokens,
        inputs.eos_id,
    )
    return out, token, key


@dataclasses.dataclass(frozen=True)
class ARStatic:
    config: ModelConfig
    sampling: SamplingParams
    max_new_tokens: int
    cache_len: int


def ar_prefill(static: ARStatic, params, inputs: PrefillInputs) -> ARState:
    TRACE_COUNTS["ar_prefill"] += 1
    logits, cache = prefill(static.config, params, inputs.tokens, inputs.prompt_lens, static.cache_len)
    out, token, key = first_token(logits, inputs, static.sampling, static.max_new_tokens)
    return ARState(
        cache=cache,
        out=out,
        last_token=token,
        length=inputs.prompt_lens + 1,
        key=key,
        steps=jnp.zeros((), jnp.int32),
    )


def ar_step(static: ARStatic, params, state: ARState, eos_id) -> ARState:
    """One decode step for every row: feed the last token, draw the next, commit where not done."""
    position = (state.length - 1)[:, None]
    logits, cache = forward(static.config, params, state.last_token[:, None], position, state.cache)
    key, sub = jax.random.split(state.key)
    token = draw_rows(sub, warp(logits[:, 0], static.sampling))
    out, counts = commit(state.out, token[:, None], jnp.ones_like(token), static.max_new_tokens, eos_id)
    advanced = counts > 0
    return ARState(
        cache=cache,
        out=out,
        last_token=jnp.where(advanced, token, state.last_token),
        length=state.length + counts,
        key=key,
        steps=state.steps + 1,
    )


def ar_loop(static: ARStatic, params, state: ARState, eos_id) -> ARState:
    """Decodes until every row is done, as one lax.while_loop."""
    TRACE_COUNTS["ar_loop"] += 1
    return jax.lax.while_loop(
        lambda s: ~jnp.all(s.out.done), lambda s: ar_step(static, params, s, eos_id), state
    )


def pad_prompts(prompts: list[list[int]], width: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-pads prompts into int32 [B, width]; returns (tokens, lengths [B])."""
    tokens = np.full((len(prompts), width), PAD_ID, np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    return tokens, np.array([len(p) for p in prompts], np.int32)
