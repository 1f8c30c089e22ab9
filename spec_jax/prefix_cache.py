"""Prompt prefixes computed once: the target's keys and values of prompt prefixes, kept in blocks of
BLOCK tokens and found by their tokens, as vLLM's automatic prefix caching does.

- A block is the keys and values of BLOCK consecutive prompt positions, [L, BLOCK, K, E] each,
  in one slot of a pool allocated once on the device ([L, N, BLOCK, K, E]: N slots, from the
  server's budget in MB). Its key is a hash chain: sha256 of the previous block's key and the
  block's own token ids, so a key names every token before the block's end, and two prompts
  share a block exactly where they share all of its tokens and everything before it.
- A request's hit (lookup) is its longest run of leading blocks in the pool, short of its last
  token (whose logits the prefill must compute). The prefill copies them into the row's cache
  (decode.prefill's `prefix`) and reads the prompt from there on.
- The blocks wholly inside a prefilled prompt are written into free slots (insert), the least
  recently used evicted first; and, where a decode step's entries are a prefill's bits
  (decode_entries_exact), those of a finished row's prompt and generated tokens (insert_row):
  a chat's next turn, whose prompt holds the reply, reads them. A lookup touches its blocks from the last to the first, so a
  block is always more recent than its descendants and eviction takes leaves first.

Exactness: on the CPU kernels the prefill reads each row in chunks whose positions' keys and
values are the same bits whatever the chunk (tests/test_prefill.py), so a row prefilled from a
hit has the bits of a full prefill (tests/test_prefix_cache.py). Generated tokens' entries are
kept only where a decode step's products are the prefill's bit for bit (decode_entries_exact: not
where prefill_rows' bulk_products takes ggml's 4-row gemm); checked on the Qwen 1.5B at gguf_q8.
"""

import collections
import dataclasses
import hashlib

import jax
import jax.numpy as jnp
import numpy as np

from models import precision
from models.cache import KVCache
from models.kernels import gguf_matmul
from models.settings import is_number
from spec_jax.decode import coarse_layout
from spec_jax.row_prefill import PREFILL_CHUNK

BLOCK = PREFILL_CHUNK  # tokens per block: a prefill chunk, so that a hit ends on a chunk's edge


def block_keys(ids) -> list[bytes]:
    """The hash chain of ids' full blocks: key j names ids[: BLOCK * (j + 1)]."""
    keys, parent = [], b""
    ids = np.asarray(ids, np.int64)
    for j in range(len(ids) // BLOCK):
        parent = hashlib.sha256(parent + ids[j * BLOCK : (j + 1) * BLOCK].tobytes()).digest()
        keys.append(parent)
    return keys


def block_bytes(config) -> int:
    """Bytes of one block (keys and values of every layer) of a model of this config."""
    itemsize = np.dtype(config.jnp_dtype).itemsize
    return 2 * config.num_layers * BLOCK * config.num_kv_heads * config.head_dim * itemsize


@dataclasses.dataclass
class Hit:
    """A request's cached prefix: its first `tokens` (a multiple of BLOCK) are in the pool's
    slots `slots`, in order."""

    tokens: int
    slots: list[int]


class PrefixCache:
    """The pool of blocks and its index (the module docstring). max_mb: the pool's size in MB of
    the device's memory (at least one block); counters: the tokens inserted."""

    def __init__(self, config, max_mb: float):
        self.num_slots = int(max_mb * 2**20 // block_bytes(config))
        if self.num_slots < 1:
            raise ValueError(
                f"prefix_cache_mb must hold at least one block of {BLOCK} tokens "
                f"({block_bytes(config) / 2**20:.2f} MB for this model), got {max_mb}"
            )
        shape = (config.num_layers, self.num_slots, BLOCK, config.num_kv_heads, config.head_dim)
        self.pool = KVCache(k=jnp.zeros(shape, config.jnp_dtype), v=jnp.zeros(shape, config.jnp_dtype))
        self.index: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # key -> slot, LRU first
        self.free = list(range(self.num_slots - 1, -1, -1))
        self.counters = collections.Counter()
        # whether finished rows' generated tokens are kept too (insert_row; decode_entries_exact)
        self.keeps_generated = False

    def lookup(self, ids) -> Hit:
        """The longest run of ids' leading blocks in the pool, short of its last token."""
        usable = (len(ids) - 1) // BLOCK  # the block holding the last token is always prefilled
        keys = []
        for key in block_keys(ids[: usable * BLOCK]):
            if key not in self.index:
                break
            keys.append(key)
        for key in reversed(keys):  # descendants older than their ancestors: leaves go first
            self.index.move_to_end(key)
        return Hit(len(keys) * BLOCK, [self.index[key] for key in keys])

    def cached_tokens(self, ids) -> int:
        """What lookup(ids) would find, in tokens, without touching or counting anything."""
        usable = (len(ids) - 1) // BLOCK
        found = 0
        for key in block_keys(ids[: usable * BLOCK]):
            if key not in self.index:
                break
            found += BLOCK
        return found

    def block_table(self, hits: list[Hit], batch: int, width: int) -> np.ndarray:
        """int32 [batch, width // BLOCK]: each row's hit slots, -1 past its hit (and for rows past
        the hits'): the prefill's `prefix` blocks."""
        table = np.full((batch, width // BLOCK), -1, np.int32)
        for r, hit in enumerate(hits):
            table[r, : len(hit.slots)] = hit.slots
        return table

    def insert(self, prompts: list, cache: KVCache, batch: int, width: int) -> None:
        """Keeps the blocks wholly inside each prompt (row r of cache [L, B, S, K, E], a prefill's)
        that the pool does not hold, evicting the least recently used."""
        sources = np.full((batch, width // BLOCK), -1, np.int32)  # pool slot of (row, block) to write
        written = {}  # slot -> (row, block) of this call: a slot taken again is written once
        for r, ids in enumerate(prompts):
            for j, key in enumerate(block_keys(ids)):
                if key in self.index:
                    continue
                slot = self.free.pop() if self.free else self.index.popitem(last=False)[1]
                if slot in written:
                    sources[written[slot]] = -1
                self.index[key], sources[r, j], written[slot] = slot, slot, (r, j)
                self.counters["prefix_cache_inserted_tokens"] += BLOCK
        if (sources >= 0).any():
            self.pool = write_blocks_jit(self.pool, cache, jnp.asarray(sources))

    def insert_row(self, ids, cache: KVCache, row) -> None:
        """insert of row `row` (an int, may be traced) of cache [L, B, S, K, E], whose entries
        hold ids at positions 0 .. len(ids) - 1 (a finished row: its prompt and generated tokens
        but the last, whose entry is not written)."""
        one = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, jnp.asarray(row), 1, axis=1), cache)
        self.insert([list(ids)], one, 1, one.k.shape[2] // BLOCK * BLOCK)

    @property
    def used_tokens(self) -> int:
        return len(self.index) * BLOCK


def write_blocks(pool: KVCache, cache: KVCache, sources_bj) -> KVCache:
    """pool with slot sources[b, j] (>= 0) set to row b's positions [BLOCK j, BLOCK (j + 1)) of
    cache [L, B, S, K, E]; -1: nothing written."""
    b, j = sources_bj.shape

    def one(pool_x, cache_x):
        blocks = cache_x[:, :b, : j * BLOCK].reshape(cache_x.shape[0], b * j, BLOCK, *cache_x.shape[3:])
        slots = jnp.where(sources_bj >= 0, sources_bj, pool_x.shape[1]).reshape(-1)  # past the pool: dropped
        return pool_x.at[:, slots].set(blocks, mode="drop")

    return KVCache(k=one(pool.k, cache.k), v=one(pool.v, cache.v))


write_blocks_jit = jax.jit(write_blocks, donate_argnums=0)


def engine_prefix_cache(config, mesh, drafter, max_mb: float) -> PrefixCache | None:
    """An engine's prefix cache of max_mb MB (0: none), where a prefill reads rows from a cached
    prefix with a full prefill's bits: the row-wise prefill of the CPU kernels (coarse_layout),
    on one device, for a drafter that reads no target features over the prompt (None elsewhere).
    ValueError naming prefix_cache_mb where it is not a number >= 0."""
    if not is_number(max_mb) or max_mb < 0:
        raise ValueError(f"prefix_cache_mb must be a number >= 0 (0: no prefix cache), got {max_mb!r}")
    if not max_mb or not coarse_layout(config) or mesh.size != 1 or drafter.reads_features:
        return None
    cache = PrefixCache(config, max_mb)
    cache.keeps_generated = decode_entries_exact(config)
    return cache


def decode_entries_exact(config) -> bool:
    """Whether a decode step's (and so a verify call's) cache entries are a prefill's bits for
    the same tokens, on the row-wise CPU kernels: their attention and norms take each position
    alone, and the products differ only through ModelConfig.bulk_products (gguf_q8's Q4_K through
    ggml's 4-row gemm in a prefill, where the CPU lacks the multi-row kernels)."""
    if config.dtype not in precision.GGUF_PRECISIONS:
        return True
    return gguf_matmul.available() and gguf_matmul.multirow()
