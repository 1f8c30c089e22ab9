"""The JSON-lines protocol every peer worker of `launch.bench --suite=peer` speaks.

A peer worker (launch/hf_peer_worker.py, launch/ov_peer_worker.py, launch/llama_peer_worker.py)
loads its library's copy of the target and draft once (or, for llama.cpp's programs, checks
them), and then serves generate requests, so that model loading is never timed and the
systems' runs can alternate. It is started by experiments/bench_peer.py as

    .venv-ref/bin/python -m launch.hf_peer_worker --target=T.gguf --draft=D.gguf --threads=2
    .venv-ref/bin/python -m launch.ov_peer_worker --fake   # no library: the protocol alone

Protocol (one JSON object per line; stdout carries nothing else, logs go to stderr):
  worker -> {"ready": true, "load_seconds": s, "versions": {...}, "threads": N, "precision": "...",
             ...}                                 (precision: what the bench's table shows)
  bench  -> {"op": "generate", "prompt": [ids], "text": "...", "max_new_tokens": N,
             "speculative": bool, "draft_max": K or null}
            (text: the same prompt as text, for programs that tokenize it themselves; draft_max:
            drafts per round for this request, null: the worker's own setting)
  worker -> {"tokens": [new ids], "num_tokens": n, "seconds": s, "peak_rss_mb": m, ...}
            (s: the generate call alone; a worker that cannot give token ids sends "text", the
            new text, instead of "tokens"; optional: "prefill_seconds", "decode_seconds",
            "decode_tokens" (the tokens the decode phase made), "num_drafted", "num_accepted")
  bench  -> {"op": "quit"}                        (or EOF): the worker exits 0
A failed request is answered with {"error": "..."} and the worker keeps serving; a failed
load is answered with {"error": "..."} in place of "ready", and the worker exits 1.

Every backend is greedy and never stops early (EOS ignored), so each request generates
max_new_tokens tokens (llama.cpp's speculative program can overshoot by up to draft_max; it
reports how many it made), as the JAX side does with eos_id=None. `--fake` answers with
deterministic tokens (prompt[-1] + 1 + i) % 256 and imports no model library: the bench's
quick mode uses it to keep the protocol tested where neither torch nor openvino exists.

This module imports only the standard library (it runs in either interpreter).
"""

import argparse
import dataclasses
import json
import os
import resource
import sys
import time
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Request:
    """One generate request: the prompt as token ids (and as text), greedy, batch 1."""

    prompt: list[int]
    max_new_tokens: int
    speculative: bool
    text: str | None = None  # the prompt's text; None when the bench did not send it
    draft_max: int | None = None  # drafts per round; None: the worker's own setting

    @classmethod
    def from_json(cls, message: dict) -> "Request":
        draft_max = message.get("draft_max")
        return cls(
            prompt=[int(t) for t in message["prompt"]],
            max_new_tokens=int(message["max_new_tokens"]),
            speculative=bool(message["speculative"]),
            text=message.get("text"),
            draft_max=None if draft_max is None else int(draft_max),
        )


class FakeBackend:
    """Deterministic tokens, no model: proves the protocol without any model library."""

    def info(self) -> dict:
        return {
            "versions": {"python": sys.version.split()[0], "backend": "fake"},
            "threads": 1,
            "precision": "fake",
        }

    def generate(self, request: Request) -> dict:
        return {"tokens": [(request.prompt[-1] + 1 + i) % 256 for i in range(request.max_new_tokens)]}


def serve(backend, out, requests=None) -> None:
    """Answers generate requests from `requests` (default stdin) on `out` until quit or EOF.

    backend: info() -> dict, generate(Request) -> dict with "tokens" (new ids) or "text" (the
    new text, with "num_tokens"), and optionally its own "seconds" (the generate call as the
    library timed it; default: this function's wall clock around generate), "peak_rss_mb"
    (default: this process's), and the reply's optional keys (module docstring).
    """

    def reply(obj):
        out.write(json.dumps(obj) + "\n")
        out.flush()

    for line in requests if requests is not None else sys.stdin:
        if not line.strip():
            continue
        try:
            message = json.loads(line)
            if message.get("op") == "quit":
                return
            if message.get("op") != "generate":
                raise ValueError(f"unknown op {message.get('op')!r}")
            request = Request.from_json(message)
            start = time.perf_counter()
            result = dict(backend.generate(request))
            seconds = time.perf_counter() - start
            if "tokens" in result:
                result["tokens"] = [int(t) for t in result["tokens"]]
                result.setdefault("num_tokens", len(result["tokens"]))
            elif "text" not in result or "num_tokens" not in result:
                raise ValueError("the backend answered neither tokens nor text with num_tokens")
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            reply({"seconds": seconds, "peak_rss_mb": rss, **result})
        except Exception as e:  # reported to the bench, which decides
            reply({"error": f"{type(e).__name__}: {e}"})


def main(
    doc: str, make_backend: Callable, add_arguments: Callable | None = None, fake_backend=FakeBackend
) -> int:
    """A worker's entry point: parses the common flags (--target, --draft, --threads, --fake)
    and the worker's own (`add_arguments(parser)`), loads `make_backend(args)` (or
    `fake_backend()`), says ready, then serves. Returns the exit code."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--target", help="target GGUF file")
    parser.add_argument("--draft", help="draft GGUF file")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--fake", action="store_true", help="no model, no library: the protocol alone")
    if add_arguments:
        add_arguments(parser)
    args = parser.parse_args()
    # The protocol owns the real stdout; anything a library prints goes to stderr, from Python
    # and from native code alike (OpenVINO's C++ logs to file descriptor 1).
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    sys.stdout = sys.stderr
    start = time.perf_counter()
    try:
        if args.fake:
            backend = fake_backend()
        else:
            if not (args.target and args.draft):
                raise ValueError("--target and --draft are required without --fake")
            backend = make_backend(args)
        info = backend.info()
    except Exception as e:
        out.write(json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")
        out.flush()
        return 1
    out.write(json.dumps({"ready": True, "load_seconds": time.perf_counter() - start, **info}) + "\n")
    out.flush()
    serve(backend, out)
    return 0
