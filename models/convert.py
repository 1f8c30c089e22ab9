"""GGUF -> this project's parameters, converted once and cached with orbax.

Cache layout (root `$SPEC_JAX_CACHE`, default `~/.cache/spec_jax`):
    {root}/gguf/{name}.gguf                   the verified GGUF (models.registry)
    {root}/converted/{name}/config.json       ModelConfig fields read from the GGUF metadata
    {root}/converted/{name}/tokenizer.json    the tokenizer built from the GGUF vocabulary
    {root}/converted/{name}/params/           float32 parameters (orbax StandardCheckpointer)
    {root}/converted/{name}/params-{dtype}/   the same in another precision (models.precision),
                                              derived from params/ on first use (the GGUF
                                              precisions read the GGUF's own blocks instead)
    {root}/converted/{name}/spec_jax_manifest.json   (and params-{dtype}/spec_jax_manifest.json)
                                              every file's size, the small ones' sha256, an id
    {root}/converted/.lock-{name}             held while the entry or a precision is written
    {root}/converted/.tmp-{name}-{pid}-XXXX/  a conversion in flight (.tmp-params-{dtype}-... in
                                              the entry: a derivation)

A conversion, and each derivation of a precision, holds the model's lock (models.registry.
file_lock) and checks again once it holds it: a second process waits, then finds the entry
done. It is written into a temporary folder beside its final place, its manifest last, and
renamed into place when complete, so an interrupted conversion leaves nothing that looks
finished; what a killed one left (its pid is in the name) is removed by the next. A finished
entry is never replaced, except one found damaged or of an older format.

Loading checks the entry against its manifest (sizes, and the hashes of config.json,
tokenizer.json and orbax's metadata), and reads it back; an entry that fails either is damaged:
it is converted (or derived) again once, and models.registry.DamagedCacheError (exit 1 at the
command line, naming the path) if it is still damaged or cannot be rebuilt. An entry written
before manifests is used while its config.json reads back.

The conversion runs in a child process, `python -m models.convert NAME`, so that the
dequantized arrays, the GGUF pages and orbax's buffers go back to the OS before the converted
checkpoint is read, and so that it never re-imports the caller's main module (a script that
calls models.load at its top level works; multiprocessing's spawn would re-run it).
"""

import argparse
import json
import os
import pathlib
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid

import jax
import numpy as np
import orbax.checkpoint as ocp

from models import gguf_loader, registry
from models.config import ModelConfig
from models.tokenizer import Tokenizer

FORMAT_VERSION = 2  # 2: matrices [out, in]
MANIFEST = "spec_jax_manifest.json"  # in each entry and each params-{dtype}/, written last
ENTRY_PARTS = ("config.json", "tokenizer.json", "params")  # what an entry's manifest covers
_HASHED_BYTES = 16 << 20  # files up to this size are hashed in the manifest (all are sized)


def to_device(leaves: list, treedef):
    """Host leaves -> a device pytree, one leaf at a time, replacing each host array in the list
    as it goes: a bulk tree_map keeps every source alive until the copies finish."""
    for i in range(len(leaves)):
        leaves[i] = jax.device_put(np.asarray(leaves[i])).block_until_ready()
    return jax.tree.unflatten(treedef, leaves)


def converted_dir(name: str, cache_dir=None) -> pathlib.Path:
    return registry.cache_root(cache_dir) / "converted" / name


def _lock(name: str, cache_dir=None) -> pathlib.Path:
    """The lock file held while model `name`'s entry or one of its precisions is written."""
    return converted_dir(name, cache_dir).parent / f".lock-{name}"


def _describe(folder: pathlib.Path, entry_id: str, parts=None) -> dict:
    """The manifest of an entry: its id, the format version and every file under `parts` (all
    of folder when None) with its size, and the sha256 of the small ones (config, tokenizer,
    orbax's metadata: reading them back from a damaged file is what must not happen)."""
    files = {}
    roots = [folder / p for p in parts] if parts else [folder]
    for root in roots:
        for path in sorted([root] if root.is_file() else root.rglob("*")):
            if path.is_file() and path.name != MANIFEST:
                size = path.stat().st_size
                entry = {"size": size}
                if size <= _HASHED_BYTES:
                    entry["sha256"] = registry.sha256_file(path)
                files[str(path.relative_to(folder))] = entry
    return {"id": entry_id, "format_version": FORMAT_VERSION, "files": files}


def _state(folder: pathlib.Path, legacy=lambda folder: ("legacy", None)) -> tuple[str | None, str | None]:
    """(entry id, None) when folder holds a complete entry whose files match its manifest;
    (None, None) when it holds none (absent, or an older format: converted afresh); (None, what
    is wrong) when it is damaged. A folder written before manifests: legacy(folder) says which
    (by default complete, id "legacy": it was renamed into place whole; reading it back checks it)."""
    if not folder.exists():
        return None, None
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        return legacy(folder)
    except (OSError, ValueError) as e:
        return None, f"its manifest {MANIFEST} cannot be read ({e})"
    if not isinstance(manifest, dict) or not {"id", "files"} <= set(manifest):
        return None, f"its manifest {MANIFEST} is not one this project wrote"
    if manifest.get("format_version") != FORMAT_VERSION:
        return None, None
    for rel, want in manifest["files"].items():
        path = folder / rel
        try:
            size = path.stat().st_size
        except OSError:
            return None, f"{rel} is missing"
        if size != want["size"]:
            return None, f"{rel} has {size} bytes, {want['size']} were written"
        if "sha256" in want and registry.sha256_file(path) != want["sha256"]:
            return None, f"{rel} is not the file that was written (sha256 differs)"
    return manifest["id"], None


def _legacy_entry(folder: pathlib.Path) -> tuple[str | None, str | None]:
    """_state of an entry written before manifests: complete when its config.json reads back
    and is of this format (older formats are converted afresh)."""
    try:
        meta = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        return None, f"config.json cannot be read ({e})"
    return ("legacy", None) if meta.get("format_version") == FORMAT_VERSION else (None, None)


def _replace(tmp: pathlib.Path, final: pathlib.Path, label: str) -> None:
    """Renames the finished tmp to final, moving an entry found damaged or outdated there aside
    first (called holding the entry's lock, so no one is writing final; a reader of it had
    found it unusable)."""
    if final.exists():
        aside = pathlib.Path(tempfile.mkdtemp(prefix=registry.tmp_prefix(label), dir=final.parent))
        os.replace(final, aside / "old")
        shutil.rmtree(aside, ignore_errors=True)
    os.replace(tmp, final)


def convert(name: str, cache_dir=None, progress: bool = True, replace: str | None = None) -> pathlib.Path:
    """Fetches and converts registry model `name` unless already done; returns its folder.
    Holds the model's file lock throughout (a second process waits, then finds it done).
    An entry that is damaged, of an older format, or whose id is `replace` (found damaged by a
    reader) is converted afresh; the leftovers of killed conversions are removed first."""
    final = converted_dir(name, cache_dir)
    entry, problem = _state(final, _legacy_entry)
    if entry is not None and entry != replace:
        return final
    registry.ensure_writable(final.parent)
    with registry.file_lock(_lock(name, cache_dir)):
        entry, problem = _state(final, _legacy_entry)  # again, now that no one else writes it
        if entry is not None and entry != replace:
            return final
        registry.remove_dead_tmp(final.parent, name)
        gguf = registry.fetch_gguf(name, cache_dir, progress=progress)  # verified (its own lock)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=registry.tmp_prefix(name), dir=final.parent))
        try:
            reader = gguf_loader.open_gguf(gguf)  # parsed once: it takes seconds for a 150k vocabulary
            config = ModelConfig(**gguf_loader.read_config(reader, name=name))
            params = gguf_loader.load_params(reader, config, progress=progress)
            # orbax copies numpy leaves before writing them (peak 3x the model: 18.3 GB for the
            # 1.5B); device arrays it writes as they are, and on a CPU each leaf moves over in
            # place of its numpy source, so the peak stays near one copy (measured: 0.5B 7.3 -> 3.6 GB).
            leaves, treedef = jax.tree.flatten(params)
            del params
            params = to_device(leaves, treedef)
            del leaves
            checkpointer = ocp.StandardCheckpointer()
            checkpointer.save(tmp / "params", params)
            checkpointer.wait_until_finished()
            Tokenizer.from_gguf(reader).save(tmp / "tokenizer.json")
            del params, reader
            meta = {"format_version": FORMAT_VERSION, "config": config.portable()}
            (tmp / "config.json").write_text(json.dumps(meta, indent=2))
            manifest = _describe(tmp, uuid.uuid4().hex, ENTRY_PARTS)
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))  # last: the entry is complete
            _replace(tmp, final, name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


class ConversionError(RuntimeError):
    """The conversion process failed without a more specific error (e.g. it was killed)."""


# Errors the child reports by name; the parent raises the same class with the same message.
_ERRORS = {
    cls.__name__: cls
    for cls in (
        registry.DownloadError,
        registry.ChecksumMismatchError,
        registry.CacheNotWritableError,
        ValueError,
        OSError,
        ConversionError,
    )
}


def convert_in_child(
    name: str, cache_dir=None, progress: bool = True, replace: str | None = None
) -> pathlib.Path:
    """Runs `python -m models.convert NAME` (convert(), with `replace`) and returns the converted
    folder; its errors are re-raised here as the same class. A child killed by a signal (the kernel's out-of-memory
    killer sends SIGKILL) is a ConversionError that says so and how much memory it had used."""
    root = pathlib.Path(__file__).resolve().parent.parent  # the folder that holds `models`
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
    }
    cmd = [sys.executable, "-m", "models.convert", name] + (
        ["--cache_dir", str(cache_dir)] if cache_dir else []
    )
    cmd += [] if progress else ["--no-progress"]
    cmd += ["--replace", replace] if replace else []
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env)  # stderr: the progress bars
    peak_gb = max(before, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 2**20
    lines = proc.stdout.strip().splitlines()
    report = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
    if proc.returncode == 0 and "folder" in report:
        if progress:
            print(f"converted {name}: peak memory {report['peak_rss_gb']:.1f} GB", file=sys.stderr)
        return pathlib.Path(report["folder"])
    if "error" in report:
        raise _ERRORS.get(report["error"], ConversionError)(report["message"])
    if proc.returncode < 0:
        sig = signal.Signals(-proc.returncode).name
        hint = ", most likely by the out-of-memory killer" if sig == "SIGKILL" else ""
        raise ConversionError(
            f"converting {name} was stopped by {sig}{hint} (the process had used up to {peak_gb:.1f} GB); "
            "free memory and run it again"
        )
    raise ConversionError(f"converting {name} failed (exit code {proc.returncode}); see the messages above")


def _int8_nodes(tree):
    """orbax restores a models.precision.Int8Weight as {"value", "scale"}: rebuild the node."""
    from models.precision import Int8Weight

    if isinstance(tree, dict):
        if set(tree) == {"value", "scale"}:
            return Int8Weight(value=tree["value"], scale=tree["scale"])
        return {k: _int8_nodes(v) for k, v in tree.items()}
    return tree


class _Damaged(Exception):
    """A cache entry found damaged while loading, and how to rebuild it (once)."""

    def __init__(self, path: pathlib.Path, what: str, rebuild):
        super().__init__(f"{path}: {what}")
        self.path, self.what, self.rebuild = path, what, rebuild


# What a failed rebuild raises (in the conversion child or here): reported as the damaged entry.
_REBUILD_ERRORS = (
    registry.DownloadError,
    registry.ChecksumMismatchError,
    registry.CacheNotWritableError,
    ConversionError,
    OSError,
)


def load_converted(name: str, cache_dir=None, progress: bool = True, dtype: str = "float32"):
    """Returns (ModelConfig, params as numpy arrays in precision `dtype`, Tokenizer), converting
    on first use (in a child process: convert_in_child) and deriving a precision's checkpoint
    from the float32 one on its first use (models.weights.cast_params, cached beside it).

    A damaged entry (a file that does not match the manifest written with it, or one that
    cannot be read back) is rebuilt once; DamagedCacheError (naming the path) if it is still
    damaged or cannot be rebuilt."""
    try:
        return _load_converted(name, cache_dir, progress, dtype)
    except _Damaged as e:
        try:
            e.rebuild()
        except _REBUILD_ERRORS as err:
            raise registry.DamagedCacheError(e.path, f"{e.what}; rebuilding it failed: {err}") from err
        except _Damaged as err:  # what the rebuild reads from is damaged too
            raise registry.DamagedCacheError(err.path, err.what) from None
    try:
        return _load_converted(name, cache_dir, progress, dtype)
    except _Damaged as e:
        raise registry.DamagedCacheError(e.path, f"{e.what} (again, after rebuilding it)") from None


def _load_converted(name: str, cache_dir, progress: bool, dtype: str):
    from models import precision

    folder = converted_dir(name, cache_dir)
    entry, problem = _state(folder, _legacy_entry)
    if problem is None and entry is None:  # no entry (or an older format): convert
        folder = convert_in_child(name, cache_dir, progress)
        entry, problem = _state(folder, _legacy_entry)

    def reconvert(replace=None):
        return lambda: convert_in_child(name, cache_dir, progress, replace=replace)

    if problem is not None:
        raise _Damaged(folder, problem, reconvert())
    try:
        meta = json.loads((folder / "config.json").read_text())
        config = ModelConfig(**meta["config"]).replace(dtype=dtype)
        tokenizer = Tokenizer.load(folder / "tokenizer.json")
    except Exception as e:  # whatever the parsers raise for a damaged file
        raise _Damaged(
            folder, f"its config or tokenizer cannot be read ({type(e).__name__}: {e})", reconvert(entry)
        ) from None
    if dtype in precision.GGUF_PRECISIONS:  # read from the verified GGUF itself: nothing to derive
        gguf = registry.fetch_gguf(name, cache_dir, progress=progress)
        return config, gguf_loader.load_block_params(gguf, config, progress=progress), tokenizer
    if dtype == "float32":
        params = _restore(folder / "params", reconvert(entry))
        return config, params, tokenizer
    derived = folder / f"params-{dtype}"
    derived_id, problem = _state(derived)
    if problem is None and derived_id is None:
        _derive(folder, config, dtype, name, cache_dir, reconvert(entry))
        derived_id, problem = _state(derived)

    def rederive(replace=None):
        return lambda: _derive(folder, config, dtype, name, cache_dir, reconvert(entry), replace=replace)

    if problem is not None:
        raise _Damaged(derived, problem, rederive())
    return config, _int8_nodes(_restore(derived, rederive(derived_id))), tokenizer


def _restore(path: pathlib.Path, rebuild):
    """The checkpoint at path as numpy arrays; _Damaged (with rebuild) if orbax cannot read it."""
    try:
        return ocp.StandardCheckpointer().restore(path)
    except MemoryError:
        raise
    except Exception as e:  # orbax and tensorstore raise many kinds
        raise _Damaged(path, f"the checkpoint cannot be read ({type(e).__name__}: {e})", rebuild) from None


def _derive(
    folder: pathlib.Path, config: ModelConfig, dtype: str, name: str, cache_dir, reconvert, replace=None
):
    """Writes folder/params-{dtype} from folder/params (models.weights.cast_params), holding the
    model's lock; nothing to do if another process wrote it meanwhile (unless it is the entry
    `replace`, found damaged). _Damaged with `reconvert` if folder/params cannot be read."""
    from models import weights

    derived = folder / f"params-{dtype}"
    with registry.file_lock(_lock(name, cache_dir)):
        entry, _ = _state(derived)
        if entry is not None and entry != replace:
            return
        label = f"params-{dtype}"
        registry.remove_dead_tmp(folder, label)
        source = _restore(folder / "params", reconvert)
        params = weights.cast_params(source, config)
        del source
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=registry.tmp_prefix(label), dir=folder))
        try:
            checkpointer = ocp.StandardCheckpointer()
            checkpointer.save(tmp / "params", params)
            checkpointer.wait_until_finished()
            manifest = _describe(tmp / "params", uuid.uuid4().hex)
            (tmp / "params" / MANIFEST).write_text(json.dumps(manifest, indent=1))  # last
            _replace(tmp / "params", derived, label)  # complete or absent, never half-written
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None) -> int:
    """The child process: converts one model, then prints one JSON line on stdout, {"folder": ...,
    "peak_rss_gb": ...} or {"error": class name, "message": ...} (exit code 1)."""
    parser = argparse.ArgumentParser(prog="python -m models.convert", description=__doc__.splitlines()[0])
    parser.add_argument("name", help="a registry model (models.registry.MODELS)")
    parser.add_argument(
        "--cache_dir", default=None, help="cache root (default $SPEC_JAX_CACHE or ~/.cache/spec_jax)"
    )
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    parser.add_argument("--replace", default=None, help="the id of an entry found damaged: convert afresh")
    args = parser.parse_args(argv)
    try:
        folder = convert(args.name, args.cache_dir, progress=args.progress, replace=args.replace)
    except Exception as e:  # reported to the parent, which raises the same class
        kind = next((n for n, cls in _ERRORS.items() if type(e) is cls), None)
        kind = kind or next((n for n, cls in _ERRORS.items() if isinstance(e, cls)), "ConversionError")
        print(json.dumps({"error": kind, "message": str(e) or type(e).__name__}), flush=True)
        return 1
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(json.dumps({"folder": str(folder), "peak_rss_gb": round(peak_gb, 2)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
