"""GGUF -> this project's parameters, converted once and cached with orbax.

Cache layout (root `$SPEC_JAX_CACHE`, default `~/.cache/spec_jax`):
    {root}/gguf/{name}.gguf                   the verified GGUF (models.registry)
    {root}/converted/{name}/config.json       ModelConfig fields read from the GGUF metadata
    {root}/converted/{name}/tokenizer.json    the tokenizer built from the GGUF vocabulary
    {root}/converted/{name}/params/           float32 parameters (orbax StandardCheckpointer)
    {root}/converted/{name}/params-{dtype}/   the same in another precision (models.precision),
                                              derived from params/ on first use (the GGUF
                                              precisions read the GGUF's own blocks instead)
A conversion is written into a temporary folder beside its final place and renamed into
place when complete, so an interrupted conversion leaves nothing that looks finished.

The conversion runs in a child process, `python -m models.convert NAME`, so that the
dequantized arrays, the GGUF pages and orbax's buffers go back to the OS before the converted
checkpoint is read, and so that it never re-imports the caller's main module (a script that
calls models.load at its top level works; multiprocessing's spawn would re-run it).
"""

import argparse
import dataclasses
import json
import os
import pathlib
import resource
import shutil
import signal
import subprocess
import sys
import tempfile

import jax
import orbax.checkpoint as ocp

import models
from models import gguf_loader, registry
from models.config import ModelConfig
from models.tokenizer import Tokenizer

FORMAT_VERSION = 2  # 2: matrices [out, in]


def converted_dir(name: str, cache_dir=None) -> pathlib.Path:
    return registry.cache_root(cache_dir) / "converted" / name


def convert(name: str, cache_dir=None, progress: bool = True) -> pathlib.Path:
    """Fetches and converts registry model `name` unless already done; returns its folder."""
    final = converted_dir(name, cache_dir)
    if (final / "config.json").exists():
        return final
    gguf = registry.fetch_gguf(name, cache_dir, progress=progress)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=final.parent))
    try:
        reader = gguf_loader.open_gguf(gguf)  # parsed once: it takes seconds for a 150k vocabulary
        config = ModelConfig(**gguf_loader.read_config(reader, name=name))
        params = gguf_loader.load_params(reader, config, progress=progress)
        # orbax copies numpy leaves before writing them (peak 3x the model: 18.3 GB for the
        # 1.5B); device arrays it writes as they are, and on a CPU each leaf moves over in
        # place of its numpy source, so the peak stays near one copy (measured: 0.5B 7.3 -> 3.6 GB).
        leaves, treedef = jax.tree.flatten(params)
        del params
        params = models.to_device(leaves, treedef)
        del leaves
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(tmp / "params", params)
        checkpointer.wait_until_finished()
        Tokenizer.from_gguf(reader).save(tmp / "tokenizer.json")
        del params, reader
        meta = {"format_version": FORMAT_VERSION, "config": dataclasses.asdict(config)}
        (tmp / "config.json").write_text(json.dumps(meta, indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _is_current(folder: pathlib.Path) -> bool:
    config_json = folder / "config.json"
    return (
        config_json.exists() and json.loads(config_json.read_text()).get("format_version") == FORMAT_VERSION
    )


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


def convert_in_child(name: str, cache_dir=None, progress: bool = True) -> pathlib.Path:
    """Runs `python -m models.convert NAME` and returns the converted folder; its errors are
    re-raised here as the same class. A child killed by a signal (the kernel's out-of-memory
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


def load_converted(name: str, cache_dir=None, progress: bool = True, dtype: str = "float32"):
    """Returns (ModelConfig, params as numpy arrays in precision `dtype`, Tokenizer), converting
    on first use (in a child process: convert_in_child) and deriving a precision's checkpoint
    from the float32 one on its first use (models.precision.cast_params, cached beside it)."""
    from models import precision

    folder = converted_dir(name, cache_dir)
    if not _is_current(folder):
        if folder.exists():  # an older format: convert afresh
            shutil.rmtree(folder)
        folder = convert_in_child(name, cache_dir, progress)
    meta = json.loads((folder / "config.json").read_text())
    config = ModelConfig(**meta["config"]).replace(dtype=dtype)
    tokenizer = Tokenizer.load(folder / "tokenizer.json")
    if dtype in precision.GGUF_PRECISIONS:  # read from the verified GGUF itself: nothing to derive
        gguf = registry.fetch_gguf(name, cache_dir, progress=progress)
        return config, gguf_loader.load_block_params(gguf, config, progress=progress), tokenizer
    checkpointer = ocp.StandardCheckpointer()
    derived = folder / f"params-{dtype}"
    if dtype == "float32":
        params = checkpointer.restore(folder / "params")
    elif derived.exists():
        params = _int8_nodes(checkpointer.restore(derived))
    else:
        params = precision.cast_params(checkpointer.restore(folder / "params"), config)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".tmp-params-{dtype}-", dir=folder))
        try:
            checkpointer.save(tmp / "params", params)
            checkpointer.wait_until_finished()
            os.replace(tmp / "params", derived)  # complete or absent, never half-written
        except OSError:
            if not derived.exists():  # (it exists if a concurrent load won the race)
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return config, params, tokenizer


def main(argv=None) -> int:
    """The child process: converts one model, then prints one JSON line on stdout, {"folder": ...,
    "peak_rss_gb": ...} or {"error": class name, "message": ...} (exit code 1)."""
    parser = argparse.ArgumentParser(prog="python -m models.convert", description=__doc__.splitlines()[0])
    parser.add_argument("name", help="a registry model (models.registry.MODELS)")
    parser.add_argument(
        "--cache_dir", default=None, help="cache root (default $SPEC_JAX_CACHE or ~/.cache/spec_jax)"
    )
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    args = parser.parse_args(argv)
    try:
        folder = convert(args.name, args.cache_dir, progress=args.progress)
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
