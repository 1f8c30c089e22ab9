"""Weight precision: float32, bfloat16 or int8 weights, and the one matrix product every layer uses.

A model's precision is `ModelConfig.dtype`:
  float32   float32 weights and activations (the converted checkpoint as it is);
  bfloat16  bfloat16 weights and activations, products accumulated in float32;
  int8      int8 matrices (every weight of the table with `contract` > 0: projections, MLP,
            embedding and head) with one float32 scale per output unit (symmetric, absmax / 127,
            round half to even), float32 activations; norms and biases stay float32.
`cast_params` turns float32 parameters into a precision (once, when a model is loaded or
made). `linear` is the product of activations with a weight of any precision; on a CPU it runs
the kernel of models/kernels/cpu_matmul.cc (one pass over the weight for all the rows of a
call, int8 / bfloat16 widened in registers), elsewhere XLA's dot (an int8 weight is widened
in the graph, which a TPU or GPU compiler fuses into the product).
"""

import math

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

PRECISIONS = ("float32", "bfloat16", "int8")
MATMUL_IMPLS = ("auto", "xla", "cpu_kernel")


@flax.struct.dataclass
class Int8Weight:
    """A weight [out..., in...] as int8 values and one float32 scale per output unit."""

    value: jax.Array  # int8, the weight's shape
    scale: jax.Array  # float32, the weight's output dimensions (all but the contracted ones)

    @property
    def shape(self):
        return self.value.shape

    @property
    def dtype(self):
        return self.value.dtype


def quantize_int8(w: np.ndarray, contract: int) -> Int8Weight:
    """Symmetric per-output-unit int8 of a float weight whose last `contract` axes are its input."""
    w = np.asarray(w, np.float32)
    out_shape = w.shape[: w.ndim - contract]
    rows = w.reshape(math.prod(out_shape), -1)
    scale = np.maximum(np.abs(rows).max(axis=1), np.finfo(np.float32).tiny) / 127.0
    value = np.clip(np.rint(rows / scale[:, None]), -127, 127).astype(np.int8)
    return Int8Weight(value=value.reshape(w.shape), scale=scale.astype(np.float32).reshape(out_shape))


def dequantize(w) -> jax.Array:
    """A float32 copy of an Int8Weight (tests and reports); other weights as they are."""
    if not isinstance(w, Int8Weight):
        return w
    scale = w.scale.reshape(w.scale.shape + (1,) * (w.value.ndim - w.scale.ndim))
    return w.value.astype(jnp.float32) * scale


def cast_params(params, config, to_device=None):
    """float32 parameters (host or device arrays) in the precision `config.dtype`.

    Matrices become Int8Weight for int8; everything else float32 (bfloat16 for bfloat16). One
    leaf at a time, each passed through `to_device` (e.g. jax.device_put) when given, so a host
    copy of the whole model is never held twice.
    """
    from models import weights

    if config.dtype not in PRECISIONS:
        raise ValueError(f"dtype must be one of {PRECISIONS}, got {config.dtype!r}")
    put = to_device or (lambda x: x)

    def one(path, leaf):
        w, _, _ = weights.entry(path)
        if config.dtype == "int8" and w.contract:
            q = quantize_int8(np.asarray(leaf), w.contract)
            return Int8Weight(value=put(q.value), scale=put(q.scale))
        dtype = jnp.bfloat16 if config.dtype == "bfloat16" else jnp.float32
        return put(np.asarray(leaf).astype(dtype, copy=False))

    return jax.tree_util.tree_map_with_path(one, params)


def resolve_matmul_impl(impl: str) -> str:
    """The implementation "auto" means here: the CPU kernel when tracing for a CPU device
    (models.kernels.target.current(): a compile-only TPU or GPU device traced from a CPU host
    gets XLA) where the kernel builds, else "xla". ValueError on a bad name, or for
    "cpu_kernel" where the kernel cannot be built (the reason was warned)."""
    from models.kernels import cpu_matmul, target

    if impl not in MATMUL_IMPLS:
        raise ValueError(f"matmul impl must be one of {MATMUL_IMPLS}, got {impl!r}")
    if impl == "auto":
        return "cpu_kernel" if target.current().platform == "cpu" and cpu_matmul.available() else "xla"
    if impl == "cpu_kernel" and not cpu_matmul.available():
        raise ValueError("matmul impl cpu_kernel is unavailable here (see the warning); use auto or xla")
    return impl


def linear(x, w, contract: int, impl: str = "auto"):
    """x [..., in...] times a weight [out..., in...] (the last `contract` axes of w, matching the
    last `contract` axes of x) -> [..., out...], in x's dtype (float32 accumulation)."""
    w_shape = w.shape
    out_shape, in_shape = w_shape[: len(w_shape) - contract], w_shape[len(w_shape) - contract :]
    if tuple(x.shape[x.ndim - contract :]) != tuple(in_shape):
        raise ValueError(f"linear: x {x.shape} does not end with the weight's input axes {in_shape}")
    lead = x.shape[: x.ndim - contract]
    x_mk = x.reshape(math.prod(lead), math.prod(in_shape))
    value = w.value if isinstance(w, Int8Weight) else w
    w_nk = value.reshape(math.prod(out_shape), math.prod(in_shape))
    scale = w.scale.reshape(-1) if isinstance(w, Int8Weight) else None
    if resolve_matmul_impl(impl) == "cpu_kernel":
        from models.kernels import cpu_matmul

        y = cpu_matmul.matmul(x_mk, w_nk, scale)
    else:
        compute = jnp.bfloat16 if w_nk.dtype == jnp.bfloat16 else jnp.float32
        y = jnp.einsum(
            "mk,nk->mn", x_mk.astype(compute), w_nk.astype(compute), preferred_element_type=jnp.float32
        )
        if scale is not None:
            y = y * scale
    return y.reshape(*lead, *out_shape).astype(x.dtype)


def lookup(table, tokens):
    """Rows of an embedding table [V, D] (any precision) at integer tokens [...]: [..., D]."""
    if isinstance(table, Int8Weight):
        return table.value[tokens].astype(jnp.float32) * table.scale[tokens][..., None]
    return jnp.take(table, tokens, axis=0)
