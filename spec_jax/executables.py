"""Compiled loops, cached by shape: a new prompt in the same length bucket reuses the executable.

`compiled(name, fn, static, args, ...)` lowers and compiles `fn(static, *args)` once per
(name, static settings, argument shapes/dtypes/shardings) and returns the executable with the
seconds its compilation took (0 when it came from the cache). Threads share the cache: a
second thread asking for a loop that is compiling waits for it instead of compiling it again.
The cache holds the MAX_EXECUTABLES most recently used loops (`set_max_executables(n)` changes
the bound; the least recently used are dropped), and fewer where the process nears the kernel's
limit on memory mappings: see `map_budget`. TRACE_COUNTS counts, by name, how often
`compiled` traced a function to compile it (a retrace means a recompile); tests read it.

Across processes: `enable_persistent_cache(folder)` turns on JAX's persistent compilation
cache for every program this process compiles from then on (the loops here, and every other
jitted call); `persistent_cache_dir()` is the project's folder for it,
`$SPEC_JAX_CACHE/compilation/<digest of the kernel libraries' builds>/`. The entry points in
launch/ call both once, before anything compiles (launch.runtime.enable_compilation_cache); a
library import never does.
"""

import collections
import contextlib
import functools
import os
import pathlib
import sys
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

import jax

from models import registry  # read through the module: tests patch its cache_root
from models.kernels import builds
from models.settings import is_int

TRACE_COUNTS: collections.Counter = collections.Counter()
MAX_EXECUTABLES = 256  # compiled loops kept per process (least recently used evicted): set_max_executables
_EXECUTABLES: dict = {}  # key -> executable, least recently used first (a plain dict keeps order)
_LOCK = threading.Lock()  # guards _EXECUTABLES and _KEY_LOCKS
_KEY_LOCKS: dict = {}  # key -> a lock held while that key compiles


def _compile(fn_static: Callable, args: tuple, donate_argnums, in_shardings, out_shardings):
    """jax.jit(fn_static) with the given shardings, lowered for args and compiled (announced
    when slow); out_shardings may be a function of the result's shape tree."""
    if callable(out_shardings):
        out_shardings = out_shardings(jax.eval_shape(fn_static, *args))
    shardings = {}
    if in_shardings is not None:
        shardings["in_shardings"] = tuple(in_shardings)
    if out_shardings is not None:
        shardings["out_shardings"] = out_shardings
    jitted = jax.jit(fn_static, donate_argnums=donate_argnums, **shardings)
    with announced_if_slow(COMPILE_NOTICE):
        return jitted.lower(*args).compile()


def compiled(
    name: str,
    fn: Callable,
    static: Hashable,
    args: tuple,
    donate_argnums=(),
    in_shardings=None,
    out_shardings=None,
) -> tuple[Any, float]:
    """Returns (executable, compile_seconds) for fn(static, *args), compiling once per shape.

    The key is the static configuration plus the shapes, dtypes and shardings of args (and
    the requested out_shardings). in_shardings / out_shardings (pytrees of
    jax.sharding.Sharding matching args / the result) are passed to jax.jit when given;
    out_shardings may also be a function from the result's shape tree to them, called (after
    tracing the function once for its shapes) only when there is no executable yet.

    Thread-safe: threads asking for one key while it compiles wait for it (one lock per key)
    and reuse it; different keys compile in parallel. The cache keeps the MAX_EXECUTABLES
    most recently used executables.
    """
    leaves, treedef = jax.tree.flatten(args)
    out_key = None if out_shardings is None or callable(out_shardings) else jax.tree.flatten(out_shardings)
    out_key = out_key and (tuple(out_key[0]), out_key[1])
    key = (
        name,
        static,
        treedef,
        tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves),
        out_key,
    )
    executable = _lookup(key)
    if executable is not None:
        return executable, 0.0
    with _LOCK:
        key_lock = _KEY_LOCKS.setdefault(key, threading.Lock())
    try:
        with key_lock:
            executable = _lookup(key)  # compiled by the thread this one waited for
            if executable is not None:
                return executable, 0.0
            start = time.perf_counter()
            executable = _compile(
                functools.partial(_counting_traces(name, fn), static),
                args,
                donate_argnums,
                in_shardings,
                out_shardings,
            )
            with _LOCK:
                _EXECUTABLES[key] = executable
                _evict()
            return executable, time.perf_counter() - start
    finally:
        with _LOCK:
            if _KEY_LOCKS.get(key) is key_lock:
                del _KEY_LOCKS[key]


def _counting_traces(name: str, fn: Callable) -> Callable:
    """fn, counting each trace of it in TRACE_COUNTS[name] (jax runs the Python function only
    when it traces: for the shapes of out_shardings, and to lower); under fn's name, which names
    the compiled program (jit_spec_loop) and its file in the persistent cache."""

    @functools.wraps(fn)
    def traced(*args):
        TRACE_COUNTS[name] += 1
        return fn(*args)

    return traced


# The one line a compilation that takes over SLOW_SECONDS prints (once per process).
SLOW_SECONDS = 2.0
COMPILE_NOTICE = (
    "compiling the decoding programs for this batch and prompt-length bucket (about a minute on a "
    "2-core CPU the first time; kept in the compilation cache for the next run)"
)
_ANNOUNCED: set = set()


@contextlib.contextmanager
def announced_if_slow(message: str, seconds: float = SLOW_SECONDS):
    """Prints `message` as one line on stderr if the block is still running after `seconds`
    (a timer thread; nothing for a fast block, e.g. a program the persistent cache had), at
    most once per process and message."""

    def announce():
        with _LOCK:
            if message in _ANNOUNCED:
                return
            _ANNOUNCED.add(message)
        print(message, file=sys.stderr, flush=True)

    timer = threading.Timer(seconds, announce)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _lookup(key):
    """The executable for key (now the most recently used), or None."""
    with _LOCK:
        executable = _EXECUTABLES.pop(key, None)
        if executable is not None:
            _EXECUTABLES[key] = executable
        return executable


def _evict() -> None:
    """Drops the least recently used executables beyond MAX_EXECUTABLES, then while the process
    holds more memory mappings than map_budget() (keeping the newest) (_LOCK held)."""
    while len(_EXECUTABLES) > MAX_EXECUTABLES:
        del _EXECUTABLES[next(iter(_EXECUTABLES))]
    budget = map_budget()
    while len(_EXECUTABLES) > 1 and mapping_count() > budget:
        del _EXECUTABLES[next(iter(_EXECUTABLES))]


def mapping_count() -> int:
    """The memory mappings this process holds (the lines of /proc/self/maps); 0 where there is no
    /proc (then map_budget never evicts)."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return maps.read().count(b"\n")
    except OSError:
        return 0


@functools.cache
def map_budget() -> int:
    """Half the kernel's limit on one process's memory mappings (vm.max_map_count, 65530 by
    default on Linux): the cache drops its oldest loops while the process holds more.

    On XLA:CPU each compiled loop holds about 280 mappings, even for a 2-layer model: its kernels
    are JIT-compiled one by one, each into its own code, read-only and data sections. So 256
    kept loops would pass the limit. Past it mmap fails inside XLA's compiler, which then
    segfaults (seen as a crash in backend_compile_and_load in long `make test` workers, whose
    tiny_target group shares this cache across modules). The other half is left for everything
    else (jax's own caches of jitted calls, the weights, the kernel libraries)."""
    try:
        limit = int(pathlib.Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        limit = 65530
    return limit // 2


def set_max_executables(count: int) -> int:
    """Sets how many compiled loops this process keeps (MAX_EXECUTABLES; the least recently
    used beyond it are dropped at once, and recompiled if asked for again); returns the old
    bound. Each kept executable holds its compiled code (not the weights: they are
    arguments); a long-lived process that decodes many shapes bounds its memory with this."""
    global MAX_EXECUTABLES
    if not is_int(count) or count < 1:
        raise ValueError(f"count must be an integer >= 1, got {count!r}")
    with _LOCK:
        old, MAX_EXECUTABLES = MAX_EXECUTABLES, count
        _evict()
    return old


def clear_compiled() -> None:
    """Forgets every compiled loop (tests that patch a rule use it so nothing stale is reused)."""
    with _LOCK:
        _EXECUTABLES.clear()


PERSISTENT_CACHE_FOLDER = "compilation"


def persistent_cache_dir(root: str | os.PathLike | None = None) -> pathlib.Path:
    """The folder for JAX's persistent compilation cache: `root` (default
    `$SPEC_JAX_CACHE/compilation`) / models.kernels.builds.build_digest().

    JAX keys each program by its HLO, compile options, XLA flags, devices and jax/jaxlib
    versions; a program calling this project's CPU kernel holds only the kernel's target name,
    so the folder is named by the builds of the kernel libraries (and the CPU): an executable
    is never paired with another build of a library that registers the same names. A rebuilt
    library starts a new folder; the old one is left for `rm -rf` (docs/design.md).
    """
    base = (
        registry.cache_root() / PERSISTENT_CACHE_FOLDER if root is None else pathlib.Path(root).expanduser()
    )
    return base / builds.build_digest()


def enable_persistent_cache(folder: str | os.PathLike | None) -> None:
    """Points JAX's persistent compilation cache at `folder` for every program this process
    compiles from now on, whatever its compile time or size (JAX's defaults skip programs that
    compile in under a second: most of this project's small ones). None turns the cache off
    (also one that $JAX_COMPILATION_CACHE_DIR names; JAX then stops hashing each program for a
    key). Call it before the first compilation: JAX decides at its first compile whether this
    process uses the cache. Never written: programs with host callbacks (jax.debug.print; JAX's
    rule) and compile-only TPU / GPU programs (models.kernels.compile_targets.compile_for: they
    cannot be read back).
    """
    if folder is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", os.fspath(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # -1: no size limit
