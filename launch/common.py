"""Shared plumbing for the absl entry points: one-line errors with exit code 2, --help with exit
code 0, SIGINT / SIGTERM as one line with exit code 130 / 143, and the --compilation_cache flag
(JAX's persistent compilation cache, on unless --nocompilation_cache or
$SPEC_JAX_COMPILATION_CACHE=0; launch.runtime.enable_compilation_cache). This module imports
neither jax nor the models: what needs them (the cache, atomic writes, the model-flag check) is
launch.runtime's, imported by run once the flags are parsed. What both share (UsageError, the
interruption, the files written, the --output_json checks) is launch.usage's, below both, and
named here too, so that launch.runtime never imports this module."""

import atexit
import functools
import gc
import os
import signal
import sys
import threading
import unicodedata
import warnings

from absl import app, flags, logging

# launch.usage's names, used here and named here as before (the entry points and tests use
# common.UsageError, ...): the `X as X` form re-exports them.
from launch.usage import COMPILATION_CACHE_ENV as COMPILATION_CACHE_ENV
from launch.usage import RECEIVED, Interrupted
from launch.usage import WRITTEN as WRITTEN
from launch.usage import UsageError as UsageError
from launch.usage import check_output_json as check_output_json
from launch.usage import finite_json as finite_json
from launch.usage import raise_if_interrupted as raise_if_interrupted

flags.DEFINE_bool(
    "compilation_cache",
    True,
    "Keep compiled programs on disk (JAX's persistent compilation cache, in "
    "$SPEC_JAX_CACHE/compilation/<kernel builds' digest>/), so a second run loads them instead of "
    f"compiling. --nocompilation_cache, or ${COMPILATION_CACHE_ENV}=0, turns it off; "
    f"${COMPILATION_CACHE_ENV}=PATH puts it in PATH/<digest>/ instead.",
)


def _swallowed_at(frame) -> bool:
    """Whether an exception raised at `frame` would be printed as "Exception ignored in ..." and
    dropped: inside a garbage collector callback (jax registers one, run whenever Python collects)
    or a finalizer."""
    callbacks = {getattr(cb, "__code__", None) for cb in gc.callbacks}
    while frame is not None:
        if frame.f_code in callbacks or frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def _interrupt(signum, frame):
    """The SIGINT / SIGTERM handler: raises Interrupted where the program is; where that
    exception would be swallowed (_swallowed_at), the signal is sent again 50 ms later instead, so
    the run still ends (seen once in CI: a SIGINT landing in jax's gc callback let the run finish
    with exit code 0)."""
    RECEIVED.append(signum)
    if _swallowed_at(frame):
        again = threading.Timer(0.05, os.kill, (os.getpid(), signum))
        again.daemon = True
        again.start()
        return
    raise Interrupted(signum)


HELP_FLAGS = ("help", "helpshort", "helpfull", "helpxml", "?", "h")


def fail(message: str, code: int = 2):
    """One line on stderr (`PROG: error: MESSAGE`) and exit `code` (2: bad input)."""
    prog = os.path.basename(sys.argv[0]) if sys.argv else "spec-jax"
    print(f"{prog}: error: {message}", file=sys.stderr)
    sys.exit(code)


CONFIG_PREFIX = "--config."


def config_overrides_as_set(argv: list[str]) -> list[str]:
    """argv with each `--config.KEY=VALUE` (ml_collections' override syntax, which launch.train's
    config flag takes) handed to the repeatable `--set` flag as KEY=VALUE, so that the entry
    points whose configs are chosen by another flag (launch.experiment's --experiment,
    launch.bench's --suite) take the same syntax and one parser reads both. ValueError for
    `--config.KEY` without `=VALUE`."""
    out = []
    for arg in argv:
        if arg.startswith((CONFIG_PREFIX, "-config.")):
            key, sep, value = arg.lstrip("-")[len("config.") :].partition("=")
            if not sep or not key:
                raise ValueError(f"--config.{key}: expected --config.KEY=VALUE, got {arg!r}")
            out.append(f"--set={key}={value}")
        else:
            out.append(arg)
    return out


def parse_flags(argv, config_overrides: bool = False):
    """absl flag parsing that reports a bad flag in one line and exits 2 (no usage dump, no
    traceback); with config_overrides, `--config.KEY=VALUE` is read as `--set=KEY=VALUE`."""
    try:
        if config_overrides:
            argv = [argv[0], *config_overrides_as_set(argv[1:])]
        return flags.FLAGS(argv)
    except (flags.Error, ValueError) as e:
        fail(str(e).splitlines()[0])
    except SystemExit as e:  # absl's --help flags print the usage, then exit 1: asked for, so 0
        if e.code == 1 and any(arg.lstrip("-").split("=")[0] in HELP_FLAGS for arg in argv[1:]):
            sys.exit(0)
        raise


def _report_interrupt(e: Interrupted) -> None:
    """One line on stderr naming what was written, then exit 128 + the signal's number."""
    prog = os.path.basename(sys.argv[0]) if sys.argv else "spec-jax"
    done = f"wrote {', '.join(WRITTEN)}" if WRITTEN else "nothing written"
    print(f"\n{prog}: interrupted ({e}); {done}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    # Not sys.exit: the interpreter's finalization can meet XLA's threads mid-compile (a signal
    # during compilation) and crash (seen once in the suite: exit -11 after this line). The exit
    # functions still run (private temporary folders removed); what this process wrote is complete
    # or removed by now (the exception unwound through its writers).
    atexit._run_exitfuncs()
    os._exit(128 + e.signum)


def _warning_line(message, category, filename, lineno, file=None, line=None):
    """warnings.showwarning for the command line: `warning: MESSAGE`, one line on stderr."""
    print(
        f"warning: {str(message).splitlines()[0] if str(message) else category.__name__}",
        file=file or sys.stderr,
    )


def run(main, compilation_cache: bool = True, config_overrides: bool = False):
    """app.run(main) where a ValueError from main is bad input (one line on stderr, exit code
    2) and data that cannot be fetched or cached is one line on stderr with exit code 1; SIGINT
    and SIGTERM are one line naming what was written (exit 130 / 143, no traceback). With
    compilation_cache (entry points that load models and compile; not launch.tpu), the
    persistent compilation cache is enabled before main (launch.runtime.enable_compilation_cache)
    and data that cannot be had (launch.runtime.UNAVAILABLE_ERRORS) is one line with exit code 1;
    config_overrides: see parse_flags."""

    def guarded(argv):
        if not flags.FLAGS["verbosity"].present:
            logging.set_verbosity(logging.WARNING)  # absl's INFO lines (backend probing) are noise here
        unavailable = ()  # without models (launch.tpu) none of their errors can arise
        try:
            if compilation_cache:
                # Late, once the flags are parsed (measured start-up cost): launch.runtime imports
                # jax and the models, 2.0 s wall (1.3 s CPU) on the 2-core EPYC against 0.1 s for
                # this module, so --help and bad flags of launch.experiment and launch.bench answer
                # in 0.15 s, and launch.tpu never loads them.
                from launch import runtime

                unavailable = runtime.UNAVAILABLE_ERRORS
                runtime.enable_compilation_cache()
            result = main(argv)
            raise_if_interrupted()
            return result
        except Exception as e:
            # An error after a signal is the interruption's: Interrupted raised inside jax's
            # lowering can leave it to fail on its own half-built state instead (seen in the
            # suite: SIGTERM during compile, then "'int' object has no attribute '_get_vars'").
            raise_if_interrupted()
            if isinstance(e, ValueError):  # includes UsageError
                fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
            if not isinstance(e, unavailable):
                raise
            fail(str(e).splitlines()[0] if str(e) else type(e).__name__, code=1)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _interrupt)
    warnings.showwarning = _warning_line
    try:
        app.run(guarded, flags_parser=functools.partial(parse_flags, config_overrides=config_overrides))
    except Interrupted as e:
        _report_interrupt(e)


def note_default_prompt(missing: bool, prompt: str) -> None:
    """Where no prompt was given (`missing`), one line on stderr naming the one used instead;
    called once every flag and model is checked (before decoding), so a refusal stays one line."""
    if missing:
        print(f"no --prompt given; using the prompt {prompt!r}", file=sys.stderr, flush=True)


def terminal_text(text: str, stream=None) -> str:
    """text as printed to `stream` (default sys.stdout): on a terminal, each control character
    other than newline and tab escaped (`\\x1b`, `\\r`, ...) so generated text cannot move the
    cursor, clear the screen or retitle the window; unchanged into a file or pipe."""
    stream = sys.stdout if stream is None else stream
    if not stream.isatty():
        return text
    return "".join(
        ch.encode("unicode_escape").decode() if unicodedata.category(ch) == "Cc" and ch not in "\n\t" else ch
        for ch in text
    )
