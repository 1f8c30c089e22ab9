"""Benchmark: this project against HF transformers on the same pair, prompts and machine,
greedy, the systems alternating.

HF runs in `peer_python` (a worker process, launch/hf_peer_worker.py, that loads both models
once); repeat r runs prompt r (cycling) through all four systems, the starting system rotating.
Each system's time is the wall time of its generate call alone (HF: measured inside the
worker). Needs a `.venv-ref` with torch and transformers; without one the suite prints one
line saying how to install it and writes nothing.
"""

import json
import os
import subprocess
import time

import ml_collections

from experiments import bench_decode, common, framework
from spec_jax import timing

TITLE = "Benchmark peer: spec-jax against HF transformers (plain and assisted), side by side"

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "launch", "hf_peer_worker.py")
PEER_INSTALL = (
    "python3 -m venv .venv-ref && .venv-ref/bin/pip install torch==2.13.0 transformers accelerate gguf numpy"
)


MODEL_KEYS = bench_decode.MODEL_KEYS
INT_RANGES = bench_decode.INT_RANGES


def get_config(quick: bool = False) -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.target = "tiny" if quick else "qwen2.5-coder-1.5b"
    config.draft = "tiny-draft" if quick else "qwen2.5-coder-0.5b"
    config.gamma = 2 if quick else 4
    config.num_prompts = 2 if quick else len(common.BENCH_PROMPTS)
    config.repeats = 2 if quick else 6
    config.max_new_tokens = 8 if quick else 32
    config.peer_python = ".venv-ref/bin/python"
    # quick: the worker's --fake backend (deterministic tokens, no torch) over the real protocol
    config.fake_peer = quick
    return config


def resolve_python(path: str) -> str:
    if os.path.isabs(path) or os.path.exists(path):
        return path
    return os.path.join(ROOT, path)


def peer_unavailable(python: str, config) -> str | None:
    """Why the peer suite cannot run with this interpreter, or None when it can."""
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        return f"peer_python={config.peer_python}: no such interpreter"
    if config.fake_peer:  # the fake worker needs nothing but the standard library
        return None
    probe = subprocess.run(
        [python, "-c", "import torch, transformers, accelerate, gguf"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if probe.returncode:
        missing = (probe.stderr.strip().splitlines() or ["import failed"])[-1]
        return f"{python} cannot import torch/transformers/accelerate/gguf ({missing})"
    return None


class PeerWorker:
    """launch/hf_peer_worker.py in the reference interpreter, spoken to in JSON lines."""

    def __init__(self, python: str, args: list[str]):
        env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen(
            [python, WORKER, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )
        self.info = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the peer worker exited (code {self.proc.wait()}); see its stderr above")
        message = json.loads(line)
        if "error" in message:
            raise RuntimeError(f"peer worker: {message['error']}")
        return message

    def generate(self, prompt, max_new_tokens: int, assisted: bool) -> dict:
        request = {"op": "generate", "prompt": prompt, "max_new_tokens": max_new_tokens, "assisted": assisted}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def first_difference(a: list, b: list) -> int | None:
    """Index of the first differing token (or the shorter length), None when equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def run(config) -> framework.Result | None:
    python = resolve_python(config.peer_python)
    reason = peer_unavailable(python, config)
    if reason:
        print(f"peer suite skipped: {reason}. Install the reference stack with: {PEER_INSTALL}")
        return None
    threads = os.cpu_count()
    if config.fake_peer:
        worker_args = ["--fake"]
    else:
        from models import registry

        paths = [str(registry.fetch_gguf(name)) for name in (config.target, config.draft)]
        worker_args = [f"--target={paths[0]}", f"--draft={paths[1]}", f"--threads={threads}"]
    print(
        f"peer: loading HF transformers in {python} (torch threads = {threads} = CPU cores) ...", flush=True
    )
    worker = PeerWorker(python, worker_args)  # loads before ours: the two loads' peaks never overlap
    try:
        target, draft = common.load_model(config.target), common.load_model(config.draft)
        prompts = bench_decode.bench_prompts(target.tokenizer, config.num_prompts)
        n, gamma = config.max_new_tokens, config.gamma

        def ours(prompt, draft_model):  # the wall time of the whole generate call
            start = time.perf_counter()
            gen = bench_decode.run_generate(target, [prompt], draft_model, gamma, 0.0, n)
            seconds = time.perf_counter() - start
            return {
                "tokens": gen.tokens[0],
                "seconds": seconds,
                "compile_seconds": gen.stats["first_compile_seconds"],
            }

        systems = {
            "HF transformers, plain": lambda p: worker.generate(p, n, False),
            "HF transformers, assisted": lambda p: worker.generate(p, n, True),
            "spec-jax, autoregressive": lambda p: ours(p, None),
            f"spec-jax, speculative gamma {gamma}": lambda p: ours(p, draft),
        }
        repeat_prompts = [prompts[r % len(prompts)] for r in range(config.repeats)]
        warmup = [b[0] for b in bench_decode.warmup_batches([[p] for p in repeat_prompts])]
        runs = timing.interleaved(systems, repeat_prompts, warmup)
    finally:
        worker.close()

    names = list(systems)
    hf_plain, hf_assisted, ours_ar, ours_spec = names
    rows = {}
    for name in names:
        results = runs[name]["results"]
        row = {
            "system": name,
            **bench_decode.throughput([r["seconds"] for r in results], [len(r["tokens"]) for r in results]),
        }
        if name.startswith("spec-jax"):
            row["compile_s"] = sum(r["compile_seconds"] for r in runs[name]["warmup"])
        rows[name] = row
    for baseline, other in ((hf_plain, hf_assisted), (ours_ar, ours_spec)):
        rows[baseline]["speedup_over_own_baseline"] = 1.0
        rows[other]["speedup_over_own_baseline"] = (
            rows[other]["tokens_per_s"] / rows[baseline]["tokens_per_s"]
        )
    best_hf = max((hf_plain, hf_assisted), key=lambda k: rows[k]["tokens_per_s"])
    for name in (ours_ar, ours_spec):
        rows[name]["ratio_to_best_hf"] = rows[name]["tokens_per_s"] / rows[best_hf]["tokens_per_s"]
        paired = timing.spread(
            (len(a["tokens"]) / a["seconds"]) / (len(b["tokens"]) / b["seconds"])
            for a, b in zip(runs[name]["results"], runs[best_hf]["results"], strict=True)
        )
        rows[name].update(
            ratio_per_repeat=paired["median"],
            ratio_per_repeat_min=paired["min"],
            ratio_per_repeat_max=paired["max"],
        )
    rows[best_hf]["ratio_to_best_hf"] = 1.0

    agreement, seen = [], set()
    for r, prompt in enumerate(repeat_prompts):
        if tuple(prompt) in seen:
            continue
        seen.add(tuple(prompt))
        out = {name: runs[name]["results"][r]["tokens"] for name in names}
        diff = first_difference(out[ours_spec], out[hf_plain])
        agreement.append(
            {
                "prompt": common.BENCH_PROMPTS[prompts.index(prompt)],
                "ours_spec_equals_hf_plain": diff is None,
                "first_difference_at": "" if diff is None else diff,
                "ours_ar_equals_ours_spec": out[ours_ar] == out[ours_spec],
                "hf_plain_equals_hf_assisted": out[hf_plain] == out[hf_assisted],
                "ours_ar_equals_hf_plain": out[ours_ar] == out[hf_plain],
            }
        )
    agree = sum(a["ours_spec_equals_hf_plain"] for a in agreement)
    summary_row = {
        "system": "summary",
        "ours_spec_over_best_hf": rows[ours_spec]["ratio_to_best_hf"],
        "best_hf": best_hf,
        "greedy_outputs_agree": f"{agree}/{len(agreement)} prompts",
    }
    hf_rss = max(r.get("peak_rss_mb", 0) for name in (hf_plain, hf_assisted) for r in runs[name]["results"])
    return framework.Result.from_dicts(
        [*rows.values(), summary_row],
        sections={"greedy agreement per prompt": agreement},
        summary={
            "peer_worker": {k: v for k, v in worker.info.items() if k != "ready"},
            "peer_worker_peak_rss_mb": round(hf_rss),
            "torch_threads": f"{threads} (torch.set_num_threads = os.cpu_count(); XLA:CPU uses every core too)",
        },
    )
