"""What models.load takes besides a random preset: a registry name, a local GGUF file, a local
Hugging Face checkpoint folder, or a Hugging Face hub repo id ("org/name").

`resolve(text)` names the source (a hub id is fetched with huggingface_hub.snapshot_download
first, and is a local folder from then on); `check(text)` says, without fetching or reading any
weights, whether `text` can be one (the entry points call it before loading anything).

A local file or folder is converted once (models.convert) into a cache entry named by its
resolved path (`entry`), and the entry records the source's `fingerprint`: the size and
modification time (ns) of every file the conversion reads. A checkpoint edited or re-saved since
has another fingerprint and is converted afresh into the same entry. Why sizes and times, not a
hash of the safetensors headers and config.json: a fine-tuned checkpoint re-saved over the old
one has the same headers (the same names, shapes, dtypes and offsets) and the same config, and
only its data differs; hashing the data itself would read every byte of a 70B at each load.
The stat costs nothing, and misses only a file rewritten with its old size and its old time
restored by hand (registry GGUFs use the same rule: models.registry's stamp).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import re

from models import gguf_loader, hf_checkpoint, hf_config, registry
from models.precision import GGUF_PRECISIONS, PRECISIONS

# What models.load takes besides names, for messages.
FORMS = "a local .gguf file, a Hugging Face checkpoint folder, or a Hugging Face hub id (org/name)"
# The files of a checkpoint folder the conversion reads (and a hub download fetches).
HF_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "model.safetensors.index.json",
    "*.safetensors",
)
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")
GGUF_MAGIC = b"GGUF"


@dataclasses.dataclass(frozen=True)
class Source:
    """A model's weights: kind "registry" (name: the registry name), "gguf" (a local GGUF file)
    or "hf" (a local checkpoint folder); for those two, `name` is the resolved path's text."""

    kind: str
    name: str

    @property
    def path(self) -> pathlib.Path | None:
        return None if self.kind == "registry" else pathlib.Path(self.name)

    @property
    def has_gguf(self) -> bool:
        """Whether the GGUF precisions (gguf, gguf_q8: the file's own blocks) can be read."""
        return self.kind in ("registry", "gguf")

    @property
    def precisions(self) -> tuple[str, ...]:
        return PRECISIONS if self.has_gguf else tuple(p for p in PRECISIONS if p not in GGUF_PRECISIONS)

    @property
    def entry(self) -> str:
        """The cache entry's folder name under converted/: the registry name, or
        `{kind}-{file or folder name}-{sha256 of the resolved path, 16 hex digits}`."""
        if self.kind == "registry":
            return self.name
        stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", self.path.name)[:48] or "model"
        return f"{self.kind}-{stem}-{hashlib.sha256(self.name.encode()).hexdigest()[:16]}"

    def files(self) -> list[pathlib.Path]:
        """The files the conversion reads (none for a registry model: its GGUF is verified)."""
        if self.kind == "gguf":
            return [self.path]
        if self.kind == "hf":
            return sorted({p for pattern in HF_FILES for p in self.path.glob(pattern) if p.is_file()})
        return []

    def fingerprint(self) -> dict[str, list[int]] | None:
        """{file name: [size, mtime_ns]} of files() (see the module docstring); None for a
        registry model."""
        if self.kind == "registry":
            return None
        out = {}
        for path in self.files():
            st = path.stat()
            out[path.name] = [st.st_size, st.st_mtime_ns]
        return out


def _local(path: pathlib.Path) -> Source:
    """The Source of an existing file or folder; ValueError in one line when it is neither a
    GGUF file nor a checkpoint folder of a supported architecture, gguf_loader.GGUFFileError
    when it is a GGUF file cut short or corrupt (gguf_loader.check_file)."""
    resolved = path.resolve()
    if resolved.is_file():
        with open(resolved, "rb") as f:
            if f.read(4) != GGUF_MAGIC:
                raise ValueError(f"{path}: not a GGUF file (it does not start with {GGUF_MAGIC!r})")
        gguf_loader.check_file(resolved)  # a truncated or corrupt file: one line, before any build
        return Source("gguf", str(resolved))

    try:
        cfg = hf_checkpoint.read_config_json(resolved)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}/config.json cannot be read ({e})") from None
    hf_config.family_of(hf_config.text_config(cfg))  # an unsupported architecture: refused, named
    return Source("hf", str(resolved))


def is_hub_id(text: str) -> bool:
    """Whether text has the form of a hub repo id, "org/name" (one slash, no leading dot)."""
    return _HUB_ID.fullmatch(text) is not None


def check(text: str, known=None) -> None:
    """ValueError in one line unless `text` is a registry name, an existing GGUF file or
    checkpoint folder (of a supported architecture), or has the form of a hub id; fetches and
    converts nothing. `known`: the names the message lists (models.known_models() by default)."""
    if text in registry.MODELS:
        return
    path = pathlib.Path(text).expanduser()
    if path.exists():
        _local(path)
        return
    if is_hub_id(text):
        return
    raise ValueError(unknown(text, known))


def unknown(text: str, known=None) -> str:
    """The message for text that names no model, listing `known` (default: the registry's
    names; models.load and models.check_source pass models.known_models(), presets included)."""
    names = ", ".join(sorted(registry.MODELS) if known is None else known)
    return f"unknown model {text!r}; known models: {names}; or {FORMS}"


def resolve(text: str, fetch: bool = True, known=None) -> Source:
    """The Source of `text` (see the module docstring); a hub id is downloaded (fetch_hub) unless
    `fetch` is False, when it is refused. ValueError for text that names none (listing `known`,
    as unknown)."""
    if text in registry.MODELS:
        return Source("registry", text)
    path = pathlib.Path(text).expanduser()
    if path.exists():
        return _local(path)
    if is_hub_id(text) and fetch:
        return _local(fetch_hub(text))
    raise ValueError(unknown(text, known))


def entry_of(text: str) -> str:
    """Source.entry of `text` without checking that a name is registered: a registry name (or
    one a test registered in another process) is its own entry; an existing file or folder's is
    named by its path. ValueError for a path that does not exist."""
    if text in registry.MODELS:
        return text
    path = pathlib.Path(text).expanduser()
    if path.exists():
        return _local(path).entry
    if os.sep in text or text.endswith(".gguf"):
        raise ValueError(unknown(text))
    return text


def fetch_hub(repo_id: str) -> pathlib.Path:
    """The checkpoint folder of hub repo `repo_id` (its HF_FILES) in huggingface_hub's own
    cache, downloaded where not there yet. models.registry.DownloadError in one line when
    huggingface_hub is not installed or the hub cannot be reached (nothing about the name is
    wrong then: the environment is)."""
    try:
        import huggingface_hub  # an optional dependency (the hub extra)
    except ImportError:
        raise registry.DownloadError(
            f"{repo_id}: no such file or folder, and huggingface_hub is not installed to fetch it "
            "as a Hugging Face hub id (install the hub extra: pip install 'spec-jax[hub]')"
        ) from None
    try:
        folder = huggingface_hub.snapshot_download(repo_id, allow_patterns=list(HF_FILES))
    except Exception as e:  # offline, unreachable, no such repo, gated: all one line
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise registry.DownloadError(
            f"{repo_id}: no such file or folder here, and the Hugging Face hub cannot provide it "
            f"({type(e).__name__}: {first})"
        ) from None
    return pathlib.Path(os.fspath(folder))


def has_gguf(text: str) -> bool:
    """Whether `text` is a registry name or an existing GGUF file (no fetching): a source the
    GGUF precisions can read."""
    if text in registry.MODELS:
        return True
    path = pathlib.Path(text).expanduser()
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False
