"""The engine's row bookkeeping (spec_jax.engine): a request on the host (Row), writing one
request's batch-1 state into a slot of the table (write_row) and freeing slots (mark_done),
the one request's prefill inputs (one_row_inputs), the checks of the slots' context
(slot_context, check_room), and the text a row may hand out (visible_text: stop strings and
partial characters held back).
"""

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.settings import is_int
from spec_jax import sharding
from spec_jax.decode import PAD_ID, PrefillInputs
from spec_jax.request import MAX_STOP_IDS, Request, RequestError
from spec_jax.sampling import row_keys
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


def write_row(table, row, b, batch: int):
    """table (a loop state or its drafter state, batch `batch`) with its row b replaced by
    row's only row, along each leaf's batch axis (sharding.batch_axis); leaves without one
    (scalars, shared arrays) keep the table's."""

    def one(path, t, r):
        axis = sharding.batch_axis(path, t.shape, batch)
        if axis is None or r.ndim != t.ndim or r.shape[axis] != 1:
            return t
        return jax.lax.dynamic_update_slice_in_dim(t, r, b, axis)

    return jax.tree_util.tree_map_with_path(one, table, row)


def mark_done(state: SpecState, rows_b) -> SpecState:
    """state with the rows of rows_b (bool [B]) done: the loop commits nothing more for them."""
    return state.replace(out=state.out.replace(done=state.out.done | rows_b))


write_row_jit = jax.jit(write_row, static_argnums=3, donate_argnums=0)
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


def one_row_inputs(row: Row, width: int) -> tuple[PrefillInputs, np.ndarray]:
    """(the row's request alone as PrefillInputs of batch 1 and the given width, unplaced; its
    stop ids as int32 [1, MAX_STOP_IDS], -1 padded)."""
    request, ids = row.handle.request, row.prompt_ids
    tokens = np.full((1, width), PAD_ID, np.int32)
    tokens[0, : len(ids)] = ids
    stops = np.full((1, MAX_STOP_IDS), -1, np.int32)
    stops[0, : len(row.stop_ids)] = row.stop_ids
    inputs = PrefillInputs(
        tokens=jnp.asarray(tokens),
        prompt_lens=jnp.asarray([len(ids)], jnp.int32),
        stop_ids=jnp.asarray(stops),
        keys=row_keys_jit(jax.random.key(request.seed), np.asarray([row.row_id], np.uint32)),
        budgets=jnp.asarray([request.max_tokens], jnp.int32),
    )
    return inputs, stops


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


def check_room(ids: list[int], stop_ids: tuple[int, ...], request: Request, context: int) -> None:
    """RequestError naming the field at fault unless the prompt (ids) and request.max_tokens fit
    a slot of `context` tokens and stop_ids holds at most MAX_STOP_IDS ids; returns None."""
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

    def inputs(self, keys, budgets, mesh) -> PrefillInputs:
        """The table as PrefillInputs (keys: [B] row keys; budgets: [B]) placed on mesh."""
        inputs = PrefillInputs(
            tokens=jnp.asarray(self.tokens),
            prompt_lens=jnp.asarray(self.prompt_lens),
            stop_ids=jnp.asarray(self.stop_ids),
            keys=keys,
            budgets=jnp.asarray(budgets, jnp.int32),
        )
        return sharding.put(inputs, sharding.state_shardings(inputs, mesh, len(self.prompt_lens)))
