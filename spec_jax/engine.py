"""The engine: one object that outlives a call, for requests that come and go (continuous
batching at the granularity of chunks of rounds). It owns the plan (spec_jax.plan.plan_engine:
the placed models, the compiled programs, gamma=auto's controllers per row bucket) and a table
of max_batch row slots (spec_jax.table.Table: one SpecState over the busy slots).

  1. submit: Request.admit checks and converts the request (ids, stop ids, room); it waits.
  2. step: waiting requests of one prompt width are prefilled together into free slots
     (Table.insert, spec_jax.prefiller: the prefix cache, kept rows, a long prompt's pieces);
     their first tokens go out at once.
  3. step, when none was admitted: one chunk of the ONE compiled loop over the table's busy
     rows (spec_jax.chunks: how many rounds); their new tokens and text go out as Updates
     (spec_jax.updates), and finished rows free their slots. cancel frees a slot at once.

Invariants (docs/design.md, "The engine"): a request's tokens do not depend on what else runs
(its own keys, budget, stop ids and warp, per-row operands of the loop; rows computed
bit-identically whatever the batch). Not thread-safe: one thread owns an Engine.
"""

import collections
import itertools
import time
from collections.abc import Iterator
from typing import Any

from spec_jax import chunks, plan, rows, sharding
from spec_jax.drafting import Drafter
from spec_jax.prefiller import Prefiller
from spec_jax.prefix_cache import engine_prefix_cache
from spec_jax.request import Admitted, Limits, Request
from spec_jax.table import Table
from spec_jax.updates import Handle, Update, next_update, read_rows, sources

NONFINITE_ERROR = "the target's logits became NaN or infinite; the output stops before them"
# Prefilled rows kept for requests seen again (rows.prefill_key; each holds a slot's caches, about
# 85 MB for the Qwen pair at 1024 tokens), and the prefix cache's MB (spec_jax.prefix_cache: about
# 4,600 prompt tokens of the Qwen 1.5B, a long system prompt and a few conversations).
PREFILL_CACHE, PREFIX_CACHE_MB = 16, 256
TTFT_KEPT = 1024  # stats()' ttft_seconds: the most recent requests' times to first token


class QueueFull(RuntimeError):
    """submit() with max_queue requests already waiting beyond the free slots."""


class Engine:
    """Serves Requests on one target (and drafter) with a table of max_batch row slots.

    Args:
      target, draft: models (models.load), as spec_jax.generate's; draft may be any drafter.
      max_batch: row slots; max_queue: requests that may wait beyond them (QueueFull past it).
      gamma, tree, mesh, verify_widths: as spec_jax.generate's, for every request.
      max_context: tokens per slot, prompt plus new tokens (default the target's context, at
        most spec_jax.rows.DEFAULT_CONTEXT); max_new_tokens: the most a request may ask for.
      prefill_cache: prefilled rows kept for identical requests; prefix_cache_mb: the prefix
        cache's size (0: off; on only where exact, spec_jax.prefix_cache).
      measure_costs (gamma=auto): measure a row bucket's model calls where no costs are cached
        (a minute each on the Qwen pair), or, False, start from predicted costs.
    """

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
        self.limits = Limits(self.max_context, self.max_new_tokens)  # what Request.admit checks
        self._ids = itertools.count()
        self._queue: collections.deque[rows.Row] = collections.deque()
        self._outbox: list[Update] = []
        self._chunk = 0  # the last chunk's length; 0 after the table changed (the next is MIN_CHUNK)
        self._counters = collections.Counter()
        prefix = engine_prefix_cache(target.config, self.mesh, self._runner.static.drafter, prefix_cache_mb)
        self._prefiller = Prefiller(
            self._runner,
            self.mesh,
            self.buckets,
            self._counters,
            prefill_cache,
            prefix,
            target.config,
            self.max_context,
        )
        self._table = Table(self._prefiller, self.controllers)
        self._slots = self._table.slots  # the Rows in the table's slots (the table's list)
        self._ttft: collections.deque[float] = collections.deque(maxlen=TTFT_KEPT)
        self._piece_seconds = 0.0  # the last piece of a long prompt's prefill (0: none since)
        self._round_seconds = 0.05  # seconds per round of the last chunk (a guess before one)

    @property
    def reads_prefixes(self) -> bool:
        """Whether prefills read prompts' blocks from the prefix cache (it is on)."""
        return self._prefiller.prefix is not None

    @property
    def drafter(self) -> Drafter:
        """The drafter that runs (spec_jax.plan.bucket_controllers: gamma=auto may set a model aside)."""
        return self._runner.static.drafter

    @property
    def tokenizer(self):
        return self.target.tokenizer

    @property
    def idle(self) -> bool:
        """Nothing waits, runs, or has an Update to hand out."""
        return not self._queue and not self._outbox and all(r is None for r in self._slots)

    @property
    def live_rows(self) -> int:
        """The rows the loop runs over: the smallest bucket holding the busy slots (0 at first)."""
        return self._table.rows

    def submit(self, request: Request | Admitted, row_id: int = 0) -> Handle:
        """Queues a request and returns its Handle: a Request is admitted here (Request.admit
        against the target and this engine's limits), or was already (a server admits on its
        own threads). RequestError naming the field at fault; QueueFull when max_queue requests
        wait already. row_id: the request draws from fold_in(key(seed), row_id), as
        spec_jax.generate's prompt of that row id does."""
        if isinstance(request, Request):
            request = request.admit(self.target, self.limits)
        admitted, request, ids = request, request.request, list(request.ids)
        room = self.max_queue + self._slots.count(None)  # free slots take requests at the next step
        if request.max_tokens and len(self._queue) >= room:
            raise QueueFull(f"{len(self._queue)} requests are waiting already (max_queue {self.max_queue})")
        handle = Handle(next(self._ids), request, len(ids))
        row = rows.Row(handle, ids, admitted.stop_ids, time.perf_counter(), int(row_id))
        for operand in ("sampling", "num_logprobs", "max_drafts"):  # the row's, from its admission
            setattr(row, operand, getattr(admitted, operand))
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
        Update (Prefiller.score)."""
        request, ids = row.handle.request, row.prompt_ids
        if request.prompt_logprobs is not None:
            self._prefiller.score(row, max(self._prefiller.width(ids, max(request.max_tokens, 1)), len(ids)))

    def cancel(self, handle: Handle) -> None:
        """Ends the request now: a waiting one leaves the queue, a running one frees its slot.
        Its last Update (from the next step) says "cancelled". A finished request: nothing."""
        for row in self._queue:
            if row.handle is handle:
                self._queue.remove(row)
                return self._finish(row, "cancelled")
        for row in self._slots:
            if row is not None and row.handle is handle:
                return self._finish(row, "cancelled")
        return None

    def _finish(self, row: rows.Row, reason: str) -> None:
        """Ends the row with no more tokens (cancelled, or a prompt scored alone): its last Update
        (with the prompt's logprobs if not yet handed out)."""
        prompt, row.prompt_logprobs = row.prompt_logprobs, None
        self._put(row, Update(row.handle, [], "", True, reason, None, None, prompt))

    def _put(self, row: rows.Row, update: Update) -> None:
        """Queues the row's update; a finished row frees its slot."""
        if update.finished:
            if row.slot is not None:
                self._table.free(row.slot)
                self._chunk = 0
            self._counters[f"finished_{update.finish_reason}"] += 1
        self._outbox.append(update)

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
            if self._table.busy():
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

    def _admit(self) -> list:
        """Prefills waiting requests into the free slots, in order, consecutive ones of one prompt
        width in one call; a long prompt still read in pieces (Prefiller.piece_due) keeps its place
        while those behind it are admitted. Returns Table.insert's (row, block, index) of each."""
        firsts = []
        while None in self._slots:
            busy = bool(self._table.busy())
            ready = [r for r in self._queue if not self._prefiller.piece_due(r.prompt_ids, busy)]
            if not ready:
                break
            width, free, group = self._prefiller.row_width(ready[0]), self._slots.count(None), []
            for row in ready:
                if len(group) == free or self._prefiller.row_width(row) != width:
                    break
                group.append(row)
            taken = {id(r) for r in group}
            self._queue = collections.deque(r for r in self._queue if id(r) not in taken)
            firsts, self._chunk = firsts + self._table.insert(group, width), 0
        return firsts

    def _read_piece(self) -> None:
        """The next piece of the first waiting prompt into the prefix cache where it is due
        (Prefiller.piece_due), and the next chunk about as long (a long prompt takes turns)."""
        if self._queue and self._prefiller.piece_due(self._queue[0].prompt_ids, bool(self._table.busy())):
            row, start = self._queue[0], time.perf_counter()
            self._prefiller.read_piece(row.prompt_ids, self._prefiller.row_width(row))
            self._piece_seconds = time.perf_counter() - start

    def _run_chunk(self) -> None:
        """One chunk of rounds over the table's rows (freed rows first marked done; its length:
        spec_jax.chunks.chunk_rounds)."""
        table = self._table
        table.ready()
        busy = [r for r in self._slots if r is not None]
        rounds, self._chunk = chunks.chunk_rounds(
            self._chunk, bool(self._queue), busy, self._piece_seconds, self._round_seconds
        )
        self._piece_seconds = 0.0
        per_round = chunks.run_chunk(self._runner, self.controllers, table, rounds, self._counters)
        self._round_seconds = per_round or self._round_seconds

    def _collect(self, firsts=None) -> None:
        """Each busy row's new tokens and text into the outbox (updates.read_rows); finished rows
        free their slots. firsts: the rows just admitted (Table.insert's), read from their blocks."""
        now = time.perf_counter()
        for row, reason in read_rows(*sources(self._table.state, self._slots[: self._table.rows], firsts)):
            if row.tokens and row.first_token_at is None:
                row.first_token_at = now
                self._ttft.append(now - row.submitted)
            self._emit(row, reason)

    def _emit(self, row: rows.Row, reason: str | None) -> None:
        """Queues the row's Update (updates.next_update: new tokens, new text, their logprobs
        where asked; a stop string ends it as "stop")."""
        sent = row.sent_tokens
        update, past = next_update(row, reason, self.tokenizer, NONFINITE_ERROR)
        self._counters["tokens_past_stop_total"] += past
        self._counters["generation_tokens_total"] += len(row.tokens) - sent
        if update is not None:
            self._put(row, update)

    def stats(self) -> dict[str, Any]:
        """Counters for monitoring, each named and described by launch.serve's /metrics (tokens,
        finishes, chunks, rounds, prefills, seconds by kind of work); now: queue_depth,
        slots_busy, max_batch, live_rows, prefix_cache_tokens; ttft_seconds: the last TTFT_KEPT
        requests' times to first token."""
        out = dict(self._counters)
        if (prefix := self._prefiller.prefix) is not None:
            out.update(prefix.counters, prefix_cache_tokens=prefix.used_tokens)
        out.update(
            queue_depth=len(self._queue),
            slots_busy=self._table.busy(),
            max_batch=self.max_batch,
            live_rows=self._table.rows,
            ttft_seconds=list(self._ttft),
        )
        return out
