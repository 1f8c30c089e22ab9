"""`spec_jax.generate`: the one entry point for autoregressive and speculative decoding.

One path: the drafter is chosen up front (None -> NoDrafter with gamma 0, plain decoding), and
"no mesh" is a 1x1 mesh on the default device, so every call places its arguments by the same
sharding rules and runs the same two compiled programs (prefill, loop).
"""

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.settings import is_int, is_number
from spec_jax import autogamma, sharding
from spec_jax.decode import PrefillInputs, bucket_length, pad_prompts
from spec_jax.drafters import ModelDrafter, NoDrafter, check_gamma, resumable, sources_of
from spec_jax.executables import compiled
from spec_jax.head_drafter import HeadDrafter
from spec_jax.metrics import NONFINITE, nonfinite_rows
from spec_jax.sampling import SamplingParams, row_keys
from spec_jax.speculative import SpecState, SpecStatic, committed_text, spec_loop, spec_prefill


@dataclasses.dataclass
class Generation:
    """tokens: the new tokens of each prompt (the stop token included when hit); stats: the
    metrics of spec_jax.metrics and timings."""

    tokens: list[list[int]]
    stats: dict[str, Any]

    @property
    def nonfinite_rows(self) -> list[int]:
        """The prompts whose target logits became non-finite (NaN or inf): each stopped there,
        its tokens are those before (spec_jax.metrics.NONFINITE)."""
        return nonfinite_rows(self.stats)


def stop_id_list(eos_id, vocab: int) -> list[int]:
    """eos_id (None, one token id, or a sequence of them) as a list; ValueError naming eos_id
    unless every id is an integer in [0, vocab)."""
    ids = [] if eos_id is None else [eos_id] if not isinstance(eos_id, Sequence) else list(eos_id)
    for i in ids:
        if not is_int(i) or not 0 <= i < vocab:
            raise ValueError(f"eos_id must be None or integer token ids in [0, {vocab}), got {eos_id!r}")
    return ids


def validate(target, prompts, drafter, gamma, max_new_tokens, eos_id):
    """Raises ValueError naming the argument and its allowed range (drafter: a drafter or None)."""
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
    if not is_int(max_new_tokens) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > target.config.max_seq_len:
        raise ValueError(
            f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the target's "
            f"context of {target.config.max_seq_len} tokens"
        )
    stop_id_list(eos_id, vocab)
    if drafter is None:
        return
    shown = gamma
    if gamma == "auto":
        gamma, shown = autogamma.GAMMA_MAX, f"'auto' (up to {autogamma.GAMMA_MAX})"
    elif not is_int(gamma) or gamma < 1:
        raise ValueError(f"gamma must be an integer >= 1 or 'auto', got {gamma!r}")
    if drafter.vocab_size != vocab:
        raise ValueError(
            f"draft vocabulary size ({drafter.vocab_size}) differs from the target's ({vocab}); "
            "speculative decoding needs one shared vocabulary"
        )
    contexts = {"the target's": target.config.max_seq_len, "the draft's": drafter.max_seq_len}
    check_gamma(gamma, longest, max_new_tokens, contexts, shown=shown)


def layout(config, prompts, max_new_tokens: int, gamma: int) -> tuple[int, int]:
    """(prompt width, cache length): prompts are right-padded to their length bucket (capped so
    the cache fits the model's context), and the cache holds the width, the new tokens and
    the gamma drafts a last round may write past them (gamma = 0 for plain decoding)."""
    longest = max(len(p) for p in prompts)
    width = min(bucket_length(longest), max(longest, config.max_seq_len - max_new_tokens))
    return width, width + max_new_tokens + gamma


def as_drafter(draft):
    """(drafter, params): a Model becomes (ModelDrafter(config), its params); a (drafter,
    params) pair (e.g. from spec_jax.ngram.fit_bigram) is used as it is."""
    if hasattr(draft, "config") and hasattr(draft, "params"):
        draft = ModelDrafter(draft.config), draft.params
    if not (isinstance(draft, tuple) and len(draft) == 2):
        raise ValueError(
            "draft must be None, a models.Model or a (drafter, params) pair "
            f"(a spec_jax.drafters.Drafter and its arrays); got {type(draft).__name__}"
        )
    drafter, params = draft
    if not all(hasattr(drafter, a) for a in ("vocab_size", "max_seq_len", "init", "propose")):
        raise ValueError(
            f"draft's drafter must implement spec_jax.drafters.Drafter; got {type(drafter).__name__}"
        )
    return drafter, params


DRAFTERS = ("model", "head", "prompt_lookup", "suffix", "hybrid", "unigram", "bigram")


def make_draft(
    kind: str, target, *, draft=None, max_ngram: int = 3, threshold: float = 0.0, sequences=None, tables=None
):
    """The (drafter, params) pair of a drafter kind, for generate's `draft`:
      model          the draft model `draft` (a models.Model or a (ModelDrafter, params) pair, e.g.
                     a vocabulary-trimmed one), stopping each row below `threshold` (0: never)
      head           a draft head on the target's features: `draft` is a (HeadDrafter, HeadParams)
                     pair (experiments.heads.load_drafter reads a trained one), stopping each row
                     below `threshold`
      prompt_lookup  spec_jax.lookup.PromptLookupDrafter(max_ngram): no model
      suffix         spec_jax.suffix.SuffixDrafter(max_ngram, threshold): the row's own text, and
                     `tables` (spec_jax.suffix.SuffixTables), or tables fitted on `sequences`, if
                     given; a row stops where the top successor frequency is below `threshold`
      hybrid         prompt lookup, and the draft model where it finds nothing
      unigram, bigram  n-gram tables fitted on `sequences` (token-id lists; spec_jax.ngram)
    ValueError naming the argument and its allowed values otherwise.
    """
    from spec_jax import lookup, ngram, suffix

    if kind not in DRAFTERS:
        raise ValueError(f"drafter must be one of {', '.join(DRAFTERS)}, got {kind!r}")
    if not is_int(max_ngram) or not 1 <= max_ngram <= lookup.MAX_NGRAM_LIMIT:
        raise ValueError(f"max_ngram must be an integer in [1, {lookup.MAX_NGRAM_LIMIT}], got {max_ngram!r}")
    if not is_number(threshold) or not 0.0 <= threshold < 1.0:
        raise ValueError(
            f"threshold must be a number in [0, 1) (0: drafts never stop early), got {threshold!r}"
        )
    vocab = target.config.vocab_size
    if kind in ("unigram", "bigram"):
        if sequences is None:
            raise ValueError(f"drafter {kind!r} needs sequences (token-id lists) to fit its table on")
        return (
            ngram.fit_unigram(sequences, vocab) if kind == "unigram" else ngram.fit_bigram(sequences, vocab)
        )
    if kind == "suffix":
        if tables is None and sequences is not None:
            tables = suffix.fit_suffix_tables(sequences, vocab, max_ngram)
        if tables is not None and not isinstance(tables, suffix.SuffixTables):
            raise ValueError(f"tables must be a spec_jax.suffix.SuffixTables, got {type(tables).__name__}")
        return suffix.SuffixDrafter(vocab, max_ngram, float(threshold)), (() if tables is None else tables)
    if kind == "head":
        drafter, params = as_drafter(draft) if draft is not None else (None, None)
        if not isinstance(drafter, HeadDrafter):
            raise ValueError(
                "drafter 'head' needs a (HeadDrafter, HeadParams) pair as draft "
                "(experiments.heads.load_drafter reads a trained head)"
            )
        return dataclasses.replace(drafter, threshold=float(threshold)), params
    prompt_lookup = lookup.PromptLookupDrafter(vocab, max_ngram)
    if kind == "prompt_lookup":
        return prompt_lookup, ()
    if draft is None:
        raise ValueError(f"drafter {kind!r} needs a draft model")
    model, params = as_drafter(draft)
    if not isinstance(model, ModelDrafter):
        raise ValueError(f"drafter {kind!r} needs a draft model, got a {type(model).__name__}")
    model = dataclasses.replace(model, threshold=float(threshold))
    if kind == "model":
        return model, params
    return lookup.HybridDrafter(prompt_lookup, model), params


VERIFY_WIDTHS = ("auto", "ends", "all")


def resolve_verify_widths(verify_widths: str, drafter) -> str:
    """SpecStatic.verify_widths for generate's setting: "ends" (the target scores 1 or gamma + 1
    positions) or "all" (any width up to gamma + 1: the narrowest that covers the round's
    drafts; one compiled branch per width). "auto" is "all" for a drafter whose learned stop
    makes short drafts common (a draft head with an acceptance head), else "ends"."""
    if verify_widths not in VERIFY_WIDTHS:
        raise ValueError(f"verify_widths must be one of {', '.join(VERIFY_WIDTHS)}, got {verify_widths!r}")
    if verify_widths == "auto":
        return "all" if getattr(drafter, "stop_rejection", 0) > 0 else "ends"
    return verify_widths


def _prefill_marking_padding_done(static, params, draft_params, inputs, active_b) -> SpecState:
    """spec_prefill with the rows where active is False marked done: rows added only to fill the
    data axis never run a round or count in the metrics."""
    state = spec_prefill(static, params, draft_params, inputs)
    return state.replace(out=state.out.replace(done=state.out.done | ~active_b))


def _shardings_of(tree):
    return jax.tree.map(lambda x: x.sharding, tree)


def run(
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
    row_ids=None,
    eos_id=None,
    mesh: jax.sharding.Mesh | None = None,
    verify_widths: str = "auto",
) -> tuple[SpecState, dict]:
    """What generate does, returning the final loop state as device arrays (caches included,
    with their shardings; rows past len(prompts) pad the data axis) and the timings dict."""
    sampling = SamplingParams(float(temperature), top_k, float(top_p))
    drafter, draft_params = (None, None) if draft is None else as_drafter(draft)
    validate(target, prompts, drafter, gamma, max_new_tokens, eos_id)
    num_rows = len(prompts)
    row_ids = np.arange(num_rows) if row_ids is None else np.asarray(row_ids)
    if row_ids.shape != (num_rows,) or not np.issubdtype(row_ids.dtype, np.integer) or row_ids.min() < 0:
        raise ValueError(f"row_ids must be {num_rows} non-negative integers (one per prompt), got {row_ids}")
    if gamma == "auto" and getattr(drafter, "stop_rejection", 0) > 0:
        gamma = autogamma.GAMMA_MAX  # an acceptance head decides each round's length: gamma is its cap
    auto = gamma == "auto" and drafter is not None
    if drafter is None:
        drafter, gamma = NoDrafter(target.config.vocab_size), 0
    elif auto:
        gamma = autogamma.GAMMA_MAX  # the cache and the metrics are sized for the largest gamma

    mesh = sharding.default_mesh() if mesh is None else mesh
    sharding.check_mesh(mesh)
    padding = -num_rows % mesh.shape[sharding.DATA]
    prompts = list(prompts) + [prompts[0]] * padding
    row_ids = np.concatenate([row_ids, np.zeros(padding, row_ids.dtype)])
    batch = len(prompts)
    width, cache_len = layout(target.config, prompts, max_new_tokens, gamma)
    controller = None
    if auto:
        costs = autogamma.costs_for(target, drafter, draft_params, batch=batch, cache_slots=cache_len)
        controller = autogamma.Controller(costs, gamma, batch=batch, resumable=resumable(drafter))
        if controller.phase == "never":  # drafting would not pay even with a good draft: never run it
            drafter, draft_params = NoDrafter(target.config.vocab_size), None
    tokens, lens = pad_prompts(prompts, width)
    inputs = PrefillInputs(
        tokens=jnp.asarray(tokens),
        prompt_lens=jnp.asarray(lens),
        stop_ids=jnp.asarray(stop_id_list(eos_id, target.config.vocab_size) or [-1], jnp.int32),
        keys=row_keys(jax.random.key(seed), row_ids),
    )
    inputs = sharding.put(inputs, sharding.state_shardings(inputs, mesh, batch))
    active = sharding.put(np.arange(batch) < num_rows, sharding.batch_sharding(mesh, 1))
    target_params = sharding.placed_params(target, mesh)
    model_drafter = drafter.model if hasattr(drafter, "model") else drafter  # a hybrid's model
    if isinstance(model_drafter, ModelDrafter):
        if model_drafter.trimmed:  # the model's parameters by the rule table, the trimmed head replicated
            draft_params = draft_params.replace(
                model=sharding.place_params(draft_params.model, mesh),
                head=sharding.put(
                    draft_params.head, jax.tree.map(lambda _: sharding.replicated(mesh), draft_params.head)
                ),
            )
        elif hasattr(draft, "config"):
            draft_params = sharding.placed_params(draft, mesh)
        else:  # a (drafter, params) pair, e.g. make_draft's
            draft_params = sharding.place_params(draft_params, mesh)
        placed = dataclasses.replace(model_drafter, config=sharding.for_mesh(model_drafter.config, mesh))
        drafter = placed if drafter is model_drafter else dataclasses.replace(drafter, model=placed)
    elif isinstance(drafter, HeadDrafter):  # the head by the rule table, the target's tables as the target's
        draft_params = draft_params.replace(
            head=sharding.place_params(draft_params.head, mesh),
            embed=sharding.place_params({"embed": {"embedding": draft_params.embed}}, mesh)["embed"][
                "embedding"
            ],
            out=sharding.put(
                draft_params.out, jax.tree.map(lambda _: sharding.replicated(mesh), draft_params.out)
            ),
        )
        drafter = dataclasses.replace(drafter, config=sharding.for_mesh(drafter.config, mesh))
    elif draft_params is not None:  # other drafters' arrays (tables): replicated
        draft_params = sharding.put(
            draft_params, jax.tree.map(lambda _: sharding.replicated(mesh), draft_params)
        )

    config = sharding.for_mesh(target.config, mesh)
    widths = resolve_verify_widths(verify_widths, drafter)
    static = SpecStatic(config, drafter, sampling, gamma, max_new_tokens, cache_len, widths)
    prefill_args = (target_params, draft_params, inputs, active)
    prefill_fn, prefill_compile_s = compiled(
        "spec_prefill",
        _prefill_marking_padding_done,
        static,
        prefill_args,
        in_shardings=_shardings_of(prefill_args),
        out_shardings=lambda state_shape: sharding.state_shardings(state_shape, mesh, batch),
    )
    start = time.perf_counter()
    state = jax.block_until_ready(prefill_fn(*prefill_args))
    prefill_s = time.perf_counter() - start

    def run_loop(static, draft_params, state, max_rounds):
        rounds = sharding.put(jnp.asarray(max_rounds, jnp.int32), sharding.replicated(mesh))
        loop_args = (target_params, draft_params, state, inputs.stop_ids, rounds)
        in_shardings = _shardings_of(loop_args)
        loop_fn, compile_s = compiled(
            "spec_loop",
            spec_loop,
            static,
            loop_args,
            donate_argnums=(2,),
            in_shardings=in_shardings,
            out_shardings=in_shardings[2],
        )
        start, work = time.perf_counter(), autogamma.work_clock()
        state = jax.block_until_ready(loop_fn(*loop_args))
        return state, compile_s, time.perf_counter() - start, autogamma.work_clock() - work

    def resume(draft_params, draft_state, state, synced_b, width):
        """(the drafter's state caught up on the text committed without it, compile seconds,
        autogamma.work_clock seconds of the run)."""
        synced = sharding.put(np.asarray(synced_b, np.int32), sharding.batch_sharding(mesh, 1))
        args = (draft_params, draft_state, inputs.tokens, inputs.prompt_lens, state.out.tokens, state.length)
        args += (synced,)
        in_shardings = _shardings_of(args)
        fn, compile_s = compiled(
            "drafter_resume",
            _resume_drafter,
            (static.drafter, cache_len, width),
            args,
            in_shardings=in_shardings,
            out_shardings=in_shardings[1],
        )
        start = autogamma.work_clock()
        draft_state = jax.block_until_ready(fn(*args))
        return draft_state, compile_s, autogamma.work_clock() - start

    if controller is None:
        state, loop_compile_s, decode_s, _ = run_loop(static, draft_params, state, np.iinfo(np.int32).max)
        timings = {}
    else:
        state, loop_compile_s, decode_s, timings = _decode_auto(
            controller, static, draft_params, state, inputs, run_loop, resume
        )
    timings = dict(
        compile_seconds=prefill_compile_s + loop_compile_s,
        prefill_seconds=prefill_s,
        decode_seconds=decode_s,
        **timings,
    )
    return state, timings


def _resume_drafter(
    static, draft_params, draft_state, tokens_bp, prompt_lens_b, out_tokens_bn, length_b, synced_b
):
    """The drafter's `resume` on the committed text. static: (drafter, cache length, width)."""
    drafter, cache_len, width = static
    text_bs = committed_text(tokens_bp, prompt_lens_b, out_tokens_bn, length_b, cache_len)
    return drafter.resume(draft_params, draft_state, text_bs, synced_b, length_b, width)


def _decode_auto(controller, static, draft_params, state, inputs, run_loop, resume):
    """gamma=auto's host loop: chunks of rounds, each gamma chosen by the controller
    (spec_jax.autogamma) from the chunks before it. Plain chunks run without the drafter, whose
    state waits aside; before it drafts again it catches up on the text committed meanwhile.

    Returns (state, compile seconds, decode seconds: the wall time of all chunks, catch-ups and
    the host's work between them, compilation excluded, {"gamma_schedule": [[gamma, rounds],
    ...] (consecutive chunks of one gamma merged), "resume_seconds": what the catch-ups took by
    autogamma.work_clock}). The controller sees each chunk's time by work_clock.
    """
    drafter, plain = static.drafter, NoDrafter(static.config.vocab_size)
    stash = None  # the drafter's state while plain chunks run without it
    fetch = sharding.fetch
    # The drafter's state follows the text below `synced` (prefill: the prompt).
    synced = np.asarray(fetch(inputs.prompt_lens)).astype(np.int64)
    compile_s = resume_s = 0.0
    schedule: list[list[int]] = []

    def observed(state):
        m = state.metrics
        return fetch(
            (state.out.done, state.out.num_generated, state.length)
            + (m.row_overlap_sum, m.row_overlap_count, m.target_calls)
        )

    start = time.perf_counter()
    before = observed(state)
    while not bool(np.all(before[0])):
        done, generated, length = before[:3]
        remaining = np.where(done, 0, static.max_new_tokens - generated)
        gamma, rounds = controller.next_chunk(remaining)
        if gamma == 0 and stash is None and drafter is not plain:
            stash, state = state.draft_state, state.replace(draft_state=())
        if gamma and stash is not None:
            # The drafter catches up on the last RESUME_WINDOW positions at most: a model
            # drafter's cache then holds stale entries before them, which changes its drafts
            # and acceptance but never the output (the rule is exact for any draft).
            synced = np.maximum(synced, length - 2 - autogamma.RESUME_WINDOW)
            gap = int(np.max(np.where(done, 0, length - 2 - synced), initial=0))
            if gap > 0:
                width = min(autogamma.RESUME_WIDTH, 1 << (gap - 1).bit_length())
                stash, c, seconds = resume(draft_params, stash, state, synced, width)
                compile_s, resume_s = compile_s + c, resume_s + seconds
                controller.observe_resume(seconds, -(-gap // width))
            state, stash = state.replace(draft_state=stash), None
        chunk_static = dataclasses.replace(static, drafter=drafter if gamma else plain, gamma=gamma)
        state, c, _, seconds = run_loop(chunk_static, draft_params if gamma else None, state, rounds)
        compile_s += c
        after = observed(state)
        controller.observe(
            autogamma.Chunk(
                gamma=gamma,
                rounds=int(after[5] - before[5]),
                seconds=seconds,
                active_b=~done,
                committed_b=after[1] - generated,
                overlap_b=after[3] - before[3],
                scored_b=after[4] - before[4],
                remaining_b=np.where(after[0], 0, static.max_new_tokens - after[1]),
            )
        )
        if gamma:  # its last round began at most gamma + 1 tokens back
            synced = np.maximum(synced, after[2] - gamma - 1)
        if schedule and schedule[-1][0] == gamma:
            schedule[-1][1] += int(after[5] - before[5])
        else:
            schedule.append([gamma, int(after[5] - before[5])])
        before = after
    decode_s = time.perf_counter() - start - compile_s
    return state, compile_s, decode_s, {"gamma_schedule": schedule, "resume_seconds": resume_s}


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
    row_ids=None,
    eos_id=None,
    mesh: jax.sharding.Mesh | None = None,
    verify_widths: str = "auto",
) -> Generation:
    """Generates up to max_new_tokens after each prompt, speculatively when a draft is given.

    Args:
      target: a models.Model.
      prompts: list of token-id lists (ragged lengths are fine).
      draft: None (plain autoregressive decoding), a models.Model, or a (drafter, params) pair
        such as spec_jax.ngram.fit_bigram returns (see as_drafter).
      gamma: draft tokens per round (static: a new gamma compiles a new loop), or "auto"
        (spec_jax.autogamma; with a draft head's acceptance head, the most it may draft, 8).
      temperature, top_k, top_p: the warp, applied identically to target and draft; any
        positive temperature samples (0 is greedy).
      seed, row_ids: row b draws its randomness from fold_in(key(seed), row_ids[b]) alone
        (row_ids default 0..B-1), so a prompt's sample does not depend on the other prompts of
        its batch: pass each prompt's index in a larger list to make batching invisible.
      eos_id: None, one token id, or a sequence of them (e.g. tokenizer.stop_ids): a row stops
        after generating any of them.
      mesh: None (one device: a 1x1 mesh) or a Mesh with axes ("data", "model")
        (spec_jax.sharding.make_mesh): both models and both caches are sharded by
        spec_jax.sharding's rule table and the loop runs under one jit with explicit in/out
        shardings. The batch is padded to a multiple of the data axis with rows that are done
        from the start. Place models once with spec_jax.sharding.place(model, mesh); unplaced
        models are placed on first use and cached. Tokens equal the unsharded run's (up to
        float reassociation in the sharded matmuls).
      verify_widths: for drafters that may propose fewer than gamma drafts, which widths the
        target's verification call may take (resolve_verify_widths): "auto", "ends", "all".

    Returns:
      Generation(tokens, stats). stats holds the metrics schema of spec_jax.metrics, the
      timings compile_seconds, prefill_seconds, decode_seconds, tokens_per_second (new tokens
      over prefill + decode), and num_new_tokens; stats["nonfinite_logits"] flags, per prompt,
      a row that stopped early because the target's logits became NaN or infinite
      (Generation.nonfinite_rows lists them).
    """
    state, timings = run(
        target,
        prompts,
        draft=draft,
        gamma=gamma,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        row_ids=row_ids,
        eos_id=eos_id,
        mesh=mesh,
        verify_widths=verify_widths,
    )
    num_rows = len(prompts)
    out, counts, nonfinite, metrics = sharding.fetch(
        (state.out.tokens, state.out.num_generated, state.out.nonfinite, state.metrics)
    )
    new_tokens = [out[i, : counts[i]].tolist() for i in range(num_rows)]
    total = int(counts[:num_rows].sum())
    stats = metrics.to_dict(() if draft is None else sources_of(as_drafter(draft)[0]))
    stats.update(
        timings,
        num_new_tokens=total,
        tokens_per_second=total / (timings["prefill_seconds"] + timings["decode_seconds"]),
    )
    stats[NONFINITE] = nonfinite[:num_rows].tolist()
    return Generation(tokens=new_tokens, stats=stats)
