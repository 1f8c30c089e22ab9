"""Pieces shared by the Pallas attention kernels (flash_attention.py and flash_decoding.py).

Both kernels reduce the masking contract of `attention` to one integer per query row:
`limit[b, t] = clip(min(q_positions[b, t] + 1, kv_lengths[b]), 0, S)`; query row t of batch row b
sees exactly the keys s < limit[b, t]. Padded query rows get limit 0 and so see nothing. With a
sliding window a second integer per row, `start[b, t] = max(0, q_positions[b, t] + 1 - window)`
(row_starts), bounds the keys from below: the row sees start <= s < limit. Key blocks wholly
before the smallest start of a tile are skipped like those past its largest limit
(first_key_block).

With a tree (tree_rows) two more integers per row: the tree's first slot `first = kv_lengths[b] - T`
and the query's ancestor bits. The row sees the keys s < first by the rule above and key first + j
where bit j is set (visible_keys); padded rows get bits 0. Block skipping reads key_span, the
rows' [start, limit) widened to the tree keys they see (the tree's keys lie past a shallow node's
own position + 1, and before a deep node's window start).

Online softmax state per query row: running max `m` (initialised to the finite DEFAULT_MASK_VALUE,
not -inf, so that `m_prev - m_next` is never inf - inf), running sum `l` and unnormalised output
`acc`. Probabilities of invisible keys are zeroed explicitly (not just pushed towards exp(-big)),
so a row that sees no key keeps l == 0 and its output is defined as zeros.
"""

import dataclasses
import functools
from collections.abc import Callable

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from models.kernels import target as target_lib
from models.kernels.reference import DEFAULT_MASK_VALUE, MAX_TREE_QUERIES, check_tree, check_window

BACKENDS = ("tpu", "gpu")
# Head dims the kernels are written for: powers of two (Triton tiles) that fill at least half of
# the 128 TPU lanes.
SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
# Lane width of the lane-replicated [rows, 128] running max / sum scratch on TPU.
TPU_LANES = 128
# Share of a TPU core's VMEM that a kernel's working set (blocks double-buffered + scratch) may
# take; the rest is Mosaic's internal scratch. 12 MiB on v2-v4, 48 MiB on v5p, 96 MiB on v5e/v6e.
TPU_VMEM_BUDGET_FRACTION = 0.75
# Slack on top of gpu_shared_memory_bytes: the largest shortfall measured was 512 bytes.
_GPU_SHARED_MEMORY_SLACK = 1024


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def is_power_of_2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def tpu_sublanes(dtype) -> int:
    """Rows per TPU vreg tile: 8 for 32-bit, 16 for packed bfloat16."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def check_inputs(q, k, v, q_positions, kv_lengths) -> None:
    """Raises ValueError (at trace time: only static shapes and dtypes are read) on contract violations."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"expected q [B, T, H, D] and k, v [B, S, KVH, D], got q{q.shape} k{k.shape} v{v.shape}"
        )
    b, t, h, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: k{k.shape} v{v.shape}")
    kb, s, kvh, kd = k.shape
    if kb != b or kd != d:
        raise ValueError(f"batch / head dim mismatch: q{q.shape} k{k.shape}")
    if h % kvh:
        raise ValueError(f"num query heads {h} is not a multiple of kv heads {kvh}")
    if q_positions.shape != (b, t):
        raise ValueError(f"q_positions must be [B, T] = {(b, t)}, got {q_positions.shape}")
    if kv_lengths.shape != (b,):
        raise ValueError(f"kv_lengths must be [B] = {(b,)}, got {kv_lengths.shape}")
    if not (jnp.issubdtype(q_positions.dtype, jnp.integer) and jnp.issubdtype(kv_lengths.dtype, jnp.integer)):
        raise ValueError(
            f"q_positions and kv_lengths must be integers, got {q_positions.dtype} and {kv_lengths.dtype}"
        )
    if min(b, t, s) < 1:
        raise ValueError(f"empty input: B={b}, T={t}, S={s}")


def check_kernel_inputs(q, k, v) -> None:
    """The extra restrictions of the Pallas kernels (the XLA reference takes any float dtype / head dim)."""
    d = q.shape[-1]
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"head dim {d} is not supported by the Pallas kernels; supported: {SUPPORTED_HEAD_DIMS}"
        )
    dtypes = {jnp.dtype(x.dtype) for x in (q, k, v)}
    if len(dtypes) != 1 or next(iter(dtypes)) not in SUPPORTED_DTYPES:
        raise ValueError(
            f"q, k, v must share one dtype out of float32 / bfloat16, got {q.dtype}, {k.dtype}, {v.dtype}"
        )


def row_limits(q_positions, kv_lengths, num_keys: int):
    """[B, T] int32: query (b, t) sees keys s < limit[b, t]."""
    limit = jnp.minimum(q_positions.astype(jnp.int32) + 1, kv_lengths.astype(jnp.int32)[:, None])
    return jnp.clip(limit, 0, num_keys)


def row_starts(q_positions, window):
    """[B, T] int32: with a window, query (b, t) sees no key s < start[b, t] = max(0, p + 1 - window).

    Computed without int32 overflow for any window (a global layer's int32 max, or a traced value
    <= 0, which leaves start >= p + 1, so the row sees nothing)."""
    reach = jnp.maximum(q_positions.astype(jnp.int32) + 1, 0)  # p + 1, and 0 for negative positions
    return reach - jnp.clip(jnp.asarray(window, jnp.int32), 0, reach)


def first_key_block(limit, row_start, block_k: int, axis):
    """int32 over `axis` of the rows [..., R]: the first key block holding a key some row sees
    (row_start <= s < limit). Rows that see nothing (row_start >= limit: padding, or a window <= 0)
    do not pull it down; where no row sees a key it is past every needed block."""
    seen = jnp.where(row_start < limit, row_start, jnp.iinfo(jnp.int32).max)
    return lax.div(jnp.min(seen, axis=axis), jnp.int32(block_k))  # operands >= 0: lax.div floors


def tree_rows(kv_lengths, tree, num_keys: int):
    """(first [B, T], bits [B, T]) int32 of a tree call (reference.attention_mask): per query, the
    tree's first slot kv_lengths[b] - T, and its ancestor bits with those of slots outside the
    cache (< 0 or >= S) cleared, so that each set bit j is a key first + j the query sees."""
    b, t = tree.shape
    first = kv_lengths.astype(jnp.int32) - t  # [B]
    slots = first[:, None] + jnp.arange(t, dtype=jnp.int32)  # [B, T]
    weights = jnp.left_shift(jnp.int32(1), jnp.arange(t, dtype=jnp.int32))
    in_cache = jnp.sum(((slots >= 0) & (slots < num_keys)) * weights, axis=1, dtype=jnp.int32)  # [B]
    return jnp.broadcast_to(first[:, None], (b, t)), tree.astype(jnp.int32) & in_cache[:, None]


def visible_keys(key_pos, limit, row_start, tree):
    """bool, broadcast of key_pos [..., K] and the rows' [..., R, 1] integers: which keys each row
    sees. limit, row_start: row_limits, row_starts (None without a window); tree: None, or the
    rows' (first, bits) of tree_rows, and then the keys from first on are seen by their bits."""
    visible = key_pos < limit
    if row_start is not None:
        visible = visible & (key_pos >= row_start)
    if tree is None:
        return visible
    first, bits = tree
    j = key_pos - first  # the key's node index in the tree, where 0 <= j < T
    bit = jnp.right_shift(bits, jnp.clip(j, 0, MAX_TREE_QUERIES - 1)) & 1
    return (visible & (j < 0)) | ((j >= 0) & (j < MAX_TREE_QUERIES) & (bit == 1))


def key_span(limit, row_start, tree, num_queries: int, num_keys: int):
    """(start, limit) per row such that every key the row sees lies in start <= s < limit: what
    key-block skipping reads (the largest limit, first_key_block). Without a tree, the rows' own;
    with one (tree_rows' (first, bits), num_queries = T) widened to the tree keys of rows with a
    bit set. start is None without a window (the keys are then read from 0)."""
    if tree is None:
        return row_start, limit
    first, bits = tree
    has = bits != 0
    limit = jnp.maximum(limit, jnp.where(has, jnp.clip(first + num_queries, 0, num_keys), 0))
    if row_start is None:
        return None, limit
    none = jnp.iinfo(jnp.int32).max
    seen = jnp.where(row_start < limit, row_start, none)
    return jnp.minimum(seen, jnp.where(has, jnp.maximum(first, 0), none)), limit


def tpu_vmem_budget(target: target_lib.Target) -> int:
    """Bytes of VMEM a TPU kernel's working set may take on `target`."""
    return int(TPU_VMEM_BUDGET_FRACTION * target.tpu_vmem_bytes)


def tpu_compiler_params(dimension_semantics, vmem_bytes: int, what: str, target: target_lib.Target):
    """Mosaic compiler params with a VMEM limit sized to the kernel; ValueError if it cannot fit."""
    budget = tpu_vmem_budget(target)
    if vmem_bytes > budget:
        raise ValueError(
            f"{what} needs about {vmem_bytes / 2**20:.1f} MiB of VMEM, more than the "
            f"{budget / 2**20:.0f} MiB budget on {target.describe('tpu')} "
            f"({target.tpu_vmem_bytes / 2**20:.0f} MiB per core); use smaller blocks"
        )
    capacity = target.tpu_vmem_bytes
    limit = int(min(max(2 * vmem_bytes, 32 * 2**20), capacity))
    return pltpu.CompilerParams(dimension_semantics=dimension_semantics, vmem_limit_bytes=limit)


def gpu_shared_memory_bytes(rows: int, block_k: int, head_dim: int, itemsize: int) -> int:
    """Upper bound on the shared memory XLA's Triton gives one program of `gpu_attend_blocks`.

    Triton stages the [block_k, D] K and V tiles, the [rows, block_k] float32 score tile and the
    [rows, D] query tile through shared memory (operand layouts of the two dots). Measured with
    XLA's own "requested N bytes" on sm_80, sm_86 and sm_90 for rows and block_k in 16..128,
    D in {64, 128}, float32 and bfloat16 (tests/test_compile_targets.py checks a few of them): exact
    for float32 up to 512 bytes, an over-estimate for bfloat16.
    """
    tiles = block_k * (2 * head_dim * itemsize + 4 * rows) + rows * head_dim * itemsize
    return tiles + _GPU_SHARED_MEMORY_SLACK


def check_gpu_shared_memory(rows: int, block_k: int, head_dim: int, dtype, what: str, target) -> None:
    """ValueError naming the numbers when one program's tiles would not fit a block's shared memory."""
    need = gpu_shared_memory_bytes(rows, block_k, head_dim, jnp.dtype(dtype).itemsize)
    have = target.gpu_shared_memory_per_block
    if need > have:
        raise ValueError(
            f"{what} needs about {need / 1024:.1f} KiB of shared memory per block "
            f"({rows} query rows x block_k={block_k}, D={head_dim}, {jnp.dtype(dtype).name}), more than "
            f"the {have / 1024:.0f} KiB of {target.describe('gpu')}; use a smaller block_k"
        )


@dataclasses.dataclass(frozen=True)
class AttentionKernel:
    """A Pallas attention kernel behind one call, the same for flash_attention.flash_attention and
    flash_decoding.flash_decoding, so that the dispatcher (models.kernels.attention) calls either
    alike; the contract is models.kernels.attention's.

    kernel(q, k, v, q_positions, kv_lengths, *, window=None, tree=None, backend, block_sizes=None,
    interpret=False, target=None) -> [B, T, H, D] in q's dtype:
      q: [B, T, H, D]; k, v: [B, S, KVH, D], same dtype (float32 or bfloat16), D in SUPPORTED_HEAD_DIMS.
      q_positions: [B, T] int; kv_lengths: [B] int.
      window: None or an int32 scalar, Python or traced (reference.check_window): query p sees only
        keys s with p - s < window; key blocks before every window of a tile are skipped.
      tree: None or int32 [B, T] ancestor bits (reference.check_tree): the queries are a token
        tree's nodes, whose keys are the last T slots (models.kernels' contract).
      backend: "tpu" (Mosaic) or "gpu" (Triton).
      block_sizes: the kernel's tiling (its module's FlashBlockSizes / DecodeBlockSizes); None:
        the kernel's default for the call.
      interpret: Pallas interpret mode (CPU). For backend="tpu", True means pltpu.InterpretParams().
      target: the device to tile for (target.Target); None: the device in effect while tracing
        (models.kernels.target.current()).

    run: the kernel, jitted with backend, block_sizes, interpret and target static: run(q, k, v,
    q_positions, kv_lengths, window, tree, *, backend, block_sizes, interpret, target).
    """

    run: Callable

    def __call__(
        self,
        q,
        k,
        v,
        q_positions,
        kv_lengths,
        *,
        window=None,
        tree=None,
        backend: str,
        block_sizes=None,
        interpret=False,
        target: target_lib.Target | None = None,
    ):
        check_window(window)  # here, before jit: a Python int is still a number
        check_tree(tree, q.shape)
        return self.run(
            q, k, v, q_positions, kv_lengths, window, tree,
            backend=backend, block_sizes=block_sizes, interpret=interpret, target=target,
        )  # fmt: skip


def largest_gpu_block(cap: int, fits) -> int | None:
    """Largest power of two in [16, cap] for which fits(block) holds; None if even 16 does not."""
    block = cap
    while block >= 16:
        if fits(block):
            return block
        block //= 2
    return None


def resolve_target(target: target_lib.Target | None) -> target_lib.Target:
    """The Target a kernel tiles for: the given one, else the device in effect while tracing."""
    return target if target is not None else target_lib.current()


def check_target(backend: str, target: target_lib.Target, interpret) -> None:
    """ValueError when the kernels of `backend` cannot compile for the accelerator being traced for.

    In interpret mode (and when lowering on a CPU host without a target device) nothing is checked.
    """
    if interpret is not False or target.platform == "cpu":
        return
    if target.platform != backend:
        raise ValueError(
            f"the pallas_{backend} kernels cannot compile for {target.describe()}, a {target.platform} "
            f"device; use impl='auto', 'xla' or 'pallas_{target.platform}'"
        )
    if backend == "gpu" and not target.triton_supported:
        major, minor = target.compute_capability
        need = ".".join(map(str, target_lib.TRITON_MIN_COMPUTE_CAPABILITY))
        raise ValueError(
            f"impl='pallas_gpu' needs compute capability >= {need} (XLA compiles Triton kernels only "
            f"from Ampere on); {target.describe()} has {major}.{minor}: use impl='auto' or 'xla'"
        )


def checked_target(backend, q, k, v, q_positions, kv_lengths, target, interpret) -> target_lib.Target:
    """Every check of a kernel call's backend, inputs and target (ValueError naming what is
    wrong); returns the Target the kernel tiles for (resolve_target)."""
    check_backend(backend)
    check_inputs(q, k, v, q_positions, kv_lengths)
    check_kernel_inputs(q, k, v)
    target = resolve_target(target)
    check_target(backend, target, interpret)
    return target


def tpu_interpret(interpret):
    """TPU kernels use strided ref loads, which only the TPU interpreter (not interpret=True) models."""
    return pltpu.InterpretParams() if interpret is True else interpret


def dot_precision(dtype):
    # float32 must not silently drop to TF32 (Triton default) or bf16 passes: the contract is f32 math.
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def init_tpu_state(m_ref, l_ref, acc_ref) -> None:
    m_ref[...] = jnp.full(m_ref.shape, DEFAULT_MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)


def tpu_flash_setup(kernel_fn, dtype, kvh, rows, d, block_k, vmem_bytes, what, target, **static):
    """What both flash TPU kernels (flash_attention, flash_decoding) are called with, over KVH kv
    heads of R query rows each and a (parallel, parallel, arbitrary) grid. Returns (kernel,
    scratch_shapes, compiler_params): kernel_fn bound to `static` (windowed, tree, num_keys), the
    scale D**-0.5 and the MXU dtype (dtype, or f32 on a TPU without bf16 matmuls); the scratch
    m, l [KVH, R, 128] f32, acc [KVH, R, D] f32, plus [block_k * KVH, D] f32 x2 for bfloat16 with
    KVH > 1; Mosaic params with a VMEM limit of vmem_bytes (ValueError naming `what` if it cannot
    fit)."""
    scratch = [
        pltpu.VMEM((kvh, rows, TPU_LANES), jnp.float32),
        pltpu.VMEM((kvh, rows, TPU_LANES), jnp.float32),
        pltpu.VMEM((kvh, rows, d), jnp.float32),
    ]
    if dtype == jnp.bfloat16 and kvh > 1:
        scratch += [pltpu.VMEM((block_k * kvh, d), jnp.float32)] * 2
    params = tpu_compiler_params(("parallel", "parallel", "arbitrary"), vmem_bytes, what, target)
    mxu_dtype = dtype if target.tpu_bf16_matmul else jnp.float32
    kernel = functools.partial(kernel_fn, scale=d**-0.5, mxu_dtype=mxu_dtype, **static)
    return kernel, scratch, params


def tpu_attend_refs(
    q_ref, k_ref, v_ref, limit_ref, start_ref, tree_refs, kv_start, m_ref, l_ref, acc_ref, f32_kv_refs,
    **static,
):  # fmt: skip
    """tpu_attend_block reading the rows' limit, [start] and [tree] from their [R, 1] refs (None
    where the kernel has no window / no tree) and the f32 key/value scratch from f32_kv_refs
    (empty unless bfloat16 with KVH > 1); static: num_keys, scale, mxu_dtype."""
    kf_ref, vf_ref = f32_kv_refs if f32_kv_refs else (None, None)
    row_start = None if start_ref is None else start_ref[...]
    row_tree = None if tree_refs is None else tuple(x[...] for x in tree_refs)
    tpu_attend_block(
        q_ref, k_ref, v_ref, limit_ref[...], row_start, row_tree, kv_start, m_ref, l_ref, acc_ref,
        kf_ref, vf_ref, **static,
    )  # fmt: skip


def tpu_attend_block(
    q_ref, k_ref, v_ref, limit, row_start, tree, kv_start, m_ref, l_ref, acc_ref, kf_ref, vf_ref,
    *, num_keys: int, scale: float, mxu_dtype,
) -> None:  # fmt: skip
    """Mosaic: online-softmax update of every kv head's query rows with one block of keys.

    Args:
      q_ref: [KVH, R, D] the query rows that read each kv head.
      k_ref, v_ref: [block_k * KVH, D], keys kv_start .. kv_start + block_k with the heads interleaved
        (row = s * KVH + h): a block of the [B, S * KVH, D] view of the [B, S, KVH, D] cache, so the
        cache is read in place. Rows at keys >= num_keys (the tail of a partial last block) are garbage.
      limit: [R, 1] int32, row r sees keys s < limit[r].
      row_start: [R, 1] int32, row r sees keys s >= row_start[r] (row_starts); None without a window.
      tree: None, or the rows' (first, bits), [R, 1] int32 each (tree_rows; visible_keys).
      kv_start: int32 scalar, position of the block's first key.
      m_ref, l_ref: [KVH, R, 128] f32 lane-replicated running max / sum; acc_ref: [KVH, R, D] f32.
      kf_ref, vf_ref: [block_k * KVH, D] f32 scratch when the inputs are bfloat16 with KVH > 1, else None.
      mxu_dtype: dtype of the matmul operands: q's dtype, or float32 for bfloat16 inputs on a TPU
        without bfloat16 matmuls (v2, v3). The default precision then rounds them as a bf16 MXU would.
    """
    kvh, rows, _ = q_ref.shape
    block_k = k_ref.shape[0] // kvh
    precision = dot_precision(q_ref.dtype)  # of the inputs' dtype, not the MXU's
    key_pos = kv_start + lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)  # [R, block_k]
    visible = visible_keys(key_pos, limit, row_start, tree)
    if kf_ref is not None:
        # Mosaic's strided sublane loads want 32-bit rows; widen the block once for all heads.
        kf_ref[...] = k_ref[...].astype(jnp.float32)
        vf_ref[...] = v_ref[...].astype(jnp.float32)
        k_src, v_src = kf_ref, vf_ref
    else:
        k_src, v_src = k_ref, v_ref
    if num_keys % block_k:
        # The last block runs past the cache: zero those value rows, since p == 0 times NaN is NaN.
        in_cache = kv_start + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0) < num_keys  # [block_k, 1]
    for h in range(kvh):
        rows_h = slice(None) if kvh == 1 else pl.ds(h, block_k, stride=kvh)
        k = k_src[rows_h, :].astype(mxu_dtype)  # [block_k, D]; exact: the values came from q's dtype
        v = v_src[rows_h, :].astype(mxu_dtype)
        if num_keys % block_k:
            v = jnp.where(in_cache, v, jnp.zeros_like(v))
        _tpu_update_head(
            q_ref[h].astype(mxu_dtype), k, v, visible, scale, precision, (m_ref, l_ref, acc_ref), h
        )


def _tpu_update_head(q, k, v, visible, scale: float, precision, state_refs, h: int) -> None:
    """One kv head's online-softmax step: q [R, D], k, v [block_k, D] in the MXU dtype, visible
    [R, block_k] bool; updates row h of the running max / sum [KVH, R, 128] and acc [KVH, R, D]."""
    m_ref, l_ref, acc_ref = state_refs
    rows = q.shape[0]
    s = lax.dot_general(
        q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32, precision=precision
    )  # [R, block_k]
    s = jnp.where(visible, s * scale, DEFAULT_MASK_VALUE)
    m_prev = m_ref[h][:, :1]  # [R, 1]
    l_prev = l_ref[h][:, :1]
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    p = jnp.where(visible, jnp.exp(s - m_next), 0.0)  # [R, block_k]
    alpha = jnp.exp(m_prev - m_next)  # [R, 1]
    pv = lax.dot_general(
        p.astype(v.dtype),
        v,
        (((1,), (0,)), ((), ())),
        preferred_element_type=jnp.float32,
        precision=precision,
    )  # [R, D]
    acc_ref[h] = alpha * acc_ref[h] + pv
    m_ref[h] = jnp.broadcast_to(m_next, (rows, TPU_LANES))
    l_ref[h] = jnp.broadcast_to(alpha * l_prev + jnp.sum(p, axis=1, keepdims=True), (rows, TPU_LANES))


def gpu_attend_blocks(
    q, k_ref, v_ref, limit, row_start, tree, first_key, num_blocks, *, block_k: int, scale: float
):
    """Triton: online softmax of query rows `q` over `num_blocks` key blocks starting at `first_key`.

    Args:
      q: [R, D] query rows (input dtype). R and D are powers of two >= 16.
      k_ref, v_ref: [S, D], the whole key sequence of one (batch row, kv head); reads past S are masked.
      limit: [R] int32, row r sees keys s < limit[r].
      row_start: [R] int32, row r sees keys s >= row_start[r] (row_starts); None without a window.
      tree: None, or the rows' (first, bits), [R] int32 each (tree_rows; visible_keys).
      first_key: int32 scalar, a multiple of block_k; num_blocks: int32 scalar, data-dependent trip count.

    Returns:
      (acc [R, D] f32 unnormalised output, m [R] f32 running max, l [R] f32 running sum).
    """
    rows, head_dim = q.shape
    num_keys = k_ref.shape[0]
    precision = dot_precision(q.dtype)

    def body(j, carry):
        acc, m_prev, l_prev = carry
        start = pl.multiple_of(first_key + j * block_k, block_k)
        key_pos = start + jnp.arange(block_k, dtype=jnp.int32)  # [block_k]
        if num_keys % block_k:
            in_cache = jnp.broadcast_to((key_pos < num_keys)[:, None], (block_k, head_dim))
            k = plgpu.load(k_ref.at[pl.ds(start, block_k), :], mask=in_cache, other=0.0)
            v = plgpu.load(v_ref.at[pl.ds(start, block_k), :], mask=in_cache, other=0.0)
        else:
            k = k_ref[pl.ds(start, block_k), :]
            v = v_ref[pl.ds(start, block_k), :]
        s = jnp.dot(q, k.T, preferred_element_type=jnp.float32, precision=precision)  # [R, block_k]
        column = None if row_start is None else row_start[:, None]
        rows_tree = None if tree is None else tuple(x[:, None] for x in tree)
        visible = visible_keys(key_pos[None, :], limit[:, None], column, rows_tree)
        s = jnp.where(visible, s * scale, DEFAULT_MASK_VALUE)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        p = jnp.where(visible, jnp.exp(s - m_next[:, None]), 0.0)
        alpha = jnp.exp(m_prev - m_next)
        pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32, precision=precision)
        return alpha[:, None] * acc + pv, m_next, alpha * l_prev + jnp.sum(p, axis=1)

    init = (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), DEFAULT_MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    return lax.fori_loop(0, num_blocks, body, init)


def normalize(acc, row_sum):
    """acc [..., R, D] / row_sum [..., R, 1]; zeros for rows that saw no key (row_sum == 0)."""
    return jnp.where(row_sum > 0, acc / jnp.where(row_sum > 0, row_sum, 1.0), 0.0)


def log_sum_exp(m, row_sum):
    """Per-row log of the softmax denominator, m + log(row_sum); -inf for rows that saw no key."""
    return jnp.where(row_sum > 0, m + jnp.log(jnp.where(row_sum > 0, row_sum, 1.0)), -jnp.inf)


def combine_partials(o_parts, lse):
    """Log-sum-exp merge of softmax partials over key chunks (plain jnp, after the kernel).

    Args:
      o_parts: [..., C, R, D] f32, each chunk's output normalised by its own sum.
      lse: [..., C, R] f32, each chunk's log-sum-exp; -inf where the chunk had no visible key.

    Returns:
      [..., R, D] f32; zeros for rows that saw no key in any chunk.
    """
    m = jnp.max(lse, axis=-2, keepdims=True)  # [..., 1, R]
    w = jnp.exp(lse - jnp.where(jnp.isfinite(m), m, 0.0))  # [..., C, R]; exp(-inf) = 0 for empty chunks
    denom = jnp.sum(w, axis=-2)  # [..., R]
    out = jnp.sum(w[..., None] * o_parts, axis=-3)  # [..., R, D]
    return out / jnp.where(denom > 0, denom, 1.0)[..., None]
