"""Prefill flash attention in Pallas: causal, grouped-query, ragged, with key-block skipping.

Tiling: queries are cut into blocks of `block_q` rows, keys into blocks of `block_k`. For each
(batch row, query block) the number of key blocks that can hold a visible key is
`cdiv(max(limit over the block's rows), block_k)` (see common.row_limits): key blocks wholly beyond
the row's length or above the causal diagonal of every query in the block are never loaded. With a
sliding window the visit starts at the block of the smallest window start of the block's rows
(common.row_starts, common.first_key_block): blocks wholly before every query's window are never
loaded either, so a long context with a small window costs about window / block_k key blocks per
query block, not S / block_k. With a token tree (`tree`, T <= 32, e.g. a 16-node tree and its root)
each query row also carries its tree's first slot and ancestor bits (common.tree_rows,
common.visible_keys), and the skipping reads the rows' common.key_span, which reaches the tree
keys they see.

TPU (Mosaic): grid (B, query blocks, key blocks), key axis last and "arbitrary". The per-block key
block counts are scalar-prefetched into SMEM; the K/V index_map clamps to the last needed block
(an unchanged block index issues no DMA) and the body is skipped with `pl.when`; with a window
the first needed block is prefetched too and key step ki visits block first + ki. One grid step
handles all heads: the [B, S, KVH, D] cache is viewed (free reshape) as [B, S * KVH, D] and each kv
head's keys are a stride-KVH sublane load, so the cache is never transposed. Queries are regrouped
in the wrapper to [B, nq, KVH, G * block_q, D] so that the G query heads sharing a kv head form one
MXU tile. m / l / acc live in VMEM scratch, initialised and finalised with `pl.when`.

GPU (Triton): grid (query blocks, B, H); each program keeps its [block_q, D] query tile in
registers and runs `lax.fori_loop` over key blocks with the data-dependent range above.
Loads past S are masked, so the cache is neither padded nor transposed.

S need not be a multiple of block_k (the ragged last block is masked); T is padded to a multiple
of block_q in the wrapper (padded query rows see no key and are sliced off).
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


@dataclasses.dataclass(frozen=True)
class FlashBlockSizes:
    """Tile sizes of the prefill kernel.

    block_q: query rows per tile (per query head; on TPU the G heads of a kv head are stacked, so
      the MXU tile has G * block_q rows). block_k: keys per tile.
    TPU: block_q a multiple of 8 (float32) / 16 (bfloat16), block_k a multiple of 128.
    GPU: both powers of two >= 16.
    """

    block_q: int
    block_k: int

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @classmethod
    def default(
        cls,
        backend: str,
        head_dim: int,
        dtype,
        target: target_lib.Target | None = None,
        group: int = 1,
        num_kv_heads: int = 1,
    ) -> "FlashBlockSizes":
        """The default tiles for `target` (None: the smallest modern part, see target.py).

        TPU: 128 x 128, block_q halved while the VMEM working set (G * block_q rows per kv head)
        exceeds the target's budget. GPU: block_q = 64 (32 for D * itemsize > 256) and block_k the
        largest power of two <= 64 with block_k * D * itemsize <= 16 KiB, both halved while the
        tiles exceed the target's shared memory per block (common.gpu_shared_memory_bytes).
        """
        common.check_backend(backend)
        target = target or target_lib.Target(backend if backend == "tpu" else "gpu")
        itemsize = jnp.dtype(dtype).itemsize
        if backend == "tpu":
            block_q, sublanes = 128, common.tpu_sublanes(dtype)
            budget = common.tpu_vmem_budget(target)
            while block_q > sublanes and (
                tpu_vmem_bytes(num_kv_heads, group * block_q, head_dim, 128, dtype) > budget
            ):
                block_q //= 2
            return cls(block_q=max(block_q, sublanes), block_k=128)
        # Triton keeps the q tile, the K and V tiles and the score tile in shared memory.
        block_k = max(16, min(64, 2 ** ((16384 // (head_dim * itemsize)).bit_length() - 1)))
        block_q = 64 if head_dim * itemsize <= 256 else 32
        have = target.gpu_shared_memory_per_block
        while (
            common.gpu_shared_memory_bytes(block_q, block_k, head_dim, itemsize) > have
            and max(block_q, block_k) > 16
        ):
            if block_k >= block_q:
                block_k //= 2
            else:
                block_q //= 2
        return cls(block_q=block_q, block_k=block_k)

    def check(self, backend: str, dtype) -> None:
        """Raises ValueError naming the numbers when the blocks do not tile for `backend`."""
        common.check_backend(backend)
        if backend == "tpu":
            sublanes = common.tpu_sublanes(dtype)
            if self.block_q % sublanes:
                raise ValueError(
                    f"TPU block_q={self.block_q} must be a multiple of {sublanes} for {jnp.dtype(dtype).name}"
                )
            if self.block_k % 128:
                raise ValueError(f"TPU block_k={self.block_k} must be a multiple of 128 (lane width)")
        else:
            for name in ("block_q", "block_k"):
                value = getattr(self, name)
                if value < 16 or not common.is_power_of_2(value):
                    raise ValueError(f"GPU {name}={value} must be a power of two >= 16 (Triton tiles)")


@functools.partial(jax.jit, static_argnames=("backend", "block_sizes", "interpret", "target"))
def _flash_attention(
    q, k, v, q_positions, kv_lengths, window, tree, *, backend, block_sizes, interpret, target
):
    target = common.checked_target(backend, q, k, v, q_positions, kv_lengths, target, interpret)
    group, kvh = q.shape[2] // k.shape[2], k.shape[2]
    if block_sizes is None:
        block_sizes = FlashBlockSizes.default(backend, q.shape[-1], q.dtype, target, group, kvh)
    block_sizes.check(backend, q.dtype)
    limit = common.row_limits(q_positions, kv_lengths, k.shape[1])  # [B, T]
    start = None if window is None else common.row_starts(q_positions, window)  # [B, T]
    tree_rows = None if tree is None else common.tree_rows(kv_lengths, tree, k.shape[1])  # [B, T] x2
    if backend == "tpu":
        interpret = common.tpu_interpret(interpret)
        return _tpu_flash_attention(q, k, v, limit, start, tree_rows, block_sizes, interpret, target)
    return _gpu_flash_attention(q, k, v, limit, start, tree_rows, block_sizes, interpret, target)


# Blocked causal attention for prefill (any T): common.AttentionKernel's call, with block_sizes a
# FlashBlockSizes (None: FlashBlockSizes.default(backend, D, dtype, target, G, KVH)).
flash_attention = common.AttentionKernel(_flash_attention)


# ---------------------------------------------------------------------------------------------- TPU


def _tpu_kernel(*refs, windowed: bool, tree: bool, num_keys: int, scale: float, mxu_dtype):
    """refs, in order (the bracketed ones with a window / a tree only):
    nblocks_ref SMEM [B * nq] int32, the end of the key blocks each (batch row, query block) needs;
    [first_ref SMEM [B * nq] int32, the first of them]; q_ref [KVH, R, D] (R = G * block_q);
    limit_ref [R, 1] int32; [start_ref [R, 1] int32]; [tree_first_ref, bits_ref [R, 1] int32];
    k_ref, v_ref [block_k * KVH, D]; o_ref [KVH, R, D]; scratch m_ref, l_ref [KVH, R, 128] f32,
    acc_ref [KVH, R, D] f32, and [block_k * KVH, D] f32 x2 for bfloat16 with KVH > 1 only."""
    refs = list(refs)
    nblocks_ref = refs.pop(0)
    first_ref = refs.pop(0) if windowed else None
    q_ref, limit_ref = refs.pop(0), refs.pop(0)
    start_ref = refs.pop(0) if windowed else None
    tree_refs = (refs.pop(0), refs.pop(0)) if tree else None
    k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, *f32_kv_refs = refs
    b, qi, ki = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    block_k = k_ref.shape[0] // q_ref.shape[0]
    block = ki if first_ref is None else first_ref[b * pl.num_programs(1) + qi] + ki

    @pl.when(ki == 0)
    def _init():
        common.init_tpu_state(m_ref, l_ref, acc_ref)

    @pl.when(block < nblocks_ref[b * pl.num_programs(1) + qi])
    def _attend():
        common.tpu_attend_refs(
            q_ref, k_ref, v_ref, limit_ref, start_ref, tree_refs, block * block_k, m_ref, l_ref, acc_ref,
            f32_kv_refs, num_keys=num_keys, scale=scale, mxu_dtype=mxu_dtype,
        )  # fmt: skip

    @pl.when(ki == pl.num_programs(2) - 1)
    def _finalize():
        o_ref[...] = common.normalize(acc_ref[...], l_ref[:, :, :1]).astype(o_ref.dtype)


def tpu_vmem_bytes(kvh: int, rows: int, d: int, block_k: int, dtype) -> int:
    """VMEM working set of the TPU kernel (rows = G * block_q): double-buffered blocks plus scratch."""
    itemsize = jnp.dtype(dtype).itemsize
    upcast = jnp.dtype(dtype) == jnp.bfloat16 and kvh > 1
    vmem = 2 * (2 * kvh * rows * d * itemsize + rows * 128 * 4 + 2 * block_k * kvh * d * itemsize)
    vmem += kvh * rows * (2 * common.TPU_LANES + d) * 4 + (2 * block_k * kvh * d * 4 if upcast else 0)
    return vmem


def _tpu_tiles(q, limit, start, tree, block_q: int, g: int):
    """The flash TPU kernel's query tiles, nq = ceil(T / block_q), R = G * block_q rows each.
    Returns (q_tiles [B, nq, KVH, R, D] (row g * block_q + i is query i of head (kv, g)), the rows'
    (limit, start or None, tree or None) padded to [B, nq, 1, block_q] (padded rows get 0: limit
    0, they see nothing), tile_rows: [B, nq, 1, block_q] -> [B, nq, R, 1])."""
    b, t, h, d = q.shape
    nq = common.cdiv(t, block_q)
    t_pad, kvh, rows = nq * block_q, h // g, g * block_q
    q_tiles = jnp.pad(q, ((0, 0), (0, t_pad - t), (0, 0), (0, 0)))
    q_tiles = (
        q_tiles.reshape(b, nq, block_q, kvh, g, d).transpose(0, 1, 3, 4, 2, 5).reshape(b, nq, kvh, rows, d)
    )

    def pad(x):
        return jnp.pad(x, ((0, 0), (0, t_pad - t))).reshape(b, nq, 1, block_q)

    def tile_rows(x):
        return jnp.broadcast_to(x, (b, nq, g, block_q)).reshape(b, nq, rows, 1)

    padded = (
        pad(limit),
        None if start is None else pad(start),
        None if tree is None else tuple(map(pad, tree)),
    )
    return q_tiles, padded, tile_rows


def _tpu_flash_attention(q, k, v, limit, start, tree, block_sizes: FlashBlockSizes, interpret, target):
    b, t, h, d = q.shape
    s, kvh = k.shape[1], k.shape[2]
    g = h // kvh
    block_q = min(block_sizes.block_q, common.round_up(t, common.tpu_sublanes(q.dtype)))
    # A block may not be larger than the array; a block equal to the full (short) sequence is legal.
    block_k = block_sizes.block_k if s > block_sizes.block_k else s
    nq, nk = common.cdiv(t, block_q), common.cdiv(s, block_k)
    rows = g * block_q
    t_pad = nq * block_q
    q_tiles, (limit_pad, start_pad, tree_pad), tile_rows = _tpu_tiles(q, limit, start, tree, block_q, g)
    span_start, span_limit = common.key_span(limit_pad, start_pad, tree_pad, t, s)
    nblocks = ((jnp.max(span_limit, axis=(2, 3)) + block_k - 1) // block_k).reshape(b * nq)  # [B * nq]
    prefetch = [nblocks]
    if start is not None:
        prefetch.append(common.first_key_block(span_limit, span_start, block_k, axis=(2, 3)).reshape(b * nq))
    row_inputs = [tile_rows(x) for x in (limit_pad, start_pad, *(tree_pad or ())) if x is not None]
    k_rows = k.reshape(b, s * kvh, d)  # free: heads interleaved per key
    v_rows = v.reshape(b, s * kvh, d)

    def kv_index(bi, qi, ki, nblocks_ref, *first_ref):
        # Past the last needed block, keep pointing at it: same block index -> no new DMA.
        last = jnp.maximum(nblocks_ref[bi * nq + qi] - 1, 0)
        block = ki + first_ref[0][bi * nq + qi] if first_ref else ki
        return bi, jnp.minimum(block, last), 0

    kernel, scratch, params = common.tpu_flash_setup(
        _tpu_kernel, q.dtype, kvh, rows, d, block_k, tpu_vmem_bytes(kvh, rows, d, block_k, q.dtype),
        f"flash_attention(block_q={block_q}, block_k={block_k}, H={h}, KVH={kvh}, D={d})", target,
        windowed=start is not None, tree=tree is not None, num_keys=s,
    )  # fmt: skip
    row_spec = pl.BlockSpec((None, None, rows, 1), lambda bi, qi, ki, *_: (bi, qi, 0, 0))
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=(b, nq, nk),
            in_specs=[
                pl.BlockSpec((None, None, kvh, rows, d), lambda bi, qi, ki, *_: (bi, qi, 0, 0, 0)),
                *[row_spec] * len(row_inputs),
                pl.BlockSpec((None, block_k * kvh, d), kv_index),
                pl.BlockSpec((None, block_k * kvh, d), kv_index),
            ],
            out_specs=pl.BlockSpec((None, None, kvh, rows, d), lambda bi, qi, ki, *_: (bi, qi, 0, 0, 0)),
            scratch_shapes=scratch,
        ),
        out_shape=jax.ShapeDtypeStruct((b, nq, kvh, rows, d), q.dtype),
        compiler_params=params,
        interpret=interpret,
        name="flash_attention_tpu",
    )(*prefetch, q_tiles, *row_inputs, k_rows, v_rows)
    out = out.reshape(b, nq, kvh, g, block_q, d).transpose(0, 1, 4, 2, 3, 5).reshape(b, t_pad, h, d)
    return out[:, :t]


# ---------------------------------------------------------------------------------------------- GPU


def _gpu_kernel(*refs, windowed: bool, tree: bool, num_queries: int, block_k: int, scale: float):
    # refs: q_ref [block_q, D]; k_ref, v_ref [S, D] of this (batch row, kv head); limit_ref [block_q];
    # with a window start_ref [block_q]; with a tree tree_first_ref, bits_ref [block_q]; o_ref
    # [block_q, D].
    q_ref, k_ref, v_ref, limit_ref, *refs = refs
    start_ref = refs.pop(0) if windowed else None
    tree_refs = (refs.pop(0), refs.pop(0)) if tree else None
    (o_ref,) = refs
    limit = limit_ref[...]
    row_start = None if start_ref is None else start_ref[...]
    row_tree = None if tree_refs is None else tuple(x[...] for x in tree_refs)
    span_start, span_limit = common.key_span(limit, row_start, row_tree, num_queries, k_ref.shape[0])
    # Key blocks past every row's limit (ragged length or causal diagonal) are never visited.
    num_blocks = lax.div(jnp.max(span_limit) + (block_k - 1), block_k)
    if start_ref is None:
        first_key = 0
    else:  # nor those before every row's window
        first = common.first_key_block(span_limit, span_start, block_k, axis=0)
        num_blocks, first_key = jnp.maximum(num_blocks - first, 0), first * block_k
    acc, _, row_sum = common.gpu_attend_blocks(
        q_ref[...], k_ref, v_ref, limit, row_start, row_tree, first_key, num_blocks,
        block_k=block_k, scale=scale,
    )  # fmt: skip
    o_ref[...] = common.normalize(acc, row_sum[:, None]).astype(o_ref.dtype)


def _gpu_flash_attention(q, k, v, limit, start, tree, block_sizes: FlashBlockSizes, interpret, target):
    b, t, h, d = q.shape
    s, kvh = k.shape[1], k.shape[2]
    g = h // kvh
    block_q = min(block_sizes.block_q, max(16, common.next_power_of_2(t)))
    common.check_gpu_shared_memory(
        block_q, block_sizes.block_k, d, q.dtype, f"GPU flash_attention(block_q={block_q})", target
    )
    nq = common.cdiv(t, block_q)
    t_pad = nq * block_q
    q_pad = jnp.pad(q, ((0, 0), (0, t_pad - t), (0, 0), (0, 0)))
    # padded rows: limit 0 (and start 0), so they see nothing
    rows = (limit, start, *(tree or ()))
    row_inputs = [jnp.pad(x, ((0, 0), (0, t_pad - t))) for x in rows if x is not None]
    row_spec = pl.BlockSpec((None, block_q), lambda qi, bi, hi: (bi, qi))
    out = pl.pallas_call(
        functools.partial(
            _gpu_kernel,
            windowed=start is not None,
            tree=tree is not None,
            num_queries=t,
            block_k=block_sizes.block_k,
            scale=d**-0.5,
        ),
        grid=(nq, b, h),
        in_specs=[
            pl.BlockSpec((None, block_q, None, d), lambda qi, bi, hi: (bi, qi, hi, 0)),
            pl.BlockSpec((None, s, None, d), lambda qi, bi, hi: (bi, 0, hi // g, 0)),
            pl.BlockSpec((None, s, None, d), lambda qi, bi, hi: (bi, 0, hi // g, 0)),
            *[row_spec] * len(row_inputs),
        ],
        out_specs=pl.BlockSpec((None, block_q, None, d), lambda qi, bi, hi: (bi, qi, hi, 0)),
        out_shape=jax.ShapeDtypeStruct((b, t_pad, h, d), q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4 if d <= 64 else 8, num_stages=2),
        interpret=interpret,
        name="flash_attention_gpu",
    )(q_pad, k, v, *row_inputs)
    return out[:, :t]
