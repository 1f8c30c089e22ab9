"""A model's source -> this project's parameters, converted once and cached, one tensor at a time.

The source (models.sources) is a registry model (its verified GGUF), a local GGUF file (both
read by models.gguf_loader.stream_params) or a local Hugging Face checkpoint folder (read by
models.hf_checkpoint.stream_params, the same stream); `name` below is the registry name, or the
entry a file or folder gets from its resolved path (models.sources.Source.entry). A file or
folder's entry records its fingerprint (its files' sizes and modification times) in config.json
and the manifest: an edited or re-saved checkpoint no longer matches and is converted afresh.

Cache layout (root `$SPEC_JAX_CACHE`, default `~/.cache/spec_jax`):
    {root}/gguf/{name}.gguf                   the verified GGUF of a registry model (models.registry)
    {root}/converted/{name}/config.json       ModelConfig fields read from the GGUF metadata or
                                              the folder's config.json (models.hf_config)
    {root}/converted/{name}/tokenizer.json    the tokenizer built from the GGUF vocabulary or the
                                              folder's tokenizer files (models.tokenizer)
    {root}/converted/{name}/params/           float32 parameters, where float32 was asked for:
                                              one .npy per leaf (its path joined by ".", e.g.
                                              layers.attn.wq.npy) and tree.json (every leaf's
                                              path, file, dtype, shape)
    {root}/converted/{name}/params-{dtype}/   the same in another precision (models.precision),
                                              cast from the source's stream as it is read (no
                                              float32 copy is written for it); the GGUF
                                              precisions read the GGUF's own blocks instead, and
                                              the entry holds no parameters for them
    {root}/converted/{name}/spec_jax_manifest.json   (and params*/spec_jax_manifest.json)
                                              every file's size, the small ones' sha256, an id
                                              (an entry written before this layout: its
                                              manifest covers params/ too)
    {root}/converted/.lock-{name}             held while the entry or a precision is written
    {root}/converted/.tmp-{name}-{pid}-XXXX/  a conversion in flight (.tmp-params-{dtype}-... in
                                              the entry: a precision added to it)

A conversion, and each precision added to an entry, holds the model's lock (models.registry.
file_lock) and checks again once it holds it: a second process waits, then finds the entry
done. It is written into a temporary folder beside its final place, its manifest last, and
renamed into place when complete, so an interrupted conversion leaves nothing that looks
finished; what a killed one left (its pid is in the name) is removed by the next. A finished
entry is never replaced, except one found damaged or of an older format.

Loading checks the entry against its manifest (sizes, and the hashes of config.json,
tokenizer.json, tree.json and the small leaves), and reads it back (every leaf's .npy header
must match tree.json, and its data must be all there); an entry that fails either is damaged:
it is converted (or derived) again once, and models.registry.DamagedCacheError (exit 1 at the
command line, naming the path) if it is still damaged or cannot be rebuilt. An entry written
before manifests is used while its config.json reads back.

Bounded memory: the conversion streams (models.gguf_loader.stream_params; a folder's
safetensors one tensor at a time): it dequantizes one block of a GGUF tensor's rows (at most
gguf_loader.BLOCK_BYTES of float32), appends it to its leaf's .npy (cast to the precision asked
for, a block of whole rows along the leaf's first axis at a time: weights.cast_leaf casts every
output unit on its own) and drops it, so it holds one block (or one row of a stacked leaf: a
layer's tensor) whatever the model's size. (Why not orbax: its checkpointers write a whole tree,
or a whole leaf, from memory, and a stacked leaf is all layers of a tensor: 1.5 GB for the
1.5B's w_gate, 75 GB for a 70B's.) A precision added to an existing entry is read from the
source again (a registry model's verified GGUF stays in the cache).

The conversion runs in a child process, `python -m models.convert SOURCE` (a registry name or
a resolved path), so that what it
allocated goes back to the OS before the converted checkpoint is read, and so that it never
re-imports the caller's main module (a script that calls models.load at its top level works;
multiprocessing's spawn would re-run it).
"""

import argparse
import json
import math
import os
import pathlib
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
import warnings

import jax
import numpy as np

from models import gguf_loader, hf_checkpoint, hf_config, precision, registry, sources, weights
from models.config import ModelConfig
from models.host_memory import file_backed, huge_page_empty, on_huge_pages
from models.precision import Int8Weight
from models.tokenizer import Tokenizer, from_hf_folder

FORMAT_VERSION = 3  # 2: matrices [out, in]; 3: params/ as one .npy per leaf (was orbax)
PARAMS_TREE = "tree.json"  # in params/ and params-{dtype}/: every leaf's path, file, dtype, shape
MANIFEST = "spec_jax_manifest.json"  # in each entry and each params-{dtype}/, written last
ENTRY_PARTS = ("config.json", "tokenizer.json")  # what an entry's manifest covers (older ones: params too)
_HASHED_BYTES = 16 << 20  # files up to this size are hashed in the manifest (all are sized)


def to_device(leaves: list, treedef):
    """Host leaves -> a device pytree, one leaf at a time, replacing each host array in the list
    as it goes: a bulk tree_map keeps every source alive until the copies finish. On a CPU
    backend, whose client uses a host array in place, leaves of a huge page or more go onto
    transparent huge pages (on_huge_pages: a copy, unless _leaf_blocks already read them there),
    and a memory map of a file is always copied, so that no device array aliases a file."""
    cpu = jax.default_backend() == "cpu"
    for i in range(len(leaves)):
        host = np.asarray(leaves[i])
        if cpu:
            placed = on_huge_pages(host)
            host = np.array(host) if placed is host and file_backed(host) else placed
        leaves[i] = jax.device_put(host).block_until_ready()
    return jax.tree.unflatten(treedef, leaves)


def converted_dir(name: str, cache_dir=None) -> pathlib.Path:
    """The cache entry of source `name` (a registry name, or a local GGUF file's or checkpoint
    folder's path: models.sources.Source.entry)."""
    return registry.cache_root(cache_dir) / "converted" / sources.entry_of(name)


def _lock(name: str, cache_dir=None) -> pathlib.Path:
    """The lock file held while source `name`'s entry or one of its precisions is written."""
    folder = converted_dir(name, cache_dir)
    return folder.parent / f".lock-{folder.name}"


def _describe(folder: pathlib.Path, entry_id: str, parts=None) -> dict:
    """The manifest of an entry: its id, the format version and every file under `parts` (all
    of folder when None) with its size, and the sha256 of the small ones (config, tokenizer,
    tree.json: reading them back from a damaged file is what must not happen)."""
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


def _state(
    folder: pathlib.Path, legacy=lambda folder: ("legacy", None), source=None
) -> tuple[str | None, str | None]:
    """(entry id, None) when folder holds a complete entry whose files match its manifest;
    (None, None) when it holds none (absent, an older format, or converted from a source whose
    fingerprint was not `source`: models.sources.Source.fingerprint; converted afresh); (None,
    what is wrong) when it is damaged. A folder written before manifests: legacy(folder) says
    which (by default complete, id "legacy": it was renamed into place whole; reading it back
    checks it)."""
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
    if manifest.get("format_version") != FORMAT_VERSION or manifest.get("source") != source:
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


def _legacy_of(source: sources.Source):
    """_state's `legacy` for source's entry: an entry without a manifest is a registry model's
    from before manifests (_legacy_entry); any other source's is converted afresh."""
    return _legacy_entry if source.kind == "registry" else lambda folder: (None, None)


def _replace(tmp: pathlib.Path, final: pathlib.Path, label: str) -> None:
    """Renames the finished tmp to final, moving an entry found damaged or outdated there aside
    first (called holding the entry's lock, so no one is writing final; a reader of it had
    found it unusable)."""
    if final.exists():
        aside = pathlib.Path(tempfile.mkdtemp(prefix=registry.tmp_prefix(label), dir=final.parent))
        os.replace(final, aside / "old")
        shutil.rmtree(aside, ignore_errors=True)
    os.replace(tmp, final)


def _read_source(source: sources.Source, cache_dir, progress: bool, tokenizer: bool = True):
    """(ModelConfig, its parameter stream, its Tokenizer or None without `tokenizer`) of a
    source: a GGUF through models.gguf_loader.stream_params, a checkpoint folder through
    models.hf_checkpoint's, the same (keys, shape, blocks) stream (nothing is read before the
    stream is)."""
    if source.kind == "hf":
        cfg = hf_checkpoint.read_config_json(source.path)
        config = ModelConfig(**hf_config.config_from_hf(cfg, name=source.path.name))
        tok = from_hf_folder(source.path) if tokenizer else None
        return config, hf_checkpoint.stream_params(source.path, config, progress=progress), tok
    if source.kind == "registry":
        gguf = registry.fetch_gguf(source.name, cache_dir, progress=progress)  # verified (its own lock)
        name = source.name
    else:
        gguf, name = source.path, source.path.stem
    reader = gguf_loader.read_index(
        gguf
    )  # the header by struct: a GGUFReader takes ~9 s for a 150k vocabulary
    config = ModelConfig(**gguf_loader.read_config(reader, name=name))
    tok = Tokenizer.from_gguf(reader) if tokenizer else None
    return config, gguf_loader.stream_params(reader, config, progress=progress), tok


def params_dir(dtype: str) -> str:
    """The folder of an entry that holds its parameters at precision `dtype` (float32: params)."""
    return "params" if dtype == "float32" else f"params-{dtype}"


def convert(
    name: str,
    cache_dir=None,
    progress: bool = True,
    replace: str | None = None,
    dtype: str | None = "float32",
) -> pathlib.Path:  # convert_in_child repeats this signature on purpose: it runs this in a child
    """Converts source `name` (a registry model, or the path of a local GGUF file or checkpoint
    folder: models.sources) unless already done, with its parameters at precision `dtype`
    (None: the entry alone, config and tokenizer, for a GGUF precision that reads the file's own
    blocks); returns its folder. Holds the entry's file lock throughout (a second process
    waits, then finds it done). An entry that is damaged, of an older format, converted from an
    earlier state of the file or folder (its fingerprint), or whose id is `replace` (found
    damaged by a reader) is converted afresh; so is the precision's folder when it is missing,
    damaged or its id is `replace`. Either is written from the source in one pass (a precision
    other than float32 is cast on the way: no float32 copy is written for it); the leftovers of
    killed conversions are removed first."""
    source = sources.resolve(name, fetch=False)
    fingerprint = source.fingerprint()  # before reading: an edit made meanwhile converts again
    final = converted_dir(name, cache_dir)
    legacy = _legacy_of(source)

    def todo() -> tuple[bool, bool]:  # (the entry, the precision's folder) to write
        entry, _ = _state(final, legacy, fingerprint)
        if entry is None or entry == replace:
            return True, dtype is not None
        params, _ = _state(final / params_dir(dtype)) if dtype else ("none", None)
        return False, params is None or params == replace

    if todo() == (False, False):
        return final
    registry.ensure_writable(final.parent)
    with registry.file_lock(_lock(name, cache_dir)):
        entry, params = todo()  # again, now that no one else writes it
        if entry:
            registry.remove_dead_tmp(final.parent, final.name)
            _write_entry(source, final, fingerprint, dtype, cache_dir, progress)
        elif params:
            label = params_dir(dtype)
            registry.remove_dead_tmp(final, label)
            config, stream, _ = _read_source(source, cache_dir, progress, tokenizer=False)
            tmp = pathlib.Path(tempfile.mkdtemp(prefix=registry.tmp_prefix(label), dir=final))
            try:
                _write_params(stream, tmp / "params", config.replace(dtype=dtype))
                _replace(tmp / "params", final / label, label)  # complete or absent, never half-written
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return final


def _write_entry(
    source: sources.Source, final: pathlib.Path, fingerprint, dtype, cache_dir, progress
) -> None:
    """Writes the entry of `source` (config.json, tokenizer.json, and its parameters at `dtype`
    unless None) into a temporary folder beside `final`, its manifest last, and renames it into
    place (called holding the entry's lock)."""
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=registry.tmp_prefix(final.name), dir=final.parent))
    try:
        config, stream, tokenizer = _read_source(source, cache_dir, progress)
        if dtype is not None:
            _write_params(stream, tmp / params_dir(dtype), config.replace(dtype=dtype))
        del stream  # a GGUF reader's memory map
        tokenizer.save(tmp / "tokenizer.json")
        meta = {"format_version": FORMAT_VERSION, "config": config.portable(), "source": fingerprint}
        (tmp / "config.json").write_text(json.dumps(meta, indent=2))
        manifest = {**_describe(tmp, uuid.uuid4().hex, ENTRY_PARTS), "source": fingerprint}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))  # last: the entry is complete
        _replace(tmp, final, final.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_params(stream, folder: pathlib.Path, config: ModelConfig) -> None:
    """Writes the parameter stream (keys, shape, float32 blocks) into `folder` at config.dtype
    (weights.cast_leaf: float32 as it comes; another precision a block of whole rows along the
    leaf's first axis at a time, as many as gguf_loader.BLOCK_BYTES of float32 hold, at least
    one), then its manifest, last."""
    with _ParamsWriter(folder) as out:  # one block of one tensor (or of whole rows) held at a time
        for keys, shape, blocks in stream:
            if config.dtype == "float32":
                leaf = out.open(keys, shape, np.float32)
                for block in blocks:
                    leaf.write(block)
            else:
                for rows in _whole_rows(shape, blocks):
                    cast = weights.cast_leaf(keys, rows, config)
                    for path, part in jax.tree_util.tree_flatten_with_path(cast)[0]:
                        part_keys = (*keys, *weights.path_keys(path))
                        if part_keys not in out.files:  # an Int8Weight's value and scale: side by side
                            out.open(part_keys, (*shape[:1], *np.shape(part)[1:]), part.dtype)
                        out.files[part_keys].write(part)
            out.close_leaves()
    manifest = _describe(folder, uuid.uuid4().hex)
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))


def _whole_rows(shape: tuple[int, ...], blocks):
    """The leaf of `shape` whose float32 values `blocks` yields (in C order, cut anywhere) as
    arrays of whole rows along its first axis: as many as gguf_loader.BLOCK_BYTES of float32
    hold (at least one), the last one shorter."""
    if not shape:
        yield np.concatenate([np.ravel(b) for b in blocks]).astype(np.float32).reshape(())
        return
    row = math.prod(shape[1:])
    buf = np.empty(max(1, gguf_loader.BLOCK_BYTES // (4 * max(row, 1))) * row, np.float32)
    filled = 0
    for block in blocks:
        values = np.ravel(block)
        while values.size:
            take = min(values.size, buf.size - filled)
            buf[filled : filled + take] = values[:take]
            filled, values = filled + take, values[take:]
            if filled == buf.size:
                yield buf.reshape(-1, *shape[1:])
                filled = 0
    if filled:
        yield buf[:filled].reshape(-1, *shape[1:])


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
    name: str,
    cache_dir=None,
    progress: bool = True,
    replace: str | None = None,
    dtype: str | None = "float32",
) -> pathlib.Path:  # convert's signature, repeated on purpose: the child runs convert with it
    """Runs `python -m models.convert NAME` (convert(), with `replace` and `dtype`) and returns the converted
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
    cmd += ["--dtype", dtype or "none"]
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
    """_restore reads a models.precision.Int8Weight as {"value", "scale"}: rebuild the node."""
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


def load_converted(
    name: str, cache_dir=None, progress: bool = True, dtype: str = "float32", mmap: bool = False
):
    """Returns (ModelConfig, params as numpy arrays in precision `dtype`, Tokenizer), converting
    on first use (in a child process: convert_in_child), straight into that precision
    (models.weights.cast_leaf as the source is read), and adding another precision to the entry
    on its first use the same way (a GGUF precision reads the GGUF's own blocks: the entry
    holds its config and tokenizer alone).

    A damaged entry (a file that does not match the manifest written with it, or one that
    cannot be read back) is rebuilt once; DamagedCacheError (naming the path) if it is still
    damaged or cannot be rebuilt."""
    try:
        return _load_converted(name, cache_dir, progress, dtype, mmap)
    except _Damaged as e:
        # docs/failure_modes.md: a damaged entry is named in a warning, then rebuilt once
        warnings.warn(
            f"damaged cache entry {e.path}: {e.what}; rebuilding it", registry.DamagedEntryWarning, 2
        )
        try:
            e.rebuild()
        except _REBUILD_ERRORS as err:
            raise registry.DamagedCacheError(e.path, f"{e.what}; rebuilding it failed: {err}") from err
        except _Damaged as err:  # what the rebuild reads from is damaged too
            raise registry.DamagedCacheError(err.path, err.what) from None
    try:
        return _load_converted(name, cache_dir, progress, dtype, mmap)
    except _Damaged as e:
        raise registry.DamagedCacheError(e.path, f"{e.what} (again, after rebuilding it)") from None


def _load_converted(name: str, cache_dir, progress: bool, dtype: str, mmap: bool = False):
    source = sources.resolve(name, fetch=False)
    if dtype not in source.precisions:
        raise ValueError(
            f"{name}: a Hugging Face checkpoint folder loads at {', '.join(source.precisions)}; "
            f"{dtype} reads a GGUF file's own blocks and needs a GGUF source"
        )
    fingerprint = source.fingerprint()
    legacy = _legacy_of(source)
    folder = converted_dir(name, cache_dir)
    stored = None if dtype in precision.GGUF_PRECISIONS else dtype  # the precision the entry holds
    entry, problem = _state(folder, legacy, fingerprint)
    if problem is None and entry is None:  # no entry (an older format, an edited source): convert
        folder = convert_in_child(name, cache_dir, progress, dtype=stored)
        entry, problem = _state(folder, legacy, fingerprint)

    def reconvert(replace=None):
        return lambda: convert_in_child(name, cache_dir, progress, replace=replace, dtype=stored)

    if problem is not None:
        raise _Damaged(folder, problem, reconvert())
    # an entry converted before the chat template was kept with the tokenizer reads it from the GGUF
    gguf = {"registry": lambda: registry.gguf_path(name, cache_dir), "gguf": lambda: source.path}
    try:
        meta = json.loads((folder / "config.json").read_text())
        config = ModelConfig(**meta["config"]).replace(dtype=dtype)
        tokenizer = Tokenizer.load(folder / "tokenizer.json", gguf=gguf.get(source.kind, lambda: None)())
    except Exception as e:  # whatever the parsers raise for a damaged file
        raise _Damaged(
            folder, f"its config or tokenizer cannot be read ({type(e).__name__}: {e})", reconvert(entry)
        ) from None
    if stored is None:  # read from the verified GGUF itself: no parameters in the entry
        gguf = source.path or registry.fetch_gguf(name, cache_dir, progress=progress)
        return config, gguf_loader.load_block_params(gguf, config, progress=progress), tokenizer
    params = folder / params_dir(dtype)
    params_id, problem = _state(params)  # an older entry's params/ has no manifest of its own: "legacy"
    if problem is None and params_id is None:  # not written yet at this precision
        convert_in_child(name, cache_dir, progress, dtype=dtype)
        params_id, problem = _state(params)
    # rebuilt: the folder alone, or an older entry whose manifest covers params/ as a whole
    rebuild = reconvert(entry if params_id == "legacy" else params_id)
    if problem is not None:
        raise _Damaged(params, problem, reconvert())
    return config, _int8_nodes(_restore(params, rebuild, mmap)), tokenizer


class _LeafFile:
    """One leaf's .npy, written front to back: its header, then its values as blocks arrive."""

    def __init__(self, path: pathlib.Path, shape: tuple[int, ...], dtype):
        self.path, self.shape, self.dtype = path, tuple(shape), np.dtype(dtype)
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize
        self.file = open(path, "wb")  # noqa: SIM115 (closed by close(): _ParamsWriter's)
        header = {"descr": _storage(self.dtype).str, "fortran_order": False, "shape": self.shape}
        np.lib.format.write_array_header_1_0(self.file, header)
        self.start = self.file.tell()

    def write(self, block: np.ndarray) -> None:
        self.file.write(np.ascontiguousarray(block, self.dtype).reshape(-1).view(np.uint8).data)

    def close(self, check: bool = True) -> None:
        written = self.file.tell() - self.start
        self.file.close()
        if check and written != self.nbytes:
            raise ValueError(f"{self.path}: {written} bytes written, the leaf has {self.nbytes}")


class _ParamsWriter:
    """A parameter tree written into `folder` leaf by leaf (open(), then close_leaves()), and its
    tree.json on leaving the `with` without an error."""

    def __init__(self, folder: pathlib.Path):
        self.folder, self.leaves, self.files = folder, [], {}

    def __enter__(self):
        self.folder.mkdir(parents=True, exist_ok=True)
        return self

    def open(self, keys: tuple[str, ...], shape: tuple[int, ...], dtype) -> _LeafFile:
        """A new leaf at pytree path `keys`, its values written to it in C order; several can be
        open at once (an Int8Weight's value and scale)."""
        file = ".".join(keys) + ".npy"
        self.leaves.append(
            {"path": list(keys), "file": file, "dtype": np.dtype(dtype).name, "shape": list(shape)}
        )
        self.files[tuple(keys)] = _LeafFile(self.folder / file, shape, dtype)
        return self.files[tuple(keys)]

    def close_leaves(self, check: bool = True) -> None:
        files, self.files = self.files, {}
        for f in files.values():
            f.close(check)

    def __exit__(self, kind, value, tb):
        self.close_leaves(check=kind is None)  # an error on the way out is the one to report
        if kind is None:
            (self.folder / PARAMS_TREE).write_text(json.dumps({"leaves": self.leaves}, indent=1))


def _storage(dtype: np.dtype) -> np.dtype:
    """The dtype a leaf's .npy names: its own, or an unsigned integer of its size for one the
    .npy format cannot name (bfloat16; tree.json keeps the real one)."""
    return np.dtype(f"<u{dtype.itemsize}") if dtype.kind == "V" else dtype


def _leaf_blocks(folder: pathlib.Path, leaf: dict, rows: int | None = None, mmap: bool = False):
    """The leaf described by `leaf` (an entry of folder's tree.json) read back from its .npy in
    blocks of `rows` along its first axis (all of it at once when None), or with `mmap` as one
    read-only memory map. ValueError if the file's header is not the one tree.json describes or
    its data ends early."""
    shape, dtype = tuple(leaf["shape"]), jax.numpy.dtype(leaf["dtype"])
    with open(folder / leaf["file"], "rb") as f:
        if np.lib.format.read_magic(f) != (1, 0):
            raise ValueError(f"{leaf['file']} is not a .npy this project wrote")
        header = np.lib.format.read_array_header_1_0(f)
        if header != (shape, False, _storage(dtype)):
            raise ValueError(f"{leaf['file']} holds {header}, {PARAMS_TREE} says {shape} {dtype}")
        if mmap:
            size = math.prod(shape) * _storage(dtype).itemsize
            if os.fstat(f.fileno()).st_size < f.tell() + size:
                raise ValueError(f"{leaf['file']} ends before its data does")
            yield np.memmap(f, _storage(dtype), "r", f.tell(), shape).view(dtype)
            return
        total = shape[0] if shape else 1
        rows = rows or total
        # a whole leaf (a load) is read straight onto huge pages: to_device uses it in place
        empty = huge_page_empty if rows == total else np.empty
        for r0 in range(0, total, rows):
            block = empty((min(rows, total - r0), *shape[1:]) if shape else (), dtype)
            if f.readinto(block.reshape(-1).view(np.uint8).data) != block.nbytes:
                raise ValueError(f"{leaf['file']} ends before its data does")
            yield block


def _read_tree(folder: pathlib.Path) -> list[dict]:
    """The leaves of folder's tree.json; ValueError if it is not one this project wrote."""
    leaves = json.loads((folder / PARAMS_TREE).read_text())["leaves"]
    if not all(isinstance(leaf, dict) and {"path", "file", "dtype", "shape"} <= set(leaf) for leaf in leaves):
        raise ValueError(f"{PARAMS_TREE} is not one this project wrote")
    return leaves


def _leaves(folder: pathlib.Path, rebuild):
    """Yields (leaf, read) for each leaf of the checkpoint at folder (leaf: its tree.json entry;
    read(rows=None): _leaf_blocks(folder, leaf, rows)); _Damaged (with rebuild) when either
    cannot be read back."""

    def damaged(e: Exception) -> _Damaged:
        return _Damaged(folder, f"the checkpoint cannot be read ({type(e).__name__}: {e})", rebuild)

    def checked(leaf, rows=None, mmap=False):
        try:
            yield from _leaf_blocks(folder, leaf, rows, mmap)
        except (OSError, ValueError, TypeError) as e:  # a missing file, numpy's header parser
            raise damaged(e) from None

    try:
        leaves = _read_tree(folder)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise damaged(e) from None
    for leaf in leaves:
        yield leaf, lambda rows=None, mmap=False, leaf=leaf: checked(leaf, rows, mmap)


def _restore(path: pathlib.Path, rebuild, mmap: bool = False):
    """The parameters at path as a nested dict of numpy arrays (read-only memory maps of the
    .npy files with `mmap`: nothing is read until a slice is); _Damaged (with rebuild) if they
    cannot be read back (tree.json unreadable, a leaf's header or length not the one it names)."""
    params: dict = {}
    for leaf, read in _leaves(path, rebuild):
        node = params
        for key in leaf["path"][:-1]:
            node = node.setdefault(key, {})
        node[leaf["path"][-1]] = next(read(mmap=True)) if mmap else next(read())
    return params


def main(argv=None) -> int:
    """The child process: converts one model, then prints one JSON line on stdout, {"folder": ...,
    "peak_rss_gb": ...} or {"error": class name, "message": ...} (exit code 1)."""
    parser = argparse.ArgumentParser(prog="python -m models.convert", description=__doc__.splitlines()[0])
    parser.add_argument(
        "name",
        help="a registry model (models.registry.MODELS), or a local GGUF file's or checkpoint folder's path",
    )
    parser.add_argument(
        "--cache_dir", default=None, help="cache root (default $SPEC_JAX_CACHE or ~/.cache/spec_jax)"
    )
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    parser.add_argument(
        "--replace",
        default=None,
        help="the id of an entry or a precision's folder found damaged: write it afresh",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        help="the precision whose parameters to write (models.precision), or none (the entry alone)",
    )
    args = parser.parse_args(argv)
    dtype = None if args.dtype == "none" else args.dtype
    try:
        folder = convert(args.name, args.cache_dir, progress=args.progress, replace=args.replace, dtype=dtype)
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
