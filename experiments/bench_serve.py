"""Benchmark serve: `python -m launch.serve` against llama.cpp's `llama-server` on the same GGUF
pair, as served: concurrent streamed requests from the `openai` client, the systems alternating.

Both servers run as subprocesses on 127.0.0.1 with the same number of row slots (`--max_batch` /
`-np`, continuous batching); the peers (config.peers) are llama-server with the draft model
loaded (`llama`: `-md`, draft-simple) and without it (`llama-plain`: the issue's reference, plain
decoding). llama-server is built
from the same vendored llama.cpp source as the peer suite's programs (models.kernels.llama_cpp,
in a build folder of its own with the server on). For each concurrency c, each repeat sends the
held-out prompts (greedy, `max_tokens` each) through c concurrent streams, to one system and then
the others (which goes first rotates); before the timed runs each system answers every prompt
at each concurrency with a few tokens, untimed (compiles, warms caches). Per system and concurrency it reports output tokens/s
(all output tokens / the run's wall time), time to first token and time per output token (p50,
p99: per request, as vLLM's bench: (latency - TTFT) / (tokens - 1)), acceptance (ours: the change of
/metrics' accepted / drafted counters over the runs; llama-server: its `timings` draft counts where
it reports them) and errors. Then an overload check on our server: twice its slots in concurrent
streams plus bursts, against a short queue: every request must complete or get 429, never a 5xx
or a lost request, and /health must answer 200 afterwards. A load tool from the registry
(guidellm) runs too where `config.guidellm` names its executable.
"""

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import httpx2
import ml_collections
import numpy as np
import openai
from prometheus_client.parser import text_string_to_metric_families

from experiments import common, framework
from models import registry
from models.kernels import llama_cpp

TITLE = "Benchmark serve: launch.serve against llama-server, concurrent streamed requests"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STARTUP_TIMEOUT_S = 900  # loading the pair and compiling, on a busy 2-core machine
REQUEST_TIMEOUT_S = 600
# Each prompt once per concurrency before the timed runs, this many tokens each: every prompt's
# length bucket and every row bucket the load reaches are compiled (or read from the compilation
# cache) before the clock runs. Warming the first c prompts alone left the other prompts' programs
# to the first timed repeat: 16.1 s against 12.0-13.3 s for the later ones at concurrency 1.
WARMUP_TOKENS = 4

MODEL_KEYS = ("target", "draft")
INT_RANGES = {
    "num_prompts": (1, 64),
    "max_tokens": (1, 4096),
    "repeats": (1, 100),
    "slots": (1, 64),
    "context": (64, 32768),
}
TUPLE_RANGES = {"concurrency": (int, 1, 64)}
PEERS = ("llama", "llama-plain")  # llama-server with the draft model (draft-simple), and without
# guidellm pulls in versions of huggingface_hub, click and rich other than this project's, so it
# lives in a venv of its own (gitignored); --config.guidellm=.venv-guidellm/bin/guidellm runs it.
GUIDELLM_INSTALL = "python3 -m venv .venv-guidellm && .venv-guidellm/bin/pip install guidellm==0.8.1"


def get_config(quick: bool = False) -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.target = "random" if quick else "qwen2.5-coder-1.5b"
    config.draft = "random-draft" if quick else "qwen2.5-coder-0.5b"
    config.prompt_set = "open" if quick else "heldout"  # experiments.common.PROMPT_SETS
    config.num_prompts = 4 if quick else 16
    config.max_tokens = 8 if quick else 48
    config.concurrency = (1, 2) if quick else (1, 4, 8)
    config.repeats = 1
    config.slots = 2 if quick else 8  # --max_batch and llama-server's -np
    config.context = 256 if quick else 1024  # tokens per slot: --max_context, llama-server's -c / -np
    config.peers = () if quick else PEERS  # llama-server needs the GGUF files: not in quick mode
    config.serve_flags = ""  # more launch.serve flags, space-separated (e.g. "--gamma=4")
    config.overload = True
    config.guidellm = ""  # the guidellm executable (GUIDELLM_INSTALL), or "" to skip it
    return config


def validate(config) -> None:
    if config.prompt_set not in common.PROMPT_SETS:
        raise ValueError(
            f"prompt_set: must be one of {', '.join(common.PROMPT_SETS)}, got {config.prompt_set!r}"
        )
    if any(p not in PEERS for p in config.peers):
        raise ValueError(f"peers: each must be one of {', '.join(PEERS)}, got {tuple(config.peers)}")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    """(status, body) of a GET; status 0 where nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, ""


class ServerProcess:
    """A server subprocess on 127.0.0.1:port, its output in `log`; `wait_ready` polls its /health
    until 200 (bounded), `stop` sends SIGTERM and returns (exit code, its output)."""

    def __init__(self, cmd: list[str], port: int, log_path: str, env=None):
        self.port, self.log_path = port, log_path
        self.url = f"http://127.0.0.1:{port}"
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed by stop)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with code {self.proc.returncode}: {self.output()[-600:]}")
            if http_get(self.url + "/health", timeout=2.0)[0] == 200:
                return
            time.sleep(0.5)
        raise TimeoutError(f"server not ready after {timeout} s: {self.output()[-600:]}")

    def output(self) -> str:
        if not self._log.closed:
            self._log.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def stop(self, timeout: float = 120) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode, self.output()


@dataclasses.dataclass
class Outcome:
    """One request as the client saw it: timings in seconds from its start (None: no token)."""

    status: int  # 200, or the HTTP status of the error; 0: the connection failed
    tokens: int = 0
    ttft: float | None = None
    tpot: float | None = None
    seconds: float = 0.0
    text: str = ""
    drafted: int = 0  # llama-server's timings, where it reports them
    accepted: int = 0
    error: str = ""


async def stream_one(
    client: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int, extra=None
) -> Outcome:
    """One streamed completion (greedy, usage asked for) as an Outcome; never raises for HTTP or
    connection errors (they are the Outcome's status)."""
    start = time.perf_counter()
    first = None
    pieces, tokens, drafted, accepted = [], None, 0, 0
    try:
        stream = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].text:
                first = first or now
                pieces.append(chunk.choices[0].text)
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            timings = (chunk.model_extra or {}).get("timings") or {}
            drafted, accepted = timings.get("draft_n", drafted), timings.get("draft_n_accepted", accepted)
    except openai.APIStatusError as e:
        return Outcome(e.status_code, seconds=time.perf_counter() - start, error=str(e)[:200])
    except (openai.APIConnectionError, openai.APIError) as e:
        return Outcome(0, seconds=time.perf_counter() - start, error=f"{type(e).__name__}: {str(e)[:200]}")
    end = time.perf_counter()
    tokens = tokens if tokens is not None else len(pieces)
    ttft = None if first is None else first - start
    # as vLLM's bench: (latency - time to first token) / (tokens - 1)
    tpot = (end - first) / (tokens - 1) if first is not None and tokens > 1 else None
    return Outcome(200, tokens, ttft, tpot, end - start, "".join(pieces), drafted, accepted)


def load_client(url: str) -> openai.AsyncOpenAI:
    """The load's client: no retries, and a connection per request (llama-server closes kept-alive
    connections now and then as the next request goes out on one, which the client would report
    as a connection error)."""
    fresh = openai.DefaultAsyncHttpxClient(limits=httpx2.Limits(max_keepalive_connections=0))
    return openai.AsyncOpenAI(
        base_url=url + "/v1", api_key="none", max_retries=0, timeout=REQUEST_TIMEOUT_S, http_client=fresh
    )


async def run_load(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int, extra=None):
    """`prompts` through `concurrency` concurrent streams: (outcomes in prompt order, wall seconds)."""
    client = load_client(url)
    order = asyncio.Queue()
    for i in range(len(prompts)):
        order.put_nowait(i)
    outcomes: list = [None] * len(prompts)

    async def worker():
        while not order.empty():
            i = order.get_nowait()
            outcomes[i] = await stream_one(client, model, prompts[i], max_tokens, extra)

    start = time.perf_counter()
    async with client:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outcomes, time.perf_counter() - start


def percentile(values, q: float) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.percentile(values, q)) if values else None


def prometheus_values(url: str) -> dict[str, float]:
    """GET /metrics as {sample name: value} (samples without labels)."""
    status, text = http_get(url + "/metrics")
    if status != 200:
        return {}
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


@dataclasses.dataclass
class System:
    """A server under test: its name, base URL, the model id it answers to, the `extra_body` of
    its requests, and whether its acceptance comes from our /metrics."""

    name: str
    server: ServerProcess
    model: str
    extra: dict | None = None
    ours: bool = False


def start_ours(config, port: int, log_dir: str, slots: int, max_queue: int) -> ServerProcess:
    cmd = [sys.executable, "-m", "launch.serve", f"--target={config.target}", f"--draft={config.draft}"]
    cmd += [f"--port={port}", f"--max_batch={slots}", f"--max_queue={max_queue}", "--grace_period=5"]
    cmd += [f"--max_context={config.context}"]
    cmd += config.serve_flags.split()
    env = {**os.environ, "PYTHONPATH": ROOT}
    return ServerProcess(cmd, port, os.path.join(log_dir, f"serve-{port}.log"), env=env)


def start_llama_server(config, port: int, log_dir: str, draft: bool = True) -> ServerProcess:
    """llama-server on the pair's GGUF files: -np slots, continuous batching, the draft model
    (draft: draft-simple, its default of up to 3 drafts a round; else plain decoding), a
    context of config.context tokens per slot, os.cpu_count() threads."""
    binary = llama_cpp.build(("llama-server",), server=True) / "bin" / "llama-server"
    target, draft_file = (str(registry.fetch_gguf(name)) for name in (config.target, config.draft))
    threads = str(os.cpu_count() or 2)
    cmd = [str(binary), "-m", target]
    if draft:
        cmd += ["-md", draft_file, "--spec-type", "draft-simple"]
    cmd += ["-np", str(config.slots), "-cb"]
    cmd += [
        "-c",
        str(4096 * config.slots),
        "-t",
        threads,
        "-tb",
        threads,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    cmd += ["--temp", "0", "--seed", "0", "--metrics", "--no-webui"]
    return ServerProcess(cmd, port, os.path.join(log_dir, f"llama-server-{port}.log"))


def summarize(system: System, concurrency: int, runs: list, before: dict, after: dict) -> dict:
    """One table row from the runs (outcomes, wall seconds) of a system at a concurrency."""
    outcomes = [o for result, _ in runs for o in result]
    ok = [o for o in outcomes if o.status == 200]
    for o in outcomes:
        if o.status != 200:
            print(f"serve: {system.name}, concurrency {concurrency}: a request failed: {o.status}: {o.error}")
    tokens = sum(o.tokens for o in ok)
    row = {
        "system": system.name,
        "concurrency": concurrency,
        "requests": len(outcomes),
        "output_tokens_per_s": tokens / sum(wall for _, wall in runs),
        "ttft_p50_ms": _ms(percentile([o.ttft for o in ok], 50)),
        "ttft_p99_ms": _ms(percentile([o.ttft for o in ok], 99)),
        "tpot_p50_ms": _ms(percentile([o.tpot for o in ok], 50)),
        "tpot_p99_ms": _ms(percentile([o.tpot for o in ok], 99)),
        "output_tokens": tokens,
        "errors": len(outcomes) - len(ok),
    }
    if system.ours:
        delta = {
            k: after.get(f"spec_jax_engine_{k}_total", 0) - before.get(f"spec_jax_engine_{k}_total", 0)
            for k in _ENGINE
        }
        drafted, accepted = delta["draft_tokens"], delta["accepted_tokens"]
        # The engine's host work per step beyond its compiled calls, as a share of decoding
        device = sum(delta[f"{k}_seconds"] for k in ("decode", "prefill", "table", "compile"))
        row["host_overhead_share"] = (
            (delta["step_seconds"] - device) / delta["decode_seconds"] if delta["decode_seconds"] else None
        )
    else:
        drafted, accepted = sum(o.drafted for o in ok), sum(o.accepted for o in ok)
    row["acceptance"] = accepted / drafted if drafted else None
    return row


_ENGINE = (
    "draft_tokens",
    "accepted_tokens",
    "decode_seconds",
    "prefill_seconds",
    "table_seconds",
    "compile_seconds",
    "step_seconds",
)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1e3 * seconds, 1)


def measure(systems: list[System], config, prompts: list[str]) -> tuple[list[dict], dict]:
    """The table rows (system x concurrency) and each system's texts at concurrency 1."""
    rows, texts = [], {}
    for c in config.concurrency:
        runs = {s.name: [] for s in systems}
        before = {s.name: prometheus_values(s.server.url) for s in systems if s.ours}
        for r in range(config.repeats):
            for k in range(len(systems)):  # the systems alternate; who goes first rotates
                s = systems[(r + k + c) % len(systems)]
                outcomes, wall = asyncio.run(
                    run_load(s.server.url, s.model, prompts, c, config.max_tokens, s.extra)
                )
                runs[s.name].append((outcomes, wall))
                print(f"serve: {s.name}, concurrency {c}, repeat {r}: {wall:.1f} s", flush=True)
        for s in systems:
            after = prometheus_values(s.server.url) if s.ours else {}
            rows.append(summarize(s, c, runs[s.name], before.get(s.name, {}), after))
            if c == min(config.concurrency):
                texts[s.name] = [o.text for o in runs[s.name][0][0]]
    return rows, texts


def same_texts(texts: dict, ours: str, prompts: list[str], config, url: str) -> dict:
    """Whether our greedy texts at the highest concurrency are the ones at the lowest (byte for byte)."""
    top = max(config.concurrency)
    outcomes, _ = asyncio.run(run_load(url, config.target, prompts, top, config.max_tokens))
    same = sum(o.text == t for o, t in zip(outcomes, texts[ours], strict=True))
    return {
        "check": f"our greedy texts at concurrency {top} = at {min(config.concurrency)}",
        "result": f"{same}/{len(prompts)}",
    }


async def overload(url: str, model: str, prompts: list[str], slots: int, max_tokens: int) -> dict:
    """2 x slots concurrent streams, plus three bursts of `slots` more while they run: the count of
    each outcome (completed, 429, anything else) and /health afterwards."""
    client = load_client(url)
    async with client:
        tasks = [
            asyncio.create_task(stream_one(client, model, prompts[i % len(prompts)], max_tokens))
            for i in range(2 * slots)
        ]
        for burst in range(3):
            await asyncio.sleep(0.5)
            tasks += [
                asyncio.create_task(
                    stream_one(client, model, prompts[(burst + i) % len(prompts)], max_tokens)
                )
                for i in range(slots)
            ]
        outcomes = await asyncio.gather(*tasks)
    completed = sum(o.status == 200 and o.tokens > 0 for o in outcomes)
    refused = sum(o.status == 429 for o in outcomes)
    health = (await asyncio.to_thread(http_get, url + "/health"))[0]
    other = sorted(
        {
            f"{o.status}: {o.error[:80]}"
            for o in outcomes
            if o.status not in (200, 429) or (o.status == 200 and not o.tokens)
        }
    )
    return {
        "requests": len(outcomes),
        "completed": completed,
        "refused_429": refused,
        "other": "; ".join(other) or "none",
        "health_after": health,
        "passed": completed + refused == len(outcomes) and health == 200,
    }


def guidellm(
    executable: str, system: System, prompts: list[str], concurrency: int, max_tokens: int, folder: str
) -> dict:
    """One guidellm run (the registry's load tool, in its own venv) on `system`: the prompts through
    `concurrency` concurrent streams, max_tokens each. Returns its output tokens/s, TTFT and TPOT
    (median, p99) and request counts, read from its JSON report."""
    data = os.path.join(folder, "prompts.jsonl")
    with open(data, "w") as f:
        # guidellm then asks for exactly max_tokens (it sends ignore_eos, as vLLM's bench does)
        f.writelines(json.dumps({"prompt": p, "output_tokens_count": max_tokens}) + "\n" for p in prompts)
    report = os.path.join(folder, f"guidellm-{system.server.port}-{concurrency}.json")
    backend = (
        f"kind=openai_http,target={system.server.url},model={system.model},request_format=/v1/completions"
    )
    cmd = [executable, "run", "--backend", backend, "--profile", f"kind=concurrent,streams={concurrency}"]
    cmd += [
        "--data",
        f"kind=json_file,path={data}",
        "--constraint",
        f"kind=max_requests,count={len(prompts)}",
    ]
    cmd += ["--output", f"kind=json,path={report}", "--disable-progress", "--disable-console"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=REQUEST_TIMEOUT_S * 4, cwd=folder)
    if proc.returncode or not os.path.exists(report):
        return {"system": system.name, "tool": "guidellm", "error": (proc.stderr or proc.stdout)[-300:]}
    with open(report) as f:
        bench = json.load(f)["benchmarks"][0]
    m, made = bench["metrics"], bench["scheduler_metrics"]["requests_made"]

    def ok(key, q):
        return round(m[key]["successful"]["percentiles"][q], 1)

    return {
        "system": system.name,
        "tool": "guidellm 0.8.1",
        "concurrency": concurrency,
        "output_tokens_per_s": round(m["output_tokens_per_second"]["successful"]["mean"], 2),
        "ttft_p50_ms": ok("time_to_first_token_ms", "p50"),
        "ttft_p99_ms": ok("time_to_first_token_ms", "p99"),
        "tpot_p50_ms": ok("time_per_output_token_ms", "p50"),
        "tpot_p99_ms": ok("time_per_output_token_ms", "p99"),
        "requests": made["total"],
        "errors": made["errored"] + made["incomplete"],
    }


def _start_systems(config, stack: contextlib.ExitStack, log_dir: str) -> list[System]:
    """Our server (slots, a queue of as many) and the peers that can run here, all ready."""
    ours = start_ours(config, free_port(), log_dir, config.slots, max_queue=config.slots)
    stack.callback(ours.stop)
    systems = [System("spec-jax launch.serve", ours, config.target, ours=True)]
    for peer in config.peers:
        try:
            server = start_llama_server(config, free_port(), log_dir, draft=peer == "llama")
        except llama_cpp.Unavailable as e:
            print(f"serve: llama-server skipped: {e}")
            continue
        stack.callback(server.stop)
        name = "llama.cpp llama-server" + (" (plain)" if peer == "llama-plain" else "")
        systems.append(System(name, server, config.target))
    for s in systems:
        print(f"serve: starting {s.name} ({s.server.url}) ...", flush=True)
        s.server.wait_ready()
    return systems


def run(config) -> framework.Result | None:
    prompts = common.prompt_set(config.prompt_set, config.num_prompts)
    log_dir = tempfile.mkdtemp(prefix="spec-jax-bench-serve-")  # the servers' output, kept for a look
    print(f"serve: the servers' logs are in {log_dir}", flush=True)
    checks, summary = (
        [],
        {"prompt_set": config.prompt_set, "slots": config.slots, "max_tokens": config.max_tokens},
    )
    with contextlib.ExitStack() as stack:
        systems = _start_systems(config, stack, log_dir)
        for s in systems:  # untimed: every prompt at each concurrency (compiles, warms caches)
            for c in sorted(config.concurrency, reverse=True):
                asyncio.run(run_load(s.server.url, s.model, prompts, c, WARMUP_TOKENS, s.extra))
        rows, texts = measure(systems, config, prompts)
        ours = systems[0]
        checks.append(same_texts(texts, ours.name, prompts, config, ours.server.url))
        if len(systems) > 1:
            for peer in systems[1:]:
                same = sum(a == b for a, b in zip(texts[ours.name], texts[peer.name], strict=True))
                checks.append(
                    {"check": f"greedy texts the same as {peer.name}'s", "result": f"{same}/{len(prompts)}"}
                )
        if config.guidellm:
            top = max(config.concurrency)
            loads = [guidellm(config.guidellm, s, prompts, top, config.max_tokens, log_dir) for s in systems]
            summary["guidellm"] = loads
        if config.overload:
            result = asyncio.run(
                overload(ours.server.url, ours.model, prompts, config.slots, config.max_tokens)
            )
            summary["overload"] = result
            checks.append(
                {
                    "check": "overload: every request completes or gets 429; /health 200 after",
                    "result": str(result),
                }
            )
        code, output = ours.server.stop(timeout=120)
        last = output.strip().splitlines()[-1] if output.strip() else ""
        checks.append({"check": "SIGTERM: exit code and last line", "result": f"{code}: {last}"})
        summary["sigterm"] = {"exit_code": code, "last_line": last}
    sections = {
        "checks": checks,
        "the same load from guidellm (the registry's load tool)": summary.get("guidellm"),
    }
    return framework.Result.from_dicts(rows, sections=sections, summary=summary)
