"""The engine's row bookkeeping (spec_jax.engine): a request on the host (Row); the table's
rows as a loop state of any row count (batch_axes: which axis of each leaf holds the rows;
resize, move_row: compaction, write_rows: admitted requests' prefilled rows, mark_done:
freed rows); the admitted requests' prefill inputs (group_inputs); the checks of the slots'
context (slot_context, check_room); and the text a row may hand out (visible_text: stop
strings and partial characters held back).
"""

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.settings import is_int
from spec_jax import sharding
from spec_jax.decode import PAD_ID, PrefillInputs, layout
from spec_jax.logprobs import TokenLogprobs
from spec_jax.request import MAX_STOP_IDS, Request, RequestError, stop_row
from spec_jax.sampling import RowSampling, SamplingParams, row_keys
from spec_jax.speculative import SpecState

DEFAULT_CONTEXT = 2048  # tokens per slot (prompt + new tokens) unless max_context says otherwise


@dataclasses.dataclass
class Row:
    """A request on the host: waiting (slot None) or in a slot."""

    handle: Any  # its spec_jax.engine.Handle
    prompt_ids: list[int]
    stop_ids: tuple[int, ...]
    submitted: float
    row_id: int = 0  # the request's keys: fold_in(key(seed), row_id)
    slot: int | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)
    sent_tokens: int = 0  # tokens already handed out in Updates
    sent_text: str = ""  # text already handed out
    first_token_at: float | None = None
    logprobs: TokenLogprobs | None = None  # of tokens (as far as read), where the request asks
    prompt_logprobs: TokenLogprobs | None = None  # the prompt's, until handed out


def batch_axes(shapes_a, shapes_b) -> tuple[int, ...]:
    """The axis that indexes the rows of each leaf (in tree_flatten order; -1: a leaf the rows
    share), from the shapes of one tree built at two batch sizes (jax.eval_shape of one
    program): the axis where they differ. No leaf is taken for a row by the coincidence of a
    size (a [G] metric with G == B, a leading axis of 1)."""
    axes = []
    for a, b in zip(jax.tree.leaves(shapes_a), jax.tree.leaves(shapes_b), strict=True):
        differ = [i for i, (x, y) in enumerate(zip(a.shape, b.shape, strict=True)) if x != y]
        axes.append(differ[0] if differ else -1)
    return tuple(axes)


def _by_leaf(fn, axes: tuple[int, ...], table, *others):
    """table with fn(leaf, axis, *the others' leaves) for each leaf that has rows (axes:
    batch_axes); the leaves the rows share keep the table's."""
    leaves, treedef = jax.tree.flatten(table)
    other_leaves = [jax.tree.leaves(o) for o in others]
    out = [
        t if axis < 0 else fn(t, axis, *(o[i] for o in other_leaves))
        for i, (t, axis) in enumerate(zip(leaves, axes, strict=True))
    ]
    return treedef.unflatten(out)


def resize(table, blank, axes: tuple[int, ...], n: int):
    """table (a loop state or its drafter's state) with n rows: its first n, or all of its rows
    followed by copies of blank's one row (a free row: done) up to n."""

    def one(t, axis, r):
        have = t.shape[axis]
        if n <= have:
            return jax.lax.slice_in_dim(t, 0, n, axis=axis)
        return jnp.concatenate([t] + [r] * (n - have), axis=axis)

    return _by_leaf(one, axes, table, blank)


def move_row(table, axes: tuple[int, ...], src, dst):
    """table with row src copied into row dst (int32 scalars); row src is left as it was."""

    def one(t, axis):
        return jax.lax.dynamic_update_slice_in_dim(
            t, jax.lax.dynamic_slice_in_dim(t, src, 1, axis), dst, axis
        )

    return _by_leaf(one, axes, table)


def take_row(table, axes: tuple[int, ...], i):
    """table's row i (an int32 scalar) as a table of one row; the shared leaves are table's."""
    return _by_leaf(lambda t, axis: jax.lax.dynamic_slice_in_dim(t, i, 1, axis), axes, table)


def write_rows(table, block, axes: tuple[int, ...], slots):
    """table with row slots[i] replaced by block's row i (block: the same tree at another batch,
    e.g. a prefill's; slots: int32 [block's rows], a slot past the table's rows drops that
    row), along each leaf's row axis; the leaves the rows share keep the table's. Nothing of a
    row's previous occupant survives."""

    def one(t, axis, r):
        return t.at[(slice(None),) * axis + (slots,)].set(r, mode="drop")

    return _by_leaf(one, axes, table, block)


def mark_done(state: SpecState, rows_b) -> SpecState:
    """state with the rows of rows_b (bool [B]) done: the loop commits nothing more for them."""
    return state.replace(out=state.out.replace(done=state.out.done | rows_b))


resize_jit = jax.jit(resize, static_argnums=(2, 3))
move_row_jit = jax.jit(move_row, static_argnums=1, donate_argnums=0)
take_row_jit = jax.jit(take_row, static_argnums=1)
write_rows_jit = jax.jit(write_rows, static_argnums=2, donate_argnums=0)
mark_done_jit = jax.jit(mark_done, donate_argnums=0)
row_keys_jit = jax.jit(row_keys)  # compiled once, not traced per admission


def table_counters(state: SpecState) -> np.ndarray:
    """The table's scalar counters on the host, int [3]: target calls (rounds), draft tokens,
    accepted tokens (no admission writes them, so their differences count a chunk's work)."""
    m = state.metrics
    return np.asarray(sharding.fetch((m.target_calls, m.num_draft_tokens, m.num_accepted_tokens)))


def stop_ids_for(request: Request, tokenizer, vocab: int) -> tuple[int, ...]:
    """The request's stop ids: its own (RequestError naming stop_ids where one is past the
    vocabulary of `vocab` tokens), or the model's stop tokens (none without a tokenizer)."""
    if request.stop_ids is None:
        return tuple(tokenizer.stop_ids) if tokenizer is not None else ()
    if any(i >= vocab for i in request.stop_ids):
        raise RequestError(
            "stop_ids", f"stop_ids must be token ids in [0, {vocab}), got {list(request.stop_ids)}"
        )
    return tuple(request.stop_ids)


def group_inputs(group: list[Row], width: int, batch: int) -> PrefillInputs:
    """The requests of group as PrefillInputs of `batch` rows (>= len(group); the rest are
    one-token PAD_ID prompts, greedy) and the given width, unplaced. Each row's keys and warp
    are its request's alone: fold_in(key(seed), row_id)."""
    tokens = np.full((batch, width), PAD_ID, np.int32)
    lens, budgets = np.ones(batch, np.int32), np.ones(batch, np.int32)
    stops = np.full((batch, MAX_STOP_IDS), -1, np.int32)
    keys = []
    for i, row in enumerate(group):
        tokens[i, : len(row.prompt_ids)] = row.prompt_ids
        lens[i], budgets[i] = len(row.prompt_ids), row.handle.request.max_tokens
        stops[i] = stop_row(row.stop_ids)
        keys.append(
            row_keys_jit(jax.random.key(row.handle.request.seed), np.asarray([row.row_id], np.uint32))
        )
    keys += [row_keys_jit(jax.random.key(0), np.zeros(1, np.uint32))] * (batch - len(group))
    return PrefillInputs(
        tokens=jnp.asarray(tokens),
        prompt_lens=jnp.asarray(lens),
        stop_ids=jnp.asarray(stops),
        keys=jnp.concatenate(keys),
        budgets=jnp.asarray(budgets),
        sampling=RowSampling.of(
            [row.handle.request.sampling for row in group] + [SamplingParams(0.0)] * (batch - len(group))
        ),
        num_logprobs=np.asarray(
            [num_logprobs(row.handle.request) for row in group] + [-1] * (batch - len(group)), np.int32
        ),
    )


def num_logprobs(request: Request) -> int:
    """The request's Output.num_logprobs: -1 (no logprobs), or how many top logprobs it asks."""
    return -1 if request.logprobs is None else int(request.logprobs)


def prefill_key(row: Row, width: int) -> tuple:
    """Everything a request's prefilled row depends on in one engine, but its budget: its prompt,
    the prefill's width, its keys (seed, row id), stop ids, speculation, the warp, and whether
    its budget ends it at the first token, and the logprobs it asks. Two requests of one key get
    the same row, bit for bit (the CPU prefill is row-wise), except for the budget leaf
    (set_budget)."""
    request = row.handle.request
    return (
        tuple(row.prompt_ids),
        width,
        request.seed,
        row.row_id,
        request.max_tokens == 1,
        tuple(row.stop_ids),
        request.speculate,
        request.sampling,
        num_logprobs(request),
    )


def set_budget(state: SpecState, slot, budget) -> SpecState:
    """state with row slot's budget (Output.budget) set to budget (int32 scalars)."""
    return state.replace(out=state.out.replace(budget=state.out.budget.at[slot].set(budget)))


set_budget_jit = jax.jit(set_budget, donate_argnums=0)


def slot_context(target, drafter, gamma: int, max_context) -> int:
    """Tokens per slot: max_context (default min(the target's context, DEFAULT_CONTEXT)),
    checked so that a round's drafts past it (gamma: the engine's static gamma) fit every
    model's context (drafter: None or the drafter). ValueError naming max_context and its
    allowed range."""
    contexts = {"the target's": target.config.max_seq_len}
    if drafter is not None:
        contexts["the draft's"] = drafter.max_seq_len
    owner, context = min(contexts.items(), key=lambda item: item[1])
    tightest = context - gamma
    if max_context is None:
        return min(tightest, DEFAULT_CONTEXT)
    if not is_int(max_context) or not 2 <= max_context <= tightest:
        room = f"{owner} context of {context} tokens" + (
            f" less {gamma} for a round's drafts" if gamma else ""
        )
        raise ValueError(f"max_context must be an integer in [2, {tightest}] ({room}), got {max_context!r}")
    return max_context


def stream_context(config, token_prompts, max_new_tokens: int) -> int:
    """Tokens per slot of an engine that streams these prompts: spec_jax.generate's cache length
    for them less the gamma a round may draft past it (spec_jax.decode.layout), so that the
    engine runs generate's programs (a prompt of any length in the bucket compiles nothing new)
    and a slot holds each prompt and its new tokens."""
    return layout(config, token_prompts, max_new_tokens, 0)[1]


def check_counts(**counts: tuple[Any, int]) -> None:
    """ValueError naming the first setting (name=(value, least)) that is not an integer >= least."""
    for name, (value, least) in counts.items():
        if not is_int(value) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")


def new_token_bound(max_new_tokens, context: int) -> int:
    """The most new tokens a request may ask for: max_new_tokens (default: context), checked to
    be an integer in [1, context]; ValueError naming max_new_tokens and that range."""
    bound = context if max_new_tokens is None else max_new_tokens
    if not is_int(bound) or not 1 <= bound <= context:
        raise ValueError(f"max_new_tokens must be an integer in [1, {context}] (max_context), got {bound!r}")
    return bound


def check_room(
    ids: list[int],
    stop_ids: tuple[int, ...],
    request: Request,
    context: int,
    max_new_tokens: int | None = None,
) -> None:
    """RequestError naming the field at fault unless the prompt (ids) and request.max_tokens fit
    a slot of `context` tokens, request.max_tokens is at most max_new_tokens (default: no
    bound but the slot) and stop_ids holds at most MAX_STOP_IDS ids; returns None."""
    if len(ids) >= context:
        raise RequestError(
            "prompt",
            f"prompt ({len(ids)} tokens) leaves no room in the context of {context} tokens",
        )
    if len(ids) + request.max_tokens > context:
        raise RequestError(
            "max_tokens",
            f"prompt ({len(ids)} tokens) + max_tokens ({request.max_tokens}) exceeds the context of "
            f"{context} tokens",
        )
    if len(stop_ids) > MAX_STOP_IDS:
        raise RequestError("stop_ids", f"at most {MAX_STOP_IDS} stop ids per request, got {len(stop_ids)}")
    if max_new_tokens is not None and request.max_tokens > max_new_tokens:
        raise RequestError(
            "max_tokens", f"max_tokens must be at most {max_new_tokens}, got {request.max_tokens}"
        )


def visible_text(tokenizer, tokens: list[int], stops, final: bool) -> tuple[str, int | None]:
    """(the text of tokens that may be handed out, the token count to cut at or None): stop
    strings (stops) end the text before their match; text that may still become a stop string
    or a multi-byte character waits for more tokens unless final. ("", None) without a
    tokenizer."""
    if tokenizer is None:
        return "", None
    decode = functools.partial(tokenizer.decode, skip_special_tokens=True)
    text = decode(tokens)
    hits = [(text.find(s), s) for s in stops if s in text]
    if hits:
        at = min(hits)[0]
        cut = next(k for k in range(1, len(tokens) + 1) if any(s in decode(tokens[:k]) for s in stops))
        return text[:at], cut
    if final:
        return text, None
    hold = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    text = text[: len(text) - hold]
    return text.rstrip("\ufffd"), None


@dataclasses.dataclass
class HostTable:
    """The host's copy of the table's prompts and stop ids (batch B): what the loop's inputs
    hold for a drafter's catch-up and the stop test, rewritten row by row at admission."""

    tokens: np.ndarray  # int32 [B, width], PAD_ID past each prompt
    prompt_lens: np.ndarray  # int32 [B]
    stop_ids: np.ndarray  # int32 [B, MAX_STOP_IDS], -1 padded

    @classmethod
    def empty(cls, batch: int, width: int) -> "HostTable":
        """B free rows of one-token (PAD_ID) prompts without stop ids."""
        return cls(
            tokens=np.full((batch, width), PAD_ID, np.int32),
            prompt_lens=np.ones(batch, np.int32),
            stop_ids=np.full((batch, MAX_STOP_IDS), -1, np.int32),
        )

    def set_row(self, b: int, ids: list[int], stops) -> None:
        """Row b holds the prompt ids and the stop ids `stops` (int32 [MAX_STOP_IDS], -1 padded)."""
        self.tokens[b] = PAD_ID
        self.tokens[b, : len(ids)] = ids
        self.prompt_lens[b] = len(ids)
        self.stop_ids[b] = stops

    def move(self, src: int, dst: int) -> None:
        """Row dst takes row src's prompt and stop ids; row src becomes a free row."""
        for rows_of in (self.tokens, self.prompt_lens, self.stop_ids):
            rows_of[dst] = rows_of[src]
        self.set_row(src, [PAD_ID], np.full(MAX_STOP_IDS, -1, np.int32))

    def inputs(self, n: int, mesh) -> PrefillInputs:
        """The table's first n rows as PrefillInputs placed on mesh (what the loop reads: the
        prompts, for a drafter's catch-up, and the stop ids; keys and budgets are unused)."""
        inputs = PrefillInputs(
            tokens=jnp.asarray(self.tokens[:n]),
            prompt_lens=jnp.asarray(self.prompt_lens[:n]),
            stop_ids=jnp.asarray(self.stop_ids[:n]),
            keys=row_keys_jit(jax.random.key(0), np.arange(n, dtype=np.uint32)),
            budgets=jnp.ones(n, jnp.int32),
            sampling=RowSampling.greedy_rows(n),
            num_logprobs=np.full(n, -1, np.int32),
        )
        return sharding.put(inputs, sharding.state_shardings(inputs, mesh, n))
