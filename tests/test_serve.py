"""launch.serve, the OpenAI-compatible server, through the real `openai` client and raw HTTP: its
endpoints, streaming, stop strings and chat; what bad input and faults get (400/404/429 bodies
that name the field, a disconnected stream's slot freed, non-finite logits ending one request);
outputs at concurrency 8 the same as each request alone; SIGTERM exiting 0 with one line.

The servers run in this process (tests/serve_support.py: uvicorn in a thread, the engine in its
own) on 127.0.0.1 and a free port, on the tiny GGUF model (a byte-level tokenizer and a chat
template) and a perturbed copy of it as the draft; one subprocess test covers the command line,
start-up (listening while loading) and SIGTERM. tests/test_serve_faults.py throws bad input at it."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx2
import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
import serve_support
from serve_support import MODEL, Server

from experiments.bench_serve import free_port, prometheus_values
from models import registry
from models.transformer import forward, init_cache
from spec_jax.engine import Engine
from spec_jax.request import Request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = [
    "def f(x):",
    "hello world",
    "import numpy",
    "The cat sat",
    "for i in range(10):",
    "class A:",
    "print(1 + 2)",
    "Once upon a time",
]
GAMMA = 2  # fixed: seeded sampling is then exact at any concurrency (spec_jax.engine)
pytestmark = pytest.mark.xdist_group("serve")


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    return serve_support.tiny_pair(tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="module")
def server(tiny_pair):
    _, target, draft = tiny_pair
    s = Server(Engine(target, draft, max_batch=8, max_queue=8, gamma=GAMMA, max_context=256))
    yield s
    s.close()


NO_STOP_IDS = {"stop_token_ids": []}  # vLLM's field: no stop tokens, so the text runs to max_tokens


def complete(server: Server, prompt: str, **kwargs):
    return server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, **kwargs)


def test_completion_chat_and_models_answer_as_openai_does(server):
    r = complete(server, PROMPTS[0])
    assert r.object == "text_completion" and r.model == MODEL and len(r.choices) == 1
    assert r.choices[0].finish_reason in ("stop", "length") and isinstance(r.choices[0].text, str)
    assert r.usage.completion_tokens >= 1
    assert r.usage.prompt_tokens == len(server.engine.tokenizer.encode(PROMPTS[0])) > 0
    chat = server.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=12
    )
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens >= 1
    assert chat.usage.prompt_tokens == len(
        server.engine.tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    )
    # The chat template's prompt gives the same tokens as that text sent as a completion.
    rendered = server.engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    ids = server.engine.tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    same = server.client.completions.create(model=MODEL, prompt=ids, max_tokens=12)
    assert same.choices[0].text == chat.choices[0].message.content, rendered
    assert [m.id for m in server.client.models.list().data] == [MODEL]
    assert httpx2.get(server.url + "/health").json()["status"] == "ok"


def test_a_stream_joins_to_the_whole_answer_and_ends_with_done(server):
    whole = complete(server, PROMPTS[1])
    chunks = list(complete(server, PROMPTS[1], stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens > 0
    raw = server.post(
        "/v1/completions", {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 4, "stream": True}
    )
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.text.rstrip().endswith("data: [DONE]")
    chat = server.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=12, stream=True
    )
    deltas = list(chat)
    assert deltas[0].choices[0].delta.role == "assistant"


def test_a_stop_string_ends_the_text_before_it(server):
    text = complete(server, PROMPTS[2], extra_body=NO_STOP_IDS).choices[0].text
    at = next(
        i
        for i in range(1, len(text) - 1)
        if text[i : i + 2].isprintable() and "\ufffd" not in text[i : i + 2]
    )
    stop = text[at : at + 2]
    for stream in (False, True):
        r = complete(server, PROMPTS[2], stop=[stop], extra_body=NO_STOP_IDS, stream=stream)
        got = "".join(c.choices[0].text for c in r if c.choices) if stream else r.choices[0].text
        assert got == text[: text.find(stop)], (stop, text)


def answers(server: Server, concurrent: bool, **kwargs) -> list[tuple[str, int]]:
    """(text, completion tokens) of each of PROMPTS: one at a time, or all at once."""
    if not concurrent:
        out = [complete(server, p, seed=i, **kwargs) for i, p in enumerate(PROMPTS)]
        return [(r.choices[0].text, r.usage.completion_tokens) for r in out]

    async def all_at_once():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        async with client:
            calls = [
                client.completions.create(model=MODEL, prompt=p, max_tokens=24, seed=i, **kwargs)
                for i, p in enumerate(PROMPTS)
            ]
            return await asyncio.gather(*calls)

    return [(r.choices[0].text, r.usage.completion_tokens) for r in asyncio.run(all_at_once())]


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
def test_outputs_at_concurrency_8_are_each_requests_alone(server, temperature):
    alone = answers(server, False, temperature=temperature)
    together = answers(server, True, temperature=temperature)
    assert together == alone
    assert len(set(alone)) > 1  # the prompts differ: a mixed-up order would show
    if temperature == 0:  # speculation off for a request: the same tokens
        plain = complete(server, PROMPTS[0], seed=0, extra_body={"spec_jax": {"speculate": False}})
        assert (plain.choices[0].text, plain.usage.completion_tokens) == alone[0]
        capped = complete(server, PROMPTS[0], seed=0, extra_body={"spec_jax": {"max_drafts": 1}})
        assert (capped.choices[0].text, capped.usage.completion_tokens) == alone[0]


def test_mixed_greedy_and_sampled_requests_at_once_are_each_alone(server):
    """Every other request sampled (temperature 0.7, top-p 0.9, its own seed), the rest greedy,
    all at once: each answer equals the request sent alone."""

    def body(i):
        warp = dict(temperature=0.7, top_p=0.9, seed=i) if i % 2 else dict(temperature=0.0)
        return dict(model=MODEL, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=16, **warp, **NO_STOP_IDS)

    alone = [server.post("/v1/completions", body(i)).json()["choices"][0]["text"] for i in range(8)]

    async def all_at_once():
        async with httpx2.AsyncClient(timeout=60) as client:
            rs = await asyncio.gather(
                *(client.post(server.url + "/v1/completions", json=body(i)) for i in range(8))
            )
        return [r.json()["choices"][0]["text"] for r in rs]

    assert asyncio.run(all_at_once()) == alone


def test_a_shared_prefix_is_read_from_the_cache_and_reported_in_usage(server):
    """Two chat turns behind one long system prompt: the second request's usage says how many of
    its prompt tokens came from the prefix cache, /metrics counts them, and its answer equals the
    one the server gives with the prefix cache empty (a fresh server)."""
    system = {"role": "system", "content": "You are terse. " * 12}
    first = [system, {"role": "user", "content": "hi"}]
    second = [*first, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "why?"}]
    hits = server.metric("spec_jax_engine_prefix_cache_hit_tokens_total")
    server.client.chat.completions.create(model=MODEL, messages=first, max_tokens=4)
    r = server.client.chat.completions.create(model=MODEL, messages=second, max_tokens=8)
    cached = r.usage.prompt_tokens_details.cached_tokens
    assert cached >= 64 and cached % 32 == 0 and cached < r.usage.prompt_tokens
    deadline = time.monotonic() + 10  # the worker publishes the engine's counters after its step
    while server.metric("spec_jax_engine_prefix_cache_hit_tokens_total") - hits < cached:
        assert time.monotonic() < deadline, "/metrics never counted the cached tokens"
        time.sleep(0.05)
    engine = server.engine
    fresh = Engine(engine.target, None, max_batch=1, gamma=GAMMA, max_context=256, prefix_cache_mb=0)
    handle = fresh.submit(Request(messages=tuple(second), max_tokens=8))
    text = "".join(u.text for u in fresh.drain() if u.handle is handle)
    assert r.choices[0].message.content == text


def test_a_disconnected_stream_is_cancelled_and_frees_its_slot(server):
    cancelled = server.metric("spec_jax_requests_finished_total")
    body = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 200, "stop_token_ids": [], "stream": True}
    with httpx2.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data:"))
    assert json.loads(first[5:])["choices"][0]["finish_reason"] is None
    deadline = time.monotonic() + 30
    values = {}
    while time.monotonic() < deadline:
        values = prometheus_values(server.url)
        if values.get("spec_jax_engine_slots_busy") == 0 and server.worker.busy == 0:
            break
        time.sleep(0.1)
    assert values.get("spec_jax_engine_slots_busy") == 0, values
    text = httpx2.get(server.url + "/metrics").text
    assert 'spec_jax_requests_finished_total{reason="cancelled"}' in text, cancelled


BAD = [
    (b'{"model": "tiny", "prompt": "x",', 400, None, "not valid JSON"),
    (b"[1, 2]", 400, None, "JSON object"),
    ({"model": MODEL, "prompt": 5}, 400, "prompt", "prompt"),
    ({"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "max_tokens", "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": "5"}, 400, "max_tokens", "max_tokens"),
    ({"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature", "temperature"),
    ({"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p", "top_p"),
    ({"model": MODEL, "prompt": "x", "n": 0}, 400, "n", "n"),
    ({"model": MODEL, "prompt": "x", "n": 17}, 400, "n", "n"),
    ({"model": MODEL, "prompt": "x", "best_of": 2}, 400, "best_of", "best_of"),
    ({"model": MODEL, "prompt": "x", "logprobs": 21}, 400, "logprobs", "logprobs"),
    ({"model": MODEL, "prompt": "x", "logprobs": -1}, 400, "logprobs", "logprobs"),
    ({"model": MODEL, "prompt": "x", "logprobs": True}, 400, "logprobs", "logprobs"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens", "echo"),
    ({"model": MODEL, "prompt": "x", "max_token": 5}, 400, "max_token", "max_token"),
    (
        {"model": MODEL, "prompt": "x", "spec_jax": {"speculate": "no"}},
        400,
        "spec_jax.speculate",
        "speculate",
    ),
    (
        {"model": MODEL, "prompt": "x", "spec_jax": {"max_drafts": -1}},
        400,
        "spec_jax.max_drafts",
        "max_drafts",
    ),
    ({"model": MODEL}, 400, "prompt", "prompt"),
    ({"model": "gpt-4", "prompt": "x"}, 404, "model", "gpt-4"),
    ({"model": MODEL, "prompt": "x" * 300}, 400, "prompt", "context of 256 tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 1000}, 400, "max_tokens", "context of 256 tokens"),
]


@pytest.mark.parametrize(("body", "status", "param", "says"), BAD)
def test_bad_requests_get_an_openai_error_naming_the_field_and_never_reach_the_engine(
    server, body, status, param, says
):
    before = server.engine.stats()["requests_total"]
    r = server.post("/v1/completions", body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and says in error["message"]
    assert server.engine.stats()["requests_total"] == before


def test_chat_top_logprobs_without_logprobs_or_out_of_range_is_refused_naming_it(server):
    before = server.engine.stats()["requests_total"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    for extra, param in (
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ):
        r = server.post("/v1/chat/completions", chat | extra)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert server.engine.stats()["requests_total"] == before


def _forward_logprobs(engine, ids) -> np.ndarray:
    """float32 [T, V]: log_softmax of the served target's logits over ids, by a plain forward."""
    target = engine.target
    tokens = jnp.asarray([ids], jnp.int32)
    out = forward(
        target.config,
        target.params,
        tokens,
        jnp.arange(len(ids))[None],
        init_cache(target.config, 1, len(ids)),
    )
    return np.asarray(jax.nn.log_softmax(out.logits[0].astype(jnp.float32), axis=-1))


def test_echo_logprobs_in_openais_legacy_format_equal_the_models(server):
    """lm-evaluation-harness's loglikelihood request (token ids, echo, logprobs 1, max_tokens 1),
    a batch of two prompts; and echo with max_tokens 0 (the prompt scored alone)."""
    prompts = [[5, 72, 101, 108, 108, 111], [87, 111, 114]]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}
    r = server.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert out["usage"]["prompt_tokens"] == 9 and out["usage"]["completion_tokens"] == 2
    decode = server.engine.tokenizer.decode
    for prompt, choice in zip(prompts, out["choices"], strict=True):
        lp = choice["logprobs"]
        assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
        ids = prompt + [int(_forward_logprobs(server.engine, prompt)[-1].argmax())]  # greedy
        assert len(lp["tokens"]) == len(ids) and lp["tokens"] == [decode([t]) for t in ids]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        want = _forward_logprobs(server.engine, ids)
        np.testing.assert_allclose(
            lp["token_logprobs"][1:], [want[t - 1, ids[t]] for t in range(1, len(ids))], atol=1e-5
        )
        for t in range(1, len(ids)):  # the top 1 and the token itself
            top = lp["top_logprobs"][t]
            assert max(top.values()) == pytest.approx(float(want[t - 1].max()), abs=1e-5)
            assert top[lp["tokens"][t]] == lp["token_logprobs"][t]
        assert lp["text_offset"] == list(np.cumsum([0] + [len(x) for x in lp["tokens"][:-1]]))
        assert choice["text"].startswith(decode(prompt))
    alone = server.post("/v1/completions", body | {"prompt": prompts[0], "max_tokens": 0}).json()
    choice = alone["choices"][0]
    assert choice["text"] == decode(prompts[0]) and alone["usage"]["completion_tokens"] == 0
    assert choice["logprobs"]["token_logprobs"] == out["choices"][0]["logprobs"]["token_logprobs"][:-1]


def test_chat_logprobs_and_streamed_logprobs_and_n_samples(server):
    """Chat's format (content[] of token, logprob, bytes, top_logprobs); a stream's chunks carry
    their tokens' logprobs, joined equal to the whole answer's; n = 3 sampled choices are three
    requests of row ids 0, 1, 2, counted in the usage."""
    messages = [{"role": "user", "content": "hi"}]
    chat = server.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, logprobs=True, top_logprobs=3, extra_body=NO_STOP_IDS
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 4
    ids = server.engine.tokenizer.encode_chat(messages)
    generated = []  # greedy: each token the argmax after the ones before
    for _ in content:
        generated.append(int(_forward_logprobs(server.engine, ids + generated)[-1].argmax()))
    assert [c.token for c in content] == [server.engine.tokenizer.decode([t]) for t in generated]
    want = _forward_logprobs(server.engine, ids + generated)[len(ids) - 1 :]
    for i, c in enumerate(content):
        assert c.logprob == pytest.approx(float(want[i, generated[i]]), abs=1e-5)
        assert c.bytes == list(c.token.encode("utf-8")) and len(c.top_logprobs) == 3
        assert [t.logprob for t in c.top_logprobs] == sorted(
            (t.logprob for t in c.top_logprobs), reverse=True
        )
        assert c.top_logprobs[0].logprob == pytest.approx(float(want[i].max()), abs=1e-5)
    stream = list(complete(server, PROMPTS[4], logprobs=2, stream=True, extra_body=NO_STOP_IDS))
    whole = complete(server, PROMPTS[4], logprobs=2, extra_body=NO_STOP_IDS).choices[0].logprobs
    joined = [
        x for c in stream if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs
    ]
    assert joined == whole.token_logprobs and len(joined) == 24
    offsets = [
        x for c in stream if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.text_offset
    ]
    assert offsets == whole.text_offset
    n = complete(server, PROMPTS[5], n=3, temperature=1.0, seed=7, extra_body=NO_STOP_IDS)
    assert [c.index for c in n.choices] == [0, 1, 2] and n.usage.completion_tokens == 72
    assert n.usage.prompt_tokens == len(server.engine.tokenizer.encode(PROMPTS[5]))
    texts = [c.text for c in n.choices]
    assert len(set(texts)) == 3  # each its own row id (tests/test_logprobs.py: generate's rows 0, 1, 2)
    one = complete(server, PROMPTS[5], temperature=1.0, seed=7, extra_body=NO_STOP_IDS)
    assert one.choices[0].text == texts[0]  # row id 0: the request alone
    streamed = list(
        complete(server, PROMPTS[5], n=3, temperature=1.0, seed=7, stream=True, extra_body=NO_STOP_IDS)
    )
    assert [
        "".join(c.choices[0].text for c in streamed if c.choices and c.choices[0].index == i)
        for i in range(3)
    ] == texts


def test_n_samples_of_a_long_prompt_read_its_prefill_from_the_prefix_cache(server):
    """The first sample's prefill puts the prompt's blocks in the prefix cache; the other two
    read them (2 x 64 tokens of an 81-token prompt) and are still each their row's sample."""
    prompt = "n samples share one prefill: " + "ab " * 17
    assert len(server.engine.tokenizer.encode(prompt)) == 81
    hits = server.metric("spec_jax_engine_prefix_cache_hit_tokens_total")
    r = complete(server, prompt, n=3, temperature=1.0, seed=3, extra_body=NO_STOP_IDS)
    deadline = time.monotonic() + 10  # the worker publishes the engine's counters after its step
    while server.metric("spec_jax_engine_prefix_cache_hit_tokens_total") - hits < 2 * 64:
        assert time.monotonic() < deadline, "the other samples did not read the cached prefix"
        time.sleep(0.05)
    assert len({c.text for c in r.choices}) == 3
    assert (
        complete(server, prompt, temperature=1.0, seed=3, extra_body=NO_STOP_IDS).choices[0].text
        == r.choices[0].text
    )


def test_the_vllm_tokenizer_endpoints_answer_as_the_models_tokenizer(server):
    tokenizer = server.engine.tokenizer
    info = httpx2.get(server.url + "/tokenizer_info").json()
    assert info["eos_token"] == tokenizer.id_to_token(tokenizer.eos_id)
    r = server.post("/tokenize", {"prompt": "hello", "add_special_tokens": False}).json()
    assert r["tokens"] == tokenizer.encode("hello", add_special_tokens=False) and r["count"] == 5
    assert server.post("/tokenize", {"prompt": "hello"}).json()["tokens"] == tokenizer.encode("hello")
    messages = [{"role": "user", "content": "hi"}]
    assert server.post("/tokenize", {"messages": messages}).json()["tokens"] == tokenizer.encode_chat(
        messages
    )
    assert server.post("/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": "hello"}
    bad = server.post("/detokenize", {"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_the_openai_client_raises_its_own_errors_for_them(server):
    with pytest.raises(openai.NotFoundError):
        server.client.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.BadRequestError) as e:
        server.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=-1
        )
    assert e.value.body["param"] == "max_tokens"
    assert httpx2.get(server.url + "/nope").json()["error"]["message"].startswith("GET /nope")


@pytest.fixture(scope="module")
def small_server(tiny_pair):
    """Two slots, a queue of two, and a target whose embedding of "Q" is NaN: a prompt with Q has
    non-finite logits."""
    _, target, draft = tiny_pair
    q = target.tokenizer.encode("Q")[-1]
    params = dict(target.params)
    params["embed"] = {"embedding": target.params["embed"]["embedding"].at[q].set(jnp.nan)}
    s = Server(
        Engine(target.replace(params=params), draft, max_batch=2, max_queue=2, gamma=GAMMA, max_context=256)
    )
    yield s
    s.close()


def test_a_full_queue_answers_429_with_retry_after_and_the_rest_complete(small_server):
    body = {"model": MODEL, "prompt": "a b c", "max_tokens": 150, "stop_token_ids": []}

    async def burst():
        async with httpx2.AsyncClient(timeout=120) as client:
            return await asyncio.gather(
                *(client.post(small_server.url + "/v1/completions", json=body) for _ in range(8))
            )

    replies = asyncio.run(burst())
    statuses = sorted(r.status_code for r in replies)
    assert set(statuses) == {200, 429}, statuses  # how many get in depends on when slots free
    refused = next(r for r in replies if r.status_code == 429)
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert all(r.json()["usage"]["completion_tokens"] == 150 for r in replies if r.status_code == 200)
    assert httpx2.get(small_server.url + "/health").status_code == 200


def test_non_finite_logits_end_that_request_with_an_error_and_the_other_goes_on(small_server):
    body = {"model": MODEL, "max_tokens": 40, "stop_token_ids": []}

    async def pair():
        async with httpx2.AsyncClient(timeout=120) as client:
            return await asyncio.gather(
                client.post(small_server.url + "/v1/completions", json=body | {"prompt": "a Q b"}),
                client.post(small_server.url + "/v1/completions", json=body | {"prompt": "a b"}),
            )

    bad, good = asyncio.run(pair())
    assert bad.status_code == 500 and "NaN" in bad.json()["error"]["message"]
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 40
    streamed = small_server.post("/v1/completions", body | {"prompt": "Q", "stream": True})
    assert '"error"' in streamed.text and streamed.text.rstrip().endswith("data: [DONE]")


def test_sigterm_finishes_what_runs_and_exits_0_with_one_line(tiny_pair, tmp_path):
    path, _, _ = tiny_pair
    port = free_port()
    cmd = [sys.executable, "-m", "launch.serve", f"--target={path}", "--draft=none", f"--port={port}"]
    cmd += ["--max_batch=2", "--grace_period=20", "--model_name=tiny", "--nocompilation_cache"]
    # A cache of its own for the GGUF's conversion (not the user's), with this machine's kernel
    # builds and llama.cpp source shared (linked) rather than built again.
    cache = tmp_path / "cache"
    cache.mkdir()
    for shared in ("kernels", "llama.cpp"):
        (cache / shared).symlink_to(registry.cache_root() / shared, target_is_directory=True)
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu", "SPEC_JAX_CACHE": str(cache)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        listening = proc.stdout.readline()
        assert listening.startswith("launch.serve: listening on"), listening + proc.stderr.read()
        # Listening before the model is loaded: /health and requests get 503 (loading) until then.
        health = httpx2.get(f"http://127.0.0.1:{port}/health", timeout=10)
        early = httpx2.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": MODEL, "prompt": "a"})
        started = proc.stdout.readline()
        assert started.startswith("launch.serve: serving tiny on"), started + proc.stderr.read()
        assert health.status_code == 503 and health.json() == {"status": "loading"}, health.text
        assert health.headers["retry-after"] == "1"
        assert early.status_code in (200, 503), early.text
        if early.status_code == 503:
            assert early.json()["error"]["code"] == "loading" and early.headers["retry-after"] == "1"
        assert httpx2.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
        body = {"model": MODEL, "prompt": "a", "max_tokens": 200, "stop_token_ids": [], "stream": True}
        with httpx2.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data:")]
        assert (
            rest[-1] == "data: [DONE]" and json.loads(rest[-2][5:])["choices"][0]["finish_reason"] == "length"
        )
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert out.splitlines() == [
        "launch.serve: SIGTERM: stopped taking requests; 1 finished, 0 cancelled, 0 failed within the 20 s grace period"
    ]
    assert "Traceback" not in err, err


def test_what_the_grace_period_cuts_ends_with_an_error_and_new_requests_get_503(small_server):
    # Last of small_server's tests: it shuts that server's engine thread down.
    body = {"model": MODEL, "prompt": "a b", "max_tokens": 200, "stop_token_ids": [], "stream": True}
    with httpx2.stream("POST", small_server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        small_server.worker.shutdown(0)
        rest = [line for line in lines if line.startswith("data:")]
    assert json.loads(rest[-2][5:])["error"]["code"] == "cancelled" and rest[-1] == "data: [DONE]"
    refused = small_server.post("/v1/completions", {"model": MODEL, "prompt": "x"})
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert httpx2.get(small_server.url + "/health").status_code == 503


@pytest.mark.parametrize(
    ("flag", "says"),
    [
        ("--port=0", "--port"),
        ("--max_batch=0", "--max_batch"),
        ("--grace_period=-1", "--grace_period"),
        ("--target=nope", "--target"),
    ],
)
def test_bad_flags_exit_2_with_one_line_before_loading_anything(flag, says):
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-m", "launch.serve", flag],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and says in proc.stderr, proc.stderr


BLOCK_AND_RUN = """
import importlib.abc, runpy, sys

MISSING = sys.argv[1]

class Missing(importlib.abc.MetaPathFinder):  # as if the module were not installed
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == MISSING:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, Missing())
sys.argv = ["launch.serve", "--target=random", "--draft=none", "--port=1"]  # if it ran: no download
runpy.run_module("launch.serve", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("module", ["uvicorn", "starlette", "pydantic", "prometheus_client"])
def test_without_the_serve_extra_one_line_names_the_module_and_the_install_and_exits_2(module):
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", BLOCK_AND_RUN, module],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"'{module}'" in proc.stderr and "pip install -e '.[serve]'" in proc.stderr, proc.stderr
