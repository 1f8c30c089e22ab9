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
(guidellm) runs too where `config.guidellm` names its executable: the plain load at the top
concurrency (unless the workloads hold mixed and not plain), and with the `mixed` workload the
mixed load at the top of config.mixed_concurrency (guidellm_mixed: its greedy and its sampled
requests as two guidellm runs at once, guidellm having no per-request sampling field).

The load comes in workloads (config.workloads, run in this order):
- `plain`: the load above (greedy completions of the prompt set; the suite's only load before).
- `mixed`: the prompt set once each as completions, greedy and sampled interleaved (g s s g g s s
  g ...; temperature MIXED_TEMPERATURE then top-p MIXED_TOP_P, seed MIXED_SEED + its index),
  at each of config.mixed_concurrency; ours must give each greedy request the same bytes as
  that request sent alone.
- `chat`: config.conversations conversations of config.turns turns behind one long shared system
  prompt (experiments/prompts/chat_system.txt, 569 tokens with the Qwen2.5 tokenizer), c of them
  at a time for each c of config.chat_concurrency: each turn POSTs the whole conversation so
  far (the system prompt, the earlier user messages and the replies as streamed, the new user
  message) to /v1/chat/completions, greedy. The user messages are the prompt set's. Time to
  first token is reported for the first turn apart from the later ones, and per turn.
- `stops`: the prompt set's code completions (experiments/prompts/workloads: a function's
  signature and docstring; the held-out file for `heldout`, the bench file otherwise), greedy,
  config.stops_max_tokens each, with the usual stop strings of code completion (STOP_STRINGS),
  at each of config.stops_concurrency. Checks: no text holds a stop string, our texts equal each
  request sent alone, and the tokens our server computed past a stop string (its /metrics)
  per request, with its rounds per chunk.
Output tokens are the servers' own counts (`usage.completion_tokens` of each stream). llama-server
gets `cache_prompt: true` in every request (its default on every endpoint of the vendored server,
tools/server/server-schema.cpp; sent so that the setting is in the request), and for a sampled
request the sampler chain `["temperature", "top_p"]`, the order spec_jax.sampling.warp applies
them (its own default chain adds top-k 40 and min-p 0.05 and applies top-p before temperature).
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

import models
from experiments import bench_workloads, common, framework
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
    "conversations": (1, 64),
    "turns": (2, 16),
    "system_prompt_chars": (0, 1_000_000),
    "stops_max_tokens": (1, 4096),
}
TUPLE_RANGES = {
    "concurrency": (int, 1, 64),
    "mixed_concurrency": (int, 1, 64),
    "chat_concurrency": (int, 1, 64),
    "stops_concurrency": (int, 1, 64),
}
PEERS = ("llama", "llama-plain")  # llama-server with the draft model (draft-simple), and without
WORKLOADS = ("plain", "mixed", "chat", "stops")
# The stops load's stop strings: a completion ends before the next top-level statement
STOP_STRINGS = ("\ndef", "\nclass", "\nif", "\n#", "\nprint")
MIXED_TEMPERATURE = 0.7
MIXED_TOP_P = 0.9
MIXED_SEED = 1000  # the seed of the mixed load's request i (sampled ones): MIXED_SEED + i
# llama-server's sampler chain for a sampled request: the warp of spec_jax.sampling, by name
LLAMA_SAMPLERS = ("temperature", "top_p")
CHAT_SYSTEM_PROMPT = os.path.join(ROOT, "experiments", "prompts", "chat_system.txt")
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
    config.context = 512 if quick else 1024  # tokens per slot: --max_context, llama-server's -c / -np
    config.peers = () if quick else PEERS  # llama-server needs the GGUF files: not in quick mode
    config.serve_flags = ""  # more launch.serve flags, space-separated (e.g. "--gamma=4")
    config.overload = True
    config.guidellm = ""  # the guidellm executable (GUIDELLM_INSTALL), or "" to skip it
    config.workloads = ("plain",)  # WORKLOADS: plain, mixed, chat, stops
    config.mixed_concurrency = (2,) if quick else (1, 4, 8)  # the mixed load's concurrencies
    config.chat_concurrency = (2,) if quick else (8,)  # chat: conversations at a time
    config.conversations = 2 if quick else 8  # chat: conversations, each of `turns` turns
    config.turns = 3
    # chat: the system prompt's first N characters, whole lines (0: all of it; the quick mode's
    # byte-level models read a character as a token)
    config.system_prompt_chars = 120 if quick else 0
    config.stops_concurrency = (2,) if quick else (8,)  # stops: the code completions' concurrencies
    config.stops_max_tokens = 16 if quick else 128  # stops: tokens at most (most stop before)
    return config


def validate(config) -> None:
    if config.prompt_set not in common.PROMPT_SETS:
        raise ValueError(
            f"prompt_set: must be one of {', '.join(common.PROMPT_SETS)}, got {config.prompt_set!r}"
        )
    if any(p not in PEERS for p in config.peers):
        raise ValueError(f"peers: each must be one of {', '.join(PEERS)}, got {tuple(config.peers)}")
    workloads = tuple(config.workloads)
    if not workloads or len(set(workloads)) < len(workloads) or any(w not in WORKLOADS for w in workloads):
        raise ValueError(
            f"workloads: one or more of {', '.join(WORKLOADS)}, each once, got {','.join(workloads)!r}"
        )
    if "chat" in workloads and config.target in models.RANDOM_PRESETS:
        raise ValueError(
            f"workloads: chat needs a target with a chat template; {config.target} (a random model) has "
            "none (--config.target=a GGUF file or model with one)"
        )


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
    until 200 (bounded; ready_seconds: from the start of the process), `stop` sends SIGTERM and
    returns (exit code, its output)."""

    def __init__(self, cmd: list[str], port: int, log_path: str, env=None):
        self.port, self.log_path = port, log_path
        self.started, self.ready_seconds = time.monotonic(), None
        self.url = f"http://127.0.0.1:{port}"
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed by stop)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with code {self.proc.returncode}: {self.output()[-600:]}")
            if http_get(self.url + "/health", timeout=2.0)[0] == 200:
                self.ready_seconds = time.monotonic() - self.started
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


@dataclasses.dataclass(frozen=True)
class Job:
    """One request of a load: a completion (`prompt`) or a chat turn (`messages`: OpenAI's
    {"role", "content"} dicts, the last one the user's), at most max_tokens, greedy unless
    temperature > 0 (then top_p and a seed of its own)."""

    max_tokens: int
    prompt: str | None = None
    messages: tuple[dict, ...] | None = None
    temperature: float = 0.0
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] | None = None

    @property
    def sampled(self) -> bool:
        return self.temperature > 0

    @property
    def turn(self) -> int:
        """A chat job's turn: its count of user messages (1: the first); 0 for a completion."""
        return 0 if self.messages is None else sum(m["role"] == "user" for m in self.messages)

    def sampling(self) -> dict:
        """The request's sampling fields, as the openai client's keyword arguments."""
        fields = {"temperature": self.temperature, "top_p": self.top_p, "seed": self.seed}
        fields["stop"] = None if self.stop is None else list(self.stop)
        return {k: v for k, v in fields.items() if v is not None}


def greedy_jobs(prompts: list[str], max_tokens: int) -> list[Job]:
    """The plain load: each prompt once, greedy."""
    return [Job(max_tokens, prompt=p) for p in prompts]


def mixed_jobs(prompts: list[str], max_tokens: int) -> list[Job]:
    """The mixed load: each prompt once, greedy and sampled interleaved as g s s g g s s g ...
    (half of each for an even count, both from 2 prompts on; the bench and held-out sets alternate
    code and English, so each kind gets both), a sampled job i at MIXED_TEMPERATURE, MIXED_TOP_P
    and seed MIXED_SEED + i."""
    return [
        Job(max_tokens, prompt=p)
        if ((i + 1) // 2) % 2 == 0
        else Job(max_tokens, prompt=p, temperature=MIXED_TEMPERATURE, top_p=MIXED_TOP_P, seed=MIXED_SEED + i)
        for i, p in enumerate(prompts)
    ]


def stop_jobs(prompts: list[str], max_tokens: int) -> list[Job]:
    """The stops load: each prompt once, greedy, with STOP_STRINGS."""
    return [Job(max_tokens, prompt=p, stop=STOP_STRINGS) for p in prompts]


def code_prompts(prompt_set: str, n: int) -> list[str]:
    """The first n code completions of the workload suite's prompts: its held-out file for the
    held-out set, its bench file for the others."""
    records = bench_workloads.load_prompts(
        "heldout" if prompt_set == "heldout" else "bench", ("code_completion",), n
    )
    return [r["prompt"] for r in records]


def system_prompt(chars: int = 0) -> str:
    """The chat load's shared system prompt (CHAT_SYSTEM_PROMPT): its first `chars` characters cut
    back to whole lines (0: all of it)."""
    with open(CHAT_SYSTEM_PROMPT, encoding="utf-8") as f:
        text = f.read()
    if chars and len(text) > chars:
        text = text[:chars].rsplit("\n", 1)[0] + "\n"
    return text


def chat_users(prompts: list[str], conversations: int, turns: int, rotate: int = 0) -> list[list[str]]:
    """The user messages of each conversation: conversation i's turn t is prompt
    i * turns + (t + rotate) % turns of the set, cycling through it where it holds fewer. rotate:
    the warm-up's (1), so that none of its conversations opens as a timed one does."""
    return [
        [prompts[(i * turns + (t + rotate) % turns) % len(prompts)] for t in range(turns)]
        for i in range(conversations)
    ]


@dataclasses.dataclass
class Outcome:
    """One request as the client saw it: timings in seconds from its start (None: no token)."""

    status: int  # 200, or the HTTP status of the error; 0: the connection failed
    tokens: int = 0  # usage.completion_tokens where the stream reported usage, else text chunks
    ttft: float | None = None
    tpot: float | None = None
    seconds: float = 0.0
    text: str = ""
    drafted: int = 0  # llama-server's timings, where it reports them
    accepted: int = 0
    error: str = ""
    usage: bool = False  # whether the stream reported usage (tokens is then the server's count)
    prompt_tokens: int | None = None  # usage.prompt_tokens


Record = tuple[Job, Outcome]


def _chunk_text(chunk, chat: bool) -> str:
    """The text of a streamed chunk: a chat chunk's delta content, a completion chunk's text."""
    if not chunk.choices:
        return ""
    choice = chunk.choices[0]
    if chat:
        return (choice.delta.content if choice.delta else None) or ""
    return choice.text or ""


async def stream_one(client: openai.AsyncOpenAI, model: str, job: Job, extra=None) -> Outcome:
    """One streamed request (usage asked for): a completion, or a chat completion where the job
    has messages. Never raises for HTTP or connection errors (they are the Outcome's status)."""
    start = time.perf_counter()
    first = None
    pieces, tokens, prompt_tokens, drafted, accepted = [], None, None, 0, 0
    chat = job.messages is not None
    request = dict(model=model, max_tokens=job.max_tokens, stream=True, extra_body=extra, **job.sampling())
    request["stream_options"] = {"include_usage": True}
    try:
        if chat:
            stream = await client.chat.completions.create(messages=list(job.messages), **request)
        else:
            stream = await client.completions.create(prompt=job.prompt, **request)
        async for chunk in stream:
            now = time.perf_counter()
            text = _chunk_text(chunk, chat)
            if text:
                first = first or now
                pieces.append(text)
            if chunk.usage is not None:
                tokens, prompt_tokens = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
            timings = (chunk.model_extra or {}).get("timings") or {}
            drafted, accepted = timings.get("draft_n", drafted), timings.get("draft_n_accepted", accepted)
    except openai.APIStatusError as e:
        return Outcome(e.status_code, seconds=time.perf_counter() - start, error=str(e)[:200])
    except (openai.APIConnectionError, openai.APIError) as e:
        return Outcome(0, seconds=time.perf_counter() - start, error=f"{type(e).__name__}: {str(e)[:200]}")
    end = time.perf_counter()
    usage = tokens is not None
    tokens = tokens if usage else len(pieces)
    ttft = None if first is None else first - start
    # as vLLM's bench: (latency - time to first token) / (tokens - 1)
    tpot = (end - first) / (tokens - 1) if first is not None and tokens > 1 else None
    text = "".join(pieces)
    return Outcome(200, tokens, ttft, tpot, end - start, text, drafted, accepted, "", usage, prompt_tokens)


def load_client(url: str) -> openai.AsyncOpenAI:
    """The load's client: no retries, and a connection per request (llama-server closes kept-alive
    connections now and then as the next request goes out on one, which the client would report
    as a connection error)."""
    fresh = openai.DefaultAsyncHttpxClient(limits=httpx2.Limits(max_keepalive_connections=0))
    return openai.AsyncOpenAI(
        base_url=url + "/v1", api_key="none", max_retries=0, timeout=REQUEST_TIMEOUT_S, http_client=fresh
    )


def _no_extra(job: Job) -> None:
    return None


async def run_load(url: str, model: str, jobs: list[Job], concurrency: int, extra=_no_extra):
    """`jobs` through `concurrency` concurrent streams: (records in job order, wall seconds).
    extra(job): the request's extra_body (a server's own fields), or None."""
    client = load_client(url)
    order = asyncio.Queue()
    for i in range(len(jobs)):
        order.put_nowait(i)
    outcomes: list = [None] * len(jobs)

    async def worker():
        while not order.empty():
            i = order.get_nowait()
            outcomes[i] = await stream_one(client, model, jobs[i], extra(jobs[i]))

    start = time.perf_counter()
    async with client:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return list(zip(jobs, outcomes, strict=True)), time.perf_counter() - start


async def run_chat(
    url: str,
    model: str,
    system: str,
    users: list[list[str]],
    concurrency: int,
    max_tokens: int,
    extra=_no_extra,
):
    """Conversations (users[i]: conversation i's user messages) through `concurrency` concurrent
    streams, each conversation's turns in order, greedy: turn t sends the system prompt, the
    earlier turns (each user message and the reply as it streamed) and user message t. A failed
    turn ends its conversation. Returns (the records, conversation by conversation and turn by
    turn, wall seconds)."""
    client = load_client(url)
    order = asyncio.Queue()
    for i in range(len(users)):
        order.put_nowait(i)
    conversations: list = [[] for _ in users]

    async def worker():
        while not order.empty():
            i = order.get_nowait()
            messages = [{"role": "system", "content": system}]
            for user in users[i]:
                messages.append({"role": "user", "content": user})
                job = Job(max_tokens, messages=tuple(messages))
                outcome = await stream_one(client, model, job, extra(job))
                conversations[i].append((job, outcome))
                if outcome.status != 200:
                    break
                messages.append({"role": "assistant", "content": outcome.text})

    start = time.perf_counter()
    async with client:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return [r for records in conversations for r in records], time.perf_counter() - start


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
    its requests (`extra`: every request's; `sampled_extra`: a sampled request's, on top), and
    whether its acceptance comes from our /metrics."""

    name: str
    server: ServerProcess
    model: str
    extra: dict | None = None
    sampled_extra: dict | None = None
    ours: bool = False

    def extra_for(self, job: Job) -> dict | None:
        """The extra_body of `job`'s request to this server (None: nothing beyond OpenAI's)."""
        body = {**(self.extra or {}), **((self.sampled_extra or {}) if job.sampled else {})}
        return body or None


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


def summarize(
    system: System, workload: str, concurrency: int, runs: list, before: dict, after: dict
) -> tuple[dict, list[dict]]:
    """One table row from the runs (records, wall seconds) of a system at a concurrency, and for a
    chat load one row per turn (its requests' prompt tokens and time to first token)."""
    outcomes = [o for records, _ in runs for _, o in records]
    ok = [o for o in outcomes if o.status == 200]
    for o in outcomes:
        if o.status != 200:
            print(
                f"serve: {system.name}, {workload}, concurrency {concurrency}: a request failed: {o.status}: {o.error}"
            )
    tokens = sum(o.tokens for o in ok if o.usage)  # the servers' own counts
    row = {
        "system": system.name,
        "workload": workload,
        "concurrency": concurrency,
        "requests": len(outcomes),
        "output_tokens_per_s": tokens / sum(wall for _, wall in runs),
        "ttft_p50_ms": _ms(percentile([o.ttft for o in ok], 50)),
        "ttft_p99_ms": _ms(percentile([o.ttft for o in ok], 99)),
        "tpot_p50_ms": _ms(percentile([o.tpot for o in ok], 50)),
        "tpot_p99_ms": _ms(percentile([o.tpot for o in ok], 99)),
        "output_tokens": tokens,
        "errors": len(outcomes) - len(ok),
        "without_usage": sum(not o.usage for o in ok),
    }
    turns = []
    if workload == "chat":
        ttft_columns, turns = _by_turn(system, concurrency, runs)
        row.update(ttft_columns)
    row.update(_drafting_columns(system, ok, before, after))
    return row, turns


def _by_turn(system: System, concurrency: int, runs: list) -> tuple[dict, list[dict]]:
    """A chat load's time to first token by turn: returns the row's columns for the first turn
    and for the later ones (ttft_first_turn_p50_ms, ..._p99_ms, ttft_later_turns_p50_ms,
    ..._p99_ms) and one row per turn (its requests, mean prompt tokens, time to first token and
    errors)."""
    by_turn: dict[int, list[Outcome]] = {}
    for records, _ in runs:
        for job, o in records:
            by_turn.setdefault(job.turn, []).append(o)
    columns = {}
    first, later = by_turn.get(1, []), [o for t, os in by_turn.items() if t > 1 for o in os]
    for name, group in (("first_turn", first), ("later_turns", later)):
        done = [o.ttft for o in group if o.status == 200]
        columns[f"ttft_{name}_p50_ms"] = _ms(percentile(done, 50))
        columns[f"ttft_{name}_p99_ms"] = _ms(percentile(done, 99))
    turns = []
    for t, group in sorted(by_turn.items()):
        done = [o for o in group if o.status == 200]
        prompt = [o.prompt_tokens for o in done if o.prompt_tokens is not None]
        turns.append(
            {
                "system": system.name,
                "concurrency": concurrency,
                "turn": t,
                "requests": len(group),
                "prompt_tokens_mean": float(np.mean(prompt)) if prompt else None,
                "ttft_p50_ms": _ms(percentile([o.ttft for o in done], 50)),
                "ttft_p99_ms": _ms(percentile([o.ttft for o in done], 99)),
                "errors": len(group) - len(done),
            }
        )
    return columns, turns


def _drafting_columns(system: System, ok: list, before: dict, after: dict) -> dict:
    """The row's drafting columns: returns {"acceptance": accepted / drafted tokens or None},
    preceded for our server by "host_overhead_share" (its host work per step beyond its compiled
    calls, as a share of decoding time; from the /metrics counters `before` and `after` the
    runs); another server's counts come from its responses (`ok`, the successful outcomes)."""
    columns = {}
    if system.ours:
        delta = {
            k: after.get(f"spec_jax_engine_{k}_total", 0) - before.get(f"spec_jax_engine_{k}_total", 0)
            for k in _ENGINE
        }
        drafted, accepted = delta["draft_tokens"], delta["accepted_tokens"]
        # The engine's host work per step beyond its compiled calls, as a share of decoding
        device = sum(delta[f"{k}_seconds"] for k in ("decode", "prefill", "table", "compile"))
        columns["host_overhead_share"] = (
            (delta["step_seconds"] - device) / delta["decode_seconds"] if delta["decode_seconds"] else None
        )
    else:
        drafted, accepted = sum(o.drafted for o in ok), sum(o.accepted for o in ok)
    columns["acceptance"] = accepted / drafted if drafted else None
    return columns


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


def measure(
    systems: list[System], workload: str, concurrencies, repeats: int, load
) -> tuple[list, list, dict]:
    """A workload's table rows (system x concurrency), its per-turn rows (chat), and each
    system's records of the first repeat at each concurrency ({name: {c: records}}).
    load(system, c): a coroutine of (records, wall seconds), the workload's load at c."""
    rows, turns, first = [], [], {s.name: {} for s in systems}
    for c in concurrencies:
        runs = {s.name: [] for s in systems}
        before = {s.name: prometheus_values(s.server.url) for s in systems if s.ours}
        for r in range(repeats):
            for k in range(len(systems)):  # the systems alternate; who goes first rotates
                s = systems[(r + k + c) % len(systems)]
                records, wall = asyncio.run(load(s, c))
                runs[s.name].append((records, wall))
                first[s.name].setdefault(c, records)
                print(f"serve: {s.name}, {workload}, concurrency {c}, repeat {r}: {wall:.1f} s", flush=True)
        for s in systems:
            after = prometheus_values(s.server.url) if s.ours else {}
            row, by_turn = summarize(s, workload, c, runs[s.name], before.get(s.name, {}), after)
            rows.append(row)
            turns += by_turn
    return rows, turns, first


def same_texts(system: System, records: list[Record], concurrency: int, check: str) -> dict:
    """The jobs of `records` sent to `system` again through `concurrency` streams: how many of
    its texts equal the records' (byte for byte), as {"check", "result"}."""
    again, _ = asyncio.run(
        run_load(system.server.url, system.model, [j for j, _ in records], concurrency, system.extra_for)
    )
    same = sum(o.text == r.text for (_, o), (_, r) in zip(again, records, strict=True))
    return {"check": check, "result": f"{same}/{len(records)}"}


async def overload(url: str, model: str, prompts: list[str], slots: int, max_tokens: int) -> dict:
    """2 x slots concurrent streams, plus three bursts of `slots` more while they run: the count of
    each outcome (completed, 429, anything else) and /health afterwards."""
    jobs = greedy_jobs(prompts, max_tokens)
    client = load_client(url)
    async with client:
        tasks = [
            asyncio.create_task(stream_one(client, model, jobs[i % len(jobs)])) for i in range(2 * slots)
        ]
        for burst in range(3):
            await asyncio.sleep(0.5)
            tasks += [
                asyncio.create_task(stream_one(client, model, jobs[(burst + i) % len(jobs)]))
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


def _guidellm_data(path: str, prompts: list[str], max_tokens: int) -> None:
    """guidellm's data file: one JSON row a prompt. With output_tokens_count guidellm asks for
    exactly max_tokens (it sends ignore_eos, as vLLM's bench does)."""
    with open(path, "w") as f:
        f.writelines(json.dumps({"prompt": p, "output_tokens_count": max_tokens}) + "\n" for p in prompts)


def guidellm_command(
    executable: str, system: System, data: str, streams: int, count: int, report: str, body=None
) -> list[str]:
    """One guidellm run's command line: the rows of `data` to `system` through `streams`
    concurrent streams, `count` requests, its JSON report written to `report`. body: fields that
    every request of the run carries (guidellm's backend `extras`; it has no per-row field for
    sampling settings), as the backend's JSON form; without it the plain load's key=value form."""
    url, model = system.server.url, system.model
    if body:
        backend = {
            "kind": "openai_http",
            "target": url,
            "model": model,
            "request_format": "/v1/completions",
            "extras": {"body": body},
        }
        backend = json.dumps(backend)
    else:
        backend = f"kind=openai_http,target={url},model={model},request_format=/v1/completions"
    # the run's cwd is the log folder: a relative path (.venv-guidellm/bin/guidellm) is the caller's
    executable = os.path.abspath(executable) if os.sep in executable else executable
    cmd = [executable, "run", "--backend", backend, "--profile", f"kind=concurrent,streams={streams}"]
    cmd += ["--data", f"kind=json_file,path={data}", "--constraint", f"kind=max_requests,count={count}"]
    cmd += ["--output", f"kind=json,path={report}", "--disable-progress", "--disable-console"]
    return cmd


def _guidellm_report(path: str) -> dict:
    """The first benchmark of a guidellm JSON report."""
    with open(path) as f:
        return json.load(f)["benchmarks"][0]


def _guidellm_columns(bench: dict) -> dict:
    """A guidellm benchmark's own figures: output tokens/s, TTFT and TPOT (p50, p99) of its
    successful requests, requests made and errors (errored + incomplete)."""
    m, made = bench["metrics"], bench["scheduler_metrics"]["requests_made"]

    def ok(key, q):
        return round(m[key]["successful"]["percentiles"][q], 1)

    return {
        "output_tokens_per_s": round(m["output_tokens_per_second"]["successful"]["mean"], 2),
        "ttft_p50_ms": ok("time_to_first_token_ms", "p50"),
        "ttft_p99_ms": ok("time_to_first_token_ms", "p99"),
        "tpot_p50_ms": ok("time_per_output_token_ms", "p50"),
        "tpot_p99_ms": ok("time_per_output_token_ms", "p99"),
        "requests": made["total"],
        "errors": made["errored"] + made["incomplete"],
    }


def _tool_failed(system: System, proc, report: str) -> dict | None:
    if proc.returncode or not os.path.exists(report):
        return {"system": system.name, "tool": "guidellm", "error": (proc.stderr or proc.stdout)[-300:]}
    return None


def guidellm(
    executable: str, system: System, prompts: list[str], concurrency: int, max_tokens: int, folder: str
) -> dict:
    """One guidellm run (the registry's load tool, in its own venv) on `system`: the prompts through
    `concurrency` concurrent streams, max_tokens each. Returns its output tokens/s, TTFT and TPOT
    (median, p99) and request counts, read from its JSON report."""
    data = os.path.join(folder, "prompts.jsonl")
    _guidellm_data(data, prompts, max_tokens)
    report = os.path.join(folder, f"guidellm-{system.server.port}-{concurrency}.json")
    cmd = guidellm_command(executable, system, data, concurrency, len(prompts), report)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=REQUEST_TIMEOUT_S * 4, cwd=folder)
    failed = _tool_failed(system, proc, report)
    if failed:
        return failed
    columns = _guidellm_columns(_guidellm_report(report))
    return {"system": system.name, "tool": "guidellm 0.8.1", "concurrency": concurrency, **columns}


def guidellm_mixed(
    executable: str, system: System, prompts: list[str], concurrency: int, max_tokens: int, folder: str
) -> dict:
    """The mixed load from guidellm: the mixed load's greedy requests and its sampled ones
    (mixed_jobs) as two guidellm runs at once against `system`, ceil(c / 2) and floor(c / 2)
    streams (at least 1 each). guidellm sends the same body fields with every request of a run
    (its backend's `extras`), so the greedy run sends temperature 0 and the sampled run
    MIXED_TEMPERATURE, MIXED_TOP_P and the one seed MIXED_SEED; each with the server's own
    fields (System.extra_for: llama-server's cache_prompt and, sampled, its samplers).

    Returns the load's figures from the two reports' requests: output tokens / (the last end -
    the first start), TTFT and TPOT p50 / p99 over both runs' successful requests, requests and
    errors; runs_overlap_share, the share of that span in which both runs were sending (they start
    as two processes, not at one instant); and each run's own figures (guidellm's aggregates)
    under `greedy_` and `sampled_`."""
    streams = {"greedy": max(1, (concurrency + 1) // 2), "sampled": max(1, concurrency // 2)}
    procs, reports = _start_mixed_runs(executable, system, prompts, streams, max_tokens, folder)
    done = _finished(procs)
    for kind in procs:
        failed = _tool_failed(system, done[kind], reports[kind])
        if failed:
            return {**failed, "run": kind}
    return _mixed_figures(system, {kind: _guidellm_report(reports[kind]) for kind in procs}, streams)


def _start_mixed_runs(executable: str, system: System, prompts, streams: dict, max_tokens: int, folder: str):
    """({kind: the guidellm process}, {kind: its report's path}) of guidellm_mixed's runs, started."""
    jobs = mixed_jobs(prompts, max_tokens)
    procs, reports = {}, {}
    for kind in ("greedy", "sampled"):
        part = [j for j in jobs if j.sampled == (kind == "sampled")]
        if not part:
            continue
        body = {**Job(1).sampling(), **(system.extra_for(Job(1)) or {})}
        if kind == "sampled":
            sampled = Job(1, temperature=MIXED_TEMPERATURE, top_p=MIXED_TOP_P, seed=MIXED_SEED)
            body = {**sampled.sampling(), **(system.extra_for(sampled) or {})}
        data = os.path.join(folder, f"mixed-{kind}-{system.server.port}.jsonl")
        _guidellm_data(data, [j.prompt for j in part], max_tokens)
        reports[kind] = os.path.join(
            folder, f"guidellm-mixed-{kind}-{system.server.port}-{sum(streams.values())}.json"
        )
        cmd = guidellm_command(executable, system, data, streams[kind], len(part), reports[kind], body)
        procs[kind] = subprocess.Popen(
            cmd, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    return procs, reports


def _finished(procs: dict) -> dict:
    """{kind: CompletedProcess} of each run, waited for (killed past REQUEST_TIMEOUT_S * 4)."""
    done = {}
    for kind, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=REQUEST_TIMEOUT_S * 4)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        done[kind] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return done


def _mixed_figures(system: System, benches: dict, streams: dict) -> dict:
    """guidellm_mixed's figures from its runs' reports ({kind: guidellm's report})."""
    ok = [r for b in benches.values() for r in b["requests"]["successful"]]
    span = max(r["request_end_time"] for r in ok) - min(r["request_start_time"] for r in ok) if ok else 0
    parts = {kind: _guidellm_columns(b) for kind, b in benches.items()}
    # the runs start as two processes do, not at one instant: the share of the load's span in
    # which both were sending (1: wholly at once; the quick models' runs, 0.04 s each, did not
    # overlap: they started 0.24 s apart)
    windows = [_window(b) for b in benches.values()]
    overlap = None
    if len(windows) == 2 and all(windows) and span:
        overlap = max(0.0, min(w[1] for w in windows) - max(w[0] for w in windows)) / span
    return {
        "system": system.name,
        "tool": "guidellm 0.8.1, two runs at once (greedy, sampled)",
        "concurrency": sum(streams[k] for k in benches),
        "output_tokens_per_s": round(sum(r["output_tokens"] for r in ok) / span, 2) if span else None,
        "ttft_p50_ms": _round(percentile([r["time_to_first_token_ms"] for r in ok], 50)),
        "ttft_p99_ms": _round(percentile([r["time_to_first_token_ms"] for r in ok], 99)),
        "tpot_p50_ms": _round(percentile([r["time_per_output_token_ms"] for r in ok], 50)),
        "tpot_p99_ms": _round(percentile([r["time_per_output_token_ms"] for r in ok], 99)),
        "requests": sum(p["requests"] for p in parts.values()),
        "errors": sum(p["errors"] for p in parts.values()),
        "runs_overlap_share": None if overlap is None else round(overlap, 3),
        **{f"{kind}_{k}": v for kind, p in parts.items() for k, v in p.items() if k != "requests"},
    }


def _window(bench: dict) -> tuple[float, float] | None:
    """(the first start, the last end) of a guidellm benchmark's successful requests; None if none."""
    ok = bench["requests"]["successful"]
    if not ok:
        return None
    return min(r["request_start_time"] for r in ok), max(r["request_end_time"] for r in ok)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


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
        sampled = {"samplers": list(LLAMA_SAMPLERS)}
        systems.append(System(name, server, config.target, {"cache_prompt": True}, sampled))
    for s in systems:
        print(f"serve: starting {s.name} ({s.server.url}) ...", flush=True)
        s.server.wait_ready()
    return systems


def _warm_up(systems: list[System], concurrencies, load) -> None:
    """Untimed, before a workload's timed runs: load(system, c) for each system at each
    concurrency, the highest first (compiles every prompt length and row count, warms caches)."""
    for s in systems:
        for c in sorted(concurrencies, reverse=True):
            asyncio.run(load(s, c))


def _plain(systems: list[System], config, prompts: list[str]) -> tuple[list[dict], list[dict]]:
    """The plain load's rows and checks: our greedy texts at the top concurrency against those at
    the lowest, and against each peer's at the lowest."""
    jobs, warm = greedy_jobs(prompts, config.max_tokens), greedy_jobs(prompts, WARMUP_TOKENS)
    _warm_up(systems, config.concurrency, lambda s, c: run_load(s.server.url, s.model, warm, c, s.extra_for))
    rows, _, first = measure(
        systems,
        "plain",
        config.concurrency,
        config.repeats,
        lambda s, c: run_load(s.server.url, s.model, jobs, c, s.extra_for),
    )
    ours, low, top = systems[0], min(config.concurrency), max(config.concurrency)
    checks = [
        same_texts(ours, first[ours.name][low], top, f"our greedy texts at concurrency {top} = at {low}")
    ]
    for peer in systems[1:]:
        pairs = zip(first[ours.name][low], first[peer.name][low], strict=True)
        same = sum(a.text == b.text for (_, a), (_, b) in pairs)
        checks.append({"check": f"greedy texts the same as {peer.name}'s", "result": f"{same}/{len(jobs)}"})
    return rows, checks


def _jobs_load(systems: list[System], workload: str, jobs: list[Job], concurrencies, config):
    """A load of fixed jobs at each concurrency, warmed up with the load itself at full length
    (_warm_up), then measured: (its table rows, each system's records of the first repeat, our
    /metrics before and after the measured runs)."""

    def load(s, c):
        return run_load(s.server.url, s.model, jobs, c, s.extra_for)

    _warm_up(systems, concurrencies, load)
    before = prometheus_values(systems[0].server.url)
    rows, _, first = measure(systems, workload, concurrencies, config.repeats, load)
    return rows, first, (before, prometheus_values(systems[0].server.url))


def _mixed(systems: list[System], config, prompts: list[str]) -> tuple[list[dict], list[dict]]:
    """The mixed load's rows and check: our greedy texts in the load at its top concurrency
    against each of those requests sent alone. The warm-up is the load itself, at full length: a
    sampled row's programs for the longer chunks compile only once a request runs that long (on
    the quick models, a warm-up of WARMUP_TOKENS left 0.4-3.7 s of compiling to the timed run)."""
    concurrencies = config.mixed_concurrency
    rows, first, _ = _jobs_load(
        systems, "mixed", mixed_jobs(prompts, config.max_tokens), concurrencies, config
    )
    ours, top = systems[0], max(concurrencies)
    greedy = [r for r in first[ours.name][top] if not r[0].sampled]
    check = f"our greedy texts in the mixed load at concurrency {top} = each request alone"
    return rows, [same_texts(ours, greedy, 1, check)]


def _chat(systems: list[System], config) -> tuple[list[dict], list[dict]]:
    """The chat load's rows and its rows per turn. The warm-up runs the conversations at full
    length (the later turns' prompts then reach the lengths of the timed ones) with each one's
    user messages in another order, so that no timed request repeats one it sent."""
    system = system_prompt(config.system_prompt_chars)
    prompts = common.prompt_set(config.prompt_set, config.conversations * config.turns)
    users = chat_users(prompts, config.conversations, config.turns)
    warm = chat_users(prompts, config.conversations, config.turns, rotate=1)
    concurrencies = config.chat_concurrency
    _warm_up(
        systems,
        concurrencies,
        lambda s, c: run_chat(s.server.url, s.model, system, warm, c, config.max_tokens, s.extra_for),
    )
    rows, turns, _ = measure(
        systems,
        "chat",
        concurrencies,
        config.repeats,
        lambda s, c: run_chat(s.server.url, s.model, system, users, c, config.max_tokens, s.extra_for),
    )
    return rows, turns


def _stops(systems: list[System], config) -> tuple[list[dict], list[dict]]:
    """The stops load's rows and checks: no text holds a stop string (every system), our texts at
    the top concurrency equal each request alone, and our tokens computed past a stop string per
    request and rounds per chunk over the timed runs (/metrics). The warm-up is the load itself."""
    prompts = code_prompts(config.prompt_set, config.num_prompts)
    jobs, concurrencies = stop_jobs(prompts, config.stops_max_tokens), config.stops_concurrency
    ours, top = systems[0], max(concurrencies)
    rows, first, (before, after) = _jobs_load(systems, "stops", jobs, concurrencies, config)
    delta = {
        k: after.get(f"spec_jax_engine_{k}", 0) - before.get(f"spec_jax_engine_{k}", 0)
        for k in _STOPS_COUNTERS
    }
    requests = len(jobs) * len(concurrencies) * config.repeats
    checks = [
        {
            "check": f"{s.name}: texts holding a stop string",
            "result": f"{sum(any(t in o.text for t in STOP_STRINGS) for _, o in first[s.name][top])}/{len(jobs)}",
        }
        for s in systems
    ]
    checks.append(
        same_texts(
            ours, first[ours.name][top], 1, f"our stops texts at concurrency {top} = each request alone"
        )
    )
    past = delta["tokens_past_stop_total"] / requests
    per_chunk = delta["rounds_total"] / delta["chunks_total"] if delta["chunks_total"] else None
    checks.append({"check": "ours: tokens computed past a stop string per request", "result": f"{past:.2f}"})
    checks.append({"check": "ours: rounds per chunk in the stops load", "result": str(_round(per_chunk))})
    return rows, checks


_STOPS_COUNTERS = ("tokens_past_stop_total", "rounds_total", "chunks_total")


def _mixed_summary(prompts: list, max_tokens: int) -> dict:
    """What the mixed load sends: returns its greedy and sampled request counts, the sampled
    requests' temperature and top_p, and the samplers llama-server is given."""
    sampled = sum(j.sampled for j in mixed_jobs(prompts, max_tokens))
    return {
        "greedy": len(prompts) - sampled,
        "sampled": sampled,
        "temperature": MIXED_TEMPERATURE,
        "top_p": MIXED_TOP_P,
        "llama_samplers": list(LLAMA_SAMPLERS),
    }


def _chat_summary(config) -> dict:
    """What the chat load sends: returns its conversations, turns per conversation and the
    shared system prompt's length in characters."""
    return {
        "conversations": config.conversations,
        "turns": config.turns,
        "system_prompt_chars": len(system_prompt(config.system_prompt_chars)),
    }


def _guidellm_mixed_loads(config, systems, prompts, log_dir: str) -> list[dict]:
    """guidellm_mixed against each system at the top mixed concurrency. Each system's first run
    of the tool's load is untimed (a warm-up, as the suite's own loads have): on the quick models
    the first request of each run waited 1.7-1.9 s for its first token, the next ones 19-25 ms."""
    top, loads = max(config.mixed_concurrency), []
    for s in systems:
        guidellm_mixed(config.guidellm, s, prompts, top, config.max_tokens, log_dir)
        loads.append(guidellm_mixed(config.guidellm, s, prompts, top, config.max_tokens, log_dir))
    return loads


def run(config) -> framework.Result | None:
    prompts = common.prompt_set(config.prompt_set, config.num_prompts)
    log_dir = tempfile.mkdtemp(prefix="spec-jax-bench-serve-")  # the servers' output, kept for a look
    print(f"serve: the servers' logs are in {log_dir}", flush=True)
    summary = {
        "prompt_set": config.prompt_set,
        "slots": config.slots,
        "max_tokens": config.max_tokens,
        "workloads": list(config.workloads),
    }
    rows, checks, turns = [], [], []
    with contextlib.ExitStack() as stack:
        systems = _start_systems(config, stack, log_dir)
        ours = systems[0]
        # from each process's start to /health 200 (the peers start while ours loads)
        summary["ready_seconds"] = {s.name: _round(s.server.ready_seconds) for s in systems}
        checks.append({"check": "seconds from start to /health 200", "result": str(summary["ready_seconds"])})
        if "plain" in config.workloads:
            plain_rows, plain_checks = _plain(systems, config, prompts)
            rows, checks = rows + plain_rows, checks + plain_checks
        if "mixed" in config.workloads:
            mixed_rows, mixed_checks = _mixed(systems, config, prompts)
            rows, checks = rows + mixed_rows, checks + mixed_checks
            summary["mixed"] = _mixed_summary(prompts, config.max_tokens)
        if "stops" in config.workloads:
            stops_rows, stops_checks = _stops(systems, config)
            rows, checks = rows + stops_rows, checks + stops_checks
        if "chat" in config.workloads:
            chat_rows, turns = _chat(systems, config)
            rows = rows + chat_rows
            summary["chat"] = _chat_summary(config)
        if config.guidellm and ("plain" in config.workloads or "mixed" not in config.workloads):
            top = max(config.concurrency)
            loads = [guidellm(config.guidellm, s, prompts, top, config.max_tokens, log_dir) for s in systems]
            summary["guidellm"] = loads
        if config.guidellm and "mixed" in config.workloads:
            summary["guidellm_mixed"] = _guidellm_mixed_loads(config, systems, prompts, log_dir)
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
        "chat: time to first token by turn": turns,
        "the same load from guidellm (the registry's load tool)": summary.get("guidellm"),
        "the mixed load from guidellm (two runs at once: greedy, sampled)": summary.get("guidellm_mixed"),
    }
    return framework.Result.from_dicts(rows, sections=sections, summary=summary)
