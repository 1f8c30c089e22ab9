"""The one loader of a target and its draft model, for launch.generate, launch.serve and the
experiments that load a pair: load_pair(...) -> Pair. It reads no flags (launch.flags turns the
command line into its arguments), so a caller with a config instead of flags calls it the same
way, with its own `load` where it has one (experiments/common.py's tiny models and cache)."""

import contextlib
import dataclasses
import functools
import sys
import threading
from collections.abc import Callable

import jax

import models
from launch.usage import UsageError
from models import registry
from models.tokenizer import check_pair
from spec_jax import sharding


@dataclasses.dataclass(frozen=True)
class Pair:
    """A loaded target and its draft model (None: no draft model: plain decoding, or a drafter
    that needs none), each placed on the mesh where load_pair was given one."""

    target: models.Model
    draft: models.Model | None = None


def load_model(
    name: str,
    dtype: str,
    batch: int = 1,
    mesh=None,
    *,
    attention_impl: str = "auto",
    matmul_impl: str = "auto",
    flag: str = "--target_dtype",
) -> models.Model:
    """models.load at dtype (auto: models.auto_precision for this batch and device count; its
    note, where it has one, is one line on stderr naming `flag`), with its config's
    attention_impl and matmul_impl set; placed on `mesh` as it is read (each process reads only
    its own shards)."""
    devices = 1 if mesh is None else mesh.devices.size
    if dtype == "auto":
        if name in registry.MODELS:  # the weights first: their download's error is reported
            registry.fetch_gguf(name)
        auto = models.auto_precision(name, batch, devices, flag=flag)
        if auto.note and jax.process_index() == 0:
            print(auto.note, file=sys.stderr)
        dtype = auto.precision
    place = None if mesh is None else (lambda params: sharding.place_params(params, mesh))
    model = models.load(name, dtype=dtype, place=place)
    config = dataclasses.replace(model.config, attention_impl=attention_impl, matmul_impl=matmul_impl)
    return model.replace(config=config)


def prefetch(name: str) -> threading.Thread | None:
    """Starts fetching the registry model `name`'s GGUF in a background thread where its file is
    not in the cache yet (announced in one line), so that a draft's download overlaps the
    target's download and conversion. Returns the thread (None: nothing to fetch). load_model's
    own fetch then waits for it (the file's lock) and finds the file, or, where the background
    fetch failed, fetches it again and reports what goes wrong."""
    if name not in registry.MODELS or registry.gguf_path(name).exists():
        return None
    size = registry.get_spec(name).size / 1e6
    print(
        f"fetching the draft {name} ({size:.0f} MB) in the background while the target is prepared",
        file=sys.stderr,
    )
    thread = threading.Thread(target=_fetch_quietly, args=(name,), daemon=True, name=f"prefetch {name}")
    thread.start()
    return thread


def _fetch_quietly(name: str) -> None:
    """registry.fetch_gguf without progress bars; an error is left to the fetch that follows."""
    with contextlib.suppress(Exception):  # load_model's fetch of the same file reports it
        registry.fetch_gguf(name, progress=False)


def load_pair(
    target: str,
    draft: str | None,
    *,
    target_dtype: str = "auto",
    draft_dtype: str = "auto",
    batch: int = 1,
    mesh=None,
    attention_impl: str = "auto",
    matmul_impl: str = "auto",
    load: Callable[[str, str], models.Model] | None = None,
    check_target: Callable[[models.Model], None] | None = None,
    check_draft: Callable[[models.Model, models.Model], None] | None = None,
    prefetch_draft: bool = False,
) -> Pair:
    """The target and draft models `target` and `draft` (None: no draft model) at their
    precisions, in these steps:

    1. prefetch_draft: the draft's download starts in the background (prefetch);
    2. the target is loaded (load_model for `batch` rows on `mesh`, or `load(name, dtype)`);
       check_target(target) runs before anything of the draft is read (a caller's prompt and
       context checks, so that a refusal comes before the draft is loaded);
    3. the draft is loaded the same way, then check_draft(target, draft);
    4. on `mesh`, both are placed once (sharding.place);
    5. the draft's tokenizer is checked against the target's (the same vocabulary, or a prefix of
       it: the draft's q is then padded): UsageError naming both otherwise.

    Returns Pair(target, draft or None)."""
    settings = dict(batch=batch, mesh=mesh, attention_impl=attention_impl, matmul_impl=matmul_impl)
    load_target = load or functools.partial(load_model, flag="--target_dtype", **settings)
    load_draft = load or functools.partial(load_model, flag="--draft_dtype", **settings)
    if prefetch_draft and draft is not None:
        prefetch(draft)
    target_model = load_target(target, target_dtype)
    if check_target is not None:
        check_target(target_model)
    draft_model = None
    if draft is not None:
        draft_model = load_draft(draft, draft_dtype)
        if check_draft is not None:
            check_draft(target_model, draft_model)
    if mesh is not None:  # placed once here; generate then uses the arrays as they are
        target_model = sharding.place(target_model, mesh)
        draft_model = None if draft_model is None else sharding.place(draft_model, mesh)
    if draft_model is not None and draft_model.tokenizer is not None and target_model.tokenizer is not None:
        try:  # a draft whose vocabulary is a prefix of the target's drafts with q padded (ModelDrafter)
            check_pair(
                target_model.tokenizer,
                draft_model.tokenizer,
                target_model.config.vocab_size,
                draft_model.config.vocab_size,
            )
        except ValueError as e:
            raise UsageError(f"--draft={draft} and --target={target}: {e}") from None
    return Pair(target_model, draft_model)
