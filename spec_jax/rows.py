"""The engine's rows on the host (spec_jax.engine): a request waiting or in a slot (Row); the
host's copy of the table's prompts and stop ids (HostTable: what the loop's inputs hold); and the
slots' bounds (slot_context, new_token_bound, stream_context, check_counts). The rows' device
memory is spec_jax.table's (its row operations: spec_jax.row_ops).
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.settings import is_int
from spec_jax import sharding
from spec_jax.decode import PAD_ID, PrefillInputs, layout
from spec_jax.logprobs import TokenLogprobs
from spec_jax.request import MAX_STOP_IDS
from spec_jax.sampling import RowSampling, SamplingParams, row_keys

DEFAULT_CONTEXT = 2048  # tokens per slot (prompt + new tokens) unless max_context says otherwise


@dataclasses.dataclass
class Row:
    """A request on the host: waiting (slot None) or in a slot."""

    handle: Any  # its spec_jax.updates.Handle
    prompt_ids: list[int]
    stop_ids: tuple[int, ...]
    submitted: float
    row_id: int = 0  # the request's keys: fold_in(key(seed), row_id)
    sampling: SamplingParams = SamplingParams(0.0)  # its warp (Admitted.sampling)
    num_logprobs: int = -1  # the logprobs it asks (Admitted.num_logprobs)
    max_drafts: int = 0  # its most drafts a round (Admitted.max_drafts; 0: it decodes plainly)
    slot: int | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)
    sent_tokens: int = 0  # tokens already handed out in Updates
    sent_text: str = ""  # text already handed out
    first_token_at: float | None = None
    logprobs: TokenLogprobs | None = None  # of tokens (as far as read), where the request asks
    prompt_logprobs: TokenLogprobs | None = None  # the prompt's, until handed out


row_keys_jit = jax.jit(row_keys)  # compiled once, not traced per admission


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


def put_snapshot(host: np.ndarray, placement):
    """sharding.put of a copy of a host array its owner changes later (Table.stop_rows): put may
    share the array's memory on a CPU, and work still queued would read the later values (the
    engine marked done a running row that a later free flagged: an intermittent CI failure)."""
    return sharding.put(np.array(host, copy=True), placement)
