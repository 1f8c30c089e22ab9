"""Flash-decoding in Pallas: few queries (decode T=1, verification T=gamma+1) against a long cache.

With T * H query rows there is too little work per batch row to fill a chip by tiling queries, so
the key sequence is split instead: `num_splits` chunks of `blocks_per_split * block_k` keys are a
parallel grid axis; each chunk produces a partial output normalised by its own softmax sum plus its
log-sum-exp, and the chunks are merged with a log-sum-exp reduction in plain jnp after the kernel
(common.combine_partials). The T queries and the G = H / KVH query heads that share a kv head are
folded into one [T * G, D] query tile, so each K/V block is read once per kv head, not once per
query head or per query. Every query row sees keys s < limit[row] (common.row_limits); key blocks
at or past the largest limit of a batch row are skipped, whole chunks included. With a sliding
window each row also sees only keys s >= start[row] (common.row_starts): the blocks a batch row
needs are then first .. end - 1 (common.first_key_block), shared out over the chunks at run time
(cdiv(end - first, num_splits) blocks each), so a small window over a long cache reads about
window / block_k blocks, spread over the parallel chunks. With a token tree (`tree`, T <= 32) each
row also carries its tree's first slot and its query's ancestor bits, repeated over the G folded
rows like the limits (common.tree_rows, common.visible_keys); the skipping then reads the rows'
key_span, which reaches the tree keys the rows see.

TPU (Mosaic): grid (B, num_splits, blocks_per_split), the last axis "arbitrary". The number of
needed key blocks per batch row (with a window: also the first of them and the blocks per chunk)
is scalar-prefetched; the K/V index_map clamps to the last needed
block (no DMA for skipped blocks) and `pl.when` skips the body. All kv heads are handled per grid
step from the [B, S * KVH, D] view of the cache (stride-KVH sublane loads per head, see
common.tpu_attend_block); m / l / acc are VMEM scratch.

GPU (Triton): grid (B, KVH, num_splits); each program loops (`lax.fori_loop`, data-dependent trip
count) over the key blocks of its chunk that are below the row's largest limit.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from models.kernels import common
from models.kernels import target as target_lib

# GPU split heuristic: aim for this many programs (B * KVH * num_splits), ~2 per SM of an H100.
_GPU_TARGET_PROGRAMS = 264
# Largest default GPU key block; smaller where rows x block_k x D would not fit shared memory.
_GPU_MAX_BLOCK_K = 128
# float32 dots run at HIGHEST precision on the FMA units (no tensor cores), unrolled per thread:
# the default tile rows x block_k x D stays within this many elements. Beyond it ptxas takes tens
# of seconds (28 s for 128 x 128 x 64 on sm_80, 3 s at this size) and the tile spills registers.
_GPU_MAX_F32_TILE = 2**18


@dataclasses.dataclass(frozen=True)
class DecodeBlockSizes:
    """Tiling of the flash-decoding kernel; None fields are picked per backend and target by `resolve`.

    block_k: keys per tile. TPU: a multiple of 128. GPU: a power of two >= 16.
    num_splits: key-sequence chunks processed in parallel (upper bound: never more than the number
      of key blocks). TPU default: 2 when B == 1 (both TensorCores of a megacore chip get work),
      else 1. GPU default: enough to give ~264 programs.
    """

    block_k: int | None = None
    num_splits: int | None = None

    def __post_init__(self):
        for name in ("block_k", "num_splits"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")

    def resolve(
        self,
        backend: str,
        batch: int,
        num_kv_heads: int,
        num_keys: int,
        head_dim: int,
        dtype,
        rows: int,
        target: target_lib.Target,
    ):
        """Returns (block_k, num_splits, blocks_per_split), checked; ValueError naming the numbers.

        rows: the folded query rows per kv head (T * H / KVH, padded). The default block_k is the
        largest whose working set fits the target: TPU VMEM (common.tpu_vmem_budget), GPU shared
        memory per block (common.gpu_shared_memory_bytes of rows x block_k x D).
        """
        common.check_backend(backend)
        block_k = self.block_k
        if backend == "tpu":
            if block_k is None:
                # Up to 512 keys and 4096 interleaved K rows per block, less while VMEM is short.
                block_k = max(128, min(512, 4096 // num_kv_heads // 128 * 128))
                budget = common.tpu_vmem_budget(target)
                while block_k > 128 and tpu_vmem_bytes(num_kv_heads, rows, head_dim, block_k, dtype) > budget:
                    block_k -= 128
            if block_k % 128:
                raise ValueError(f"TPU block_k={block_k} must be a multiple of 128 (lane width)")
            # A block may not be larger than the array; one block equal to the whole cache is legal.
            block_k = min(block_k, num_keys)
        else:
            what = f"GPU flash_decoding(block_k={block_k})"
            if block_k is None:
                itemsize = jnp.dtype(dtype).itemsize
                have = target.gpu_shared_memory_per_block
                cap = _GPU_MAX_BLOCK_K
                while (
                    jnp.dtype(dtype) == jnp.float32 and cap > 16 and rows * cap * head_dim > _GPU_MAX_F32_TILE
                ):
                    cap //= 2
                block_k = common.largest_gpu_block(
                    cap, lambda bk: common.gpu_shared_memory_bytes(rows, bk, head_dim, itemsize) <= have
                )
                what = "GPU flash_decoding at the smallest block_k=16"
                block_k = block_k or 16  # does not fit: the check below says so
            if block_k < 16 or not common.is_power_of_2(block_k):
                raise ValueError(f"GPU block_k={block_k} must be a power of two >= 16 (Triton tiles)")
            common.check_gpu_shared_memory(rows, block_k, head_dim, dtype, what, target)
        num_blocks = common.cdiv(num_keys, block_k)
        num_splits = self.num_splits
        if num_splits is None:
            if backend == "tpu":
                num_splits = 2 if batch == 1 else 1
            else:
                num_splits = common.cdiv(_GPU_TARGET_PROGRAMS, batch * num_kv_heads)
        blocks_per_split = common.cdiv(num_blocks, min(num_splits, num_blocks))
        # Recount so that no chunk starts past the cache.
        return block_k, common.cdiv(num_blocks, blocks_per_split), blocks_per_split


def folded_rows(backend: str, num_queries: int, group: int, dtype) -> int:
    """Rows of the folded [T * G, D] query tile: padded to the TPU sublanes, or a GPU power of two >= 16."""
    if backend == "tpu":
        return common.round_up(num_queries * group, common.tpu_sublanes(dtype))
    return max(16, common.next_power_of_2(num_queries * group))


def fits(q_shape, kv_shape, dtype, backend: str, target: target_lib.Target) -> bool:
    """Whether the default tiling of flash_decoding fits `target` for these shapes (GPU: the folded
    query tile and the smallest key block within one block's shared memory). The dispatcher sends
    small-T calls that do not fit to flash_attention, which tiles the queries."""
    if backend != "gpu":
        return True
    _, t, h, d = q_shape
    rows = folded_rows(backend, t, h // kv_shape[2], dtype)
    need = common.gpu_shared_memory_bytes(rows, 16, d, jnp.dtype(dtype).itemsize)
    return need <= target.gpu_shared_memory_per_block


def tpu_vmem_bytes(kvh: int, rows: int, d: int, block_k: int, dtype) -> int:
    """VMEM working set of the TPU kernel: double-buffered inputs and outputs plus scratch."""
    itemsize = jnp.dtype(dtype).itemsize
    upcast = jnp.dtype(dtype) == jnp.bfloat16 and kvh > 1
    vmem = 2 * (kvh * rows * d * itemsize + rows * 128 * 4 + 2 * block_k * kvh * d * itemsize)
    vmem += 2 * kvh * rows * (d + common.TPU_LANES) * 4  # outputs
    vmem += kvh * rows * (2 * common.TPU_LANES + d) * 4 + (2 * block_k * kvh * d * 4 if upcast else 0)
    return vmem


@functools.partial(jax.jit, static_argnames=("backend", "block_sizes", "interpret", "target"))
def _flash_decoding(
    q, k, v, q_positions, kv_lengths, window, tree, *, backend, block_sizes, interpret, target
):
    target = common.checked_target(backend, q, k, v, q_positions, kv_lengths, target, interpret)
    b, t, h, d = q.shape
    s, kvh = k.shape[1], k.shape[2]
    g = h // kvh
    rows = folded_rows(backend, t, g, q.dtype)
    tiling = (block_sizes or DecodeBlockSizes()).resolve(backend, b, kvh, s, d, q.dtype, rows, target)
    limit = common.row_limits(q_positions, kv_lengths, s)  # [B, T]
    # Fold: [B, T, H, D] -> [B, KVH, R, D] with row t * G + g; padded rows have limit 0.
    q_rows = q.reshape(b, t, kvh, g, d).transpose(0, 2, 1, 3, 4).reshape(b, kvh, t * g, d)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, rows - t * g), (0, 0)))

    def fold(x):  # [B, T] -> [B, R]: each query's integer on its G rows; padded rows get 0
        return jnp.pad(jnp.repeat(x, g, axis=1), ((0, 0), (0, rows - t * g)))

    limit_rows = fold(limit)  # padded rows see nothing
    start_rows = None if window is None else fold(common.row_starts(q_positions, window))
    tree_rows = None if tree is None else tuple(map(fold, common.tree_rows(kv_lengths, tree, s)))
    row_args = (limit_rows, start_rows, tree_rows, t)
    if backend == "tpu":
        interpret = common.tpu_interpret(interpret)
        o_parts, lse = _tpu_partials(q_rows, k, v, *row_args, *tiling, interpret, target)
    else:
        o_parts, lse = _gpu_partials(q_rows, k, v, *row_args, *tiling, interpret)
    out = common.combine_partials(o_parts, lse)  # [B, KVH, R, D] f32
    out = out[:, :, : t * g].reshape(b, kvh, t, g, d).transpose(0, 2, 1, 3, 4).reshape(b, t, h, d)
    return out.astype(q.dtype)


# Split-K attention for small T: common.AttentionKernel's call, with block_sizes a
# DecodeBlockSizes (None: DecodeBlockSizes(), all defaults). Any T works, but the folded
# [T * H / KVH, D] query tile is meant to be small (the dispatcher sends T <= 16 here).
flash_decoding = common.AttentionKernel(_flash_decoding)


# ---------------------------------------------------------------------------------------------- TPU


def _tpu_kernel(*refs, windowed: bool, tree: bool, num_keys: int, scale: float, mxu_dtype):
    """refs, in order (the bracketed ones with a window / a tree only): nblocks_ref SMEM [B] int32,
    the end of the key blocks holding a visible key, per batch row; [first_ref SMEM [B] int32, the
    first of them; per_split_ref SMEM [B] int32, how many of them each chunk takes]; q_ref
    [KVH, R, D]; limit_ref [R, 1] int32; [start_ref [R, 1] int32]; [tree_first_ref, bits_ref
    [R, 1] int32]; k_ref, v_ref [block_k * KVH, D]; o_ref [KVH, R, D] f32, this chunk's normalised
    output; lse_ref [KVH, R, 128] f32, its log-sum-exp (lane-replicated); scratch m_ref, l_ref
    [KVH, R, 128] f32, acc_ref [KVH, R, D] f32, and [block_k * KVH, D] f32 x2 for bfloat16 with
    KVH > 1 only."""
    refs = list(refs)
    nblocks_ref = refs.pop(0)
    first_ref, per_split_ref = (refs.pop(0), refs.pop(0)) if windowed else (None, None)
    q_ref, limit_ref = refs.pop(0), refs.pop(0)
    start_ref = refs.pop(0) if windowed else None
    tree_refs = (refs.pop(0), refs.pop(0)) if tree else None
    k_ref, v_ref, o_ref, lse_ref, m_ref, l_ref, acc_ref, *f32_kv_refs = refs
    b, split, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    block_k = k_ref.shape[0] // q_ref.shape[0]
    if first_ref is None:
        block = split * pl.num_programs(2) + j
    else:
        block = first_ref[b] + split * per_split_ref[b] + j

    @pl.when(j == 0)
    def _init():
        common.init_tpu_state(m_ref, l_ref, acc_ref)

    needed = block < nblocks_ref[b]
    if per_split_ref is not None:
        needed = needed & (j < per_split_ref[b])

    @pl.when(needed)
    def _attend():
        common.tpu_attend_refs(
            q_ref, k_ref, v_ref, limit_ref, start_ref, tree_refs, block * block_k, m_ref, l_ref, acc_ref,
            f32_kv_refs, num_keys=num_keys, scale=scale, mxu_dtype=mxu_dtype,
        )  # fmt: skip

    @pl.when(j == pl.num_programs(2) - 1)
    def _finalize():
        row_sum = l_ref[...]
        o_ref[...] = common.normalize(acc_ref[...], row_sum[:, :, :1])
        lse_ref[...] = common.log_sum_exp(m_ref[...], row_sum)


def _tpu_prefetch(limit_rows, start_rows, tree_rows, num_queries, num_keys, block_k, num_splits):
    """(prefetch, row_inputs) of the flash-decoding TPU kernel: the scalar-prefetched int32 [B]
    arrays (nblocks, the end of the key blocks holding a visible key; with a window also first,
    the first of them, and per_split, how many each chunk takes: never more than
    blocks_per_split) and the rows' [B, R] inputs (limit, [start], [tree first, bits])."""
    span_start, span_limit = common.key_span(limit_rows, start_rows, tree_rows, num_queries, num_keys)
    nblocks = (jnp.max(span_limit, axis=1) + block_k - 1) // block_k  # [B]
    prefetch, row_inputs = [nblocks], [limit_rows]
    if start_rows is not None:
        first = common.first_key_block(span_limit, span_start, block_k, axis=1)  # [B]
        per_split = (jnp.maximum(nblocks - first, 0) + num_splits - 1) // num_splits  # [B]
        prefetch += [first, per_split]
        row_inputs.append(start_rows)
    return prefetch, row_inputs + list(tree_rows or [])


def _tpu_partials(
    q_rows, k, v, limit_rows, start_rows, tree_rows, num_queries, block_k, num_splits, blocks_per_split,
    interpret, target,
):  # fmt: skip
    """Returns o_parts [B, KVH, C, R, D] f32 and lse [B, KVH, C, R] f32 (C = num_splits)."""
    b, kvh, rows, d = q_rows.shape
    s = k.shape[1]
    prefetch, row_inputs = _tpu_prefetch(
        limit_rows, start_rows, tree_rows, num_queries, s, block_k, num_splits
    )
    k_rows = k.reshape(b, s * kvh, d)  # free: heads interleaved per key
    v_rows = v.reshape(b, s * kvh, d)

    def kv_index(bi, split, j, nblocks_ref, *window_refs):
        # Past the last needed block, keep pointing at it: same block index -> no new DMA.
        last = jnp.maximum(nblocks_ref[bi] - 1, 0)
        if not window_refs:
            return bi, jnp.minimum(split * blocks_per_split + j, last), 0
        first_ref, per_split_ref = window_refs
        per = per_split_ref[bi]
        block = first_ref[bi] + split * per + jnp.minimum(j, jnp.maximum(per - 1, 0))
        return bi, jnp.minimum(block, last), 0

    kernel, scratch, params = common.tpu_flash_setup(
        _tpu_kernel, q_rows.dtype, kvh, rows, d, block_k, tpu_vmem_bytes(kvh, rows, d, block_k, q_rows.dtype),
        f"flash_decoding(block_k={block_k}, KVH={kvh}, rows={rows})", target,
        windowed=start_rows is not None, tree=tree_rows is not None, num_keys=s,
    )  # fmt: skip
    row_spec = pl.BlockSpec((None, rows, 1), lambda bi, c, j, *_: (bi, 0, 0))
    o_parts, lse = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=(b, num_splits, blocks_per_split),
            in_specs=[
                pl.BlockSpec((None, kvh, rows, d), lambda bi, c, j, *_: (bi, 0, 0, 0)),
                *[row_spec] * len(row_inputs),
                pl.BlockSpec((None, block_k * kvh, d), kv_index),
                pl.BlockSpec((None, block_k * kvh, d), kv_index),
            ],
            out_specs=[
                pl.BlockSpec((None, None, kvh, rows, d), lambda bi, c, j, *_: (bi, c, 0, 0, 0)),
                pl.BlockSpec(
                    (None, None, kvh, rows, common.TPU_LANES), lambda bi, c, j, *_: (bi, c, 0, 0, 0)
                ),
            ],
            scratch_shapes=scratch,
        ),
        out_shape=[
            jax.ShapeDtypeStruct((b, num_splits, kvh, rows, d), jnp.float32),
            jax.ShapeDtypeStruct((b, num_splits, kvh, rows, common.TPU_LANES), jnp.float32),
        ],
        compiler_params=params,
        interpret=interpret,
        name="flash_decoding_tpu",
    )(*prefetch, q_rows, *(x[:, :, None] for x in row_inputs), k_rows, v_rows)
    return o_parts.transpose(0, 2, 1, 3, 4), lse[..., 0].transpose(0, 2, 1, 3)


# ---------------------------------------------------------------------------------------------- GPU


def _gpu_kernel(
    *refs, windowed: bool, tree: bool, num_queries: int, block_k: int, blocks_per_split: int, scale: float
):
    # refs: q_ref [R, D]; k_ref, v_ref [S, D] of this (batch row, kv head); limit_ref [R]; with a
    # window start_ref [R]; with a tree tree_first_ref, bits_ref [R]; o_ref [R, D] f32 and lse_ref
    # [R] f32 of this chunk.
    q_ref, k_ref, v_ref, limit_ref, *refs = refs
    start_ref = refs.pop(0) if windowed else None
    tree_refs = (refs.pop(0), refs.pop(0)) if tree else None
    o_ref, lse_ref = refs
    limit = limit_ref[...]
    row_start = None if start_ref is None else start_ref[...]
    row_tree = None if tree_refs is None else tuple(x[...] for x in tree_refs)
    span_start, span_limit = common.key_span(limit, row_start, row_tree, num_queries, k_ref.shape[0])
    if start_ref is None:
        first_key = pl.program_id(2) * (blocks_per_split * block_k)
        # Blocks of this chunk below the largest limit; 0 for chunks past the row's length.
        todo = lax.div(jnp.max(span_limit) - first_key + (block_k - 1), block_k)
        num_blocks = jnp.clip(todo, 0, blocks_per_split)
    else:
        # The blocks some row's window reaches, first .. end - 1, shared out over the chunks.
        first = common.first_key_block(span_limit, span_start, block_k, axis=0)
        end = lax.div(jnp.max(span_limit) + (block_k - 1), block_k)
        num_splits = pl.num_programs(2)
        per_split = lax.div(jnp.maximum(end - first, 0) + (num_splits - 1), num_splits)
        chunk_first = first + pl.program_id(2) * per_split
        num_blocks = jnp.clip(end - chunk_first, 0, per_split)
        first_key = chunk_first * block_k
    acc, m, row_sum = common.gpu_attend_blocks(
        q_ref[...], k_ref, v_ref, limit, row_start, row_tree, first_key, num_blocks,
        block_k=block_k, scale=scale,
    )  # fmt: skip
    o_ref[...] = common.normalize(acc, row_sum[:, None])
    lse_ref[...] = common.log_sum_exp(m, row_sum)


def _gpu_partials(
    q_rows, k, v, limit_rows, start_rows, tree_rows, num_queries, block_k, num_splits, blocks_per_split,
    interpret,
):  # fmt: skip
    """Returns o_parts [B, KVH, C, R, D] f32 and lse [B, KVH, C, R] f32 (C = num_splits)."""
    b, kvh, rows, d = q_rows.shape
    s = k.shape[1]
    row_inputs = [x for x in (limit_rows, start_rows, *(tree_rows or ())) if x is not None]
    row_spec = pl.BlockSpec((None, rows), lambda bi, hi, c: (bi, 0))
    return pl.pallas_call(
        functools.partial(
            _gpu_kernel,
            windowed=start_rows is not None,
            tree=tree_rows is not None,
            num_queries=num_queries,
            block_k=block_k,
            blocks_per_split=blocks_per_split,
            scale=d**-0.5,
        ),
        grid=(b, kvh, num_splits),
        in_specs=[
            pl.BlockSpec((None, None, rows, d), lambda bi, hi, c: (bi, hi, 0, 0)),
            pl.BlockSpec((None, s, None, d), lambda bi, hi, c: (bi, 0, hi, 0)),
            pl.BlockSpec((None, s, None, d), lambda bi, hi, c: (bi, 0, hi, 0)),
            *[row_spec] * len(row_inputs),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, d), lambda bi, hi, c: (bi, hi, c, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda bi, hi, c: (bi, hi, c, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, kvh, num_splits, rows, d), jnp.float32),
            jax.ShapeDtypeStruct((b, kvh, num_splits, rows), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="flash_decoding_gpu",
    )(q_rows, k, v, *row_inputs)
