"""The engine (spec_jax.engine): continuous batching whose rows are exact. Every request's tokens
equal spec_jax.generate's for that request alone, whatever else runs (greedy and seeded
sampling, staggered arrivals, rows finishing early, cancelled rows, a slot's previous
occupant, a row whose logits turn NaN)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_gguf

import spec_jax
from models.cache import KVCache
from models.tokenizer import Tokenizer
from spec_jax import autogamma, chunks, drafting, executables, row_ops, rows, sharding
from spec_jax.autogamma.costs import Costs
from spec_jax.decode import layout
from spec_jax.drafting.hybrid import HybridDrafter
from spec_jax.drafting.lookup import PromptLookupDrafter
from spec_jax.engine import Engine, QueueFull
from spec_jax.request import Request, RequestError
from spec_jax.updates import Handle

pytestmark = pytest.mark.xdist_group("tiny_target")

GAMMA = 3
CONTEXT = 64
# (prompt, max_tokens, seed): one prompt bucket (<= 16 tokens), two budgets (rows end early).
REQUESTS = [
    ([5, 9, 2], 12, 3),
    ([7, 3, 8, 11, 4], 5, 4),
    ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], 12, 5),
    ([30], 5, 6),
    ([17, 40, 2, 2], 12, 7),
    ([60, 61, 62], 5, 8),
    ([9, 9, 9, 9, 9, 1], 12, 9),
    ([44, 12], 5, 10),
    ([3, 33, 13], 12, 11),
    ([25], 12, 12),
]


_ALONE: dict = {}


def _alone(
    target,
    draft,
    prompt: tuple,
    max_tokens: int,
    seed: int,
    temperature: float,
    gamma=GAMMA,
    top_k=0,
    top_p=1.0,
):
    """spec_jax.generate's tokens for the request alone (memoized per models and request)."""
    key = (id(target), id(draft), prompt, max_tokens, seed, temperature, gamma, top_k, top_p)
    if key not in _ALONE:
        _ALONE[key] = (
            target,
            draft,
            _generate_alone(target, draft, prompt, max_tokens, seed, temperature, gamma, top_k, top_p),
        )
    return _ALONE[key][2]


def _generate_alone(target, draft, prompt, max_tokens, seed, temperature, gamma, top_k, top_p):
    gen = spec_jax.generate(
        target,
        [list(prompt)],
        draft=draft,
        gamma=gamma,
        max_new_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        eos_id=None,
    )
    return gen.tokens[0]


def alone(target, draft, request: Request, gamma=GAMMA):
    r = request
    return _alone(target, draft, r.prompt_ids, r.max_tokens, r.seed, r.temperature, gamma, r.top_k, r.top_p)


# Each request's warp in a mixed table: greedy, plain sampling, top-p, top-k, by its index.
MIXED = [
    dict(temperature=0.0),
    dict(temperature=1.0),
    dict(temperature=0.7, top_p=0.9),
    dict(temperature=0.5, top_k=5),
]


def warp_of(kind: str, i: int) -> dict:
    return {"greedy": dict(temperature=0.0), "sampled": dict(temperature=1.0), "mixed": MIXED[i % 4]}[kind]


def run_staggered(engine: Engine, requests: list[Request], arrivals: list[int]):
    """Submits requests[i] before step arrivals[i] (steps counted from 0) and drains the engine.
    Returns ({handle id: tokens}, {handle id: finish reason}, handles)."""
    tokens, reasons, handles = {}, {}, []
    step = 0
    pending = sorted(zip(arrivals, range(len(requests)), strict=True))
    while pending or not engine.idle:
        while pending and pending[0][0] <= step:
            handles.append(engine.submit(requests[pending.pop(0)[1]]))
        for u in engine.step():
            tokens.setdefault(u.handle.id, []).extend(u.token_ids)
            if u.finished:
                reasons[u.handle.id] = u.finish_reason
        step += 1
    return tokens, reasons, handles


@pytest.mark.parametrize("warps", ["greedy", "sampled", "mixed"])
@pytest.mark.parametrize("concurrency", [1, 3, 8])
def test_each_request_equals_itself_alone_at_any_concurrency(tiny_target, tiny_draft, warps, concurrency):
    """Mixed: greedy rows, sampled rows, top-p and top-k rows in one table (one chunk)."""
    requests = [
        Request(prompt_ids=tuple(p), max_tokens=m, seed=s, stop_ids=(), **warp_of(warps, i))
        for i, (p, m, s) in enumerate(REQUESTS)
    ]
    engine = Engine(tiny_target, tiny_draft, max_batch=concurrency, gamma=GAMMA, max_context=CONTEXT)
    arrivals = [0, 0, 1, 1, 2, 4, 4, 5, 9, 9]  # staggered: some join a running table
    tokens, reasons, handles = run_staggered(engine, requests, arrivals)
    assert len(handles) == len(requests)
    for h in handles:
        assert tokens[h.id] == alone(tiny_target, tiny_draft, h.request), (h.id, concurrency)
        assert reasons[h.id] == "length"
    stats = engine.stats()
    assert stats["slots_busy"] == 0 and stats["queue_depth"] == 0
    assert stats["generation_tokens_total"] == sum(m for _, m, _ in REQUESTS)
    assert stats["finished_length"] == len(REQUESTS)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_a_request_is_exact_across_slot_moves_bucket_changes_and_batched_prefills(
    tiny_target, tiny_draft, temperature, monkeypatch
):
    """A long request shares its first prefill with a short one; when the short one leaves it
    moves to slot 0 and the table grows to 4 rows for three requests prefilled in one call,
    then shrinks to 1 row when they leave: its tokens (and theirs) equal each alone."""

    def request(i):
        p, _, seed = REQUESTS[i]
        return Request(
            prompt_ids=tuple(p),
            max_tokens=50 if i == 2 else 4,
            seed=seed,
            temperature=temperature,
            stop_ids=(),
        )

    monkeypatch.setattr(chunks, "MAX_CHUNK", 2)  # at most 8 tokens a step: the long row lasts
    engine = Engine(tiny_target, tiny_draft, max_batch=4, gamma=GAMMA, max_context=CONTEXT)
    assert engine.buckets == (1, 2, 4)
    handles = [engine.submit(request(0)), engine.submit(request(2))]
    long = handles[1]
    tokens, seen = {}, []  # seen: (rows the loop runs over, the long request's slot) per step

    def step():
        for u in engine.step():
            tokens.setdefault(u.handle, []).extend(u.token_ids)
        row = next((r for r in engine._slots if r is not None and r.handle is long), None)
        seen.append((engine.live_rows, None if row is None else row.slot))

    while any(r is not None and r.handle is handles[0] for r in engine._slots) or not seen:
        step()
    handles += [engine.submit(request(i)) for i in (3, 4, 5)]  # the long row is alone in slot 1
    while not engine.idle:
        step()
    assert seen[0] == (2, 1) and seen[-1][1] is None, seen
    alive = [s for s in seen if s[1] is not None]
    assert (4, 0) in alive and alive[-1] == (1, 0), seen  # moved to slot 0, grown, shrunk
    assert engine.step() == [] and engine.live_rows == 1  # an idle step shrinks the table
    assert engine.stats()["prefill_calls"] == 2  # two batches: (0, 2) and (3, 4, 5)
    for h in handles:
        assert tokens[h] == alone(tiny_target, tiny_draft, h.request), h.id


def test_a_first_admission_becomes_the_table_and_traces_no_blank_row_or_row_axes(tiny_target, tiny_draft):
    # a --stream run's first token: one prefill, no blank row's prefill and no row-axes trace
    engine = Engine(tiny_target, tiny_draft, max_batch=4, gamma=GAMMA, max_context=CONTEXT)
    requests = [Request(prompt_ids=tuple(p), max_tokens=m, seed=s, stop_ids=()) for p, m, s in REQUESTS[:3]]
    handles = [engine.submit(r) for r in requests]
    updates = engine.step()
    table = engine._table
    assert {u.handle.id for u in updates} == {h.id for h in handles}  # each has its first tokens
    assert table._blank is None and table._axes is None and table.rows == 4
    assert engine.stats()["prefill_calls"] == 1
    tokens = {h.id: [] for h in handles}
    for u in [*updates, *engine.drain()]:
        tokens[u.handle.id] += u.token_ids
    for h, r in zip(handles, requests, strict=True):
        assert tokens[h.id] == alone(tiny_target, tiny_draft, r)


def test_a_request_seen_again_reuses_its_prefilled_row_exactly(tiny_target, tiny_draft):
    """The same prompt and seed again (alone, then beside others, with another budget) takes its
    kept prefilled row, and its tokens are still its own alone (its own budget too); another
    seed or other stop ids are prefilled afresh; with prefill_cache=0 nothing is kept."""
    req = Request(prompt_ids=(5, 9, 2), max_tokens=8, seed=3, temperature=1.0, stop_ids=())
    longer = dataclasses.replace(req, max_tokens=12)
    misses = [dataclasses.replace(req, seed=4), dataclasses.replace(req, stop_ids=(7,))]
    engine = Engine(tiny_target, tiny_draft, max_batch=4, gamma=GAMMA, max_context=CONTEXT, prefill_cache=4)
    tokens = {}
    for batch in ([req], [longer, *misses], [req]):
        handles = [engine.submit(r) for r in batch]
        for u in engine.drain():
            tokens.setdefault(u.handle, []).extend(u.token_ids)
        for h in handles:
            if h.request.stop_ids:
                expected = alone(tiny_target, tiny_draft, dataclasses.replace(h.request, stop_ids=()))
                expected = expected[: expected.index(7) + 1] if 7 in expected else expected
            else:
                expected = alone(tiny_target, tiny_draft, h.request)
            assert tokens[h] == expected, h.request
    assert len(tokens[handles[0]]) == 8
    assert engine.stats()["prefill_cache_hits"] == 2  # longer and req again; the misses were new
    cold = Engine(tiny_target, tiny_draft, max_batch=4, gamma=GAMMA, max_context=CONTEXT, prefill_cache=0)
    for _ in range(2):
        cold.submit(req)
        assert [t for u in cold.drain() for t in u.token_ids] == alone(tiny_target, tiny_draft, req)
    assert "prefill_cache_hits" not in cold.stats() and cold.stats()["prefill_calls"] == 2


def test_a_row_that_stops_frees_its_slot_and_a_waiting_request_takes_it(tiny_target, tiny_draft):
    """Stop ids end rows early; with one slot, the next request runs in it right after."""
    first, second = REQUESTS[0], REQUESTS[2]
    reference = alone(tiny_target, tiny_draft, Request(prompt_ids=tuple(first[0]), max_tokens=12, seed=3))
    stop = reference[3]  # the row stops at its first occurrence
    engine = Engine(tiny_target, tiny_draft, max_batch=1, gamma=GAMMA, max_context=CONTEXT)
    a = engine.submit(Request(prompt_ids=tuple(first[0]), max_tokens=12, seed=3, stop_ids=(stop,)))
    b = engine.submit(Request(prompt_ids=tuple(second[0]), max_tokens=12, seed=5, stop_ids=()))
    tokens, reasons = {}, {}
    for u in engine.drain():
        tokens.setdefault(u.handle, []).extend(u.token_ids)
        reasons[u.handle] = u.finish_reason if u.finished else None
    assert tokens[a] == reference[: reference.index(stop) + 1] and reasons[a] == "stop"
    assert tokens[b] == alone(tiny_target, tiny_draft, b.request) and reasons[b] == "length"


def test_a_slot_holds_nothing_of_its_previous_occupant(tiny_target, tiny_draft):
    """A long request, then a short one in the same (only) slot: the short one's tokens equal
    its own alone, and its row of the table holds only its own tokens (a slot not reset
    would keep the long one's tokens, count or done flag)."""
    engine = Engine(tiny_target, tiny_draft, max_batch=1, gamma=GAMMA, max_context=CONTEXT)
    long = engine.submit(Request(prompt_ids=tuple(range(1, 40)), max_tokens=20, seed=1, stop_ids=()))
    list(engine.drain())
    short = Request(prompt_ids=(30,), max_tokens=5, seed=6, stop_ids=())
    h = engine.submit(short)
    first = [t for u in engine.step() for t in u.token_ids]  # admitted: the prefill's first token
    assert len(first) == 1
    engine._table.flush()  # the admission's row writes (deferred: its first token went out first)
    out = engine._table.state.out
    assert int(out.num_generated[0]) == 1 and not bool(out.done[0]) and int(out.budget[0]) == 5
    assert np.all(np.asarray(out.tokens[0, 1:]) == 0)
    assert int(engine._table.state.length[0]) == 2
    tokens = [t for u in engine.drain() if u.handle is h for t in u.token_ids]
    assert first + tokens == alone(tiny_target, tiny_draft, short)
    assert long.id == 0 and h.id == 1


def toy_table(b: int, fill):
    """A toy loop state of b rows: batch leaves (leading axis, a cache's axis 1), a scalar,
    and a [3] leaf that is not per row (of the table's size when b == 3)."""
    return {
        "cache": KVCache(k=jnp.full((2, b, 4, 1, 2), fill), v=jnp.full((2, b, 4, 1, 2), fill)),
        "tokens": jnp.full((b, 5), fill, jnp.int32),
        "count": jnp.full((), fill, jnp.int32),
        "per_position": jnp.full((3,), fill, jnp.int32),
    }


def test_row_writes_moves_and_resizes_touch_every_per_row_leaf_and_keep_shared_ones():
    """row_ops.batch_axes finds the row axis from two batch sizes (not from a size that happens to
    equal the batch: "per_position" has 3 entries at batch 3); write_rows, move_row and resize
    act on exactly those leaves."""
    axes = row_ops.batch_axes(toy_table(3, 0), toy_table(4, 0))
    assert axes == (1, 1, -1, -1, 0)  # tree order: cache k, v, count, per_position, tokens
    table = toy_table(3, 0)
    block = toy_table(2, 7)
    out = row_ops.write_rows(table, block, axes, jnp.asarray([1, 3], jnp.int32))  # row 1 of the block dropped
    np.testing.assert_array_equal(out["cache"].k[:, :, 0, 0, 0], [[0, 7, 0], [0, 7, 0]])
    np.testing.assert_array_equal(out["tokens"][:, 0], [0, 7, 0])
    assert int(out["count"]) == 0
    np.testing.assert_array_equal(out["per_position"], [0, 0, 0])
    moved = row_ops.move_row(out, axes, jnp.int32(1), jnp.int32(2))
    np.testing.assert_array_equal(moved["tokens"][:, 0], [0, 7, 7])
    np.testing.assert_array_equal(moved["cache"].v[:, :, 0, 0, 0], [[0, 7, 7], [0, 7, 7]])
    grown = row_ops.resize(moved, toy_table(1, 5), axes, 5)
    np.testing.assert_array_equal(grown["tokens"][:, 0], [0, 7, 7, 5, 5])
    assert grown["cache"].k.shape == (2, 5, 4, 1, 2) and grown["per_position"].shape == (3,)
    shrunk = row_ops.resize(grown, toy_table(1, 5), axes, 2)
    np.testing.assert_array_equal(shrunk["cache"].k[:, :, 0, 0, 0], [[0, 7], [0, 7]])
    assert int(shrunk["count"]) == 0


def test_cancel_frees_the_slot_at_once_and_the_others_are_unaffected(tiny_target, tiny_draft):
    engine = Engine(tiny_target, tiny_draft, max_batch=2, gamma=GAMMA, max_context=CONTEXT)
    requests = [Request(prompt_ids=tuple(p), max_tokens=12, seed=s, stop_ids=()) for p, _, s in REQUESTS[:3]]
    handles = [engine.submit(r) for r in requests]
    first = engine.step()  # the first two are admitted
    assert engine.stats()["slots_busy"] == 2
    engine.cancel(handles[0])
    assert engine.stats()["slots_busy"] == 1  # at once
    tokens, last = {}, {}
    for u in [*first, *engine.drain()]:
        tokens.setdefault(u.handle, []).extend(u.token_ids)
        last[u.handle] = u
    assert last[handles[0]].finished and last[handles[0]].finish_reason == "cancelled"
    for h in handles[1:]:
        assert tokens[h] == alone(tiny_target, tiny_draft, h.request)
    # A waiting request cancelled never runs.
    waiting = [engine.submit(r) for r in requests]
    engine.cancel(waiting[2])
    updates = [u for u in engine.drain() if u.handle is waiting[2]]
    assert [(u.token_ids, u.finish_reason) for u in updates] == [([], "cancelled")]


def test_chunks_restart_at_one_round_after_the_table_changes_and_double_while_it_is_stable(
    tiny_target, tiny_draft
):
    """The chunk's rounds: MIN_CHUNK (1) after an admission or a freed slot (a request may be on
    its way, and waits at most one round), doubling while the table is stable. A loop that kept
    doubling across admissions would make a request arriving after a first one wait a long chunk."""
    engine = Engine(tiny_target, tiny_draft, max_batch=2, gamma=GAMMA, max_context=CONTEXT)
    long = Request(prompt_ids=(5, 9, 2), max_tokens=40, seed=3, stop_ids=())

    def rounds_of_next_step():
        before = engine.stats().get("rounds", 0)
        engine.step()
        return engine.stats().get("rounds", 0) - before

    engine.submit(long)
    assert rounds_of_next_step() == 0  # the admission: its first token, no chunk
    assert [rounds_of_next_step() for _ in range(3)] == [1, 2, 4]
    engine.submit(dataclasses.replace(long, max_tokens=30, seed=4))
    assert rounds_of_next_step() == 0
    assert [rounds_of_next_step() for _ in range(2)] == [1, 2]
    assert chunks.MIN_CHUNK == 1


def test_a_chunk_lasts_about_chunk_seconds_at_most():
    """A stable table's chunks double to MAX_CHUNK rounds where rounds are fast, and stop at
    about CHUNK_SECONDS where they are slow (a request arriving mid-chunk waits for its end)."""
    row = rows.Row(Handle(0, Request(prompt_ids=(1,), max_tokens=1000), 1), [1], (), 0.0)
    assert chunks.chunk_rounds(32, False, [row], 0.0, 0.001) == (chunks.MAX_CHUNK, chunks.MAX_CHUNK)
    slow = int(chunks.CHUNK_SECONDS / 0.15)
    assert chunks.chunk_rounds(32, False, [row], 0.0, 0.15) == (slow, slow) and slow < 32
    assert chunks.chunk_rounds(32, True, [row], 0.0, 0.15)[0] == chunks.MIN_CHUNK  # a request waits


def test_after_a_piece_of_a_long_prompt_the_chunk_decodes_after_piece_times_as_long():
    """After a long prompt's piece took 0.6 s, rounds of 0.05 s: AFTER_PIECE x 0.6 / 0.05 rounds
    (the running rows then compute AFTER_PIECE / (1 + AFTER_PIECE) of the time), whether requests
    wait or not, within MAX_CHUNK; as many as the piece took (the old rule) fails it."""
    row = rows.Row(Handle(0, Request(prompt_ids=(1,), max_tokens=1000), 1), [1], (), 0.0)
    expected = int(chunks.AFTER_PIECE * 0.6 / 0.05)
    assert chunks.AFTER_PIECE >= 2 and expected < chunks.MAX_CHUNK
    for waiting in (False, True):
        assert chunks.chunk_rounds(4, waiting, [row], 0.6, 0.05)[0] == expected != int(0.6 / 0.05)
    assert chunks.chunk_rounds(4, False, [row], 60.0, 0.05)[0] == chunks.MAX_CHUNK


def test_a_request_that_ends_at_its_first_token_finishes_in_the_step_that_admits_it(tiny_target, tiny_draft):
    """The admission step reads first tokens from the prefilled (or kept) rows, not the table: a
    budget of 1 ends as "length" and a first token that is a stop id as "stop", in that step,
    beside a request that goes on; a kept row gives the same again."""
    engine = Engine(tiny_target, tiny_draft, max_batch=4, gamma=GAMMA, max_context=CONTEXT)
    one = Request(prompt_ids=(5, 9, 2), max_tokens=1, seed=3, stop_ids=())
    going = Request(prompt_ids=(7, 3, 8), max_tokens=6, seed=4, stop_ids=())
    first = alone(tiny_target, tiny_draft, going)[0]
    stopped = dataclasses.replace(going, stop_ids=(first,))
    for _ in range(2):  # the second time from the kept rows
        handles = [engine.submit(r) for r in (one, stopped, going)]
        got = {u.handle: (u.token_ids, u.finished, u.finish_reason) for u in engine.step()}
        assert got[handles[0]] == (alone(tiny_target, tiny_draft, one), True, "length")
        assert got[handles[1]] == ([first], True, "stop")
        assert got[handles[2]] == ([first], False, None)
        later = [u for u in engine.drain() if u.handle is handles[2]]
        rest = [t for u in later for t in u.token_ids]
        # (the updates and counters in the message: this failed once in a fresh-clone CI run,
        # the row handing out its first token and then nothing, and did not reproduce)
        seen = [(u.token_ids, u.finished, u.finish_reason) for u in later]
        assert [first, *rest] == alone(tiny_target, tiny_draft, going), (seen, engine.stats())
    assert engine.stats()["prefill_cache_hits"] == 3


def test_the_freed_rows_placed_for_the_loop_are_a_copy_not_the_tables_own_memory():
    """Table.apply_stops places its freed-row flags through rows.put_snapshot: sharding.put of a
    NumPy array may share its memory on a CPU (the broken case: plain put, which shared it in
    57 of 200 such arrays here), and the table changes the flags right after queueing the
    marking, so a running row could be marked done (the first-token test above failed so in
    two fresh-clone CI runs: its running row ended as "length" with no token after its first)."""
    placement = sharding.batch_sharding(sharding.default_mesh(), 1)
    shared = copied = 0
    for n in range(200):
        host = np.zeros(n % 9 + 1, bool)  # sizes vary, and with them the arrays' alignment
        plain, snapshot = sharding.put(host, placement), rows.put_snapshot(host, placement)
        host[0] = True  # the table's next free, before the queued marking ran
        shared, copied = shared + bool(plain[0]), copied + bool(snapshot[0])
    assert copied == 0
    assert shared > 0, "put no longer shares host memory: put_snapshot may be unneeded"


def test_a_request_without_speculation_decodes_as_plain_decoding_beside_speculating_rows(
    tiny_target, tiny_draft
):
    """speculate=False inside a drafting table: the tokens of plain decoding alone (sampled:
    the rows' random streams are plain decoding's, so this fails unless the row drafts nothing)."""
    engine = Engine(tiny_target, tiny_draft, max_batch=3, gamma=GAMMA, max_context=CONTEXT)
    plain = Request(
        prompt_ids=(5, 9, 2), max_tokens=12, seed=3, temperature=1.0, speculate=False, stop_ids=()
    )
    spec = Request(prompt_ids=(7, 3, 8), max_tokens=12, seed=4, temperature=1.0, stop_ids=())
    hp, hs = engine.submit(plain), engine.submit(spec)
    tokens = {}
    for u in engine.drain():
        tokens.setdefault(u.handle, []).extend(u.token_ids)
    assert tokens[hp] == _alone(tiny_target, None, (5, 9, 2), 12, 3, 1.0)
    assert tokens[hp] != alone(tiny_target, tiny_draft, plain)  # the speculative sample differs
    assert tokens[hs] == alone(tiny_target, tiny_draft, spec)


def test_a_requests_draft_cap_bounds_its_drafts_and_keeps_its_tokens(tiny_target, tiny_draft):
    """max_drafts: a row verifies at most that many drafts a round (the loop's gamma is 3), its
    greedy tokens those of plain decoding; a row beside it drafts the full gamma. Counted by the
    engine's draft tokens per round: a cap the loop ignored drafts 3 a round here too."""

    def run(*requests):
        engine = Engine(tiny_target, tiny_draft, max_batch=2, gamma=GAMMA, max_context=CONTEXT)
        handles = [engine.submit(r) for r in requests]
        tokens = {h: [] for h in handles}
        for u in engine.drain():
            tokens[u.handle].extend(u.token_ids)
        return [tokens[h] for h in handles], engine.stats()

    capped = Request(prompt_ids=(5, 9, 2), max_tokens=16, max_drafts=1, stop_ids=())
    free = Request(prompt_ids=(7, 3, 8), max_tokens=16, stop_ids=())
    plain = _alone(tiny_target, None, (5, 9, 2), 16, 0, 0.0)
    (alone_tokens,), alone_stats = run(capped)
    assert alone_tokens == plain
    assert 0 < alone_stats["draft_tokens_total"] <= alone_stats["rounds"]  # at most 1 a round
    (free_tokens,), free_stats = run(free)
    assert free_stats["draft_tokens_total"] > free_stats["rounds"]  # uncapped: more than 1 a round
    (beside, other), _ = run(capped, free)
    assert beside == plain and other == free_tokens
    (none,), none_stats = run(dataclasses.replace(capped, max_drafts=0))
    assert none == plain and none_stats["draft_tokens_total"] == 0


def poisoned(model, token: int):
    """The model with a NaN embedding row for `token` (tests/test_nonfinite.py)."""
    params = dict(model.params)
    params["embed"] = {"embedding": model.params["embed"]["embedding"].at[token].set(jnp.nan)}
    return model.replace(params=params)


def test_nonfinite_logits_end_that_request_with_an_error_and_the_others_go_on(tiny_target, tiny_draft):
    a = Request(prompt_ids=(5, 9, 2), max_tokens=12, seed=3, stop_ids=())
    b = Request(prompt_ids=(7, 3, 8, 11, 4), max_tokens=12, seed=4, stop_ids=())
    clean_a, clean_b = alone(tiny_target, tiny_draft, a), alone(tiny_target, tiny_draft, b)
    read_by_b = set(b.prompt_ids) | set(clean_b)
    k, bad = next(
        (k, t)
        for k, t in enumerate(clean_a[:-1])
        if k >= 1 and t not in read_by_b and t not in a.prompt_ids and t not in clean_a[:k]
    )
    target = poisoned(tiny_target, bad)
    engine = Engine(target, tiny_draft, max_batch=2, gamma=GAMMA, max_context=CONTEXT)
    ha, hb = engine.submit(a), engine.submit(b)
    tokens, last = {}, {}
    for u in engine.drain():
        tokens.setdefault(u.handle, []).extend(u.token_ids)
        last[u.handle] = u
    assert last[ha].finish_reason == "error" and "NaN" in last[ha].error
    assert tokens[ha] == clean_a[: k + 1] == _alone(target, tiny_draft, a.prompt_ids, 12, 3, 0.0)
    assert last[hb].finish_reason == "length" and tokens[hb] == clean_b


def test_greedy_and_sampled_requests_share_a_chunk_and_new_warp_values_compile_nothing(
    tiny_target, tiny_draft
):
    """Requests of different warps are admitted together (one prefill, one table) and each is
    exact; once the programs exist, requests with warp values never seen before (temperatures,
    top-k, top-p) compile nothing: they are operands of the loop, not static settings."""
    engine = Engine(tiny_target, tiny_draft, max_batch=4, gamma=GAMMA, max_context=CONTEXT)
    greedy = Request(prompt_ids=(5, 9, 2), max_tokens=12, seed=3, stop_ids=())
    sampled = Request(prompt_ids=(7, 3, 8), max_tokens=5, seed=4, temperature=1.0, stop_ids=())
    hg, hs = engine.submit(greedy), engine.submit(sampled)
    first = engine.step()
    assert engine.stats()["slots_busy"] == 2 and engine.stats()["queue_depth"] == 0
    assert engine.stats()["prefill_calls"] == 1
    tokens = {}
    for u in [*first, *engine.drain()]:
        tokens.setdefault(u.handle, []).extend(u.token_ids)
    assert tokens[hg] == alone(tiny_target, tiny_draft, greedy)
    assert tokens[hs] == alone(tiny_target, tiny_draft, sampled)
    traces = dict(executables.TRACE_COUNTS)
    news = [
        Request(prompt_ids=(5, 9, 2), max_tokens=12, seed=3, stop_ids=(), temperature=0.71, top_p=0.93),
        Request(prompt_ids=(7, 3, 8), max_tokens=5, seed=4, stop_ids=(), temperature=0.72, top_k=7),
    ]
    handles = [engine.submit(r) for r in news]
    tokens = {}
    for u in engine.drain():
        tokens.setdefault(u.handle, []).extend(u.token_ids)
    assert dict(executables.TRACE_COUNTS) == traces, "a new warp value traced (compiled) a program"
    for h in handles:
        assert tokens[h] == alone(tiny_target, tiny_draft, h.request)


def test_submit_checks_the_request_against_the_model_and_the_queue(tiny_target):
    engine = Engine(tiny_target, None, max_batch=1, max_queue=2, max_context=32)
    with pytest.raises(
        RequestError, match=r"prompt \(30 tokens\) \+ max_tokens \(5\) exceeds the context of 32"
    ) as e:
        engine.submit(Request(prompt_ids=tuple([1] * 30), max_tokens=5))
    assert e.value.field == "max_tokens"
    with pytest.raises(RequestError, match="prompt_ids") as e:
        engine.submit(Request(prompt_ids=(1, 64)))
    assert e.value.field == "prompt_ids"
    with pytest.raises(RequestError, match="no tokenizer") as e:
        engine.submit(Request(prompt="hello"))
    assert e.value.field == "prompt"
    with pytest.raises(RequestError) as e:
        engine.submit(Request(prompt_ids=(1,), temperature=-1.0))
    assert e.value.field == "temperature"
    # max_queue waiting beyond the free slot: 1 + 2 requests are taken, the next is refused
    for i in range(3):
        engine.submit(Request(prompt_ids=(i + 1,), max_tokens=4))
    with pytest.raises(QueueFull):
        engine.submit(Request(prompt_ids=(4,), max_tokens=4))
    assert engine.stats()["queue_depth"] == 3


CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    """The tiny GGUF model with its byte-level tokenizer and a chat template."""
    path = tmp_path_factory.mktemp("engine") / "tiny.gguf"
    model = tiny_gguf.write(path, chat_template=CHAT_TEMPLATE)
    return model.replace(tokenizer=Tokenizer.from_gguf(path))


def test_generate_takes_texts_and_conversations_and_returns_text_with_the_clis_defaults(text_model):
    """Three lines for a notebook: strings in, text out; greedy with the model's stop tokens."""
    tok = text_model.tokenizer
    gen = spec_jax.generate(text_model, "def f(x):", max_new_tokens=8)
    ids = spec_jax.generate(
        text_model, [tok.encode("def f(x):")], max_new_tokens=8, temperature=0.0, eos_id=list(tok.stop_ids)
    )
    assert gen.tokens == ids.tokens and gen.text == [tok.decode(ids.tokens[0], skip_special_tokens=True)]
    messages = [{"role": "user", "content": "hi"}]
    chat = spec_jax.generate(text_model, [messages, "x"], max_new_tokens=4)
    by_ids = spec_jax.generate(text_model, [tok.encode_chat(messages), tok.encode("x")], max_new_tokens=4)
    assert chat.tokens == by_ids.tokens and len(chat.text) == 2


def test_stream_yields_each_prompts_text_in_pieces_that_add_up_to_generate(text_model):
    prompts = ["def f(x):", "hello", [{"role": "user", "content": "hi"}]]
    pieces: dict = {}
    finished = {}
    for i, update in spec_jax.stream(text_model, prompts, max_tokens=10, max_batch=2):
        pieces.setdefault(i, []).append(update.text)
        finished[i] = update.finish_reason if update.finished else None
    gen = spec_jax.generate(text_model, prompts, max_new_tokens=10)
    assert ["".join(pieces[i]) for i in range(3)] == gen.text
    assert all(finished[i] in ("stop", "length") for i in range(3))
    assert max(len(p) for p in pieces.values()) > 1  # it streamed: more than one piece


def test_a_stop_string_ends_the_text_before_it(text_model):
    alone_text = spec_jax.generate(text_model, "hello", max_new_tokens=16, eos_id=None).text[0]
    stop = alone_text[5:7]
    assert stop and alone_text.find(stop) >= 1
    engine = Engine(text_model, None, max_batch=2, max_context=64)
    h = engine.submit(Request(prompt="hello", max_tokens=16, stop=(stop,), stop_ids=()))
    updates = list(engine.drain())
    assert "".join(u.text for u in updates) == alone_text[: alone_text.find(stop)]
    assert updates[-1].finished and updates[-1].finish_reason == "stop" and updates[-1].handle is h


def test_a_row_computes_at_most_stop_chunk_rounds_past_its_stop_string(text_model):
    """A stop string matched late in a long run: the row is cut within STOP_CHUNK rounds of the
    match (plain decoding: a token a round), counted in tokens_past_stop_total; chunks of up to
    MAX_CHUNK rounds would compute up to 32 tokens past it."""
    alone = spec_jax.generate(text_model, "hello", max_new_tokens=48, eos_id=None)
    ids = alone.tokens[0]
    text = text_model.tokenizer.decode(ids[:40], skip_special_tokens=True)
    stop = text[-3:]  # ends in the 40th token's text
    first = text.find(stop)
    engine = Engine(text_model, None, max_batch=2, max_context=128)
    engine.submit(Request(prompt="hello", max_tokens=48, stop=(stop,), stop_ids=()))
    updates = list(engine.drain())
    assert "".join(u.text for u in updates) == text[:first]
    assert updates[-1].finish_reason == "stop"
    assert 0 <= engine.stats()["tokens_past_stop_total"] <= chunks.STOP_CHUNK


def test_gamma_auto_rows_are_greedy_exact_across_plain_and_drafting_chunks(
    tiny_target, tiny_draft, monkeypatch
):
    """gamma=auto on the table (costs fixed, drafting cheap): chunks switch between plain
    decoding (the drafter's states set aside, new rows' states written there) and drafting
    (caught up first); every greedy request still equals itself alone."""
    cheap = Costs(
        step_seconds=0.01,
        draft1=0.01,
        draft2=0.01,
        verify=(1.0,) + tuple(1.0 + 0.02 * g for g in range(1, 9)),
    )
    monkeypatch.setattr(autogamma, "costs_for", lambda *a, **k: cheap)
    requests = [Request(prompt_ids=tuple(p), max_tokens=m, seed=s, stop_ids=()) for p, m, s in REQUESTS[:6]]
    engine = Engine(tiny_target, tiny_draft, max_batch=3, gamma="auto", max_context=CONTEXT)
    tokens, reasons, handles = run_staggered(engine, requests, [0, 0, 1, 2, 3, 3])
    for h in handles:
        assert tokens[h.id] == alone(tiny_target, tiny_draft, h.request)
    schedules = [c.schedule for c in engine.controllers.values()]
    gammas = {g for schedule in schedules for g, _ in schedule}
    assert 0 in gammas and gammas - {0}, schedules


def test_a_draft_that_would_never_pay_is_dropped_and_prefills_nothing(tiny_target, tiny_draft, monkeypatch):
    """gamma=auto with costs under which drafting loses even at a good draft's acceptance: the
    engine decodes plainly without the drafter (as spec_jax.generate does), so no prefill or
    slot carries the draft model's state, and each request equals plain decoding alone."""
    expensive = Costs(step_seconds=0.01, draft1=1.5, draft2=3.0, verify=(1.0,) + (2.0,) * 8)
    monkeypatch.setattr(autogamma, "costs_for", lambda *a, **k: expensive)
    engine = Engine(tiny_target, tiny_draft, max_batch=2, gamma="auto", max_context=CONTEXT)
    assert not engine.drafter.sources  # NoDrafter
    assert jax.tree.leaves(engine._runner.draft_params) == []
    requests = [Request(prompt_ids=tuple(p), max_tokens=m, seed=s, stop_ids=()) for p, m, s in REQUESTS[:3]]
    tokens, _, handles = run_staggered(engine, requests, [0, 0, 1])
    for h in handles:
        assert tokens[h.id] == alone(tiny_target, None, h.request)
    assert engine.stats().get("draft_tokens_total", 0) == 0
    assert Engine(tiny_target, tiny_draft, max_batch=2, gamma=2, max_context=CONTEXT).drafter.sources


def test_a_hybrid_whose_model_would_never_pay_drafts_with_prompt_lookup_alone(
    tiny_target, tiny_draft, monkeypatch
):
    """gamma=auto with costs under which the draft model loses even at a good draft's acceptance,
    while prompt lookup's drafts cost no call: a hybrid engine runs its lookup alone (the model's
    params and prefill gone, controllers of the lookup's own), and each request equals plain
    decoding alone. A model drafter under the same costs decodes plainly (the test above)."""
    verify = tuple(1.0 + 0.05 * g for g in range(17))
    by_kind = {
        True: Costs(step_seconds=0.01, draft1=0.0, draft2=0.0, verify=verify),
        False: Costs(step_seconds=0.01, draft1=1.5, draft2=3.0, verify=verify),
    }
    monkeypatch.setattr(
        autogamma, "costs_for", lambda t, drafter, *a, **k: by_kind[isinstance(drafter, PromptLookupDrafter)]
    )
    hybrid = drafting.build("hybrid", tiny_target, drafting.Settings(draft=tiny_draft))
    assert isinstance(hybrid[0], HybridDrafter)
    engine = Engine(tiny_target, hybrid, max_batch=2, gamma="auto", max_context=CONTEXT)
    assert isinstance(engine.drafter, PromptLookupDrafter)
    assert jax.tree.leaves(engine._runner.draft_params) == []
    assert {c.phase for c in engine.controllers.values()} != {"never"}
    requests = [Request(prompt_ids=tuple(p), max_tokens=m, seed=s, stop_ids=()) for p, m, s in REQUESTS[:3]]
    tokens, _, handles = run_staggered(engine, requests, [0, 0, 1])
    for h in handles:
        assert tokens[h.id] == alone(tiny_target, None, h.request)
    monkeypatch.setattr(autogamma, "costs_for", lambda *a, **k: by_kind[False])
    lookup = drafting.build("prompt_lookup", tiny_target)
    assert isinstance(
        Engine(tiny_target, hybrid, max_batch=2, gamma=2, max_context=CONTEXT).drafter, HybridDrafter
    )
    assert not Engine(tiny_target, lookup, max_batch=2, gamma="auto", max_context=CONTEXT).drafter.sources


def test_tree_rounds_on_the_table_are_exact_and_a_plain_row_drafts_no_tree(tiny_target, tiny_draft):
    """tree=4: sampled rows equal spec_jax.generate(tree=4) alone; a speculate=False row among
    them equals plain decoding alone (its tree's q zeroed)."""
    engine = Engine(tiny_target, tiny_draft, max_batch=3, tree=4, max_context=CONTEXT)
    requests = [
        Request(prompt_ids=(5, 9, 2), max_tokens=10, seed=3, temperature=1.0, stop_ids=()),
        Request(
            prompt_ids=(7, 3, 8, 11), max_tokens=10, seed=4, temperature=1.0, stop_ids=(), speculate=False
        ),
        Request(prompt_ids=(30,), max_tokens=10, seed=5, temperature=1.0, stop_ids=()),
    ]
    handles = [engine.submit(r) for r in requests]
    tokens = {}
    for u in engine.drain():
        tokens.setdefault(u.handle, []).extend(u.token_ids)
    for h in handles:
        r = h.request
        if r.speculate:
            expected = spec_jax.generate(
                tiny_target, [list(r.prompt_ids)], draft=tiny_draft, tree=4, max_new_tokens=10,
                temperature=1.0, seed=r.seed, eos_id=None,
            ).tokens[0]  # fmt: skip
        else:
            expected = _alone(tiny_target, None, r.prompt_ids, 10, r.seed, 1.0)
        assert tokens[h] == expected, h.id


def test_bad_engine_settings_are_refused_naming_them(tiny_target, tiny_draft):
    context = tiny_target.config.max_seq_len
    with pytest.raises(ValueError, match=rf"max_context must be an integer in \[2, {context - 3}\] .*less 3"):
        Engine(tiny_target, tiny_draft, gamma=3, max_context=context)
    with pytest.raises(ValueError, match="max_batch must be an integer >= 1, got 0"):
        Engine(tiny_target, None, max_batch=0)
    with pytest.raises(ValueError, match="prefill_cache must be an integer >= 0, got -1"):
        Engine(tiny_target, None, prefill_cache=-1)
    with pytest.raises(ValueError, match="gamma must be an integer >= 1 or 'auto'"):
        Engine(tiny_target, tiny_draft, gamma=0)
    with pytest.raises(
        ValueError, match=r"max_new_tokens must be an integer in \[1, 40\] \(max_context\), got 41"
    ):
        Engine(tiny_target, None, max_context=40, max_new_tokens=41)
    engine = Engine(tiny_target, None, max_context=40, max_new_tokens=8)
    with pytest.raises(RequestError, match="max_tokens must be at most 8, got 9") as e:
        engine.submit(Request(prompt_ids=(1, 2), max_tokens=9))
    assert e.value.field == "max_tokens"


def test_the_engine_runs_generates_prefill_program_and_its_free_row_shares_it(tiny_target, tiny_draft):
    # the CLI's --stream after `make demo` (a generate call) finds its prefill compiled: the
    # engine's requests of a bucket, its blank row and generate's call are one program (without
    # the prefix cache, whose pool the prefill reads: spec_jax.stream runs without it)
    prompt, new = [5, 9, 2, 7], 6
    _, cache_len = layout(tiny_target.config, [prompt], new, GAMMA)
    spec_jax.generate(tiny_target, [prompt], draft=tiny_draft, gamma=GAMMA, max_new_tokens=new, eos_id=None)
    before = executables.TRACE_COUNTS["spec_prefill"]
    engine = Engine(
        tiny_target,
        tiny_draft,
        gamma=GAMMA,
        max_context=cache_len - GAMMA,
        max_new_tokens=new,
        prefix_cache_mb=0,
    )
    handle = engine.submit(Request(prompt_ids=tuple(prompt), max_tokens=new, stop_ids=()))
    tokens = [t for u in engine.drain() if u.handle.id == handle.id for t in u.token_ids]
    assert executables.TRACE_COUNTS["spec_prefill"] == before  # no prefill of its own: generate's
    assert tokens == alone(tiny_target, tiny_draft, Request(prompt_ids=tuple(prompt), max_tokens=new))
    # spec_jax.stream sizes its engine by the same rule (rows.stream_context)
    updates = spec_jax.stream(
        tiny_target, [prompt], draft=tiny_draft, gamma=GAMMA, max_tokens=new, stop_ids=()
    )
    assert [t for _, u in updates for t in u.token_ids] == tokens
    assert executables.TRACE_COUNTS["spec_prefill"] == before


def test_a_prompt_whose_length_bucket_exceeds_the_slot_is_prefilled_within_it(tiny_target, tiny_draft):
    """max_context 24, a 20-token prompt (bucket 32): the prefill's width is capped at the slot
    (nothing written past its cache), and the tokens are still the request's alone."""
    engine = Engine(tiny_target, tiny_draft, max_batch=2, gamma=GAMMA, max_context=24)
    request = Request(prompt_ids=tuple(range(3, 23)), max_tokens=4, seed=2, stop_ids=())
    h = engine.submit(request)
    tokens = [t for u in engine.drain() if u.handle is h for t in u.token_ids]
    assert tokens == alone(tiny_target, tiny_draft, request)
