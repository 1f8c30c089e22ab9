"""What every decoding loop shares: padded prompts, prefill, the first token, the per-row commit.

Every loop keeps, per row, `length` = committed tokens (prompt + generated). The last
committed token is not yet in any cache; everything before it is. A model call feeds tokens
from there at their absolute positions, so each row advances by its own count and whatever
a rejected draft wrote past a row's length is overwritten before it can be read. The loop
itself (autoregressive decoding is the speculative loop with a drafter that proposes
nothing) is in spec_jax.speculative.
"""

from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models.kernels import target as kernel_target
from models.settings import is_int
from models.transformer import (
    ForwardOutput,
    attention_impl,
    forward,
    init_cache,
    on_cpu,
)
from spec_jax.logprobs import Kept, empty_kept, kept_logprobs
from spec_jax.row_prefill import PREFILL_CHUNK, prefill_rows, read_prefix
from spec_jax.sampling import RowSampling, draw_rows, split_rows, warp

MIN_BUCKET = 16
# The smallest bucket on the CPU kernels' path (layout): prompts up to it share their programs.
COARSE_WIDTH = 256
PAD_ID = 0


def bucket_length(n: int, minimum: int = MIN_BUCKET) -> int:
    """The power-of-two bucket (>= minimum) that a prompt of n tokens is padded to."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


def pad_prompts(prompts: list[list[int]], width: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-pads prompts into int32 [B, width]; returns (tokens, lengths [B])."""
    tokens = np.full((len(prompts), width), PAD_ID, np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    return tokens, np.array([len(p) for p in prompts], np.int32)


def layout(config, prompts, max_new_tokens: int, gamma: int, reads_features: bool = False) -> tuple[int, int]:
    """(prompt width, cache length): prompts are right-padded to their length bucket (capped so
    the cache fits the model's context), and the cache holds the width, the new tokens and
    the gamma drafts a last round may write past them (gamma = 0 for plain decoding).

    Where the model runs on the CPU kernels (coarse_layout) the bucket has a floor of
    COARSE_WIDTH, so that prompts of every length up to it share one prefill and one loop
    program (a new length compiles nothing): the row-wise prefill stops at each row's own
    length and the CPU attention reads only each row's live slots, so the padding costs no
    work. reads_features (a drafter that reads the target's features over the whole padded
    prompt, whose work grows with the width) keeps the prompt width tight there; the cache
    length stays coarse, so the loop programs are still shared."""
    longest = max(len(p) for p in prompts)
    cap = max(longest, config.max_seq_len - max_new_tokens)
    width = min(bucket_length(longest), cap)
    if not coarse_layout(config):
        return width, width + max_new_tokens + gamma
    coarse = min(bucket_length(longest, COARSE_WIDTH), cap)
    return (width if reads_features else coarse), coarse + max_new_tokens + gamma


def coarse_layout(config) -> bool:
    """Whether layout pads to COARSE_WIDTH: where calls run on the CPU kernels, as prefill and
    models.transformer.attention_impl decide (its "cpu" attention, in a program lowered for a
    CPU: the device traced for, models.kernels.target.current)."""
    if attention_impl(config) != "cpu":
        return False
    return config.attention_impl == "cpu" or kernel_target.current().platform == "cpu"


def stop_id_list(eos_id, vocab: int) -> list[int]:
    """eos_id (None, one token id, or a sequence of them) as a list; ValueError naming eos_id
    unless every id is an integer in [0, vocab)."""
    ids = [] if eos_id is None else [eos_id] if not isinstance(eos_id, Sequence) else list(eos_id)
    for i in ids:
        if not is_int(i) or not 0 <= i < vocab:
            raise ValueError(f"eos_id must be None or integer token ids in [0, {vocab}), got {eos_id!r}")
    return ids


def prefill(
    config: ModelConfig, params, tokens_bp, prompt_lens_b, cache_len: int, with_features=False, prefix=None
) -> ForwardOutput:
    """Runs the padded prompts [B, P] through the model into a fresh cache of cache_len slots.

    prefix: None, or (pool, blocks): each row's leading positions already computed, in blocks of
    PREFILL_CHUNK positions (spec_jax.prefix_cache: pool, a KVCache [L, N, PREFILL_CHUNK, K, E];
    blocks, int32 [B, P // PREFILL_CHUNK], row b's j-th block's pool slot, -1 past its hit). They
    are copied into the cache and the row-wise path reads each row from the first position after
    them: the same bits as reading it whole. One call over the batch (off the CPU kernels)
    computes every position again.

    Returns a ForwardOutput (models.transformer.forward): the logits at each row's last prompt
    token [B, V], the cache, and with_features the features at every prompt position [B, P, D].

    Where the model runs on the CPU kernels (models.transformer.attention_impl "cpu": one CPU
    device, in a program lowered for a CPU), the prompts are read row by row in chunks of
    PREFILL_CHUNK positions (prefill_rows): a product of that many rows runs near the kernel's
    compute rate (on the Zen 5, a model call costs 8.99 ms a position over 16 positions, 8.14
    over 32 and 8.13 over 48; eight held-out prompts read in 0.93x the time with 32 as with 16),
    so one call over the whole padded batch only adds the padding's work (every row padded to
    the longest prompt's bucket). A call over every row's next chunk (prefill_rows' batched,
    the same bits for each row) is not taken either: on the 2-core Xeon, 2-8 rows read in
    0.87-0.99x the time where each read three full chunks, 1.09-1.22x where each read 24 tokens
    past its cached prefix (a chat turn's: its padding to a chunk is then computed; the Qwen
    1.5B at gguf_q8, docs/benchmarks.md, "Batched prefill of rows past a cached prefix").
    Elsewhere (TPU, GPU, a mesh) one call over the batch.
    """
    batch, width = tokens_bp.shape
    cache = init_cache(config, batch, cache_len)
    start_b = jnp.zeros((batch,), jnp.int32)
    if prefix is not None:
        pool, blocks_bj = prefix
        cache = read_prefix(cache, pool, blocks_bj)
        start_b = jnp.sum(jnp.cumprod(blocks_bj >= 0, axis=1), axis=1).astype(jnp.int32) * PREFILL_CHUNK

    def one_call(tokens_bp, prompt_lens_b, cache):
        positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
        out = forward(
            config,
            params,
            tokens_bp,
            positions,
            cache,
            logits_at=(prompt_lens_b - 1)[:, None],
            with_features=with_features,
        )
        return out.replace(logits=out.logits[:, 0])

    if attention_impl(config) != "cpu":
        return one_call(tokens_bp, prompt_lens_b, cache)

    def by_rows(tokens_bp, prompt_lens_b, cache):
        return prefill_rows(
            config, params, tokens_bp, prompt_lens_b, cache, PREFILL_CHUNK, with_features, start_b
        )

    return on_cpu(config, by_rows, one_call, tokens_bp, prompt_lens_b, cache)


@flax.struct.dataclass
class Output:
    """Generated tokens so far. tokens: [B, N + slack] (PAD_ID past each row's count)."""

    tokens: jax.Array  # int32 [B, N + slack]
    num_generated: jax.Array  # int32 [B]
    done: jax.Array  # bool [B]
    # bool [B]: the row stopped because the target's logits it drew from were NaN or infinite
    # (commit's nonfinite_b); its tokens are those committed before.
    nonfinite: jax.Array
    budget: jax.Array  # int32 [B]: the most tokens the row may generate (<= N)
    # The target's raw log-probabilities of each token at the same positions as tokens
    # (spec_jax.logprobs: written where some row asks, zeros elsewhere), and each row's ask.
    logprobs: jax.Array  # float32 [B, N + slack]: the kept token's
    top_ids: jax.Array  # int32 [B, N + slack, MAX_LOGPROBS]: the most probable tokens there
    top_logprobs: jax.Array  # float32 [B, N + slack, MAX_LOGPROBS]
    num_logprobs: jax.Array  # int32 [B]: -1 none; 0 the kept token's; k: and the top k


def new_output(batch: int, max_new_tokens: int, slack: int, budget_b=None, num_logprobs_b=None) -> Output:
    """An empty Output of [batch, max_new_tokens + slack] tokens; budget_b (int32 [B], default
    max_new_tokens for every row): the most tokens each row may generate; num_logprobs_b (int32
    [B], default -1: none): the logprobs each row asks for (Output.num_logprobs)."""
    budget = jnp.full((batch,), max_new_tokens, jnp.int32) if budget_b is None else budget_b
    asks = jnp.full((batch,), -1, jnp.int32) if num_logprobs_b is None else num_logprobs_b
    kept = empty_kept(batch, max_new_tokens + slack)
    return Output(
        tokens=jnp.full((batch, max_new_tokens + slack), PAD_ID, jnp.int32),
        num_generated=jnp.zeros((batch,), jnp.int32),
        done=jnp.zeros((batch,), jnp.bool_),
        nonfinite=jnp.zeros((batch,), jnp.bool_),
        budget=jnp.asarray(budget, jnp.int32),
        logprobs=kept.logprobs,
        top_ids=kept.top_ids,
        top_logprobs=kept.top_logprobs,
        num_logprobs=jnp.asarray(asks, jnp.int32),
    )


def commit(
    out: Output, new_bc, counts_b, max_new_tokens: int, stop_ids_z, nonfinite_b=None, kept: Kept | None = None
) -> tuple[Output, jax.Array]:
    """Appends the first counts[b] of the new tokens [B, C] to each row that is not done, and
    their log-probabilities kept (spec_jax.logprobs.Kept of [B, C], optional) at the same
    positions.

    A row stops at max_new_tokens (an int, or int32 [B]: each row's own) and after the first of
    its new tokens that is in stop_ids [Z] or [B, Z] (each row's own set; entries < 0 are
    padding; an empty or all-negative set disables stopping). Where
    nonfinite_b [B] (bool, optional) is set, the row's next token after its counts[b] would
    come from non-finite target logits: unless it stops first for the reasons above, it stops
    there, flagged in Output.nonfinite. Returns (output, committed [B]): how many tokens each
    row really committed.
    """
    c = new_bc.shape[1]
    idx = jnp.arange(c)[None, :]
    counts = jnp.where(out.done, 0, jnp.minimum(counts_b, max_new_tokens - out.num_generated))
    stops = stop_ids_z if stop_ids_z.ndim == 1 else stop_ids_z[:, None, :]  # [Z] or [B, 1, Z]
    is_stop = jnp.any((new_bc[..., None] == stops) & (stops >= 0), axis=-1)  # [B, C]
    is_stop = is_stop & (idx < counts[:, None])
    first_stop = jnp.argmax(is_stop, axis=1)
    hit_stop = jnp.any(is_stop, axis=1)
    counts = jnp.where(hit_stop, first_stop + 1, counts)
    b_idx = jnp.arange(new_bc.shape[0])[:, None]
    dest = jnp.where(idx < counts[:, None], out.num_generated[:, None] + idx, out.tokens.shape[1])
    tokens = out.tokens.at[b_idx, dest].set(new_bc, mode="drop")
    if kept is not None:
        out = out.replace(
            logprobs=out.logprobs.at[b_idx, dest].set(kept.logprobs, mode="drop"),
            top_ids=out.top_ids.at[b_idx, dest].set(kept.top_ids, mode="drop"),
            top_logprobs=out.top_logprobs.at[b_idx, dest].set(kept.top_logprobs, mode="drop"),
        )
    num_generated = out.num_generated + counts
    done = out.done | hit_stop | (num_generated >= max_new_tokens)
    bad = jnp.zeros_like(done) if nonfinite_b is None else nonfinite_b & ~done
    output = out.replace(
        tokens=tokens, num_generated=num_generated, done=done | bad, nonfinite=out.nonfinite | bad
    )
    return output, counts


@flax.struct.dataclass
class PrefillInputs:
    tokens: jax.Array  # int32 [B, P]
    prompt_lens: jax.Array  # int32 [B]
    stop_ids: jax.Array  # int32 [E] or [B, E]: a row stops after generating any of these (-1: padding)
    keys: jax.Array  # [B] PRNG keys, one per row
    budgets: jax.Array | None = None  # int32 [B]: each row's most new tokens (None: max_new_tokens)
    # int32 [B, P // PREFILL_CHUNK]: each row's cached prefix, pool slots (-1 past it; None: none):
    # prefill's prefix blocks, with the prefix cache's pool (spec_jax.prefix_cache)
    prefix_blocks: jax.Array | None = None
    sampling: RowSampling | None = None  # each row's warp (None: greedy, every row)
    num_logprobs: jax.Array | None = None  # int32 [B]: Output.num_logprobs (None: -1, no row asks)

    def row_sampling(self) -> RowSampling:
        """Each row's warp: sampling, or greedy for every row where it is None."""
        batch = self.tokens.shape[0]
        return RowSampling.greedy_rows(batch) if self.sampling is None else self.sampling.for_rows(batch)


def first_token(logits_bv, inputs: PrefillInputs, sampling: RowSampling, max_new_tokens: int):
    """Draws the first new token from the prefill logits; returns (Output, token [B], keys [B]).
    A row whose logits are not all finite commits nothing and is done (Output.nonfinite). The
    token's logprobs (rows that ask: inputs.num_logprobs) are those of the same logits."""
    keys, draw_keys = split_rows(inputs.keys, 2)
    token = draw_rows(draw_keys, warp(logits_bv, sampling))
    nonfinite = ~jnp.all(jnp.isfinite(logits_bv), axis=-1)
    empty = new_output(token.shape[0], max_new_tokens, 0, inputs.budgets, inputs.num_logprobs)
    out, _ = commit(
        empty,
        token[:, None],
        jnp.where(nonfinite, 0, 1),
        empty.budget,
        inputs.stop_ids,
        nonfinite,
        kept_logprobs(lambda: logits_bv[:, None], token[:, None], empty.num_logprobs),
    )
    return out, token, keys
