"""The loop's state and its static settings (spec_jax.speculative runs them): SpecState, the
per-row state one round reads and writes (shapes in the field comments: B rows), and
SpecStatic, what one compiled loop is specialised to (a static argument of jax.jit).
"""

import dataclasses
from typing import Any

import flax.struct
import jax

from models.cache import KVCache
from models.config import ModelConfig
from spec_jax.decode import Output
from spec_jax.drafting.base import Drafter
from spec_jax.metrics import SpecMetrics
from spec_jax.sampling import RowSampling


@flax.struct.dataclass
class SpecState:
    target_cache: KVCache
    draft_state: Any
    out: Output
    prev_token: jax.Array  # int32 [B], committed token n-2 (in the target cache)
    last_token: jax.Array  # int32 [B], committed token n-1 (in no cache yet)
    length: jax.Array  # int32 [B], n: committed tokens, prompt included
    keys: jax.Array  # [B] PRNG keys, one chain per row
    metrics: SpecMetrics
    sampling: RowSampling  # each row's warp (temperature, top-k, top-p [B]), read every round
    # int32 [B] or None (every row: the loop's gamma): each row's most drafts a round, its
    # drafts past it unproposed (q zeroed, so the rule reads them as a shorter proposal and draws
    # from p there: exact); 0: the row decodes plainly inside a drafting loop, with the keys
    # plain decoding uses (the same tokens as gamma = 0). A tree's nodes deeper than it are
    # dropped. spec_jax.engine sets it per request (Request.speculate, Request.max_drafts).
    max_drafts: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class SpecStatic:
    """The static settings of one compiled loop (hashable: a static argument of jax.jit)."""

    config: ModelConfig
    drafter: Drafter
    gamma: int  # 0: plain autoregressive decoding (with NoDrafter)
    max_new_tokens: int
    cache_len: int
    # Target call widths for drafters that propose fewer than gamma drafts in some rounds (each
    # compiles a branch of the loop): "ends" 1 and gamma + 1; "all" every width 1..gamma + 1,
    # so that a round verifies only as many positions as its longest draft needs; "doubling" 1,
    # 2^k + 1 below gamma + 1 and gamma + 1 (a copying drafter's power-of-two draft counts,
    # spec_jax.drafting.lookup.draft_counts, in log2(gamma) + 2 branches).
    verify_widths: str = "ends"
    # 0: chain rounds. N > 0: tree rounds (spec_jax.tree), the drafter's propose_tree of N node
    # slots verified in one target call of N + 1 queries; gamma is then N (the cache and the
    # metrics are sized for paths of up to N tokens).
    tree_nodes: int = 0

    def widths(self) -> tuple[int, ...]:
        if self.verify_widths == "all":
            return tuple(range(1, self.gamma + 2))
        if self.verify_widths == "ends":
            return (1, self.gamma + 1)
        if self.verify_widths == "doubling":
            powers = {2**k + 1 for k in range(self.gamma.bit_length()) if 2**k < self.gamma}
            return tuple(sorted({1, self.gamma + 1} | powers))
        raise ValueError(f"verify_widths must be 'ends', 'all' or 'doubling', got {self.verify_widths!r}")
