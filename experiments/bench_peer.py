"""Benchmark: this project against HF transformers and OpenVINO GenAI on the same pair, prompts
and machine, greedy, the systems alternating.

Each peer library runs in `peer_python` in a worker process of its own (launch/hf_peer_worker.py,
launch/ov_peer_worker.py; one protocol, launch/peer_protocol.py) that loads both models once;
repeat r runs prompt r (cycling) through every system (plain and speculative of each library),
the starting system rotating. Each system's time is the wall time of its generate call alone
(the peers': measured inside the worker). A peer library whose packages `peer_python` cannot
import is skipped with one line saying how to install them; with neither, or without the
interpreter, the suite prints why and writes nothing.
"""

import contextlib
import dataclasses
import json
import os
import subprocess
import time
from collections.abc import Callable

import jax
import ml_collections

from experiments import bench_decode, common, framework
from spec_jax import timing

TITLE = "Benchmark peer: spec-jax against HF transformers and OpenVINO GenAI (plain and speculative), side by side"

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEER_INSTALL = (
    "python3 -m venv .venv-ref && .venv-ref/bin/pip install torch==2.13.0 transformers accelerate gguf numpy "
    "openvino-genai==2026.4.1.0"
)
HF_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class Peer:
    """A peer library: its worker module, what the worker imports, and its two systems."""

    key: str  # its value in config.peers
    library: str
    module: str  # run as `peer_python -m module` from the repository root
    requires: tuple[str, ...]  # modules the real (not --fake) worker imports
    install: str  # the pip line that gives .venv-ref those modules
    plain: str  # row names; {gamma} is the suite's gamma
    speculative: str
    worker_args: Callable[[ml_collections.ConfigDict], list[str]]  # beyond --target/--draft/--threads


PEERS = {
    peer.key: peer
    for peer in (
        Peer(
            key="hf",
            library="HF transformers",
            module="launch.hf_peer_worker",
            requires=("torch", "transformers", "accelerate", "gguf"),
            install=".venv-ref/bin/pip install torch==2.13.0 transformers accelerate gguf numpy",
            plain="HF transformers, plain",
            speculative="HF transformers, assisted",
            worker_args=lambda config: [f"--dtype={config.hf_dtype}"],
        ),
        Peer(
            key="ov",
            library="OpenVINO GenAI",
            module="launch.ov_peer_worker",
            requires=("openvino_genai", "gguf", "numpy"),
            install=".venv-ref/bin/pip install openvino-genai==2026.4.1.0 gguf numpy",
            plain="OpenVINO GenAI, plain",
            speculative="OpenVINO GenAI, speculative gamma {gamma}",
            worker_args=lambda config: [f"--num_assistant_tokens={config.gamma}"],
        ),
    )
}

MODEL_KEYS = bench_decode.MODEL_KEYS
DTYPE_KEYS = bench_decode.DTYPE_KEYS
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
    config.peers = tuple(PEERS)  # the peer libraries to run, from PEERS
    config.hf_dtype = "float32"  # torch dtype of HF's models (HF_DTYPES)
    config.target_dtype = "float32"  # this project's precisions (models.precision.PRECISIONS)
    config.draft_dtype = "float32"
    # quick: the workers' --fake backend (deterministic tokens, no library) over the real protocol
    config.fake_peer = quick
    return config


def validate(config) -> None:
    if config.hf_dtype not in HF_DTYPES:
        raise ValueError(f"hf_dtype: must be one of {', '.join(HF_DTYPES)}, got {config.hf_dtype!r}")
    peers = tuple(config.peers)
    if not peers or any(p not in PEERS for p in peers) or len(set(peers)) != len(peers):
        raise ValueError(f"peers: must be distinct values from {', '.join(PEERS)}, got {','.join(peers)!r}")


def resolve_python(path: str) -> str:
    if os.path.isabs(path) or os.path.exists(path):
        return path
    return os.path.join(ROOT, path)


def peer_unavailable(python: str, peer: Peer, fake: bool = False) -> str | None:
    """Why `peer`'s worker cannot run in `python`, or None when it can (the fake worker needs
    nothing but the standard library)."""
    if fake:
        return None
    probe = subprocess.run(
        [python, "-c", f"import {', '.join(peer.requires)}"], capture_output=True, text=True, timeout=300
    )
    if probe.returncode:
        missing = (probe.stderr.strip().splitlines() or ["import failed"])[-1]
        return f"{python} cannot import {'/'.join(peer.requires)} ({missing})"
    return None


class PeerWorker:
    """A peer worker (launch/peer_protocol.py) in the reference interpreter, spoken to in JSON lines."""

    def __init__(self, python: str, module: str, args: list[str]):
        env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen(
            [python, "-m", module, *args],
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

    def generate(self, prompt, max_new_tokens: int, speculative: bool) -> dict:
        request = {
            "op": "generate",
            "prompt": prompt,
            "max_new_tokens": max_new_tokens,
            "speculative": speculative,
        }
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


def params_precision(model) -> str:
    """The dtypes of a model's weight matrices, e.g. "float32"."""
    return "/".join(sorted({str(leaf.dtype) for leaf in jax.tree.leaves(model.params) if leaf.ndim >= 2}))


def available_peers(python: str, config) -> list[Peer]:
    """The peers of config.peers that can run in `python`; prints one line for each that cannot."""
    peers = []
    for key in config.peers:
        peer = PEERS[key]
        reason = peer_unavailable(python, peer, config.fake_peer)
        if reason:
            print(f"peer suite: {peer.library} skipped: {reason}. Install it with: {peer.install}")
        else:
            peers.append(peer)
    return peers


def run(config) -> framework.Result | None:
    python = resolve_python(config.peer_python)
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        print(
            f"peer suite skipped: peer_python={config.peer_python}: no such interpreter. "
            f"Install the reference stack with: {PEER_INSTALL}"
        )
        return None
    peers = available_peers(python, config)
    if not peers:
        print("peer suite skipped: no peer library can run, so there is nothing to compare with")
        return None
    threads = os.cpu_count()
    n, gamma = config.max_new_tokens, config.gamma
    if config.fake_peer:
        model_args = ["--fake"]
    else:
        from models import registry

        paths = [str(registry.fetch_gguf(name)) for name in (config.target, config.draft)]
        model_args = [f"--target={paths[0]}", f"--draft={paths[1]}", f"--threads={threads}"]

    ar, spec = "spec-jax, autoregressive", f"spec-jax, speculative gamma {gamma}"
    families = {"spec-jax": (ar, spec)}  # library -> (plain system, speculative system)
    with contextlib.ExitStack() as stack:
        workers = {}
        for peer in peers:  # one at a time, all before ours: the loads' peaks never overlap
            print(f"peer: loading {peer.library} in {python} ({threads} threads = CPU cores) ...", flush=True)
            workers[peer.key] = PeerWorker(python, peer.module, model_args + peer.worker_args(config))
            stack.callback(workers[peer.key].close)
            families[peer.library] = (peer.plain, peer.speculative.format(gamma=gamma))
        target = common.load_model(config.target, config.target_dtype)
        draft = common.load_model(config.draft, config.draft_dtype)
        prompts = bench_decode.bench_prompts(target.tokenizer, config.num_prompts)

        def ours(prompt, draft_model):  # the wall time of the whole generate call
            start = time.perf_counter()
            gen = bench_decode.run_generate(target, [prompt], draft_model, gamma, 0.0, n)
            seconds = time.perf_counter() - start
            return {
                "tokens": gen.tokens[0],
                "seconds": seconds,
                "compile_seconds": gen.stats["first_compile_seconds"],
            }

        def peer_system(worker, speculative):
            return lambda p: worker.generate(p, n, speculative)

        systems = {ar: lambda p: ours(p, None), spec: lambda p: ours(p, draft)}
        for peer in peers:
            plain_name, spec_name = families[peer.library]
            systems[plain_name] = peer_system(workers[peer.key], False)
            systems[spec_name] = peer_system(workers[peer.key], True)
        repeat_prompts = [prompts[r % len(prompts)] for r in range(config.repeats)]
        warmup = [b[0] for b in bench_decode.warmup_batches([[p] for p in repeat_prompts])]
        runs = timing.interleaved(systems, repeat_prompts, warmup)

    precision = dict.fromkeys((ar, spec), params_precision(target))
    for peer in peers:
        precision.update(dict.fromkeys(families[peer.library], workers[peer.key].info["precision"]))
    first_run = {}  # each distinct prompt -> the first repeat that ran it
    for r, prompt in enumerate(repeat_prompts):
        first_run.setdefault(tuple(prompt), r)
    differences = {  # system -> per distinct prompt, where its tokens first differ from spec-jax AR's
        name: [
            first_difference(runs[name]["results"][r]["tokens"], runs[ar]["results"][r]["tokens"])
            for r in first_run.values()
        ]
        for name in systems
    }

    def per_second(result):
        return len(result["tokens"]) / result["seconds"]

    rows = {}
    for name in systems:
        results = runs[name]["results"]
        row = {
            "system": name,
            "precision": precision[name],
            **bench_decode.throughput([r["seconds"] for r in results], [len(r["tokens"]) for r in results]),
        }
        if name != ar:
            paired = timing.spread(
                per_second(a) / per_second(b) for a, b in zip(results, runs[ar]["results"], strict=True)
            )
            same = sum(d is None for d in differences[name])
            row.update(
                ratio_per_repeat=paired["median"],
                ratio_per_repeat_min=paired["min"],
                ratio_per_repeat_max=paired["max"],
                greedy_same_as_spec_jax_ar=f"{same}/{len(first_run)} prompts",
            )
        if name in (ar, spec):
            row["compile_s"] = sum(r["compile_seconds"] for r in runs[name]["warmup"])
        rows[name] = row
    for baseline, other in families.values():
        rows[baseline]["speedup_over_own_baseline"] = 1.0
        rows[other]["speedup_over_own_baseline"] = (
            rows[other]["tokens_per_s"] / rows[baseline]["tokens_per_s"]
        )
    for row in rows.values():
        row["over_spec_jax_ar"] = row["tokens_per_s"] / rows[ar]["tokens_per_s"]

    def speed(name):
        return rows[name]["tokens_per_s"]

    fastest = max(families["spec-jax"], key=speed)
    summary_row = {"system": "summary", "fastest_spec_jax": fastest}
    if "HF transformers" in families:
        best_hf = max(families["HF transformers"], key=speed)
        summary_row.update(best_hf=best_hf, fastest_spec_jax_over_best_hf=speed(fastest) / speed(best_hf))
    if "OpenVINO GenAI" in families:
        ov_spec = families["OpenVINO GenAI"][1]
        summary_row["fastest_spec_jax_over_openvino_speculative"] = speed(fastest) / speed(ov_spec)

    agreement = []
    for i, prompt in enumerate(first_run):
        entry = {"prompt": common.BENCH_PROMPTS[prompts.index(list(prompt))]}
        for name in systems:
            if name != ar:
                entry[name] = "same" if differences[name][i] is None else f"differs at {differences[name][i]}"
        agreement.append(entry)
    summary = {}
    for peer in peers:
        summary[f"{peer.key}_worker"] = {k: v for k, v in workers[peer.key].info.items() if k != "ready"}
        rss = max(r.get("peak_rss_mb", 0) for name in families[peer.library] for r in runs[name]["results"])
        summary[f"{peer.key}_worker_peak_rss_mb"] = round(rss)
    summary["threads"] = (
        f"{threads} = os.cpu_count() (XLA:CPU; torch.set_num_threads; OpenVINO INFERENCE_NUM_THREADS)"
    )
    return framework.Result.from_dicts(
        [*rows.values(), summary_row],
        sections={"greedy agreement with spec-jax autoregressive, per prompt": agreement},
        summary=summary,
    )
