"""Building the native libraries that compiled programs call by name (models.kernels.builds
names their builds).

`verified_build` is the one way a library is built and found again: in its cache folder only
when that folder is this user's own (owned by them, writable by no one else), else in a private
temporary folder of this process (never a shared, predictable path another user could plant a
library in); the library's sha256 is stored beside it (`NAME.so.sha256`, written after it) and
checked before every load, and a library that does not match is built again.
"""

import atexit
import functools
import os
import pathlib
import shutil
import sys
import tempfile
from collections.abc import Callable

from models import registry


class LibraryMismatch(OSError):
    """A library's bytes do not match the sha256 stored beside it, even after building it again."""


def verified_build(path: pathlib.Path, compile_to: Callable[[str], None]) -> pathlib.Path:
    """The path of a library named path.name whose sha256 matches the one stored beside it,
    built with compile_to(output path) where there is none (or it does not match).

    It lives in path's folder when that folder is usable (own_folder), else in a private
    temporary folder of this process. The build holds the library's file_lock (a second process
    waits, then finds it built) and removes what killed builds left. LibraryMismatch if the
    library still does not match after one build; compile_to's errors propagate."""
    folder = path.parent if own_folder(path.parent) else _private_folder()
    path = folder / path.name
    if _matches(path):
        return path
    label = path.stem
    with registry.file_lock(folder / f".lock-{label}"):
        if _matches(path):  # built by another process meanwhile
            return path
        registry.remove_dead_tmp(folder, label)
        print(
            f"building the kernel library {label} with a C++ compiler (once: seconds to a minute)",
            file=sys.stderr,
        )
        with registry.atomic_path(path, label=label, suffix=path.suffix) as tmp:
            compile_to(str(tmp))
            digest = registry.sha256_file(tmp)
        registry.write_text_atomic(_digest_path(path), digest + "\n")  # after the library
    if not _matches(path):
        raise LibraryMismatch(f"{path}: its sha256 does not match {_digest_path(path)} after building it")
    return path


def built(path: pathlib.Path) -> bool:
    """Whether verified_build(path, ...) finds the library in path's folder without compiling
    (False where that folder is missing, creating nothing, or not usable: a build would go to a
    private temporary folder)."""
    return path.parent.is_dir() and own_folder(path.parent) and _matches(path)


def _digest_path(path: pathlib.Path) -> pathlib.Path:
    return path.with_name(path.name + ".sha256")


def _matches(path: pathlib.Path) -> bool:
    try:
        return _digest_path(path).read_text().strip() == registry.sha256_file(path)
    except OSError:
        return False


def own_folder(folder: pathlib.Path) -> bool:
    """Whether folder can be created and is safe to load libraries from: owned by this user and
    writable by no one else (so no one else can put a library, or its digest, there)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        st = folder.stat()
    except OSError:
        return False
    return st.st_uid == os.getuid() and not st.st_mode & 0o022 and os.access(folder, os.W_OK)


@functools.cache
def _private_folder() -> pathlib.Path:
    """A temporary folder only this process uses (mkdtemp: mode 0700, an unpredictable name),
    removed at exit; libraries built there are built again by the next process."""
    folder = pathlib.Path(tempfile.mkdtemp(prefix="spec_jax-kernels-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder
