"""Compiled loops, cached by shape: a new prompt in the same length bucket reuses the executable.

`compiled(name, fn, static, args, ...)` lowers and compiles `fn(static, *args)` once per
(name, static settings, argument shapes/dtypes/shardings) and returns the executable with the
seconds its compilation took (0 when it came from the cache). TRACE_COUNTS counts how often
each loop body was traced (a retrace means a recompile); tests read it.
"""

import collections
import functools
import time
from collections.abc import Callable, Hashable
from typing import Any

import jax

TRACE_COUNTS: collections.Counter = collections.Counter()
_EXECUTABLES: dict = {}


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
    if key in _EXECUTABLES:
        return _EXECUTABLES[key], 0.0
    start = time.perf_counter()
    fn_static = functools.partial(fn, static)
    if callable(out_shardings):
        out_shardings = out_shardings(jax.eval_shape(fn_static, *args))
    shardings = {}
    if in_shardings is not None:
        shardings["in_shardings"] = tuple(in_shardings)
    if out_shardings is not None:
        shardings["out_shardings"] = out_shardings
    jitted = jax.jit(fn_static, donate_argnums=donate_argnums, **shardings)
    executable = jitted.lower(*args).compile()
    _EXECUTABLES[key] = executable
    return executable, time.perf_counter() - start


def clear_compiled() -> None:
    """Forgets every compiled loop (tests that patch a rule use it so nothing stale is reused)."""
    _EXECUTABLES.clear()
