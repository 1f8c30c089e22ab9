"""The engine's chunks (spec_jax.engine): how many rounds of the one compiled loop the next one
runs (chunk_rounds), and running it over the table with its counters (run_chunk).

Chunks are MIN_CHUNK rounds while requests wait or just after the table changed (a request on
its way waits at most that), doubling to MAX_CHUNK while the table is stable, and about
CHUNK_SECONDS long at most; at most as many rounds as the busy row nearest its budget has
tokens left (the slot it frees is taken at once);
at most STOP_CHUNK while a row has stop strings (matched on the host at chunk ends); and after a
piece of a long prompt's prefill, AFTER_PIECE times as long as the piece took.
"""

import time

from spec_jax.autogamma import auto_chunk, observed

MIN_CHUNK, MAX_CHUNK = 1, 64
# A chunk runs about this long at most (the last chunk's seconds per round): a request that
# arrives while it runs waits for its end to be admitted (64 rounds of a loaded 2-core CPU's
# 0.15 s made a new request wait 10 s for its first token).
CHUNK_SECONDS = 1.0
# A row computes at most this many rounds past its stop string.
STOP_CHUNK = 2
# After a piece of a long prompt, the next chunk decodes this many times as long as the piece took:
# the running rows' time per token is then about (1 + AFTER_PIECE) / AFTER_PIECE of their own, and
# the long prompt is read at 1 / (1 + AFTER_PIECE) of the prefill's pace. At 1 (as long as the
# piece), the serve suite's longprompt load (Qwen pair gguf_q8, 4 running streams, a prompt of
# 1,997 tokens, 2-core Xeon) saw the streams' time per token in the window at p50 136 ms and p99
# 329-483 ms (p99 2.4-3.5x the p50); at 2, p50 100-107 ms and p99 106-152 ms (1.1-1.4x), the long
# prompt's first token 60 s -> 93 s (docs/benchmarks.md, serve: the longprompt load).
AFTER_PIECE = 2.0


def chunk_rounds(
    last: int, waiting: bool, busy: list, piece_seconds: float, round_seconds: float
) -> tuple[int, int]:
    """(the rounds of the next chunk, the chunk length the one after it doubles from): last, the
    last chunk's length (0 after the table changed); waiting, whether requests wait; busy, the
    busy Rows; piece_seconds: the last piece of a long prompt (0: none since); round_seconds:
    the last chunk's seconds per round."""
    chunk = (
        MIN_CHUNK
        if waiting or not last
        else min(2 * last, MAX_CHUNK, max(MIN_CHUNK, int(CHUNK_SECONDS / round_seconds)))
    )
    if piece_seconds:  # after a piece of a long prompt: decode AFTER_PIECE times as long
        chunk = int(min(MAX_CHUNK, max(MIN_CHUNK, AFTER_PIECE * piece_seconds / round_seconds)))
    left = min(r.handle.request.max_tokens - len(r.tokens) for r in busy)
    if any(r.handle.request.stop for r in busy):
        left = min(left, STOP_CHUNK)
    return max(1, min(chunk, left)), chunk


def run_chunk(runner, controllers: dict, table, rounds: int, counters) -> float | None:
    """`rounds` rounds of the loop over the table's state (gamma=auto's controller of its bucket
    choosing drafting or plain rounds where controllers are given), counted into counters
    (rounds, draft and accepted tokens, compile and decode seconds). Returns the seconds per
    drafted round, or None where none ran or it compiled."""
    start = time.perf_counter()
    if not controllers:
        table.state, compile_s, _, _ = runner.loop(table.state, rounds)
    else:
        before = observed(table.state)
        table.state, _, compile_s = auto_chunk(
            controllers[table.rows], runner, table.catch_up, table.state, before, rounds
        )
    after = table.counters_now()
    drafted_rounds, drafted, accepted = (after - table.counted).tolist()
    table.counted = after
    decode_s = time.perf_counter() - start - compile_s
    counters["compile_seconds"] += compile_s
    counters["decode_seconds"] += decode_s
    counters["chunks"] += 1
    counters["rounds"] += drafted_rounds
    counters["draft_tokens_total"] += drafted
    counters["accepted_tokens_total"] += accepted
    return decode_s / drafted_rounds if drafted_rounds and not compile_s else None
