"""The interleaved Q6_K kernel (gguf_matmul.cc's Q6Kx8: 8 weight rows a group, one unpacking of
each block for up to 8 rows of x): every row of every call has the bits of ggml's own vec_dot on
the file's layout, so a verify call over gamma + 1 positions gives each position what a decode
step gives it, and the layout moves the file's bits without changing them.

The kernel builds on first use (the tests fail where it cannot: CI has compilers); the layout
needs its multi-row build (AVX-512 VNNI), without which these tests skip.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import models
from models import convert, host_memory, precision, transformer
from models.kernels import gguf_matmul

Q6K = T.Q6_K.value


@pytest.fixture(scope="module")
def kernel():
    assert gguf_matmul.available(), "the GGUF block kernel did not build (see the warning)"
    if not gguf_matmul.multirow():
        pytest.skip("this CPU has no multi-row build (AVX-512 VNNI): Q6_K stays in the file's layout")
    return gguf_matmul


def q6k_rows(kernel, n: int, k: int, seed: int) -> np.ndarray:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    return kernel.quantize(w, Q6K)


def product(kernel, data, interleaved=False, ggml_dot=False, live=None):
    return jax.jit(
        lambda x, live=None: kernel.matmul(
            x, jnp.asarray(data), Q6K, True, ggml_dot=ggml_dot, interleaved=interleaved, live=live
        )
    )


@pytest.mark.parametrize("k", [256, 1536, 2816])  # 1, 6 and 11 blocks a row
def test_interleaved_q6k_rows_are_ggml_vec_dots_bits_at_every_row_count(kernel, k):
    """Rows 1..16 of x: one group of rows up to 8, then a group of 8 and a remainder (9, 11, 13
    are no multiple of the 8 rows a group or of the 4 lanes a pass), each row exactly ggml's
    vec_dot of the file's layout (ggml_dot), for 40 weight rows (5 groups of 8 columns)."""
    data = q6k_rows(kernel, 40, k, seed=1)
    x = np.random.default_rng(2).standard_normal((16, k)).astype(np.float32) * 3
    reference = np.asarray(product(kernel, data, ggml_dot=True)(jnp.asarray(x)))
    own = product(kernel, kernel.interleave_q6k(data), interleaved=True)
    for m in range(1, 17):
        np.testing.assert_array_equal(np.asarray(own(jnp.asarray(x[:m]))), reference[:m], err_msg=f"{m} rows")


def test_the_comparison_sees_a_wrong_layout(kernel):
    """The check above can fail: the file's own rows read as Q6Kx8 (no interleave), or groups
    of 8 rows interleaved in the wrong order, give other numbers."""
    data = q6k_rows(kernel, 16, 512, seed=3)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((3, 512)).astype(np.float32))
    reference = np.asarray(product(kernel, data, ggml_dot=True)(x))
    swapped = kernel.interleave_q6k(np.concatenate([data[8:], data[:8]]))
    for wrong in (data, swapped):
        assert not np.array_equal(np.asarray(product(kernel, wrong, interleaved=True)(x)), reference)


def test_interleave_q6k_moves_the_bits_and_back(kernel):
    data = q6k_rows(kernel, 24, 768, seed=5)
    packed = kernel.interleave_q6k(data)
    assert packed.shape == data.shape and packed.dtype == np.uint8
    assert not np.array_equal(packed, data)
    np.testing.assert_array_equal(kernel.interleave_q6k(packed, back=True), data)
    assert sorted(np.unpackbits(packed).tolist()) == sorted(np.unpackbits(data).tolist())


@pytest.mark.parametrize("shape", [(12, 210), (8, 200), (8,)])
def test_interleave_q6k_refuses_other_shapes_in_one_line(kernel, shape):
    with pytest.raises(
        ValueError, match=r"interleave_q6k: Q6_K rows \[N, row_bytes\] with N a multiple of 8"
    ):
        kernel.interleave_q6k(np.zeros(shape, np.uint8))


def test_no_ggml_product_reads_interleaved_q6k(kernel):
    data = kernel.interleave_q6k(q6k_rows(kernel, 8, 256, seed=6))
    x = jnp.ones((1, 256), jnp.float32)
    with pytest.raises(Exception, match="interleaved Q6_K has rows a multiple of 8 and no ggml product"):
        np.asarray(product(kernel, data, interleaved=True, ggml_dot=True)(x))


@pytest.mark.parametrize("live", [0, 1, 5, 9, 16])
def test_rows_past_live_are_zero_and_the_live_rows_keep_their_bits(kernel, live):
    data = kernel.interleave_q6k(q6k_rows(kernel, 24, 768, seed=7))
    x = jnp.asarray(np.random.default_rng(8).standard_normal((16, 768)).astype(np.float32))
    call = product(kernel, data, interleaved=True)
    full = np.asarray(call(x))
    part = np.asarray(call(x, jnp.int32(live)))
    np.testing.assert_array_equal(part[:live], full[:live])
    assert not part[live:].any()


def test_rows_of_x_quantized_on_several_threads_keep_their_bits(kernel):
    """24 rows of K 2816 (67K values: quantized on XLA's threads) against the same rows 3 at a
    time (quantized on the calling thread)."""
    data = kernel.interleave_q6k(q6k_rows(kernel, 64, 2816, seed=9))
    x = np.random.default_rng(10).standard_normal((24, 2816)).astype(np.float32) * 3
    call = product(kernel, data, interleaved=True)
    together = np.asarray(call(jnp.asarray(x)))
    apart = np.concatenate([np.asarray(call(jnp.asarray(x[i : i + 3]))) for i in range(0, 24, 3)])
    np.testing.assert_array_equal(together, apart)


def test_the_q6k_layout_setting(monkeypatch, kernel):
    """$SPEC_JAX_GGUF_Q6K: unset or "interleaved" takes Q6Kx8 where the kernel's own products
    run one-row calls too (one_row_own), "rows" keeps the file's layout (the path before it),
    anything else is one clear error."""
    monkeypatch.delenv(gguf_matmul.Q6K_ENV, raising=False)
    assert gguf_matmul.interleave_q6k_pays() == gguf_matmul.one_row_own()
    monkeypatch.setenv(gguf_matmul.Q6K_ENV, "interleaved")
    assert gguf_matmul.interleave_q6k_pays() == gguf_matmul.one_row_own()
    monkeypatch.setenv(gguf_matmul.Q6K_ENV, "rows")
    assert not gguf_matmul.interleave_q6k_pays()
    monkeypatch.setenv(gguf_matmul.Q6K_ENV, "fast")
    with pytest.raises(
        ValueError, match=r"\$SPEC_JAX_GGUF_Q6K must be one of interleaved, rows \(or unset\), got 'fast'"
    ):
        gguf_matmul.interleave_q6k_pays()


def test_the_q4k_kernels_prefetching_changes_no_bit(kernel):
    """gguf_matmul.prefetch_q4k (the interleaved Q4_K kernel asking for its blocks ahead, or not,
    as before it did; benchmarks time both): every row of 1..8 the same bits either way."""
    data = jnp.asarray(
        kernel.interleave_q4k(
            kernel.quantize(
                np.random.default_rng(11).standard_normal((264, 1536)).astype(np.float32), T.Q4_K.value
            )
        )
    )
    x = np.random.default_rng(12).standard_normal((8, 1536)).astype(np.float32)
    call = jax.jit(lambda x: kernel.matmul(x, data, T.Q4_K.value, True, interleaved=True))
    try:
        for m in range(1, 9):
            kernel.prefetch_q4k(False)
            before = np.asarray(call(jnp.asarray(x[:m])))
            kernel.prefetch_q4k(True)
            np.testing.assert_array_equal(np.asarray(call(jnp.asarray(x[:m]))), before, err_msg=f"{m} rows")
    finally:
        kernel.prefetch_q4k(True)


def _q6k_layout(params, interleaved: bool):
    """params with every Q6_K matrix at 8-bit activations (rows a multiple of 8) in Q6Kx8 or in
    the file's rows, moved with interleave_q6k."""

    def move(w):
        if not isinstance(w, precision.BlockWeight) or w.ggml_type != Q6K or not w.quantize_x:
            return w
        rows = np.asarray(w.data).reshape(-1, w.data.shape[-1])
        if rows.shape[0] % 8 or w.interleaved == interleaved:
            return w
        data = gguf_matmul.interleave_q6k(rows, back=not interleaved).reshape(w.data.shape)
        return w.replace(data=jnp.asarray(data), interleaved=interleaved)

    return jax.tree.map(move, params, is_leaf=lambda x: isinstance(x, precision.BlockWeight))


@pytest.mark.slow
def test_the_qwen_targets_logits_are_the_same_bits_in_either_q6k_layout(kernel):
    """The Qwen2.5-Coder-1.5B at gguf_q8 (its lm head, 14 down and 14 v projections are Q6_K): a
    verify call over 5 positions after a 4-token prefill gives the same logits with the Q6_K
    matrices in the file's rows and in Q6Kx8, and each position the logits of its decode step."""
    model = models.load("qwen2.5-coder-1.5b", dtype="gguf_q8", progress=False)
    call = jax.jit(lambda p, t, pos, c: transformer.forward(model.config, p, t, pos, c))
    prompt, drafts = jnp.array([[9707, 11, 1879, 0]]), jnp.array([[151643, 220, 16, 17, 18]])
    logits = {}
    for interleaved in (False, True):
        params = _q6k_layout(model.params, interleaved)
        moved = [w for w in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, precision.BlockWeight))]
        assert sum(
            isinstance(w, precision.BlockWeight) and w.interleaved and w.ggml_type == Q6K for w in moved
        ) == (29 if interleaved else 0)
        cache = call(params, prompt, jnp.arange(4)[None], transformer.init_cache(model.config, 1, 64)).cache
        verify = np.asarray(call(params, drafts, 4 + jnp.arange(5)[None], cache).logits)[0]
        steps = []
        for i in range(5):
            out = call(params, drafts[:, i : i + 1], jnp.array([[4 + i]]), cache)
            cache = out.cache
            steps.append(np.asarray(out.logits)[0, 0])
        np.testing.assert_array_equal(verify, np.stack(steps))
        logits[interleaved] = verify
    np.testing.assert_array_equal(logits[True], logits[False])


def test_take_rows_reads_an_interleaved_q6k_head_back_into_rows_and_refuses_an_interleaved_q4k(kernel):
    """A trimmed vocabulary or a trained head's token ids take rows of the output head
    (precision.take_rows): from a Q6_K head in the kernel's layout, the file's rows, not the
    interleaved bytes at those offsets (a group of 8 rows holds each other's values)."""
    rows = q6k_rows(kernel, 16, 256, seed=5)
    head = precision.BlockWeight(jnp.asarray(rows), T.Q6_K.value, (256,), quantize_x=True)
    packed = head.replace(data=jnp.asarray(gguf_matmul.interleave_q6k(rows)), interleaved=True)
    ids = jnp.asarray([0, 3, 8, 15], jnp.int32)
    taken = precision.take_rows(packed, ids)
    assert not taken.interleaved
    np.testing.assert_array_equal(np.asarray(taken.data), rows[np.asarray(ids)])
    assert not np.array_equal(
        np.asarray(packed.data)[np.asarray(ids)], rows[np.asarray(ids)]
    )  # the naive take
    q4k = head.replace(ggml_type=T.Q4_K.value, interleaved=True)
    with pytest.raises(ValueError, match="Q4_K weight interleaved"):
        precision.take_rows(q4k, ids)


def test_a_load_writes_each_interleaved_layout_once_onto_huge_pages(kernel):
    """precision.for_cpu_kernel (every GGUF load at gguf_q8 on this CPU) interleaves a Q4_K and a
    Q6_K matrix of a few huge pages straight into huge-page memory: the bits of interleaving
    into a new array, and models.convert.to_device then places it where it is, with no copy
    (a second buffer of fresh memory cost about 3 s per GB of the server's start)."""
    for ggml_type, k in ((T.Q4_K.value, 2048), (Q6K, 1536)):
        w = np.random.default_rng(ggml_type).standard_normal((4096, k)).astype(np.float32)
        data = kernel.quantize(w, ggml_type)
        assert data.nbytes > 2 * host_memory.HUGE_PAGE
        block = precision.BlockWeight(data=data, ggml_type=ggml_type, in_shape=(k,), quantize_x=True)
        packed = precision.for_cpu_kernel(block)
        assert packed.interleaved
        interleave = kernel.interleave_q6k if ggml_type == Q6K else kernel.interleave_q4k
        np.testing.assert_array_equal(packed.data, interleave(data))
        assert isinstance(host_memory.bases(packed.data)[-1], host_memory._HugePages)
        placed = convert.to_device([packed.data], jax.tree.structure(0))
        assert placed.unsafe_buffer_pointer() == packed.data.ctypes.data  # in place, not copied


def test_an_interleave_into_a_wrong_buffer_is_refused(kernel):
    data = q6k_rows(kernel, 8, 256, seed=6)
    for out in (np.empty((8, 209), np.uint8), np.empty(data.shape, np.int8), data):
        with pytest.raises(ValueError, match="out: "):
            kernel.interleave_q6k(data, out=out)
