"""What the engine hands back for a request (spec_jax.engine): its Handle, and its Updates, read
from the rows of a loop state after a chunk or a prefill (read_rows), cut at stop strings and
at characters still incomplete (visible_text), and written out by next_update.
"""

import dataclasses
import functools
from typing import Any, NamedTuple

from spec_jax import sharding
from spec_jax.logprobs import TokenLogprobs
from spec_jax.request import Request
from spec_jax.rows import Row


@dataclasses.dataclass(eq=False)
class Handle:
    """A submitted request: .id (unique per engine), .request, .prompt_tokens, .cached_tokens,
    .prompt_logprobs. Hashable by identity."""

    id: int
    request: Request
    prompt_tokens: int = 0  # the prompt's token count (after the chat template)
    cached_tokens: int = 0  # of them, read from the prefix cache (set when it is prefilled)
    # the prompt's logprobs where the request asks for them (Request.prompt_logprobs), set when
    # it is submitted (they come in its first Update too)
    prompt_logprobs: TokenLogprobs | None = None


@dataclasses.dataclass(frozen=True)
class Update:
    """A request's progress since its last Update: its new token ids and their text (stop
    strings cut); finished with finish_reason "stop" | "length" | "cancelled" | "error".
    logprobs: the new tokens' (TokenLogprobs of token_ids) where the request asks for them;
    prompt_logprobs: the prompt's, in the request's first Update, where it asks for them."""

    handle: Handle
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    error: str | None = None
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: TokenLogprobs | None = None


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


class First(NamedTuple):
    """Where an admitted request's first token is read (Table.insert): row `index` of `block`,
    the state it was prefilled in (or kept)."""

    row: Row
    block: Any
    index: int


def sources(
    state, slots: list, firsts: "list[First] | None" = None
) -> tuple[list[tuple[Row, int, int]], dict]:
    """read_rows' arguments: the busy rows of slots (Row or None), each read from its row of
    the table's state; or firsts, the rows just admitted (row, block, index), each read from
    row index of the block it was prefilled in (or kept), not from the table."""
    if firsts is None:
        return [(row, 0, b) for b, row in enumerate(slots) if row is not None], {0: state}
    return [(row, id(block), i) for row, block, i in firsts], {id(block): block for _, block, _ in firsts}


def read_rows(sources: list[tuple[Row, int, int]], blocks: dict) -> list[tuple[Row, str | None]]:
    """Each source's row read from its state, in one fetch: sources (row, key of its state in
    blocks, its index there); sets each row's tokens (and logprobs, where its request asks) and
    returns (row, finish reason: None while it runs, "error" for a non-finite logit, "stop" for
    a stop id, else "length")."""
    leaves = {k: (s.out.tokens, s.out.num_generated, s.out.done, s.out.nonfinite) for k, s in blocks.items()}
    asking = {key for row, key, _ in sources if row.handle.request.logprobs is not None}
    kept = {k: (s.out.logprobs, s.out.top_ids, s.out.top_logprobs) for k, s in blocks.items() if k in asking}
    fetched, kept = sharding.fetch((leaves, kept))  # the logprobs only of blocks whose rows ask
    out = []
    for row, key, b in sources:
        tokens, counts, done, nonfinite = fetched[key]
        row.tokens = tokens[b, : counts[b]].tolist()
        if key in kept and row.handle.request.logprobs is not None:
            read_logprobs(row, kept[key], b)
        reason = None
        if done[b]:
            hit_stop = bool(row.tokens) and row.tokens[-1] in row.stop_ids
            reason = "error" if nonfinite[b] else "stop" if hit_stop else "length"
        out.append((row, reason))
    return out


def read_logprobs(row: Row, kept, b: int) -> None:
    """row.logprobs extended to its tokens from row b of kept, the host's (Output.logprobs,
    top_ids, top_logprobs): each new token's and its request's top k."""
    have = row.logprobs or TokenLogprobs()
    start, end = len(have), len(row.tokens)
    lp, top_ids, top_lp = (a[b, start:end] for a in kept)
    row.logprobs = have + TokenLogprobs.of(
        row.tokens[start:], lp, top_ids, top_lp, row.handle.request.logprobs
    )


def next_update(
    row: Row, reason: str | None, tokenizer, error: str | None = None
) -> tuple["Update | None", int]:
    """(the row's Update since its last one, or None where it has nothing new and goes on; the
    tokens it computed past a stop string). A stop string cuts the row's tokens and ends it as
    "stop"; error: the message of a finish "error". The prompt's logprobs go in its first Update."""
    text, cut = visible_text(tokenizer, row.tokens, row.handle.request.stop, final=reason is not None)
    past = 0
    if cut is not None:
        past = len(row.tokens) - cut
        row.tokens, reason = row.tokens[:cut], "stop"
    new_tokens, new_text = row.tokens[row.sent_tokens :], text[len(row.sent_text) :]
    logprobs = None if row.logprobs is None else row.logprobs[row.sent_tokens : len(row.tokens)]
    row.sent_tokens, row.sent_text = len(row.tokens), text
    if reason is None and not (new_tokens or new_text):
        return None, past
    prompt, row.prompt_logprobs = row.prompt_logprobs, None
    error = error if reason == "error" else None
    return Update(row.handle, new_tokens, new_text, reason is not None, reason, error, logprobs, prompt), past
