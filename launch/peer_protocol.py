"""The JSON-lines protocol every peer worker of `launch.bench --suite=peer` speaks.

A peer worker (launch/hf_peer_worker.py, launch/ov_peer_worker.py) runs in the reference
interpreter (`.venv-ref`, no jax), loads its library's copy of the target and draft once, and
then serves generate requests, so that model loading is never timed and the systems' runs can
alternate. It is started by experiments/bench_peer.py as

    .venv-ref/bin/python -m launch.hf_peer_worker --target=T.gguf --draft=D.gguf --threads=2
    .venv-ref/bin/python -m launch.ov_peer_worker --fake   # no library: the protocol alone

Protocol (one JSON object per line; stdout carries nothing else, logs go to stderr):
  worker -> {"ready": true, "load_seconds": s, "versions": {...}, "threads": N, "precision": "...",
             ...}                                 (precision: what the bench's table shows)
  bench  -> {"op": "generate", "prompt": [ids], "max_new_tokens": N, "speculative": bool}
  worker -> {"tokens": [new ids], "seconds": s, "peak_rss_mb": m}   (s: the generate call alone)
  bench  -> {"op": "quit"}                        (or EOF): the worker exits 0
A failed request is answered with {"error": "..."} and the worker keeps serving; a failed
load is answered with {"error": "..."} in place of "ready", and the worker exits 1.

Every backend is greedy and never stops early (EOS ignored), so each request generates
exactly max_new_tokens tokens, as the JAX side does with eos_id=None. `--fake` answers with
deterministic tokens (prompt[-1] + 1 + i) % 256 and imports no model library: the bench's
quick mode uses it to keep the protocol tested where neither torch nor openvino exists.

This module imports only the standard library (it runs in either interpreter).
"""

import argparse
import json
import os
import resource
import sys
import time
from collections.abc import Callable


class FakeBackend:
    """Deterministic tokens, no model: proves the protocol without any model library."""

    def info(self) -> dict:
        return {
            "versions": {"python": sys.version.split()[0], "backend": "fake"},
            "threads": 1,
            "precision": "fake",
        }

    def generate(self, prompt: list[int], max_new_tokens: int, speculative: bool) -> list[int]:
        return [(prompt[-1] + 1 + i) % 256 for i in range(max_new_tokens)]


def serve(backend, out, requests=None) -> None:
    """Answers generate requests from `requests` (default stdin) on `out` until quit or EOF.

    backend: info() -> dict, generate(prompt ids, max_new_tokens, speculative) -> new ids.
    """

    def reply(obj):
        out.write(json.dumps(obj) + "\n")
        out.flush()

    for line in requests if requests is not None else sys.stdin:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            if request.get("op") == "quit":
                return
            if request.get("op") != "generate":
                raise ValueError(f"unknown op {request.get('op')!r}")
            prompt = [int(t) for t in request["prompt"]]
            n, speculative = int(request["max_new_tokens"]), bool(request["speculative"])
            start = time.perf_counter()
            tokens = backend.generate(prompt, n, speculative)
            seconds = time.perf_counter() - start
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            reply({"tokens": [int(t) for t in tokens], "seconds": seconds, "peak_rss_mb": rss})
        except Exception as e:  # reported to the bench, which decides
            reply({"error": f"{type(e).__name__}: {e}"})


def main(doc: str, make_backend: Callable, add_arguments: Callable | None = None) -> int:
    """A worker's entry point: parses the common flags (--target, --draft, --threads, --fake)
    and the worker's own (`add_arguments(parser)`), loads `make_backend(args)` (or the fake
    backend), says ready, then serves. Returns the exit code."""
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
            backend = FakeBackend()
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
