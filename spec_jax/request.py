"""One request, validated once and admitted once, with its ranges and defaults defined here
and nowhere else (greedy, the model's stop tokens, speculation on). `validate` checks what needs
no model; `Request.admit(target, limits)` the rest, in one place (the prompt's token ids, the
stop ids, the room in a slot), returning the Admitted request the engine queues. Errors are
RequestError: a ValueError naming the field at fault and its allowed range.
"""

import dataclasses
import math
from typing import Any

import numpy as np

from models.settings import is_int, is_number
from models.tokenizer import TooLong, validate_messages
from spec_jax.logprobs import MAX_LOGPROBS
from spec_jax.sampling import SamplingParams, validate_sampling

MAX_STOP_IDS = 16  # stop token ids per request (the loop holds [B, MAX_STOP_IDS])
MAX_STOP_STRINGS = 8
SEED_RANGE = (-(2**63), 2**63 - 1)  # jax.random.key takes a 64-bit seed
UNCAPPED = 2**31 - 1  # Admitted.max_drafts of a request that sets none: the loop's gamma bounds it


class RequestError(ValueError):
    """A request's field is out of range: .field names it ("max_tokens", "prompt", ...),
    .message (== str(error)) says the allowed range."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field, self.message = field, message


@dataclasses.dataclass(frozen=True)
class Limits:
    """A slot's bounds: context (tokens per slot, prompt and new tokens), max_new_tokens (the
    most new tokens a request may ask for; None: no bound but the slot's)."""

    context: int
    max_new_tokens: int | None = None


@dataclasses.dataclass(frozen=True)
class Admitted:
    """A request checked against a model and a slot (Request.admit), with its row's operands:
    its prompt's token ids, its stop ids (its own, or the model's stop tokens), its warp, the
    logprobs it asks (-1: none; k: the top k too) and its most drafts a round (0: plainly)."""

    request: "Request"
    ids: tuple[int, ...]
    stop_ids: tuple[int, ...]
    sampling: SamplingParams
    num_logprobs: int
    max_drafts: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Request:
    """One generation request. Exactly one of prompt (a text), messages (a conversation,
    rendered with the model's chat template) or prompt_ids (token ids) is given.

    max_tokens: new tokens at most (>= 1; 0 with prompt_logprobs: the prompt is only scored).
    temperature >= 0 (0: greedy), top_k >= 0 (0: off),
    top_p in (0, 1]: the warp of spec_jax.sampling. seed: the request's randomness depends on
    it alone (not on its slot or on other requests). stop: strings that end the text (the
    text stops before the match). stop_ids: token ids that end it (None: the model's stop
    tokens). speculate: False decodes this request plainly, without drafts. max_drafts: None
    (the engine's gamma), or the most drafts a round of this request verifies (0: plainly).

    logprobs: None, or k in [0, MAX_LOGPROBS]: each new token's log-probability under the
    target (raw: before the warp; spec_jax.logprobs) and the k most probable tokens' there
    (Update.logprobs). prompt_logprobs: the same for each prompt token after the first, from a
    scoring call over the prompt (the first Update's prompt_logprobs).
    """

    prompt: str | None = None
    messages: tuple[dict, ...] | None = None
    prompt_ids: tuple[int, ...] | None = None
    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    stop_ids: tuple[int, ...] | None = None
    speculate: bool = True
    max_drafts: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    @property
    def sampling(self) -> SamplingParams:
        """The request's warp (its row's operands of the loop: spec_jax.sampling.RowSampling)."""
        return SamplingParams(float(self.temperature), int(self.top_k), float(self.top_p))

    def validate(self) -> "Request":
        """Returns self, or raises RequestError naming the first field out of range (the
        checks that need no model)."""
        _check_prompt(self.prompt, self.messages, self.prompt_ids)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise RequestError(
                    name, f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {value!r}"
                )
        least = 0 if self.prompt_logprobs is not None else 1
        if not is_int(self.max_tokens) or self.max_tokens < least:
            also = "" if least else " (0: the prompt scored alone)"
            raise RequestError(
                "max_tokens", f"max_tokens must be an integer >= {least}{also}, got {self.max_tokens!r}"
            )
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if not is_number(value) or math.isnan(value):
                raise RequestError(name, f"{name} must be a number, got {value!r}")
        if not is_int(self.top_k):
            raise RequestError("top_k", f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        try:
            validate_sampling(self.temperature, self.top_k, self.top_p)
        except ValueError as e:
            raise RequestError(str(e).split()[0], str(e)) from None
        if not is_int(self.seed) or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise RequestError("seed", f"seed must be an integer in [-2**63, 2**63 - 1], got {self.seed!r}")
        _check_stops(self.stop, self.stop_ids)
        if type(self.speculate) is not bool:  # not 0 or 1
            raise RequestError("speculate", f"speculate must be true or false, got {self.speculate!r}")
        drafts = self.max_drafts
        if drafts is not None and (not is_int(drafts) or not 0 <= drafts <= UNCAPPED):
            raise RequestError(
                "max_drafts", f"max_drafts must be None or an integer in [0, {UNCAPPED}], got {drafts!r}"
            )
        return self

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> "Request":
        """A validated Request from JSON-like fields (lists become tuples); RequestError naming
        an unknown field or the first one out of range."""
        known = {f.name for f in dataclasses.fields(cls)}
        for name in fields:
            if name not in known:
                raise RequestError(name, f"unknown field {name!r}; known: {', '.join(sorted(known))}")
        values = dict(fields)
        for name in ("messages", "prompt_ids", "stop", "stop_ids"):
            if isinstance(values.get(name), list):
                values[name] = tuple(values[name])
        if isinstance(values.get("stop"), str):  # OpenAI's "stop" may be one string
            values["stop"] = (values["stop"],)
        return cls(**values).validate()

    def admit(self, target, limits: Limits) -> Admitted:
        """This request checked (validate) and converted for target within a slot of `limits`:
        its prompt's token ids (encode_prompt: a text far over the slot is refused before it is
        tokenized), its stop ids, and the room for its prompt and max_tokens. RequestError
        naming the field at fault."""
        self.validate()
        ids = encode_prompt(target, self, limits.context)
        vocab, tokenizer, n, context = target.config.vocab_size, target.tokenizer, len(ids), limits.context
        stop_ids = self.stop_ids
        if stop_ids is None:  # the model's stop tokens
            stop_ids = tuple(tokenizer.stop_ids) if tokenizer is not None else ()
        elif any(i >= vocab for i in stop_ids):
            raise RequestError(
                "stop_ids", f"stop_ids must be token ids in [0, {vocab}), got {list(stop_ids)}"
            )
        if len(stop_ids) > MAX_STOP_IDS:
            raise RequestError(
                "stop_ids", f"at most {MAX_STOP_IDS} stop ids per request, got {len(stop_ids)}"
            )
        if n >= context:
            raise RequestError(
                "prompt", f"prompt ({n} tokens) leaves no room in the context of {context} tokens"
            )
        if n + self.max_tokens > context:
            raise RequestError(
                "max_tokens",
                f"prompt ({n} tokens) + max_tokens ({self.max_tokens}) exceeds the context of {context} tokens",
            )
        if limits.max_new_tokens is not None and self.max_tokens > limits.max_new_tokens:
            raise RequestError(
                "max_tokens", f"max_tokens must be at most {limits.max_new_tokens}, got {self.max_tokens}"
            )
        sampling = SamplingParams(float(self.temperature), int(self.top_k), float(self.top_p))
        asks = -1 if self.logprobs is None else int(self.logprobs)
        drafts = 0 if not self.speculate else UNCAPPED if self.max_drafts is None else int(self.max_drafts)
        return Admitted(self, tuple(ids), tuple(stop_ids), sampling, asks, drafts)


def _check_prompt(prompt, messages, prompt_ids) -> None:
    fields = {"prompt": prompt, "messages": messages, "prompt_ids": prompt_ids}
    given = [name for name, value in fields.items() if value is not None]
    if len(given) != 1:
        raise RequestError(
            "prompt", f"give exactly one of prompt, messages, prompt_ids (got {given or 'none'})"
        )
    if prompt is not None and (not isinstance(prompt, str) or not prompt):
        raise RequestError("prompt", f"prompt must be a non-empty string, got {prompt!r:.80}")
    if prompt is not None:
        _check_unicode("prompt", prompt)
    if messages is not None:
        try:
            messages = validate_messages(list(messages) if isinstance(messages, tuple | list) else messages)
        except ValueError as e:
            raise RequestError("messages", f"messages: {e}") from None
        for i, m in enumerate(messages):
            for key in ("role", "content"):
                _check_unicode(f"messages[{i}].{key}", m[key], field="messages")
    ids = prompt_ids
    if ids is not None and (
        not isinstance(ids, tuple | list) or not ids or not all(is_int(i) and i >= 0 for i in ids)
    ):
        raise RequestError("prompt_ids", "prompt_ids must be a non-empty list of token ids (integers >= 0)")


def _check_unicode(name: str, text: str, field: str | None = None) -> None:
    """RequestError naming `field` (default: name) unless `text` is valid Unicode: a lone UTF-16
    surrogate (which JSON's \\u escapes can spell) has no UTF-8 form, and the tokenizer raises
    on it."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(
            field or name,
            f"{name} is not valid Unicode: a lone surrogate U+{ord(text[e.start]):04X} at character {e.start}",
        ) from None


def _check_stops(stop, ids) -> None:
    if not isinstance(stop, tuple | list) or len(stop) > MAX_STOP_STRINGS:
        raise RequestError("stop", f"stop must be a list of at most {MAX_STOP_STRINGS} strings, got {stop!r}")
    if not all(isinstance(s, str) and s for s in stop):
        raise RequestError("stop", f"stop strings must be non-empty strings, got {stop!r}")
    for i, s in enumerate(stop):
        _check_unicode(f"stop[{i}]", s, field="stop")
    if ids is None:
        return
    if (
        not isinstance(ids, tuple | list)
        or len(ids) > MAX_STOP_IDS
        or not all(is_int(i) and i >= 0 for i in ids)
    ):
        raise RequestError(
            "stop_ids", f"stop_ids must be at most {MAX_STOP_IDS} token ids (integers >= 0), got {ids!r}"
        )


def request_for(prompt, **fields) -> Request:
    """A Request for one prompt as spec_jax.generate takes it: a text, a conversation
    ([{"role", "content"}, ...]) or token ids; fields: the Request's others (max_tokens, ...)."""
    if isinstance(prompt, str):
        return Request(prompt=prompt, **fields)
    if isinstance(prompt, list | tuple) and any(isinstance(m, dict) for m in prompt):
        return Request(messages=tuple(prompt), **fields)
    return Request(prompt_ids=tuple(int(t) for t in prompt), **fields)


def encode_prompt(target, request: Request, context: int | None = None) -> list[int]:
    """The request's prompt as token ids for target: a text by its tokenizer, a conversation by
    its chat template, token ids checked against its vocabulary; RequestError naming the
    prompt's field where the model cannot read it. context: a slot's tokens; a text that the
    tokenizer's bound (Tokenizer.min_tokens: its bytes over its longest token's) proves too long
    for it with request.max_tokens is refused before it is tokenized, as Request.admit
    refuses it after (RequestError naming prompt or max_tokens)."""
    if request.prompt_ids is not None:
        ids = list(request.prompt_ids)
        vocab = target.config.vocab_size
        if max(ids) >= vocab:
            raise RequestError("prompt_ids", f"prompt_ids must be token ids in [0, {vocab}), got {max(ids)}")
        return ids
    field = "prompt" if request.prompt is not None else "messages"
    tokenizer = target.tokenizer
    if tokenizer is None:
        raise RequestError(field, f"this model has no tokenizer: give prompt_ids instead of {field}")
    at_most = None if context is None else max(context - request.max_tokens, 0)
    try:
        if request.prompt is not None:
            return tokenizer.encode(request.prompt, at_most=at_most)
        return tokenizer.encode_chat(list(request.messages), at_most=at_most)
    except TooLong as e:
        size = f"{field} ({e.size} bytes: at least {e.at_least} tokens, at most {e.longest} bytes a token)"
        if e.at_least >= context:
            raise RequestError(field, f"{size} leaves no room in the context of {context} tokens") from None
        raise RequestError(
            "max_tokens",
            f"{size} + max_tokens ({request.max_tokens}) exceeds the context of {context} tokens",
        ) from None
    except ValueError as e:  # no chat template, or the template refuses the conversation
        if request.prompt is not None:
            raise
        raise RequestError("messages", f"messages: {e}") from None


def stop_row(stop_ids) -> np.ndarray:
    """A row's stop ids as int32 [max(MAX_STOP_IDS, their count)], -1 padded: the loop's per-row
    stop ids, for the engine's rows and a spec_jax.generate call's alike."""
    stops = np.full(max(MAX_STOP_IDS, len(stop_ids)), -1, np.int32)
    stops[: len(stop_ids)] = stop_ids
    return stops
