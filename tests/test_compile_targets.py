"""The kernels and the model compile for real TPUs and GPUs, on this CPU-only machine.

libtpu and the CUDA PJRT plugin give compile-only devices (models/kernels/compile_targets.py):
compiling for them runs libtpu's Mosaic compiler and XLA:TPU, or XLA:GPU's Triton -> PTX -> cubin
for that compute capability and shared-memory limit. These are the cases that matter (the ones
that failed before the target-aware tiling, and one decode / verify / prefill step of each
registered model per target, both dtypes); `python scripts/compile_sweep.py` compiles every shape
for every target. Each "broken" test compiles something the fixes avoid and checks that the real
compiler rejects it, so the constraint the tiling works around is shown to exist.
"""

import functools
import re

import jax
import jax.numpy as jnp
import pytest

import models.kernels
from experiments import compile_loop
from models.kernels import common, flash_attention, flash_decoding
from models.kernels import compile_targets as ct
from models.kernels import target as target_lib
from models.kernels.flash_decoding import DecodeBlockSizes
from spec_jax.drafting.model import ModelDrafter

_missing = ct.missing_packages()
if _missing:
    pytest.skip(
        f"compile-only TPU/GPU backends not installed ({', '.join(_missing)}): {ct.INSTALL_HINT}",
        allow_module_level=True,
    )

# One TPU generation and two GPU classes, one of them with 99 KiB of shared memory per block.
CI_TARGETS = ("tpu-v5e", "gpu-a100", "gpu-rtx-a6000")
_QWEN_1_5B, _QWEN_0_5B, _SMOLLM2 = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "smollm2-135m"
# Model steps: a Latin square of (target x step) -> model, so that every registered model's decode,
# verify and prefill step compiles for some target and every target sees both dtypes (all of them
# for every target: scripts/compile_sweep.py). Plus the kernel call that failed on sm_86 / sm_89.
CI_CASES = {
    "tpu-v5e": [
        ct.Case("model", _SMOLLM2, 8, 2048, 1, "bfloat16"),
        ct.Case("model", _QWEN_1_5B, 1, 1000, 16, "float32"),
        ct.Case("model", _QWEN_0_5B, 1, 1000, 128, "bfloat16"),
    ],
    "gpu-a100": [
        ct.Case("model", _QWEN_0_5B, 8, 2048, 1, "float32"),
        ct.Case("model", _SMOLLM2, 1, 1000, 16, "bfloat16"),
        ct.Case("model", _QWEN_1_5B, 1, 1000, 128, "bfloat16"),
    ],
    "gpu-rtx-a6000": [
        ct.Case("model", _QWEN_1_5B, 8, 2048, 1, "bfloat16"),
        ct.Case("model", _QWEN_0_5B, 1, 1000, 5, "float32"),  # failed before: 114944 > 101376 bytes
        ct.Case("model", _SMOLLM2, 1, 256, 37, "float32"),  # prefill, a ragged bucket
    ],
}
# Failed on sm_86 before (7 query heads per kv head x 16 queries, float32); compiled for all three.
VERIFY_F32 = ct.Case("kernel", _QWEN_0_5B, 1, 1000, 16, "float32")
CI_PAIRS = [(target, case) for target, cases in CI_CASES.items() for case in (*cases, VERIFY_F32)]


def test_ci_cases_cover_models_steps_and_dtypes():
    steps = {(case.model, case.step) for cases in CI_CASES.values() for case in cases}
    assert steps == {(m, s) for m in ct.MODELS for s in ("decode", "verify", "prefill")}
    for target in CI_TARGETS:
        assert {case.dtype for case in CI_CASES[target]} == {"float32", "bfloat16"}, target


@pytest.mark.parametrize(
    "target, case", CI_PAIRS, ids=[f"{t}-{c.label().replace(' ', '-')}" for t, c in CI_PAIRS]
)
def test_compiles_for_target(target, case):
    result = ct.compile_case(case, target)
    assert result.status == "ok", result.error
    assert result.impl == ct.pallas_impl(target)


# The whole speculative decoding program (experiments/compile_loop.py: spec_loop, the while_loop of
# draft -> verify -> commit rounds) of the Qwen pair at full depth, at `make demo`'s shapes: one TPU
# and the 99 KiB GPU class, both batch sizes between them, bfloat16 and int8 (make demo's default). spec_prefill and the other
# targets: scripts/compile_sweep.py --kinds=loop.
LOOP_PAIRS = [
    ("tpu-v5e", compile_loop.LoopCase("loop", 8, "bfloat16")),
    ("gpu-rtx-a6000", compile_loop.LoopCase("loop", 1, "int8")),
]


@pytest.mark.parametrize(
    "target, case",
    # The GPU case in the slow tier (the TPU one, and the pod case of tests/test_pod_pairs.py, run
    # in `make test`; `make compile-sweep` compiles every loop for every target).
    [pytest.param(*LOOP_PAIRS[0]), pytest.param(*LOOP_PAIRS[1], marks=pytest.mark.slow)],
    ids=[f"{t}-{c.label().replace(' ', '-')}" for t, c in LOOP_PAIRS],
)
def test_speculative_loop_compiles_for_target(target, case):
    result = compile_loop.compile_loop_case(case, target)
    assert result.status == "ok", result.error
    assert result.impl == ct.pallas_impl(target)


def test_loop_case_has_the_demo_shapes():
    """make demo: gamma 4, 64 new tokens, a 5-token prompt in the 16-token bucket; the target's
    cache has 16 + 64 + 4 slots, the draft's K(D - 1) more (room for its tree calls: ModelDrafter),
    the loop carries both and the drafts' distributions."""
    fn, args, impl, donate = compile_loop.loop_program(
        compile_loop.LoopCase("loop", 8, "bfloat16"), "tpu-v5e"
    )
    params, draft_params, state, stop_ids = args
    assert impl == "pallas_tpu" and donate == (2,) and stop_ids.shape == (2,)
    assert state.target_cache.k.shape[:3] == (28, 8, 16 + 64 + 4)
    room = ModelDrafter.tree_width * (ModelDrafter.tree_depth - 1)  # the draft's tree calls
    assert state.draft_state.k.shape[:3] == (24, 8, 16 + 64 + 4 + room)
    assert params["layers"]["mlp"]["w_gate"].shape[0] == 28


@pytest.mark.parametrize(
    "target, expected",
    [("tpu-v5e", "pallas_tpu"), ("tpu-v2", "pallas_tpu"), ("gpu-rtx-a6000", "pallas_gpu"), ("gpu-t4", "xla")],
)
def test_auto_traces_the_kernel_for_the_target_device(target, expected):
    """A model with attention_impl="auto" traced for a compile-only device gets that device's Pallas
    kernel (not the CPU's XLA attention of jax.default_backend()), or XLA attention on pre-Ampere GPUs."""
    case = ct.Case("model", "smollm2-135m", 1, 256, 5, "bfloat16", impl="auto")
    fn, args, impl = ct.case_program(case, target)
    text = ct.lower_for(fn, args, ct.device(target)).as_text()
    assert models.kernels.resolve_impl(impl, ct.device(target)) == expected
    for pallas in ("pallas_tpu", "pallas_gpu"):
        assert ct.has_pallas_kernel(text, pallas) == (pallas == expected)


@pytest.mark.parametrize("target", ["gpu-t4", "gpu-v100"])
def test_pre_ampere_gpu_compiles_with_xla_attention_and_refuses_forced_pallas(target):
    """V100 needs CUDA 12's ptxas (nvidia-cuda-nvcc-cu12): CUDA 13 dropped sm_70."""
    verify = ct.Case("model", "qwen2.5-coder-0.5b", 1, 1000, 5, "float32", impl="auto")
    result = ct.compile_case(verify, target)
    assert result.status == "ok" and result.impl == "xla", result.error
    forced = ct.compile_case(ct.Case("kernel", "qwen2.5-coder-0.5b", 1, 1000, 5, "float32"), target)
    assert forced.status == "refused" and "needs compute capability >= 8.0" in forced.error


def test_pre_ampere_gpu_broken_xla_rejects_triton():
    """What "refused" avoids: XLA itself will not compile a Triton kernel for sm_75."""
    case = ct.Case("kernel", "qwen2.5-coder-0.5b", 1, 256, 1, "bfloat16")
    fn, args, _ = ct.case_program(case, "gpu-t4")
    a100 = target_lib.Target("gpu", "pretend Ampere", compute_capability=(8, 0))
    fn = functools.partial(flash_decoding.flash_decoding, backend="gpu", target=a100)
    with pytest.raises(Exception, match=r"Triton support is only enabled for Ampere GPUs"):
        ct.compile_for(fn, args, ct.device("gpu-t4"))


def _decode_args(t, h, kvh, d, s, dtype):
    return (
        jax.ShapeDtypeStruct((1, t, h, d), dtype),
        jax.ShapeDtypeStruct((1, s, kvh, d), dtype),
        jax.ShapeDtypeStruct((1, s, kvh, d), dtype),
        jax.ShapeDtypeStruct((1, t), jnp.int32),
        jax.ShapeDtypeStruct((1,), jnp.int32),
    )


@pytest.mark.parametrize("target", ["tpu-v5e", "gpu-rtx-a6000"])
@pytest.mark.parametrize(
    "kernel, t", [(flash_decoding.flash_decoding, 5), (flash_attention.flash_attention, 128)],
    ids=["flash_decoding", "flash_attention"],
)  # fmt: skip
def test_kernels_compile_with_a_traced_window(target, kernel, t):
    """Gemma 3's local / global layers pass the window as a traced int32 (chosen per layer inside
    the layer scan): each Pallas kernel compiles with one for a real TPU and GPU (B = 1: the TPU
    decode kernel shares the window's blocks out over its 2 chunks at run time)."""
    impl = ct.pallas_impl(target)

    def fn(q, k, v, q_positions, kv_lengths, window):
        return kernel(q, k, v, q_positions, kv_lengths, window=window, backend=impl.removeprefix("pallas_"))

    args = (
        *_decode_args(t=t, h=8, kvh=2, d=128, s=1000, dtype=jnp.bfloat16),
        jax.ShapeDtypeStruct((), jnp.int32),
    )
    assert ct.has_pallas_kernel(ct.lower_for(fn, args, ct.device(target)).as_text(), impl)
    ct.compile_for(fn, args, ct.device(target))  # the device compiler's errors propagate


# Tree calls (token trees, models.kernels' `tree`): the decoding kernel with T = 8 (a 7-node tree
# and its root) and flash_attention with T = 17 (16 nodes and the root), with a traced window too
# (a Gemma 3 layer), for two TPU generations and two GPUs, bfloat16 on one of each, float32 on the
# other.
TREE_TARGETS = {"tpu-v5e": "bfloat16", "tpu-v6e": "float32", "gpu-h100": "bfloat16", "gpu-a100": "float32"}


@pytest.mark.parametrize("target", TREE_TARGETS)
@pytest.mark.parametrize(
    "kernel, t", [(flash_decoding.flash_decoding, 8), (flash_attention.flash_attention, 17)],
    ids=["flash_decoding", "flash_attention"],
)  # fmt: skip
def test_kernels_compile_with_a_tree_mask(target, kernel, t):
    impl = ct.pallas_impl(target)

    def fn(q, k, v, q_positions, kv_lengths, window, tree):
        backend = impl.removeprefix("pallas_")
        return kernel(q, k, v, q_positions, kv_lengths, window=window, tree=tree, backend=backend)

    args = (
        *_decode_args(t=t, h=14, kvh=2, d=64, s=1000, dtype=jnp.dtype(TREE_TARGETS[target])),
        jax.ShapeDtypeStruct((), jnp.int32),
        jax.ShapeDtypeStruct((1, t), jnp.int32),
    )
    assert ct.has_pallas_kernel(ct.lower_for(fn, args, ct.device(target)).as_text(), impl)
    ct.compile_for(fn, args, ct.device(target))  # the device compiler's errors propagate


def test_sm86_broken_old_block_rule_exceeds_shared_memory():
    """The old GPU rule (block_k = 128 for D=64 float32, whatever the folded rows) on Qwen2.5-0.5B
    verification: the sm_86 compiler rejects it. Forced through by claiming H100's shared memory."""
    claims_h100 = target_lib.Target("gpu", "sm_86 claiming 227 KiB", compute_capability=(8, 6),
                                    shared_memory_per_block=227 * 1024)  # fmt: skip
    fn = functools.partial(
        flash_decoding.flash_decoding,
        backend="gpu",
        block_sizes=DecodeBlockSizes(block_k=128),
        target=claims_h100,
    )
    args = _decode_args(t=5, h=14, kvh=2, d=64, s=1000, dtype=jnp.float32)
    with pytest.raises(
        Exception, match=r"Shared memory size limit exceeded: requested 114944, available: 101376"
    ):
        ct.compile_for(fn, args, ct.device("gpu-rtx-a6000"))


# A GPU whose blocks get 1 KiB: every compile fails and says how much shared memory it requested.
_PROBE = ct.GpuSpec("probe: sm_86 with 1 KiB", (8, 6), 84, 1024, 1024, 1536, 2**30, 10**11, 2**20, 1.0)


@pytest.mark.parametrize(
    "rows, block_k, d, dtype",
    [(64, 128, 64, jnp.float32), (128, 32, 128, jnp.float32), (64, 64, 128, jnp.bfloat16)],
)
def test_shared_memory_estimate_bounds_what_triton_requests(rows, block_k, d, dtype):
    """common.gpu_shared_memory_bytes is what the GPU tiling trusts; XLA reports the real number."""
    big = target_lib.Target("gpu", "unbounded", compute_capability=(8, 6), shared_memory_per_block=2**30)
    fn = functools.partial(
        flash_decoding.flash_decoding,
        backend="gpu",
        block_sizes=DecodeBlockSizes(block_k=block_k, num_splits=1),
        target=big,
    )
    # kvh=1, one query head per kv head: the folded tile has T = rows rows.
    with pytest.raises(Exception, match=r"Shared memory size limit exceeded") as error:
        ct.compile_for(fn, _decode_args(t=rows, h=1, kvh=1, d=d, s=2048, dtype=dtype), ct.device(_PROBE))
    requested = int(re.search(r"requested (\d+)", str(error.value)).group(1))
    estimate = common.gpu_shared_memory_bytes(rows, block_k, d, jnp.dtype(dtype).itemsize)
    assert requested <= estimate, f"Triton requested {requested} bytes, the estimate is {estimate}"
    assert estimate - requested < max(4096, requested // 2), "the estimate is far too loose to be useful"


@pytest.mark.parametrize("step, t", [("decode", 1), ("prefill", 128)])
def test_tpu_v3_compiles_bfloat16(step, t):
    case = ct.Case("kernel", "qwen2.5-coder-0.5b", 1, 1000, t, "bfloat16")
    result = ct.compile_case(case, "tpu-v3")
    assert result.status == "ok", result.error


def test_tpu_v3_broken_bfloat16_matmul_is_rejected():
    """Without the float32 multiply, Mosaic rejects bf16 operands on v3 (shown by pretending v3 has
    bf16 matmuls)."""
    claims_v5 = target_lib.Target("tpu", "TPU v3 claiming v5", tpu_generation=5, vmem_bytes=16 * 2**20)
    fn = functools.partial(flash_decoding.flash_decoding, backend="tpu", target=claims_v5)
    args = _decode_args(t=1, h=14, kvh=2, d=64, s=1000, dtype=jnp.bfloat16)
    with pytest.raises(Exception, match=r"Unsupported matmul RHS type on target: vector<\d+x\d+xbf16>"):
        ct.compile_for(fn, args, ct.device("tpu-v3"))


def test_tpu_v4_broken_vmem_overflow_is_rejected():
    """The VMEM budget is per generation: a decode block the old fixed 48 MiB budget allowed (~21 MiB)
    overflows v4's 16 MiB. The tiling now refuses it at trace time (test_kernels.py); forced through
    here by claiming v5e's 128 MiB, XLA:TPU rejects it."""
    claims_v5e = target_lib.Target("tpu", "TPU v4 claiming 128 MiB", tpu_generation=4, vmem_bytes=128 * 2**20)
    fn = functools.partial(
        flash_decoding.flash_decoding,
        backend="tpu",
        block_sizes=DecodeBlockSizes(block_k=4096),
        target=claims_v5e,
    )
    args = _decode_args(t=5, h=8, kvh=2, d=128, s=8192, dtype=jnp.float32)
    with pytest.raises(Exception, match=r"Ran out of memory in memory space vmem"):
        ct.compile_for(fn, args, ct.device("tpu-v4"))
    fn = functools.partial(fn, target=None)  # the device's own facts
    with pytest.raises(ValueError, match=r"more than the 12 MiB budget on TPU v4"):
        ct.lower_for(fn, args, ct.device("tpu-v4"))


# The engine's programs (issue 52): its loop, whose rows each carry their own warp (per-row
# temperature / top-k / top-p operands: every path of the warp is in the one program), and its
# prefill reading each row's cached prefix from the prefix cache's pool, for TPU v5e and v6e and
# an H100, with the target's Pallas kernels, at 2 layers (the same program as at full depth, a
# shorter layer scan). The slow tier: each is a whole-program compile (tens of seconds here).
ENGINE_PAIRS = [
    (target, compile_loop.LoopCase(phase, 8, "bfloat16", num_layers=2))
    for target in ("tpu-v5e", "tpu-v6e", "gpu-h100")
    for phase in ("loop", "prefix_prefill")
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "target, case", ENGINE_PAIRS, ids=[f"{t}-{c.label().replace(' ', '-')}" for t, c in ENGINE_PAIRS]
)
def test_engine_programs_compile_for_tpu_v5e_v6e_and_h100(target, case):
    result = compile_loop.compile_loop_case(case, target)
    assert result.status == "ok", result.error
    assert result.impl == ct.pallas_impl(target)
