"""How far one object travels through the project's code (issue 54's goals), by sys.setprofile.

  .venv/bin/python scripts/call_trace.py [--path=both|generate|serve] [--verbose] [--json=FILE]

A *stop* is a call into the project's own code (spec_jax/, models/, launch/; not site-packages,
not tests) whose arguments (named, *args' items, **kwargs' values) hold a tracked object, by
identity, at the call's 'call' event; a coroutine's or generator's resumption is not a new call.
*Files* counts the distinct files of the stops; a *return* is a stop into a file visited before
that is not the previous stop's file.

- generate: `target` through one spec_jax.generate call (gamma=auto) on a tiny random pair (a
  4-layer target, a 1-layer draft) with token-id prompts, the process's first call (compilation
  included). Only `target` is tracked, by identity (not its config, params or what it returns).
- serve: one tiny-model completion through launch.serve's app (tests/serve_support.Server:
  uvicorn in a thread, the engine in another; threading.setprofile follows both) from the
  handler to the compiled loop (the first call of `Runner.loop`, or --until's qualified name;
  not counted: tracing ends there). Tracked: the handler's HTTP request, then every
  stop's return value that is not None, a bool, a number or a str (a tuple's or list's items
  too, two levels down): body -> Request -> token ids -> row -> ... Once the loop's thread
  (the engine's) has its first stop, the other threads' later stops are left out: they wait for
  the answer (the response side), concurrently, in an order that varies from run to run.

Prints a table (stops, files, returns per path; --verbose: each stop as file:function) and
exits 0. Uses only public entry points (spec_jax.generate, spec_jax.Engine, models.random_model,
the serve tests' Server) so that it measures any layout of the files behind them.
"""

import argparse
import dataclasses
import dis
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
# serve_support imports the tests' conftest, which puts the compile-only TPU / GPU backends on
# the path where they are installed (their plugins log errors at jax's start-up): not needed here
# (left as it is in a test process, whose conftest has run and whose subprocesses inherit it)
if "conftest" not in sys.modules:
    os.environ.setdefault("SPEC_JAX_COMPILE_DEPS", "")

from starlette.requests import Request as HttpRequest  # noqa: E402

try:  # the serve tests' in-process server and tiny GGUF pair; the generate path runs without it
    import serve_support
except ImportError as e:
    serve_support, SERVE_SUPPORT_MISSING = None, e

import models  # noqa: E402
import spec_jax  # noqa: E402

PACKAGES = ("spec_jax", "models", "launch")
_FIRST_CALL, _SUSPENSION = dis.opmap["RESUME"], dis.opmap["YIELD_VALUE"]
_GENERATOR_FLAGS = 0x20 | 0x80 | 0x200  # CO_GENERATOR, CO_COROUTINE, CO_ASYNC_GENERATOR
_VARARGS, _VARKEYWORDS = 0x04, 0x08
_PRIMITIVES = (type(None), bool, int, float, complex, str)


@dataclasses.dataclass(frozen=True)
class Stop:
    file: str  # relative to the root, e.g. "spec_jax/api.py"
    function: str  # the code's qualified name
    thread: int = 0  # the ident of the thread that made the call

    def __str__(self) -> str:
        return f"{self.file}:{self.function}"


@dataclasses.dataclass(frozen=True)
class Summary:
    stops: int
    files: int
    returns: int


def summarize(stops: list[Stop]) -> Summary:
    """Stops, distinct files, and returns: stops into a file seen before that is not the previous
    stop's file."""
    seen, returns, previous = set(), 0, None
    for stop in stops:
        if stop.file in seen and stop.file != previous:
            returns += 1
        seen.add(stop.file)
        previous = stop.file
    return Summary(len(stops), len(seen), returns)


def argument_values(frame) -> list:
    """The values of the frame's arguments at its 'call' event: the named ones, then *args'
    items and **kwargs' values."""
    code, local = frame.f_code, frame.f_locals
    n = code.co_argcount + code.co_kwonlyargcount
    values = [local[name] for name in code.co_varnames[:n] if name in local]
    if code.co_flags & _VARARGS:
        values.extend(local.get(code.co_varnames[n], ()))
        n += 1
    if code.co_flags & _VARKEYWORDS:
        values.extend(local.get(code.co_varnames[n], {}).values())
    return values


def _is_first_entry(frame) -> bool:
    """False for a generator's or coroutine's resumption (RESUME with a non-zero operand)."""
    if not frame.f_code.co_flags & _GENERATOR_FLAGS or frame.f_lasti < 0:
        return True
    code = frame.f_code.co_code
    return code[frame.f_lasti] != _FIRST_CALL or code[frame.f_lasti + 1] == 0


def _is_suspension(frame) -> bool:
    """True where a 'return' event is a generator's or coroutine's yield, not its return."""
    if not frame.f_code.co_flags & _GENERATOR_FLAGS or frame.f_lasti < 0:
        return False
    return frame.f_code.co_code[frame.f_lasti] == _SUSPENSION


class Tracer:
    """A profile function (for sys.setprofile and threading.setprofile) that records stops.

    root, packages: the project's code is the files under root/<package>/ (none under a
    site-packages folder). follow_returns: a stop's return value joins the tracked objects.
    start(frame) -> bool: where given, nothing is recorded before the first project call for
    which it holds; that call's argument values (not primitives) are then tracked too.
    until(frame) -> bool: the first project call for which it holds ends the tracing (it is
    not a stop)."""

    def __init__(self, root, packages=PACKAGES, tracked=(), follow_returns=False, start=None, until=None):
        self.root, self.packages = str(pathlib.Path(root).resolve()) + os.sep, tuple(packages)
        self.follow_returns, self.start, self.until = follow_returns, start, until
        self.tracked = {id(x): x for x in tracked}  # the objects kept alive: their ids stay theirs
        self.stops: list[Stop] = []
        self.active = start is None
        self.finished = self.ended = False
        self.end_thread: int | None = None  # the thread that made the `until` call
        self.open_stops: set[int] = set()  # id(frame) of stops not yet returned
        self._files: dict = {}  # code -> its file relative to root, or None outside the project
        self._lock = threading.Lock()

    def project_file(self, code) -> str | None:
        if code not in self._files:
            path = os.path.realpath(code.co_filename)
            relative = path[len(self.root) :] if path.startswith(self.root) else None
            inside = (
                relative and relative.split(os.sep)[0] in self.packages and "site-packages" not in relative
            )
            self._files[code] = relative.replace(os.sep, "/") if inside else None
        return self._files[code]

    def __call__(self, frame, event, arg):
        if self.finished or event not in ("call", "return"):
            return
        if event == "return":
            if self.follow_returns and id(frame) in self.open_stops and not _is_suspension(frame):
                with self._lock:
                    self.open_stops.discard(id(frame))
                    self.track(arg)
            return
        file = self.project_file(frame.f_code)
        if file is None or not _is_first_entry(frame):
            return
        with self._lock:
            self._call(frame, file)

    def _call(self, frame, file: str) -> None:
        if self.until is not None and self.until(frame):
            self.finished = self.ended = True
            self.end_thread = threading.get_ident()
            return
        values = argument_values(frame)
        if not self.active:
            if not self.start(frame):
                return
            self.active = True
            for value in values:
                self.track(value, depth=0)
        if any(id(value) in self.tracked for value in values):
            self.stops.append(Stop(file, frame.f_code.co_qualname, threading.get_ident()))
            self.open_stops.add(id(frame))

    def path(self) -> list[Stop]:
        """The stops on the way to the `until` call: where that call's thread took the object in,
        the other threads' later stops are left out (they wait for its answer, concurrently, in
        an order that varies from run to run)."""
        first = next((i for i, s in enumerate(self.stops) if s.thread == self.end_thread), None)
        if first is None:
            return list(self.stops)
        return self.stops[:first] + [s for s in self.stops[first:] if s.thread == self.end_thread]

    def track(self, value, depth: int = 2) -> None:
        """Tracks value (not a primitive) and, depth levels down, a tuple's or list's items."""
        if isinstance(value, _PRIMITIVES):
            return
        self.tracked[id(value)] = value
        if depth and isinstance(value, (tuple, list)):
            for item in value[:64]:
                self.track(item, depth - 1)

    def run(self, fn, *args, threads: bool = False, **kwargs):
        """fn(*args, **kwargs) under this profile (and in the threads it starts where `threads`)."""
        if threads:
            threading.setprofile(self)
        sys.setprofile(self)
        try:
            return fn(*args, **kwargs)
        finally:
            sys.setprofile(None)
            if threads:
                threading.setprofile(None)


def trace_generate(target=None, draft=None, **options) -> list[Stop]:
    """The stops of `target` through one spec_jax.generate(target, prompts, draft=draft,
    **options) call (default: a tiny random pair, max_new_tokens=16) on two token-id prompts."""
    if target is None:  # a draft small enough beside its target that gamma=auto drafts (a pair
        # of equal cost runs plain decoding: the drafter is dropped before the run)
        target = models.random_model(
            vocab_size=64, num_layers=4, d_model=64, num_heads=4, num_kv_heads=2, seed=0
        )
        draft = models.random_model(
            vocab_size=64, num_layers=1, d_model=32, num_heads=4, num_kv_heads=2, seed=1
        )
    options.setdefault("max_new_tokens", 16)
    tracer = Tracer(_code_root(), tracked=[target])
    tracer.run(spec_jax.generate, target, [[1, 2, 3, 4, 5], [7, 8, 9]], draft=draft, **options)
    return tracer.stops


def _code_root() -> pathlib.Path:
    """The folder that holds the imported spec_jax package (this checkout, or PYTHONPATH's)."""
    return pathlib.Path(spec_jax.__file__).resolve().parent.parent


def _is_handler_call(frame) -> bool:
    """A call whose arguments hold Starlette's HTTP request: the app's route handler."""
    return any(isinstance(v, HttpRequest) for v in argument_values(frame))


def calls_to(qualname: str):
    """A predicate on frames: the code's qualified name is `qualname` or ends with "." + it."""
    return lambda frame: (
        frame.f_code.co_qualname == qualname or frame.f_code.co_qualname.endswith("." + qualname)
    )


def trace_serve(folder: pathlib.Path, until: str = "Runner.loop", max_tokens: int = 8) -> list[Stop]:
    """The stops of one completion request through the served app, up to the first call of the
    function whose qualified name ends with `until` (the compiled loop)."""
    if serve_support is None:
        raise SystemExit(f"call_trace: the serve path needs tests/serve_support.py: {SERVE_SUPPORT_MISSING}")
    _, target, draft = serve_support.tiny_pair(folder)
    engine = spec_jax.Engine(target, draft, max_batch=2, max_queue=2, max_context=256)
    tracer = Tracer(_code_root(), follow_returns=True, start=_is_handler_call, until=calls_to(until))
    tracer.finished = True  # off while the server is built and warmed: its threads get the profile
    threading.setprofile(tracer)  # and so do the threads the request starts (asyncio.to_thread's)
    try:
        server = serve_support.Server(engine)
    except BaseException:
        threading.setprofile(None)
        raise
    try:
        body = {"model": serve_support.MODEL, "prompt": "def f(x):", "max_tokens": max_tokens}
        tracer.finished = False
        response = server.post("/v1/completions", body)
        deadline = time.monotonic() + 60
        while not tracer.finished and time.monotonic() < deadline:
            time.sleep(0.05)
        tracer.finished = True
        assert response.status_code == 200, response.text
        assert tracer.stops, "no stop recorded: the handler was not reached"
        assert tracer.ended, f"the request ended without a call to {until} (--until)"
    finally:
        threading.setprofile(None)
        server.close()
    return tracer.path()


GOALS = {"generate": (20, 8), "serve": (18, 8)}  # issue 54: at most this many stops, returns
PATHS = {"generate": lambda folder, until: trace_generate(), "serve": trace_serve}


def _commit() -> str:
    """The short commit of the traced checkout, "+changes" where its packages differ from it."""
    git = ["git", "-C", str(_code_root())]
    try:
        head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--", *PACKAGES], capture_output=True, text=True
        )
    except OSError:
        return "unknown"
    return (head.stdout.strip() or "unknown") + ("+changes" if dirty.stdout.strip() else "")


def numbered(stops: list[Stop]) -> list[tuple[int, Stop]]:
    """(the stop's thread numbered 1, 2, ... in the order they first stop, the stop) of each."""
    threads: dict[int, int] = {}
    return [(threads.setdefault(s.thread, len(threads) + 1), s) for s in stops]


def table(results: dict[str, list[Stop]], verbose: bool) -> str:
    """The summary per path (and, verbose, each path's stops in order)."""
    lines = [f"{'path':<10}{'stops':>7}{'files':>7}{'returns':>9}   goal (issue 54)"]
    for name, stops in results.items():
        s, (most_stops, most_returns) = summarize(stops), GOALS[name]
        lines.append(
            f"{name:<10}{s.stops:>7}{s.files:>7}{s.returns:>9}   <= {most_stops} stops, <= {most_returns} returns"
        )
    for name, stops in results.items() if verbose else ():
        lines.append(f"\n{name} (thread, in order of first stop: file:function):")
        lines.extend(f"  {i:>3} t{thread} {stop}" for i, (thread, stop) in enumerate(numbered(stops), 1))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 2)[2])
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--path", choices=("both", *PATHS), default="both", help="which path to trace")
    parser.add_argument("--verbose", action="store_true", help="list each stop as file:function")
    parser.add_argument(
        "--until", default="Runner.loop", help="serve: tracing ends at this function (qualified name)"
    )
    parser.add_argument("--json", help="also write the figures and the stops to this file")
    args = parser.parse_args(argv)

    results = {}
    with tempfile.TemporaryDirectory(prefix="call_trace") as folder:
        for name in PATHS if args.path == "both" else (args.path,):
            results[name] = PATHS[name](pathlib.Path(folder), args.until)
    print(f"code: {_code_root()} at {_commit()}")
    print(table(results, args.verbose))
    if args.json:
        record = {
            name: {**dataclasses.asdict(summarize(stops)), "trace": [f"t{t} {s}" for t, s in numbered(stops)]}
            for name, stops in results.items()
        }
        record["commit"], record["date"] = _commit(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        record["command"] = " ".join(["scripts/call_trace.py", *(sys.argv[1:] if argv is None else argv)])
        pathlib.Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
