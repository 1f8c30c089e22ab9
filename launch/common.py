"""Shared plumbing for the absl entry points: one-line errors with exit code 2, atomic writes,
and JAX's persistent compilation cache (on unless --nocompilation_cache or
$SPEC_JAX_COMPILATION_CACHE=0)."""

import functools
import json
import math
import os
import sys

from absl import app, flags, logging

COMPILATION_CACHE_ENV = "SPEC_JAX_COMPILATION_CACHE"
_OFF = ("0", "off", "false", "no")
_ON = ("", "1", "on", "true", "yes")

flags.DEFINE_bool(
    "compilation_cache",
    True,
    "Keep compiled programs on disk (JAX's persistent compilation cache, in "
    "$SPEC_JAX_CACHE/compilation/<kernel builds' digest>/), so a second run loads them instead of "
    f"compiling. --nocompilation_cache, or ${COMPILATION_CACHE_ENV}=0, turns it off; "
    f"${COMPILATION_CACHE_ENV}=PATH puts it in PATH/<digest>/ instead.",
)


class UsageError(ValueError):
    """Bad input from the command line; reported as one line with exit code 2."""


def fail(message: str, code: int = 2):
    """One line on stderr (`PROG: error: MESSAGE`) and exit `code` (2: bad input)."""
    prog = os.path.basename(sys.argv[0]) if sys.argv else "spec-jax"
    print(f"{prog}: error: {message}", file=sys.stderr)
    sys.exit(code)


def _unavailable_errors() -> tuple:
    """Errors meaning data a command needs cannot be had (no registry access, a corrupted
    download, a cache folder that cannot be written, a conversion killed for lack of memory):
    the environment, not the flags."""
    from models.convert import ConversionError
    from models.corpora import CorpusUnavailableError
    from models.registry import CacheNotWritableError, ChecksumMismatchError, DamagedCacheError, DownloadError

    return (
        DownloadError,
        ChecksumMismatchError,
        CacheNotWritableError,
        DamagedCacheError,
        CorpusUnavailableError,
        ConversionError,
    )


def check_model_flag(flag: str, name: str) -> None:
    """UsageError in one line naming `flag` unless models.load takes `name` (models.check_source:
    a model name, a local GGUF file or checkpoint folder, or a hub id's form); nothing is loaded."""
    import models

    try:
        models.check_source(name)
    except ValueError as e:
        raise UsageError(f"{flag}: {str(e).splitlines()[0]}") from None


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


def enable_compilation_cache():
    """Turns on JAX's persistent compilation cache for this process (spec_jax.executables) unless
    --nocompilation_cache or $SPEC_JAX_COMPILATION_CACHE is 0/off/false/no; the env variable may
    also name the folder that holds the per-build folders (default $SPEC_JAX_CACHE/compilation).
    Returns the cache folder, or None when off (also when the folder cannot be created: the run
    goes on compiling everything, as without the cache)."""
    from spec_jax import executables

    setting = os.environ.get(COMPILATION_CACHE_ENV, "").strip()
    folder = None
    if flags.FLAGS.compilation_cache and setting.lower() not in _OFF:
        folder = executables.persistent_cache_dir(None if setting.lower() in _ON else setting)
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            folder = None
    executables.enable_persistent_cache(folder)
    return folder


def run(main, compilation_cache: bool = True, config_overrides: bool = False):
    """app.run(main) where a ValueError from main is bad input (one line on stderr, exit code
    2) and data that cannot be fetched or cached is one line on stderr with exit code 1. With
    compilation_cache (entry points that compile), the persistent compilation cache is enabled
    before main (enable_compilation_cache); config_overrides: see parse_flags."""

    def guarded(argv):
        if not flags.FLAGS["verbosity"].present:
            logging.set_verbosity(logging.WARNING)  # absl's INFO lines (backend probing) are noise here
        try:
            if compilation_cache:
                enable_compilation_cache()
            return main(argv)
        except ValueError as e:  # includes UsageError
            fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
        except Exception as e:
            if not isinstance(e, _unavailable_errors()):
                raise
            fail(str(e).splitlines()[0] if str(e) else type(e).__name__, code=1)

    app.run(guarded, flags_parser=functools.partial(parse_flags, config_overrides=config_overrides))


def finite_json(value):
    """value with every non-finite float (NaN, inf) replaced by None, recursively: strict JSON
    parsers reject the bare NaN that json.dump writes (e.g. acceptance_rate with --draft=none)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


def check_output_json(path: str) -> None:
    """UsageError unless --output_json names a file in an existing folder (checked before any
    model is loaded, and again when writing)."""
    path = os.path.abspath(path)
    if os.path.isdir(path):
        raise UsageError(f"--output_json: {path} is a folder; name a file")
    if not os.path.isdir(os.path.dirname(path)):
        raise UsageError(f"--output_json: directory {os.path.dirname(path)} does not exist")


def write_json_atomic(path: str, payload) -> None:
    """Writes JSON to path all at once (models.registry.atomic_write: no half-written file, the
    user's usual permissions): strict JSON, non-finite numbers as null."""
    from models.registry import atomic_write

    check_output_json(path)
    text = json.dumps(finite_json(payload), indent=2, allow_nan=False) + "\n"
    atomic_write(path, lambda f: f.write(text.encode()))
