"""The serve suite (experiments/bench_serve.py): its load client against stub servers, and its quick
mode end to end on a tiny GGUF model with a chat template.

The first stub behaves as llama-server sometimes does: it answers the first request on a
connection and closes the connection when the next request arrives on it. A client that reuses
kept-alive connections loses those requests (APIConnectionError); the suite's client must lose
none. The second records every request body and answers completions and chat completions alike,
with fewer text chunks than the tokens its usage reports, so that a count taken from the events
would differ from the servers' own."""

import asyncio
import csv
import dataclasses
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import tiny_gguf

from experiments import bench_serve, framework
from experiments.bench_serve import (
    Job,
    Outcome,
    Record,
    System,
    chat_users,
    event_tokens,
    greedy_jobs,
    longprompt_figures,
    mixed_jobs,
    run_chat,
    run_load,
    run_longprompt,
    stream_gaps,
    summarize,
    system_prompt,
)

CHUNK = {"id": "c", "object": "text_completion", "created": 0, "model": "stub"}


def _sse_body() -> bytes:
    text = dict(CHUNK, choices=[{"index": 0, "text": "hi", "finish_reason": None}])
    usage = dict(CHUNK, choices=[], usage={"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2})
    return "".join(f"data: {json.dumps(c)}\n\n" for c in (text, usage)).encode() + b"data: [DONE]\n\n"


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, dict] | None:
    """Reads one HTTP request (head and Content-Length body): (path, JSON body); None at the end
    of the stream."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    lines = head.decode().split("\r\n")
    length = 0
    for line in lines:
        if line.lower().startswith("content-length:"):
            length = int(line.split(":", 1)[1])
    body = await reader.readexactly(length)
    return lines[0].split()[1], json.loads(body or b"{}")


def _answer(writer, body: bytes, status: str = "200 OK", kind: str = "text/event-stream") -> None:
    head = f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n\r\n"
    writer.write(head.encode() + body)


async def _one_answer_per_connection(reader, writer, connections: list) -> None:
    connections.append(writer.get_extra_info("peername"))
    if await _read_request(reader):
        _answer(writer, _sse_body())
        await writer.drain()
        await _read_request(reader)  # the next request on this connection, if the client reuses it
    writer.close()  # ... is never answered


def _load(prompts: int) -> tuple[list, list]:
    async def main():
        connections = []
        server = await asyncio.start_server(
            lambda r, w: _one_answer_per_connection(r, w, connections), "127.0.0.1", 0
        )
        port = server.sockets[0].getsockname()[1]
        async with server:
            records, _ = await run_load(
                f"http://127.0.0.1:{port}", "stub", greedy_jobs(["p"] * prompts, 4), 1
            )
        return [o for _, o in records], connections

    return asyncio.run(main())


def test_the_load_client_loses_no_request_to_a_server_that_closes_kept_alive_connections():
    outcomes, connections = _load(prompts=4)
    assert [o.status for o in outcomes] == [200] * 4, [o.error for o in outcomes]
    assert [o.tokens for o in outcomes] == [1] * 4
    assert [o.text for o in outcomes] == ["hi"] * 4
    assert len(set(connections)) == 4  # a connection of its own per request


# ---- a stub that records what the suite sends ------------------------------------------------

USAGE_TOKENS = 5  # what the stub's usage reports; it streams 2 text chunks
FAIL = "fail"  # a user message or prompt the stub answers with a 503


class Recorder:
    """A stub OpenAI server on 127.0.0.1: /v1/completions and /v1/chat/completions streamed as two
    text chunks and a usage chunk of USAGE_TOKENS tokens (no usage chunk where the request's
    prompt is "no usage"); a chat reply's text is "reply N" (N counts the chat requests). Keeps
    (path, body) of every request in `requests`."""

    def __init__(self):
        self.requests: list[tuple[str, dict]] = []

    async def handle(self, reader, writer) -> None:
        request = await _read_request(reader)
        if request is not None:
            self.requests.append(request)
            path, body = request
            chat = path.endswith("/chat/completions")
            last = body["messages"][-1]["content"] if chat else body["prompt"]
            if last == FAIL:
                _answer(
                    writer, b'{"error": {"message": "no"}}', "503 Service Unavailable", "application/json"
                )
            else:
                text = (
                    f"reply {sum(p.endswith('/chat/completions') for p, _ in self.requests)}"
                    if chat
                    else "ab"
                )
                _answer(writer, self._stream(chat, text, usage=last != "no usage"))
            await writer.drain()
        writer.close()

    @staticmethod
    def _stream(chat: bool, text: str, usage: bool) -> bytes:
        half = len(text) // 2
        if chat:
            base = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "stub"}
            pieces = [
                dict(base, choices=[{"index": 0, "delta": {"role": "assistant", "content": p}}])
                for p in (text[:half], text[half:])
            ]
        else:
            pieces = [dict(CHUNK, choices=[{"index": 0, "text": p}]) for p in (text[:half], text[half:])]
        if usage:
            use = {"prompt_tokens": 7, "completion_tokens": USAGE_TOKENS, "total_tokens": 7 + USAGE_TOKENS}
            pieces.append(dict(pieces[0], choices=[], usage=use))
        return "".join(f"data: {json.dumps(c)}\n\n" for c in pieces).encode() + b"data: [DONE]\n\n"


def _with_recorder(load):
    """(the result of `await load(url)`, the requests the stub got)."""
    recorder = Recorder()

    async def main():
        server = await asyncio.start_server(recorder.handle, "127.0.0.1", 0)
        async with server:
            return await load(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")

    return asyncio.run(main()), recorder.requests


def _llama_like() -> System:
    """A System with llama-server's request fields, as the suite starts it (no process)."""
    return System(
        "peer", None, "stub", {"cache_prompt": True}, {"samplers": list(bench_serve.LLAMA_SAMPLERS)}
    )


def test_the_mixed_load_interleaves_greedy_and_sampled_each_sampled_one_with_its_own_seed():
    prompts = [f"prompt {i}" for i in range(8)]
    peer = _llama_like()
    (records, _), requests = _with_recorder(
        lambda url: run_load(url, "stub", mixed_jobs(prompts, 6), 3, peer.extra_for)
    )
    assert [o.status for _, o in records] == [200] * 8
    bodies = {body["prompt"]: body for _, body in requests}
    kinds = ["sampled" if bodies[p]["temperature"] > 0 else "greedy" for p in prompts]
    assert kinds == ["greedy", "sampled", "sampled", "greedy"] * 2
    for p, kind in zip(prompts, kinds, strict=True):
        body = bodies[p]
        assert (
            body["max_tokens"] == 6 and body["stream"] and body["stream_options"] == {"include_usage": True}
        )
        assert body["cache_prompt"] is True  # every request to llama-server
        if kind == "greedy":
            assert body["temperature"] == 0 and not {"top_p", "seed", "samplers"} & set(body)
        else:
            assert (
                body["temperature"] == bench_serve.MIXED_TEMPERATURE
                and body["top_p"] == bench_serve.MIXED_TOP_P
            )
            assert body["samplers"] == ["temperature", "top_p"]  # ours: spec_jax.sampling.warp's order
    assert [j.sampled for j in mixed_jobs(prompts[:2], 6)] == [False, True]  # both kinds from 2 prompts
    seeds = [bodies[p]["seed"] for p, kind in zip(prompts, kinds, strict=True) if kind == "sampled"]
    assert len(set(seeds)) == len(seeds) == 4
    # ours gets no llama-server fields (its schema refuses unknown ones)
    ours = System("ours", None, "stub", ours=True)
    assert all(ours.extra_for(j) is None for j in mixed_jobs(prompts, 6))


def test_output_tokens_are_the_servers_usage_counts_not_the_stream_events():
    prompts = ["a", "b", "no usage", "c"]
    (records, wall), _ = _with_recorder(lambda url: run_load(url, "stub", mixed_jobs(prompts, 6), 2))
    outcomes = {j.prompt: o for j, o in records}
    assert outcomes["a"].usage and outcomes["a"].tokens == USAGE_TOKENS and outcomes["a"].text == "ab"
    assert not outcomes["no usage"].usage
    row, turns = summarize(System("peer", None, "stub"), "mixed", 2, [(records, wall)], {}, {})
    assert row["output_tokens"] == 3 * USAGE_TOKENS  # not 2 events a request, and nothing without usage
    assert row["without_usage"] == 1 and row["errors"] == 0 and row["requests"] == 4
    assert row["workload"] == "mixed" and turns == []


def test_each_chat_turn_sends_the_whole_conversation_so_far():
    users = [["u0a", "u0b", "u0c"], ["u1a", "u1b", "u1c"], ["u2a", FAIL, "u2c"]]
    (records, _), requests = _with_recorder(lambda url: run_chat(url, "stub", "SYSTEM", users, 2, 9))
    assert all(path == "/v1/chat/completions" for path, _ in requests)
    sent = {tuple((m["role"], m["content"]) for m in body["messages"]): body for _, body in requests}
    by_conversation = {}
    for job, outcome in records:
        by_conversation.setdefault(job.messages[1]["content"], []).append((job, outcome))
    assert [len(v) for v in by_conversation.values()] == [3, 3, 2]  # the failed turn ends its conversation
    for conversation, turns in by_conversation.items():
        history = [("system", "SYSTEM")]
        for t, (job, outcome) in enumerate(turns, start=1):
            user = users[int(conversation[1])][t - 1]
            history.append(("user", user))
            assert job.turn == t and tuple((m["role"], m["content"]) for m in job.messages) == tuple(history)
            assert tuple(history) in sent and sent[tuple(history)]["max_tokens"] == 9
            if outcome.status == 200:
                assert outcome.text.startswith("reply ") and outcome.tokens == USAGE_TOKENS
                history.append(("assistant", outcome.text))  # the reply as it streamed
            else:
                assert user == FAIL and outcome.status == 503
    assert len(requests) == 8


def test_chat_rows_report_the_first_turn_apart_from_the_later_ones():
    def record(turn: int, ttft: float, status: int = 200) -> tuple[Job, Outcome]:
        messages = [{"role": "system", "content": "s"}]
        for t in range(turn):
            messages += [{"role": "user", "content": f"u{t}"}] + (
                [{"role": "assistant", "content": "a"}] if t < turn - 1 else []
            )
        return Job(4, messages=tuple(messages)), Outcome(
            status, 4, ttft, 0.01, 1.0, "x", usage=True, prompt_tokens=10 * turn
        )

    records = [record(1, 0.5), record(1, 0.7), record(2, 0.1), record(3, 0.2), record(3, 9.0, status=500)]
    row, turns = summarize(System("peer", None, "stub"), "chat", 8, [(records, 2.0)], {}, {})
    assert (row["ttft_first_turn_p50_ms"], row["ttft_later_turns_p50_ms"]) == (600.0, 150.0)
    assert row["errors"] == 1 and row["output_tokens"] == 16 and row["output_tokens_per_s"] == 8.0
    assert [(t["turn"], t["requests"], t["errors"], t["prompt_tokens_mean"]) for t in turns] == [
        (1, 2, 0, 10.0),
        (2, 1, 0, 20.0),
        (3, 2, 1, 30.0),
    ]


def test_the_chat_warm_up_sends_no_timed_first_turn_and_users_come_from_the_prompt_set():
    prompts = [f"p{i}" for i in range(24)]
    timed, warm = chat_users(prompts, 8, 3), chat_users(prompts, 8, 3, rotate=1)
    assert timed[0] == ["p0", "p1", "p2"] and timed[7] == ["p21", "p22", "p23"]
    assert sorted(u for c in warm for u in c) == sorted(prompts)
    assert not {c[0] for c in timed} & {c[0] for c in warm}
    assert chat_users(prompts[:4], 2, 3) == [["p0", "p1", "p2"], ["p3", "p0", "p1"]]  # cycles


def test_the_system_prompt_is_the_committed_file_or_its_first_whole_lines():
    whole = system_prompt()
    assert whole.startswith("You are a careful assistant") and len(whole) > 2000
    assert "Beautiful is better than ugly." in whole and "defaultdict" in whole
    short = system_prompt(120)
    assert whole.startswith(short) and short.endswith("\n") and 0 < len(short) <= 120


@pytest.mark.parametrize(
    "workloads, target, message",
    [
        (
            ("plain", "bursty"),
            "random",
            "workloads: one or more of plain, mixed, chat, stops, longprompt, each once, got 'plain,bursty'",
        ),
        ((), "random", "workloads: one or more of plain, mixed, chat, stops, longprompt, each once, got ''"),
        (
            ("mixed", "mixed"),
            "random",
            "workloads: one or more of plain, mixed, chat, stops, longprompt, each once, got 'mixed,mixed'",
        ),
        (("chat",), "random", "workloads: chat needs a target with a chat template"),
    ],
)
def test_a_bad_workloads_setting_is_refused_in_one_line_naming_the_field(workloads, target, message):
    with pytest.raises(ValueError) as e:
        framework.make_config("serve", quick=True, overrides={"workloads": workloads, "target": target})
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_a_context_too_small_for_the_long_prompt_is_refused_in_one_line_naming_the_field():
    overrides = {"workloads": ("longprompt",), "longprompt_tokens": 2000, "context": 2007}
    with pytest.raises(ValueError) as e:
        framework.make_config("serve", quick=True, overrides=overrides)
    assert str(e.value).startswith("context: the longprompt load's prompt of 2000 tokens")
    assert "--config.context=2008 or more, got 2007" in str(e.value) and "\n" not in str(e.value)
    config = framework.make_config("serve", quick=True, overrides={**overrides, "context": 2008})
    assert config.context == 2008


def test_the_default_workload_is_the_plain_load_alone():
    for quick in (True, False):
        assert tuple(framework.make_config("serve", quick=quick)["workloads"]) == ("plain",)


# ---- the longprompt load: inter-token latency from each stream's events --------------------


def test_an_events_tokens_are_one_each_for_a_token_an_event_and_by_characters_beyond():
    assert event_tokens([3, 1, 5], 3) == [1.0, 1.0, 1.0]  # llama-server: one token an event
    assert event_tokens([1, 5, 9], 15) == [1.0, 5.0, 9.0]  # ours: a chunk's tokens an event
    assert event_tokens([2, 2], 3) == [1.5, 1.5]
    assert event_tokens([4, 4], 1) == [0.5, 0.5]  # fewer tokens than events: spread evenly


def _stream(
    started: float, times: list[float], chars: list[int], tokens: int, long=False, counts=None
) -> Record:
    job = Job(8 if long else 4, prompt="long" if long else "p", long=long)
    counts = counts or [None] * len(times)
    events = tuple((t - started, c, n) for t, c, n in zip(times, chars, counts, strict=True))
    outcome = Outcome(
        200, tokens, times[0] - started, None, times[-1] - started, "x", usage=True, started=started
    )
    return job, dataclasses.replace(outcome, events=events, prompt_tokens=2000 if long else 3)


def test_the_running_streams_latency_is_split_over_each_events_tokens_and_windowed_by_the_long_prompt():
    """Stream A decodes a token every 0.1 s, then waits 0.5 s for an event of 2 tokens (its 3
    characters) while the long prompt (sent at 0.45, first token at 1.0) is read; stream B is sent
    inside that window and waits 0.5 s for its first token."""
    a = _stream(0.0, [0.1, 0.2, 0.3, 0.4, 0.9, 1.0, 1.1], [1, 1, 1, 1, 3, 1, 1], 8)
    b = _stream(0.6, [1.1, 1.2], [1, 1], 2)
    long = _stream(0.45, [1.0, 1.05], [1, 1], 2, long=True)
    gaps = stream_gaps(a[1])
    assert [round(g.seconds, 6) for g in gaps] == [0.1, 0.1, 0.1, 0.5, 0.1, 0.1]
    assert [g.tokens for g in gaps] == [1.0, 1.0, 1.0, 2.0, 1.0, 1.0]
    assert round(gaps[3].per_token, 6) == 0.25
    figures = longprompt_figures([([a, b, long], 1.2)])
    # over the run: 6 of 8 tokens at 0.1 s, 2 at 0.25 s; in the window (gaps ending after 0.45
    # and starting before 1.0): A's 0.5 s gap (2 tokens) and its 0.9 -> 1.0 gap (1 token)
    assert (figures["itl_p50_ms"], figures["itl_p99_ms"]) == (100.0, 250.0)
    assert (figures["window_itl_p50_ms"], figures["window_itl_p99_ms"]) == (250.0, 250.0)
    assert figures["before_itl_p50_ms"] == 100.0  # A's three gaps before the long prompt's send
    assert figures["window_p99_over_p50"] == 1.0 and figures["window_p99_over_before_p50"] == 2.5
    assert figures["longest_gap_in_window_ms"] == 500.0 and figures["longest_gap_before_ms"] == 100.0
    assert figures["sent_in_window_ttft_max_ms"] == 500.0  # B, queued while the long prompt was read
    assert figures["long_ttft_ms"] == 550.0 and figures["long_prompt_tokens"] == 2000
    assert figures["long_errors"] == 0
    assert figures["streams_through_window"] == 1  # A; B started inside the window
    assert (figures["tokens_per_event_before"], figures["tokens_per_event_in_window"]) == (1.0, 1.5)
    # the row over the running streams leaves the long prompt out
    row, itl = summarize(System("peer", None, "stub"), "longprompt", 2, [([a, b, long], 1.2)], {}, {})
    assert row["requests"] == 2 and row["output_tokens"] == 10
    assert itl == [{"system": "peer", "running_streams": 2, **figures}]


def test_an_events_tokens_come_from_the_usage_so_far_where_the_server_sends_it():
    # 3 characters and 1 character, 2 tokens each (a chunk of 2 rounds for every row): the usage
    # so far says so, where the characters would have split them 3 to 1
    told = _stream(0.0, [0.1, 0.3, 0.5], [1, 3, 1], 5, counts=[1, 3, 5])
    assert [g.tokens for g in stream_gaps(told[1])] == [2, 2]
    assert [g.tokens for g in stream_gaps(_stream(0.0, [0.1, 0.3, 0.5], [1, 3, 1], 5)[1])] == [3.0, 1.0]
    # a count that does not grow with each event is not believed
    odd = _stream(0.0, [0.1, 0.3, 0.5], [1, 3, 1], 5, counts=[1, 1, 5])
    assert [g.tokens for g in stream_gaps(odd[1])] == [3.0, 1.0]


def test_the_long_prompt_goes_out_after_every_running_stream_has_its_first_token():
    (records, _), requests = _with_recorder(
        lambda url: run_longprompt(url, "stub", ["p0", "p1", "p2"], "LONG", 3, 6, lead_s=0.05)
    )
    (long,) = [(j, o) for j, o in records if j.long]
    running = [(j, o) for j, o in records if not j.long]
    assert long[1].status == 200 and long[0].max_tokens == bench_serve.LONGPROMPT_REPLY_TOKENS
    sent = {j.prompt for j, _ in running}
    assert sent == {"p0", "p1", "p2"}  # each stream its own prompts, from the first on
    first_tokens = {}
    for j, o in running:
        first_tokens.setdefault(j.prompt, o.started + o.ttft)
    assert max(first_tokens.values()) + 0.05 <= long[1].started
    ended = long[1].started + long[1].seconds
    assert all(o.started < ended for _, o in running)  # no request starts after the long one ended
    assert all(o.events for _, o in running) and all(j.max_tokens == 6 for j, _ in running)
    assert [b["prompt"] for _, b in requests].count("LONG") == 1
    assert not any(
        "continuous_usage_stats" in b["stream_options"] for _, b in requests
    )  # llama-server's schema
    (records, _), requests = _with_recorder(
        lambda url: run_longprompt(url, "stub", ["p0"], "LONG", 1, 6, 0.0, usage_each_event=True)
    )
    running = [b for _, b in requests if b["prompt"] != "LONG"]
    assert running and all(b["stream_options"]["continuous_usage_stats"] for b in running)


# ---- the load tool (guidellm), faked: its command lines and its reports ------------------------

FAKE_TOOL = """#!{python}
import json, sys, time
args = sys.argv[1:]
opt = {{args[i]: args[i + 1] for i in range(1, len(args) - 1, 2)}}
start = time.time()
time.sleep(0.3)
with open({log!r}, "a") as f:
    f.write(json.dumps({{"argv": args, "start": start, "end": time.time()}}) + "\\n")
rows = [json.loads(line) for line in open(opt["--data"].split("path=", 1)[1])]
requests = [
    {{"request_start_time": 1000.0 + i, "request_end_time": 1001.0 + i, "output_tokens": r["output_tokens_count"],
      "time_to_first_token_ms": 10.0 * (i + 1), "time_per_output_token_ms": 2.0}}
    for i, r in enumerate(rows)
]
def stat(mean, p50, p99):
    return {{"successful": {{"mean": mean, "percentiles": {{"p50": p50, "p99": p99}}}}}}
bench = {{
    "metrics": {{"output_tokens_per_second": stat(7.0, 0, 0), "time_to_first_token_ms": stat(0, 15.0, 19.9),
                 "time_per_output_token_ms": stat(0, 2.0, 2.0)}},
    "scheduler_metrics": {{"requests_made": {{"total": len(rows), "errored": 0, "incomplete": 0}}}},
    "requests": {{"successful": requests}},
}}
json.dump({{"benchmarks": [bench]}}, open(opt["--output"].split("path=", 1)[1], "w"))
"""


def _fake_tool(tmp_path):
    """A fake guidellm executable: it records its command line and the time it ran, reads its
    data file and writes a report in guidellm's JSON layout (request i of a run: start 1000 + i,
    end 1001 + i, max_tokens output tokens, TTFT 10 (i + 1) ms). Returns (its path, its log)."""
    log = tmp_path / "tool.jsonl"
    tool = tmp_path / "guidellm"
    tool.write_text(FAKE_TOOL.format(python=sys.executable, log=str(log)))
    os.chmod(tool, 0o755)
    return str(tool), log


def _served(name="peer", extra=None, sampled=None) -> System:
    server = SimpleNamespace(url="http://127.0.0.1:9", port=9)
    return System(name, server, "stub", extra, sampled)


def _option(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_the_load_tools_mixed_load_is_a_greedy_and_a_sampled_run_at_once(tmp_path):
    tool, log = _fake_tool(tmp_path)
    prompts = [f"prompt {i}" for i in range(4)]  # g s s g
    peer = _llama_like()
    peer = _served(extra=peer.extra, sampled=peer.sampled_extra)
    result = bench_serve.guidellm_mixed(tool, peer, prompts, 8, 6, str(tmp_path))
    runs = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(runs) == 2
    assert max(r["start"] for r in runs) < min(r["end"] for r in runs)  # both ran at once
    by_kind = {}
    for run in runs:
        backend = json.loads(_option(run["argv"], "--backend"))
        body = backend["extras"]["body"]
        by_kind["sampled" if body["temperature"] > 0 else "greedy"] = (run["argv"], backend, body)
    for kind, (argv, backend, body) in by_kind.items():
        assert argv[0] == "run" and backend["kind"] == "openai_http"
        assert backend["target"] == "http://127.0.0.1:9" and backend["request_format"] == "/v1/completions"
        assert _option(argv, "--profile") == "kind=concurrent,streams=4"
        assert _option(argv, "--constraint") == "kind=max_requests,count=2"
        data = _option(argv, "--data").split("path=", 1)[1]
        rows = [json.loads(line) for line in Path(data).read_text().splitlines()]
        want = [0, 3] if kind == "greedy" else [1, 2]
        assert rows == [{"prompt": f"prompt {i}", "output_tokens_count": 6} for i in want]
        assert body["cache_prompt"] is True  # llama-server's field, in every request
    assert by_kind["greedy"][2] == {"temperature": 0.0, "cache_prompt": True}
    assert by_kind["sampled"][2] == {
        "temperature": bench_serve.MIXED_TEMPERATURE,
        "top_p": bench_serve.MIXED_TOP_P,
        "seed": bench_serve.MIXED_SEED,
        "cache_prompt": True,
        "samplers": ["temperature", "top_p"],
    }
    # the load's figures from both reports' requests: 4 x 6 tokens over 1000.0 .. 1002.0
    assert result["output_tokens_per_s"] == 12.0 and result["concurrency"] == 8
    assert (result["ttft_p50_ms"], result["tpot_p50_ms"]) == (15.0, 2.0)
    assert result["requests"] == 4 and result["errors"] == 0
    assert result["runs_overlap_share"] == 1.0  # both runs' requests span 1000.0 .. 1002.0
    assert result["greedy_output_tokens_per_s"] == result["sampled_output_tokens_per_s"] == 7.0
    assert result["sampled_ttft_p99_ms"] == 19.9
    # ours gets OpenAI's fields alone
    (tmp_path / "ours").mkdir()
    tool2, log2 = _fake_tool(tmp_path / "ours")
    bench_serve.guidellm_mixed(tool2, _served("ours"), prompts, 1, 6, str(tmp_path / "ours"))
    bodies = [
        json.loads(_option(json.loads(line)["argv"], "--backend"))["extras"]["body"]
        for line in log2.read_text().splitlines()
    ]
    assert sorted(b["temperature"] for b in bodies) == [0.0, bench_serve.MIXED_TEMPERATURE]
    assert not any({"cache_prompt", "samplers"} & set(b) for b in bodies)
    assert all(
        "streams=1" in _option(json.loads(line)["argv"], "--profile")
        for line in log2.read_text().splitlines()
    )


def test_the_load_tools_plain_run_keeps_its_command_line_and_a_failed_run_is_reported(tmp_path):
    tool, log = _fake_tool(tmp_path)
    result = bench_serve.guidellm(tool, _served(), ["a", "b", "c"], 2, 5, str(tmp_path))
    (run,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert _option(run["argv"], "--backend") == (
        "kind=openai_http,target=http://127.0.0.1:9,model=stub,request_format=/v1/completions"
    )
    assert result == {
        "system": "peer",
        "tool": "guidellm 0.8.1",
        "concurrency": 2,
        "output_tokens_per_s": 7.0,
        "ttft_p50_ms": 15.0,
        "ttft_p99_ms": 19.9,
        "tpot_p50_ms": 2.0,
        "tpot_p99_ms": 2.0,
        "requests": 3,
        "errors": 0,
    }
    failed = bench_serve.guidellm_mixed("false", _served(), ["a", "b"], 2, 5, str(tmp_path))
    assert failed["tool"] == "guidellm" and failed["run"] == "greedy" and "error" in failed


# ---- the quick mode, end to end ---------------------------------------------------------------

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """The quick serve suite with every workload, on the tiny GGUF (a byte-level tokenizer and a
    chat template) as target and draft, converted into a cache of its own: (result, output folder)."""
    folder = tmp_path_factory.mktemp("bench_serve")
    model = folder / "tiny.gguf"
    tiny_gguf.write(model, chat_template=CHAT_TEMPLATE, add_bos=True)
    with pytest.MonkeyPatch.context() as m:
        m.setenv("SPEC_JAX_CACHE", str(folder / "cache"))  # not the user's cache
        overrides = {"workloads": bench_serve.WORKLOADS, "target": str(model), "draft": str(model)}
        result, _ = framework.run_experiment(
            "serve", quick=True, overrides={**overrides, "overload": False}, output_dir=str(folder / "out")
        )
    return result, folder / "out"


def _rows(folder) -> list[dict]:
    with open(folder / "serve.csv") as f:
        return list(csv.DictReader(f))


def test_quick_mode_runs_every_workload_and_counts_tokens_from_usage(quick_run):
    _, out = quick_run
    rows = _rows(out)
    config = framework.make_config("serve", quick=True)
    expected = (
        [("plain", c) for c in config.concurrency]
        + [("mixed", c) for c in config.mixed_concurrency]
        + [("stops", c) for c in config.stops_concurrency]
        + [("chat", c) for c in config.chat_concurrency]
        + [("longprompt", config.longprompt_concurrency)]
    )
    assert [(r["workload"], int(r["concurrency"])) for r in rows] == expected
    for r in rows:
        assert int(r["errors"]) == 0 and int(r["without_usage"]) == 0, r
        assert int(r["output_tokens"]) > 0 and float(r["output_tokens_per_s"]) > 0
    mixed = next(r for r in rows if r["workload"] == "mixed")
    assert int(mixed["requests"]) == config.num_prompts * config.repeats
    chat = next(r for r in rows if r["workload"] == "chat")
    assert int(chat["requests"]) == config.conversations * config.turns * config.repeats
    assert chat["ttft_first_turn_p50_ms"] and chat["ttft_later_turns_p99_ms"]


def test_quick_mode_sends_the_stop_strings_and_checks_their_texts(quick_run):
    """The stops load: every request carries STOP_STRINGS (the servers cut at them: no text holds
    one), our texts equal each request sent alone, and our tokens past a stop and rounds per chunk
    come from /metrics."""
    _, out = quick_run
    report = json.loads((out / "serve.json").read_text())
    checks = {c["check"]: c["result"] for c in report["summary"]["sections"]["checks"]}
    config = framework.make_config("serve", quick=True)
    n, top = config.num_prompts, max(config.stops_concurrency)
    assert checks["spec-jax launch.serve: texts holding a stop string"] == f"0/{n}"
    assert checks[f"our stops texts at concurrency {top} = each request alone"] == f"{n}/{n}"
    assert float(checks["ours: tokens computed past a stop string per request"]) >= 0
    assert float(checks["ours: rounds per chunk in the stops load"]) >= 1
    jobs = bench_serve.stop_jobs(bench_serve.code_prompts(config.prompt_set, n), 8)
    assert all(j.sampling()["stop"] == list(bench_serve.STOP_STRINGS) for j in jobs)
    assert all(j.prompt.startswith("def ") for j in jobs)  # the workload suite's code completions


def test_quick_mode_reports_how_long_each_server_took_to_answer_health(quick_run):
    """The start-up figure (issue 52: ready in seconds): from the server process's start to its
    first /health 200, for each system, in the summary and the checks."""
    _, out = quick_run
    report = json.loads((out / "serve.json").read_text())
    ready = report["summary"]["ready_seconds"]
    assert list(ready) == ["spec-jax launch.serve"] and 0 < ready["spec-jax launch.serve"] < 600
    checks = {c["check"]: c["result"] for c in report["summary"]["sections"]["checks"]}
    assert checks["seconds from start to /health 200"] == str(ready)


def test_quick_mode_checks_our_greedy_mixed_texts_against_each_request_alone(quick_run):
    result, out = quick_run
    report = json.loads((out / "serve.json").read_text())
    checks = {c["check"]: c["result"] for c in report["summary"]["sections"]["checks"]}
    config = framework.make_config("serve", quick=True)
    top = max(config.mixed_concurrency)
    greedy = sum(not j.sampled for j in mixed_jobs(["p"] * config.num_prompts, 1))
    assert (
        report["summary"]["mixed"]["greedy"]
        == greedy
        == config.num_prompts - report["summary"]["mixed"]["sampled"]
    )
    assert (
        checks[f"our greedy texts in the mixed load at concurrency {top} = each request alone"]
        == f"{greedy}/{greedy}"
    )
    low = min(config.concurrency)
    assert (
        checks[f"our greedy texts at concurrency {max(config.concurrency)} = at {low}"]
        == f"{config.num_prompts}/{config.num_prompts}"
    )


def test_quick_mode_chat_turns_grow_by_the_earlier_turns(quick_run):
    _, out = quick_run
    report = json.loads((out / "serve.json").read_text())
    turns = report["summary"]["sections"]["chat: time to first token by turn"]
    config = framework.make_config("serve", quick=True)
    assert [t["turn"] for t in turns] == list(range(1, config.turns + 1))
    prompt = [t["prompt_tokens_mean"] for t in turns]
    # each later turn's prompt holds the earlier turns: longer by at least the replies' tokens
    assert all(b >= a + 1 for a, b in zip(prompt, prompt[1:], strict=False)), prompt
    assert "## chat: time to first token by turn" in (out / "serve.md").read_text()


def test_quick_mode_reports_the_running_streams_latency_while_a_long_prompt_arrives(quick_run):
    """The longprompt load on the tiny GGUF: its long prompt is cut to about longprompt_tokens by
    our server's tokenizer and answered, and the running streams' latency over the window holds
    the gaps of the prompt's reading."""
    _, out = quick_run
    report = json.loads((out / "serve.json").read_text())
    (itl,) = report["summary"]["sections"][
        "longprompt: the running streams' time per output token while a long prompt arrives"
    ]
    config = framework.make_config("serve", quick=True)
    assert itl["system"] == "spec-jax launch.serve" and itl["long_errors"] == 0
    assert itl["running_streams"] == config.longprompt_concurrency
    assert 0.8 * config.longprompt_tokens <= itl["long_prompt_tokens"] <= config.longprompt_tokens
    assert 0 <= itl["itl_p50_ms"] <= itl["itl_p99_ms"] and itl["window_itl_p99_ms"] > 0
    assert 0 < itl["longest_gap_in_window_ms"] <= itl["long_ttft_ms"]
    summary = report["summary"]["longprompt"]
    assert len(summary["long_prompt_files"]) == config.repeats + 1  # the warm-up's and each repeat's
