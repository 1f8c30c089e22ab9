"""`spec_jax.generate`: the one entry point for autoregressive and speculative decoding."""

import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax import sharding
from spec_jax.decode import (
    ARStatic,
    PrefillInputs,
    ar_loop,
    ar_prefill,
    bucket_length,
    compiled,
    pad_prompts,
)
from spec_jax.drafters import ModelDrafter
from spec_jax.sampling import SamplingParams
from spec_jax.speculative import SpecStatic, spec_loop, spec_prefill


@dataclasses.dataclass
class Generation:
    """tokens: the new tokens of each prompt (EOS included when hit); stats: metrics and timings.

    state: on a mesh, the final loop state as device arrays (caches included), so its
    shardings can be inspected; None otherwise.
    """

    tokens: list[list[int]]
    stats: dict[str, Any]
    state: Any = None


def validate(target, prompts, draft, gamma, max_new_tokens, eos_id):
    """Raises ValueError naming the argument and its allowed range (draft: a drafter or None)."""
    if not isinstance(prompts, list | tuple) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    vocab = target.config.vocab_size
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompts[{i}] is empty; every prompt needs at least one token")
        arr = np.asarray(p)
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"prompts[{i}] must be a flat list of integer token ids")
        if arr.min() < 0 or arr.max() >= vocab:
            raise ValueError(
                f"prompts[{i}] has token ids outside the vocabulary [0, {vocab}): "
                f"min {arr.min()}, max {arr.max()}"
            )
    if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > target.config.max_seq_len:
        raise ValueError(
            f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the target's "
            f"context of {target.config.max_seq_len} tokens"
        )
    if eos_id is not None and not 0 <= eos_id < vocab:
        raise ValueError(f"eos_id must be in [0, {vocab}), got {eos_id}")
    if draft is None:
        return
    if not isinstance(gamma, int) or gamma < 1:
        raise ValueError(f"gamma must be an integer >= 1, got {gamma!r}")
    if draft.vocab_size != vocab:
        raise ValueError(
            f"draft vocabulary size ({draft.vocab_size}) differs from the target's ({vocab}); "
            "speculative decoding needs one shared vocabulary"
        )
    if longest + max_new_tokens + gamma > draft.max_seq_len:
        raise ValueError(
            f"the draft's context ({draft.max_seq_len} tokens) is shorter than needed: "
            f"prompt {longest} + max_new_tokens {max_new_tokens} + gamma {gamma}"
        )


def layout(config, prompts, max_new_tokens: int, gamma: int) -> tuple[int, int]:
    """(prompt width, cache length): prompts are right-padded to their length bucket (capped so
    the cache fits the model's context), and the cache holds the width, the new tokens and
    the gamma drafts a last round may write past them (gamma = 0 for plain decoding)."""
    longest = max(len(p) for p in prompts)
    width = min(bucket_length(longest), max(longest, config.max_seq_len - max_new_tokens))
    return width, width + max_new_tokens + gamma


def as_drafter(draft):
    """(drafter, params): a Model becomes (ModelDrafter(config), its params); a (drafter,
    params) pair (e.g. from spec_jax.ngram.fit_bigram) is used as it is; a bare drafter
    object is used with params None (or its `arrays`)."""
    if hasattr(draft, "config") and hasattr(draft, "params"):
        draft = ModelDrafter(draft.config), draft.params
    elif not (isinstance(draft, tuple) and len(draft) == 2):
        draft = draft, getattr(draft, "arrays", None)
    drafter, params = draft
    if not all(hasattr(drafter, a) for a in ("vocab_size", "max_seq_len", "init", "propose")):
        raise ValueError(
            f"draft must be None, a models.Model, a drafter (spec_jax.drafters.Drafter) or a "
            f"(drafter, params) pair; got {type(drafter).__name__}"
        )
    return drafter, params


def _mark_padding_done(prefill_fn, static, *args):
    """prefill_fn(static, *args[:-1]) with the rows where args[-1] (active [B]) is False marked
    done: rows added only to fill the data axis then never run a round or count in the metrics."""
    *args, active = args
    state = prefill_fn(static, *args)
    return state.replace(out=state.out.replace(done=state.out.done | ~active))


def _shardings_of(tree):
    return jax.tree.map(lambda x: x.sharding, tree)


def generate(
    target,
    prompts,
    *,
    draft=None,
    gamma: int = 4,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_id: int | None = None,
    mesh: jax.sharding.Mesh | None = None,
) -> Generation:
    """Generates up to max_new_tokens after each prompt, speculatively when a draft is given.

    Args:
      target: a models.Model.
      prompts: list of token-id lists (ragged lengths are fine).
      draft: None (plain autoregressive decoding), a models.Model, or a (drafter, params) pair
        such as spec_jax.ngram.fit_bigram returns (see as_drafter).
      gamma: draft tokens per round (static: a new gamma compiles a new loop).
      temperature, top_k, top_p: the warp, applied identically to target and draft.
      seed: row b's randomness depends on (seed, b) only.
      eos_id: a row stops after generating it.
      mesh: None (one device) or a Mesh with axes ("data", "model") (spec_jax.sharding.make_mesh):
        both models and both caches are sharded by spec_jax.sharding's rule table and the loop
        runs under one jit with explicit in/out shardings. The batch is padded to a multiple of
        the data axis with rows that are done from the start. Place models once with
        spec_jax.sharding.place(model, mesh); unplaced models are placed on first use and cached.
        Tokens equal the unsharded run's (up to float reassociation in the sharded matmuls).

    Returns:
      Generation(tokens, stats). stats holds the metrics schema of spec_jax.metrics (for
      speculative runs), the timings compile_seconds, prefill_seconds, decode_seconds,
      tokens_per_second (new tokens over prefill + decode), and num_new_tokens.
    """
    sampling = SamplingParams(float(temperature), top_k, float(top_p))
    drafter, draft_params = (None, None) if draft is None else as_drafter(draft)
    validate(target, prompts, drafter, gamma, max_new_tokens, eos_id)

    num_rows = len(prompts)
    if mesh is not None:
        sharding.check_mesh(mesh)
        prompts = list(prompts) + [prompts[0]] * (-num_rows % mesh.shape[sharding.DATA])
    width, cache_len = layout(target.config, prompts, max_new_tokens, 0 if drafter is None else gamma)
    tokens, lens = pad_prompts(prompts, width)
    inputs = PrefillInputs(
        tokens=jnp.asarray(tokens),
        prompt_lens=jnp.asarray(lens),
        eos_id=jnp.asarray(-1 if eos_id is None else eos_id, jnp.int32),
        key=jax.random.key(seed),
    )
    target_params = target.params
    sharded = {}  # extra compiled() arguments on a mesh
    if mesh is not None:
        batch = len(prompts)
        target_params = sharding.placed_params(target, mesh)
        if isinstance(drafter, ModelDrafter):
            draft_params = sharding.placed_params(draft, mesh)
        elif draft_params is not None:  # other drafters' arrays (tables): replicated
            draft_params = sharding.put(
                draft_params, jax.tree.map(lambda _: sharding.replicated(mesh), draft_params)
            )
        inputs = sharding.put(inputs, sharding.state_shardings(inputs, mesh, batch))
        active = sharding.put(np.arange(batch) < num_rows, sharding.batch_sharding(mesh, 1))

    def compile_prefill(name, fn, static, args):
        if mesh is None:
            return compiled(name, fn, static, args)
        fn, args = functools.partial(_mark_padding_done, fn), (*args, active)
        state_shape = jax.eval_shape(functools.partial(fn, static), *args)
        sharded["state"] = sharding.state_shardings(state_shape, mesh, batch)
        return compiled(
            name + "_sharded",
            fn,
            static,
            args,
            in_shardings=_shardings_of(args),
            out_shardings=sharded["state"],
        )

    def compile_loop(name, fn, static, args, state_arg):
        if mesh is None:
            return compiled(name, fn, static, args, donate_argnums=(state_arg,))
        in_shardings = _shardings_of(args)
        return compiled(
            name,
            fn,
            static,
            args,
            donate_argnums=(state_arg,),
            in_shardings=in_shardings,
            out_shardings=in_shardings[state_arg],
        )

    if drafter is None:
        static = ARStatic(target.config, sampling, max_new_tokens, cache_len)
        prefill_args = (target_params, inputs) + (() if mesh is None else (active,))
        prefill_fn, c1 = compile_prefill("ar_prefill", ar_prefill, static, (target_params, inputs))
        start = time.perf_counter()
        state = jax.block_until_ready(prefill_fn(*prefill_args))
        prefill_s = time.perf_counter() - start
        args = (target_params, state, inputs.eos_id)
        loop_fn, c2 = compile_loop("ar_loop", ar_loop, static, args, 1)
        start = time.perf_counter()
        state = jax.block_until_ready(loop_fn(*args))
        decode_s = time.perf_counter() - start
        stats = {"target_calls": int(sharding.fetch(state.steps)) + 1, "draft_calls": 0}
    else:
        static = SpecStatic(target.config, drafter, sampling, gamma, max_new_tokens, cache_len)
        prefill_args = (target_params, draft_params, inputs)
        prefill_fn, c1 = compile_prefill("spec_prefill", spec_prefill, static, prefill_args)
        start = time.perf_counter()
        state = jax.block_until_ready(prefill_fn(*prefill_args, *(() if mesh is None else (active,))))
        prefill_s = time.perf_counter() - start
        args = (target_params, draft_params, state, inputs.eos_id)
        loop_fn, c2 = compile_loop("spec_loop", spec_loop, static, args, 2)
        start = time.perf_counter()
        state = jax.block_until_ready(loop_fn(*args))
        decode_s = time.perf_counter() - start
        stats = sharding.fetch(state.metrics).to_dict()

    out, counts = sharding.fetch((state.out.tokens, state.out.num_generated))
    new_tokens = [out[i, : counts[i]].tolist() for i in range(num_rows)]
    total = int(counts[:num_rows].sum())
    stats.update(
        compile_seconds=c1 + c2,
        prefill_seconds=prefill_s,
        decode_seconds=decode_s,
        num_new_tokens=total,
        tokens_per_second=total / (prefill_s + decode_s),
    )
    return Generation(tokens=new_tokens, stats=stats, state=None if mesh is None else state)
