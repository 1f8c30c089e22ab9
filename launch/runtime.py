"""The entry points' plumbing that needs the models and jax, for a run whose flags are parsed:
JAX's persistent compilation cache, the errors that mean data cannot be had, the model-flag
check and atomic JSON output. launch.common.run imports this module once the flags are parsed
(launch.common stays light, so that --help and bad flags answer without jax). It imports
launch.usage, never launch.common, so the imports among launch/ point one way."""

import atexit
import json
import os
import pathlib
import shutil
import sys
import tempfile

from absl import flags

import models
from launch import usage
from models import convert, corpora, gguf_loader, registry
from models.kernels import libraries
from spec_jax import executables

_OFF = ("0", "off", "false", "no")
_ON = ("", "1", "on", "true", "yes")

# Errors meaning data a command needs cannot be had (no registry access, a corrupted download, a
# cache folder that cannot be written, a conversion killed for lack of memory, a truncated or
# corrupt GGUF file): the environment, not the flags. launch.common.run reports them as one line
# with exit code 1.
UNAVAILABLE_ERRORS = (
    gguf_loader.GGUFFileError,
    registry.DownloadError,
    registry.ChecksumMismatchError,
    registry.CacheNotWritableError,
    registry.DamagedCacheError,
    corpora.CorpusUnavailableError,
    convert.ConversionError,
)


def check_model_flag(flag: str, name: str) -> None:
    """UsageError in one line naming `flag` unless models.load takes `name` (models.check_source:
    a model name, a local GGUF file or checkpoint folder, or a hub id's form); nothing is loaded."""
    try:
        models.check_source(name)
    except ValueError as e:
        raise usage.UsageError(f"{flag}: {str(e).splitlines()[0]}") from None


def enable_compilation_cache():
    """Turns on JAX's persistent compilation cache for this process (spec_jax.executables) unless
    --nocompilation_cache or $SPEC_JAX_COMPILATION_CACHE is 0/off/false/no; the env variable may
    also name the folder that holds the per-build folders (default $SPEC_JAX_CACHE/compilation).
    The cache holds native code, so it gets the kernel folder's checks
    (models.kernels.libraries.own_folder): a folder (or its parent) that another user owns,
    that others can write, or that this user cannot write is not used; the run then uses a
    private temporary cache (removed at exit) after one warning line on stderr. Returns the
    folder in use, or None when off."""
    setting = os.environ.get(usage.COMPILATION_CACHE_ENV, "").strip()
    folder = None
    if flags.FLAGS.compilation_cache and setting.lower() not in _OFF:
        folder = executables.persistent_cache_dir(None if setting.lower() in _ON else setting)
        if not (libraries.own_folder(folder.parent) and libraries.own_folder(folder)):
            print(
                f"warning: not using the compilation cache {folder}: it must be a folder of yours that "
                "you can write and no one else can; compiling into a private cache for this run",
                file=sys.stderr,
            )
            folder = pathlib.Path(tempfile.mkdtemp(prefix="spec_jax-compilation-"))
            atexit.register(shutil.rmtree, folder, ignore_errors=True)
    executables.enable_persistent_cache(folder)
    return folder


def write_json_atomic(path: str, payload) -> None:
    """Writes JSON to path all at once (models.registry.atomic_write: no half-written file, the
    user's usual permissions): strict JSON, non-finite numbers as null; the path is named by the
    interrupt line (launch.usage.WRITTEN)."""
    usage.check_output_json(path)
    usage.raise_if_interrupted()
    text = json.dumps(usage.finite_json(payload), indent=2, allow_nan=False) + "\n"
    registry.atomic_write(path, lambda f: f.write(text.encode()))
    usage.WRITTEN.append(path)
