"""Weight precision: int8 quantization, the CPU matmul kernel, and exactness per precision."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import apply, perturbed

import models
import spec_jax
from models import precision, weights
from models.kernels import cpu_matmul
from spec_jax import sharding

PROMPTS = [[5, 9, 2], [1], [7, 7, 3, 8, 11, 4, 6, 2, 9, 10]]
MAX_NEW = 13
# Both builds of the kernel, each skipped where this CPU lacks its instructions.
ISAS = [
    pytest.param(
        isa,
        marks=pytest.mark.skipif(
            cpu_matmul.cpu_supported(isa) is not None, reason=str(cpu_matmul.cpu_supported(isa))
        ),
    )
    for isa in cpu_matmul.ISAS
]
# precision.linear's products by XLA's dot (a config's matmul_impl picks them).
XLA = models.ModelConfig(
    vocab_size=8,
    num_layers=1,
    d_model=8,
    num_heads=1,
    num_kv_heads=1,
    head_dim=8,
    mlp_dim=8,
    matmul_impl="xla",
)


def test_int8_quantization_is_symmetric_per_output_unit_and_within_half_a_step():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 4, 10)).astype(np.float32)  # [heads, E, D]: contract 1
    w[2, 1] *= 100.0  # one unit with a large range must not coarsen the others
    q = precision.quantize_int8(w, contract=1)
    assert q.value.dtype == np.int8 and q.value.shape == w.shape and q.scale.shape == (6, 4)
    np.testing.assert_allclose(q.scale, np.abs(w).max(axis=-1) / 127.0, rtol=1e-6)
    assert np.abs(q.value).max() == 127
    err = np.abs(np.asarray(precision.dequantize(q)) - w)
    assert (err <= q.scale[..., None] / 2 + 1e-6).all()
    assert err[0].max() < np.abs(w[0]).max() / 200  # untouched by the large unit


def test_cast_params_covers_every_matrix_of_the_weight_table():
    model = models.cast(models.random_model(vocab_size=64, num_layers=2, d_model=32, seed=0), "int8")
    for path, leaf in jax.tree_util.tree_flatten_with_path(model.params)[0]:
        w, _, field = weights.entry(path)
        if w.contract:
            assert field in ("value", "scale"), w.name
            assert leaf.dtype == (jnp.int8 if field == "value" else jnp.float32), w.name
        else:
            assert field is None and leaf.dtype == jnp.float32, w.name
    assert jax.tree.structure(weights.logical_axes(model.params)) is not None  # every leaf has axes


def test_cast_refuses_a_model_that_is_not_float32():
    model = models.random_model(vocab_size=64, num_layers=1, d_model=32, dtype="bfloat16")
    with pytest.raises(ValueError, match="must be float32"):
        models.cast(model, "int8")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize(
    "n, k",
    [
        (45, 37),  # partial blocks and tiles of weight rows, a k tail (not a multiple of 8 or 16)
        (31, 2011),  # the same with longer rows, prefetched ahead across tiles
        (5, 1029),  # fewer weight rows than a tile of any pass
    ],
)
def test_cpu_kernel_matches_xla_and_each_row_is_bit_identical_whatever_the_row_count(isa, dtype, n, k):
    assert cpu_matmul.available(isa)
    rng = np.random.default_rng(1)
    w = rng.standard_normal((n, k)).astype(np.float32)
    weight = precision.quantize_int8(w, 1) if dtype == "int8" else jnp.asarray(w, dtype)
    value, scale = (weight.value, weight.scale) if dtype == "int8" else (weight, None)
    rows = 24  # every pass shape of both builds, and calls of several passes
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
    kernel = jax.jit(lambda x: cpu_matmul.matmul(x, value, scale, isa))
    assert cpu_matmul.target_name(dtype, isa) in kernel.lower(x).as_text()
    reference = jnp.asarray(precision.dequantize(weight), jnp.float32)  # float32 products of the same weights
    all_rows = np.asarray(kernel(x))
    np.testing.assert_allclose(
        all_rows, precision.linear(x, reference, 1, XLA), rtol=2e-5, atol=5e-5 * k**0.5
    )
    for m in range(1, rows):  # a decode call (1 row) and verify calls (m rows) agree bitwise
        np.testing.assert_array_equal(np.asarray(kernel(x[:m])), all_rows[:m])
        np.testing.assert_array_equal(np.asarray(kernel(x[m : m + 1]))[0], all_rows[m])
    # live (a prefill's last chunk): the rows before it keep their bits, the rest are 0, not computed
    with_live = jax.jit(lambda x, n: cpu_matmul.matmul(x, value, scale, isa, live=n))
    assert np.abs(all_rows).max(axis=1).min() > 0  # no row is 0 by itself
    for live in (0, 1, 7, rows):
        got = np.asarray(with_live(x, live))
        np.testing.assert_array_equal(got[:live], all_rows[:live])
        assert not got[live:].any()


def test_the_kernel_build_is_chosen_from_the_cpu_or_the_environment(monkeypatch):
    monkeypatch.setattr(cpu_matmul, "_cpu_flags", lambda: frozenset({"avx2", "fma", "sse2"}))
    monkeypatch.delenv(cpu_matmul.ISA_ENV, raising=False)
    assert cpu_matmul.isa() == "avx2" and cpu_matmul.cpu_supported() is None
    assert "avx512f" in cpu_matmul.cpu_supported("avx512")  # forced where it cannot run: the reason
    monkeypatch.setattr(cpu_matmul, "_cpu_flags", lambda: frozenset(cpu_matmul.ISAS["avx512"][0]))
    assert cpu_matmul.isa() == "avx512"
    monkeypatch.setenv(cpu_matmul.ISA_ENV, "avx2")
    assert cpu_matmul.isa() == "avx2" and cpu_matmul.library_path().name.startswith("cpu_matmul-avx2-")
    made = models.ModelConfig(**XLA.portable())  # a config made now takes it (a saved one holds none)
    assert made.cpu_isa == "avx2" and "cpu_isa" not in XLA.portable()
    monkeypatch.setenv(cpu_matmul.ISA_ENV, "avx512")
    assert made.replace(dtype="int8").cpu_isa == "avx2"  # and keeps it: it is in the compiled key
    monkeypatch.setenv(cpu_matmul.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="SPEC_JAX_CPU_ISA must be one of avx2, avx512"):
        cpu_matmul.isa()


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_precision_drift_from_float32_is_small_on_a_random_model(dtype):
    f32 = models.random_model(vocab_size=64, num_layers=2, d_model=32, seed=0)
    low = models.cast(f32, dtype)
    tokens = jnp.asarray([PROMPTS[2]])
    positions = jnp.arange(tokens.shape[1])[None]
    cache = models.init_cache(f32.config, 1, 16)
    ref = apply(f32, tokens, positions, cache).logits
    out = apply(low, tokens, positions, models.init_cache(low.config, 1, 16)).logits
    drift = float(jnp.abs(out.astype(jnp.float32) - ref).max() / jnp.abs(ref).max())
    assert 0 < drift < 0.05  # changed (the precision is real), but close


@pytest.fixture(scope="module")
def pair_f32():
    target = models.random_model(vocab_size=64, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, seed=0)
    return target, perturbed(target, 0.1, seed=7)


def _greedy(target, draft=None):
    return spec_jax.generate(
        target, PROMPTS, draft=draft, gamma=3, max_new_tokens=MAX_NEW, temperature=0.0
    ).tokens


# float32 with the default impl is tests/test_speculative.py's case; int8 with the kernel is the
# next test's, once per build of the kernel.
@pytest.mark.parametrize("dtype, impl", [("bfloat16", "auto"), ("int8", "xla"), ("float32", "xla")])
def test_greedy_speculative_equals_autoregressive_at_each_precision(pair_f32, dtype, impl):
    target, draft = (models.cast(m, dtype) if dtype != "float32" else m for m in pair_f32)
    target, draft = (m.replace(config=m.config.replace(matmul_impl=impl)) for m in (target, draft))
    assert _greedy(target, draft) == _greedy(target), (dtype, impl)


@pytest.mark.parametrize("kernel_isa", ISAS)
def test_greedy_speculative_equals_autoregressive_at_int8_on_each_build_of_the_kernel(pair_f32, kernel_isa):
    target, draft = (models.cast(m, "int8") for m in pair_f32)
    kernel = dict(matmul_impl="cpu_kernel", cpu_isa=kernel_isa)
    target, draft = (m.replace(config=m.config.replace(**kernel)) for m in (target, draft))
    tokens = jnp.asarray([PROMPTS[0]])
    lowered = jax.jit(models.forward, static_argnums=0).lower(
        target.config, target.params, tokens, jnp.arange(3)[None], models.init_cache(target.config, 1, 8)
    )
    assert cpu_matmul.target_name("int8", kernel_isa) in lowered.as_text()  # the build asked for
    assert _greedy(target, draft) == _greedy(target)


def test_quantizing_only_the_draft_never_changes_the_output(pair_f32):
    target, draft = pair_f32
    assert _greedy(target, models.cast(draft, "int8")) == _greedy(target)


def test_the_cpu_kernel_is_refused_on_a_multi_device_mesh_and_auto_means_xla_there():
    config = models.random_model(vocab_size=64, num_layers=1, d_model=32).config
    mesh = sharding.default_mesh()
    assert sharding.for_mesh(config, mesh) is config

    class TwoDevices:  # for_mesh reads the mesh's device count only
        devices = np.zeros(2)

    assert sharding.for_mesh(config, TwoDevices()).matmul_impl == "xla"
    with pytest.raises(ValueError, match="matmul_impl: cpu_kernel runs on one device"):
        sharding.for_mesh(config.replace(matmul_impl="cpu_kernel"), TwoDevices())


def _verify_minus_steps(model) -> float:
    """max |logits of one call over 3 positions - logits of 3 one-position calls| after a prefill."""
    f = jax.jit(models.forward, static_argnums=0)
    tokens, prefix = [5, 17, 33, 2, 9, 41, 7], 4
    cache = models.init_cache(model.config, 1, 32)
    cache = f(
        model.config, model.params, jnp.asarray([tokens[:prefix]]), jnp.arange(prefix)[None], cache
    ).cache
    steps, step_cache = [], cache
    for i in range(3):
        pos = prefix + i
        out = f(model.config, model.params, jnp.asarray([[tokens[pos]]]), jnp.asarray([[pos]]), step_cache)
        logits, step_cache = out.logits, out.cache
        steps.append(logits[0, 0])
    verify = f(
        model.config,
        model.params,
        jnp.asarray([tokens[prefix : prefix + 3]]),
        jnp.arange(prefix, prefix + 3)[None],
        cache,
    ).logits
    return float(jnp.abs(verify[0] - jnp.stack(steps)).max())


@pytest.mark.parametrize("dtype", ["int8", "bfloat16"])
def test_a_verify_call_equals_decode_steps_bit_for_bit_on_the_cpu_kernels(dtype):
    """With the products in the CPU kernel, attention and RMSNorm run there too (each row alone),
    so a call over several positions gives each position the bits of its decode step. XLA's
    reference attention and norm (the broken case) do not, with heads 128 wide."""
    f32 = models.random_model(
        vocab_size=128,
        num_layers=2,
        d_model=256,
        num_heads=2,
        num_kv_heads=2,
        head_dim=128,
        scan_layers=False,
    )
    model = models.cast(f32, dtype)
    assert models.transformer.attention_impl(model.config) == "cpu"
    assert _verify_minus_steps(model) == 0.0
    if dtype == "int8":  # (at bfloat16 the suite's XLA flags happen to compile XLA's path alike)
        xla = model.replace(config=model.config.replace(attention_impl="xla"))
        assert _verify_minus_steps(xla) > 0.0
