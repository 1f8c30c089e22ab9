"""The model's CPU kernels follow the platform a program is lowered for, not the host's backend.

forward is exported from this CPU host for cuda and tpu with default settings (matmul_impl auto):
the module must hold none of the CPU kernels' custom calls (their targets, spec_jax_*, have no
compatibility guarantee, so jax.export refuses to serialize them, and no GPU or TPU runs them).
Lowered for the CPU, the same program still runs on the CPU kernels.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from models import precision
from models.kernels import cpu_matmul, gguf_matmul
from spec_jax import decode

# The GGUF precisions dequantize in XLA off the CPU (a tiny model's matrices are Q5_0 blocks:
# nothing is interleaved for the CPU kernel, which only that kernel can read).
PRECISIONS = ("float32", "bfloat16", "int8", "gguf", "gguf_q8")
CPU_TARGET = "spec_jax_"  # the prefix of every CPU kernel's ffi target (cpu_matmul, gguf_matmul)


@functools.cache
def tiny(dtype: str, scan_layers: bool = True) -> models.Model:
    model = models.random_model(
        vocab_size=64, num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, scan_layers=scan_layers
    )
    return model if dtype == "float32" else models.cast(model, dtype)


def forward_args(config, batch=2, width=4, slots=8):
    tokens = jnp.arange(batch * width, dtype=jnp.int32).reshape(batch, width) % config.vocab_size
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
    return tokens, positions, models.init_cache(config, batch, slots)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("dtype", PRECISIONS)
def test_forward_exported_for_an_accelerator_from_the_cpu_holds_no_cpu_kernel_call(dtype, platform):
    model = tiny(dtype)
    assert model.config.matmul_impl == "auto" and model.config.attention_impl == "auto"
    fn = jax.jit(functools.partial(models.forward, model.config))
    with precision.portable_lowering():
        exported = jax.export.export(fn, platforms=[platform])(model.params, *forward_args(model.config))
    assert CPU_TARGET not in exported.mlir_module()
    assert exported.platforms == (platform,)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_prefill_exported_for_an_accelerator_from_the_cpu_is_one_call_without_cpu_kernels(platform):
    """decode.prefill reads the prompts row by row only where it runs on the CPU kernels: for
    an accelerator it is one model call over the batch (layers unrolled: no loop at all)."""
    model = tiny("int8", scan_layers=False)
    tokens, _, _ = forward_args(model.config, width=16)
    lens = jnp.asarray([16, 5], jnp.int32)
    fn = jax.jit(lambda p, t, n: decode.prefill(model.config, p, t, n, 32).logits)
    with precision.portable_lowering():
        exported = jax.export.export(fn, platforms=[platform])(model.params, tokens, lens)
    text = exported.mlir_module()
    assert CPU_TARGET not in text and "stablehlo.while" not in text
    on_cpu = fn.lower(model.params, tokens, lens).as_text()
    assert cpu_matmul.target_name("int8", model.config.cpu_isa) in on_cpu and "stablehlo.while" in on_cpu


@pytest.mark.parametrize("dtype", PRECISIONS)
def test_forward_on_the_cpu_still_runs_on_the_cpu_kernels_with_their_numbers(dtype):
    """Lowered for the CPU: the kernels' custom calls, no conditional left in the compiled
    program, and the logits of a forward whose every product is the kernel's (matmul_impl
    cpu_kernel) bit for bit; XLA's products (matmul_impl xla) agree to rounding."""
    model = tiny(dtype)
    assert cpu_matmul.available(model.config.cpu_isa)
    args = (model.params, *forward_args(model.config))
    fn = jax.jit(functools.partial(models.forward, model.config))
    lowered = fn.lower(*args)
    if dtype in ("gguf", "gguf_q8"):
        assert gguf_matmul.available() and gguf_matmul.MATMUL_TARGET in lowered.as_text()
    else:
        assert cpu_matmul.target_name(jnp.dtype(dtype).name, model.config.cpu_isa) in lowered.as_text()
    assert cpu_matmul.rowwise_target("attention", model.config.cpu_isa) in lowered.as_text()
    assert "conditional" not in lowered.compile().as_text()
    got = np.asarray(fn(*args).logits)
    kernel = models.forward(model.config.replace(matmul_impl="cpu_kernel"), *args).logits
    np.testing.assert_array_equal(got, np.asarray(kernel))
    xla = models.forward(model.config.replace(matmul_impl="xla"), *args).logits
    np.testing.assert_allclose(got, np.asarray(xla), rtol=2e-2, atol=2e-2 * np.abs(got).max())


def test_the_cpu_kernel_build_is_part_of_the_model_config():
    """The ISA is a field of the config (so of every compiled program's key), chosen when the
    config is made: a config of the other build compiles the other build's calls."""
    model = tiny("int8")
    assert model.config.cpu_isa == cpu_matmul.isa()
    for isa in cpu_matmul.ISAS:
        config = model.config.replace(cpu_isa=isa)
        text = (
            jax.jit(functools.partial(models.forward, config))
            .lower(model.params, *forward_args(config))
            .as_text()
        )
        assert cpu_matmul.target_name("int8", isa) in text
        assert hash(config) != hash(model.config) or isa == model.config.cpu_isa
    with pytest.raises(ValueError, match="cpu_isa must be one of avx2, avx512"):
        model.config.replace(cpu_isa="sse9")


def test_without_portable_lowering_the_program_is_traced_for_the_device_it_runs_on():
    """The contract's other side: outside portable_lowering the platform is decided while
    tracing, for the device traced for (here the CPU), so an export for a TPU then carries the
    CPU kernels' calls (jax refuses to serialize them) and the CPU program has no other branch."""
    model = tiny("int8")
    fn = jax.jit(functools.partial(models.forward, model.config))
    try:
        text = jax.export.export(fn, platforms=["tpu"])(
            model.params, *forward_args(model.config)
        ).mlir_module()
    except Exception as e:  # noqa: BLE001 - what jax raises for an unserializable custom call
        text = str(e)
    assert CPU_TARGET in text
