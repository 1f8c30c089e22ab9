"""Attention with a token tree's mask (models.kernels, `tree`): each node reads the committed text
and its own ancestors, at the position of its depth, whatever slot it sits in."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import kernels
from models.kernels import reference
from spec_jax import tree as tree_lib

# Two rows of different committed lengths; 7 nodes: two branches under the root and a deeper one.
PARENTS = [[-1, 0, 0, 1, -1, 4, 2], [-1, -1, 1, 2, 0, 4, 4]]
PREFIX = [5, 9]  # committed tokens in the cache before the tree (the root is the first query)


def tree_inputs(seed=0, h=4, kvh=2, d=16, cache=24, dtype=jnp.float32, parents=PARENTS, prefix=PREFIX):
    """q [B, T, H, D], k/v [B, cache, KVH, D], positions [B, T] (prefix + depth), kv_lengths,
    ancestor bits [B, T] for the root (query 0) plus the nodes of `parents` (query 1 + n; the
    7 of PARENTS by default), after `prefix` committed tokens per row."""
    parents = jnp.asarray(parents, jnp.int32)
    b, n = parents.shape
    t = n + 1
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), dtype)
    k = jnp.asarray(rng.standard_normal((b, cache, kvh, d)), dtype)
    v = jnp.asarray(rng.standard_normal((b, cache, kvh, d)), dtype)
    depth = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), tree_lib.depths(parents)], axis=1)
    prefix = jnp.asarray(prefix, jnp.int32)
    positions = prefix[:, None] + depth
    bits = tree_lib.query_bits(parents)
    return q, k, v, positions, prefix + t, bits, parents


def path_of(parents, b, node):
    """The slots (within the tree call, 0 = root) of node's ancestors and itself, root first."""
    path = [node]
    while path[-1] >= 0:
        path.append(int(parents[b][path[-1]]))
    return [0] + [1 + x for x in reversed(path[:-1])]


def test_the_chains_bits_are_the_causal_mask():
    q, k, v, _, _, _, _ = tree_inputs()
    b, t = q.shape[:2]
    kv_lengths = jnp.asarray(PREFIX) + t
    positions = jnp.asarray(PREFIX)[:, None] + jnp.arange(t)[None]
    chain_bits = tree_lib.query_bits(jnp.broadcast_to(jnp.arange(t - 1) - 1, (b, t - 1)))
    plain = reference.attention_reference(q, k, v, positions, kv_lengths)
    chained = reference.attention_reference(q, k, v, positions, kv_lengths, tree=chain_bits)
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(chained))


@pytest.mark.parametrize("window", [None, 3])
def test_each_node_attends_as_if_its_path_were_decoded_in_order(window):
    """Node x of row b equals the causal attention of its path laid out contiguously after the
    prefix: the keys of its ancestors moved to the slots of their depths."""
    q, k, v, positions, kv_lengths, bits, parents = tree_inputs()
    if window is not None:  # what the model does: the window folded into the tree's bits
        bits = bits & reference.tree_window_bits(positions, window)
    got = reference.attention_reference(q, k, v, positions, kv_lengths, window, bits)
    ref = jax.jit(reference.attention_reference, static_argnums=5)  # one program per path length
    for b, prefix in enumerate(PREFIX):
        for x in range(q.shape[1]):
            slots = path_of(PARENTS, b, x - 1) if x else [0]
            order = list(range(prefix)) + [prefix + s for s in slots]
            kb, vb = k[b : b + 1, jnp.asarray(order)], v[b : b + 1, jnp.asarray(order)]
            pos = jnp.asarray([[len(order) - 1]])
            want = ref(q[b : b + 1, x : x + 1], kb, vb, pos, jnp.asarray([len(order)]), window)
            np.testing.assert_allclose(np.asarray(got[b, x]), np.asarray(want[0, 0]), atol=1e-6, rtol=0)


def _cpu_attention():
    """models.kernels.attention with impl "cpu", jitted (window and tree traced)."""
    from models.kernels import cpu_matmul

    isa = cpu_matmul.isa()
    if not cpu_matmul.available(isa):
        pytest.skip(f"the CPU kernel library ({isa}) cannot be built here")
    fn = functools.partial(kernels.attention, impl="cpu", cpu_isa=isa)
    return jax.jit(lambda q, k, v, pos, lens, window, tree: fn(q, k, v, pos, lens, window=window, tree=tree))


def paths_laid_out(q, k, v):
    """Each node of tree_inputs decoded after its path laid out contiguously, as one batch of
    single queries: q [N, 1, H, D], k / v [N, S, KVH, D] (the prefix, then the path's keys in
    depth order), positions [N, 1] and kv_lengths [N] (N = B * T, row b's node x at b * T + x)."""
    qs, ks, vs, lengths = [], [], [], []
    for b, prefix in enumerate(PREFIX):
        for x in range(q.shape[1]):
            slots = path_of(PARENTS, b, x - 1) if x else [0]
            order = list(range(prefix)) + [prefix + s for s in slots]
            order += [0] * (k.shape[1] - len(order))  # padding past the length: never read
            qs.append(q[b, x : x + 1])
            ks.append(k[b, jnp.asarray(order)])
            vs.append(v[b, jnp.asarray(order)])
            lengths.append(prefix + len(slots))
    lengths = jnp.asarray(lengths, jnp.int32)
    return jnp.stack(qs), jnp.stack(ks), jnp.stack(vs), lengths[:, None] - 1, lengths


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("window", [None, 3])
def test_cpu_kernel_gives_each_node_the_bits_of_its_path_decoded_in_order(window, dtype):
    """The CPU kernel computes each query alone in one fixed order: a tree node's output is the
    same bits as the same query decoded after its path laid out contiguously (what a chain's
    verification row is to a decode step), and close to the reference."""
    attend = _cpu_attention()
    q, k, v, positions, kv_lengths, bits, _ = tree_inputs(dtype=dtype)
    if window is not None:
        bits = bits & reference.tree_window_bits(positions, window)
    w = None if window is None else jnp.int32(window)
    got = np.asarray(attend(q, k, v, positions, kv_lengths, w, bits))
    pq, pk, pv, ppos, plens = paths_laid_out(q, k, v)
    want = np.asarray(attend(pq, pk, pv, ppos, plens, w, None))
    np.testing.assert_array_equal(got, want.reshape(got.shape))
    ref = reference.attention_reference(q, k, v, positions, kv_lengths, window, bits)
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(got.astype(np.float32), np.asarray(ref, np.float32), atol=tol, rtol=0)


@pytest.mark.parametrize("window", [None, 3])
def test_cpu_kernel_on_a_chains_bits_is_the_causal_call_bit_for_bit(window):
    attend = _cpu_attention()
    q, k, v, _, _, _, _ = tree_inputs()
    b, t = q.shape[:2]
    kv_lengths = jnp.asarray(PREFIX) + t
    positions = jnp.asarray(PREFIX)[:, None] + jnp.arange(t)[None]
    chain_bits = tree_lib.query_bits(jnp.broadcast_to(jnp.arange(t - 1) - 1, (b, t - 1)))
    if window is not None:
        chain_bits = chain_bits & reference.tree_window_bits(positions, window)
    w = None if window is None else jnp.int32(window)
    plain = attend(q, k, v, positions, kv_lengths, w, None)
    chained = attend(q, k, v, positions, kv_lengths, w, chain_bits)
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(chained))


def more_parents(num_nodes, seed=0):
    """PARENTS grown to num_nodes nodes per row: each new node under a random earlier one (or the root)."""
    rng = np.random.default_rng(seed)
    rows = [list(row) for row in PARENTS]
    for row in rows:
        row += [int(rng.integers(-1, n)) for n in range(len(row), num_nodes)]
    return rows


def causal_bits(bits):
    """The broken variant: every earlier query visible, the chain's bits on a tree."""
    t = bits.shape[1]
    return jnp.broadcast_to((2 ** (jnp.arange(t) + 1) - 1).astype(jnp.int32), bits.shape)


def max_normalised_error(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return np.max(np.abs(got - want)) / np.max(np.abs(want))


# Each Pallas backend and window on the decoding kernel (T = 8: PARENTS and its root) and on
# flash_attention (T > DECODE_MAX_QUERIES, one T of 17..20 per case).
PALLAS_CASES = [
    (impl, window, t)
    for impl, window, big in [
        ("pallas_gpu", None, 17),
        ("pallas_gpu", 3, 18),
        ("pallas_tpu", None, 19),
        ("pallas_tpu", 3, 20),
    ]
    for t in (8, big)
]


@pytest.mark.parametrize("impl, window, t", PALLAS_CASES, ids=lambda x: str(x))
def test_pallas_kernels_give_each_node_the_references_attention(impl, window, t):
    """Interpret mode, ragged rows; the same program fed the chain's bits (siblings visible) fails
    the comparison."""
    assert (t > kernels.DECODE_MAX_QUERIES) == (t > 8)
    q, k, v, positions, kv_lengths, bits, _ = tree_inputs(d=64, parents=more_parents(t - 1))
    if window is not None:
        bits = bits & reference.tree_window_bits(positions, window)
    fn = functools.partial(kernels.attention, impl=impl, interpret=True)
    attend = jax.jit(lambda q, k, v, pos, lens, tree: fn(q, k, v, pos, lens, window=window, tree=tree))
    want = reference.attention_reference(q, k, v, positions, kv_lengths, window, bits)
    assert max_normalised_error(attend(q, k, v, positions, kv_lengths, bits), want) <= 2e-6
    broken = attend(q, k, v, positions, kv_lengths, causal_bits(bits))
    assert max_normalised_error(broken, want) > 1e-2


@pytest.mark.parametrize("window", [None, 1])
@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.parametrize("t", [8, 17], ids=["flash_decoding", "flash_attention"])
def test_pallas_kernels_read_the_blocks_of_the_tree_keys_and_skip_the_rest(t, backend, window):
    """Small key blocks, K/V outside the blocks a tree call needs hold NaN (a kernel that read them
    would give NaN): past kv_lengths, and before both the windows and the tree's first slot.
    Row 0's deepest node ends at a block boundary, so tree keys lie past every row's p + 1 (the
    causal rule's limit); in row 1 the root's slot is a block's last key and with window 1 every
    node's window starts past it (the window does not apply to the tree's keys: bits unfolded)."""
    from models.kernels import flash_attention, flash_decoding

    block_k = 16 if backend == "gpu" else 128
    if t == 8:
        fn = flash_decoding.flash_decoding
        blocks = flash_decoding.DecodeBlockSizes(block_k=block_k, num_splits=3 if backend == "gpu" else 2)
    else:
        fn = flash_attention.flash_attention
        blocks = flash_attention.FlashBlockSizes(16 if backend == "gpu" else 8, block_k)
    parents = more_parents(t - 1)
    deepest = int(tree_lib.depths(jnp.asarray(parents[:1])).max())
    prefix = [256 - deepest - 1, 127]
    q, k, v, positions, kv_lengths, bits, _ = tree_inputs(d=64, cache=400, parents=parents, prefix=prefix)
    assert int(positions[0].max()) + 1 == 256 < int(kv_lengths[0])
    first = np.asarray(prefix)
    start = first if window is not None else np.zeros_like(first)  # window 1: no committed key seen
    keys = np.arange(k.shape[1])[None, :]
    end = -(-np.asarray(kv_lengths) // block_k) * block_k
    poison = (keys < (start // block_k * block_k)[:, None]) | (keys >= end[:, None])
    assert poison.any(axis=1).all(), "every row must have a block to skip"
    poison = jnp.asarray(poison)[:, :, None, None]
    k_bad, v_bad = jnp.where(poison, jnp.nan, k), jnp.where(poison, jnp.nan, v)
    attend = jax.jit(
        functools.partial(fn, window=window, tree=bits, backend=backend, block_sizes=blocks, interpret=True)
    )
    got = attend(q, k_bad, v_bad, positions, kv_lengths)
    want = reference.attention_reference(q, k, v, positions, kv_lengths, window, bits)
    assert np.isfinite(np.asarray(got)).all()
    assert max_normalised_error(got, want) <= 2e-6


def test_a_mask_that_lets_siblings_through_fails_the_comparison():
    """The broken variant: every earlier query visible (the chain's mask on a tree)."""
    q, k, v, positions, kv_lengths, bits, _ = tree_inputs()
    right = reference.attention_reference(q, k, v, positions, kv_lengths, tree=bits)
    wrong = reference.attention_reference(q, k, v, positions, kv_lengths, tree=causal_bits(bits))
    assert np.abs(np.asarray(right) - np.asarray(wrong)).max() > 1e-2


def test_bits_are_each_nodes_ancestors_and_the_root():
    bits = np.asarray(tree_lib.query_bits(jnp.asarray(PARENTS, jnp.int32)))
    for b in range(2):
        for x in range(bits.shape[1]):
            seen = {j for j in range(bits.shape[1]) if bits[b, x] >> j & 1}
            assert seen == set(path_of(PARENTS, b, x - 1) if x else [0]), (b, x)


@pytest.mark.parametrize(
    "bad, message",
    [
        (jnp.zeros((2, 3), jnp.int32), "tree must be None or an integer [B, T] = [2, 8] array"),
        (jnp.zeros((2, 8), jnp.float32), "tree must be None or an integer"),
    ],
)
def test_a_bad_tree_is_a_value_error_naming_tree(bad, message):
    q, k, v, positions, kv_lengths, _, _ = tree_inputs()
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        kernels.attention(q, k, v, positions, kv_lengths, tree=bad, impl="xla")


def test_more_than_32_queries_is_refused():
    q = jnp.zeros((1, 33, 2, 8))
    k = jnp.zeros((1, 40, 2, 8))
    with pytest.raises(ValueError, match="at most 32 queries"):
        kernels.attention(
            q,
            k,
            k,
            jnp.zeros((1, 33), jnp.int32),
            jnp.asarray([40]),
            tree=jnp.zeros((1, 33), jnp.int32),
            impl="xla",
        )


def test_jit_of_the_tree_mask_equals_eager():
    q, k, v, positions, kv_lengths, bits, _ = tree_inputs()
    eager = reference.attention_reference(q, k, v, positions, kv_lengths, tree=bits)
    jitted = jax.jit(reference.attention_reference)(q, k, v, positions, kv_lengths, None, bits)
    np.testing.assert_allclose(np.asarray(eager), np.asarray(jitted), atol=1e-6)


def _decode_path_logits(model, prefix, path_tokens):
    """The logits after each token of prefix + path_tokens, fed in order through the cache."""
    from conftest import apply

    import models

    tokens = list(prefix) + list(path_tokens)
    cache = models.init_cache(model.config, 1, 32)
    out = apply(model, jnp.asarray([tokens]), jnp.arange(len(tokens))[None], cache)
    return np.asarray(out.logits[0])


# XLA's attention with scanned layers, and the CPU kernel with a window folded into the bits.
@pytest.mark.parametrize("layout", ["scanned", "windowed-cpu-kernel"])
def test_a_tree_forward_gives_each_node_the_logits_of_decoding_its_path(tiny_target, layout):
    """Two ragged rows: every node's logits equal those at the end of its path decoded in order,
    and the tree's keys land at contiguous slots from the root's."""
    from conftest import apply

    import models

    impl = "xla"
    if layout == "windowed-cpu-kernel":  # the CPU attention kernel (models.kernels impl "cpu")
        _cpu_attention()  # skips where the CPU kernel library cannot be built
        impl, layout = "cpu", "windowed"
    model = tiny_target.replace(config=tiny_target.config.replace(attention_impl=impl))
    if layout == "windowed":  # local layer 0 with a window shorter than the text, global layer 1
        model = model.replace(
            config=model.config.replace(family="gemma3", sliding_window=4, local_layers=(0,))
        )
    parents = jnp.asarray(PARENTS, jnp.int32)
    rng = np.random.default_rng(3)
    prefixes = [list(rng.integers(1, 64, size=n)) for n in PREFIX]
    nodes = rng.integers(1, 64, size=parents.shape)
    cache = models.init_cache(model.config, 2, 32)
    for b, prefix in enumerate(prefixes):  # the committed text, each row alone (ragged)
        one = models.init_cache(model.config, 1, 32)
        one = apply(model, jnp.asarray([prefix[:-1]]), jnp.arange(len(prefix) - 1)[None], one).cache
        cache = cache.replace(k=cache.k.at[:, b].set(one.k[:, 0]), v=cache.v.at[:, b].set(one.v[:, 0]))
    roots = jnp.asarray([p[-1] for p in prefixes])
    tokens = jnp.concatenate([roots[:, None], jnp.asarray(nodes, jnp.int32)], axis=1)
    depth = jnp.concatenate([jnp.zeros((2, 1), jnp.int32), tree_lib.depths(parents)], axis=1)
    root_slot = jnp.asarray(PREFIX) - 1
    out = apply_tree(model, tokens, root_slot[:, None] + depth, cache, tree_lib.query_bits(parents))
    for b, prefix in enumerate(prefixes):
        for x in range(tokens.shape[1]):
            path = path_of(PARENTS, b, x - 1)[1:] if x else []
            want = _decode_path_logits(model, prefix, [int(nodes[b, s - 1]) for s in path])[-1]
            np.testing.assert_allclose(
                np.asarray(out.logits[b, x]), want, atol=2e-5, rtol=0, err_msg=f"{b} {x}"
            )
    # The root's key and value are at its slot, where plain decoding would put them.
    plain = apply(model, roots[:, None], root_slot[:, None], cache)
    np.testing.assert_allclose(
        np.asarray(out.cache.k[:, jnp.arange(2), root_slot]),
        np.asarray(plain.cache.k[:, jnp.arange(2), root_slot]),
        atol=1e-6,
    )


def apply_tree(model, tokens, positions, cache, bits):
    import models

    fn = jax.jit(lambda params, t, pos, c, bits: models.forward(model.config, params, t, pos, c, tree=bits))
    return fn(model.params, tokens, positions, cache, bits)
