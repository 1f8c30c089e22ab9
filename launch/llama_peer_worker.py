"""The llama.cpp side of `launch.bench --suite=peer`: its own programs, one process per request,
behind the same JSON-lines protocol as the other peers.

Imports only the standard library, so experiments/bench_peer.py runs it in the project's own
interpreter (no .venv-ref needed); the programs come from models.kernels.llama_cpp.build (the
vendored llama.cpp of the registry's llama-cpp-python sdist, built once with cmake for this
CPU), and the bench passes their folder:

    python -m launch.llama_peer_worker --target=T.gguf --draft=D.gguf --threads=2 \\
        --bin_dir=$SPEC_JAX_CACHE/llama.cpp/build-.../bin

A plain request runs `llama-completion` and a speculative one `llama-speculative-simple
--spec-type draft-simple --spec-draft-n-max K` (K: the request's draft_max, else --draft_max),
on the same GGUF files the project loads: raw completion of the prompt's text (no chat template:
`-no-cnv`; `--no-escape`, so a backslash in the prompt stays one), greedy (`--temp 0 --top-k 1`),
batch 1, `--ignore-eos` (llama.cpp biases the end tokens to -inf, so it never stops early),
`-t`/`-tb` threads, and llama.cpp's own warm-up run before its timer starts. The time of a
request is what the program measures itself (`--perf`), not the process: llama-completion's
`total time` (prompt eval + eval + sampling, from after loading), llama-speculative-simple's
`encoded` + `decoded` seconds. Both phases are reported: prefill (llama-completion's prompt
eval of the whole prompt; llama-speculative-simple's encode of the prompt but its last token,
on both models) and decode (the rest).

Neither program prints the ids it generates, so the reply carries the new text (stdout) and the
token count the program reports; the bench compares text. llama-completion prints the prompt's
ids (`--verbose-prompt`), and a request whose text llama.cpp tokenizes to other ids than the
bench's is an error. llama-completion makes exactly `-n` tokens; llama-speculative-simple
makes at least `-n` + 1 and up to K more (its last round drafts without the length cap), so
it is asked for max_new_tokens - 1 and its reply says how many it made.
"""

import os
import pathlib
import re
import resource
import subprocess
import sys
import time

from launch import peer_protocol

PLAIN, SPECULATIVE = "llama-completion", "llama-speculative-simple"
CTX_SIZE = 4096  # KV-cache slots: prompt + new tokens + a draft must fit
TIMEOUT_S = 1800  # one request (loading the models included)
COMMON_FLAGS = (
    "--temp", "0", "--top-k", "1", "--ignore-eos", "--no-escape", "--perf", "--seed", "0",
    "--no-log-prefix", "--no-log-timestamps", "--log-colors", "off", "-c", str(CTX_SIZE),
)  # fmt: skip

_MS = r"([0-9.]+)\s*ms\s*/\s*(\d+)"
_COMPLETION_TIMES = {
    "prompt_eval": re.compile(r"prompt eval time\s*=\s*" + _MS),
    "eval": re.compile(r"\beval time\s*=\s*" + _MS + r"\s*runs"),
    "total": re.compile(r"total time\s*=\s*" + _MS),
}
_SPECULATIVE_TIMES = re.compile(r"\b(encoded|decoded)\s+(\d+) tokens in\s+([0-9.]+) seconds")
_SPECULATIVE_COUNTS = re.compile(r"^\s*(n_drafted|n_accept)\s*=\s*(\d+)\s*$", re.M)
_PROMPT_COUNT = re.compile(r"number of tokens in prompt = (\d+)")
_PROMPT_TOKEN = re.compile(r"^\s*(\d+) -> '", re.M)


def _text(stdout: bytes) -> str:
    # Each token's piece is printed as its bytes; a piece may end inside a UTF-8 character.
    return stdout.decode("utf-8", errors="replace")


def parse_completion(stdout: bytes, stderr: str) -> dict:
    """The reply for one llama-completion run (-no-cnv --no-display-prompt --perf
    --verbose-prompt): the new text (stdout, less the blank lines the program ends with), the
    token count (eval runs + 1: the last token is sampled, never evaluated), the prompt's ids,
    and the timings in seconds (total: the generate call; prefill: prompt eval; decode: eval)."""
    found = {}
    for key, pattern in _COMPLETION_TIMES.items():
        match = pattern.search(stderr)
        if match is None:
            raise ValueError(f"{PLAIN} printed no {key.replace('_', ' ')} time (was --perf passed?)")
        found[key] = (float(match[1]) / 1e3, int(match[2]))
    count = _PROMPT_COUNT.search(stderr)
    if count is None:
        raise ValueError(f"{PLAIN} printed no prompt tokens (was --verbose-prompt passed?)")
    prompt_ids = [int(t) for t in _PROMPT_TOKEN.findall(stderr, count.end())[: int(count[1])]]
    return {
        "text": _text(stdout).removesuffix("\n\n"),
        "num_tokens": found["eval"][1] + 1,
        "seconds": found["total"][0],
        "prefill_seconds": found["prompt_eval"][0],
        "decode_seconds": found["eval"][0],
        "decode_tokens": found["eval"][1],
        "prompt_ids": prompt_ids,
    }


def parse_speculative(stdout: bytes, stderr: str, prompt_text: str) -> dict:
    """The reply for one llama-speculative-simple run: the new text (stdout is two newlines, the
    prompt's pieces, the new pieces, then two newlines twice), the token count it decoded, the
    drafted and accepted counts, and the timings in seconds (its encode phase + its decode phase)."""
    phases = {name: (int(n), float(s)) for name, n, s in _SPECULATIVE_TIMES.findall(stderr)}
    counts = {name: int(n) for name, n in _SPECULATIVE_COUNTS.findall(stderr)}
    missing = [k for k in ("encoded", "decoded", "n_drafted", "n_accept") if k not in phases | counts]
    if missing:
        raise ValueError(f"{SPECULATIVE} printed no {', '.join(missing)} (did it finish?)")
    text = _text(stdout).removeprefix("\n\n").removesuffix("\n\n\n\n")
    if not text.startswith(prompt_text):
        raise ValueError(f"{SPECULATIVE} echoed {text[: len(prompt_text)]!r}, not the prompt {prompt_text!r}")
    (_, encode_s), (decoded, decode_s) = phases["encoded"], phases["decoded"]
    return {
        "text": text[len(prompt_text) :],
        "num_tokens": decoded,
        "seconds": encode_s + decode_s,
        "prefill_seconds": encode_s,
        "decode_seconds": decode_s,
        "decode_tokens": decoded,
        "num_drafted": counts["n_drafted"],
        "num_accepted": counts["n_accept"],
    }


def _load_info(stderr: str) -> dict:
    """What llama.cpp says (at -v) about a model it loaded: file type, flash attention, KV type."""
    info = {}
    for key, pattern in (
        ("file_type", r"print_info: file type\s*=\s*(.+)"),
        ("flash_attention", r"Flash Attention (enabled|disabled)"),
        ("kv_cache", r"llama_kv_cache: size = .*K \((\w+)\).*V \((\w+)\)"),
        ("cpu", r"system_info: (.*)"),
    ):
        match = re.search(pattern, stderr)
        if match:
            info[key] = "/".join(sorted(set(match.groups()))) if key == "kv_cache" else match[1].strip()
    return info


class LlamaCppBackend:
    """llama.cpp's programs on the two GGUF files, one process per request."""

    def __init__(self, bin_dir: str, target_gguf: str, draft_gguf: str, threads: int, draft_max: int = 3):
        self.bin = pathlib.Path(bin_dir)
        for program in (PLAIN, SPECULATIVE):
            if not os.access(self.bin / program, os.X_OK):
                raise FileNotFoundError(
                    f"{self.bin / program}: no such program (build it: models.kernels.llama_cpp)"
                )
        self.target, self.draft, self.threads, self.draft_max = target_gguf, draft_gguf, threads, draft_max
        version = subprocess.run([self.bin / PLAIN, "--version"], capture_output=True, text=True, timeout=60)
        self.version = " ".join((version.stdout + version.stderr).split())
        # One token from each model at -v: says how llama.cpp loads them, and warms the page cache.
        self.models = {}
        for name, path in (("target", target_gguf), ("draft", draft_gguf)):
            _, stderr = self._run([PLAIN, "-m", path, "-p", "x", "-n", "1", "-no-cnv", "-v", "--simple-io"])
            self.models[name] = _load_info(stderr)

    def _run(self, args) -> tuple[bytes, str]:
        cmd = [str(self.bin / args[0]), *map(str, args[1:]), *COMMON_FLAGS, "-t", str(self.threads)]
        cmd += ["-tb", str(self.threads)]
        proc = subprocess.run(cmd, capture_output=True, stdin=subprocess.DEVNULL, timeout=TIMEOUT_S)
        stderr = proc.stderr.decode("utf-8", errors="replace")
        if proc.returncode:
            tail = " | ".join(stderr.strip().splitlines()[-3:])
            raise RuntimeError(f"{args[0]} exited with code {proc.returncode}: {tail}")
        return proc.stdout, stderr

    def info(self) -> dict:
        target = self.models["target"]
        return {
            "versions": {"python": sys.version.split()[0], "llama.cpp": self.version},
            "threads": self.threads,
            "precision": f"GGUF weights ({target.get('file_type', '?')}), ggml CPU",
            "models": self.models,
            "context": CTX_SIZE,
            "draft": {"type": "draft-simple", "n_max": "per system", "n_min": 0, "p_min": 0.0},
        }

    def generate(self, request: peer_protocol.Request) -> dict:
        if request.text is None:
            raise ValueError("llama.cpp takes the prompt as text: the request has no text")
        start = time.perf_counter()
        if request.speculative:
            k = request.draft_max or self.draft_max
            stdout, stderr = self._run(
                [SPECULATIVE, "-m", self.target, "-md", self.draft, "--spec-type", "draft-simple"]
                + ["--spec-draft-n-max", k, "--spec-draft-n-min", 0, "--spec-draft-p-min", 0]
                + ["-p", request.text, "-n", request.max_new_tokens - 1, "--color", "off"]
            )
            result = parse_speculative(stdout, stderr, request.text)
        else:
            stdout, stderr = self._run(
                [PLAIN, "-m", self.target, "-p", request.text, "-n", request.max_new_tokens]
                + ["-no-cnv", "--no-display-prompt", "--verbose-prompt", "--simple-io"]
            )
            result = parse_completion(stdout, stderr)
            prompt_ids = result.pop("prompt_ids")
            if prompt_ids != request.prompt:
                raise ValueError(
                    f"llama.cpp tokenized the prompt as {prompt_ids}, the bench as {request.prompt}"
                )
        if result["num_tokens"] < request.max_new_tokens:
            raise ValueError(
                f"llama.cpp made {result['num_tokens']} tokens, asked for {request.max_new_tokens}"
            )
        result["process_seconds"] = time.perf_counter() - start  # with loading and llama.cpp's warm-up
        result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        return result


class FakeTextBackend(peer_protocol.FakeBackend):
    """The fake backend's tokens as text (one letter each), as llama.cpp answers: no programs."""

    def generate(self, request: peer_protocol.Request) -> dict:
        if request.text is None:
            raise ValueError("llama.cpp takes the prompt as text: the request has no text")
        n = request.max_new_tokens
        letters = "".join(chr(ord("a") + t % 26) for t in super().generate(request)["tokens"])
        reply = {"text": letters, "num_tokens": n, "prefill_seconds": 1e-3, "decode_seconds": 1e-3 * n}
        if request.speculative:
            reply.update(num_drafted=n, num_accepted=n // 2)
        return {**reply, "decode_tokens": n - 1}


def add_arguments(parser) -> None:
    parser.add_argument("--bin_dir", help="the folder of llama-completion and llama-speculative-simple")
    parser.add_argument(
        "--draft_max", type=int, default=3, help="drafts per round where a request names none"
    )


def make_backend(args) -> LlamaCppBackend:
    if not args.bin_dir:
        raise ValueError("--bin_dir is required without --fake")
    return LlamaCppBackend(args.bin_dir, args.target, args.draft, args.threads, args.draft_max)


if __name__ == "__main__":
    sys.exit(peer_protocol.main(__doc__, make_backend, add_arguments, fake_backend=FakeTextBackend))
