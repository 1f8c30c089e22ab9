"""The OpenAI-compatible request and response bodies of `launch.serve`, as typed pydantic models,
the one place where an HTTP body becomes the engine's `spec_jax.request.Request`, and the
OpenAI-style error body.

A body is checked in three steps, all before the engine sees it: JSON syntax, the schema (types,
OpenAI's ranges, unknown fields refused as OpenAI refuses them), then `Request.validate()` (the
project's ranges and defaults, defined once in spec_jax.request). Each failure is an `ApiError`
whose body names the field: `{"error": {"message", "type", "param", "code"}}`.

Defaults are the project's, not OpenAI's: a field left out takes `Request`'s default (greedy,
the model's stop tokens, 64 new tokens), so the server, `launch.generate` and `spec_jax.generate`
answer the same. The extension field `spec_jax` carries this project's per-request settings:
`{"spec_jax": {"speculate": false}}` decodes that request plainly (same tokens, no drafting);
`{"spec_jax": {"max_drafts": 2}}` verifies at most 2 of its drafts a round (same tokens).

What evaluation clients ask for (lm-evaluation-harness's `local-completions`): `logprobs` (0-20)
on /v1/completions in OpenAI's legacy format (tokens, token_logprobs, top_logprobs, text_offset),
`echo` (the prompt's tokens and their logprobs first; the first token's is null) with
`max_tokens: 0` (the prompt scored alone), a batch of prompts (a list of strings or of token-id
lists: choice i * n + j is prompt i's sample j); `logprobs: true` + `top_logprobs` (0-20) on
/v1/chat/completions in OpenAI's chat format; `n` samples of each prompt (row ids 0..n-1 of one
seed: spec_jax.generate's batch of the prompt n times). Logprobs are the target's raw ones
(spec_jax.logprobs: before temperature, top-k and top-p). `best_of` is refused.
"""

import dataclasses
import json
import time
import uuid
from typing import Annotated, Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from spec_jax.logprobs import MAX_LOGPROBS, TokenLogprobs
from spec_jax.request import Request, RequestError

MAX_N = 16  # samples per prompt (`n`): each one a row of the engine
MAX_PROMPTS = 64  # prompts in one completions body (a batch: lm-evaluation-harness's batch_size)


@dataclasses.dataclass
class ApiError(Exception):
    """An HTTP error with an OpenAI-style body; `param` names the field at fault (None: the body)."""

    status: int
    message: str
    param: str | None = None
    type: str = "invalid_request_error"
    code: str | None = None
    headers: dict[str, str] | None = None

    def body(self) -> dict:
        """{"error": {"message", "type", "param", "code"}}, as OpenAI's API answers (lone
        surrogates in the message or param escaped, so that the body encodes as UTF-8)."""
        param = None if self.param is None else _printable(self.param)
        return {
            "error": {
                "message": _printable(self.message),
                "type": self.type,
                "param": param,
                "code": self.code,
            }
        }


class SpecJaxOptions(BaseModel):
    """The `spec_jax` extension field: this project's per-request settings."""

    model_config = ConfigDict(extra="forbid", strict=True)
    speculate: bool | None = None  # False: this request decodes plainly (its tokens are the same)
    max_drafts: int | None = None  # at most this many drafts a round for this request (0: plainly)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: the usage so far in every chunk


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None  # accepted as OpenAI does; the chat templates here do not render it


# A float field takes an integer too (strict pydantic does: JSON has one number type), not "0".
Number = Annotated[float, Field(allow_inf_nan=False)]


class _Sampling(BaseModel):
    """The fields both endpoints share, with their types (strict: "5" is not 5). Their ranges are
    Request's (spec_jax.request), checked by to_request; only what OpenAI's API has and this server
    does not do is refused here (best_of, penalties, logit_bias, tools)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str
    max_tokens: int | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: int | None = None  # an extension, as vLLM's
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # as vLLM's: these ids end it (default: the model's stop tokens)
    ignore_eos: bool = False  # as vLLM's: no stop tokens (unless stop_token_ids names some)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    presence_penalty: Literal[0, 0.0] = 0
    frequency_penalty: Literal[0, 0.0] = 0
    logit_bias: Annotated[dict, Field(max_length=0)] | None = None
    user: str | None = None
    spec_jax: SpecJaxOptions | None = None


Logprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]


class CompletionBody(_Sampling):
    """POST /v1/completions. `prompt`: a string, a list of token ids, or a batch of either (a list
    of strings or of token-id lists, at most MAX_PROMPTS). `logprobs`: each token's logprob and
    the top k's; `echo`: the prompt first (its tokens' logprobs too, with logprobs)."""

    prompt: (
        str
        | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
        | list[int]
        | Annotated[list[list[int]], Field(min_length=1, max_length=MAX_PROMPTS)]
        | None
    )
    echo: bool = False
    logprobs: Logprobs | None = None
    best_of: Literal[1] | None = None
    suffix: None = None


class ChatBody(_Sampling):
    """POST /v1/chat/completions; `max_completion_tokens` is OpenAI's newer name of max_tokens."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: Logprobs | None = None
    tools: Annotated[list, Field(max_length=0)] | None = None


class TokenizeBody(BaseModel):
    """POST /tokenize, as vLLM's: a `prompt` (BOS added as the model's metadata says, where
    add_special_tokens) or `messages` (the chat template's text). lm-evaluation-harness's remote
    tokenizer (tokenizer_backend=remote) reads the model's tokens from it."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeBody(BaseModel):
    """POST /detokenize, as vLLM's: `tokens` -> their text."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[int]


# What a body may hold (parse_body): JSON nested at most this deep (a body of this API nests 3
# levels: messages, a message, its fields) and numbers of at most this many characters (a 64-bit
# seed has 20). Python's parser would otherwise recurse until it fails, or refuse a number past
# 4300 digits with an internal error.
MAX_JSON_DEPTH = 16
MAX_NUMBER_CHARS = 64


class _Refused(ValueError):
    """A JSON number past MAX_NUMBER_CHARS (raised from inside json.loads)."""


def _int(text: str) -> int:
    if len(text) > MAX_NUMBER_CHARS:
        raise _Refused(f"a number of {len(text)} characters (at most {MAX_NUMBER_CHARS})")
    return int(text)


def _float(text: str) -> float:
    if len(text) > MAX_NUMBER_CHARS:
        raise _Refused(f"a number of {len(text)} characters (at most {MAX_NUMBER_CHARS})")
    return float(text)


def _check_values(value, path: tuple, depth: int) -> None:
    """ApiError 400 naming the field where `value` (found at `path`, `depth` levels down) nests too
    deep or holds a string that is not valid Unicode."""
    if isinstance(value, str):
        if not _is_unicode(value):
            name = _dotted(path) or None
            raise ApiError(400, f"{name or 'the body'}: {_unicode_error(value)}", param=name)
        return
    if not isinstance(value, dict | list):
        return
    if depth > MAX_JSON_DEPTH:
        name = _dotted(path)
        raise ApiError(
            400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels (at {name})", param=name
        )
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for key, item in items:
        if isinstance(key, str) and not _is_unicode(key):
            name = _dotted(path) or None
            where = f"a field name in {name}" if name else "a field name"
            raise ApiError(400, f"{where}: {_unicode_error(key)}", param=name)
        _check_values(item, (*path, key), depth + 1)


def _is_unicode(text: str) -> bool:
    """Whether `text` is valid Unicode (no lone surrogates): what UTF-8 can encode."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _unicode_error(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"not valid Unicode: a lone surrogate U+{ord(text[e.start]):04X} at character {e.start}"
    return "valid Unicode"


def _dotted(path: tuple) -> str:
    return ".".join(_printable(str(p)) for p in path)


def _printable(text: str) -> str:
    """`text` with lone surrogates written as \\udXXX escapes (so that an error naming it can be
    sent as UTF-8)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def parse_body(raw: bytes, schema: type[BaseModel]) -> BaseModel:
    """The body as `schema`; ApiError 400 for what is not one of it, naming the field where it
    can: bytes that are not UTF-8 JSON, or not an object, nesting deeper than MAX_JSON_DEPTH, a
    number longer than MAX_NUMBER_CHARS, a string (a key or a value) that is not valid Unicode
    (a lone UTF-16 surrogate, which JSON's \\u escapes can spell), a field out of the schema."""
    try:
        data = json.loads(raw, parse_int=_int, parse_float=_float)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f" at line {e.lineno} column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
        raise ApiError(400, f"the request body is not valid JSON{where}: {getattr(e, 'msg', e)}") from None
    except RecursionError:  # the C parser's guard, near 1000 levels
        raise ApiError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except _Refused as e:
        raise ApiError(400, f"the request body holds {e}") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    _check_values(data, (), 1)
    try:
        return schema.model_validate(data)
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in _field_path(first["loc"])) or None
        got = "" if first["type"] == "missing" else f", got {json.dumps(first.get('input'))[:80]}"
        raise ApiError(400, f"{param}: {first['msg']}{got}", param=param) from None


def _field_path(loc: tuple) -> tuple:
    """pydantic's error location without the union-member tags it inserts ("str", "list[int]")."""
    return tuple(
        p for p in loc if isinstance(p, int) or not any(c in p for c in "[]()") and p not in _TYPE_TAGS
    )


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "literal", "none", "function-after"}


# Request's fields that a body spells differently
_BODY_NAME = {
    "prompt_ids": "prompt",
    "speculate": "spec_jax.speculate",
    "max_drafts": "spec_jax.max_drafts",
    "stop_ids": "stop_token_ids",
}


def body_field(field: str) -> str:
    """The body's name of a Request field (RequestError.field): prompt_ids is sent as prompt, ..."""
    return _BODY_NAME.get(field, field)


def to_requests(body: CompletionBody | ChatBody) -> list[Request]:
    """One Request per prompt of the body (a chat body: one), each as to_request makes it."""
    if isinstance(body, ChatBody):
        return [to_request(body)]
    prompt = body.prompt  # one prompt (a string or token ids), or a batch of them
    batch = isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list)
    return [to_request(body, p) for p in (prompt if batch else [prompt])]


def to_request(body: CompletionBody | ChatBody, prompt=None) -> Request:
    """The engine's Request for a parsed body (prompt: which of a completions body's prompts;
    to_requests gives each): only the fields the client set (the rest take Request's defaults),
    validated by Request.from_dict (the ranges); ApiError 400 naming the body's field. Logprobs:
    a completion's `logprobs` k, or a chat's top_logprobs (0 by default) where `logprobs` is
    true; `echo` with logprobs asks for the prompt's too (prompt_logprobs); `echo` with
    max_tokens 0 scores the prompt alone."""
    fields: dict[str, Any] = {}
    if isinstance(body, ChatBody):
        fields["messages"] = [{"role": m.role, "content": m.content} for m in body.messages]
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs set to true", param="top_logprobs")
        if body.logprobs:
            fields["logprobs"] = body.top_logprobs or 0
    else:
        if isinstance(prompt, list):
            fields["prompt_ids"] = prompt
        else:
            fields["prompt"] = prompt
        max_tokens = body.max_tokens
        if body.logprobs is not None:
            fields["logprobs"] = body.logprobs
        if body.echo and (body.logprobs is not None or max_tokens == 0):
            fields["prompt_logprobs"] = body.logprobs or 0  # max_tokens 0: the prompt is read alone
        if max_tokens == 0 and not body.echo:
            raise ApiError(400, "max_tokens: 0 only with echo (the prompt scored alone)", param="max_tokens")
    for name, value in (
        ("max_tokens", max_tokens),
        ("temperature", body.temperature),
        ("top_p", body.top_p),
        ("top_k", body.top_k),
        ("seed", body.seed),
        ("stop", body.stop),
        ("stop_ids", [] if body.ignore_eos and body.stop_token_ids is None else body.stop_token_ids),
    ):
        if value is not None:
            fields[name] = value
    for name, value in dict(body.spec_jax or {}).items():
        if value is not None:
            fields[name] = value
    try:
        return Request.from_dict(fields)
    except RequestError as e:
        raise ApiError(400, str(e), param=body_field(e.field)) from None


def request_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def chunk(
    rid: str,
    model: str,
    created: int,
    chat: bool,
    text: str,
    finish: str | None,
    first: bool,
    index: int = 0,
    logprobs: dict | None = None,
) -> dict:
    """One streamed chunk, as OpenAI's: text_completion (a `text` piece) or chat.completion.chunk
    (a `delta`; the first one carries the assistant's role), of choice `index`, with its tokens'
    logprobs (completion_logprobs / chat_logprobs) or None."""
    if chat:
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [choice],
        }
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def completion_logprobs(kept: TokenLogprobs, token_text, offset: int = 0) -> dict:
    """OpenAI's legacy `logprobs` of consecutive tokens: {"tokens", "token_logprobs",
    "top_logprobs", "text_offset"}: each token's text (token_text(id)), its logprob (None for a
    prompt's first token), {token text: logprob} of its top k and the token itself (so up to
    k + 1 entries, as OpenAI's; None where it has no logprob), and where it starts in the
    choice's text (the first at `offset`, each next one after the one before)."""
    tokens = [token_text(t) for t in kept.token_ids]
    offsets, at = [], offset
    for text in tokens:
        offsets.append(at)
        at += len(text)
    tops = []
    for token, value, top in zip(tokens, kept.logprobs, kept.top, strict=True):
        entry = None if value is None else {token_text(i): v for i, v in top}
        if entry is not None:
            entry.setdefault(token, value)
        tops.append(entry)
    return {
        "tokens": tokens,
        "token_logprobs": list(kept.logprobs),
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(kept: TokenLogprobs, token_text) -> dict:
    """OpenAI's chat `logprobs`: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
    "logprob", "bytes"}, ...]}, ...]}, the top k of each token (bytes: the UTF-8 of its text)."""

    def one(i: int, value: float) -> dict:
        text = token_text(i)
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

    content = [
        one(t, v) | {"top_logprobs": [one(i, x) for i, x in top]}
        for t, v, top in zip(kept.token_ids, kept.logprobs, kept.top, strict=True)
    ]
    return {"content": content}


def choice_logprobs(chat: bool, kept: TokenLogprobs | None, token_text, offset: int = 0) -> dict | None:
    """A choice's `logprobs` in its endpoint's format (None where none were asked)."""
    if kept is None:
        return None
    return chat_logprobs(kept, token_text) if chat else completion_logprobs(kept, token_text, offset)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage, with prompt_tokens_details.cached_tokens: the prompt tokens read from the
    prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


@dataclasses.dataclass
class Choice:
    """One choice of a whole response: its text, finish reason and logprobs (the endpoint's
    format, or None)."""

    text: str
    finish: str
    logprobs: dict | None = None


def completion(rid: str, model: str, chat: bool, choices: list[Choice], use: dict) -> dict:
    """The whole (non-streamed) response: text_completion or chat.completion, choice i at index i."""
    created = int(time.time())
    out = []
    for i, c in enumerate(choices):
        if chat:
            message = {"role": "assistant", "content": c.text}
            out.append({"index": i, "message": message, "logprobs": c.logprobs, "finish_reason": c.finish})
        else:
            out.append({"index": i, "text": c.text, "logprobs": c.logprobs, "finish_reason": c.finish})
    obj = "chat.completion" if chat else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": out, "usage": use}
