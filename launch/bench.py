"""Benchmarks: medians over repeats after warm-up, variants interleaved in one run.

  python -m launch.bench --suite=loop       # compiled while_loop vs a Python loop of jitted steps
  python -m launch.bench --suite=overhead   # AR vs speculative (draft = target): bookkeeping cost
  python -m launch.bench --suite=decode     # the Qwen pair: tokens/s over batch, temperature, gamma
  python -m launch.bench --suite=peer       # the same pair through HF transformers, side by side
  python -m launch.bench --suite=roofline   # bytes per step vs measured memory bandwidth
  python -m launch.bench --suite=peer,decode,roofline   # together: the models load once

Each suite prints Markdown tables and writes .md, .csv (the main table) and .json (every
table, the command, git revision, machine, versions, peak RSS) into --output_dir. Warm-up runs (which compile) are never timed; compile time is reported in
its own column. Timings are never asserted by tests; --quick runs each suite on tiny random
models so the test suite can check that the harness runs. docs/benchmarks.md explains
every column.
"""

import concurrent.futures
import csv
import functools
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from launch import common
from spec_jax.timing import interleaved, spread, timed, timed_interleaved

FLAGS = flags.FLAGS
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUITES = ("loop", "overhead", "peer", "decode", "roofline")
REAL_SUITES = ("decode", "peer", "roofline")  # default to the Qwen pair
WORKER = os.path.join(ROOT, "launch", "hf_peer_worker.py")
PEER_INSTALL = (
    "python3 -m venv .venv-ref && .venv-ref/bin/pip install torch==2.13.0 transformers accelerate gguf numpy"
)

# Per-suite defaults for the flags left unset (None): chosen so that decode + peer + roofline
# on the Qwen pair fit in 30 minutes on a 2-core CPU (docs/benchmarks.md has the budget).
DEFAULTS = {
    "loop": dict(model="random", repeats=5, max_new_tokens=128),
    "overhead": dict(model="random", repeats=5, max_new_tokens=128),
    "decode": dict(model="qwen2.5-coder-1.5b", repeats=3, max_new_tokens=32),
    "peer": dict(model="qwen2.5-coder-1.5b", repeats=6, max_new_tokens=32),
    "roofline": dict(model="qwen2.5-coder-1.5b", repeats=10, max_new_tokens=32),
}

flags.DEFINE_list(
    "suite",
    ["loop"],
    "Suites to run, comma-separated, from: " + ", ".join(SUITES) + " (run in that order, peer before "
    "decode so that HF loads before this project's models are resident).",
)
flags.DEFINE_string(
    "model",
    None,
    "Target model (models.known_models()); default: random (loop, overhead), else qwen2.5-coder-1.5b.",
)
flags.DEFINE_string("draft", "qwen2.5-coder-0.5b", "Draft model (decode, peer, roofline).")
flags.DEFINE_integer(
    "repeats",
    None,
    "Timed repeats after warm-up (default per suite: loop/overhead 5, decode 3, peer 6, roofline 10).",
    lower_bound=1,
)
flags.DEFINE_integer(
    "max_new_tokens",
    None,
    "Tokens generated per run (default: 128 loop/overhead, 32 decode/peer; EOS never stops a run).",
    lower_bound=2,
)
flags.DEFINE_integer(
    "gamma",
    4,
    "Draft tokens per round: overhead, peer, decode cells after the first (see --full_sweep); "
    "roofline's verify call has gamma + 1 tokens.",
    lower_bound=1,
)
flags.DEFINE_integer("batch_size", 1, "Rows decoded together (loop, overhead, roofline).", lower_bound=1)
flags.DEFINE_list("batch_sizes", ["1", "4"], "Batch sizes to sweep (decode).")
flags.DEFINE_list(
    "gammas", ["1", "2", "3", "4", "5", "6"], "Gammas swept in decode's first (batch, temperature) cell."
)
flags.DEFINE_list("temperatures", ["0", "1"], "Temperatures to sweep (decode).")
flags.DEFINE_bool(
    "full_sweep", False, "Decode: every --gammas in every (batch, temperature) cell, not only the first."
)
flags.DEFINE_integer(
    "num_prompts", None, "Use the first N of the built-in prompts (decode, peer; default all 8)."
)
flags.DEFINE_string(
    "peer_python", ".venv-ref/bin/python", "Interpreter with torch + transformers (peer suite)."
)
flags.DEFINE_integer("context", 128, "KV-cache positions each step reads (roofline).", lower_bound=8)
flags.DEFINE_integer(
    "bandwidth_mb", 1024, "Size of the array copied to measure memory bandwidth (roofline).", lower_bound=1
)
flags.DEFINE_bool("quick", False, "Tiny random models and sizes, for tests: proves the harness runs.")
flags.DEFINE_string("output_dir", "benchmarks/results", "Where the .md, .csv and .json go.")

QUICK_SWEEP = (["1", "2"], ["2"], ["0"])  # --quick: batch sizes, gammas, temperatures

# Code and English prompts, alternating (the Qwen pair are code models; English is harder for
# the draft), so that a few repeats already mix both. Each is at most 16 tokens with the Qwen
# tokenizer, so every prompt and every batch of them shares one compiled bucket.
PROMPTS = [
    "def quicksort(arr):\n    ",
    "The history of the Roman Empire begins",
    "import numpy as np\n\ndef moving_average(x, window):\n    ",
    "To make a cup of tea, first",
    "class LinkedList:\n    def __init__(self):\n        ",
    "SELECT name, COUNT(*) FROM orders",
    "# Sum the second column of a CSV file\nimport csv\n",
    "def is_prime(n: int) -> bool:\n    ",
]


# --- timing helpers: spec_jax.timing (spread, interleaved, timed, timed_interleaved) ----------


def peak_rss_mb() -> float:
    """This process's peak resident set size so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def machine() -> dict:
    def git(*args):
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, check=True, cwd=ROOT).stdout
        except (OSError, subprocess.CalledProcessError):
            return None

    rev = git("rev-parse", "--short", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    import flax

    return {
        "command": " ".join(["python -m launch.bench", *sys.argv[1:]]),
        "git_revision": rev.strip() if rev else "unknown",
        "git_dirty": None if status is None else bool(status.strip()),
        "platform": platform.platform(),
        "processor": cpu,
        "cpu_count": os.cpu_count(),
        "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "flax": flax.__version__,
        "numpy": np.__version__,
        "devices": [str(d) for d in jax.devices()],
    }


# --- models and prompts -----------------------------------------------------------------------


def tiny_model(seed: int):
    """A 1-layer random model with a byte tokenizer: what --quick runs on."""
    import models

    model = models.random_model(
        vocab_size=256, num_layers=1, d_model=32, num_heads=2, num_kv_heads=1, seed=seed
    )
    return model.replace(tokenizer=models.ByteTokenizer())


_PAIRS: dict = {}


def load_pair():
    """(target, draft) models: tiny random ones under --quick, else --model and --draft. Loaded
    once per process, so suites run together share them."""
    import models

    key = (FLAGS.quick, FLAGS.model, FLAGS.draft)
    if key not in _PAIRS:
        _PAIRS.clear()  # at most one pair resident
        _PAIRS[key] = (
            (tiny_model(0), tiny_model(1))
            if FLAGS.quick
            else (models.load(FLAGS.model), models.load(FLAGS.draft))
        )
    return _PAIRS[key]


def token_prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(p) for p in PROMPTS[: FLAGS.num_prompts]]


def sweep() -> tuple[list[int], list[int], list[float]]:
    """The decode suite's (batch sizes, gammas, temperatures), checked."""
    return (
        _parse_list("batch_sizes", int, 1, 64),
        _parse_list("gammas", int, 1, 16),
        _parse_list("temperatures", float, 0.0, 100.0),
    )


def _parse_list(flag: str, kind, low, high) -> list:
    values = []
    for text in FLAGS[flag].value:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            noun = "an integer" if kind is int else "a number"
            raise common.UsageError(
                f"--{flag}: each value must be {noun} in [{low:g}, {high:g}], got {text!r}"
            )
        values.append(value)
    if not values:
        raise common.UsageError(f"--{flag} must not be empty")
    return values


# --- suites: loop, overhead (random models) ---------------------------------------------------


def ar_setup(model, prompts, max_new_tokens):
    """The executables and the initial state of the autoregressive loop for these prompts."""
    from spec_jax import decode
    from spec_jax.sampling import SamplingParams

    width = decode.bucket_length(max(len(p) for p in prompts))
    static = decode.ARStatic(model.config, SamplingParams(0.0), max_new_tokens, width + max_new_tokens)
    tokens, lens = decode.pad_prompts(prompts, width)
    inputs = decode.PrefillInputs(
        jnp.asarray(tokens), jnp.asarray(lens), jnp.asarray(-1, jnp.int32), jax.random.key(0)
    )
    prefill = jax.jit(functools.partial(decode.ar_prefill, static))
    return static, prefill, inputs


def synthetic_prompts() -> list[list[int]]:
    return [[1 + (7 * i + j) % 50 for j in range(8 + 3 * i)] for i in range(FLAGS.batch_size)]


def load_one():
    import models

    if FLAGS.quick:
        return models.random_model(vocab_size=64, num_layers=1, d_model=32, num_heads=2, num_kv_heads=1)
    return models.load(FLAGS.model)


def suite_loop():
    """Per-token time: the whole decode as one lax.while_loop vs a Python loop of the jitted step."""
    from spec_jax import decode

    model, prompts = load_one(), synthetic_prompts()
    n = FLAGS.max_new_tokens
    static, prefill, inputs = ar_setup(model, prompts, n)
    loop = jax.jit(functools.partial(decode.ar_loop, static), donate_argnums=1)
    step = jax.jit(functools.partial(decode.ar_step, static), donate_argnums=1)

    def compiled_loop():
        return loop(model.params, prefill(model.params, inputs), inputs.eos_id)

    def python_loop():
        state = prefill(model.params, inputs)
        while not bool(jnp.all(state.out.done)):  # a host check per token, as a Python loop does
            state = step(model.params, state, inputs.eos_id)
        return state

    variants = {
        "compiled lax.while_loop": compiled_loop,
        "python loop of jitted step": python_loop,
        "prefill alone": lambda: prefill(model.params, inputs),
    }
    results = timed_interleaved(variants, FLAGS.repeats)
    prefill_only = results.pop("prefill alone")
    rows = []
    for name, t in results.items():
        steps = n - 1  # tokens after the first, which prefill draws
        per_token = (t["median"] - prefill_only["median"]) / steps
        rows.append(
            {
                "variant": name,
                "ms_per_token": 1e3 * per_token,
                "total_ms_median": 1e3 * t["median"],
                "total_ms_min": 1e3 * t["min"],
                "total_ms_max": 1e3 * t["max"],
                "tokens": n,
                "prefill_ms_median": 1e3 * prefill_only["median"],
            }
        )
    return rows, {}


def suite_overhead():
    """Time per committed token of AR and of speculative decoding with draft = target.

    With draft = target every draft is accepted, so a round commits gamma + 1 tokens for
    gamma draft steps plus one verification call; what the round costs beyond those model
    calls (measured alone, same shapes) is the loop's own bookkeeping.
    """
    import models
    import spec_jax
    from models.transformer import forward

    model, prompts = load_one(), synthetic_prompts()
    n, gamma = FLAGS.max_new_tokens, FLAGS.gamma
    kwargs = dict(max_new_tokens=n, temperature=0.0)
    ar = lambda: spec_jax.generate(model, prompts, **kwargs)  # noqa: E731
    spec = lambda: spec_jax.generate(model, prompts, draft=model, gamma=gamma, **kwargs)  # noqa: E731
    runs = interleaved({"ar": lambda _: ar(), "spec": lambda _: spec()}, [None] * FLAGS.repeats, [None])
    ar_runs = [g.stats for g in runs["ar"]["results"]]
    spec_runs = [g.stats for g in runs["spec"]["results"]]

    # The model calls of one round (drafter: one T=2 call and gamma - 1 T=1 calls; target: one
    # T=gamma+1 call), alone, compiled in a fori_loop so per-call dispatch is not counted.
    batch, cache_len, reps = len(prompts), 16 + n + gamma, 32
    cache = models.init_cache(model.config, batch, cache_len)
    pos0 = jnp.full((batch, 1), cache_len // 2, jnp.int32)

    def repeated(widths):
        def body(_, carry):
            cache, acc = carry
            for offset, width in widths:
                logits, cache = forward(
                    model.config,
                    model.params,
                    jnp.zeros((batch, width), jnp.int32),
                    pos0 + offset + jnp.arange(width),
                    cache,
                )
                acc = acc + logits[:, -1, 0].sum()  # consumed, so the head is not dead code
            return cache, acc

        fn = jax.jit(lambda c: jax.lax.fori_loop(0, reps, body, (c, jnp.zeros(()))))
        return timed(lambda: fn(cache), FLAGS.repeats)["median"] / reps

    calls = repeated([(0, 2)] + [(2 + i, 1) for i in range(gamma - 1)] + [(0, gamma + 1)])
    ar_step = repeated([(0, 1)])

    def med(runs, key):
        return statistics.median(r[key] for r in runs)

    rounds = spec_runs[0]["target_calls"] - 1
    round_s = med(spec_runs, "decode_seconds") / rounds
    ar_token_s = med(ar_runs, "decode_seconds") / (ar_runs[0]["target_calls"] - 1)
    spec_token_s = med(spec_runs, "decode_seconds") / (spec_runs[0]["num_new_tokens"] - len(prompts))
    rows = [
        {
            "variant": "autoregressive",
            "ms_per_committed_token": 1e3 * ar_token_s,
            "ms_per_step_or_round": 1e3 * ar_token_s,
            "model_calls_ms": 1e3 * ar_step,
            "non_model_fraction": 1 - ar_step / ar_token_s,  # signed: negative = within noise
        },
        {
            "variant": f"speculative, draft = target, gamma {gamma}",
            "ms_per_committed_token": 1e3 * spec_token_s,
            "ms_per_step_or_round": 1e3 * round_s,
            "model_calls_ms": 1e3 * calls,
            "non_model_fraction": 1 - calls / round_s,
            "acceptance_rate": spec_runs[0]["acceptance_rate"],
            "mean_accepted_length": spec_runs[0]["mean_accepted_length"],
        },
    ]
    return rows, {}


# --- suite: decode ----------------------------------------------------------------------------


def batches_for(prompts, batch: int, repeats: int) -> list[list[list[int]]]:
    """The batch of each repeat: repeat r takes prompts r*B .. r*B + B - 1, cycling, so that
    repeats walk through every prompt instead of timing one (very predictable) prompt."""
    return [[prompts[(r * batch + i) % len(prompts)] for i in range(batch)] for r in range(repeats)]


def warmup_batches(batches) -> list:
    """One batch per distinct prompt bucket: warming up on each compiles every executable the
    timed repeats will use, so no timed repeat compiles."""
    from spec_jax.decode import bucket_length

    by_width = {}
    for b in batches:
        by_width.setdefault(bucket_length(max(len(p) for p in b)), b)
    return list(by_width.values())


def aggregate_spec(stats: list[dict]) -> dict:
    """Acceptance over several runs, pooled (sums, not a median of ratios)."""
    drafted = sum(s["num_draft_tokens"] for s in stats)
    accepted = sum(s["num_accepted_tokens"] for s in stats)
    rounds = sum(s["num_rounds"] for s in stats)
    scored = sum(s["num_scored_positions"] for s in stats)
    overlap = sum(s["alpha_hat"] * s["num_scored_positions"] for s in stats if s["num_scored_positions"])
    return {
        "acceptance_rate": accepted / drafted if drafted else float("nan"),
        "mean_accepted_length": 1 + accepted / rounds if rounds else float("nan"),
        "alpha_hat": overlap / scored if scored else float("nan"),
    }


def throughput(seconds: list[float], tokens: list[int]) -> dict:
    """tokens_per_s: all tokens over all seconds; per_repeat_tokens_per_s: median/min/max."""
    per = spread(t / s for t, s in zip(tokens, seconds, strict=True))
    return {
        "tokens_per_s": sum(tokens) / sum(seconds),
        "per_repeat_tokens_per_s": per["median"],
        "per_repeat_tokens_per_s_min": per["min"],
        "per_repeat_tokens_per_s_max": per["max"],
    }


_COMPILE_SECONDS: dict = {}  # executable -> seconds its first compile took, across suites


def run_generate(target, prompts, draft, gamma: int, temperature: float, seed: int = 0):
    """spec_jax.generate(...) with stats["first_compile_seconds"]: what compiling this loop
    took, also when an earlier suite in this process compiled it (generate then reports 0)."""
    import spec_jax
    from spec_jax.decode import bucket_length

    gamma = gamma if draft is not None else 0
    gen = spec_jax.generate(
        target,
        prompts,
        draft=draft,
        gamma=max(gamma, 1),
        max_new_tokens=FLAGS.max_new_tokens,
        temperature=temperature,
        seed=seed,
    )
    width = bucket_length(max(len(p) for p in prompts))
    key = (id(target), id(draft), gamma, temperature, len(prompts), width, FLAGS.max_new_tokens)
    if gen.stats["compile_seconds"]:
        _COMPILE_SECONDS[key] = gen.stats["compile_seconds"]
    gen.stats["first_compile_seconds"] = _COMPILE_SECONDS.get(key, 0.0)
    return gen


def suite_decode():
    """Autoregressive vs speculative decoding on the pair, over batch size, temperature, gamma.

    Cells are (batch, temperature). The first cell (batch 1, temperature 0 by default) sweeps
    every --gammas; the other cells run --gamma alone, unless --full_sweep (every gamma in
    every cell: about 10 minutes of compilation alone on a 2-core CPU). In each cell AR and
    the gammas are warmed up (compile, reported apart), then timed for --repeats interleaved
    repeats, repeat r decoding the r-th batch of prompts (cycling through them). At
    temperature 0 every speculative row is checked against the AR row of the same repeat:
    greedy speculative decoding must give identical tokens.
    """
    batch_sizes, gammas, temperatures = sweep()
    target, draft = load_pair()
    prompts = token_prompts(target.tokenizer)
    rows, identity, covered, checked = [], {"same": 0, "rows": 0}, set(), set()
    cells = [(b, t) for b in batch_sizes for t in temperatures]
    for i, (batch, temperature) in enumerate(cells):
        batches = batches_for(prompts, batch, FLAGS.repeats)
        cell_gammas = gammas if FLAGS.full_sweep or i == 0 else [FLAGS.gamma]
        variants = {"autoregressive": (None, 0)} | {f"gamma {g}": (draft, g) for g in cell_gammas}

        def run(inputs, draft_model, gamma, temperature=temperature):
            r, batch_prompts = inputs
            return run_generate(target, batch_prompts, draft_model, gamma, temperature, seed=r)

        fns = {name: functools.partial(run, draft_model=d, gamma=g) for name, (d, g) in variants.items()}
        runs = interleaved(fns, list(enumerate(batches)), [(0, b) for b in warmup_batches(batches)])
        ar_results = runs["autoregressive"]["results"]
        ar_tps = None
        for name, (_, gamma) in variants.items():
            result = runs[name]
            gens = result["results"]
            stats = [g.stats for g in gens]
            if any(s["compile_seconds"] for s in stats):
                print(f"warning: {name} compiled during a timed repeat", file=sys.stderr)
            row = {
                "variant": "autoregressive" if gamma == 0 else "speculative",
                "batch": batch,
                "temperature": temperature,
                "gamma": gamma,
                **throughput(result["seconds"], [s["num_new_tokens"] for s in stats]),
            }
            ar_tps = ar_tps or row["tokens_per_s"]
            row["speedup"] = row["tokens_per_s"] / ar_tps
            if gamma:
                row.update(aggregate_spec(stats))
            ttft = spread(1e3 * s["prefill_seconds"] for s in stats)
            row.update(ttft_ms=ttft["median"], ttft_ms_min=ttft["min"], ttft_ms_max=ttft["max"])
            row["compile_s"] = sum(g.stats["first_compile_seconds"] for g in result["warmup"])
            if gamma and temperature == 0:
                same = sum(
                    a == b
                    for ar, sp in zip(ar_results, gens, strict=True)
                    for a, b in zip(ar.tokens, sp.tokens, strict=True)
                )
                total = sum(len(g.tokens) for g in gens)
                row["identical_to_ar"] = f"{same}/{total}"
                identity["same"] += same
                identity["rows"] += total
                covered.update(tuple(p) for b in batches for p in b)
                checked.add(gamma)
            rows.append(row)
            print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    summary = [
        {
            "check": "greedy identity: speculative tokens == autoregressive tokens, same batch",
            "identical_rows": f"{identity['same']}/{identity['rows']}"
            if identity["rows"]
            else "not run (no temperature 0)",
            "prompts_covered": f"{len(covered)}/{len(prompts)}",
            "gammas": ",".join(map(str, sorted(checked))),
            "batch_sizes": ",".join(map(str, batch_sizes)),
        }
    ]
    if identity["rows"] and identity["same"] != identity["rows"]:
        print("warning: greedy speculative output differs from autoregressive", file=sys.stderr)
    return rows, {"greedy identity": summary}


# --- suite: peer (HF transformers in .venv-ref) -----------------------------------------------


def resolve_python(path: str) -> str:
    if os.path.isabs(path) or os.path.exists(path):
        return path
    return os.path.join(ROOT, path)


def peer_unavailable(python: str) -> str | None:
    """Why the peer suite cannot run with this interpreter, or None when it can."""
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        return f"--peer_python={FLAGS.peer_python}: no such interpreter"
    if FLAGS.quick:  # the fake worker needs nothing but the standard library
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


def suite_peer():
    """This project vs HF transformers on the same pair, prompts and machine, greedy, alternating.

    HF runs in --peer_python (a worker process that loads both models once); repeat r runs
    prompt r (cycling) through all four systems, the starting system rotating. Each system's
    time is the wall time of its generate call alone (HF: measured inside the worker).
    """
    python = resolve_python(FLAGS.peer_python)
    reason = peer_unavailable(python)
    if reason:
        print(f"peer suite skipped: {reason}. Install the reference stack with: {PEER_INSTALL}")
        return None
    threads = os.cpu_count()
    if FLAGS.quick:
        worker_args = ["--fake"]
    else:
        from models import registry

        paths = [str(registry.fetch_gguf(name)) for name in (FLAGS.model, FLAGS.draft)]
        worker_args = [f"--target={paths[0]}", f"--draft={paths[1]}", f"--threads={threads}"]
    print(
        f"peer: loading HF transformers in {python} (torch threads = {threads} = CPU cores) ...", flush=True
    )
    worker = PeerWorker(python, worker_args)  # loads before ours: the two loads' peaks never overlap
    try:
        target, draft = load_pair()
        prompts = token_prompts(target.tokenizer)
        n, gamma = FLAGS.max_new_tokens, FLAGS.gamma

        def ours(prompt, draft_model):
            start = time.perf_counter()
            gen = run_generate(target, [prompt], draft_model, gamma, 0.0)
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
        repeat_prompts = [prompts[r % len(prompts)] for r in range(FLAGS.repeats)]
        runs = interleaved(
            systems, repeat_prompts, [b[0] for b in warmup_batches([[p] for p in repeat_prompts])]
        )
    finally:
        worker.close()

    names = list(systems)
    hf_plain, hf_assisted, ours_ar, ours_spec = names
    rows = {}
    for name in names:
        results = runs[name]["results"]
        row = {
            "system": name,
            **throughput([r["seconds"] for r in results], [len(r["tokens"]) for r in results]),
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
        per_repeat = [
            (len(a["tokens"]) / a["seconds"]) / (len(b["tokens"]) / b["seconds"])
            for a, b in zip(runs[name]["results"], runs[best_hf]["results"], strict=True)
        ]
        paired = spread(per_repeat)
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
                "prompt": PROMPTS[prompts.index(prompt)],
                "ours_spec_equals_hf_plain": diff is None,
                "first_difference_at": "" if diff is None else diff,
                "ours_ar_equals_ours_spec": out[ours_ar] == out[ours_spec],
                "hf_plain_equals_hf_assisted": out[hf_plain] == out[hf_assisted],
                "ours_ar_equals_hf_plain": out[ours_ar] == out[hf_plain],
            }
        )
    agree = sum(a["ours_spec_equals_hf_plain"] for a in agreement)
    summary = {
        "system": "summary",
        "ours_spec_over_best_hf": rows[ours_spec]["ratio_to_best_hf"],
        "best_hf": best_hf,
        "greedy_outputs_agree": f"{agree}/{len(agreement)} prompts",
    }
    print(f"peer: worker {json.dumps({k: v for k, v in worker.info.items() if k != 'ready'})}", flush=True)
    hf_rss = max(r.get("peak_rss_mb", 0) for name in (hf_plain, hf_assisted) for r in runs[name]["results"])
    extra_info = {
        "peer_worker": {k: v for k, v in worker.info.items() if k != "ready"},
        "peer_worker_peak_rss_mb": round(hf_rss),
        "torch_threads": f"{threads} (torch.set_num_threads = os.cpu_count(); XLA:CPU uses every core too)",
    }
    return [*rows.values(), summary], {"greedy agreement per prompt": agreement}, extra_info


# --- suite: roofline --------------------------------------------------------------------------


def measure_bandwidth(megabytes: int, repeats: int) -> list[dict]:
    """GB/s of a large array copy (read + write counted) and of a large array sum (read only),
    on one thread and on every core. A decode step mostly reads (its weights), so the read
    figure is the tighter ceiling for it; the copy is the classic STREAM-style measure."""
    src = np.ones(megabytes * 2**20 // 8, np.float64)
    dst = np.zeros_like(src)  # written once, so no page faults inside the timed copies
    threads = os.cpu_count() or 1
    step = -(-src.size // threads)
    bounds = [(i, min(i + step, src.size)) for i in range(0, src.size, step)]
    pool = concurrent.futures.ThreadPoolExecutor(threads)  # numpy releases the GIL while copying

    def parallel_copy():
        list(pool.map(lambda b: np.copyto(dst[b[0] : b[1]], src[b[0] : b[1]]), bounds))

    def parallel_sum():
        list(pool.map(lambda b: src[b[0] : b[1]].sum(), bounds))

    methods = {  # name: (fn, bytes moved per call)
        "numpy copy, 1 thread": (lambda: np.copyto(dst, src), 2 * src.nbytes),
        f"numpy copy, {threads} threads": (parallel_copy, 2 * src.nbytes),
        "numpy sum (read only), 1 thread": (src.sum, src.nbytes),
        f"numpy sum (read only), {threads} threads": (parallel_sum, src.nbytes),
    }
    runs = timed_interleaved({name: fn for name, (fn, _) in methods.items()}, repeats)
    pool.shutdown()
    rows = []
    for name, t in runs.items():
        gbs = methods[name][1] / 1e9
        rows.append(
            {
                "method": name,
                "kind": "read" if "sum" in name else "copy",
                "array_mb": megabytes,
                "gb_per_s": gbs / t["median"],
                "gb_per_s_min": gbs / t["max"],
                "gb_per_s_max": gbs / t["min"],
            }
        )
    return rows


def step_bytes(model, batch: int, tokens_per_row: int, cache_slots: int) -> dict:
    """Bytes one model call reads: every weight once, but of the input embedding table only the
    B * T rows looked up (unless the head is tied to it, which reads it whole), plus the KV
    cache at cache_slots positions (the XLA attention reads every slot of the cache)."""
    cfg = model.config
    weights = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(model.params)[0]:
        keys = [str(getattr(k, "key", k)) for k in path]
        if keys[0] == "embed" and not cfg.tie_embeddings:
            weights += batch * tokens_per_row * leaf.shape[-1] * leaf.dtype.itemsize
        else:
            weights += leaf.size * leaf.dtype.itemsize
    itemsize = jnp.dtype(cfg.jnp_dtype).itemsize
    kv = 2 * cfg.num_layers * batch * cache_slots * cfg.num_kv_heads * cfg.head_dim * itemsize
    return {"weights": weights, "kv": kv}


def suite_roofline():
    """Bytes per step against the machine's measured bandwidth: the floor on step time.

    Times the project's own compiled calls with params as jit arguments and the state donated:
    spec_jax.decode.ar_step (a T = 1 decode step: model call + warp + draw + commit) for the
    target and for the draft, and the target's model call with T = gamma + 1 (verification).
    """
    from models.transformer import forward
    from spec_jax import decode
    from spec_jax.sampling import SamplingParams

    bandwidth = measure_bandwidth(FLAGS.bandwidth_mb, max(3, FLAGS.repeats // 2))
    best_gbs = max(r["gb_per_s"] for r in bandwidth if r["kind"] == "copy")
    read_gbs = max(r["gb_per_s"] for r in bandwidth if r["kind"] == "read")
    target, draft = load_pair()
    batch, slots, gamma, warm = FLAGS.batch_size, FLAGS.context, FLAGS.gamma, 2
    steps = FLAGS.repeats + warm + 1
    if slots <= steps + 1:
        raise common.UsageError(f"--context must exceed repeats + {warm + 2}, got {slots}")

    def ar_step_call(model):
        static = decode.ARStatic(model.config, SamplingParams(0.0), steps, slots)
        state = decode.ARState(  # as if mid-generation: the steps write the last `steps` slots
            cache=decode.init_cache(model.config, batch, slots),
            out=decode.new_output(batch, steps, 0),
            last_token=jnp.ones((batch,), jnp.int32),
            length=jnp.full((batch,), slots - steps, jnp.int32),
            key=jax.random.key(0),
            steps=jnp.zeros((), jnp.int32),
        )
        eos = jnp.asarray(-1, jnp.int32)
        exe, compile_s = decode.compiled(
            "bench_ar_step", decode.ar_step, static, (model.params, state, eos), (1,)
        )
        box = {"state": state}

        def call(_):
            box["state"] = exe(model.params, box["state"], eos)
            return box["state"]

        return call, compile_s, 1

    def verify_call(model):
        width = gamma + 1
        cache = decode.init_cache(model.config, batch, slots)
        tokens = jnp.ones((batch, width), jnp.int32)
        positions = jnp.broadcast_to(slots - width + jnp.arange(width, dtype=jnp.int32), (batch, width))

        def model_call(config, params, tokens, positions, cache):
            return forward(config, params, tokens, positions, cache)

        args = (model.params, tokens, positions, cache)
        exe, compile_s = decode.compiled("bench_model_call", model_call, model.config, args, (3,))
        box = {"cache": cache}

        def call(_):
            logits, box["cache"] = exe(model.params, tokens, positions, box["cache"])
            return logits

        return call, compile_s, width

    calls = {
        "target decode step (T=1)": (target, ar_step_call),
        "draft decode step (T=1)": (draft, ar_step_call),
        f"target verify call (T={gamma + 1})": (target, verify_call),
    }
    fns, meta = {}, {}
    for name, (model, make) in calls.items():
        fns[name], compile_s, width = make(model)
        meta[name] = (model, compile_s, width)
    runs = interleaved(fns, [None] * FLAGS.repeats, [None] * warm)
    rows = []
    for name, (model, compile_s, width) in meta.items():
        nbytes = step_bytes(model, batch, width, slots)
        total = nbytes["weights"] + nbytes["kv"]
        floor_s = total / (best_gbs * 1e9)
        t = spread(runs[name]["seconds"])
        rows.append(
            {
                "call": name,
                "model": model.config.name,
                "batch": batch,
                "cache_slots": slots,
                "weight_mb": nbytes["weights"] / 2**20,
                "kv_mb": nbytes["kv"] / 2**20,
                "floor_ms": 1e3 * floor_s,
                "step_ms": 1e3 * t["median"],
                "step_ms_min": 1e3 * t["min"],
                "step_ms_max": 1e3 * t["max"],
                "step_over_floor": t["median"] / floor_s,
                "step_over_read_floor": t["median"] / (total / (read_gbs * 1e9)),
                "achieved_gb_per_s": total / t["median"] / 1e9,
                "compile_s": compile_s,
            }
        )
    step_ms = rows[0]["step_ms"]
    rows[2]["verify_over_target_step"] = rows[2]["step_ms"] / step_ms
    return (
        rows,
        {"memory bandwidth": bandwidth},
        {"bandwidth_gb_per_s_used": best_gbs, "read_gb_per_s": read_gbs},
    )


# --- output -----------------------------------------------------------------------------------


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1 else f"{v:.2f}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace("|", "\\|")  # one table row


def markdown(rows: list[dict]) -> str:
    """A Markdown table; a column `x` with siblings `x_min` and `x_max` prints as `x [min, max]`."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    ranged = {k for k in keys if f"{k}_min" in keys and f"{k}_max" in keys}
    shown = [k for k in keys if not any(k in (f"{r}_min", f"{r}_max") for r in ranged)]

    def cell(row, k):
        if k not in row:
            return ""
        if k in ranged and f"{k}_min" in row:
            return f"{_fmt(row[k])} [{_fmt(row[f'{k}_min'])}, {_fmt(row[f'{k}_max'])}]"
        return _fmt(row[k])

    header = [f"{k} [min, max]" if k in ranged else k for k in shown]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(shown)]
    lines += ["| " + " | ".join(cell(r, k) for k in shown) + " |" for r in rows]
    return "\n".join(lines)


def write_csv(path: str, rows: list[dict]) -> None:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys, lineterminator="\n")
        writer.writeheader()
        writer.writerows({k: repr(v) if isinstance(v, float) else v for k, v in r.items()} for r in rows)
    os.replace(tmp, path)


def apply_defaults(suite: str) -> None:
    """Sets the flags left unset on the command line to this suite's defaults (or --quick's)."""
    for name, value in DEFAULTS[suite].items():
        if not FLAGS[name].present:
            FLAGS[name].value = value
    if not FLAGS["num_prompts"].present:
        FLAGS.num_prompts = len(PROMPTS)
    if not 1 <= FLAGS.num_prompts <= len(PROMPTS):
        raise common.UsageError(f"--num_prompts must be in [1, {len(PROMPTS)}], got {FLAGS.num_prompts}")
    if FLAGS.quick:
        FLAGS.repeats, FLAGS.max_new_tokens, FLAGS.num_prompts = 2, 8, 2
        FLAGS.batch_sizes, FLAGS.gammas, FLAGS.temperatures = QUICK_SWEEP
        FLAGS.context, FLAGS.bandwidth_mb, FLAGS.gamma = 32, 16, 2


def run_suite(suite: str) -> None:
    """Runs one suite and writes its files; a skipped suite (peer without torch) writes nothing."""
    apply_defaults(suite)
    start = time.perf_counter()
    result = {
        "loop": suite_loop,
        "overhead": suite_overhead,
        "decode": suite_decode,
        "peer": suite_peer,
        "roofline": suite_roofline,
    }[suite]()
    if result is None:
        return
    rows, sections, *extra = result
    info = machine()
    info.update(
        suite=suite,
        model="quick (tiny random)" if FLAGS.quick else FLAGS.model,
        draft=FLAGS.draft if suite in REAL_SUITES and not FLAGS.quick else None,
        max_new_tokens=FLAGS.max_new_tokens,
        repeats=FLAGS.repeats,
        peak_rss_mb=round(peak_rss_mb()),
        suite_seconds=round(time.perf_counter() - start, 1),
        **(extra[0] if extra else {}),
    )
    tables = [markdown(rows)] + [f"## {title}\n\n{markdown(t)}" for title, t in sections.items() if t]
    text = "\n\n".join(tables)
    print(f"# {suite}\n\n{text}\n", flush=True)
    os.makedirs(FLAGS.output_dir, exist_ok=True)
    base = os.path.join(FLAGS.output_dir, f"{suite}{'-quick' if FLAGS.quick else ''}")
    header = "\n".join(f"- {k}: {v}" for k, v in info.items())
    md_tmp = base + ".md.tmp"
    with open(md_tmp, "w") as f:
        f.write(f"# Benchmark: {suite}\n\n{header}\n\n{text}\n")
    os.replace(md_tmp, base + ".md")
    write_csv(base + ".csv", rows)
    common.write_json_atomic(base + ".json", {"info": info, "rows": rows, "sections": sections})


def main(argv):
    if len(argv) > 1:
        raise common.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    unknown = [s for s in FLAGS.suite if s not in SUITES]
    if unknown or not FLAGS.suite:
        raise common.UsageError(
            f"--suite: each value must be one of {', '.join(SUITES)}, got {','.join(FLAGS.suite)!r}"
        )
    suites = [s for s in SUITES if s in FLAGS.suite]
    for suite in suites:  # every flag checked before anything runs
        apply_defaults(suite)
        sweep()
    for suite in suites:
        run_suite(suite)


if __name__ == "__main__":
    common.run(main)
