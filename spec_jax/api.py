"""`spec_jax.generate`: the one entry point for autoregressive and speculative decoding.

One path: the drafter is chosen up front (None -> NoDrafter with gamma 0, plain decoding), and
"no mesh" is a 1x1 mesh on the default device, so every call places its arguments by the same
sharding rules and runs the same two compiled programs (prefill, loop). `run` reads as its
steps: validate, plan (the layout and one gamma policy, fixed or auto), place, compile and run
the prefill, run the loop in chunks (one chunk unless gamma is auto).
"""

import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax import engine as engine_lib
from spec_jax import rows, sharding
from spec_jax.autogamma import decode_auto
from spec_jax.decode import PrefillInputs, pad_prompts
from spec_jax.logprobs import TokenLogprobs
from spec_jax.metrics import NONFINITE, nonfinite_rows
from spec_jax.plan import Options, Plan, make_plan, measured, spec_static
from spec_jax.request import Limits, encode_prompt, request_for, stop_row
from spec_jax.runner import Runner
from spec_jax.sampling import row_keys
from spec_jax.speculative import SpecState
from spec_jax.updates import Update


@dataclasses.dataclass
class Generation:
    """tokens: the new tokens of each prompt (the stop token included when hit); stats: the
    metrics of spec_jax.metrics and timings."""

    tokens: list[list[int]]
    stats: dict[str, Any]
    text: list[str] | None = None  # each prompt's new text (special tokens skipped); None: no tokenizer
    # each prompt's new tokens' log-probabilities (generate's logprobs; None: not asked)
    logprobs: list[TokenLogprobs] | None = None

    @property
    def nonfinite_rows(self) -> list[int]:
        """The prompts whose target logits became non-finite (NaN or inf): each stopped there,
        its tokens are those before (spec_jax.metrics.NONFINITE)."""
        return nonfinite_rows(self.stats)


def _place(target, plan: Plan, seed: int, max_new_tokens: int, logprobs: int | None = None):
    """(target params, draft params, PrefillInputs, active [B]) on the plan's mesh, and the
    drafter as it runs there: the models by the rule table (each drafter says how its params
    are placed), the inputs' rows over the data axis.

    The inputs have the engine's form (spec_jax.rows.group_inputs): each row's stop ids
    ([B, MAX_STOP_IDS] at least, -1 padded: stop_row) and budget (max_new_tokens), so that a call and
    the engine's requests of one bucket run the same programs (a --stream run after `make demo`
    finds its prefill in the compilation cache)."""
    mesh, batch = plan.mesh, len(plan.prompts)
    tokens, lens = pad_prompts(plan.prompts, plan.width)
    stops = np.tile(stop_row(plan.stop_ids), (batch, 1))
    inputs = PrefillInputs(
        tokens=jnp.asarray(tokens),
        prompt_lens=jnp.asarray(lens),
        stop_ids=jnp.asarray(stops),
        keys=row_keys(jax.random.key(seed), plan.row_ids),
        budgets=jnp.full(batch, max_new_tokens, jnp.int32),
        sampling=plan.sampling.for_rows(batch),
        num_logprobs=np.full(batch, -1 if logprobs is None else logprobs, np.int32),
    )
    inputs = sharding.put(inputs, sharding.state_shardings(inputs, mesh, batch))
    active = sharding.put(np.arange(batch) < plan.num_rows, sharding.batch_sharding(mesh, 1))
    target_params = sharding.placed_params(target, mesh)
    draft_params = sharding.put_once(plan.draft_params, plan.drafter.param_shardings(plan.draft_params, mesh))
    return target_params, draft_params, inputs, active, plan.drafter.for_mesh(mesh)


def run(target, prompts, **options) -> tuple[SpecState, dict]:
    """What generate does (the same arguments; prompts as token ids), returning the final loop
    state as device arrays (caches included, with their shardings; rows past len(prompts) pad
    the data axis) and the timings dict."""
    state, timings, _ = _run(target, prompts, Options(**options))
    return state, timings


def _run(target, prompts, options: Options) -> tuple[SpecState, dict, Plan]:
    """run's (state, timings), and the Plan it ran."""
    if options.eos_id == "auto":  # the model's stop tokens
        options = dataclasses.replace(options, eos_id=model_stop_ids(target))
    plan = measured(target, make_plan(target, prompts, options))
    target_params, draft_params, inputs, active, drafter = _place(
        target, plan, options.seed, options.max_new_tokens, options.logprobs
    )
    static = spec_static(target, plan.mesh, drafter, plan.policy, options, plan.cache_len)
    runner = Runner(static, plan.mesh, target_params, draft_params, inputs)
    state, prefill_compile_s, prefill_s = runner.prefill(active)
    if plan.controller is None:
        state, loop_compile_s, decode_s, _ = runner.loop(state, np.iinfo(np.int32).max)
        timings = {}
    else:
        state, loop_compile_s, decode_s, timings = decode_auto(plan.controller, runner, state)
        plan.controller.save_rounds()  # the costs the next run plans with
    timings = dict(
        compile_seconds=prefill_compile_s + loop_compile_s,
        prefill_seconds=prefill_s,
        decode_seconds=decode_s,
        **timings,
    )
    return state, timings, plan


def model_stop_ids(target) -> list[int] | None:
    """The target tokenizer's stop tokens (eos, eot, the family's end tokens), or None without one."""
    tokenizer = getattr(target, "tokenizer", None)
    return None if tokenizer is None else list(tokenizer.stop_ids)


def one_or_many(prompts):
    """[prompts] where prompts is one prompt (a text, or a conversation: a list of message
    dicts); anything else (a list of prompts) as it is."""
    one = isinstance(prompts, str) or (
        isinstance(prompts, list | tuple) and prompts and isinstance(prompts[0], dict)
    )
    return [prompts] if one else prompts


def token_prompts(target, prompts) -> list:
    """generate's prompts as token-id lists: a text (or a list of them) by the target's
    tokenizer, a conversation ([{"role", "content"}, ...], or a list of them) through its chat
    template (spec_jax.request.encode_prompt), token-id lists as they are (validate checks
    them). RequestError naming the prompt where the model has no tokenizer (or no chat
    template) to read it."""
    prompts = one_or_many(prompts)
    if not isinstance(prompts, list | tuple):
        return prompts  # validate names it
    is_text = [
        isinstance(p, str) or (isinstance(p, list | tuple) and any(isinstance(m, dict) for m in p))
        for p in prompts
    ]
    return [
        encode_prompt(target, request_for(p)) if text else p for p, text in zip(prompts, is_text, strict=True)
    ]


def generate(target, prompts, **options) -> Generation:
    """Generates up to max_new_tokens after each prompt, speculatively when a draft is given.

    Args:
      target: a models.Model.
      prompts: a text, a conversation ([{"role": str, "content": str}, ...], rendered with the
        target's chat template: target.tokenizer.encode_chat), or a list of texts,
        conversations and token-id lists (ragged lengths are fine); texts need the target's
        tokenizer.
      draft: None (plain autoregressive decoding), a models.Model, or a (drafter, params) pair
        such as spec_jax.drafting.ngram.fit_bigram returns (see as_drafter).
      gamma: draft tokens per round (static: a new gamma compiles a new loop), or "auto"
        (the default; spec_jax.autogamma; with a draft head's acceptance head, the most it
        may draft, 8).
      max_new_tokens: new tokens per prompt at most (default 64).
      temperature, top_k, top_p: the warp, applied identically to target and draft; any
        positive temperature samples (0, the default, is greedy). Each is one value for every
        prompt, or a sequence of one value per prompt: each row is warped by its own settings
        (operands of the one compiled loop: a new value compiles nothing).
      seed, row_ids: row b draws its randomness from fold_in(key(seed), row_ids[b]) alone
        (row_ids default 0..B-1), so a prompt's sample does not depend on the other prompts of
        its batch: pass each prompt's index in a larger list to make batching invisible.
      eos_id: "auto" (the default: the target tokenizer's stop_ids, none without a tokenizer),
        None, one token id, or a sequence of them: a row stops after generating any of them.
      mesh: None (one device: a 1x1 mesh) or a Mesh with axes ("data", "model")
        (spec_jax.sharding.make_mesh): both models and both caches are sharded by
        spec_jax.sharding's rule table and the loop runs under one jit with explicit in/out
        shardings. The batch is padded to a multiple of the data axis with rows that are done
        from the start. Place models once with spec_jax.sharding.place(model, mesh); unplaced
        models are placed on first use and cached. Tokens equal the unsharded run's (up to
        float reassociation in the sharded matmuls).
      verify_widths: for drafters that may propose fewer than gamma drafts, which widths the
        target's verification call may take (spec_jax.plan.resolve_verify_widths): "auto",
        "ends", "all", "doubling" (1, 2^k + 1 and gamma + 1: the copying drafters' "auto").
      tree: 0 (each round verifies a chain of gamma drafts) or N in [1, MAX_TREE_NODES]: each
        round verifies the drafter's token tree of up to N nodes (Drafter.propose_tree; by
        default the chain of N drafts; a draft model's is EAGLE-2's dynamic tree, shaped by
        its tree_depth and tree_width: spec_jax.drafting.model.ModelDrafter) in one target call
        with a tree mask (spec_jax.tree); gamma is then not used. "auto": each chunk of rounds
        runs plain decoding, a chain of 1..8 drafts or a tree of 4, 8 or 16 nodes, whichever
        promises the most tokens per second (spec_jax.autogamma.TreeController); gamma is then
        auto, whatever it says.
      logprobs: None, or k in [0, 20]: Generation.logprobs holds each new token's
        log-probability under the target (raw: log_softmax of its logits before the warp, from
        the call that verified the token; spec_jax.logprobs) and the k most probable tokens'.

    Returns:
      Generation(tokens, stats, text, logprobs): text, each prompt's new text (special tokens
      skipped; None without a tokenizer); logprobs, each prompt's TokenLogprobs (None unless
      asked). stats holds the metrics schema of spec_jax.metrics, the
      timings compile_seconds, prefill_seconds, decode_seconds, tokens_per_second (new tokens
      over prefill + decode), and num_new_tokens; stats["nonfinite_logits"] flags, per prompt,
      a row that stopped early because the target's logits became NaN or infinite
      (Generation.nonfinite_rows lists them).
    """
    prompts = token_prompts(target, prompts)
    options = Options(**options)
    state, timings, plan = _run(target, prompts, options)
    return _generation(target, state, timings, plan, len(prompts), options.logprobs)


def _generation(
    target, state: SpecState, timings: dict, plan: Plan, num_rows: int, logprobs: int | None = None
) -> Generation:
    """generate's Generation of the final loop state for its first num_rows rows (the rest pad
    the data axis): the new tokens, the metrics, timings and rates, the text."""
    out, counts, nonfinite, metrics = sharding.fetch(
        (state.out.tokens, state.out.num_generated, state.out.nonfinite, state.metrics)
    )
    new_tokens = [out[i, : counts[i]].tolist() for i in range(num_rows)]
    total = int(counts[:num_rows].sum())
    stats = metrics.to_dict(plan.sources)
    stats.update(
        timings,
        num_new_tokens=total,
        tokens_per_second=total / (timings["prefill_seconds"] + timings["decode_seconds"]),
    )
    stats[NONFINITE] = nonfinite[:num_rows].tolist()
    kept = None
    if logprobs is not None:
        lp, ids, values = sharding.fetch((state.out.logprobs, state.out.top_ids, state.out.top_logprobs))
        kept = [
            TokenLogprobs.of(t, lp[i, : len(t)], ids[i, : len(t)], values[i, : len(t)], logprobs)
            for i, t in enumerate(new_tokens)
        ]
    return Generation(tokens=new_tokens, stats=stats, text=decoded(target, new_tokens), logprobs=kept)


def decoded(target, tokens: list[list[int]]) -> list[str] | None:
    """Each token list's text by the target's tokenizer (special tokens skipped), or None
    without one."""
    tokenizer = getattr(target, "tokenizer", None)
    return None if tokenizer is None else [tokenizer.decode(t, skip_special_tokens=True) for t in tokens]


def stream(
    target, prompts, draft=None, *, gamma="auto", tree=0, max_batch=8, mesh=None, **fields
) -> Iterator[tuple[int, Update]]:
    """Generates for each prompt on an Engine, yielding its tokens as chunks of rounds finish.

    Args:
      target, draft, gamma, tree, mesh: as generate's.
      prompts: a text, a conversation, token ids, or a list of them.
      max_batch: the engine's row slots (prompts beyond them wait for a free one).
      **fields: the Request's (max_tokens, temperature, top_k, top_p, seed, stop, stop_ids,
        speculate, logprobs), one value for every prompt; the defaults are Request's (greedy,
        the model's stop tokens).

    Yields:
      (prompt index, spec_jax.updates.Update): the prompt's new token ids and text since its
      last Update; its last has finished set. Each prompt's tokens equal generate's for it
      alone with the same settings (seed: its own, row id 0).
    """
    prompts = list(one_or_many(prompts))
    # Admitted once, against the target's context: the engine below is sized to hold them.
    limits = Limits(target.config.max_seq_len)
    admitted = [request_for(p, **fields).admit(target, limits) for p in prompts]
    ids, new = [list(a.ids) for a in admitted], admitted[0].request.max_tokens  # one for all
    context = rows.stream_context(target.config, ids, new)  # launch.generate --stream's rule
    engine = engine_lib.Engine(
        target,
        draft,
        max_batch=max_batch,
        gamma=gamma,
        tree=tree,
        mesh=mesh,
        max_context=context,
        max_new_tokens=new,
        prefix_cache_mb=0,  # generate's prefill program: without the prefix cache's pool
    )
    index = {engine.submit(a).id: i for i, a in enumerate(admitted)}
    for update in engine.drain():
        yield index[update.handle.id], update
