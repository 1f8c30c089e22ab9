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
- `longprompt`: config.longprompt_concurrency running streams send the prompt set's prompts back
  to back (greedy, config.longprompt_max_tokens each) while one long prompt of about
  config.longprompt_tokens tokens (a standard-library source file, LONGPROMPT_REPLY_TOKENS new
  tokens) arrives (run_longprompt). Reported: the running streams' inter-token latency over the
  run and over the window from the long prompt's send to its first token, the longest gap
  between a stream's events in that window, and the long prompt's time to first token (issue 52:
  the running streams' p99 stays <= 2x their p50 while a 2,000-token prompt arrives).
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
from models import corpora, registry
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
    "longprompt_concurrency": (1, 64),
    "longprompt_max_tokens": (1, 4096),
    "longprompt_tokens": (16, 32768),
    "longprompt_lead_ms": (0, 60_000),
}
TUPLE_RANGES = {
    "concurrency": (int, 1, 64),
    "mixed_concurrency": (int, 1, 64),
    "chat_concurrency": (int, 1, 64),
    "stops_concurrency": (int, 1, 64),
}
PEERS = ("llama", "llama-plain")  # llama-server with the draft model (draft-simple), and without
WORKLOADS = ("plain", "mixed", "chat", "stops", "longprompt")
# The stops load's stop strings: a completion ends before the next top-level statement
STOP_STRINGS = ("\ndef", "\nclass", "\nif", "\n#", "\nprint")
MIXED_TEMPERATURE = 0.7
MIXED_TOP_P = 0.9
MIXED_SEED = 1000  # the seed of the mixed load's request i (sampled ones): MIXED_SEED + i
# llama-server's sampler chain for a sampled request: the warp of spec_jax.sampling, by name
LLAMA_SAMPLERS = ("temperature", "top_p")
CHAT_SYSTEM_PROMPT = os.path.join(ROOT, "experiments", "prompts", "chat_system.txt")
LONGPROMPT_REPLY_TOKENS = 8  # the longprompt load's long prompt: its new tokens
# Characters of source text taken per token asked before the cut to tokens (Python source runs
# 3-4 characters a token with the Qwen2.5 tokenizer, 1 with a byte-level one)
LONGPROMPT_CHARS_PER_TOKEN = 6
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
    config.workloads = ("plain",)  # WORKLOADS: plain, mixed, chat, stops, longprompt
    config.mixed_concurrency = (2,) if quick else (1, 4, 8)  # the mixed load's concurrencies
    config.chat_concurrency = (2,) if quick else (8,)  # chat: conversations at a time
    config.conversations = 2 if quick else 8  # chat: conversations, each of `turns` turns
    config.turns = 3
    # chat: the system prompt's first N characters, whole lines (0: all of it; the quick mode's
    # byte-level models read a character as a token)
    config.system_prompt_chars = 120 if quick else 0
    config.stops_concurrency = (2,) if quick else (8,)  # stops: the code completions' concurrencies
    config.stops_max_tokens = 16 if quick else 128  # stops: tokens at most (most stop before)
    # longprompt: running streams (each sends the prompt set's prompts back to back, greedy, at
    # most this many tokens each: enough to outlast the long prompt's reading, after which they
    # are closed) while one long prompt of about longprompt_tokens tokens arrives. The long
    # prompt needs a slot of longprompt_tokens + LONGPROMPT_REPLY_TOKENS: with the full default
    # (2,000 tokens) --config.context=2560 or more (validate refuses a smaller one); llama-server's
    # slots hold 4,096 tokens each whatever config.context is (start_llama_server)
    config.longprompt_concurrency = 2 if quick else 4
    config.longprompt_max_tokens = 64 if quick else 1024
    config.longprompt_tokens = 200 if quick else 2000
    # longprompt: how long the running streams decode undisturbed (from each one's first token)
    # before the long prompt is sent
    config.longprompt_lead_ms = 100 if quick else 5000
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
    needed = config.longprompt_tokens + LONGPROMPT_REPLY_TOKENS
    if "longprompt" in workloads and config.context < needed:
        raise ValueError(
            f"context: the longprompt load's prompt of {config.longprompt_tokens} tokens and its "
            f"{LONGPROMPT_REPLY_TOKENS} new ones need --config.context={needed} or more, got {config.context}"
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


def http_post_json(url: str, body: dict, timeout: float = 60.0) -> dict:
    """The JSON answer of a POST of `body` as JSON (raises urllib.error.HTTPError on a status >= 400)."""
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=timeout) as r:
        return json.loads(r.read())


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
    temperature > 0 (then top_p and a seed of its own). long: the longprompt load's long prompt
    (the others of that load are its running streams)."""

    max_tokens: int
    prompt: str | None = None
    messages: tuple[dict, ...] | None = None
    temperature: float = 0.0
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] | None = None
    long: bool = False

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
    started: float = 0.0  # time.perf_counter() at the request's start
    # (seconds from the start, characters, output tokens so far or None where the server did not
    # say) of each streamed event that carried text
    events: tuple[tuple[float, int, int | None], ...] = ()


Record = tuple[Job, Outcome]


def _chunk_text(chunk, chat: bool) -> str:
    """The text of a streamed chunk: a chat chunk's delta content, a completion chunk's text."""
    if not chunk.choices:
        return ""
    choice = chunk.choices[0]
    if chat:
        return (choice.delta.content if choice.delta else None) or ""
    return choice.text or ""


async def stream_one(
    client: openai.AsyncOpenAI,
    model: str,
    job: Job,
    extra=None,
    first_token: asyncio.Event | None = None,
    usage_each_event: bool = False,
    until: asyncio.Event | None = None,
) -> Outcome:
    """One streamed request (usage asked for): a completion, or a chat completion where the job
    has messages. first_token, where given, is set at its first text; usage_each_event asks for
    the usage so far in every event too (vLLM's continuous_usage_stats, which ours answers and
    llama-server's schema does not hold); until, where given, closes the stream (the server
    cancels the request) at the first event after it is set, the outcome counting what came.
    Never raises for HTTP or connection errors (they are the Outcome's status)."""
    start = time.perf_counter()
    first = None
    pieces, events, tokens, prompt_tokens, drafted, accepted = [], [], None, None, 0, 0
    chat = job.messages is not None
    request = dict(model=model, max_tokens=job.max_tokens, stream=True, extra_body=extra, **job.sampling())
    request["stream_options"] = (
        {"include_usage": True, "continuous_usage_stats": True}
        if usage_each_event
        else {"include_usage": True}
    )
    try:
        if chat:
            stream = await client.chat.completions.create(messages=list(job.messages), **request)
        else:
            stream = await client.completions.create(prompt=job.prompt, **request)
        async for chunk in stream:
            now, text = time.perf_counter(), _chunk_text(chunk, chat)
            if text:
                first = first or now
                pieces.append(text)
                events.append(
                    (now - start, len(text), chunk.usage.completion_tokens if chunk.usage else None)
                )
                if first_token is not None:
                    first_token.set()
            if chunk.usage is not None:
                tokens, prompt_tokens = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
            timings = (chunk.model_extra or {}).get("timings") or {}
            drafted, accepted = timings.get("draft_n", drafted), timings.get("draft_n_accepted", accepted)
            if until is not None and until.is_set():
                await stream.close()
                break
    except openai.APIStatusError as e:
        return Outcome(e.status_code, seconds=time.perf_counter() - start, error=str(e)[:200], started=start)
    except (openai.APIConnectionError, openai.APIError) as e:
        error = f"{type(e).__name__}: {str(e)[:200]}"
        return Outcome(0, seconds=time.perf_counter() - start, error=error, started=start)
    usage = tokens is not None
    tokens = tokens if usage else len(pieces)
    counts = dict(drafted=drafted, accepted=accepted, usage=usage, prompt_tokens=prompt_tokens)
    return _streamed(start, first, pieces, events, tokens, counts)


def _streamed(start: float, first: float | None, pieces: list[str], events: list, tokens: int, counts: dict):
    """The Outcome of a stream that ended now (stream_one's): its text, timings and `counts`."""
    end = time.perf_counter()
    ttft = None if first is None else first - start
    # as vLLM's bench: (latency - time to first token) / (tokens - 1)
    tpot = (end - first) / (tokens - 1) if first is not None and tokens > 1 else None
    timing = dict(ttft=ttft, tpot=tpot, seconds=end - start, started=start, events=tuple(events))
    return Outcome(200, tokens, text="".join(pieces), **timing, **counts)


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


async def run_longprompt(
    url: str,
    model: str,
    prompts: list[str],
    long_text: str,
    concurrency: int,
    max_tokens: int,
    lead_s: float,
    extra=_no_extra,
    usage_each_event: bool = False,
):
    """The longprompt load: `concurrency` running streams, stream i sending prompts i, i + c,
    i + 2c, ... of `prompts` (cycling; greedy, max_tokens each) one after another until the long
    prompt has ended, which closes the request each runs then (the server cancels it); the long
    prompt (long_text, greedy, LONGPROMPT_REPLY_TOKENS) goes out once every stream has its first
    token (or its first request failed) and lead_s seconds more have passed. A stream whose
    request fails stops; the running requests ask for the usage in each event where
    usage_each_event (stream_one). Returns (the records: the running requests' in the order they
    ended and the long prompt's, wall seconds)."""
    client = load_client(url)
    firsts = [asyncio.Event() for _ in range(concurrency)]
    done = asyncio.Event()
    records: list = []

    async def stream(i: int):
        k = i
        while not done.is_set():
            job = Job(max_tokens, prompt=prompts[k % len(prompts)])
            outcome = await stream_one(client, model, job, extra(job), firsts[i], usage_each_event, done)
            firsts[i].set()  # also where it failed before its first token
            records.append((job, outcome))
            k += concurrency
            if outcome.status != 200:
                break

    async def long_prompt():
        await asyncio.gather(*(e.wait() for e in firsts))
        await asyncio.sleep(lead_s)
        job = Job(LONGPROMPT_REPLY_TOKENS, prompt=long_text, long=True)
        records.append((job, await stream_one(client, model, job, extra(job))))
        done.set()

    start = time.perf_counter()
    async with client:
        await asyncio.gather(long_prompt(), *(stream(i) for i in range(concurrency)))
    return records, time.perf_counter() - start


def long_texts(prompt_set: str, count: int, chars: int) -> list[tuple[tuple[str, ...], str]]:
    """`count` long prompts' source texts, disjoint: each of whole standard-library files
    (models.corpora's code documents, each headed by a comment naming it) joined until it holds
    `chars` characters, as (the files' names, the text). The held-out and grounded sets take the
    corpora's test split from its middle on (their own prompts come from its ends), the open set
    its training split. ValueError naming the field where the split runs out."""
    train, test = corpora.split(corpora.documents("code"), corpora.TRIM_TEST_FRACTION)
    docs = train if prompt_set == "open" else test[len(test) // 2 :]
    texts, names, parts = [], [], []
    for name, text in docs:
        names.append(name)
        parts.append(f"# {name}\n{text}")
        if sum(len(p) for p in parts) >= chars:
            texts.append((tuple(names), "\n".join(parts)))
            names, parts = [], []
        if len(texts) == count:
            return texts
    raise ValueError(
        f"repeats: the {prompt_set} set's source files hold {len(texts)} long prompts of "
        f"longprompt_tokens, fewer than the {count} asked (repeats + 1, the warm-up's)"
    )


def cut_to_tokens(url: str, text: str, tokens: int) -> str:
    """`text` cut to its first tokens - 1 tokens (room for a BOS) as the server at url tokenizes it
    (POST /tokenize and /detokenize, vLLM's and ours), then back to whole lines. Where the server
    does not tokenize (launch.serve answers 500 for the random models' byte-level tokenizer, whose
    encode takes no add_special_tokens), a character stands for a token (byte-level: ASCII)."""
    try:
        ids = http_post_json(url + "/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]
        cut = http_post_json(url + "/detokenize", {"tokens": ids[: tokens - 1]})["prompt"]
    except urllib.error.HTTPError as e:
        print(f"serve: longprompt: {url}/tokenize answered {e.code}: cut at {tokens - 1} characters")
        cut = text[: tokens - 1]
    return cut[: cut.rfind("\n") + 1] if "\n" in cut else cut


def event_tokens(chars: list[int], tokens: int) -> list[float]:
    """A stream's output tokens spread over its text events where the stream tells no per-event
    count (chars: each event's characters): one token an event where the stream has that many, the
    rest in proportion to the events' characters beyond one (so a server that streams a token an
    event, as llama-server does, gets 1 each). Ours tells the count (stream_one's
    usage_each_event): a chunk's events carry as many tokens each under plain decoding, while
    their characters vary 4-fold."""
    n, extra_chars = len(chars), sum(chars) - len(chars)
    if tokens <= n or extra_chars <= 0:
        return [tokens / n] * n
    return [1 + (tokens - n) * (c - 1) / extra_chars for c in chars]


@dataclasses.dataclass(frozen=True)
class Gap:
    """The wait for a stream's text event after its previous one: from `start` to `end`
    (time.perf_counter() seconds), for the event's `tokens` (event_tokens)."""

    start: float
    end: float
    tokens: float

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def per_token(self) -> float:
        """The gap split evenly over its event's tokens: the inter-token latency of each."""
        return self.seconds / self.tokens


def stream_gaps(outcome: Outcome) -> list[Gap]:
    """The Gaps of a successful stream: one for each text event after its first (the wait for the
    first is its time to first token), with its tokens: from the usage so far in each event where
    the server sent it (stream_one's usage_each_event), else event_tokens."""
    if outcome.status != 200 or len(outcome.events) < 2:
        return []
    times = [outcome.started + t for t, _, _ in outcome.events]
    tokens = event_tokens([c for _, c, _ in outcome.events], outcome.tokens)
    counts = [n for _, _, n in outcome.events]
    if None not in counts and all(b > a for a, b in zip([0, *counts], counts, strict=False)):
        tokens = [b - a for a, b in zip([0, *counts], counts, strict=False)]
    return [Gap(a, b, k) for a, b, k in zip(times, times[1:], tokens[1:], strict=False)]


def token_percentile(gaps: list[Gap], q: float) -> float | None:
    """The q-th percentile of the seconds per output token over the gaps' tokens (each gap's
    per_token weighted by its tokens); None without gaps."""
    if not gaps:
        return None
    values, weights = [g.per_token for g in gaps], [g.tokens for g in gaps]
    return float(np.percentile(values, q, weights=weights, method="inverted_cdf"))


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
    """One table row from the runs (records, wall seconds) of a system at a concurrency (for the
    longprompt load, over its running streams), and rows of the workload's own: for a chat load
    one per turn (its requests' prompt tokens and time to first token), for the longprompt load
    one of its running streams' inter-token latency while the long prompt arrives
    (longprompt_figures)."""
    outcomes = [o for records, _ in runs for job, o in records if not job.long]
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
    if workload == "longprompt":
        turns = [{"system": system.name, "running_streams": concurrency, **longprompt_figures(runs)}]
    row.update(_drafting_columns(system, ok, before, after))
    return row, turns


def longprompt_figures(runs: list) -> dict:
    """The longprompt load's figures over its runs ((records, wall seconds) each, one long prompt
    a run): the running streams' seconds per output token (stream_gaps; p50 and p99 over their
    tokens) over the whole runs, before each run's window (p50: the streams undisturbed) and over
    the window, from the long prompt's send to its first token (the gaps that overlap it); the
    window's p99 over its p50 (issue 52: at most 2) and over the p50 before it; the longest gap in
    a window and before one;
    the longest time to first token of a running request sent in a window; the fewest running
    requests that spanned a run's window; the tokens of an event (p50) before the windows and in
    them; and the long prompt's prompt tokens (the smallest over the runs), time to first token
    (p50 over the runs) and errors."""
    whole, window, before, waits, longs, through = [], [], [], [], [], []
    for records, _ in runs:
        (long,) = [o for job, o in records if job.long]
        longs.append(long)
        end = long.started + (long.ttft if long.ttft is not None else long.seconds)
        through.append(sum(o.started < long.started < end < o.started + o.seconds for _, o in records))
        for job, o in records:
            if job.long:
                continue
            gaps = stream_gaps(o)
            whole += gaps
            window += [g for g in gaps if g.end > long.started and g.start < end]
            before += [g for g in gaps if g.end <= long.started]
            if long.started <= o.started < end and o.ttft is not None:
                waits.append(o.ttft)
    ok = [o for o in longs if o.status == 200]
    window_p50, window_p99, before_p50 = (
        token_percentile(g, q) for g, q in ((window, 50), (window, 99), (before, 50))
    )
    prompt_tokens = [o.prompt_tokens for o in ok if o.prompt_tokens is not None]
    return {
        "long_prompt_tokens": min(prompt_tokens) if prompt_tokens else None,
        "long_ttft_ms": _ms(percentile([o.ttft for o in ok], 50)),
        "itl_p50_ms": _ms(token_percentile(whole, 50)),
        "itl_p99_ms": _ms(token_percentile(whole, 99)),
        "before_itl_p50_ms": _ms(before_p50),
        "window_itl_p50_ms": _ms(window_p50),
        "window_itl_p99_ms": _ms(window_p99),
        "window_p99_over_p50": _ratio(window_p99, window_p50),
        "window_p99_over_before_p50": _ratio(window_p99, before_p50),
        "longest_gap_in_window_ms": _ms(max((g.seconds for g in window), default=None)),
        "longest_gap_before_ms": _ms(max((g.seconds for g in before), default=None)),
        "sent_in_window_ttft_max_ms": _ms(max(waits, default=None)),
        "streams_through_window": min(through),
        "tokens_per_event_before": _round(percentile([g.tokens for g in before], 50)),
        "tokens_per_event_in_window": _round(percentile([g.tokens for g in window], 50)),
        "long_errors": len(longs) - len(ok),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


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


def _longprompt(systems: list[System], config, prompts: list[str]) -> tuple[list[dict], list[dict], dict]:
    """The longprompt load's rows (over its running streams), its rows of inter-token latency
    while the long prompt arrives, and what it sent. The long prompts are cut to
    config.longprompt_tokens by our server's tokenizer (the pair's, llama-server's too); the
    warm-up is the load itself with a long prompt of its own, and each timed repeat sends
    another (the same one to every system), so that no server finds its long prompt cached."""
    c = config.longprompt_concurrency
    sources = long_texts(
        config.prompt_set, config.repeats + 1, LONGPROMPT_CHARS_PER_TOKEN * config.longprompt_tokens
    )
    texts = [cut_to_tokens(systems[0].server.url, text, config.longprompt_tokens) for _, text in sources]
    sent = {s.name: 0 for s in systems}  # each system's long prompts sent so far

    def load(s, c):
        text = texts[sent[s.name]]
        sent[s.name] += 1
        max_tokens, lead = config.longprompt_max_tokens, config.longprompt_lead_ms / 1e3
        return run_longprompt(s.server.url, s.model, prompts, text, c, max_tokens, lead, s.extra_for, s.ours)

    _warm_up(systems, (c,), load)
    rows, itl, _ = measure(systems, "longprompt", (c,), config.repeats, load)
    summary = {
        "running_streams": c,
        "max_tokens": config.longprompt_max_tokens,
        "long_prompt_tokens_asked": config.longprompt_tokens,
        "long_prompt_chars": [len(t) for t in texts],
        "long_prompt_files": [list(names) for names, _ in sources],  # the warm-up's first
        "long_prompt_max_tokens": LONGPROMPT_REPLY_TOKENS,
    }
    return rows, itl, summary


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


def _overload_check(ours: System, config, prompts: list[str], summary: dict) -> dict:
    """The overload check on our server (overload): its result into summary["overload"]; returns
    the check's row."""
    result = asyncio.run(overload(ours.server.url, ours.model, prompts, config.slots, config.max_tokens))
    summary["overload"] = result
    return {
        "check": "overload: every request completes or gets 429; /health 200 after",
        "result": str(result),
    }


def _sigterm(ours: System, summary: dict) -> dict:
    """Our server stopped with SIGTERM: its exit code and last line into summary["sigterm"];
    returns the check's row."""
    code, output = ours.server.stop(timeout=120)
    last = output.strip().splitlines()[-1] if output.strip() else ""
    summary["sigterm"] = {"exit_code": code, "last_line": last}
    return {"check": "SIGTERM: exit code and last line", "result": f"{code}: {last}"}


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
    rows, checks, turns, itl = [], [], [], []
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
        if "longprompt" in config.workloads:
            long_rows, itl, summary["longprompt"] = _longprompt(systems, config, prompts)
            rows = rows + long_rows
        if config.guidellm and ("plain" in config.workloads or "mixed" not in config.workloads):
            top = max(config.concurrency)
            loads = [guidellm(config.guidellm, s, prompts, top, config.max_tokens, log_dir) for s in systems]
            summary["guidellm"] = loads
        if config.guidellm and "mixed" in config.workloads:
            summary["guidellm_mixed"] = _guidellm_mixed_loads(config, systems, prompts, log_dir)
        if config.overload:
            checks.append(_overload_check(ours, config, prompts, summary))
        checks.append(_sigterm(ours, summary))
    sections = {
        "checks": checks,
        "chat: time to first token by turn": turns,
        "longprompt: the running streams' time per output token while a long prompt arrives": itl,
        "the same load from guidellm (the registry's load tool)": summary.get("guidellm"),
        "the mixed load from guidellm (two runs at once: greedy, sampled)": summary.get("guidellm_mixed"),
    }
    return framework.Result.from_dicts(rows, sections=sections, summary=summary)
