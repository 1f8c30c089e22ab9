"""An OpenAI-compatible HTTP server on the project's engine (spec_jax.engine), with streaming and
continuous batching.

  python -m launch.serve                                  # the Qwen pair, http://127.0.0.1:8000/v1
  python -m launch.serve --target=random --draft=random-draft --port=8001 --max_batch=4
  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
      -d '{"model": "qwen2.5-coder-1.5b", "prompt": "def f(x):", "max_tokens": 32}'

Endpoints: POST /v1/completions, POST /v1/chat/completions (the target's chat template),
`"stream": true` as server-sent events ending in `data: [DONE]`, GET /v1/models, GET /health,
GET /metrics (Prometheus text). The model, drafter and precision flags are launch.generate's
(see --helpfull); a request's fields take launch.generate's defaults (greedy, the model's stop
tokens). Per-request speculation: `"spec_jax": {"speculate": false}` decodes that request plainly.
launch/serve_schema.py documents the bodies and their checks.

Faults: a malformed body, a wrong type, a value out of range or an unknown field is a 400 naming
the field, an unknown model a 404, both before the engine sees the request; a prompt over the
context a 400 naming the limit; a full queue a 429 with Retry-After; a client that leaves
mid-stream has its row cancelled and its slot freed; non-finite logits end that request with an
error (the others go on); SIGTERM or SIGINT stops taking requests (503), lets what runs finish
for --grace_period seconds, cancels the rest, and exits 0 with one line.
"""

import asyncio
import json
import signal
import sys
import time

import uvicorn
from absl import flags
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from launch import common
from launch import generate as generate_flags  # the model, drafter and precision flags
from launch.serve_engine import EngineWorker, Metrics, Stream
from launch.serve_schema import (
    ApiError,
    ChatBody,
    CompletionBody,
    StreamOptions,
    chunk,
    completion,
    parse_body,
    request_id,
    to_request,
)
from launch.serve_schema import usage as usage_body
from spec_jax.engine import Engine, QueueFull
from spec_jax.request import Request, RequestError

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
    "On SIGTERM: seconds the running requests may take before they are cancelled.",
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

RETRY_AFTER_S = 1  # the Retry-After of a 429 or a 503


def make_app(worker: EngineWorker, metrics: Metrics, model: str, context: int) -> Starlette:
    """The ASGI app: the endpoints over `worker` (which owns the engine), serving `model` with a
    context of `context` tokens."""

    async def completions(http: HttpRequest) -> Response:
        return await _generate(http, worker, metrics, model, chat=False)

    async def chat_completions(http: HttpRequest) -> Response:
        return await _generate(http, worker, metrics, model, chat=True)

    async def models(http: HttpRequest) -> Response:
        card = {
            "id": model,
            "object": "model",
            "created": 0,
            "owned_by": "spec-jax",
            "max_model_len": context,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def health(http: HttpRequest) -> Response:
        if not worker.accepting:
            return JSONResponse({"status": "shutting down"}, 503, headers={"Retry-After": str(RETRY_AFTER_S)})
        return JSONResponse({"status": "ok", "running": worker.busy})

    async def prometheus(http: HttpRequest) -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

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
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: internal_error})


async def _generate(
    http: HttpRequest, worker: EngineWorker, metrics: Metrics, model: str, chat: bool
) -> Response:
    """One POST: the body checked and turned into a Request, submitted, answered whole or streamed."""
    endpoint = "chat" if chat else "completions"
    try:
        body = parse_body(await http.body(), ChatBody if chat else CompletionBody)
        if body.model != model:
            raise ApiError(
                404,
                f"model: {body.model!r} is not served here; this server serves {model!r} (GET /v1/models)",
                param="model",
                code="model_not_found",
            )
        stream = await _submit(worker, to_request(body))
    except ApiError as e:
        metrics.requests.labels(endpoint=endpoint, status=str(e.status)).inc()
        return JSONResponse(e.body(), e.status, headers=e.headers)
    metrics.requests.labels(endpoint=endpoint, status="200").inc()
    options = body.stream_options or StreamOptions()
    rid = request_id(chat)
    if body.stream:
        events = _events(worker, stream, rid, model, chat, options)
        return StreamingResponse(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
    return await _whole(http, worker, stream, rid, model, chat)


async def _submit(worker: EngineWorker, request) -> Stream:
    """worker.submit with the engine's refusals as ApiErrors: the context (400) and a full queue or
    a server shutting down (429 / 503, with Retry-After)."""
    if not worker.accepting:
        raise _unavailable()
    try:
        return await worker.submit(request)
    except RequestError as e:
        raise ApiError(400, str(e), param=e.field) from None
    except QueueFull as e:
        if not worker.accepting:
            raise _unavailable() from None
        retry = {"Retry-After": str(RETRY_AFTER_S)}
        raise ApiError(
            429, f"the queue is full: {e}", type="rate_limit_error", code="rate_limit_exceeded", headers=retry
        ) from None


def _unavailable() -> ApiError:
    headers = {"Retry-After": str(RETRY_AFTER_S)}
    return ApiError(
        503, "the server is shutting down", type="server_error", code="shutting_down", headers=headers
    )


async def _events(
    worker: EngineWorker, stream: Stream, rid: str, model: str, chat: bool, options: StreamOptions
):
    """The server-sent events of one streamed request: a chunk per Update with text (and the last;
    each with the usage so far if options.continuous_usage_stats), an error event if the request
    failed, a usage chunk if options.include_usage, then `data: [DONE]`. A client that leaves
    ends this generator: its request is cancelled and its slot freed."""
    created = int(time.time())
    first = True
    try:
        while True:
            update = await stream.get()
            failure = _failure(update)
            if failure is not None:
                yield _sse(failure.body())
                break
            if update.text or update.finished or first:
                piece = chunk(rid, model, created, chat, update.text, _finish_reason(update), first)
                if options.continuous_usage_stats:
                    piece["usage"] = usage_body(_prompt_tokens(stream), stream.tokens)
                yield _sse(piece)
                first = False
            if update.finished:
                if options.include_usage:
                    tail = chunk(rid, model, created, chat, "", None, False) | {"choices": []}
                    yield _sse(tail | {"usage": usage_body(_prompt_tokens(stream), stream.tokens)})
                break
        yield "data: [DONE]\n\n"
    finally:
        worker.cancel(stream)  # a no-op once it has finished


async def _whole(
    http: HttpRequest, worker: EngineWorker, stream: Stream, rid: str, model: str, chat: bool
) -> Response:
    """The non-streamed answer: every Update's text joined; the request is cancelled if the client
    leaves first (checked each second)."""
    pieces = []
    try:
        while True:
            try:
                update = await asyncio.wait_for(stream.get(), timeout=1.0)
            except TimeoutError:
                if await http.is_disconnected():
                    worker.cancel(stream)
                continue
            pieces.append(update.text)
            if update.finished:
                break
    except asyncio.CancelledError:
        worker.cancel(stream)
        raise
    failure = _failure(update)
    if failure is not None:
        return JSONResponse(failure.body(), failure.status)
    use = usage_body(_prompt_tokens(stream), stream.tokens)
    return JSONResponse(completion(rid, model, chat, "".join(pieces), _finish_reason(update), use))


def _failure(update) -> ApiError | None:
    """The error a request's last Update reports: the engine's (e.g. non-finite logits: 500), or
    a cancellation by the server (its grace period ran out: 503); None for a request that ended
    normally."""
    if update.error is not None:
        return ApiError(500, update.error, type="server_error", code=update.finish_reason)
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


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class _Server(uvicorn.Server):
    """uvicorn's server whose SIGTERM / SIGINT starts the engine's grace period and then exits
    normally (uvicorn alone re-raises the signal after shutting down: exit code 143)."""

    def __init__(self, config: uvicorn.Config, worker: EngineWorker, grace: float, ready_line: str):
        super().__init__(config)
        self.ready_line = ready_line
        self.worker = worker
        self.grace = grace
        self.signal_name: str | None = None

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:  # listening: the line a script may wait for
            print(self.ready_line, flush=True)

    def handle_exit(self, sig: int, frame) -> None:
        if self.signal_name is None:
            self.signal_name = signal.Signals(sig).name
            self.worker.shutdown(self.grace)
        else:
            self.force_exit = True
        self.should_exit = True


def load_engine():
    """The Engine from launch.generate's model, drafter and precision flags, with --max_batch row
    slots and a queue of --max_queue (the flags checked before anything loads)."""
    mesh, _ = generate_flags.check_flags()
    target = generate_flags.load_model(FLAGS.target, FLAGS.target_dtype, FLAGS.max_batch, mesh)
    draft = None
    if FLAGS.draft != "none" and FLAGS.drafter in ("model", "hybrid"):
        draft = generate_flags.load_model(FLAGS.draft, FLAGS.draft_dtype, FLAGS.max_batch, mesh)
    stop_ids = generate_flags.stop_ids_from_flag(target.tokenizer, target.config.vocab_size)
    draft_vocab = generate_flags.draft_vocab_from_flag(draft.config.vocab_size) if draft is not None else 0
    drafter = generate_flags.build_draft(target, draft, stop_ids, draft_vocab)
    return Engine(
        target,
        drafter,
        max_batch=FLAGS.max_batch,
        max_queue=FLAGS.max_queue,
        gamma=generate_flags.gamma_from_flag(),
        tree=generate_flags.tree_from_flag(),
        mesh=mesh,
        max_context=FLAGS.max_context,
    )


WARM_TOKENS = 8  # per warm-up request: past gamma=auto's first plain round into a drafting chunk


def warm_up(engine) -> None:
    """Greedy requests at each of the engine's row buckets (1, 2, 4, ... max_batch at once), each
    set twice (the second reuses the kept prefilled rows), so that no client waits for a
    prefill, a kept row's write or a loop to compile at its concurrency."""
    for n in engine.buckets:
        for _ in range(2):
            for i in range(n):
                engine.submit(Request(prompt_ids=(i,), max_tokens=WARM_TOKENS))
            for _ in engine.drain():
                pass


def serve(engine, model: str, host: str, port: int, grace: float, context: int) -> str:
    """Serves `engine` until SIGTERM / SIGINT; returns the one line that says how it stopped."""
    warm_up(engine)
    metrics = Metrics(model)
    worker = EngineWorker(engine, metrics).start()
    app = make_app(worker, metrics, model, context)
    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", access_log=False, timeout_graceful_shutdown=grace + 10
    )
    plain = (
        ""
        if engine.drafts or not engine.controllers
        else "; gamma=auto: drafting would not pay here, decoding plainly"
    )
    ready = f"launch.serve: serving {model} on http://{host}:{port}/v1 ({engine_slots(engine)} slots{plain})"
    server = _Server(config, worker, grace, ready)
    server.run()
    if server.signal_name is None:  # uvicorn stopped by itself (e.g. the port was taken)
        worker.shutdown(0)
        worker.join(timeout=30)
        raise common.UsageError(f"--host={host} --port={port}: the server could not start or stopped")
    worker.join(timeout=grace + 30)
    c = worker.counts
    return (
        f"launch.serve: {server.signal_name}: stopped taking requests; {c['finished']} finished, "
        f"{c['cancelled']} cancelled, {c['error']} failed within the {grace:g} s grace period"
    )


def engine_slots(engine) -> int:
    return int(engine.stats().get("max_batch", FLAGS.max_batch))


def main(argv):
    if len(argv) > 1:
        raise common.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    engine = load_engine()
    model = FLAGS.model_name or FLAGS.target
    line = serve(engine, model, FLAGS.host, FLAGS.port, FLAGS.grace_period, engine.max_context)
    print(line, flush=True)
    sys.stdout.flush()


def cli():
    """The command line: main under launch.common.run (bad flags: one line, exit 2)."""
    common.run(main)


if __name__ == "__main__":
    cli()
