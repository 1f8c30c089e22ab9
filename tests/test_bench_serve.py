"""The serve suite's load client (experiments.bench_serve.run_load) against a stub server that
behaves as llama-server sometimes does: it answers the first request on a connection and closes
the connection when the next request arrives on it. A client that reuses kept-alive connections
loses those requests (APIConnectionError); the suite's client must lose none."""

import asyncio
import json

from experiments.bench_serve import run_load

CHUNK = {"id": "c", "object": "text_completion", "created": 0, "model": "stub"}


def _sse_body() -> bytes:
    text = dict(CHUNK, choices=[{"index": 0, "text": "hi", "finish_reason": None}])
    usage = dict(CHUNK, choices=[], usage={"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2})
    return "".join(f"data: {json.dumps(c)}\n\n" for c in (text, usage)).encode() + b"data: [DONE]\n\n"


async def _read_request(reader: asyncio.StreamReader) -> bool:
    """Reads one HTTP request (head and Content-Length body); False at the end of the stream."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return False
    length = 0
    for line in head.decode().split("\r\n"):
        if line.lower().startswith("content-length:"):
            length = int(line.split(":", 1)[1])
    await reader.readexactly(length)
    return True


async def _one_answer_per_connection(reader, writer, connections: list) -> None:
    connections.append(writer.get_extra_info("peername"))
    if await _read_request(reader):
        body = _sse_body()
        head = (
            "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: keep-alive\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        writer.write(head.encode() + body)
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
            outcomes, _ = await run_load(f"http://127.0.0.1:{port}", "stub", ["p"] * prompts, 1, 4)
        return outcomes, connections

    return asyncio.run(main())


def test_the_load_client_loses_no_request_to_a_server_that_closes_kept_alive_connections():
    outcomes, connections = _load(prompts=4)
    assert [o.status for o in outcomes] == [200] * 4, [o.error for o in outcomes]
    assert [o.tokens for o in outcomes] == [1] * 4
    assert [o.text for o in outcomes] == ["hi"] * 4
    assert len(set(connections)) == 4  # a connection of its own per request
