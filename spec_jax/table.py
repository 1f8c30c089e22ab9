"""The engine's table (spec_jax.engine): one loop state whose rows are the busy slots.

- Busy rows sit in the lowest slots: a row that leaves is replaced by the highest busy row
  (move), and the loop runs over the smallest bucket of rows (row_buckets: 1, 2, 4, ...
  max_batch) that holds them, so a lone request pays for one row, not max_batch. The table
  grows (free rows: copies of a blank, done row) when admissions need more rows and shrinks
  when rows leave (resize).
- A free row is done in the loop state: it computes but commits nothing.
- Admitting requests writes EVERY per-row leaf of their prefilled rows into their slots (the
  row axis of each leaf: row_ops.batch_axes, found from the prefill's shapes at two batch
  sizes), so nothing of a previous occupant survives: its cache, drafter state, tokens,
  budget, keys and per-row metrics. The first admission into an empty table writes nothing:
  its prefilled block (free rows past the requests, done) becomes the table. Rows prefilled
  for identical requests are kept (spec_jax.prefiller.prefill_key) and written again instead of a prefill.
- While a gamma=auto plain chunk holds the drafter's states aside (CatchUp.stash), writes,
  moves and resizes apply to them too.
- An admission's resize and row writes are deferred (Table.flush, run by the next compaction):
  the admitted requests' first tokens, read from the rows they were prefilled in, go out
  without waiting for them (XLA:CPU runs these copies inline, a few hundred ms for a burst).
"""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax import row_ops, rows, sharding
from spec_jax.autogamma import CatchUp
from spec_jax.decode import PAD_ID
from spec_jax.prefiller import Prefiller, prefill_key
from spec_jax.request import stop_row
from spec_jax.speculative import SpecState, spec_prefill
from spec_jax.updates import First


def row_buckets(max_batch: int, unit: int = 1) -> tuple[int, ...]:
    """The row counts the engine's loop runs at: unit (the mesh's data axis) times powers of
    two below max_batch, and max_batch."""
    sizes = []
    n = unit
    while n < max_batch:
        sizes.append(n)
        n *= 2
    return (*sizes, max_batch)


class Table:
    """The loop state over the busy slots, its host copies (slots: the Rows; host: prompts and
    stop ids), the drafter's catch-up, and the kept prefilled rows. runner: the engine's
    Runner (its inputs are set here); controllers: gamma=auto's per bucket ({} without);
    counters: the engine's."""

    def __init__(self, prefiller: Prefiller, controllers: dict):
        self.prefiller, self.controllers, self.counters = prefiller, controllers, prefiller.counters
        self.runner, self.mesh, self.max_context = prefiller.runner, prefiller.mesh, prefiller.max_context
        self.buckets, self.bucket_for = prefiller.buckets, prefiller.bucket_for
        max_batch = self.buckets[-1]
        self.slots: list[rows.Row | None] = [None] * max_batch
        self.host = rows.HostTable.empty(max_batch, self.max_context)
        self.stop_rows = np.zeros(max_batch, bool)  # freed slots the loop state does not yet mark done
        self.inputs_stale = False  # the host's table of prompts and stop ids changed
        self.state, self.rows = None, 0  # the loop state (built at the first admission), its rows
        self.deferred: list = []  # device work on the state that flush() runs (an admission's)
        self._blank, self._axes = None, None  # a free row; the row axis of each leaf (blank, axes)
        # the free row's prompt width: a one-token request's, so that one prefill program serves both
        self.blank_width = prefiller.width([PAD_ID], 1)
        self.catch_up = None
        self.counted = None

    def busy(self) -> int:
        return sum(r is not None for r in self.slots)

    def flush(self) -> None:
        """Runs the deferred device work on the state, in order."""
        deferred, self.deferred = self.deferred, []
        for op in deferred:
            op()

    @property
    def blank(self) -> SpecState:
        """The free row: a one-token prompt, done (prefilled at its first use)."""
        if self._blank is None:
            inputs = rows.HostTable.empty(1, self.blank_width).inputs(1, self.mesh)
            active = sharding.put(np.zeros(1, bool), sharding.batch_sharding(self.mesh, 1))
            blank, compile_s, _ = self.prefiller.run(active, inputs, [], 1)
            self.counters["compile_seconds"] += compile_s
            self._blank = blank.replace(max_drafts=jnp.zeros(1, jnp.int32))
        return self._blank

    @property
    def axes(self) -> dict[str, tuple[int, ...]]:
        """row_axes(), found at its first use."""
        if self._axes is None:
            self._axes = self.row_axes()
        return self._axes

    def build(self, state: SpecState | None = None) -> None:
        """The table over `state` (a prefilled block: its rows past the requests are free rows,
        one-token prompts, done, as the blank is), or else of one free row (a copy of the blank).
        The first admission into an empty table starts from its block, so that neither the blank
        nor the row axes are needed before the first token (a --stream run's first text)."""
        # a copy: the loop donates the table's state, and a block's rows may wait in pending_keeps
        self.state = jax.tree.map(jnp.copy, self.blank if state is None else state)
        self.rows = int(self.state.length.shape[0])
        self.counted = row_ops.table_counters(self.state)
        self.inputs_stale = True
        if self.controllers:
            self.catch_up = CatchUp(self.runner, np.ones(self.rows, np.int64))
            self.controllers[self.rows].forget(np.ones(self.rows, bool))

    def row_axes(self) -> dict[str, tuple[int, ...]]:
        """The row axis of each leaf (row_ops.batch_axes) of the loop state ("state"), of the
        drafter's state ("draft") and of the loop state without it ("nodraft": a plain chunk's,
        while the drafter's waits aside), from the shapes of the blank row (batch 1, already
        prefilled) and of the prefill at batch 2 (one trace of it: each trace of the whole model
        costs seconds of a server's or a --stream run's start for a 1.5B model)."""
        inputs = rows.HostTable.empty(2, self.blank_width).inputs(2, self.mesh)
        prefill = functools.partial(spec_prefill, self.runner.static)
        b = jax.eval_shape(prefill, self.runner.target_params, self.runner.draft_params, inputs)
        b = b.replace(max_drafts=jax.ShapeDtypeStruct((2,), jnp.int32))
        a = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self.blank)
        return {
            "state": row_ops.batch_axes(a, b),
            "draft": row_ops.batch_axes(a.draft_state, b.draft_state),
            "nodraft": row_ops.batch_axes(a.replace(draft_state=()), b.replace(draft_state=())),
        }

    def stash(self):
        """The drafter's state set aside while plain chunks run (CatchUp.stash), or None."""
        return self.catch_up.stash if self.catch_up is not None else None

    def state_axes(self) -> tuple[int, ...]:
        return self.axes["nodraft" if self.stash() is not None else "state"]

    def resize(self, n: int) -> None:
        """The table runs over n rows: its first n (the busy ones among them), or all of them and
        free rows (copies of the blank one) up to n. gamma=auto goes on with bucket n's
        controller (its rows' acceptance back to the prior). The state's copy is deferred."""
        self.deferred.append(functools.partial(self._resize_state, n))
        if self.catch_up is not None:
            synced = self.catch_up.synced
            self.catch_up.synced = np.concatenate([synced, np.ones(max(n - len(synced), 0), np.int64)])[:n]
            self.controllers[n].forget(np.ones(n, bool))
        self.rows, self.inputs_stale = n, True

    def _resize_state(self, n: int) -> None:
        stash = self.stash()
        blank = self.blank if stash is None else self.blank.replace(draft_state=())
        self.state = row_ops.resize_jit(self.state, blank, self.state_axes(), n)
        if stash is not None:
            self.catch_up.stash = row_ops.resize_jit(stash, self.blank.draft_state, self.axes["draft"], n)

    def move(self, src: int, dst: int) -> None:
        """The busy row in slot src moves to the free slot dst (its state, host row and
        catch-up position); src becomes free (marked done before the next chunk)."""
        s, d = jnp.int32(src), jnp.int32(dst)
        stash = self.stash()
        self.state = row_ops.move_row_jit(self.state, self.state_axes(), s, d)
        if stash is not None:
            self.catch_up.stash = row_ops.move_row_jit(stash, self.axes["draft"], s, d)
        self.host.move(src, dst)
        self.stop_rows[src], self.stop_rows[dst] = True, False
        row = self.slots[src]
        self.slots[dst], self.slots[src], row.slot = row, None, dst
        if self.catch_up is not None:
            self.catch_up.synced[dst] = self.catch_up.synced[src]
            self.controllers[self.rows].forget(np.arange(self.rows) == dst)
        self.inputs_stale = True

    def compact(self) -> None:
        """Freed rows are marked done (the deferred work run first), and the busy rows move into
        the lowest slots."""
        self.apply_stops()
        busy = [b for b, r in enumerate(self.slots) if r is not None]
        holes = [b for b in range(len(busy)) if self.slots[b] is None]
        for dst, src in zip(holes, [b for b in busy if b >= len(busy)], strict=True):
            self.move(src, dst)

    def free(self, slot: int) -> None:
        """Slot's request leaves: the slot takes the next admission, and its row of the loop
        state is marked done before the next chunk (apply_stops); its entries go to the prefix
        cache first (Prefiller.keep_generated)."""
        self.prefiller.keep_generated(self.state, self.slots[slot], slot)
        self.slots[slot], self.stop_rows[slot] = None, True

    def counters_now(self) -> np.ndarray:
        """row_ops.table_counters of the state: int [3] rounds, draft tokens, accepted tokens."""
        return row_ops.table_counters(self.state)

    def shrink(self) -> None:
        """The table runs over the smallest bucket that holds its busy rows (in its lowest slots)."""
        n = self.bucket_for(self.busy())
        if n < self.rows:
            self.apply_stops()
            self.resize(n)
            self.flush()

    def ready(self) -> None:
        """Before a chunk: the loop's inputs (the rows' prompts, which a drafter's catch-up reads,
        and stop ids) placed again where they changed, and the freed rows marked done."""
        if self.inputs_stale:
            self.runner.inputs = self.host.inputs(self.rows, self.mesh)
            self.inputs_stale = False
        self.apply_stops()

    def apply_stops(self) -> None:
        """The deferred work runs, and the loop state's rows of freed slots are marked done."""
        self.flush()
        if self.stop_rows[: self.rows].any():
            stop = rows.put_snapshot(self.stop_rows[: self.rows], sharding.batch_sharding(self.mesh, 1))
            self.state = row_ops.mark_done_jit(self.state, stop)
        self.stop_rows[:] = False

    def insert(self, group: list[rows.Row], width: int) -> list[First]:
        """Writes every per-row leaf of each request's prefilled row into the next free slot
        (the table grown to hold them), so nothing of a slot's previous occupant is read: the
        rows kept from an earlier identical prefill (spec_jax.prefiller.prefill_key), and the others'
        prefilled together (the smallest bucket of rows that holds them, the width of each
        alone), then kept (at the next admission: keep_pending). Into an empty table, a group
        prefilled whole becomes the table itself (build). The resize and writes are deferred
        (flush). Returns (row, block, index) per request: its prefilled row is row index of
        block (a prefill's state or a kept row)."""
        if self.prefiller.pending:  # (the row axes are found here, not before a first token)
            self.keep_pending()
        keys = [prefill_key(row, width) for row in group]
        start, k = self.busy(), len(group)
        misses = [
            (b, row)
            for b, (row, key) in enumerate(zip(group, keys, strict=True), start)
            if key not in self.prefiller.kept
        ]
        if self.state is None and start == 0 and len(misses) == k:  # the table starts from the block
            block = self.prefiller.prefill(group, width)
            self.build(block)
            firsts = [First(row, block, i) for i, row in enumerate(group)]
        else:
            if self.state is None:
                self.build()
            if self.bucket_for(start + k) > self.rows:
                self.resize(self.bucket_for(start + k))
            firsts = []
            for b, (row, key) in enumerate(zip(group, keys, strict=True), start):
                if key in self.prefiller.kept:
                    self.prefiller.kept.move_to_end(key)
                    budget = row.handle.request.max_tokens
                    self.deferred.append(functools.partial(self.write, self.prefiller.kept[key], [b], budget))
                    self.counters["prefill_cache_hits"] += 1
                    firsts.append(First(row, self.prefiller.kept[key], 0))
            block = None
            if misses:
                block = self.prefiller.prefill([row for _, row in misses], width)
                self.deferred.append(functools.partial(self.write, block, [b for b, _ in misses]))
                firsts += [First(row, block, i) for i, (_, row) in enumerate(misses)]
        if self.prefiller.prefill_cache and misses:
            self.prefiller.pending += [(keys[b - start], block, i) for i, (b, _) in enumerate(misses)]
        for b, row in enumerate(group, start):
            self.host.set_row(b, row.prompt_ids, stop_row(row.stop_ids))
            self.stop_rows[b], row.slot, self.slots[b] = False, b, row
            if self.catch_up is not None:
                self.catch_up.synced[b] = len(row.prompt_ids)
        if self.catch_up is not None:
            new = np.arange(self.rows)
            self.controllers[self.rows].forget((new >= start) & (new < start + k))
        self.inputs_stale = True  # placed again once, before the next chunk
        return firsts

    def keep_pending(self) -> None:
        """The rows prefilled since the last admission, each taken from its block, into the
        prefiller's kept rows (Prefiller.keep)."""
        for key, block, i in self.prefiller.pending:
            self.prefiller.keep(key, row_ops.take_row_jit(block, self.axes["state"], jnp.int32(i)))
        self.prefiller.pending = []

    def timed(self, fn, *args) -> None:
        """fn(*args), its device work done, timed into stats' table_seconds (the table's row
        writes, moves and resizes: device work besides the prefill and the loop)."""
        start = time.perf_counter()
        fn(*args)
        if self.state is not None:
            jax.block_until_ready((self.state, self.stash()))
        self.counters["table_seconds"] += time.perf_counter() - start

    def write(self, block: SpecState, slots: list[int], budget: int | None = None) -> None:
        """Rows 0 .. len(slots) - 1 of block (a prefill's state, or a kept row: then budget is
        its request's) into the table's slots (the drafter's states into the stash while a
        plain chunk holds them aside)."""
        batch = int(block.length.shape[0])
        where = np.full(batch, self.rows, np.int32)  # past the table: dropped
        where[: len(slots)] = slots
        where = jnp.asarray(where)
        if (stash := self.stash()) is not None:
            self.catch_up.stash = row_ops.write_rows_jit(stash, block.draft_state, self.axes["draft"], where)
            block = block.replace(draft_state=())
        self.state = row_ops.write_rows_jit(self.state, block, self.state_axes(), where)
        if budget is not None:
            self.state = row_ops.set_budget_jit(self.state, jnp.int32(slots[0]), jnp.int32(budget))
