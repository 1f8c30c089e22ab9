"""The GGUF precisions gguf and gguf_q8: ggml's block kernel, its XLA counterpart, and exactness.

The kernel (models/kernels/gguf_matmul.cc) is checked against float64 products of gguf-py's
reference dequantization, and against ggml's own vec_dot for its multi-row 8-bit path; then the
properties speculative decoding rests on: each output row is bit-identical whatever the number
of rows in the call, so greedy speculative decoding equals plain decoding, and sampling keeps
the target's distribution exactly. The kernel builds on first use; where it cannot, its tests
fail (CI has compilers) while those of the XLA path (gguf_blocks) do not need it.
"""

import ast
import concurrent.futures
import math
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import apply, perturbed
from gguf import GGMLQuantizationType as T
from gguf import quants
from test_cli import run_cli
from test_distribution import HORIZON, PROMPT, WARPS, V, chi2_pvalue, exact_joint, sample_counts

import models
import spec_jax
from models import precision, registry, weights
from models.gguf_loader import open_gguf
from models.kernels import gguf_blocks, gguf_matmul
from models.precision import BlockWeight
from spec_jax import executables, rounds

ROOT = pathlib.Path(__file__).resolve().parent.parent
EPS32 = 2.0**-24  # float32's unit roundoff
# (type, K): the K-quants take 256-value blocks, Q5_0 / Q8_0 32-value ones; two or more blocks a row.
TYPES = [(T.Q4_K, 512), (T.Q6_K, 768), (T.Q5_0, 96), (T.Q8_0, 160)]
TYPE_IDS = [t.name for t, _ in TYPES]
PROMPTS = [[5, 9, 2], [1], [7, 7, 3, 8, 11, 4, 6, 2, 9, 10]]  # ragged, one of a single token
MAX_NEW = 13


def kernel():
    """Asserts the kernel builds here: its tests fail rather than skip where it cannot."""
    assert gguf_matmul.available(), "the GGUF block kernel did not build (see the warning)"
    return gguf_matmul


def blocks(ggml_type, n: int, k: int, seed: int):
    """(uint8 [n, row_bytes] from ggml's quantizer, float64 [n, k] of gguf-py's dequantization)
    of random normal rows."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    data = kernel().quantize(w, ggml_type.value)
    return data, quants.dequantize(data, ggml_type).astype(np.float64)


def is_block(x) -> bool:
    return isinstance(x, BlockWeight)


def summation_bound(x, w_oi):
    """|y - x . w^T| for float32 products and sums of K terms, at most (K + 1) u |x| . |w|^T."""
    return (x.shape[1] + 1) * EPS32 * (np.abs(x).astype(np.float64) @ np.abs(w_oi).T)


def matmul(x, data, ggml_type, quantize_x, ggml_dot=False):
    return np.asarray(
        gguf_matmul.matmul(jnp.asarray(x), jnp.asarray(data), ggml_type.value, quantize_x, ggml_dot)
    )


# -- 1. The faithful kernel (precision gguf) --------------------------------------------------


@pytest.mark.parametrize("n", [45, 77])  # partial chunks of 32 weight rows
@pytest.mark.parametrize("ggml_type, k", TYPES, ids=TYPE_IDS)
def test_faithful_kernel_equals_float64_product_of_reference_dequantization(ggml_type, k, n):
    data, w = blocks(ggml_type, n, k, seed=1)
    x = np.random.default_rng(2).standard_normal((5, k)).astype(np.float32)
    y = matmul(x, data, ggml_type, quantize_x=False)
    ref = x.astype(np.float64) @ w.T
    assert y.shape == (5, n) and y.dtype == np.float32
    assert (np.abs(y - ref) <= summation_bound(x, w)).all()


@pytest.mark.parametrize("ggml_type, k", TYPES, ids=TYPE_IDS)
def test_kernel_rows_equal_reference_dequantized_rows_exactly(ggml_type, k):
    data, w = blocks(ggml_type, 45, k, seed=3)
    indices = np.array([[3, 0, 44], [3, 17, 3]])  # repeats, the first and the last row
    got = np.asarray(kernel().rows(jnp.asarray(indices), jnp.asarray(data), ggml_type.value, k))
    assert got.shape == (2, 3, k) and got.dtype == np.float32
    np.testing.assert_array_equal(got, w[indices].astype(np.float32))


# -- 2. The 8-bit kernel (precision gguf_q8) --------------------------------------------------


@pytest.mark.parametrize("ggml_type, k", TYPES[:2], ids=TYPE_IDS[:2])
def test_multirow_q8_kernel_agrees_with_ggml_vec_dot_and_is_near_the_float_product(ggml_type, k):
    data, w = blocks(ggml_type, 77, k, seed=4)
    x = np.random.default_rng(5).standard_normal((11, k)).astype(np.float32)  # a group of 8 and 3
    ours = matmul(x, data, ggml_type, quantize_x=True)
    ggml = matmul(x, data, ggml_type, quantize_x=True, ggml_dot=True)
    # The same integer products; only the float order of the scales' sums differs.
    np.testing.assert_allclose(ours, ggml, rtol=1e-5, atol=1e-5 * np.abs(ggml).max())
    ref = x.astype(np.float64) @ w.T
    for y in (ours, ggml):  # 8-bit activations: about 0.7% from the float product here
        assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 0.02
        assert np.abs(y - ref).max() / np.abs(ref).max() < 0.02


@pytest.mark.parametrize("ggml_type, k", TYPES[2:], ids=TYPE_IDS[2:])
def test_q8_kernel_of_32_value_blocks_is_near_the_float_product(ggml_type, k):
    data, w = blocks(ggml_type, 77, k, seed=4)
    x = np.random.default_rng(5).standard_normal((11, k)).astype(np.float32)
    y = matmul(x, data, ggml_type, quantize_x=True)
    ref = x.astype(np.float64) @ w.T
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 0.02
    assert np.abs(y - ref).max() > (summation_bound(x, w)).max()  # the activations were quantized


# -- 3. Row invariance: what speculative decoding's exactness rests on -------------------------


@pytest.mark.parametrize("ggml_dot", [False, True])
@pytest.mark.parametrize("quantize_x", [False, True])
@pytest.mark.parametrize("ggml_type, k", TYPES, ids=TYPE_IDS)
def test_each_output_row_is_bit_identical_whatever_the_row_count(ggml_type, k, quantize_x, ggml_dot):
    rows = 16  # groups of the multi-row kernel (8) and their remainders
    data, _ = blocks(ggml_type, 77, k, seed=6)
    x = jnp.asarray(np.random.default_rng(7).standard_normal((rows, k)), jnp.float32)
    call = jax.jit(lambda x: kernel().matmul(x, jnp.asarray(data), ggml_type.value, quantize_x, ggml_dot))
    single = np.stack([np.asarray(call(x[i : i + 1]))[0] for i in range(rows)])  # decode calls
    for m in range(1, rows + 1):  # verify calls of m rows, the row at each place in them
        np.testing.assert_array_equal(np.asarray(call(x[:m])), single[:m], err_msg=f"first {m} rows")
        np.testing.assert_array_equal(
            np.asarray(call(x[rows - m :])), single[rows - m :], err_msg=f"last {m}"
        )


def test_interleaved_q4k_agrees_with_ggml_vec_dot_and_each_row_is_bit_identical_whatever_the_row_count():
    """Q4_K at gguf_q8 in llama.cpp's repacked layout (groups of 8 rows, ggml_gemv_q4_K_8x8_q8_K):
    the same integer products as ggml's vec_dot on the file's own layout (a wrong interleave of
    the values or of the 6-bit scales is far off), and row m's bits do not depend on M. 264
    weight rows: a partial chunk of the kernel's 256."""
    rows = 16
    data, _ = blocks(T.Q4_K, 264, 512, seed=8)
    packed = kernel().interleave_q4k(data)
    assert packed.shape == data.shape and not np.array_equal(packed, data)
    x = jnp.asarray(np.random.default_rng(9).standard_normal((rows, 512)), jnp.float32)
    call = jax.jit(lambda x: kernel().matmul(x, jnp.asarray(packed), T.Q4_K.value, True, interleaved=True))
    ggml = matmul(np.asarray(x), data, T.Q4_K, quantize_x=True, ggml_dot=True)
    np.testing.assert_allclose(np.asarray(call(x)), ggml, rtol=1e-5, atol=1e-5 * np.abs(ggml).max())
    single = np.stack([np.asarray(call(x[i : i + 1]))[0] for i in range(rows)])
    for m in range(1, rows + 1):
        np.testing.assert_array_equal(np.asarray(call(x[:m])), single[:m], err_msg=f"first {m} rows")
        np.testing.assert_array_equal(
            np.asarray(call(x[rows - m :])), single[rows - m :], err_msg=f"last {m}"
        )


def test_products_run_at_once_from_several_threads_keep_their_bits():
    """The kernels' split over XLA's threads (models/kernels/cpu_parallel.h: the caller takes
    chunks beside the pool's tasks and waits for those computing one) under calls that overlap:
    programs of three independent products (as q, k and v, which XLA may run at once) from four
    Python threads at a time give every output the bits of the same program run alone. A caller
    that returned before a task finished its chunk shows as rows of no product."""
    data = [
        jnp.asarray(kernel().interleave_q4k(blocks(T.Q4_K, n, 512, seed=20 + n)[0]))
        for n in (264, 1024, 2048)
    ]

    @jax.jit
    def three(x):
        return [kernel().matmul(x, d, T.Q4_K.value, True, interleaved=True) for d in data]

    xs = [
        jnp.asarray(np.random.default_rng(30 + i).standard_normal((1 + i % 3, 512)), jnp.float32)
        for i in range(8)
    ]
    alone = [[np.asarray(y) for y in three(x)] for x in xs]

    def worker(t):  # the (thread, repeat) pairs whose outputs differ from the program's alone
        calls = [(r, (t + r) % len(xs)) for r in range(25)]
        return [(t, r) for r, i in calls if any(map(differ, three(xs[i]), alone[i]))]

    def differ(y, a):
        return not np.array_equal(np.asarray(y), a)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert [f for found in pool.map(worker, range(4)) for f in found] == []


@pytest.mark.parametrize("k", [256, 1536])
def test_interleaved_q4k_rows_are_ggml_gemvs_bits_whatever_the_row_count(k):
    """The multi-row kernel on the interleaved layout (one unpacking of a block for up to 8 rows
    of x) gives each row exactly the bits of ggml's own ggml_gemv_q4_K_8x8_q8_K (ggml_dot=True
    runs that gemv, one call per row), for every row count 1..16 (groups of 8 and remainders)."""
    data, _ = blocks(T.Q4_K, 264, k, seed=12)
    packed = jnp.asarray(kernel().interleave_q4k(data))
    x = np.random.default_rng(13).standard_normal((16, k)).astype(np.float32) * 3
    own = jax.jit(lambda x: kernel().matmul(x, packed, T.Q4_K.value, True, interleaved=True))
    gemv = jax.jit(lambda x: kernel().matmul(x, packed, T.Q4_K.value, True, ggml_dot=True, interleaved=True))
    reference = np.asarray(gemv(jnp.asarray(x)))
    for m in range(1, 17):
        np.testing.assert_array_equal(np.asarray(own(jnp.asarray(x[:m]))), reference[:m], err_msg=f"{m} rows")


ONE_ROW_CHECK = """
import numpy as np, jax, jax.numpy as jnp
from gguf import GGMLQuantizationType as T
from models.kernels import gguf_matmul as g
assert g.available()
rng = np.random.default_rng(18)
same = []
for t, n, k in ((T.Q4_K, 264, 1536), (T.Q6_K, 40, 1536)):
    data = g.quantize(rng.standard_normal((n, k)).astype(np.float32), t.value)
    il = t == T.Q4_K
    w = jnp.asarray(g.interleave_q4k(data) if il else data)
    x = jnp.asarray(rng.standard_normal((1, k)).astype(np.float32) * 3)
    own = g.matmul(x, w, t.value, True, interleaved=il)
    ggml = g.matmul(x, w, t.value, True, ggml_dot=True, interleaved=il)
    same.append(bool(np.array_equal(np.asarray(own), np.asarray(ggml))))
print(g.one_row_own(), *same)
"""


@pytest.mark.parametrize("choice", ["ggml", "own"])
def test_a_one_row_product_has_ggmls_bits_whichever_kernel_runs_it(choice):
    """A decode step's one-row products run ggml's own (gemv for interleaved Q4_K, vec_dot for
    Q6_K) or the multi-row kernel, whichever the CPU runs faster (gguf_matmul.one_row_own). Both
    must give the row ggml's bits. $SPEC_JAX_GGUF_ONE_ROW fixes the choice (a process of its own
    each, since the kernel reads it once), so both are checked on any CPU."""
    if not kernel().multirow():
        pytest.skip("this CPU has no multi-row build (AVX-512 VNNI): one-row products are ggml's")
    env = {**os.environ, gguf_matmul.ONE_ROW_ENV: choice}
    proc = subprocess.run(
        [sys.executable, "-c", ONE_ROW_CHECK], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == [str(choice == "own"), "True", "True"]


def test_an_unknown_one_row_choice_is_one_clear_error(monkeypatch):
    monkeypatch.setenv(gguf_matmul.ONE_ROW_ENV, "fast")
    with pytest.raises(
        ValueError, match=r"\$SPEC_JAX_GGUF_ONE_ROW must be one of ggml, own \(or unset\), got 'fast'"
    ):
        gguf_matmul.one_row_setting()
    monkeypatch.setenv(gguf_matmul.ONE_ROW_ENV, "own")
    assert gguf_matmul.one_row_setting() == "own"


@pytest.mark.parametrize("rows", [1, 3, 4, 7, 16])  # gemm's groups of 4 and gemv's remainder
def test_ggml_gemm_on_interleaved_q4k_agrees_with_ggml_vec_dot(rows):
    """ggml's prefill path (bulk with ggml_dot, and a prefill's bulk where the CPU lacks the
    multi-row kernel: rows in groups of 4 through ggml's gemm, the rest through gemv): the same
    products as vec_dot up to float order, whatever the row count."""
    data, _ = blocks(T.Q4_K, 264, 512, seed=10)
    packed = jnp.asarray(kernel().interleave_q4k(data))
    x = np.random.default_rng(11).standard_normal((rows, 512)).astype(np.float32)
    y = np.asarray(
        kernel().matmul(
            jnp.asarray(x), packed, T.Q4_K.value, True, ggml_dot=True, interleaved=True, bulk=True
        )
    )
    ggml = matmul(x, data, T.Q4_K, quantize_x=True, ggml_dot=True)
    np.testing.assert_allclose(y, ggml, rtol=1e-5, atol=1e-5 * np.abs(ggml).max())


@pytest.mark.parametrize(
    "ggml_type, interleaved, ggml_dot, bulk, rows_apart",
    [
        (T.Q4_K, True, False, False, 1),  # the multi-row kernel; apart: one row (gemv's bits)
        (T.Q6_K, False, False, False, 1),
        (T.Q4_K, True, True, True, 8),  # ggml's gemm: rows in groups of 4 (quantize_mat_q8_K_4x8)
    ],
)
def test_rows_of_x_quantized_on_several_threads_keep_their_bits(
    ggml_type, interleaved, ggml_dot, bulk, rows_apart
):
    """x is quantized on XLA's threads where its rows hold at least 32K values (EachXRow in
    gguf_matmul.cc), on the calling thread below: 24 rows of K 2816 (67K values) give each row
    the bits of the same rows multiplied a few at a time (8 rows: 22.5K values). A row quantized
    into another row's place, or left unquantized, shows as a row that differs."""
    k = 2816
    data, _ = blocks(ggml_type, 64, k, seed=40)
    w = jnp.asarray(kernel().interleave_q4k(data) if interleaved else data)
    x = np.random.default_rng(41).standard_normal((24, k)).astype(np.float32) * 3
    call = jax.jit(
        lambda x: kernel().matmul(
            x, w, ggml_type.value, True, ggml_dot=ggml_dot, interleaved=interleaved, bulk=bulk
        )
    )
    together = np.asarray(call(jnp.asarray(x)))
    apart = np.concatenate(
        [np.asarray(call(jnp.asarray(x[i : i + rows_apart]))) for i in range(0, 24, rows_apart)]
    )
    np.testing.assert_array_equal(together, apart)


# (type, K, quantize_x, interleaved, bulk, ggml_dot): every path of the kernel's product, ggml's
# gemm (the last) included: it computes the live rows rounded up to its groups of 4.
LIVE_PATHS = [
    (T.Q4_K, 512, True, True, False, False),
    (T.Q4_K, 512, True, True, True, False),
    (T.Q6_K, 768, True, False, False, False),
    (T.Q8_0, 160, True, False, False, False),
    (T.Q4_K, 512, False, False, False, False),
    (T.Q5_0, 96, False, False, False, False),
    (T.Q4_K, 512, True, True, True, True),
]


@pytest.mark.parametrize("live", [0, 1, 6, 8, 16])
@pytest.mark.parametrize(
    "ggml_type, k, quantize_x, interleaved, bulk, ggml_dot",
    LIVE_PATHS,
    ids=lambda v: getattr(v, "name", str(v)),
)
def test_rows_past_live_are_zero_and_the_live_rows_keep_their_bits(
    ggml_type, k, quantize_x, interleaved, bulk, ggml_dot, live
):
    """matmul's `live` (a prefill's last chunk, which its prompt does not fill): the rows before
    it are the bits of the call over all 16 rows, the rows from it on are 0 (not computed), on
    every path; live is an operand, so one compiled program serves every count."""
    data, _ = blocks(ggml_type, 264, k, seed=14)
    w = jnp.asarray(kernel().interleave_q4k(data) if interleaved else data)
    x = jnp.asarray(np.random.default_rng(15).standard_normal((16, k)).astype(np.float32))
    product = jax.jit(
        lambda x, n: kernel().matmul(
            x, w, ggml_type.value, quantize_x, ggml_dot=ggml_dot, interleaved=interleaved, bulk=bulk, live=n
        )
    )
    full = np.asarray(product(x, 16))
    got = np.asarray(product(x, live))
    assert np.abs(full).max(axis=1).min() > 0  # no row of the full call is 0 by itself
    np.testing.assert_array_equal(got[:live], full[:live])
    assert not got[live:].any()


def test_the_row_wise_prefill_agrees_with_one_call_and_skips_its_last_chunks_padding():
    """prefill_rows at gguf_q8 runs its products with bulk on (and only it: a decode step's
    forward has it off). With the multi-row kernel (this CPU's build) bulk changes no bits, so
    its logits equal one call's over the padded batch bit for bit; where ggml's gemm takes the
    bulk rows they agree up to float order. A last chunk's rows past the prompt are not
    computed (forward's live_tokens): with no q/k/v bias their cache entries stay exactly 0
    (computed, they are the padding tokens' keys)."""
    from models.transformer import attention_impl
    from spec_jax import decode

    model = models.cast(
        models.random_model(
            vocab_size=64, num_layers=1, d_model=256, num_heads=4, num_kv_heads=2, scan_layers=False,
            qkv_bias=False,
        ),
        "gguf_q8",
    )  # fmt: skip
    assert attention_impl(model.config) == "cpu"
    lengths = [5, 20]  # last chunks of 5 and 4 live tokens (16-wide chunks)
    tokens, lens = decode.pad_prompts([[3, 5, 7, 9, 11], list(range(1, 21))], 32)

    def rows(t, n):
        out = decode.prefill(model.config, model.params, t, n, 40)
        return out.logits, out.cache.k

    lowered = jax.jit(rows).lower(jnp.asarray(tokens), jnp.asarray(lens)).as_text()
    assert "bulk = true" in lowered
    step = jax.jit(models.forward, static_argnums=0).lower(
        model.config,
        model.params,
        jnp.asarray(tokens[:, :1]),
        jnp.zeros((2, 1), jnp.int32),
        models.init_cache(model.config, 2, 40),
    )
    assert "bulk = true" not in step.as_text() and "bulk = false" in step.as_text()
    got, k = (np.asarray(a) for a in jax.jit(rows)(jnp.asarray(tokens), jnp.asarray(lens)))
    positions = jnp.broadcast_to(jnp.arange(32), (2, 32))
    config = model.config.replace(bulk_products=not kernel().multirow())
    want = models.forward(
        config, model.params, jnp.asarray(tokens), positions, models.init_cache(config, 2, 40),
        logits_at=jnp.asarray(lens - 1)[:, None],
    )  # fmt: skip
    want_logits, want_k = np.asarray(want.logits[:, 0]), np.asarray(want.cache.k)
    if kernel().multirow():
        np.testing.assert_array_equal(got, want_logits)
    else:
        np.testing.assert_allclose(got, want_logits, rtol=1e-5, atol=1e-5 * np.abs(want_logits).max())
    for r, n in enumerate(lengths):
        np.testing.assert_allclose(k[:, r, :n], want_k[:, r, :n], rtol=1e-5, atol=1e-5)
        chunk_end = (n + 15) // 16 * 16
        assert np.abs(want_k[:, r, n:chunk_end]).max() > 0  # the padding's keys, computed
        assert not k[:, r, n:chunk_end].any()  # skipped


def test_casting_to_gguf_q8_interleaves_q4k_matrices_but_not_the_embedding_table():
    """models.cast on a CPU: every Q4_K layer matrix interleaved for the kernel, the embedding
    (whose rows are looked up) as the file lays it out; the XLA path refuses an interleaved
    weight in one clear error rather than reading its bytes as rows."""
    model = models.cast(
        models.random_model(vocab_size=64, num_layers=1, d_model=256, num_heads=4, num_kv_heads=2), "gguf_q8"
    )
    layer = [w for w in jax.tree.leaves(model.params["layers"], is_leaf=is_block) if is_block(w)]
    assert layer and all(w.interleaved for w in layer if w.ggml_type == T.Q4_K.value)
    assert not model.params["embed"]["embedding"].interleaved
    with pytest.raises(ValueError, match="interleaved"):
        precision.dequantize(layer[0])
    with pytest.raises(ValueError, match="interleaved"):
        precision.linear(jnp.ones((1, 256)), layer[0], 1, model.config.replace(matmul_impl="xla"))


# -- 4. The XLA path (gguf_blocks) against the kernel -----------------------------------------


@pytest.mark.parametrize(
    "w_shape, contract",
    [
        ((45, 512), 1),  # Q4_K
        ((3, 15, 96), 1),  # Q5_0, two output axes (a q projection [heads, head_dim, D])
        ((20, 2, 48), 2),  # Q5_0, two input axes (an output projection [D, heads, head_dim])
    ],
)
def test_xla_path_agrees_with_the_kernel_at_gguf(w_shape, contract):
    kernel()
    rng = np.random.default_rng(8)
    weight = precision.quantize_blocks(rng.standard_normal(w_shape).astype(np.float32), contract)
    assert isinstance(weight, BlockWeight) and weight.shape == w_shape and not weight.quantize_x
    in_shape = w_shape[len(w_shape) - contract :]
    x = jnp.asarray(rng.standard_normal((2, 3, *in_shape)), jnp.float32)
    config = models.random_model(vocab_size=8, num_layers=1, d_model=32).config
    by_kernel = jax.jit(
        lambda x: precision.linear(x, weight, contract, config.replace(matmul_impl="cpu_kernel"))
    )
    assert gguf_matmul.MATMUL_TARGET in by_kernel.lower(x).as_text()
    by_xla = jax.jit(lambda x: precision.linear(x, weight, contract, config.replace(matmul_impl="xla")))
    assert gguf_matmul.MATMUL_TARGET not in by_xla.lower(x).as_text()
    got, want = np.asarray(by_xla(x)), np.asarray(by_kernel(x))
    assert got.shape == want.shape == (2, 3, *w_shape[: len(w_shape) - contract])
    k = math.prod(in_shape)
    x_mi = np.asarray(x).reshape(-1, k)
    w_oi = np.asarray(precision.dequantize(weight), np.float64).reshape(-1, k)
    bound = 2 * summation_bound(x_mi, w_oi)  # each side's rounding
    assert (np.abs(got - want).reshape(x_mi.shape[0], -1) <= bound).all()


@pytest.mark.parametrize("d", [64, 256], ids=["Q5_0", "Q4_K"])
def test_kernel_lookup_of_a_block_embedding_equals_gguf_blocks_rows(d):
    kernel()
    table = precision.quantize_blocks(np.random.default_rng(9).standard_normal((40, d)), 1)
    tokens = jnp.asarray([[3, 0, 39], [7, 7, 1]])
    lookup = jax.jit(lambda t: precision.lookup(table, t))
    assert gguf_matmul.ROWS_TARGET in lookup.lower(tokens).as_text()
    want = gguf_blocks.dequantize(table.data[tokens], table.ggml_type, d)
    np.testing.assert_array_equal(np.asarray(lookup(tokens)), np.asarray(want))


@pytest.mark.parametrize("ggml_type", [T.Q5_0, T.Q8_0], ids=["Q5_0", "Q8_0"])
def test_without_the_kernel_products_and_lookups_fall_back_to_gguf_blocks(ggml_type, monkeypatch):
    """Blocks from gguf-py's own quantizer and the kernel reported unavailable: nothing here
    needs the kernel's library."""
    monkeypatch.setattr(gguf_matmul, "available", lambda: False)
    rng = np.random.default_rng(10)
    w = rng.standard_normal((45, 96)).astype(np.float32)
    data = np.ascontiguousarray(quants.quantize(w, ggml_type)).view(np.uint8)
    weight = BlockWeight(data=jnp.asarray(data), ggml_type=ggml_type.value, in_shape=(96,))
    ref_w = quants.dequantize(data, ggml_type).astype(np.float64)
    x = rng.standard_normal((4, 96)).astype(np.float32)
    config = models.random_model(vocab_size=8, num_layers=1, d_model=32).config  # matmul_impl auto
    product = jax.jit(lambda x: precision.linear(x, weight, 1, config))
    assert gguf_matmul.MATMUL_TARGET not in product.lower(jnp.asarray(x)).as_text()
    y = np.asarray(product(jnp.asarray(x)))
    assert (np.abs(y - x.astype(np.float64) @ ref_w.T) <= summation_bound(x, ref_w)).all()
    tokens = jnp.asarray([[3, 0, 44], [7, 7, 1]])
    lookup = jax.jit(lambda t: precision.lookup(weight, t))
    assert gguf_matmul.ROWS_TARGET not in lookup.lower(tokens).as_text()
    np.testing.assert_array_equal(np.asarray(lookup(tokens)), ref_w[np.asarray(tokens)].astype(np.float32))


# -- 5. Greedy speculative decoding equals plain decoding -------------------------------------


@pytest.fixture(scope="module")
def float_pairs():
    """(target, draft) float32 pairs by block type of their cast: every matrix's input width is
    d_model, 3 d_model or heads x head_dim (head_dim 8 and 64)."""
    pairs = {}
    for name, d in (("Q5_0", 32), ("Q4_K", 256)):
        target = models.random_model(
            vocab_size=64, num_layers=2, d_model=d, num_heads=4, num_kv_heads=2, seed=0
        )
        pairs[name] = (target, perturbed(target, 0.1, seed=7))
    return pairs


def _layout(model, scan_layers: bool):
    if scan_layers:
        return model
    params = models.unstack_layers(model.params, model.config.num_layers)
    return model.replace(config=model.config.replace(scan_layers=False), params=params)


def _greedy(target, draft=None, gamma=1):
    return spec_jax.generate(
        target, PROMPTS, draft=draft, gamma=gamma, max_new_tokens=MAX_NEW, temperature=0.0
    )


# A covering set, not the full product (each case compiles three loops): both precisions on
# both block types, each impl, each layout, each gamma; gguf_q8 with the kernel on both types.
@pytest.mark.parametrize(
    "block_type, dtype, impl, scan_layers, gammas",
    [
        ("Q5_0", "gguf_q8", "auto", True, (1, 3)),
        ("Q5_0", "gguf", "xla", False, (1,)),
        ("Q4_K", "gguf_q8", "auto", False, (1, 3)),
        ("Q4_K", "gguf", "auto", True, (3,)),
    ],
)
def test_greedy_speculative_equals_autoregressive_at_gguf_precisions(
    float_pairs, block_type, dtype, impl, scan_layers, gammas
):
    target, draft = (models.cast(_layout(m, scan_layers), dtype) for m in float_pairs[block_type])
    target, draft = (m.replace(config=m.config.replace(matmul_impl=impl)) for m in (target, draft))
    leaves = jax.tree.leaves(target.params, is_leaf=is_block)
    assert {w.ggml_type for w in leaves if is_block(w)} == {T[block_type].value}
    tokens = jnp.asarray([PROMPTS[0]])
    lowered = jax.jit(models.forward, static_argnums=0).lower(
        target.config, target.params, tokens, jnp.arange(3)[None], models.init_cache(target.config, 1, 8)
    )
    assert (gguf_matmul.MATMUL_TARGET in lowered.as_text()) == (impl == "auto"), "auto means the kernel"
    plain = _greedy(target).tokens
    for gamma in gammas:
        spec = _greedy(target, draft, gamma)
        assert 0 < spec.stats["acceptance_rate"] < 1, "drafts must be accepted, and not all"
        assert spec.tokens == plain, (gamma, spec.tokens, plain)


# -- 6. Sampling at gguf_q8 keeps the target's distribution exactly ----------------------------


@pytest.fixture(scope="module")
def q8_pair():
    """test_distribution's vocabulary of 8, with d_model 32 (Q5_0 blocks), at gguf_q8."""
    kw = dict(vocab_size=V, num_layers=1, d_model=32, num_heads=2, num_kv_heads=1)
    target, draft = (models.cast(models.random_model(**kw, seed=s), "gguf_q8") for s in (3, 4))
    return target, draft, exact_joint(target, WARPS[0])


def test_speculative_sampling_at_gguf_q8_matches_target_distribution_exactly(q8_pair):
    target, draft, joint = q8_pair
    assert joint.shape == (V,) * HORIZON and np.isclose(joint.sum(), 1.0) and len(PROMPT) == 3
    counts, s = sample_counts(target, draft, WARPS[0], gamma=2, seed=0)
    assert 0.1 < s["acceptance_rate"] < 0.95, "draft and target must differ for the test to mean anything"
    assert chi2_pvalue(counts, joint) > 1e-3


@pytest.mark.slow  # the harness catching this rule: tests/test_distribution.py (float32), in make test
def test_a_broken_rule_that_always_accepts_fails_at_gguf_q8(q8_pair, monkeypatch):
    target, draft, joint = q8_pair

    def always_accept(drafts, q, p, key):
        n = jnp.full(drafts.shape[:1], drafts.shape[1], jnp.int32)
        return n, jnp.argmax(p[:, -1], -1).astype(jnp.int32)

    monkeypatch.setattr(rounds, "verify", always_accept)
    monkeypatch.setattr(executables, "_EXECUTABLES", {})  # the real rule's loops stay for the others
    counts, _ = sample_counts(target, draft, WARPS[0], gamma=2, seed=0)
    assert chi2_pvalue(counts, joint) < 1e-6


# -- 7. Bad input -------------------------------------------------------------------------------

ALLOWED = ("float32", "bfloat16", "int8", "gguf", "gguf_q8")


def test_an_unknown_precision_is_refused_naming_the_allowed_ones():
    model = models.random_model(vocab_size=64, num_layers=1, d_model=32, seed=0)
    for make in (lambda: models.cast(model, "gguf_q4"), lambda: models.load("random", dtype="gguf_q4")):
        with pytest.raises(ValueError, match="gguf_q4") as info:
            make()
        assert all(name in str(info.value) for name in ALLOWED), str(info.value)


def test_casting_a_model_whose_matrix_inputs_are_not_a_multiple_of_32_is_refused():
    model = models.random_model(vocab_size=64, num_layers=1, d_model=16, num_heads=2, num_kv_heads=1)
    for dtype in ("gguf", "gguf_q8"):
        with pytest.raises(ValueError, match="multiple of 32, got 16"):
            models.cast(model, dtype)


def test_cli_refuses_an_unknown_precision_in_one_line():
    result = run_cli("--target_dtype=gguf_q4")
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "--target_dtype" in lines[0] and all(name in lines[0] for name in ALLOWED), lines[0]


def test_the_cli_offers_the_precision_table_and_auto():
    from launch import generate

    for flag in ("target_dtype", "draft_dtype"):
        assert generate.FLAGS[flag].parser.enum_values == ["auto", *precision.PRECISIONS]
    assert precision.PRECISIONS == tuple(precision.TABLE) == ALLOWED
    assert precision.GGUF_PRECISIONS == ("gguf", "gguf_q8")


def test_no_entry_point_writes_its_own_list_of_the_precisions():
    """A precision is one entry of models.precision.TABLE: a tuple or list literal in launch/
    naming two or more of them would be a copy to keep in step."""
    root = pathlib.Path(__file__).resolve().parent.parent
    copies = []
    for path in sorted((root / "launch").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List)):
                names = {e.value for e in node.elts if isinstance(e, ast.Constant)} & set(
                    precision.PRECISIONS
                )
                if len(names) > 1 and not names <= {"float32", "bfloat16"}:  # torch's dtypes (peers)
                    copies.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not copies, f"lists of precisions outside models.precision.TABLE: {copies}"


# -- 8. A real GGUF: SmolLM2-135M in its own blocks -------------------------------------------

# The real SmolLM2 checks are slow-tier (`make test-slow`): the default suite has their tiny
# twins (tests/test_gguf_families.py: GGUF files in the real files' block types, logits against
# transformers; the greedy identity tests above) and one real-weights check of its own
# (tests/test_real_models.py: SmolLM2's prefill logits against transformers).
SMOLLM = "smollm2-135m"


@pytest.fixture(scope="module")
def smollm():
    """SmolLM2 at float32 (the converted checkpoint), gguf and gguf_q8 (scanned: compiles in
    seconds), and the GGUF file's type of each tensor by name."""
    loaded = {
        d: models.load(SMOLLM, dtype=d, progress=False, scan_layers=True)
        for d in ("float32", "gguf", "gguf_q8")
    }
    reader = open_gguf(registry.gguf_path(SMOLLM))  # parsing its metadata takes seconds: once
    return {**loaded, "file_types": {t.name: int(t.tensor_type) for t in reader.tensors}}


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["gguf", "gguf_q8"])
def test_real_gguf_loads_every_matrix_in_the_files_own_block_type(smollm, dtype):
    model, file_types = smollm[dtype], smollm["file_types"]
    leaves, _ = jax.tree_util.tree_flatten_with_path(model.params, is_leaf=is_block)
    seen = set()
    for path, leaf in leaves:
        w, stacked, _ = weights.entry(path)
        if not w.contract:
            assert not isinstance(leaf, BlockWeight) and leaf.dtype == jnp.float32, w.name
            continue
        assert isinstance(leaf, BlockWeight) and leaf.quantize_x == (dtype == "gguf_q8"), w.name
        names = [w.gguf.format(i=i) for i in range(model.config.num_layers)] if stacked else [w.gguf]
        assert {file_types[name] for name in names} == {leaf.ggml_type}, w.name
        seen.add(T(leaf.ggml_type).name)
    assert seen == {"Q4_1", "Q8_0"}  # the file's matrices and its (tied) embedding


@pytest.fixture(scope="module")
def smollm_prompt(smollm):
    return smollm["float32"].tokenizer.encode("def add(a, b):\n    return a + b\n\nprint(add(")


def _logits(model, prompt):
    tokens = jnp.asarray([prompt])
    cache = models.init_cache(model.config, 1, len(prompt))
    logits = apply(model, tokens, jnp.arange(len(prompt))[None], cache).logits
    return np.asarray(logits[0])


@pytest.mark.slow
def test_real_gguf_logits_equal_float32_up_to_summation_order(smollm, smollm_prompt):
    f32 = _logits(smollm["float32"], smollm_prompt)
    gguf = _logits(smollm["gguf"], smollm_prompt)
    assert np.abs(gguf - f32).max() < 1e-3  # 3e-5 measured, of logits up to ~40
    np.testing.assert_array_equal(gguf.argmax(-1), f32.argmax(-1))


@pytest.mark.slow
def test_real_gguf_q8_drafting_for_itself_decodes_greedily_like_plain_decoding(smollm, smollm_prompt):
    model = smollm["gguf_q8"]
    kw = dict(max_new_tokens=16, temperature=0.0)
    spec = spec_jax.generate(model, [smollm_prompt], draft=model, gamma=3, **kw)
    plain = spec_jax.generate(model, [smollm_prompt], **kw)
    assert spec.tokens == plain.tokens
    assert spec.stats["acceptance_rate"] == 1.0  # the same model: every draft is the target's token


def test_the_fastest_precision_is_gguf_q8_for_registry_models_where_the_gguf_kernel_runs(monkeypatch):
    """What --target_dtype=auto (launch.generate's default) means: the file's own blocks at 8-bit
    activations for a registry model on one CPU with the GGUF kernel (at larger batches only with
    its multi-row build); int8 for a random preset, at larger batches without the multi-row
    build (one ggml product per row), on a mesh, and where the kernel cannot be built (products
    would dequantize in XLA: many times slower)."""
    kernel()
    assert models.fastest_precision("qwen2.5-coder-1.5b") == "gguf_q8"
    assert models.fastest_precision("random") == "int8"
    for multirow, at_batch_4 in ((True, "gguf_q8"), (False, "int8")):
        monkeypatch.setattr(gguf_matmul, "multirow", lambda m=multirow: m)
        assert models.fastest_precision("qwen2.5-coder-1.5b", batch=4) == at_batch_4
        assert models.fastest_precision("qwen2.5-coder-1.5b") == "gguf_q8"
    assert models.fastest_precision("qwen2.5-coder-1.5b", devices=8) == "int8"  # XLA's path on a mesh
    monkeypatch.setattr(gguf_matmul, "available", lambda: False)
    assert models.fastest_precision("qwen2.5-coder-1.5b") == "int8"


def test_multirow_q6k_rows_are_ggml_vec_dots_bits_whatever_the_row_count():
    """The multi-row Q6_K kernel gives each row exactly the bits of ggml's own vec_dot (so a
    one-row call may run vec_dot and a verification call the multi-row kernel), for every row
    count 1..16 (groups of 8 and remainders) and rows of 1, 6 and 11 blocks (11: more than the
    10 blocks of 8 rows of x a span holds, so from 9 rows on the blocks go in two spans, Q6KRows)."""
    for k in (256, 1536, 2816):
        data, _ = blocks(T.Q6_K, 40, k, seed=16)
        x = np.random.default_rng(17).standard_normal((16, k)).astype(np.float32) * 3
        reference = matmul(x, data, T.Q6_K, quantize_x=True, ggml_dot=True)
        own = jax.jit(lambda x, data=data: kernel().matmul(x, jnp.asarray(data), T.Q6_K.value, True))
        for m in range(1, 17):
            np.testing.assert_array_equal(
                np.asarray(own(jnp.asarray(x[:m]))), reference[:m], err_msg=f"K {k}, {m} rows"
            )
