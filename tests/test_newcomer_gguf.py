"""Issue 39, item 4: a truncated or corrupt GGUF file is refused before anything is built or
allocated, in one line naming the file and what is wrong, exit code 1 (exit 2 stays for bad
flags). Truncated and edited copies of the tiny GGUF (tests/tiny_gguf.py) stand in."""

import os
import pathlib
import struct
import subprocess
import sys

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


# --- item 3: auto picks a precision that needs no build where the build cannot pay -------------


@pytest.fixture
def no_build(monkeypatch):
    """The GGUF kernel's availability check (which builds ggml and the kernel) made to fail the
    test if called; the kernel counted as available otherwise. Returns a setter of `built`."""
    from models.kernels import gguf_matmul, llama_cpp, target

    monkeypatch.setattr(target, "current", lambda: type("T", (), {"platform": "cpu"})())
    state = {"built": False, "asked": 0}

    def available():
        state["asked"] += 1
        return True

    monkeypatch.setattr(gguf_matmul, "available", available)
    monkeypatch.setattr(gguf_matmul, "multirow", lambda: True)
    monkeypatch.setattr(llama_cpp, "built", lambda *a, **k: state["built"])
    return state


def test_a_toy_gguf_runs_at_a_precision_that_needs_no_build(tiny_file, no_build):
    """A 27-tensor draft.gguf built llama.cpp for 112 s (draft_dtype=auto chose gguf_q8)."""
    no_build["built"] = True
    assert models.fastest_precision(str(tiny_file)) == "int8"
    assert models.fastest_precision(str(tiny_file), tokens=10**6) == "int8"
    assert no_build["asked"] == 0  # nothing built or loaded to decide


def test_a_short_run_before_the_kernel_is_built_needs_no_build(no_build):
    big = "qwen2.5-coder-1.5b"
    assert models.fastest_precision(big, tokens=64) == "int8" and no_build["asked"] == 0
    assert models.fastest_precision(big, tokens=models.BUILD_PAYS_TOKENS) == "gguf_q8"  # a run that pays
    no_build["built"] = True  # once built, every run uses it
    assert models.fastest_precision(big, tokens=8) == "gguf_q8"


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
