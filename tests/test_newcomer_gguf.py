"""Issue 39, item 4: a truncated or corrupt GGUF file is refused before anything is built or
allocated, in one line naming the file and what is wrong, exit code 1 (exit 2 stays for bad
flags). Truncated and edited copies of the tiny GGUF (tests/tiny_gguf.py) stand in.

Issue 53, item 1: `auto` takes the GGUF kernel (gguf_q8) for a run of any length, building it
where it is not built yet; without cmake or a compiler, int8 and one line saying what is missing;
`python -m models.kernels.build` (what `make demo` / `make test` start at set-up) says the same."""

import inspect
import json
import os
import pathlib
import shutil
import struct
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest
import tiny_gguf

import models
from models import gguf_loader

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    tiny_gguf.write(path)
    return path


def _first_tensor_field(reader) -> int:
    return min(t.field.offset for t in reader.tensors)


def _damaged(src: pathlib.Path, dst: pathlib.Path, how: str) -> pathlib.Path:
    data = bytearray(src.read_bytes())
    table = _first_tensor_field(gguf_loader.GGUFReader(str(src), "r"))
    if how == "inside the metadata":
        data = data[:200]
    elif how == "inside the tensor table":
        data = data[: table + 10]
    elif how == "inside the tensor data":
        data = data[:-7]
    elif how == "bad version":
        data[4:8] = struct.pack("<I", 99)
    elif how == "bad tensor type":
        name_len = struct.unpack_from("<Q", data, table)[0]
        at = table + 8 + name_len
        ndims = struct.unpack_from("<I", data, at)[0]
        data[at + 4 + 8 * ndims : at + 8 + 8 * ndims] = struct.pack("<I", 1234)
    dst.write_bytes(bytes(data))
    return dst


DAMAGE = {
    "inside the metadata": "truncated: the file ends inside metadata",
    "inside the tensor table": "truncated: the file ends inside the tensor table",
    "inside the tensor data": "truncated or corrupt: tensor .* needs bytes up to",
    "bad version": "corrupt: GGUF version 99",
    "bad tensor type": "corrupt: tensor .* has unknown type 1234",
}


def test_the_whole_file_passes(tiny_file):
    gguf_loader.check_file(tiny_file)


@pytest.mark.parametrize("how", list(DAMAGE))
def test_a_damaged_file_is_one_error_naming_it_before_anything_is_read(tiny_file, tmp_path, how):
    bad = _damaged(tiny_file, tmp_path / "bad.gguf", how)
    with pytest.raises(gguf_loader.GGUFFileError, match=DAMAGE[how]) as info:
        models.check_source(str(bad))  # what launch.generate checks its flags with
    assert str(bad) in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(gguf_loader.GGUFFileError):
        gguf_loader.open_gguf(bad)


def test_the_cli_refuses_a_truncated_draft_in_one_line_exit_1_before_building(tiny_file, tmp_path):
    """It built llama.cpp for 92 s, then exited 2 with `cannot reshape array of size 1064`."""
    bad = _damaged(tiny_file, tmp_path / "draft.gguf", "inside the tensor data")
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "JAX_PLATFORMS": "cpu",
        "SPEC_JAX_CACHE": str(tmp_path / "c"),
    }
    result = subprocess.run(
        [sys.executable, "-m", "launch.generate", "--target=random", f"--draft={bad}", "--prompt=x"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and str(bad) in lines[0] and "truncated" in lines[0], result.stderr
    assert not (tmp_path / "c").exists()  # nothing built, converted or cached


# --- item 3: auto picks a precision that needs no build for a toy GGUF ------------------------
# --- issue 53, item 1: the GGUF kernel from the first run, whatever its length -----------------


@pytest.fixture
def no_build(monkeypatch):
    """The GGUF kernel's availability check (which builds ggml and the kernel where they are not
    built) counted, the kernel reported available; ggml reported not built yet."""
    from models.kernels import gguf_matmul, llama_cpp, target

    monkeypatch.setattr(target, "current", lambda: type("T", (), {"platform": "cpu"})())
    state = {"asked": 0}

    def available():
        state["asked"] += 1
        return True

    monkeypatch.setattr(gguf_matmul, "available", available)
    monkeypatch.setattr(gguf_matmul, "multirow", lambda: True)
    monkeypatch.setattr(llama_cpp, "built", lambda *a, **k: False)
    return state


def test_a_toy_gguf_runs_at_a_precision_that_needs_no_build(tiny_file, no_build):
    """A 27-tensor draft.gguf built llama.cpp for 112 s (draft_dtype=auto chose gguf_q8)."""
    assert models.fastest_precision(str(tiny_file)) == "int8"
    assert no_build["asked"] == 0  # nothing built or loaded to decide


def test_auto_asks_for_the_gguf_kernel_before_it_is_built_and_takes_gguf_q8(no_build):
    """Issue 53: auto chose int8 (0.49x llama.cpp) for any run under 4,096 tokens until one long
    run had built the kernel; asking for the kernel now builds it where it is not built."""
    assert models.fastest_precision("qwen2.5-coder-1.5b") == "gguf_q8" and no_build["asked"] == 1
    assert "tokens" not in inspect.signature(models.auto_precision).parameters  # no run-length rule


def _run_tiny(tiny_file, tmp_path, prelude: str, env: dict) -> tuple[subprocess.CompletedProcess, dict]:
    """launch.generate on the tiny GGUF as target and draft, 4 greedy tokens (a short run), with
    `prelude` run first (models.SMALL_GGUF_BYTES = 0: the tiny file counts as a real model);
    the process and its --output_json."""
    out = tmp_path / "out.json"
    code = f"import models, sys\nmodels.SMALL_GGUF_BYTES = 0\n{prelude}\nfrom launch import generate\ngenerate.cli()"
    args = [f"--target={tiny_file}", f"--draft={tiny_file}", "--prompt=hi", "--max_new_tokens=4"]
    args += ["--temperature=0", "--gamma=2", f"--output_json={out}", "--nocompilation_cache"]
    result = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result, json.loads(out.read_text())


# ggml reported not built, and its build stood in for by the folder the default cache holds (the
# suite's other GGUF tests build it there): the stand-in says when it is called.
NOT_BUILT_YET = """
from models.kernels import llama_cpp
built_folder = llama_cpp.build_dir()
def stand_in(targets=llama_cpp.LIBRARIES, cache_dir=None, server=False):
    print("stand-in build of", *targets, file=sys.stderr)
    return built_folder
llama_cpp.built = lambda *a, **k: False
llama_cpp.build = stand_in
"""


def test_a_short_run_before_ggml_is_built_builds_it_and_runs_at_gguf_q8(tiny_file, tmp_path):
    """A 4-token run on a machine where ggml is not built yet asks for the build and runs
    gguf_q8 (before issue 53 it ran int8 and built nothing)."""
    from models.kernels import gguf_matmul

    assert gguf_matmul.available(), "the GGUF block kernel did not build (see the warning)"
    result, report = _run_tiny(tiny_file, tmp_path, NOT_BUILT_YET, {})
    assert "stand-in build of ggml-base ggml-cpu" in result.stderr, result.stderr
    assert report["target_dtype"] == "gguf_q8" and report["draft_dtype"] == "gguf_q8", report


def _path_without_cmake(folder: pathlib.Path, compilers: bool) -> str:
    """A PATH of one folder holding links to the C and C++ compilers (compilers=True) or nothing."""
    folder.mkdir()
    for tool in ("cc", "c++", "g++", "gcc") if compilers else ():
        if shutil.which(tool):
            (folder / tool).symlink_to(shutil.which(tool))
    return str(folder)


def test_without_cmake_a_run_takes_int8_and_says_why_once(tiny_file, tmp_path):
    """No cmake on the PATH (the C++ compiler there): target and draft at int8, and one line, not
    one per model, naming cmake and how to install it."""
    from conftest import cache_with_kernels

    env = {
        "PATH": _path_without_cmake(tmp_path / "bin", compilers=True),
        "SPEC_JAX_CACHE": str(cache_with_kernels(tmp_path / "cache")),  # the int8 kernel only
    }
    result, report = _run_tiny(tiny_file, tmp_path, "", env)
    assert report["target_dtype"] == "int8" and report["draft_dtype"] == "int8", report
    said = [line for line in result.stderr.splitlines() if "cmake" in line]
    assert len(said) == 1 and "apt-get install cmake g++" in said[0], result.stderr
    assert said[0].startswith("warning: spec_jax: the GGUF block kernel is unavailable"), said
    assert not (tmp_path / "cache" / "llama.cpp").exists()  # nothing downloaded to find out


@pytest.mark.parametrize("compilers", [True, False], ids=["no cmake", "no cmake or compiler"])
def test_check_tools_names_what_is_missing_and_how_to_install_it(tmp_path, monkeypatch, compilers):
    from models.kernels import gguf_matmul, llama_cpp

    monkeypatch.setenv("PATH", _path_without_cmake(tmp_path / "bin", compilers))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(llama_cpp.Unavailable) as info:
        llama_cpp.check_tools()
    missing = "cmake not found" if compilers else "cmake and a C/C++ compiler not found"
    assert str(info.value).startswith(missing) and "apt-get install cmake g++" in str(info.value)
    assert gguf_matmul.unbuildable() == str(info.value)


def _build_command(args, env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "models.kernels.build", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_build_command_without_cmake_says_so_in_one_line_and_starts_nothing_in_the_background(
    tmp_path,
):
    from conftest import cache_with_kernels

    cache = cache_with_kernels(tmp_path / "cache")
    env = {"PATH": _path_without_cmake(tmp_path / "bin", compilers=True), "SPEC_JAX_CACHE": str(cache)}
    result = _build_command([], env)
    assert result.returncode == 1 and result.stdout == "", result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "cmake not found" in lines[0] and "apt-get install cmake g++" in lines[0], (
        lines
    )
    background = _build_command(["--background"], env)  # what `make demo` runs after installing
    assert background.returncode == 0 and background.stdout == background.stderr == "", background
    assert not (cache / "llama.cpp").exists() and not (cache / "kernel-build.log").exists()


def test_the_background_build_builds_ggml_first_and_only_what_is_missing(tmp_path):
    """ggml first: a run waits for it before it reads the weights; the int8 kernel, a few seconds
    of g++ that the run needs only when it compiles, after it. Nothing where all is built."""
    from conftest import cache_with_kernels

    from models.kernels import build, gguf_matmul

    if gguf_matmul.unbuildable():
        pytest.skip(gguf_matmul.unbuildable())
    assert build.pending(tmp_path / "empty") == ["gguf", "cpu"]
    assert build.pending(cache_with_kernels(tmp_path / "cpu")) == ["gguf"]
    assert not (tmp_path / "empty").exists()  # nothing built or made to decide


def test_a_lock_held_elsewhere_prints_what_the_waiter_waits_for(tmp_path, capsys):
    """A run that needs llama.cpp while `python -m models.kernels.build --background` builds it
    says that it waits (registry.file_lock's `waiting`), then gets the lock once it is let go."""
    from models import registry

    held, release = threading.Event(), threading.Event()

    def holder():
        with registry.file_lock(tmp_path / ".lock"):
            held.set()
            release.wait(30)

    thread = threading.Thread(target=holder)
    thread.start()
    assert held.wait(30)
    threading.Timer(0.5, release.set).start()
    with registry.file_lock(tmp_path / ".lock", waiting="waiting for the build"):
        assert release.is_set()  # not before the holder let go
    thread.join()
    assert capsys.readouterr().err == "waiting for the build\n"
    with registry.file_lock(tmp_path / ".lock", waiting="waiting for the build"):
        pass
    assert capsys.readouterr().err == ""  # a free lock: nothing said


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_blocks_load_from_the_header_index_without_parsing_the_vocabulary(tmp_path, monkeypatch, arch):
    """Issue 39, first output in seconds: load_block_params reads a file through check_file's
    index (GGUFReader took ~8 s per Qwen file to parse the vocabulary before anything was read),
    and gets the same arrays as through a GGUFReader; the index's scalar metadata are
    metadata_value's."""
    path = tmp_path / "tiny.gguf"
    tiny_gguf.write(path, arch, qkv_bias=arch != "llama")  # llama files carry no biases
    reader = gguf_loader.GGUFReader(str(path), "r")
    config = models.ModelConfig(**gguf_loader.read_config(reader)).replace(dtype="gguf_q8")
    expected = gguf_loader.load_block_params(reader, config, progress=False)
    index = gguf_loader.check_file(path)
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}  # the reader's own
    scalars = {k for k, f in fields.items() if f.types and f.types[0] != gguf_loader.GGUFValueType.ARRAY}
    assert set(index.metadata) == scalars
    assert all(index.metadata[k] == gguf_loader.metadata_value(reader, k) for k in scalars)

    class NoReader:
        def __init__(self, *args, **kwargs):
            raise AssertionError("GGUFReader opened")

    monkeypatch.setattr(gguf_loader, "GGUFReader", NoReader)
    got = gguf_loader.load_block_params(str(path), config, progress=False)
    flat_e, tree_e = jax.tree.flatten(expected)
    flat_g, tree_g = jax.tree.flatten(got)
    assert tree_e == tree_g and len(flat_g) > 0
    for e, g in zip(flat_e, flat_g, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(e))


def test_a_file_cut_anywhere_inside_its_vocabulary_is_refused_naming_the_field(tiny_file, tmp_path):
    """check_file steps over a vocabulary's strings in one loop (gguf_loader._Header.skip_strings):
    it reads the same index as the whole file's parse, and a file that ends inside the strings,
    at a length or inside one, is the one-line truncation error naming the field."""
    reader = gguf_loader.GGUFReader(str(tiny_file), "r")
    field = reader.fields["tokenizer.ggml.tokens"]
    # the strings: after the key, the value type, the item type and the count (parts 0-4)
    start = field.offset + sum(p.nbytes for p in field.parts[:5])
    end = field.offset + sum(p.nbytes for p in field.parts)
    index = gguf_loader.check_file(tiny_file)
    assert set(index.tensors) == {t.name for t in reader.tensors}
    assert gguf_loader.read_index(tiny_file).metadata["tokenizer.ggml.tokens"] == [
        str(bytes(field.parts[i]), "utf-8") for i in field.data
    ]
    data = tiny_file.read_bytes()
    for cut in sorted({start + 3, start + 8, start + 9, (start + end) // 2, end - 1}):
        path = tmp_path / f"cut-{cut}.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(
            gguf_loader.GGUFFileError,
            match=r"truncated: the file ends inside metadata 'tokenizer.ggml.tokens' \(at byte \d+\)",
        ):
            gguf_loader.check_file(path)
