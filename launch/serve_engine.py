"""The engine's thread for `launch.serve`, and the server's Prometheus metrics.

One worker thread owns the `spec_jax.engine.Engine` (which is not thread-safe): submits and
cancels reach it through a thread-safe queue, and each request's `Update`s go back to that
request's asyncio queue on the server's event loop (`loop.call_soon_threadsafe`). The HTTP layer
never touches the engine. A request's outcome is always delivered: its updates end with one whose
`finished` is true (stop, length, cancelled or error), also when the engine raises or the server
shuts down.

What is slow and per request stays off that thread: `EngineWorker.prepare` tokenizes a prompt
(or renders and tokenizes a conversation) in the caller's thread and hands the engine token ids.
An exception the engine raises while admitting a request fails that request alone (EngineFailed),
and one raised while stepping fails the requests that were running; the thread goes on either
way. Each turn of its loop stamps `heartbeat`, which /health reads.
"""

import asyncio
import contextlib
import dataclasses
import queue
import sys
import threading
import time
import traceback

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from spec_jax.engine import QueueFull, Update
from spec_jax.request import Admitted, Request, RequestError

PREFIX = "spec_jax"
prometheus_client.disable_created_metrics()  # no `_created` sample beside every counter
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120)


class EngineFailed(RuntimeError):
    """The engine raised something other than its refusals while admitting one request (a bug):
    that request fails (500), the others and the engine thread go on."""


class Stream:
    """One request's side of the worker: its asyncio queue of Updates and its timings (perf_counter
    seconds). `done` once its finished Update has been queued. `rid`: the id its response carries
    (named in its errors); `row_id`: its row's keys, fold_in(key(seed), row_id) (a response's n
    samples of one prompt: 0..n-1)."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, request: Request | Admitted, rid: str = "", row_id: int = 0
    ):
        self.loop = loop
        self.request = request
        self.rid = rid
        self.row_id = row_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.started = asyncio.Event()  # set with its first Update: it was prefilled (or ended)
        self.handle = None
        self.arrived = time.perf_counter()
        self.first_token: float | None = None
        self.tokens = 0
        self.done = False

    def put(self, update: Update) -> None:
        """From the worker thread: hand `update` to the event loop."""
        self.loop.call_soon_threadsafe(self._arrived, update)

    def _arrived(self, update: Update) -> None:
        self.queue.put_nowait(update)
        self.started.set()

    async def get(self) -> Update:
        return await self.queue.get()


class Metrics:
    """The server's Prometheus metrics (in a registry of its own), rendered by GET /metrics: HTTP
    requests by endpoint and status, tokens, time to first token, time per output token, and the
    engine's own counters (acceptance, queue depth, slot occupancy) read from `Engine.stats()`."""

    def __init__(self, model: str):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            f"{PREFIX}_http_requests",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.finished = Counter(
            f"{PREFIX}_requests_finished", "Requests ended, by finish reason", ["reason"], registry=r
        )
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "Arrival to first token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            f"{PREFIX}_time_per_output_token_seconds",
            "(last token - first token) / (tokens - 1), per request",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
            registry=r,
        )
        self.e2e = Histogram(
            f"{PREFIX}_request_latency_seconds", "Arrival to last token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.running = Gauge(f"{PREFIX}_requests_running", "Requests submitted and not finished", registry=r)
        Gauge(f"{PREFIX}_model_info", "The served model", ["model"], registry=r).labels(model=model).set(1)
        self.engine_stats: dict = {}  # the worker's latest Engine.stats(), replaced whole
        r.register(_EngineCollector(self))

    def observe_finish(self, stream: Stream, update: Update, now: float) -> None:
        """Counts a request that ended (its last Update)."""
        self.finished.labels(reason=update.finish_reason or "unknown").inc()
        self.running.dec()
        self.e2e.observe(now - stream.arrived)
        if stream.first_token is not None and stream.tokens > 1:
            self.tpot.observe((now - stream.first_token) / (stream.tokens - 1))


class _EngineCollector:
    """Engine.stats() as metrics: draft and accepted tokens (acceptance = accepted / draft),
    queue depth, busy slots and the slot count."""

    COUNTERS = {
        "requests_total": "Requests the engine accepted (submitted)",
        "prompt_tokens_total": "Prompt tokens of the requests submitted to the engine",
        "draft_tokens_total": "Tokens the drafter proposed",
        "accepted_tokens_total": "Drafted tokens the target accepted",
        "rounds": "Rounds run (target calls of the compiled loop)",
        "chunks": "Chunks of rounds run (host round trips)",
        "prefill_calls": "Prefill calls (each prefills one or more waiting requests)",
        "prefill_cache_hits": "Requests whose prefilled row was kept from an identical earlier request",
        "prefix_cache_hit_tokens": "Prompt tokens read from the prefix cache instead of computed",
        "prefix_cache_inserted_tokens": "Prompt tokens whose keys and values the prefix cache kept",
        "prefill_pieces": "Pieces of long prompts read while rows decoded (each followed by decoding)",
        "tokens_past_stop_total": "Tokens computed after a stop string's match, then cut",
        "decode_seconds": "Seconds in chunks of the compiled loop, compilation excluded",
        "prefill_seconds": "Seconds in prefills, compilation excluded",
        "table_seconds": "Seconds writing, moving and resizing the table's rows (device work between chunks)",
        "compile_seconds": "Seconds compiling",
        "scored_prompts_total": "Prompts scored for their logprobs (echo with logprobs, or max_tokens 0)",
        "score_seconds": "Seconds scoring prompts for their logprobs",
        "step_seconds": "Seconds in Engine.step() calls (minus decode, prefill, table and compile: the host's own work)",
    }
    GAUGES = {
        "queue_depth": "Requests waiting for a slot",
        "slots_busy": "Row slots holding a request",
        "max_batch": "Row slots in the engine's table",
        "live_rows": "Rows the compiled loop runs over now (the smallest bucket holding the busy slots)",
        "prefix_cache_tokens": "Prompt tokens the prefix cache holds now",
    }

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self):
        stats = self.metrics.engine_stats
        for key, doc in self.COUNTERS.items():
            if key in stats:
                yield CounterMetricFamily(
                    f"{PREFIX}_engine_{key.removesuffix('_total')}", doc, value=stats[key]
                )
        for key, doc in self.GAUGES.items():
            if key in stats:
                yield GaugeMetricFamily(f"{PREFIX}_engine_{key}", doc, value=stats[key])
        if stats.get("draft_tokens_total"):
            rate = stats["accepted_tokens_total"] / stats["draft_tokens_total"]
            yield GaugeMetricFamily(
                f"{PREFIX}_acceptance_rate", "accepted / draft tokens since start", value=rate
            )


@dataclasses.dataclass
class _Submit:
    stream: Stream
    done: asyncio.Future


@dataclasses.dataclass
class _Cancel:
    stream: Stream


class EngineWorker:
    """The thread that owns the engine. `prepare` (from any other thread) tokenizes a request;
    `submit` (from the event loop) returns a Stream, or raises RequestError (the engine's model
    checks, e.g. the context), QueueFull or EngineFailed; `cancel` ends a request and frees its
    slot; `shutdown(grace)` stops taking requests and cancels what still runs `grace` seconds
    later; `join()` waits for the thread to end; `alive` and `heartbeat` (time.monotonic() of the
    loop's last turn) say whether it still works."""

    IDLE_WAIT_S = 1.0  # an idle loop turns at least this often (its heartbeat)

    def __init__(self, engine, metrics: Metrics):
        self.engine = engine
        self.metrics = metrics
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict = {}  # handle -> Stream, while running
        self._deadline: float | None = None  # set by shutdown(): cancel all at this time
        self.accepting = True
        self.counts = {"finished": 0, "cancelled": 0, "error": 0}
        self.heartbeat = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="spec-jax-engine", daemon=True)

    def start(self) -> "EngineWorker":
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        """Whether the engine thread runs (it ends after shutdown, or where something no handler
        stops ended it)."""
        return self._thread.is_alive()

    @property
    def shutting_down(self) -> bool:
        """Whether shutdown() was called."""
        return self._deadline is not None

    def prepare(self, request: Request) -> Admitted:
        """`request` admitted as the engine takes it (Request.admit against the engine's target
        and limits: validated, its prompt's token ids, stop ids, room). Runs in the caller's
        thread, never the engine's: tokenizing a long prompt does not hold up the rows that run
        (the tokenizer releases the GIL). RequestError naming the field at fault."""
        return request.admit(self.engine.target, self.engine.limits)

    async def submit(self, request: Request | Admitted, rid: str = "", row_id: int = 0) -> Stream:
        loop = asyncio.get_running_loop()
        stream = Stream(loop, request, rid, row_id)
        done = loop.create_future()
        self._inbox.put(_Submit(stream, done))
        try:
            await done  # the worker sets the handle, or RequestError / QueueFull / EngineFailed
        except asyncio.CancelledError:  # the client left before its request was admitted
            self._inbox.put(_Cancel(stream))  # after the _Submit: the handle is set by then
            raise
        return stream

    def cancel(self, stream: Stream) -> None:
        if not stream.done:
            self._inbox.put(_Cancel(stream))

    def shutdown(self, grace: float) -> None:
        """Stops taking requests; what runs may finish for `grace` seconds, then is cancelled; the
        thread ends once nothing runs."""
        self.accepting = False
        self._deadline = time.monotonic() + grace
        self._inbox.put(None)  # wake the thread

    def join(self, timeout: float | None = None) -> bool:
        """Waits for the thread; whether it ended."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def busy(self) -> int:
        return len(self._streams)

    def _run(self) -> None:
        try:
            while True:
                self.heartbeat = time.monotonic()
                try:
                    if self._turn():
                        return
                except Exception:  # a bug here, not in the engine: fail what runs, keep serving
                    traceback.print_exc(file=sys.stderr)
                    self._fail_all("the server's engine thread failed (see its log)")
                    time.sleep(0.1)  # a fault that repeats does not spin
        finally:  # shut down, or ended by something no handler stops: nothing may wait on it
            self._fail_all("the engine thread stopped")
            self._save_costs()

    def _turn(self) -> bool:
        """One turn of the loop: takes in submits and cancels, cancels what the grace period
        cut, runs one engine step; whether the thread is done (shut down, nothing runs)."""
        self._take_inbox(block=not self._streams and self._deadline is None)
        if self._deadline is not None and time.monotonic() >= self._deadline:
            for handle in list(self._streams):
                self._cancel_handle(handle)
        if self._deadline is not None and not self._streams:
            return True
        if self._streams:
            self._step()
        self._publish()
        return False

    def _take_inbox(self, block: bool) -> None:
        """Handles every submit and cancel waiting (waiting up to IDLE_WAIT_S for one when
        `block`)."""
        items = []
        try:
            items.append(self._inbox.get(timeout=self.IDLE_WAIT_S) if block else self._inbox.get_nowait())
            while True:
                items.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        for item in items:
            if isinstance(item, _Submit):
                self._admit(item)
            elif isinstance(item, _Cancel) and item.stream.handle in self._streams:
                self._cancel_handle(item.stream.handle)

    def _admit(self, item: _Submit) -> None:
        loop = item.stream.loop
        if not self.accepting:
            error = QueueFull("the server is shutting down")
        else:
            try:
                item.stream.handle = self.engine.submit(item.stream.request, item.stream.row_id)
                error = None
            except (RequestError, QueueFull) as e:
                error = e
            except Exception as e:  # a bug met by this request: it fails, the thread goes on
                traceback.print_exc(file=sys.stderr)
                error = EngineFailed(f"{type(e).__name__}: {e}")
        if error is not None:
            loop.call_soon_threadsafe(_settle, item.done, error)
            return
        self._streams[item.stream.handle] = item.stream
        self.metrics.running.inc()
        loop.call_soon_threadsafe(_settle, item.done, None)

    def _cancel_handle(self, handle) -> None:
        """Cancels in the engine (its slot is freed at once) and ends the stream as cancelled."""
        stream = self._streams.get(handle)
        try:
            self.engine.cancel(handle)
        except Exception:  # the request may have just finished inside the engine
            traceback.print_exc(file=sys.stderr)
        if stream is not None:
            self._deliver(
                stream, Update(handle=handle, token_ids=[], text="", finished=True, finish_reason="cancelled")
            )

    def _step(self) -> None:
        try:
            updates = self.engine.step()
        except Exception as e:  # a bug in the engine: fail what runs, keep serving
            traceback.print_exc(file=sys.stderr)
            self._fail_all(f"the engine failed: {type(e).__name__}: {e}")
            return
        for update in updates:
            stream = self._streams.get(update.handle)
            if stream is not None:  # None: cancelled here already
                self._deliver(stream, update)

    def _fail_all(self, message: str) -> None:
        """Ends every running request with an error Update carrying `message` (each cancelled in
        the engine first: the engine step that failed ran them all together, so none of them can
        be told apart as the one at fault)."""
        for handle in list(self._streams):
            self._cancel_handle_quietly(handle)
            fail = Update(
                handle=handle, token_ids=[], text="", finished=True, finish_reason="error", error=message
            )
            self._deliver(self._streams[handle], fail)

    def _publish(self) -> None:
        """The engine's numeric counters for /metrics."""
        stats = self.engine.stats()
        self.metrics.engine_stats = {k: v for k, v in stats.items() if isinstance(v, int | float)}

    def _save_costs(self) -> None:
        """As the thread ends: gamma=auto's controllers' timed rounds go into their cached costs
        (autogamma.Controller.save_rounds), so that the next start plans with what this one ran."""
        for controller in self.engine.controllers.values():
            try:
                controller.save_rounds()
            except Exception:  # the costs are a cache: never fail the shutdown over them
                traceback.print_exc(file=sys.stderr)

    def _cancel_handle_quietly(self, handle) -> None:
        with contextlib.suppress(Exception):  # the engine already failed; its state is unknown
            self.engine.cancel(handle)

    def _deliver(self, stream: Stream, update: Update) -> None:
        now = time.perf_counter()
        if update.token_ids:
            if stream.first_token is None:
                stream.first_token = now
                self.metrics.ttft.observe(now - stream.arrived)
            stream.tokens += len(update.token_ids)
            self.metrics.generation_tokens.inc(len(update.token_ids))
        if update.finished:
            stream.done = True
            del self._streams[update.handle]
            self.metrics.observe_finish(stream, update, now)
            reason = update.finish_reason
            self.counts[
                "cancelled" if reason == "cancelled" else "error" if reason == "error" else "finished"
            ] += 1
        stream.put(update)


def _settle(future: asyncio.Future, error: Exception | None) -> None:
    if future.cancelled():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
