"""Benchmark: this project against HF transformers, OpenVINO GenAI and llama.cpp on the same pair,
prompts and machine, greedy, the systems alternating.

Each peer runs in a worker process of its own (launch/hf_peer_worker.py, launch/ov_peer_worker.py,
launch/llama_peer_worker.py; one protocol, launch/peer_protocol.py): HF's and OpenVINO's in
`peer_python`, loading both models once; llama.cpp's in this interpreter (it needs only the
standard library), running llama.cpp's own programs, built once from the registry's
llama-cpp-python sdist (models.kernels.llama_cpp), one process per request. Repeat r runs prompt
r (cycling) through every system (plain and speculative of each library; llama.cpp's speculative
program at each `llama_draft_n_max`), the starting system rotating. Each system's time is the
wall time of its generate call alone (the peers': measured inside the worker, llama.cpp's by the
program itself). A peer that cannot run here (packages `peer_python` cannot import; no cmake or
compiler for llama.cpp) is skipped with one line saying why and how to fix it; with none left the
suite prints why and writes nothing.
"""

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable

import jax
import ml_collections

from experiments import bench_decode, common, framework
from launch.loading import load_pair
from models import registry
from models.kernels import llama_cpp
from spec_jax import timing

TITLE = (
    "Benchmark peer: spec-jax against HF transformers, OpenVINO GenAI and llama.cpp "
    "(plain and speculative), side by side"
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEER_INSTALL = (
    "python3 -m venv .venv-ref && .venv-ref/bin/pip install torch==2.13.0 transformers accelerate gguf numpy "
    "openvino-genai==2026.4.1.0"
)
HF_DTYPES = ("float32", "bfloat16")
LLAMA_PROGRAMS = ("llama-completion", "llama-speculative-simple", "llama-bench")


@dataclasses.dataclass(frozen=True)
class System:
    """One row of the table: a peer's plain or speculative generate."""

    name: str
    speculative: bool
    draft_max: int | None = None  # drafts per round asked of the worker (None: the worker's setting)


@dataclasses.dataclass(frozen=True)
class Peer:
    """A peer library: its worker module, what the worker needs, and its systems."""

    key: str  # its value in config.peers
    library: str
    module: str  # run as `python -m module` from the repository root
    # Modules the real (not --fake) worker imports, in peer_python; () for a worker that needs
    # only the standard library, which runs in this interpreter.
    requires: tuple[str, ...]
    systems: Callable[[ml_collections.ConfigDict], list[System]]  # the plain system first
    worker_args: Callable[[ml_collections.ConfigDict], list[str]]  # beyond --target/--draft/--threads
    install: str = ""  # the pip line that gives peer_python the modules of `requires`
    # llama.cpp programs its worker runs, built here once (models.kernels.llama_cpp, whose error
    # says what is missing)
    programs: tuple[str, ...] = ()


def _llama_bin_dir() -> str:
    return str(llama_cpp.build_dir() / "bin")


PEERS = {
    peer.key: peer
    for peer in (
        Peer(
            key="hf",
            library="HF transformers",
            module="launch.hf_peer_worker",
            requires=("torch", "transformers", "accelerate", "gguf"),
            install=".venv-ref/bin/pip install torch==2.13.0 transformers accelerate gguf numpy",
            systems=lambda config: [
                System("HF transformers, plain", False),
                System("HF transformers, assisted", True),
            ],
            worker_args=lambda config: [f"--dtype={config.hf_dtype}"],
        ),
        Peer(
            key="ov",
            library="OpenVINO GenAI",
            module="launch.ov_peer_worker",
            requires=("openvino_genai", "gguf", "numpy"),
            install=".venv-ref/bin/pip install openvino-genai==2026.4.1.0 gguf numpy",
            systems=lambda config: [
                System("OpenVINO GenAI, plain", False),
                System(f"OpenVINO GenAI, speculative gamma {config.gamma}", True),
            ],
            worker_args=lambda config: [f"--num_assistant_tokens={config.gamma}"],
        ),
        Peer(
            key="llama",
            library="llama.cpp",
            module="launch.llama_peer_worker",
            requires=(),
            systems=lambda config: [
                System("llama.cpp, plain", False),
                *(System(f"llama.cpp, speculative gamma {k}", True, k) for k in config.llama_draft_n_max),
            ],
            worker_args=lambda config: [f"--bin_dir={_llama_bin_dir()}"],
            programs=LLAMA_PROGRAMS,
        ),
    )
}

MODEL_KEYS = bench_decode.MODEL_KEYS
DTYPE_KEYS = bench_decode.DTYPE_KEYS
INT_RANGES = bench_decode.INT_RANGES
TUPLE_RANGES = {"llama_draft_n_max": (int, 1, 16)}


def get_config(quick: bool = False) -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.target = "tiny" if quick else "qwen2.5-coder-1.5b"
    config.draft = "tiny-draft" if quick else "qwen2.5-coder-0.5b"
    config.gamma = 2 if quick else 4
    config.auto = True  # also spec-jax with gamma=auto (launch.generate's default)
    config.prompt_set = "open"  # experiments.common.PROMPT_SETS
    config.num_prompts = 2 if quick else len(common.BENCH_PROMPTS)
    config.repeats = 2 if quick else 6
    config.max_new_tokens = 8 if quick else 32
    config.peer_python = ".venv-ref/bin/python"
    config.peers = tuple(PEERS)  # the peer libraries to run, from PEERS
    config.hf_dtype = "float32"  # torch dtype of HF's models (HF_DTYPES)
    # llama.cpp's speculative systems: one per --spec-draft-n-max (drafts per round)
    config.llama_draft_n_max = (2,) if quick else (2, 3, 4)
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
    if config.prompt_set not in common.PROMPT_SETS:
        raise ValueError(
            f"prompt_set: must be one of {', '.join(common.PROMPT_SETS)}, got {config.prompt_set!r}"
        )
    if len(set(config.llama_draft_n_max)) != len(config.llama_draft_n_max):
        raise ValueError(f"llama_draft_n_max: values must be distinct, got {tuple(config.llama_draft_n_max)}")


def resolve_python(path: str) -> str:
    if os.path.isabs(path) or os.path.exists(path):
        return path
    return os.path.join(ROOT, path)


def worker_python(peer: Peer, python: str) -> str:
    """The interpreter `peer`'s worker runs in: `python` (peer_python) for a worker that imports
    a library, this interpreter for one that needs only the standard library."""
    return python if peer.requires else sys.executable


def peer_unavailable(python: str, peer: Peer, fake: bool = False) -> str | None:
    """Why `peer`'s worker cannot run with `python` as peer_python (what is missing and how to
    get it), or None when it can. The fake worker needs nothing but the standard library and its
    interpreter; llama.cpp's programs are built here (once, cached) when they can be."""
    if peer.requires and not (os.path.isfile(python) and os.access(python, os.X_OK)):
        return f"peer_python={python}: no such interpreter. Install it with: {PEER_INSTALL}"
    if fake:
        return None
    if peer.requires:
        probe = subprocess.run(
            [python, "-c", f"import {', '.join(peer.requires)}"], capture_output=True, text=True, timeout=300
        )
        if probe.returncode:
            missing = (probe.stderr.strip().splitlines() or ["import failed"])[-1]
            return f"{python} cannot import {'/'.join(peer.requires)} ({missing}). Install it with: {peer.install}"
    if peer.programs:
        try:
            if not llama_cpp.built(peer.programs):
                llama_cpp.check_tools()
                print(
                    f"peer: building {', '.join(peer.programs)} from {llama_cpp.PACKAGE}=={llama_cpp.VERSION}'s "
                    "llama.cpp source (once, cached; a few minutes) ...",
                    flush=True,
                )
            llama_cpp.build(peer.programs)
        except llama_cpp.Unavailable as e:
            return f"{peer.library} cannot be built here: {e}"
    return None


class PeerWorker:
    """A peer worker (launch/peer_protocol.py) in its interpreter, spoken to in JSON lines."""

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

    def generate(self, prompt, text: str, max_new_tokens: int, system: System) -> dict:
        request = {
            "op": "generate",
            "prompt": prompt,
            "text": text,
            "max_new_tokens": max_new_tokens,
            "speculative": system.speculative,
            "draft_max": system.draft_max,
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


def first_text_difference(text: str, tokens: list[int], decode: Callable) -> int | None:
    """How many of `tokens` `text` reproduces: None when it starts with all of them (a peer that
    reports text may make a few tokens more), else the index of the first token whose text is
    not where `text` has it. A token that ends inside a UTF-8 character counts with the next."""
    if text.startswith(decode(tokens).rstrip("\ufffd")):
        return None
    for i in range(len(tokens)):
        if not text.startswith(decode(tokens[: i + 1]).rstrip("\ufffd")):
            return i
    return len(tokens)


def params_precision(model) -> str:
    """The dtypes of a model's weight matrices, e.g. "float32"."""
    return "/".join(sorted({str(leaf.dtype) for leaf in jax.tree.leaves(model.params) if leaf.ndim >= 2}))


def available_peers(python: str, config) -> list[Peer]:
    """The peers of config.peers that can run (`python`: peer_python); prints one line for each
    that cannot."""
    peers = []
    for key in config.peers:
        peer = PEERS[key]
        reason = peer_unavailable(python, peer, config.fake_peer)
        if reason:
            print(f"peer suite: {peer.library} skipped: {reason}")
        else:
            peers.append(peer)
    return peers


def run(config) -> framework.Result | None:
    python = resolve_python(config.peer_python)
    needs_python = [PEERS[k] for k in config.peers if PEERS[k].requires]
    if len(needs_python) == len(config.peers) and not (os.path.isfile(python) and os.access(python, os.X_OK)):
        print(
            f"peer suite skipped: peer_python={config.peer_python}: no such interpreter. "
            f"Install the reference stack with: {PEER_INSTALL}"
        )
        return None
    peers = available_peers(python, config)
    if not peers:
        print("peer suite skipped: no peer library can run, so there is nothing to compare with")
        return None
    cells = _run_cells(config, peers, python)
    rows = _rows(cells)
    return framework.Result.from_dicts(
        [*rows.values(), _summary_row(rows, cells.families)],
        sections={
            "greedy agreement with spec-jax autoregressive, per prompt": _agreement(cells),
            "prompt reading (prefill), median ms per prompt over its repeats": _prefill_by_prompt(cells),
        },
        summary=_summary(config, cells, peers),
    )


@dataclasses.dataclass
class Cells:
    """What the interleaved runs of every system measured (run's steps read it).

    runs: timing.interleaved's {system: {"results", "warmup"}}; ar: spec-jax's autoregressive
    system, every other's reference; ours: spec-jax's systems; families: library -> its systems,
    its plain one first; speculative: the systems that draft; precision: system -> its weights'
    precision; differences: system -> per distinct prompt, where its output first differs from
    ar's (None: the same); first_run: each distinct prompt -> the first repeat that ran it;
    texts: the prompts' text; workers: peer key -> its worker's info; threads: the CPU threads;
    prompt_of: each repeat -> its prompt's index; prompt_tokens: each prompt's token count.
    """

    runs: dict
    ar: str
    ours: list
    families: dict
    speculative: set
    precision: dict
    differences: dict
    first_run: dict
    texts: list
    workers: dict
    threads: int
    prompt_of: list
    prompt_tokens: list


def _model_args(config, threads: int) -> list[str]:
    """The workers' model flags: --fake, or both models' GGUF files and the thread count."""
    if config.fake_peer:
        return ["--fake"]
    paths = [str(registry.fetch_gguf(name)) for name in (config.target, config.draft)]
    return [f"--target={paths[0]}", f"--draft={paths[1]}", f"--threads={threads}"]


def our_result(target, prompt, draft, gamma, max_new_tokens: int, eos_id="auto") -> dict:
    """One spec-jax generate call on one prompt, greedy, timed whole (compile included where it
    compiles): its tokens, seconds and the loop's stats (eos_id: run_generate's)."""
    start = time.perf_counter()
    gen = bench_decode.run_generate(target, [prompt], draft, gamma, 0.0, max_new_tokens, eos_id=eos_id)
    seconds = time.perf_counter() - start
    stats = gen.stats
    return {
        "tokens": gen.tokens[0],
        "num_tokens": len(gen.tokens[0]),
        "seconds": seconds,
        "compile_seconds": stats["first_compile_seconds"],
        "prefill_seconds": stats["prefill_seconds"],  # prefill + the first token
        "decode_seconds": stats["decode_seconds"],
        "decode_tokens": len(gen.tokens[0]) - 1,
        "num_drafted": stats.get("num_draft_tokens", 0),
        "num_accepted": stats.get("num_accepted_tokens", 0),
    }


def _start_workers(stack, config, peers, python: str, model_args, threads: int):
    """({peer key: PeerWorker}, {peer key: its systems}), loaded one at a time, all before ours:
    the loads' peaks never overlap. Each worker is closed when `stack` closes."""
    workers, peer_systems = {}, {}
    for peer in peers:
        python_for_peer = worker_python(peer, python)
        print(
            f"peer: loading {peer.library} in {python_for_peer} ({threads} threads = CPU cores) ...",
            flush=True,
        )
        workers[peer.key] = PeerWorker(python_for_peer, peer.module, model_args + peer.worker_args(config))
        stack.callback(workers[peer.key].close)
        peer_systems[peer.key] = peer.systems(config)
    return workers, peer_systems


def _run_cells(config, peers, python: str) -> Cells:
    """Every system (spec-jax's and the peers') on the same prompts, interleaved, repeats
    rotating over the prompts."""
    threads, n, gamma = os.cpu_count(), config.max_new_tokens, config.gamma
    ar, spec = "spec-jax, autoregressive", f"spec-jax, speculative gamma {gamma}"
    auto = "spec-jax, speculative gamma auto" if config.auto else None
    ours = [ar, spec] + ([auto] if auto else [])
    families = {"spec-jax": ours}  # library -> its systems, the plain one first
    with contextlib.ExitStack() as stack:
        workers, peer_systems = _start_workers(
            stack, config, peers, python, _model_args(config, threads), threads
        )
        pair = load_pair(
            config.target,
            config.draft,
            target_dtype=config.target_dtype,
            draft_dtype=config.draft_dtype,
            load=common.load_model,
        )
        target, draft = pair.target, pair.draft
        texts = common.prompt_set(config.prompt_set, config.num_prompts)
        prompts = [target.tokenizer.encode(t) for t in texts]
        systems = {
            ar: lambda i: our_result(target, prompts[i], None, gamma, n),
            spec: lambda i: our_result(target, prompts[i], draft, gamma, n),
        }
        if auto:
            systems[auto] = lambda i: our_result(target, prompts[i], draft, "auto", n)
        speculative = {spec, auto} - {None}
        for peer in peers:
            families[peer.library] = [s.name for s in peer_systems[peer.key]]
            for system in peer_systems[peer.key]:
                worker = workers[peer.key]
                systems[system.name] = lambda i, w=worker, s=system: w.generate(prompts[i], texts[i], n, s)
                if system.speculative:
                    speculative.add(system.name)
        repeat_prompts = [r % len(prompts) for r in range(config.repeats)]
        batches = bench_decode.warmup_batches([[prompts[i]] for i in repeat_prompts])
        runs = timing.interleaved(systems, repeat_prompts, [prompts.index(b[0]) for b in batches])
    precision = dict.fromkeys(ours, params_precision(target))
    for peer in peers:
        precision.update(dict.fromkeys(families[peer.library], workers[peer.key].info["precision"]))
    first_run = {}  # each distinct prompt -> the first repeat that ran it
    for r, i in enumerate(repeat_prompts):
        first_run.setdefault(i, r)

    def difference(name, r):
        result, ar_tokens = runs[name]["results"][r], runs[ar]["results"][r]["tokens"]
        if "tokens" in result:
            return first_difference(result["tokens"], ar_tokens)
        return first_text_difference(result["text"], ar_tokens, target.tokenizer.decode)

    differences = {name: [difference(name, r) for r in first_run.values()] for name in systems}
    info = {key: w.info for key, w in workers.items()}
    return Cells(
        runs, ar, ours, families, speculative, precision, differences, first_run, texts, info, threads,
        repeat_prompts, [len(p) for p in prompts],
    )  # fmt: skip


def _per_second(result) -> float:
    return result["num_tokens"] / result["seconds"]


def _row(cells: Cells, name: str) -> dict:
    """One system's row: throughput, precision, prefill and decode speeds where it reports them,
    its acceptance rate, and against spec-jax AR its paired speed ratio and greedy agreement."""
    results = cells.runs[name]["results"]
    counts = sorted({r["num_tokens"] for r in results})
    row = {
        "system": name,
        "precision": cells.precision[name],
        **bench_decode.throughput([r["seconds"] for r in results], [r["num_tokens"] for r in results]),
        "new_tokens": str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}",
    }
    if all("prefill_seconds" in r for r in results):
        row["prefill_ms"] = timing.spread(1e3 * r["prefill_seconds"] for r in results)["median"]
        row["decode_tokens_per_s"] = sum(r["decode_tokens"] for r in results) / sum(
            r["decode_seconds"] for r in results
        )
    if name in cells.speculative and all("num_drafted" in r for r in results):
        drafted = sum(r["num_drafted"] for r in results)
        row["acceptance_rate"] = sum(r["num_accepted"] for r in results) / drafted if drafted else 0.0
    if name != cells.ar:
        ar_results = cells.runs[cells.ar]["results"]
        paired = timing.spread(
            _per_second(a) / _per_second(b) for a, b in zip(results, ar_results, strict=True)
        )
        same = sum(d is None for d in cells.differences[name])
        row.update(
            ratio_per_repeat=paired["median"],
            ratio_per_repeat_min=paired["min"],
            ratio_per_repeat_max=paired["max"],
            greedy_same_as_spec_jax_ar=f"{same}/{len(cells.first_run)} prompts",
        )
    if name in cells.ours:
        row["compile_s"] = sum(r["compile_seconds"] for r in cells.runs[name]["warmup"])
    return row


def _rows(cells: Cells) -> dict[str, dict]:
    """system -> its row, with its speedup over its own library's plain system and over spec-jax AR."""
    rows = {name: _row(cells, name) for name in cells.differences}
    for baseline, *others in cells.families.values():
        rows[baseline]["speedup_over_own_baseline"] = 1.0
        for other in others:
            rows[other]["speedup_over_own_baseline"] = (
                rows[other]["tokens_per_s"] / rows[baseline]["tokens_per_s"]
            )
    for row in rows.values():
        row["over_spec_jax_ar"] = row["tokens_per_s"] / rows[cells.ar]["tokens_per_s"]
    return rows


def _summary_row(rows: dict, families: dict) -> dict:
    """The fastest spec-jax system and its speed over each peer library's best (OpenVINO: its
    speculative system)."""

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
    if "llama.cpp" in families:
        best_llama = max(families["llama.cpp"], key=speed)
        summary_row.update(
            best_llama_cpp=best_llama, fastest_spec_jax_over_best_llama_cpp=speed(fastest) / speed(best_llama)
        )
    return summary_row


def _agreement(cells: Cells) -> list[dict]:
    """Per distinct prompt: whether each system's output is spec-jax AR's, or where it differs."""
    agreement = []
    for k, i in enumerate(cells.first_run):
        entry = {"prompt": cells.texts[i]}
        for name, where in cells.differences.items():
            if name != cells.ar:
                entry[name] = "same" if where[k] is None else f"differs at {where[k]}"
        agreement.append(entry)
    return agreement


def _prefill_by_prompt(cells: Cells) -> list[dict]:
    """Per distinct prompt: its token count and each system's median prefill ms over the repeats
    that ran it (systems that report a prefill time)."""
    table = []
    for i in cells.first_run:
        entry = {"prompt": cells.texts[i][:40], "tokens": cells.prompt_tokens[i]}
        for name, run in cells.runs.items():
            results = [r for r, p in zip(run["results"], cells.prompt_of, strict=True) if p == i]
            if results and all("prefill_seconds" in r for r in results):
                entry[name] = timing.spread(1e3 * r["prefill_seconds"] for r in results)["median"]
        table.append(entry)
    return table


def _summary(config, cells: Cells, peers) -> dict:
    """The prompt set, each worker's info and peak memory, and the threads every library ran on."""
    summary = {"prompt_set": config.prompt_set}
    for peer in peers:
        summary[f"{peer.key}_worker"] = {k: v for k, v in cells.workers[peer.key].items() if k != "ready"}
        rss = max(
            r.get("peak_rss_mb", 0)
            for name in cells.families[peer.library]
            for r in cells.runs[name]["results"]
        )
        summary[f"{peer.key}_worker_peak_rss_mb"] = round(rss)
    summary["threads"] = (
        f"{cells.threads} = os.cpu_count() (XLA:CPU; torch.set_num_threads; OpenVINO INFERENCE_NUM_THREADS; "
        "llama.cpp -t and -tb)"
    )
    return summary
