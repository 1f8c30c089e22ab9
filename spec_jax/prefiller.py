"""The engine's prefills (spec_jax.table.Table calls them): a group of admitted requests
prefilled in one call, each row's keys and warp its request's alone (group_inputs); with the
prefix cache where it is on, each request read from the end of its cached prefix and its
prompt's blocks kept after; rows prefilled for identical requests (prefill_key) kept for the
next; and a long prompt's pieces read into the prefix cache (read_piece).
"""

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax import sharding
from spec_jax.decode import PAD_ID, PrefillInputs, layout
from spec_jax.prefix_cache import BLOCK
from spec_jax.request import MAX_STOP_IDS, Request, stop_row
from spec_jax.rows import Row, row_keys_jit
from spec_jax.sampling import RowSampling, SamplingParams
from spec_jax.speculative import SpecState
from spec_jax.updates import Handle

# A prompt whose uncached part is longer than this, arriving while rows decode, is read into the
# prefix cache this many tokens at a time (read_piece), each piece followed by a chunk of decoding
# of about the piece's time, before it is admitted: the running streams slow down, not stop.
PREFILL_PIECE = 2 * BLOCK


def group_inputs(group: list[Row], width: int, batch: int) -> PrefillInputs:
    """The requests of group as PrefillInputs of `batch` rows (>= len(group); the rest are
    one-token PAD_ID prompts, greedy) and the given width, unplaced. Each row's keys and warp
    are its request's alone: fold_in(key(seed), row_id)."""
    tokens = np.full((batch, width), PAD_ID, np.int32)
    lens, budgets = np.ones(batch, np.int32), np.ones(batch, np.int32)
    stops = np.full((batch, MAX_STOP_IDS), -1, np.int32)
    keys = []
    for i, row in enumerate(group):
        tokens[i, : len(row.prompt_ids)] = row.prompt_ids
        lens[i], budgets[i] = len(row.prompt_ids), row.handle.request.max_tokens
        stops[i] = stop_row(row.stop_ids)
        keys.append(
            row_keys_jit(jax.random.key(row.handle.request.seed), np.asarray([row.row_id], np.uint32))
        )
    keys += [row_keys_jit(jax.random.key(0), np.zeros(1, np.uint32))] * (batch - len(group))
    return PrefillInputs(
        tokens=jnp.asarray(tokens),
        prompt_lens=jnp.asarray(lens),
        stop_ids=jnp.asarray(stops),
        keys=jnp.concatenate(keys),
        budgets=jnp.asarray(budgets),
        sampling=RowSampling.of(
            [row.sampling for row in group] + [SamplingParams(0.0)] * (batch - len(group))
        ),
        num_logprobs=np.asarray([row.num_logprobs for row in group] + [-1] * (batch - len(group)), np.int32),
    )


def prefill_key(row: Row, width: int) -> tuple:
    """Everything a request's prefilled row depends on in one engine, but its budget: its prompt,
    the prefill's width, its keys (seed, row id), stop ids, speculation, the warp, and whether
    its budget ends it at the first token, and the logprobs it asks. Two requests of one key get
    the same row, bit for bit (the CPU prefill is row-wise), except for the budget leaf
    (set_budget)."""
    request = row.handle.request
    return (
        tuple(row.prompt_ids),
        width,
        request.seed,
        row.row_id,
        request.max_tokens == 1,
        tuple(row.stop_ids),
        row.max_drafts,
        row.sampling,
        row.num_logprobs,
    )


@dataclasses.dataclass
class Prefiller:
    """Prefills for one table: runner (the engine's Runner), mesh, buckets (the loop's row
    counts), counters (the engine's), prefill_cache (rows kept for identical requests, at most),
    prefix (the prefix cache, spec_jax.prefix_cache, or None), config (the target's),
    max_context (tokens per slot)."""

    runner: object
    mesh: object
    buckets: tuple[int, ...]
    counters: collections.Counter
    prefill_cache: int
    prefix: object
    config: object
    max_context: int
    # prefill_key -> a kept row (a state of one row), least recently used first
    kept: collections.OrderedDict = dataclasses.field(default_factory=collections.OrderedDict)
    pending: list = dataclasses.field(default_factory=list)  # (key, block, row) kept at Table.keep_pending

    def bucket_for(self, n: int) -> int:
        """The smallest row bucket that holds n rows."""
        return next(b for b in self.buckets if b >= n)

    def width(self, ids, max_tokens: int) -> int:
        """The prompt width spec_jax.generate gives a request alone (its length bucket), within
        the slot."""
        features = self.runner.static.drafter.reads_features
        return min(layout(self.config, [ids], max_tokens, 0, features)[0], self.max_context)

    def row_width(self, row: Row) -> int:
        """width() of a waiting request's prompt."""
        return self.width(row.prompt_ids, row.handle.request.max_tokens)

    def prefill(self, group: list[Row], width: int, piece: bool = False) -> SpecState:
        """The group's requests prefilled in one call: a state of the smallest bucket of rows
        that holds them (row i: group[i]; the rest free), their max_drafts set per request. piece:
        a long prompt's piece (read_piece), counted apart from the requests' prefills."""
        k = len(group)
        batch = self.bucket_for(k)
        inputs = group_inputs(group, width, batch)
        inputs = sharding.put(inputs, sharding.state_shardings(inputs, self.mesh, batch))
        active = sharding.put(np.arange(batch) < k, sharding.batch_sharding(self.mesh, 1))
        block, compile_s, prefill_s = self.run(active, inputs, group, batch)
        self.counters["compile_seconds"] += compile_s
        self.counters["prefill_seconds"] += prefill_s
        self.counters["prefill_pieces" if piece else "prefill_calls"] += 1
        if not piece and self.prefix is not None:
            self.counters["prefix_cache_hit_tokens"] += sum(row.handle.cached_tokens for row in group)
        caps = [r.max_drafts for r in group] + [0] * (batch - k)
        return block.replace(max_drafts=jnp.asarray(caps, jnp.int32))

    def run(self, active, inputs: PrefillInputs, group: list[Row], batch: int):
        """runner.prefill's (state, compile seconds, prefill seconds) of the group's inputs; with the
        prefix cache, each request read from the end of its cached prefix (its handle's
        cached_tokens), and the blocks of its prompt kept afterwards."""
        if self.prefix is None:
            return self.runner.prefill(active, inputs)
        width = int(inputs.tokens.shape[1])
        hits = [self.prefix.lookup(row.prompt_ids) for row in group]
        for row, hit in zip(group, hits, strict=True):
            row.handle.cached_tokens = hit.tokens
        blocks = jnp.asarray(self.prefix.block_table(hits, batch, width))
        inputs = inputs.replace(prefix_blocks=sharding.put(blocks, sharding.batch_sharding(self.mesh, 2)))
        out = self.runner.prefill(active, inputs, self.prefix.pool)
        if group:
            self.prefix.insert([row.prompt_ids for row in group], out[0].target_cache, batch, width)
        return out

    def piece_due(self, ids, busy: bool) -> bool:
        """Whether prompt ids, waiting while rows decode (busy), has more than PREFILL_PIECE
        tokens past its cached prefix: it is read in pieces (read_piece) before its admission."""
        if not busy or self.prefix is None or len(ids) <= PREFILL_PIECE:  # no hashing: Engine._admit
            return False  # asks this of every waiting request each step
        return len(ids) - self.prefix.cached_tokens(ids) > PREFILL_PIECE

    def read_piece(self, ids: list[int], width: int) -> None:
        """A long prompt's next piece: the prompt ids up to PREFILL_PIECE tokens past its cached
        prefix, prefilled at `width` for the prefix cache alone (its blocks kept, its row dropped)."""
        ids = list(ids[: self.prefix.cached_tokens(ids) + PREFILL_PIECE])
        request = Request(prompt_ids=tuple(ids), max_tokens=1, stop_ids=())
        self.prefill([Row(Handle(-1, request, len(ids)), ids, (), 0.0)], width, piece=True)

    def score(self, row: Row, width: int) -> None:
        """The prompt's logprobs (its request's prompt_logprobs top ones) into the row and its
        handle: one scoring call at `width` (Runner.score), apart from its generation."""
        kept, compile_s, seconds = self.runner.score(
            row.prompt_ids, width, row.handle.request.prompt_logprobs
        )
        row.prompt_logprobs = row.handle.prompt_logprobs = kept
        self.counters["compile_seconds"] += compile_s
        self.counters["score_seconds"] += seconds
        self.counters["scored_prompts_total"] += 1

    def keep_generated(self, state: SpecState | None, row: Row | None, slot: int) -> None:
        """A leaving row's entries (its prompt's and generated tokens', but the last token's, not
        written) into the prefix cache where they are a prefill's bits (PrefixCache.keeps_generated),
        when they reach a block past its prompt's: the next chat turn, whose prompt holds this
        reply, reads them instead of computing them again. state: the table's; slot: the row's."""
        prefix = self.prefix
        if prefix is None or not prefix.keeps_generated or state is None or row is None:
            return
        ids = [*row.prompt_ids, *row.tokens][: len(row.prompt_ids) + len(row.tokens) - 1]
        if len(ids) // BLOCK > len(row.prompt_ids) // BLOCK:
            prefix.insert_row(ids, state.target_cache, slot)

    def keep(self, key: tuple, row: SpecState) -> None:
        """Keeps a prefilled row (a state of one row) for requests of prefill_key `key`, the least
        recently used dropped beyond prefill_cache."""
        self.kept[key] = row
        while len(self.kept) > self.prefill_cache:
            self.kept.popitem(last=False)
