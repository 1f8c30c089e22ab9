"""The HF transformers side of `launch.bench --suite=peer`: loads once, then serves JSON lines.

Runs in the reference interpreter (`.venv-ref`: torch, transformers, accelerate, gguf; no
jax), started by launch/bench.py as a subprocess, so that model loading is never timed and
the two systems' runs can alternate:

    .venv-ref/bin/python launch/hf_peer_worker.py --target=T.gguf --draft=D.gguf --threads=2
    .venv-ref/bin/python launch/hf_peer_worker.py --fake      # no torch: the protocol alone

Protocol (one JSON object per line; stdout carries nothing else, logs go to stderr):
  worker -> {"ready": true, "load_seconds": s, "versions": {...}, "threads": N, "assistant": {...}}
  bench  -> {"op": "generate", "prompt": [ids], "max_new_tokens": N, "assisted": bool}
  worker -> {"tokens": [new ids], "seconds": s, "peak_rss_mb": m}   (s: model.generate alone)
  bench  -> {"op": "quit"}                        (or EOF): the worker exits 0
A failed request is answered with {"error": "..."} and the worker keeps serving; a failed
load is answered with {"error": "..."} in place of "ready", and the worker exits 1.

Greedy (do_sample=False), float32, EOS disabled (generation_config.eos_token_id = None) so
that every run generates exactly max_new_tokens, as the JAX side does with eos_id=None.
Assisted generation runs with HF's own defaults for the assistant (what a user gets).
`--fake` answers with deterministic tokens (prompt[-1] + 1 + i) % 256 and never imports
torch: the bench's quick mode uses it to keep the protocol tested where no torch exists.
"""

import argparse
import json
import os
import resource
import sys
import time

ASSISTANT_KEYS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")


class FakeBackend:
    """Deterministic tokens, no model: proves the protocol without torch."""

    def info(self) -> dict:
        return {"versions": {"python": sys.version.split()[0], "backend": "fake"}, "threads": 1}

    def generate(self, prompt, max_new_tokens, assisted):
        return [(prompt[-1] + 1 + i) % 256 for i in range(max_new_tokens)]


class HFBackend:
    """AutoModelForCausalLM from the GGUF files, float32, greedy; the draft as assistant_model."""

    def __init__(self, target_gguf: str, draft_gguf: str, threads: int):
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging

        logging.disable_progress_bar()  # stderr is the bench's console
        torch.set_num_threads(threads)
        self.torch = torch

        def load(path):
            folder, name = os.path.split(os.path.abspath(path))
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
            model.generation_config.eos_token_id = None  # never stop early: exactly max_new_tokens
            model.generation_config.pad_token_id = 0
            return model.eval()

        self.target = load(target_gguf)
        self.draft = load(draft_gguf)

    def info(self) -> dict:
        import accelerate
        import transformers
        from transformers import GenerationConfig

        config = self.draft.generation_config  # HF reads the assistant settings from the assistant
        defaults = getattr(GenerationConfig, "_get_default_generation_params", dict)()  # what None means
        return {
            "versions": {
                "python": sys.version.split()[0],
                "torch": self.torch.__version__,
                "transformers": transformers.__version__,
                "accelerate": accelerate.__version__,
            },
            "threads": self.torch.get_num_threads(),
            "assistant": {
                k: v if (v := getattr(config, k, None)) is not None else defaults.get(k)
                for k in ASSISTANT_KEYS
            },
        }

    def generate(self, prompt, max_new_tokens, assisted):
        torch = self.torch
        ids = torch.tensor([prompt], dtype=torch.long)
        kwargs = dict(
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            temperature=None,
            top_k=None,
            top_p=None,
        )
        if assisted:
            kwargs["assistant_model"] = self.draft
        with torch.inference_mode():
            out = self.target.generate(ids, **kwargs)
        return out[0, len(prompt) :].tolist()


def serve(backend, out) -> None:
    def reply(obj):
        out.write(json.dumps(obj) + "\n")
        out.flush()

    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            if request.get("op") == "quit":
                return
            if request.get("op") != "generate":
                raise ValueError(f"unknown op {request.get('op')!r}")
            prompt = [int(t) for t in request["prompt"]]
            n, assisted = int(request["max_new_tokens"]), bool(request["assisted"])
            start = time.perf_counter()
            tokens = backend.generate(prompt, n, assisted)
            seconds = time.perf_counter() - start
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            reply({"tokens": tokens, "seconds": seconds, "peak_rss_mb": rss})
        except Exception as e:  # reported to the bench, which decides
            reply({"error": f"{type(e).__name__}: {e}"})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="target GGUF file")
    parser.add_argument("--draft", help="draft GGUF file")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--fake", action="store_true", help="no model, no torch: the protocol alone")
    args = parser.parse_args()
    # The protocol owns the real stdout; anything a library prints goes to stderr.
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout = sys.stderr
    start = time.perf_counter()
    try:
        if args.fake:
            backend = FakeBackend()
        else:
            if not (args.target and args.draft):
                raise ValueError("--target and --draft are required without --fake")
            backend = HFBackend(args.target, args.draft, args.threads)
        info = backend.info()
    except Exception as e:
        out.write(json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")
        out.flush()
        return 1
    out.write(json.dumps({"ready": True, "load_seconds": time.perf_counter() - start, **info}) + "\n")
    out.flush()
    serve(backend, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
