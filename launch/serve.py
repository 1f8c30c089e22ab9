"""An OpenAI-compatible HTTP server on the project's engine (spec_jax.engine), with streaming and
continuous batching.

  python -m launch.serve                                  # the Qwen pair, http://127.0.0.1:8000/v1
  python -m launch.serve --target=random --draft=random-draft --port=8001 --max_batch=4
  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
      -d '{"model": "qwen2.5-coder-1.5b", "prompt": "def f(x):", "max_tokens": 32}'

Endpoints: POST /v1/completions, POST /v1/chat/completions (the target's chat template),
`"stream": true` as server-sent events ending in `data: [DONE]`, GET /v1/models, GET /health,
GET /metrics (Prometheus text), and vLLM's POST /tokenize, POST /detokenize, GET /tokenizer_info
(lm-evaluation-harness's remote tokenizer). Logprobs, echo, n samples and batches of prompts:
launch/serve_schema.py. The model, drafter and precision flags are launch.flags' (shared with
launch.generate; see --helpfull); a request's fields take launch.generate's defaults (greedy,
the model's stop tokens). Per-request speculation: `"spec_jax": {"speculate": false}` decodes
that request plainly. launch/serve_schema.py documents the bodies and their checks. Needs the
`serve` extra (pip install -e '.[serve]'); without it, one line naming the missing module and
exit code 2.

Start-up: the flags are checked (a bad one: one line, exit 2), the server listens at once
(stdout: "launch.serve: listening on ..."), and loads the models in the background; /health
answers 503 {"status": "loading"} (a generation request 503 with Retry-After) until the models
are placed and a lone request's programs compiled, then 200 (stdout: "launch.serve: serving
..."). Other row buckets compile when traffic first needs them (--warm_all_buckets compiles them
all before /health says ok). With gamma=auto each bucket's costs start from those cached for
this machine and pair, or from the prior predicted from the models' sizes (as
spec_jax.generate's), never measured before serving; the rounds the traffic runs refine them
(autogamma's controllers time each chunk) and are cached at shutdown for the next start.

Faults; nothing a client sends stops the server:
- a body over --max_body_mb: 413 (from its Content-Length, or while it is read); a body not sent
  within --body_timeout: 408; headers not sent within --header_timeout, or a keep-alive
  connection idle for --keep_alive_timeout: the connection is closed.
- a body that is not JSON, nests deeper than 16 levels, holds a number over 64 characters or a
  string that is not valid Unicode (a lone surrogate): 400; a wrong type, a value out of range
  or an unknown field: 400 naming the field; an unknown model: 404; all before the engine sees
  the request.
- a prompt over the context: 400 naming the limit; one whose bytes alone prove it (a byte-level
  BPE's tokens cover at most its longest token's bytes) is refused before it is tokenized, and
  tokenizing happens off the engine's thread (EngineWorker.prepare).
- a full queue: 429 with Retry-After; a client that leaves mid-stream: its row is cancelled and
  its slot freed; non-finite logits end that request with an error (the others go on).
- an exception the engine raises while admitting a request: a 500 naming that request (the
  others and the engine thread go on); one raised while stepping: the requests that were running
  end with an error, the engine thread goes on. /health answers 503 when the engine thread has
  died or its loop has not turned for --health_stall seconds.
- SIGTERM or SIGINT: /health and new requests get 503 with Retry-After while what runs may
  finish (the listener stays open) for up to --grace_period seconds; the rest is cancelled, and
  the server exits 0 with one line. A second signal exits at once.
"""

import asyncio
import dataclasses
import functools
import importlib
import json
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

SERVE_EXTRA_MODULES = ("uvicorn", "h11", "starlette", "pydantic", "prometheus_client")
SERVE_EXTRA_INSTALL = "pip install -e '.[serve]'"


def require_serve_extra() -> None:
    """One line on stderr and exit 2 where a module of the serve extra (setup.py's "serve") is not
    installed: what `python -m launch.serve` says instead of a traceback."""
    for name in SERVE_EXTRA_MODULES:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            missing = e.name or name
            print(
                f"launch.serve: error: the server needs the module {missing!r}, which is not installed; "
                f"{SERVE_EXTRA_INSTALL} (in the repository) adds it",
                file=sys.stderr,
            )
            sys.exit(2)


if __name__ == "__main__":
    require_serve_extra()

import h11  # noqa: E402
import uvicorn  # noqa: E402
from absl import flags  # noqa: E402
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest  # noqa: E402
from starlette.applications import Starlette  # noqa: E402
from starlette.exceptions import HTTPException  # noqa: E402
from starlette.requests import ClientDisconnect  # noqa: E402
from starlette.requests import Request as HttpRequest  # noqa: E402
from starlette.responses import JSONResponse, Response, StreamingResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402
from uvicorn.protocols.http.h11_impl import H11Protocol  # noqa: E402

from launch import common  # noqa: E402
from launch import flags as shared  # noqa: E402  (the model, drafter and precision flags)
from launch.serve_engine import EngineFailed, EngineWorker, Metrics, Stream  # noqa: E402
from launch.serve_schema import (  # noqa: E402
    ApiError,
    ChatBody,
    Choice,
    CompletionBody,
    DetokenizeBody,
    StreamOptions,
    TokenizeBody,
    body_field,
    choice_logprobs,
    chunk,
    completion,
    parse_body,
    request_id,
    to_requests,
)
from launch.serve_schema import usage as usage_body  # noqa: E402
from spec_jax.engine import Engine, QueueFull  # noqa: E402
from spec_jax.logprobs import TokenLogprobs  # noqa: E402
from spec_jax.request import Admitted, Request, RequestError  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (0.0.0.0: every interface).")
flags.DEFINE_integer("port", 8000, "TCP port to listen on.", lower_bound=1, upper_bound=65535)
flags.DEFINE_integer("max_batch", 8, "Row slots: requests decoded together.", lower_bound=1, upper_bound=256)
flags.DEFINE_integer(
    "max_queue", 64, "Requests waiting for a slot beyond max_batch; one more is answered 429.", lower_bound=1
)
flags.DEFINE_float(
    "grace_period",
    30.0,
    "On SIGTERM: seconds the running requests may take before they are cancelled (new ones get 503 "
    "meanwhile).",
    lower_bound=0,
)
flags.DEFINE_integer(
    "max_context",
    None,
    "Tokens per slot, prompt plus new tokens (default: the target's context, at most 2048); the KV "
    "caches and the compiled loop are sized for it.",
    lower_bound=2,
)
flags.DEFINE_string("model_name", None, "The model id clients send (default: --target as given).")
flags.DEFINE_float(
    "prefix_cache_mb",
    256.0,
    "MB of device memory for the prefix cache: prompt prefixes' keys and values in blocks of 32 tokens, "
    "reused exactly by every request that starts with them (a shared system prompt, a chat's earlier "
    "turns); least recently used evicted. 0: none. On where a prefill is read row by row (the CPU "
    "kernels, one device).",
    lower_bound=0,
)
flags.DEFINE_float(
    "max_body_mb",
    4.0,
    "The largest request body, in MiB (1 MiB = 1048576 bytes); a larger one is answered 413, from its "
    "Content-Length or as soon as that much has arrived.",
    lower_bound=0.001,
)
flags.DEFINE_float(
    "header_timeout",
    10.0,
    "Seconds a connection may take to send a request's headers (from when it opens, or its last "
    "response ended); then it is closed (slow or stalled clients).",
    lower_bound=0.1,
)
flags.DEFINE_float(
    "body_timeout",
    30.0,
    "Seconds a request's body may take to arrive once its headers have; then 408.",
    lower_bound=0.1,
)
flags.DEFINE_integer(
    "keep_alive_timeout",
    5,
    "Seconds an idle keep-alive connection stays open (uvicorn's timeout_keep_alive).",
    lower_bound=1,
)
flags.DEFINE_float(
    "health_stall",
    300.0,
    "GET /health answers 503 when the engine thread's loop has not turned for this many seconds (a "
    "step compiling a new row bucket's programs may take a minute on a 2-core CPU).",
    lower_bound=1,
)
flags.DEFINE_bool(
    "warm_all_buckets",
    False,
    "Compile every row bucket's programs (1, 2, 4, ... --max_batch requests at once) before /health "
    "says ok; by default only a lone request's, and the others when traffic first needs them.",
)

RETRY_AFTER_S = 1  # the Retry-After of a 429 or a 503
MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Limits:
    """What a client may take: a body's bytes and seconds, the seconds its headers may take, how
    long the engine thread may go without a turn before /health says it has stalled."""

    max_body_bytes: int = 4 * MiB
    body_timeout_s: float = 30.0
    header_timeout_s: float = 10.0
    health_stall_s: float = 300.0


class Service:
    """What the app serves: `worker` (the engine's thread) once the engine is loaded, None while it
    loads; `error` the loading's failure; `context` the tokens per slot once loaded."""

    def __init__(self, model: str, metrics: Metrics, limits: Limits = Limits()):
        self.model, self.metrics, self.limits = model, metrics, limits
        self.worker: EngineWorker | None = None
        self.context: int | None = None
        self.error: BaseException | None = None

    def serve_engine(self, engine) -> EngineWorker:
        """Starts the worker over a loaded (and warmed) engine: from now on requests are taken."""
        self.context = engine.max_context
        self.worker = EngineWorker(engine, self.metrics).start()
        return self.worker

    def ready_worker(self) -> EngineWorker:
        """The worker, or ApiError 503 (with Retry-After) while loading or shutting down."""
        worker = self.worker
        if worker is None:
            code, message = (
                ("loading", "the model is loading") if self.error is None else ("failed", "loading failed")
            )
            raise ApiError(503, f"{message}; retry later", type="server_error", code=code, headers=_retry())
        if not worker.accepting:
            raise _unavailable()
        if not worker.alive:
            raise ApiError(503, "the engine thread has stopped", type="server_error", code="engine_dead")
        return worker

    def health(self) -> tuple[int, dict]:
        """(status code, body) of GET /health: 200 {"status": "ok", "running": n}; 503 with
        {"status": "loading" | "failed" | "shutting down" | "stalled" | "dead", ...}."""
        worker = self.worker
        if worker is None:
            if self.error is not None:
                return 503, {"status": "failed", "error": f"{type(self.error).__name__}: {self.error}"}
            return 503, {"status": "loading"}
        if worker.shutting_down:
            return 503, {"status": "shutting down"}
        if not worker.alive:
            return 503, {"status": "dead", "error": "the engine thread has stopped"}
        idle = time.monotonic() - worker.heartbeat
        if idle > self.limits.health_stall_s:
            return 503, {
                "status": "stalled",
                "error": f"the engine thread's loop has not turned for {idle:.0f} s",
            }
        return 200, {"status": "ok", "running": worker.busy}


def make_app(service: Service) -> Starlette:
    """The ASGI app: the endpoints over `service` (whose worker owns the engine)."""

    async def completions(http: HttpRequest) -> Response:
        return await _generate(http, service, chat=False)

    async def chat_completions(http: HttpRequest) -> Response:
        return await _generate(http, service, chat=True)

    async def models(http: HttpRequest) -> Response:
        card = {
            "id": service.model,
            "object": "model",
            "created": 0,
            "owned_by": "spec-jax",
            "max_model_len": service.context,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def health(http: HttpRequest) -> Response:
        status, body = service.health()
        return JSONResponse(body, status, headers=None if status == 200 else _retry())

    async def tokenize(http: HttpRequest) -> Response:
        return await _tokenizer_call(http, service, TokenizeBody)

    async def detokenize(http: HttpRequest) -> Response:
        return await _tokenizer_call(http, service, DetokenizeBody)

    async def tokenizer_info(http: HttpRequest) -> Response:
        try:
            return JSONResponse(_tokenizer_info(service))
        except ApiError as e:
            return JSONResponse(e.body(), e.status, headers=e.headers)

    async def prometheus(http: HttpRequest) -> Response:
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def http_error(http: HttpRequest, exc: HTTPException) -> Response:
        message = f"{http.method} {http.url.path}: {exc.detail}"
        return JSONResponse(ApiError(exc.status_code, message).body(), exc.status_code)

    async def internal_error(http: HttpRequest, exc: Exception) -> Response:
        error = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
        return JSONResponse(error.body(), 500)

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/tokenizer_info", tokenizer_info, methods=["GET"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: internal_error})


async def _generate(http: HttpRequest, service: Service, chat: bool) -> Response:
    """One POST: the body read (within the limits), checked and turned into a tokenized Request
    off the event loop and the engine's thread, submitted, answered whole or streamed."""
    endpoint = "chat" if chat else "completions"
    rid = request_id(chat)
    try:
        worker = service.ready_worker()
        raw = await _read_body(http, service.limits)
        body, requests = await asyncio.to_thread(_prepared, raw, chat, service.model, worker)
        choices = await _submit_all(worker, body, requests, rid)
    except ApiError as e:
        service.metrics.requests.labels(endpoint=endpoint, status=str(e.status)).inc()
        return JSONResponse(e.body(), e.status, headers=e.headers)
    service.metrics.requests.labels(endpoint=endpoint, status="200").inc()
    options = body.stream_options or StreamOptions()
    if body.stream:
        events = _events(worker, choices, rid, service.model, chat, options)
        return StreamingResponse(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
    return await _whole(http, worker, choices, rid, service.model, chat)


def _tokenizer(worker: EngineWorker):
    """The served model's tokenizer, or ApiError 400 where it has none."""
    tokenizer = worker.engine.tokenizer
    if tokenizer is None:
        raise ApiError(400, "this model has no tokenizer: send and read token ids")
    return tokenizer


def _tokenizer_info(service: Service) -> dict:
    """GET /tokenizer_info, as vLLM's: the bos and eos tokens, the chat template, the context."""
    tokenizer = _tokenizer(service.ready_worker())
    name = {i: tokenizer.id_to_token(i) for i in (tokenizer.bos_id, tokenizer.eos_id) if i is not None}
    return {
        "tokenizer_class": "spec_jax",
        "bos_token": name.get(tokenizer.bos_id),
        "eos_token": name.get(tokenizer.eos_id),
        "pad_token": None,
        "chat_template": tokenizer.chat_template,
        "model_max_length": service.context,
    }


async def _tokenizer_call(http: HttpRequest, service: Service, schema) -> Response:
    """POST /tokenize or /detokenize (vLLM's bodies and answers: {"count", "max_model_len",
    "tokens"} or {"prompt"}), off the event loop and the engine's thread."""

    def answer(raw: bytes, worker: EngineWorker) -> dict:
        body, tokenizer = parse_body(raw, schema), _tokenizer(worker)
        if body.model is not None and body.model != service.model:
            raise ApiError(
                404, f"model: {body.model!r} is not served here", param="model", code="model_not_found"
            )
        if schema is DetokenizeBody:
            vocab = worker.engine.target.config.vocab_size
            if any(not 0 <= t < vocab for t in body.tokens):
                raise ApiError(400, f"tokens: token ids must be in [0, {vocab})", param="tokens")
            return {"prompt": tokenizer.decode(body.tokens)}
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "prompt: give exactly one of prompt, messages", param="prompt")
        if body.prompt is not None:
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            try:
                messages = [{"role": m.role, "content": m.content} for m in body.messages]
                ids = tokenizer.encode_chat(messages, body.add_generation_prompt)
            except ValueError as e:
                raise ApiError(400, f"messages: {e}", param="messages") from None
        return {"count": len(ids), "max_model_len": service.context, "tokens": ids, "token_strs": None}

    try:
        worker = service.ready_worker()
        raw = await _read_body(http, service.limits)
        return JSONResponse(await asyncio.to_thread(answer, raw, worker))
    except ApiError as e:
        return JSONResponse(e.body(), e.status, headers=e.headers)


@dataclasses.dataclass
class _Choice:
    """One choice of a response: its engine request's stream, which prompt it samples (the
    first choice of each prompt counts its prompt tokens in the usage), what precedes its text
    (echo: the prompt's text and, with logprobs, the prompt's TokenLogprobs), how its logprobs
    are shown (None: not asked) and how far its tokens' text has run (their text_offset)."""

    stream: Stream
    counts_prompt: bool
    echo_text: str = ""
    echo_logprobs: TokenLogprobs | None = None
    token_text: Callable[[int], str] | None = None  # a token's text, where logprobs are shown
    offset: int = 0
    first: bool = True

    def logprobs(self, chat: bool, kept: TokenLogprobs | None) -> dict | None:
        """kept (the echo's first, once) in the endpoint's format, text offsets running on."""
        if self.token_text is None:
            return None
        kept = kept or TokenLogprobs()
        if self.first and self.echo_logprobs is not None:
            kept = self.echo_logprobs + kept
        shown = choice_logprobs(chat, kept, self.token_text, self.offset)
        self.offset += sum(len(self.token_text(t)) for t in kept.token_ids)
        return shown


async def _submit_all(worker: EngineWorker, body, requests: list[Admitted], rid: str) -> list[_Choice]:
    """Submits each prompt's n samples (row ids 0..n-1 of its seed; the prompt's logprobs asked
    of the first alone where it generates) and returns the choices in order (prompt i's sample
    j at i * n + j). Where the engine reads cached prompt prefixes, the other samples wait for
    the first one's first Update (its prefill put the prompt's blocks in the prefix cache): each
    then computes only the prompt's last, partial block instead of all of it. A refusal cancels
    what was submitted and is raised."""
    chat = isinstance(body, ChatBody)
    shown = bool(body.logprobs) if chat else body.logprobs is not None
    token_text = _token_text(worker.engine.tokenizer) if shown else None
    # each prompt as the body gave it (a text, or token ids), for echo
    prompts = [None if chat else a.request.prompt or list(a.request.prompt_ids) for a in requests]
    choices: list[list[_Choice]] = [[] for _ in requests]
    staged = body.n > 1 and worker.engine.reads_prefixes

    async def sample(i: int, j: int) -> None:
        request = requests[i]  # admitted (EngineWorker.prepare)
        if j and request.request.max_tokens:  # the first one's prompt logprobs serve all
            request = dataclasses.replace(
                request, request=dataclasses.replace(request.request, prompt_logprobs=None)
            )
        choice = _Choice(
            await _submit(worker, request, rid, row_id=j), counts_prompt=not j, token_text=token_text
        )
        if not chat and body.echo:
            prompt = prompts[i]
            choice.echo_text = prompt if isinstance(prompt, str) else worker.engine.tokenizer.decode(prompt)
            choice.echo_logprobs = choices[i][0].stream.handle.prompt_logprobs if j and shown else None
            if not j and shown:
                choice.echo_logprobs = choice.stream.handle.prompt_logprobs
        choices[i].append(choice)

    try:
        for i in range(len(requests)):
            await sample(i, 0)
        if staged:
            await asyncio.gather(*(c[0].stream.started.wait() for c in choices))
        for i in range(len(requests)):
            for j in range(1, body.n):
                await sample(i, j)
    except BaseException:
        for choice in (c for per_prompt in choices for c in per_prompt):
            worker.cancel(choice.stream)
        raise
    return [c for per_prompt in choices for c in per_prompt]


def _token_text(tokenizer) -> Callable[[int], str]:
    """A token's text as logprobs show it (its own decoding, special tokens kept), memoized."""
    return functools.lru_cache(maxsize=1 << 16)(lambda i: tokenizer.decode([i]))


async def _read_body(http: HttpRequest, limits: Limits) -> bytes:
    """The request's body: ApiError 413 where it is over limits.max_body_bytes (its
    Content-Length says so, or that much has arrived), 408 where it has not arrived within
    limits.body_timeout_s, 400 for a Content-Length that is not a byte count."""
    limit = limits.max_body_bytes
    declared = http.headers.get("content-length")
    if declared is not None and not declared.strip().isdigit():
        raise ApiError(400, f"Content-Length must be a byte count, got {declared[:40]!r}", headers=_close())
    if declared is not None and int(declared) > limit:
        raise _too_large(limit, f"its Content-Length is {int(declared)} bytes")
    pieces, size = [], 0
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            async for piece in http.stream():
                size += len(piece)
                if size > limit:
                    raise _too_large(limit, f"more than {limit} bytes arrived")
                pieces.append(piece)
    except TimeoutError:
        raise ApiError(
            408, f"the request body did not arrive within {limits.body_timeout_s:g} s", headers=_close()
        ) from None
    except ClientDisconnect:
        raise ApiError(400, "the client closed the connection before the body was sent") from None
    return b"".join(pieces)


def _too_large(limit: int, why: str) -> ApiError:
    return ApiError(
        413,
        f"the request body is larger than the server takes ({limit} bytes, --max_body_mb): {why}",
        code="body_too_large",
        headers=_close(),
    )


def _prepared(raw: bytes, chat: bool, model: str, worker: EngineWorker):
    """(the parsed body, its Requests (one per prompt) admitted: Request.admit): the body's
    checks (serve_schema.parse_body, the model, to_requests) and EngineWorker.prepare's
    tokenization, as ApiErrors. Runs in a thread of its own: neither the event loop nor the
    engine waits for it."""
    body = parse_body(raw, ChatBody if chat else CompletionBody)
    if body.model != model:
        raise ApiError(
            404,
            f"model: {body.model!r} is not served here; this server serves {model!r} (GET /v1/models)",
            param="model",
            code="model_not_found",
        )
    requests = to_requests(body)
    try:
        return body, [worker.prepare(request) for request in requests]
    except RequestError as e:
        raise ApiError(400, str(e), param=body_field(e.field)) from None


async def _submit(worker: EngineWorker, request: Admitted, rid: str, row_id: int = 0) -> Stream:
    """worker.submit with the engine's refusals as ApiErrors: the context (400), a full queue or a
    server shutting down (429 / 503, with Retry-After), an exception the engine raised for this
    request (500 naming it)."""
    if not worker.accepting:
        raise _unavailable()
    try:
        return await worker.submit(request, rid, row_id)
    except RequestError as e:
        raise ApiError(400, str(e), param=body_field(e.field)) from None
    except EngineFailed as e:
        raise ApiError(
            500, f"request {rid} failed: the engine raised {e}", type="server_error", code="engine_error"
        ) from None
    except QueueFull as e:
        if not worker.accepting:
            raise _unavailable() from None
        raise ApiError(
            429,
            f"the queue is full: {e}",
            type="rate_limit_error",
            code="rate_limit_exceeded",
            headers=_retry(),
        ) from None


def _retry() -> dict[str, str]:
    return {"Retry-After": str(RETRY_AFTER_S)}


def _close() -> dict[str, str]:
    """Closes the connection after the response: the request's body may not have been read."""
    return {"Connection": "close"}


def _unavailable() -> ApiError:
    return ApiError(
        503, "the server is shutting down", type="server_error", code="shutting_down", headers=_retry()
    )


async def _events(
    worker: EngineWorker, choices: list[_Choice], rid: str, model: str, chat: bool, options: StreamOptions
):
    """The server-sent events of one streamed request: a chunk per Update of each choice with text
    or logprobs (and its first and last; each with the usage so far if
    options.continuous_usage_stats), an error event if a choice failed (the others are then
    cancelled), a usage chunk if options.include_usage, then `data: [DONE]`. A client that
    leaves ends this generator: its requests are cancelled and their slots freed."""
    created = int(time.time())
    merged = _Merged([c.stream for c in choices])
    try:
        while not merged.done:
            i, update = await merged.get()
            choice = choices[i]
            failure = _failure(update, rid)
            if failure is not None:
                yield _sse(failure.body())
                break
            logprobs = choice.logprobs(chat, update.logprobs) if update.token_ids or choice.first else None
            if update.text or update.finished or choice.first or logprobs is not None:
                text = (choice.echo_text if choice.first else "") + update.text
                finish = _finish_reason(update)
                piece = chunk(rid, model, created, chat, text, finish, choice.first, i, logprobs)
                if options.continuous_usage_stats:
                    piece["usage"] = _usage(choices)
                yield _sse(piece)
                choice.first = False
        else:
            if options.include_usage:
                tail = chunk(rid, model, created, chat, "", None, False) | {"choices": []}
                yield _sse(tail | {"usage": _usage(choices)})
        yield "data: [DONE]\n\n"
    finally:
        merged.close()
        for choice in choices:
            worker.cancel(choice.stream)  # a no-op once it has finished


class _Merged:
    """The Updates of several streams in one queue as they come: get() -> (stream index, Update);
    `done` once every stream has sent its finished one; close() stops reading them."""

    def __init__(self, streams: list[Stream]):
        self._queue: asyncio.Queue = asyncio.Queue()
        self._left = len(streams)
        self._tasks = [asyncio.create_task(self._pump(i, s)) for i, s in enumerate(streams)]

    async def _pump(self, i: int, stream: Stream) -> None:
        while True:
            update = await stream.get()
            self._queue.put_nowait((i, update))
            if update.finished:
                return

    @property
    def done(self) -> bool:
        return not self._left

    async def get(self) -> tuple[int, Any]:
        i, update = await self._queue.get()
        self._left -= update.finished
        return i, update

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()


async def _whole(
    http: HttpRequest, worker: EngineWorker, choices: list[_Choice], rid: str, model: str, chat: bool
) -> Response:
    """The non-streamed answer: each choice's Updates joined (its echo first); the requests are
    cancelled if the client leaves first (checked each second) or one of them fails."""
    texts = [[c.echo_text] for c in choices]
    kept: list[TokenLogprobs | None] = [None] * len(choices)
    last: list = [None] * len(choices)
    merged = _Merged([c.stream for c in choices])
    try:
        while not merged.done:
            try:
                i, update = await asyncio.wait_for(merged.get(), timeout=1.0)
            except TimeoutError:
                if await http.is_disconnected():
                    for choice in choices:
                        worker.cancel(choice.stream)
                continue
            texts[i].append(update.text)
            if update.logprobs is not None:
                kept[i] = update.logprobs if kept[i] is None else kept[i] + update.logprobs
            if update.finished:
                last[i] = update
                failure = _failure(update, rid)
                if failure is not None:
                    return JSONResponse(failure.body(), failure.status)
    finally:
        merged.close()
        for choice in choices:
            worker.cancel(choice.stream)  # a no-op once it has finished
    out = [
        Choice("".join(t), _finish_reason(u), c.logprobs(chat, k))
        for c, t, k, u in zip(choices, texts, kept, last, strict=True)
    ]
    return JSONResponse(completion(rid, model, chat, out, _usage(choices)))


def _usage(choices: list[_Choice]) -> dict:
    """The usage of a response so far: each prompt's tokens once, every choice's new tokens."""
    prompts = [c.stream for c in choices if c.counts_prompt]
    return usage_body(
        sum(_prompt_tokens(s) for s in prompts),
        sum(c.stream.tokens for c in choices),
        sum(_cached_tokens(s) for s in prompts),
    )


def _failure(update, rid: str) -> ApiError | None:
    """The error a request's last Update reports: the engine's (e.g. non-finite logits: 500,
    naming the request), or a cancellation by the server (its grace period ran out: 503); None
    for a request that ended normally."""
    if update.error is not None:
        return ApiError(500, f"request {rid}: {update.error}", type="server_error", code=update.finish_reason)
    if update.finish_reason == "cancelled":
        return ApiError(
            503,
            "cancelled: the server shut down before this request finished",
            type="server_error",
            code="cancelled",
        )
    return None


def _finish_reason(update) -> str | None:
    """OpenAI's finish_reason: "stop" or "length"."""
    if not update.finished:
        return None
    return "length" if update.finish_reason == "length" else "stop"


def _prompt_tokens(stream: Stream) -> int:
    return int(getattr(stream.handle, "prompt_tokens", 0))


def _cached_tokens(stream: Stream) -> int:
    """The prompt tokens read from the prefix cache (0 before the request was prefilled)."""
    return int(getattr(stream.handle, "cached_tokens", 0))


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class HeaderDeadline(H11Protocol):
    """uvicorn's h11 protocol with a deadline for a request's headers (uvicorn has none: a client
    that opens a connection and sends its headers a byte at a time would hold it for ever). The
    deadline starts when the connection opens, and again when a response ends on a kept-alive
    one; it is not moved by data that arrives, and ends once the headers are in. Past it, the
    connection is closed. Subclass with HEADER_TIMEOUT_S set (header_deadline)."""

    HEADER_TIMEOUT_S = 10.0

    def connection_made(self, transport) -> None:
        self._header_timer = None
        super().connection_made(transport)
        self._watch_headers()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_headers()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_headers()

    def connection_lost(self, exc) -> None:
        self._stop_timer()
        super().connection_lost(exc)

    def _watch_headers(self) -> None:
        """Starts the deadline where the connection waits for a request's headers (h11's IDLE:
        nothing or part of them received) and none runs; stops it once they are in."""
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(self.HEADER_TIMEOUT_S, self._headers_late)
        else:
            self._stop_timer()

    def _stop_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def header_deadline(seconds: float) -> type[HeaderDeadline]:
    """HeaderDeadline with a deadline of `seconds` (uvicorn.Config's http= takes a class)."""
    return type("HeaderDeadline", (HeaderDeadline,), {"HEADER_TIMEOUT_S": float(seconds)})


def uvicorn_config(
    app, host: str, port: int, limits: Limits, keep_alive_s: int, grace: float
) -> uvicorn.Config:
    """uvicorn's Config for the app: h11 with the header deadline, the keep-alive timeout, no
    access log."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=header_deadline(limits.header_timeout_s),
        timeout_keep_alive=keep_alive_s,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=int(grace) + 10,
    )


class GracefulServer(uvicorn.Server):
    """uvicorn's server whose SIGTERM / SIGINT starts the engine's grace period and keeps
    listening (new requests and /health: 503 with Retry-After) until the engine thread is done
    (what ran finished or was cancelled at the grace period's end), then exits normally (uvicorn
    alone closes the listener at once and re-raises the signal after shutting down: exit code
    143). A second signal exits at once. `on_listening` runs once the socket listens."""

    def __init__(self, config: uvicorn.Config, service: Service, grace: float, on_listening=None):
        super().__init__(config)
        self.service = service
        self.grace = grace
        self.on_listening = on_listening
        self.signal_name: str | None = None

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.on_listening is not None:
            self.on_listening()

    def handle_exit(self, sig: int, frame) -> None:
        if self.signal_name is None:
            self.signal_name = signal.Signals(sig).name
            self.begin_shutdown()
        else:
            self.force_exit = self.should_exit = True

    def begin_shutdown(self) -> None:
        """The grace period: the worker stops taking requests; on_tick ends the server once its
        thread is done (at once while the engine is still loading)."""
        worker = self.service.worker
        if worker is not None:
            worker.shutdown(self.grace)

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        if self.signal_name is None:
            return False
        worker = self.service.worker
        return worker is None or not worker.alive


def load_engine(mesh=None, measure_costs: bool = False):
    """The Engine from launch.flags' model, drafter and precision flags (shared.load_pair), with
    --max_batch row slots and a queue of --max_queue, on `mesh` (check_flags' first).
    measure_costs: gamma=auto measures each row bucket's model calls before serving where none
    are cached (minutes on the Qwen pair); by default it starts from the prior and refines from
    the rounds served."""
    pair = shared.load_pair(FLAGS.max_batch, mesh)
    return Engine(
        pair.target,
        shared.drafting_of(pair).draft,
        max_batch=FLAGS.max_batch,
        max_queue=FLAGS.max_queue,
        gamma=shared.gamma_from_flag(),
        tree=shared.tree_from_flag(),
        mesh=mesh,
        max_context=FLAGS.max_context,
        measure_costs=measure_costs,
        prefix_cache_mb=FLAGS.prefix_cache_mb,
    )


WARM_TOKENS = 8  # per warm-up request: past gamma=auto's first plain round into a drafting chunk


def warm_up(engine, buckets=None) -> None:
    """Greedy requests at each of `buckets` (default every one of the engine's row buckets: 1, 2,
    4, ... max_batch at once), each set twice (the second reuses the kept prefilled rows), so
    that no client waits for a prefill, a kept row's write or a loop to compile at those
    concurrencies."""
    for n in engine.buckets if buckets is None else buckets:
        for _ in range(2):
            for i in range(n):
                engine.submit(Request(prompt_ids=(i,), max_tokens=WARM_TOKENS))
            for _ in engine.drain():
                pass


def serve(
    load,
    model: str,
    host: str,
    port: int,
    grace: float,
    limits: Limits,
    keep_alive_s: int = 5,
    warm_all=False,
):
    """Listens at once and serves the engine that `load()` returns (loaded and warmed in a
    thread meanwhile: /health says "loading") until SIGTERM / SIGINT; returns the one line that
    says how it stopped. A failure to load stops the server and is raised here."""
    metrics = Metrics(model)
    service = Service(model, metrics, limits)
    url = f"http://{host}:{port}/v1"

    def load_and_warm():
        try:
            engine = load()
            warm_up(engine, None if warm_all else engine.buckets[:1])
            service.serve_engine(engine)
        except BaseException as e:  # raised by serve once the server has stopped
            service.error = e
            server.should_exit = True
            return
        print(
            f"launch.serve: serving {model} on {url} ({engine_slots(engine)} slots{drafting(engine)})",
            flush=True,
        )

    loader = threading.Thread(target=load_and_warm, name="spec-jax-load", daemon=True)

    def on_listening():
        print(
            f"launch.serve: listening on {url}; loading {model} (GET /health: 503 until it is ready)",
            flush=True,
        )
        loader.start()

    config = uvicorn_config(make_app(service), host, port, limits, keep_alive_s, grace)
    server = GracefulServer(config, service, grace, on_listening)
    server.run()
    if service.error is not None:
        raise service.error
    return _how_it_stopped(server, service, model, host, port, grace)


def _how_it_stopped(server, service, model: str, host: str, port: int, grace: float) -> str:
    """Once the server has stopped: returns the one line that says how a signal stopped it (while
    loading, or with the worker's requests finished, cancelled and failed within the `grace`
    period, which it waits for). common.UsageError where uvicorn stopped by itself (e.g. the port
    was taken), after shutting the worker down."""
    worker = service.worker
    if server.signal_name is None:  # uvicorn stopped by itself (e.g. the port was taken)
        if worker is not None:
            worker.shutdown(0)
            worker.join(timeout=30)
        raise common.UsageError(f"--host={host} --port={port}: the server could not start or stopped")
    if worker is None:
        return f"launch.serve: {server.signal_name}: stopped while loading {model}"
    worker.join(timeout=grace + 30)
    c = worker.counts
    return (
        f"launch.serve: {server.signal_name}: stopped taking requests; {c['finished']} finished, "
        f"{c['cancelled']} cancelled, {c['error']} failed within the {grace:g} s grace period"
    )


def drafting(engine) -> str:
    """The ready line's note where gamma=auto set the draft model aside
    (spec_jax.plan.bucket_controllers): plain decoding, or a hybrid's prompt lookup alone."""
    sources = engine.drafter.sources
    if engine.controllers and not sources:
        return "; gamma=auto: drafting would not pay here, decoding plainly"
    if engine.controllers and FLAGS.drafter == "hybrid" and sources == ("prompt_lookup",):
        return "; gamma=auto: the draft model would not pay here, prompt lookup drafts alone"
    return ""


def engine_slots(engine) -> int:
    return int(engine.stats().get("max_batch", FLAGS.max_batch))


def main(argv):
    if len(argv) > 1:
        raise common.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    mesh, _ = shared.check_flags()  # every flag, before the server listens or anything loads
    limits = Limits(
        max_body_bytes=int(FLAGS.max_body_mb * MiB),
        body_timeout_s=FLAGS.body_timeout,
        header_timeout_s=FLAGS.header_timeout,
        health_stall_s=FLAGS.health_stall,
    )
    model = FLAGS.model_name or FLAGS.target
    line = serve(
        functools.partial(load_engine, mesh),
        model,
        FLAGS.host,
        FLAGS.port,
        FLAGS.grace_period,
        limits,
        FLAGS.keep_alive_timeout,
        FLAGS.warm_all_buckets,
    )
    print(line, flush=True)
    sys.stdout.flush()


def cli():
    """The command line: main under launch.common.run (bad flags: one line, exit 2)."""
    common.run(main)


if __name__ == "__main__":
    cli()
