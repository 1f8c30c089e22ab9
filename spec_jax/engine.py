"""The engine: one object that outlives a call, for requests that come and go (continuous
batching at the granularity of chunks of rounds). It owns the plan (spec_jax.plan.plan_engine:
the placed models, the compiled programs, gamma=auto's controllers per row bucket) and a table
of max_batch row slots (spec_jax.table.Table: one SpecState over the busy slots).

  submit(request) -> Handle     validates the request against the model, queues it
  step() -> [Update]            admits waiting requests into free slots (one prefill per group
                                of one prompt width), or runs one chunk of the ONE compiled
                                loop over the table's rows; returns each request's new tokens
  cancel(handle)                frees the request's slot at once
  drain() -> iterator           step() until nothing waits or runs

Invariants (docs/design.md, "The engine"): a request's tokens do not depend on what else runs
(its own keys, budget, stop ids and warp, per-row operands of the loop; rows computed
bit-identically whatever the batch); chunks of MIN_CHUNK rounds while requests wait, doubling
to MAX_CHUNK while the table is stable. Not thread-safe: one thread owns an Engine.
"""

import collections
import itertools
import time
from collections.abc import Iterator
from typing import Any

from spec_jax import plan, rows, sharding
from spec_jax.decode import PAD_ID, layout
from spec_jax.drafting import NoDrafter
from spec_jax.logprobs import TokenLogprobs
from spec_jax.prefix_cache import BLOCK, engine_prefix_cache
from spec_jax.request import Handle, Request, Update, encode_prompt
from spec_jax.runner import auto_chunk, observed
from spec_jax.table import Table

MIN_CHUNK, MAX_CHUNK = 1, 64  # rounds per chunk: while requests wait or the table just changed; at most
# Rounds per chunk at most while a row has stop strings (matched on the host at chunk ends): a row
# computes at most this many rounds past its stop string.
STOP_CHUNK = 2
# A prompt whose uncached part is longer than this, arriving while rows decode, is read into the
# prefix cache this many tokens at a time, each piece followed by a chunk of decoding of about the
# piece's time, before it is admitted: the running streams slow down instead of stopping.
PREFILL_PIECE = 2 * BLOCK
NONFINITE_ERROR = "the target's logits became NaN or infinite; the output stops before them"
# Prefilled rows kept for requests seen again (rows.prefill_key; each holds a slot's caches, about
# 85 MB for the Qwen pair at 1024 tokens), and the prefix cache's MB (spec_jax.prefix_cache: about
# 4,600 prompt tokens of the Qwen 1.5B, a long system prompt and a few conversations).
PREFILL_CACHE, PREFIX_CACHE_MB = 16, 256
TTFT_KEPT = 1024  # stats()' ttft_seconds: the most recent requests' times to first token


class QueueFull(RuntimeError):
    """submit() with max_queue requests already waiting beyond the free slots."""


class Engine:
    """Serves Requests on one target (and drafter) with a table of max_batch row slots (module
    docstring). gamma, tree: as spec_jax.generate's, for every request (one compiled loop per
    row bucket); mesh: as generate's; max_context: tokens per slot, prompt plus new tokens
    (default the target's context, at most spec_jax.rows.DEFAULT_CONTEXT); max_new_tokens: the
    most a request may ask for (default max_context; spec_jax.generate's programs for the same
    max_new_tokens and cache length are the engine's); max_queue: requests that may wait;
    measure_costs (gamma=auto): where no costs are cached for a row bucket, measure its model
    calls now (about a minute each on the Qwen pair), or, False, start from the prior predicted
    from the models' sizes (as spec_jax.generate does), which the controllers correct by timing
    the rounds that run (their save_rounds caches that for the next start; launch.serve calls it
    at shutdown)."""

    def __init__(
        self,
        target,
        draft=None,
        *,
        max_batch: int = 8,
        max_queue: int = 64,
        gamma: int | str = "auto",
        tree: int | str = 0,
        mesh=None,
        max_context: int | None = None,
        max_new_tokens: int | None = None,
        verify_widths: str = "auto",
        prefill_cache: int = PREFILL_CACHE,
        measure_costs: bool = True,
        prefix_cache_mb: float = PREFIX_CACHE_MB,
    ):
        rows.check_counts(
            max_batch=(max_batch, 1), max_queue=(max_queue, 1), prefill_cache=(prefill_cache, 0)
        )
        self.target, self.max_batch, self.max_queue = target, max_batch, max_queue
        self.mesh = sharding.default_mesh() if mesh is None else mesh
        sharding.check_mesh(self.mesh)
        settings = dict(max_batch=max_batch, gamma=gamma, tree=tree, max_context=max_context)
        settings.update(
            max_new_tokens=max_new_tokens, verify_widths=verify_widths, measure_costs=measure_costs
        )
        p = plan.plan_engine(target, draft, self.mesh, settings)
        self._runner, self.controllers, self.buckets = p.runner, p.controllers, p.buckets
        self.max_context, self.max_new_tokens = p.max_context, p.max_new_tokens
        self._ids = itertools.count()
        self._queue: collections.deque[rows.Row] = collections.deque()
        self._outbox: list[Update] = []
        self._chunk = 0  # the last chunk's length; 0 after the table changed (the next is MIN_CHUNK)
        self._counters = collections.Counter()
        self._table = Table(
            self._runner,
            self.mesh,
            max_batch,
            self.max_context,
            self.controllers,
            self._counters,
            prefill_cache,
            self._prompt_width([PAD_ID], 1),
            engine_prefix_cache(target.config, self.mesh, self._runner.static.drafter, prefix_cache_mb),
        )
        self._slots = self._table.slots  # the Rows in the table's slots (the table's list)
        self._ttft: collections.deque[float] = collections.deque(maxlen=TTFT_KEPT)
        self._piece_seconds = 0.0  # the last piece of a long prompt's prefill (0: none since)
        self._round_seconds = 0.05  # seconds per round of the last chunk (a guess before one)

    @property
    def reads_prefixes(self) -> bool:
        """Whether a prefill reads the prompt's blocks held in the prefix cache (it is on): a
        request whose prompt another one prefilled first computes only the rest of it."""
        return self._table.prefix is not None

    @property
    def drafts(self) -> bool:
        """Whether the engine has a drafter that runs (not where gamma=auto dropped it)."""
        return not isinstance(self._runner.static.drafter, NoDrafter)

    @property
    def tokenizer(self):
        return self.target.tokenizer

    @property
    def idle(self) -> bool:
        """Nothing waits, runs, or has an Update to hand out."""
        return not self._queue and not self._outbox and all(r is None for r in self._slots)

    @property
    def live_rows(self) -> int:
        """The rows the compiled loop runs over now: the smallest bucket that holds the busy
        slots (0 before the first admission)."""
        return self._table.rows

    def bucket_for(self, n: int) -> int:
        """The smallest row bucket that holds n rows."""
        return self._table.bucket_for(n)

    # --- requests --------------------------------------------------------------------------
    def submit(self, request: Request, row_id: int = 0) -> Handle:
        """Queues a request (validated against the model) and returns its Handle. RequestError
        naming the field at fault; QueueFull when max_queue requests wait already. row_id:
        the request draws from fold_in(key(seed), row_id), as spec_jax.generate's prompt of
        that row id does (launch.generate --stream passes each prompt's index in its file)."""
        request.validate()
        ids = encode_prompt(self.target, request)
        stop_ids = rows.stop_ids_for(request, self.tokenizer, self.target.config.vocab_size)
        rows.check_room(ids, stop_ids, request, self.max_context, self.max_new_tokens)
        room = self.max_queue + self._slots.count(None)  # free slots take requests at the next step
        if request.max_tokens and len(self._queue) >= room:
            raise QueueFull(f"{len(self._queue)} requests are waiting already (max_queue {self.max_queue})")
        handle = Handle(next(self._ids), request, len(ids))
        row = rows.Row(handle, ids, stop_ids, time.perf_counter(), int(row_id))
        self._counters["requests_total"] += 1
        self._counters["prompt_tokens_total"] += len(ids)
        self._score(row)
        if not request.max_tokens:  # the prompt scored alone: no slot
            self._finish(row, "length")
        else:
            self._queue.append(row)
        return handle

    def _score(self, row: rows.Row) -> None:
        """The prompt's logprobs where the request asks (Request.prompt_logprobs), for its first
        Update: one scoring call (Runner.score), apart from its generation."""
        k, ids = row.handle.request.prompt_logprobs, row.prompt_ids
        if k is None:
            return
        width = max(self._prompt_width(ids, max(row.handle.request.max_tokens, 1)), len(ids))
        kept, compile_s, seconds = self._runner.score(ids, width, k)
        row.prompt_logprobs = row.handle.prompt_logprobs = kept
        self._counters["compile_seconds"] += compile_s
        self._counters["score_seconds"] += seconds
        self._counters["scored_prompts_total"] += 1

    def cancel(self, handle: Handle) -> None:
        """Ends the request now: a waiting one leaves the queue, a running one frees its slot.
        Its last Update (from the next step) says "cancelled". A finished request: nothing."""
        for row in self._queue:
            if row.handle is handle:
                self._queue.remove(row)
                return self._finish(row, "cancelled")
        for b, row in enumerate(self._slots):
            if row is not None and row.handle is handle:
                self._table.stop_rows[b] = True
                return self._finish(row, "cancelled")
        return None

    def _finish(
        self, row: rows.Row, reason: str, error: str | None = None, text: str = "", tokens=(), logprobs=None
    ) -> None:
        """Frees the row's slot and queues its last Update (logprobs: its tokens', where asked;
        the prompt's logprobs if not yet handed out)."""
        if row.slot is not None:
            self._slots[row.slot], self._chunk = None, 0
        prompt, row.prompt_logprobs = row.prompt_logprobs, None
        self._outbox.append(Update(row.handle, list(tokens), text, True, reason, error, logprobs, prompt))
        self._counters[f"finished_{reason}"] += 1

    # --- stepping --------------------------------------------------------------------------
    def step(self) -> list[Update]:
        """Admits waiting requests into free slots (their first tokens come back at once, read
        from the rows they were prefilled in while the table's writes run) or, when none was
        admitted, runs one chunk of rounds over the table's busy rows (compacted into its lowest
        slots, the loop run over the smallest bucket that holds them). Returns the Updates of
        every request that produced tokens or finished since the last step."""
        start = time.perf_counter()
        table = self._table
        if table.state is not None:
            table.timed(table.compact)  # waits for the last admission's row writes too
        firsts = self._admit()
        if firsts:
            self._collect(firsts)
        elif table.state is not None:
            table.timed(table.shrink)
            if self._busy():
                self._read_piece()  # of a long prompt waiting (Table.read_piece), then decoding
                self._run_chunk()
                self._collect()
        updates, self._outbox = self._outbox, []
        self._counters["step_seconds"] += time.perf_counter() - start
        return updates

    def drain(self) -> Iterator[Update]:
        """step() until nothing waits or runs, yielding every Update."""
        while not self.idle:
            yield from self.step()

    def _busy(self) -> int:
        return sum(r is not None for r in self._slots)

    def _admit(self) -> list:
        """Prefills waiting requests into the free slots, in order: consecutive requests of one
        prompt width in one prefill call (whatever their warps). Returns Table.insert's (row,
        block, index) of each request admitted."""
        firsts = []
        while self._queue and None in self._slots and self._uncached(self._queue[0]) <= PREFILL_PIECE:
            width, free, group = self._width(self._queue[0]), self._slots.count(None), []
            while self._queue and len(group) < free and self._width(self._queue[0]) == width:
                group.append(self._queue.popleft())
            firsts, self._chunk = firsts + self._table.insert(group, width), 0
        return firsts

    def _uncached(self, row: rows.Row) -> int:
        """A waiting prompt's tokens past its cached prefix while rows decode (0 otherwise: it is
        prefilled whole)."""
        return self._table.uncached(row.prompt_ids) if self._busy() else 0

    def _read_piece(self) -> None:
        """The next PREFILL_PIECE tokens of the first waiting prompt into the prefix cache where
        more than that is left, and the next chunk about as long (a long prompt takes turns)."""
        if self._queue and self._uncached(self._queue[0]) > PREFILL_PIECE:
            row, start = self._queue[0], time.perf_counter()
            self._table.read_piece(row.prompt_ids, PREFILL_PIECE, self._width(row))
            self._piece_seconds = time.perf_counter() - start

    def _width(self, row: rows.Row) -> int:
        return self._prompt_width(row.prompt_ids, row.handle.request.max_tokens)

    def _prompt_width(self, ids, max_tokens: int) -> int:
        """The prompt width spec_jax.generate gives a request alone (its length bucket), within
        the slot."""
        features = self._runner.static.drafter.reads_features
        return min(layout(self.target.config, [ids], max_tokens, 0, features)[0], self.max_context)

    def _run_chunk(self) -> None:
        """One chunk of rounds over the table's rows (freed rows first marked done): at most as
        many rounds as the busy row nearest its budget has tokens left, so that a slot it
        frees is taken at once."""
        table = self._table
        if table.inputs_stale:  # the rows' prompts (a drafter's catch-up reads them) and stop ids
            self._runner.inputs = table.host.inputs(table.rows, self.mesh)
            table.inputs_stale = False
        table.apply_stops()
        self._chunk = MIN_CHUNK if self._queue or not self._chunk else min(2 * self._chunk, MAX_CHUNK)
        if self._piece_seconds:  # after a piece of a long prompt: decode about as long
            self._chunk = int(min(MAX_CHUNK, max(MIN_CHUNK, self._piece_seconds / self._round_seconds)))
            self._piece_seconds = 0.0
        busy = [r for r in self._slots if r is not None]
        left = min(r.handle.request.max_tokens - len(r.tokens) for r in busy)
        if any(r.handle.request.stop for r in busy):
            left = min(left, STOP_CHUNK)
        rounds = max(1, min(self._chunk, left))
        start = time.perf_counter()
        if not self.controllers:
            table.state, compile_s, _, _ = self._runner.loop(table.state, rounds)
        else:
            before = observed(table.state)
            table.state, _, compile_s = auto_chunk(
                self.controllers[table.rows], self._runner, table.catch_up, table.state, before, rounds
            )
        after = rows.table_counters(table.state)
        drafted_rounds, drafted, accepted = (after - table.counted).tolist()
        table.counted = after
        self._counters["compile_seconds"] += compile_s
        decode_s = time.perf_counter() - start - compile_s
        self._counters["decode_seconds"] += decode_s
        if drafted_rounds and not compile_s:
            self._round_seconds = decode_s / drafted_rounds
        self._counters["chunks"] += 1
        self._counters["rounds"] += drafted_rounds
        self._counters["draft_tokens_total"] += drafted
        self._counters["accepted_tokens_total"] += accepted

    def _collect(self, firsts=None) -> None:
        """Each busy row's new tokens and text into the outbox; finished rows free their slots.
        firsts: the rows just admitted, (row, block, index): each one's first token is read from
        row index of the block it was prefilled in (or kept), not from the table."""
        if firsts is None:  # (row, key of the state it is read from, its index there)
            blocks = {0: self._table.state}
            sources = [
                (row, 0, b) for b, row in enumerate(self._slots[: self._table.rows]) if row is not None
            ]
        else:
            blocks = {id(block): block for _, block, _ in firsts}
            sources = [(row, id(block), i) for row, block, i in firsts]
        leaves = {
            k: (s.out.tokens, s.out.num_generated, s.out.done, s.out.nonfinite) for k, s in blocks.items()
        }
        asking = {key for row, key, _ in sources if row.handle.request.logprobs is not None}
        kept = {
            k: (s.out.logprobs, s.out.top_ids, s.out.top_logprobs) for k, s in blocks.items() if k in asking
        }
        fetched, kept = sharding.fetch((leaves, kept))  # the logprobs only of blocks whose rows ask
        now = time.perf_counter()
        for row, key, b in sources:
            tokens, counts, done, nonfinite = fetched[key]
            row.tokens = tokens[b, : counts[b]].tolist()
            if key in kept and row.handle.request.logprobs is not None:
                self._read_logprobs(row, kept[key], b)
            if row.tokens and row.first_token_at is None:
                row.first_token_at = now
                self._ttft.append(now - row.submitted)
            reason = None
            if done[b]:
                hit_stop = bool(row.tokens) and row.tokens[-1] in row.stop_ids
                reason = "error" if nonfinite[b] else "stop" if hit_stop else "length"
            self._emit(row, reason)

    def _read_logprobs(self, row: rows.Row, kept, b: int) -> None:
        """row.logprobs extended to its tokens from row b of kept, the host's (Output.logprobs,
        top_ids, top_logprobs): each new token's and its request's top k."""
        have = row.logprobs or TokenLogprobs()
        start, end = len(have), len(row.tokens)
        lp, top_ids, top_lp = (a[b, start:end] for a in kept)
        k = row.handle.request.logprobs
        row.logprobs = have + TokenLogprobs.of(row.tokens[start:], lp, top_ids, top_lp, k)

    def _emit(self, row: rows.Row, reason: str | None) -> None:
        """Queues the row's Update (new tokens, new text, their logprobs where asked, the
        prompt's logprobs in the first; a stop string ends it as "stop")."""
        text, cut = rows.visible_text(
            self.tokenizer, row.tokens, row.handle.request.stop, final=reason is not None
        )
        if cut is not None:
            self._counters["tokens_past_stop_total"] += len(row.tokens) - cut
            row.tokens, reason = row.tokens[:cut], "stop"
            if row.slot is not None:
                self._table.stop_rows[row.slot] = True
        new_tokens, new_text = row.tokens[row.sent_tokens :], text[len(row.sent_text) :]
        logprobs = None if row.logprobs is None else row.logprobs[row.sent_tokens : len(row.tokens)]
        row.sent_tokens, row.sent_text = len(row.tokens), text
        self._counters["generation_tokens_total"] += len(new_tokens)
        if reason is not None:
            error = NONFINITE_ERROR if reason == "error" else None
            return self._finish(row, reason, error, new_text, new_tokens, logprobs)
        if new_tokens or new_text:
            prompt, row.prompt_logprobs = row.prompt_logprobs, None
            self._outbox.append(Update(row.handle, new_tokens, new_text, False, None, None, logprobs, prompt))
        return None

    # --- counters --------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters for monitoring (each named and described by launch.serve's /metrics): requests,
        tokens (prompt, generated, drafted, accepted, read from the prefix cache, computed past a
        stop), finishes by reason, chunks, rounds, prefills and pieces, seconds of compiling,
        prefilling, scoring, decoding, table work and steps (step_seconds less the rest: the
        host's own work); now: queue_depth, slots_busy, max_batch, live_rows,
        prefix_cache_tokens; ttft_seconds: the last TTFT_KEPT requests' times to first token."""
        out = dict(self._counters)
        if self._table.prefix is not None:
            out.update(self._table.prefix.counters, prefix_cache_tokens=self._table.prefix.used_tokens)
        out.update(
            queue_depth=len(self._queue),
            slots_busy=sum(r is not None for r in self._slots),
            max_batch=self.max_batch,
            live_rows=self._table.rows,
            ttft_seconds=list(self._ttft),
        )
        return out
