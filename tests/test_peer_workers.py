"""The peer suite's parts that need no peer library: the workers' JSON-lines protocol, the
draft GGUF's requantization for OpenVINO GenAI, reading llama.cpp's programs' output (captured
from the real programs in tests/fixtures/llama_cpp/), comparing a peer's text with our tokens,
and skipping a library whose packages or tools are missing while the others still run.
(tests/test_bench.py runs the whole suite on fake workers.)"""

import io
import json
import os
import pathlib
import stat
import subprocess
import sys

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from experiments import bench_peer
from launch import llama_peer_worker, ov_peer_worker, peer_protocol
from models.kernels import llama_cpp

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "llama_cpp"


def test_protocol_answers_each_request_and_survives_a_bad_one():
    requests = [
        json.dumps({"op": "generate", "prompt": [5, 6], "max_new_tokens": 3, "speculative": True}),
        "",
        json.dumps({"op": "nope"}),
        json.dumps({"op": "generate", "prompt": [], "max_new_tokens": 2, "speculative": False}),
        json.dumps({"op": "quit"}),
        json.dumps({"op": "generate", "prompt": [1], "max_new_tokens": 1, "speculative": False}),
    ]
    out = io.StringIO()
    peer_protocol.serve(peer_protocol.FakeBackend(), out, [line + "\n" for line in requests])
    replies = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(replies) == 3  # nothing after quit
    assert replies[0]["tokens"] == [7, 8, 9] and replies[0]["num_tokens"] == 3
    assert replies[0]["seconds"] >= 0 and replies[0]["peak_rss_mb"] > 0
    assert "unknown op" in replies[1]["error"]
    assert replies[2]["error"].startswith("IndexError")  # an empty prompt: the fake backend's error


def write_gguf(path, tensors: dict, quant_types: dict):
    writer = gguf.GGUFWriter(path, "qwen2")
    writer.add_block_count(1)
    writer.add_token_list(["a", "b", "<|endoftext|>"])
    writer.add_token_merges(["a b"])
    writer.add_eos_token_id(2)
    for name, values in tensors.items():
        qtype = quant_types.get(name)
        if qtype is None:
            writer.add_tensor(name, values)
        else:
            writer.add_tensor(name, quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_draft_requantized_for_openvino_keeps_metadata_and_other_tensors(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "token_embd.weight": rng.standard_normal((16, 64)).astype(np.float32),
        "blk.0.attn_norm.weight": rng.standard_normal(64).astype(np.float32),
        "output.weight": rng.standard_normal((16, 64)).astype(np.float32),
    }
    Q = GGMLQuantizationType
    src, out = tmp_path / "draft.gguf", tmp_path / "draft.q8_0.gguf"
    write_gguf(src, tensors, {"token_embd.weight": Q.Q5_0, "output.weight": Q.Q8_0})

    assert ov_peer_worker.requantize_gguf(src, out) == 1
    before, after = gguf.GGUFReader(src), gguf.GGUFReader(out)
    assert [(t.name, t.tensor_type.name, list(t.shape)) for t in after.tensors] == [
        ("token_embd.weight", "Q8_0", [64, 16]),
        ("blk.0.attn_norm.weight", "F32", [64]),
        ("output.weight", "Q8_0", [64, 16]),
    ]
    keys = [k for k in before.fields if not k.startswith("GGUF.")]
    assert keys == [k for k in after.fields if not k.startswith("GGUF.")]
    assert all(before.fields[k].contents() == after.fields[k].contents() for k in keys)
    for kept in (1, 2):  # copied byte for byte
        assert np.array_equal(before.tensors[kept].data, after.tensors[kept].data)
    q5 = quants.dequantize(before.tensors[0].data, Q.Q5_0)
    q8 = quants.dequantize(after.tensors[0].data, Q.Q8_0)
    # Q8_0: blocks of 32 values, scale max|x| / 127 (stored as float16): within a step of Q5_0's values
    q5_blocks, q8_blocks = q5.reshape(16, 2, 32), q8.reshape(16, 2, 32)
    step = np.abs(q5_blocks).max(axis=-1, keepdims=True) / 127
    assert np.all(np.abs(q8_blocks - q5_blocks) <= step) and not np.array_equal(q8, q5)


def test_draft_for_openvino_is_made_once_and_never_left_half_made(tmp_path):
    src = tmp_path / "draft.gguf"
    write_gguf(
        src,
        {"token_embd.weight": np.ones((4, 32), np.float32)},
        {"token_embd.weight": GGMLQuantizationType.Q5_0},
    )
    exported = []

    def broken_export(gguf_path):
        exported.append(gguf_path)
        raise RuntimeError("no model")

    with pytest.raises(RuntimeError, match="no model"):
        ov_peer_worker.draft_for_openvino(src, export=broken_export)
    assert len(exported) == 1 and _files(tmp_path) == ["draft.gguf"]

    def export(gguf_path):  # what enable_save_ov_model does: the IR beside the GGUF it read
        exported.append(gguf_path)
        (gguf_path.parent / "openvino_model.xml").write_text("<net/>")

    folder = ov_peer_worker.draft_for_openvino(src, export=export)
    assert folder == tmp_path / "draft.openvino" == ov_peer_worker.draft_folder(src)
    assert _files(tmp_path) == ["draft.gguf", "draft.openvino"]  # no temporary left
    assert sorted(p.name for p in folder.iterdir()) == ["draft.q8_0.gguf", "openvino_model.xml"]
    assert exported[-1].name == "draft.q8_0.gguf"
    assert [t.tensor_type.name for t in gguf.GGUFReader(folder / "draft.q8_0.gguf").tensors] == ["Q8_0"]
    assert ov_peer_worker.draft_for_openvino(src, export=export) == folder and len(exported) == 2  # cached


def _files(folder):
    """The names in folder but the (empty) lock file of the export."""
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith(".lock-"))


def test_a_killed_exports_leftover_is_removed_by_the_next_export(tmp_path):
    src = tmp_path / "draft.gguf"
    write_gguf(
        src,
        {"token_embd.weight": np.ones((4, 32), np.float32)},
        {"token_embd.weight": GGMLQuantizationType.Q5_0},
    )
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    leftover = tmp_path / f".tmp-draft.openvino-{int(dead.stdout)}-abc"
    leftover.mkdir()
    (leftover / "draft.q8_0.gguf").write_bytes(b"half")

    def export(gguf_path):
        (gguf_path.parent / "openvino_model.xml").write_text("<net/>")

    ov_peer_worker.draft_for_openvino(src, export=export)
    assert _files(tmp_path) == ["draft.gguf", "draft.openvino"]


def stub_interpreter(tmp_path, modules):
    """An executable that runs this interpreter with empty stand-ins for `modules` importable."""
    stubs = tmp_path / "stubs"
    for name in modules:
        (stubs / name).mkdir(parents=True)
        (stubs / name / "__init__.py").write_text("")
    script = tmp_path / "python"
    script.write_text(f'#!/bin/sh\nPYTHONPATH={stubs} exec {sys.executable} "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return os.fspath(script)


def test_a_missing_peer_library_is_skipped_with_one_line_and_the_other_runs(tmp_path, capsys):
    config = bench_peer.get_config(quick=False)
    config.peers = ("hf", "ov")
    no_openvino = stub_interpreter(tmp_path / "hf", ["torch", "transformers", "accelerate", "gguf"])
    assert [p.key for p in bench_peer.available_peers(no_openvino, config)] == ["hf"]
    (line,) = capsys.readouterr().out.splitlines()
    assert "OpenVINO GenAI skipped" in line and "pip install openvino-genai==2026.4.1.0" in line

    no_torch = stub_interpreter(tmp_path / "ov", ["openvino_genai", "gguf", "numpy"])
    assert [p.key for p in bench_peer.available_peers(no_torch, config)] == ["ov"]
    (line,) = capsys.readouterr().out.splitlines()
    assert "HF transformers skipped" in line and "pip install torch==2.13.0" in line


def test_a_text_peer_answers_text_with_its_token_count_and_timings():
    requests = [
        json.dumps(
            {"op": "generate", "prompt": [5, 6], "text": "ab", "max_new_tokens": 3, "speculative": True}
        ),
        json.dumps({"op": "generate", "prompt": [5], "max_new_tokens": 2, "speculative": False}),
    ]
    out = io.StringIO()
    peer_protocol.serve(llama_peer_worker.FakeTextBackend(), out, [line + "\n" for line in requests])
    first, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert first["text"] == "hij" and first["num_tokens"] == 3 and "tokens" not in first  # 7, 8, 9 as letters
    assert first["num_drafted"] == 3 and first["decode_seconds"] > 0
    assert "no text" in second["error"]  # llama.cpp's programs take text


def test_llama_completion_output_parsed_into_text_tokens_and_phase_timings():
    stdout = (FIXTURES / "completion.stdout").read_bytes()
    stderr = (FIXTURES / "completion.stderr").read_text()
    result = llama_peer_worker.parse_completion(stdout, stderr)
    assert result == {
        "text": " if len(arr) <= 1:\n",  # -n 8; the program ends its output with two newlines
        "num_tokens": 8,  # 7 eval runs: the last token is sampled, never evaluated
        "seconds": pytest.approx(0.42199),
        "prefill_seconds": pytest.approx(0.14943),
        "decode_seconds": pytest.approx(0.26926),
        "decode_tokens": 7,
        "prompt_ids": [750, 3974, 6860, 10939, 982, 257],  # a piece with a newline spans two lines
    }
    with pytest.raises(ValueError, match="no total time"):
        llama_peer_worker.parse_completion(stdout, stderr.replace("total time", "sum"))


def test_llama_speculative_output_parsed_without_the_echoed_prompt():
    stdout = (FIXTURES / "speculative.stdout").read_bytes()
    stderr = (FIXTURES / "speculative.stderr").read_text()
    prompt = "def quicksort(arr):\n    "
    result = llama_peer_worker.parse_speculative(stdout, stderr, prompt)
    assert result == {
        # -n 7 made 11 tokens: the last round drafts without the length cap (n_max 3, all accepted)
        "text": " if len(arr) <= 1:\n         return arr",
        "num_tokens": 11,
        "seconds": pytest.approx(0.322 + 1.033),
        "prefill_seconds": pytest.approx(0.322),
        "decode_seconds": pytest.approx(1.033),
        "decode_tokens": 11,
        "num_drafted": 8,
        "num_accepted": 8,
    }
    with pytest.raises(ValueError, match="not the prompt"):
        llama_peer_worker.parse_speculative(stdout, stderr, "def mergesort")
    with pytest.raises(ValueError, match="no decoded"):
        llama_peer_worker.parse_speculative(stdout, stderr.replace("decoded", "made"), prompt)


def byte_decode(ids):
    return bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("abc", None),
        ("abcdef", None),  # a text peer may make a few tokens more
        ("abx", 2),
        ("", 0),
        ("ab", 2),  # shorter
    ],
)
def test_text_compared_with_our_tokens_token_by_token(text, expected):
    assert bench_peer.first_text_difference(text, list(b"abc"), byte_decode) == expected


def test_text_comparison_waits_for_a_character_split_over_tokens():
    tokens = list("aé!".encode())  # é is two bytes: two tokens here
    assert bench_peer.first_text_difference("aé!", tokens, byte_decode) is None
    assert bench_peer.first_text_difference("aé?", tokens, byte_decode) == 3
    assert bench_peer.first_text_difference("aè!", tokens, byte_decode) == 2  # è shares é's first byte
    assert bench_peer.first_text_difference("aé", tokens[:2], byte_decode) is None  # ends inside é


def tools_path(tmp_path, tools):
    """A PATH holding only stand-ins for `tools` (each does nothing)."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for tool in tools:
        (folder / tool).write_text("#!/bin/sh\nexit 0\n")
        (folder / tool).chmod(0o755)
    return str(folder)


@pytest.mark.parametrize(
    "tools, cxx, message",
    [
        ((), None, "cmake and a C/C++ compiler not found on the PATH (apt-get install cmake g++)"),
        (
            ("cmake", "cc"),
            "no-such-c++",
            ": a C/C++ compiler not found on the PATH (apt-get install cmake g++)",
        ),
    ],
)
def test_llama_cpp_without_cmake_or_compiler_is_skipped_with_one_line(
    tmp_path, monkeypatch, capsys, tools, cxx, message
):
    monkeypatch.setenv("SPEC_JAX_CACHE", str(tmp_path / "cache"))  # nothing built there
    monkeypatch.setenv("PATH", tools_path(tmp_path, tools))
    if cxx:
        monkeypatch.setenv("CXX", cxx)
    config = bench_peer.get_config(quick=False)
    config.peers = ("llama",)
    assert bench_peer.available_peers("/nonexistent/python", config) == []
    (line,) = capsys.readouterr().out.splitlines()
    assert (
        line.startswith("peer suite: llama.cpp skipped: llama.cpp cannot be built here: ") and message in line
    )
    assert not (tmp_path / "cache").exists() or not any(
        (tmp_path / "cache").rglob("*.tar.gz")
    )  # nothing fetched


@pytest.mark.slow
@pytest.mark.skipif(
    not llama_cpp.built(bench_peer.LLAMA_PROGRAMS),
    reason="llama.cpp's programs are not built (a few minutes)",
)
def test_llama_worker_runs_the_real_programs_greedy_on_the_qwen_pair():
    from models import registry
    from models.tokenizer import Tokenizer

    paths = [str(registry.fetch_gguf(name)) for name in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")]
    tokenizer = Tokenizer.from_gguf(paths[0])
    backend = llama_peer_worker.LlamaCppBackend(
        str(llama_cpp.build_dir() / "bin"), *paths, threads=os.cpu_count()
    )
    assert backend.info()["models"]["target"]["file_type"]
    text = "def quicksort(arr):\n    "
    ids = tokenizer.encode(text)  # llama-completion checks that it tokenizes the text the same
    plain = backend.generate(peer_protocol.Request(ids, 6, False, text=text))
    spec = backend.generate(peer_protocol.Request(ids, 6, True, text=text, draft_max=2))
    assert plain["num_tokens"] == 6 and 6 <= spec["num_tokens"] <= 8
    assert spec["text"].startswith(plain["text"])  # greedy: speculative repeats plain decoding
    assert (
        bench_peer.first_text_difference(plain["text"], tokenizer.encode(plain["text"]), tokenizer.decode)
        is None
    )
    with pytest.raises(ValueError, match="tokenized the prompt"):
        backend.generate(peer_protocol.Request(ids[:-1], 2, False, text=text))
