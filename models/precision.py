"""Weight precision: float32, bfloat16 or int8 weights, and the one matrix product every layer uses.

A model's precision is `ModelConfig.dtype`:
  float32   float32 weights and activations (the converted checkpoint as it is);
  bfloat16  bfloat16 weights and activations, products accumulated in float32;
  int8      int8 matrices (every weight of the table with `contract` > 0: projections, MLP,
            embedding and head) with one float32 scale per output unit (symmetric, absmax / 127,
            round half to even), float32 activations; norms and biases stay float32.
  gguf      the checkpoint's own GGUF blocks (Q4_K, Q5_0, Q6_K, Q8_0, ... as the file ships each
            matrix; a BlockWeight), dequantized in the product with ggml's reference
            dequantization and multiplied with float32 activations: the numbers HF and
            llama.cpp's reference dequantization give, at the file's size.
  gguf_q8   the same blocks, with each row of activations quantized to 8 bits per block (ggml's
            Q8_K / Q8_0, the weight type's vec_dot_type) and integer dot products: how llama.cpp
            runs a GGUF on a CPU. The fastest on a CPU.
models.weights.cast_params turns float32 parameters into a precision (once, when a model is
loaded or made), with this module's quantizers. `linear` is the product of activations with a weight of any precision; on a CPU it runs
the kernel of models/kernels/cpu_matmul.cc (one pass over the weight for all the rows of a
call, int8 / bfloat16 widened in registers), elsewhere XLA's dot (an int8 weight is widened
in the graph, which a TPU or GPU compiler fuses into the product).
"""

import math

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

PRECISIONS = ("float32", "bfloat16", "int8", "gguf", "gguf_q8")
GGUF_PRECISIONS = ("gguf", "gguf_q8")
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


@flax.struct.dataclass
class BlockWeight:
    """A weight [out..., in...] kept as GGUF blocks: each output unit's row of `in` values is a
    row of blocks of ggml type `ggml_type` (gguf.GGMLQuantizationType), row_bytes bytes.
    quantize_x: products quantize the activations to 8 bits (precision gguf_q8) or not (gguf).
    interleaved: Q4_K rows in groups of 8 with their blocks interleaved (llama.cpp's CPU repack;
    for_cpu_kernel): only the CPU kernel reads them."""

    data: jax.Array  # uint8 [out..., row_bytes]
    ggml_type: int = flax.struct.field(pytree_node=False)
    in_shape: tuple = flax.struct.field(pytree_node=False)  # the contracted (input) axes
    quantize_x: bool = flax.struct.field(pytree_node=False, default=False)
    interleaved: bool = flax.struct.field(pytree_node=False, default=False)

    @property
    def shape(self):
        return tuple(self.data.shape[:-1]) + tuple(self.in_shape)

    @property
    def dtype(self):
        return self.data.dtype


def default_block_type(k: int) -> int:
    """The block format models.weights.cast_params gives a matrix with k inputs: Q4_K (256-value blocks, as
    the pair's files hold most matrices) where k allows it, else Q5_0 (32-value blocks)."""
    from gguf import GGMLQuantizationType as T

    if k % 256 == 0:
        return T.Q4_K.value
    if k % 32 == 0:
        return T.Q5_0.value
    raise ValueError(f"a GGUF precision needs matrices whose inputs are a multiple of 32, got {k}")


def quantize_blocks(
    w: np.ndarray, contract: int, ggml_type: int | None = None, quantize_x: bool = False
) -> BlockWeight:
    """A float weight [out..., in...] (last `contract` axes its input) in a GGUF block format
    (default: default_block_type), quantized with ggml's own quantizer."""
    from models.kernels import gguf_matmul

    w = np.asarray(w, np.float32)
    out_shape, in_shape = w.shape[: w.ndim - contract], w.shape[w.ndim - contract :]
    k = math.prod(in_shape)
    ggml_type = default_block_type(k) if ggml_type is None else ggml_type
    data = gguf_matmul.quantize(w.reshape(-1, k), ggml_type)
    return BlockWeight(
        data=data.reshape(*out_shape, -1),
        ggml_type=int(ggml_type),
        in_shape=tuple(in_shape),
        quantize_x=quantize_x,
    )


def for_cpu_kernel(w: BlockWeight, table: bool = False) -> BlockWeight:
    """w as the CPU kernel multiplies it fastest: a Q4_K matrix at gguf_q8 (8-bit activations)
    with a multiple of 8 output rows gets its blocks interleaved in groups of 8 rows
    (gguf_matmul.interleave_q4k, the layout llama.cpp's CPU backend repacks Q4_K into), read by
    ggml's repacked product: measured 1.3-1.8x this project's own Q4_K kernel at 1-16 rows on an
    AVX-512 CPU (docs/design.md). Everything else, an embedding table (table: its rows are
    looked up), or where the products do not run on this CPU's kernel: w unchanged. Host arrays."""
    from gguf import GGMLQuantizationType as T

    from models.kernels import gguf_matmul, target

    rows = math.prod(w.data.shape[:-1])
    if table or w.interleaved or not w.quantize_x or w.ggml_type != T.Q4_K.value or rows % 8:
        return w
    if target.current().platform != "cpu" or not gguf_matmul.available():
        return w
    data = gguf_matmul.interleave_q4k(np.asarray(w.data).reshape(rows, -1))
    return w.replace(data=data.reshape(w.data.shape), interleaved=True)


def quantize_int8(w: np.ndarray, contract: int) -> Int8Weight:
    """Symmetric per-output-unit int8 of a float weight whose last `contract` axes are its input."""
    w = np.asarray(w, np.float32)
    out_shape = w.shape[: w.ndim - contract]
    rows = w.reshape(math.prod(out_shape), -1)
    scale = np.maximum(np.abs(rows).max(axis=1), np.finfo(np.float32).tiny) / 127.0
    value = np.clip(np.rint(rows / scale[:, None]), -127, 127).astype(np.int8)
    return Int8Weight(value=value.reshape(w.shape), scale=scale.astype(np.float32).reshape(out_shape))


def dequantize(w) -> jax.Array:
    """A float32 copy of an Int8Weight or a BlockWeight (tests and reports); other weights as they are."""
    if isinstance(w, BlockWeight):
        from models.kernels import gguf_blocks

        _no_interleaved(w)
        k = math.prod(w.in_shape)
        return gguf_blocks.dequantize(w.data, w.ggml_type, k).reshape(w.shape)
    if not isinstance(w, Int8Weight):
        return w
    scale = w.scale.reshape(w.scale.shape + (1,) * (w.value.ndim - w.scale.ndim))
    return w.value.astype(jnp.float32) * scale


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


def linear(x, w, contract: int, impl: str = "auto", bulk: bool = False):
    """x [..., in...] times a weight [out..., in...] (the last `contract` axes of w, matching the
    last `contract` axes of x) -> [..., out...], in x's dtype (float32 accumulation). bulk: a
    many-row path may be taken whose rows differ in the last bits from a one-row call's
    (ModelConfig.bulk_products; prefill only)."""
    w_shape = w.shape
    out_shape, in_shape = w_shape[: len(w_shape) - contract], w_shape[len(w_shape) - contract :]
    if tuple(x.shape[x.ndim - contract :]) != tuple(in_shape):
        raise ValueError(f"linear: x {x.shape} does not end with the weight's input axes {in_shape}")
    lead = x.shape[: x.ndim - contract]
    x_mi = x.reshape(math.prod(lead), math.prod(in_shape))
    if isinstance(w, BlockWeight):
        y = _block_product(x_mi, w, impl, bulk)
        return y.reshape(*lead, *out_shape).astype(x.dtype)
    value = w.value if isinstance(w, Int8Weight) else w
    w_oi = value.reshape(math.prod(out_shape), math.prod(in_shape))
    scale = w.scale.reshape(-1) if isinstance(w, Int8Weight) else None
    if resolve_matmul_impl(impl) == "cpu_kernel":
        from models.kernels import cpu_matmul

        y = cpu_matmul.matmul(x_mi, w_oi, scale)
    else:
        compute = jnp.bfloat16 if w_oi.dtype == jnp.bfloat16 else jnp.float32
        y = jnp.einsum(
            "mi,oi->mo", x_mi.astype(compute), w_oi.astype(compute), preferred_element_type=jnp.float32
        )
        if scale is not None:
            y = y * scale
    return y.reshape(*lead, *out_shape).astype(x.dtype)


def _block_product(x_mi, w: BlockWeight, impl: str, bulk: bool = False):
    """x [M, I] . W^T -> [M, O] float32 for a BlockWeight: ggml's CPU kernel (float32 or 8-bit
    activations, as the weight's precision says) where the CPU kernels run, else XLA's dot on
    the blocks dequantized in the graph (float32 activations)."""
    data_oy = w.data.reshape(-1, w.data.shape[-1])
    if resolve_matmul_impl(impl) == "cpu_kernel":
        from models.kernels import gguf_matmul

        if gguf_matmul.available():
            return gguf_matmul.matmul(
                x_mi, data_oy, w.ggml_type, quantize_x=w.quantize_x, interleaved=w.interleaved, bulk=bulk
            )
    _no_interleaved(w)
    from models.kernels import gguf_blocks

    w_oi = gguf_blocks.dequantize(data_oy, w.ggml_type, x_mi.shape[1])
    return jnp.einsum("mi,oi->mo", x_mi.astype(jnp.float32), w_oi, preferred_element_type=jnp.float32)


def _no_interleaved(w: BlockWeight):
    if w.interleaved:
        raise ValueError(
            "a Q4_K weight interleaved for the CPU kernel (precision.for_cpu_kernel) is read by that "
            "kernel only: load the model for this device (models.load on it) instead"
        )


def lookup(table, tokens):
    """Rows of an embedding table [V, D] (any precision) at integer tokens [...]: [..., D]."""
    if isinstance(table, BlockWeight):
        _no_interleaved(table)
        from models.kernels import gguf_matmul, target

        k = math.prod(table.in_shape)
        if target.current().platform == "cpu" and gguf_matmul.available():
            return gguf_matmul.rows(tokens, table.data, table.ggml_type, k)
        from models.kernels import gguf_blocks

        return gguf_blocks.dequantize(table.data[tokens], table.ggml_type, k)
    if isinstance(table, Int8Weight):
        return table.value[tokens].astype(jnp.float32) * table.scale[tokens][..., None]
    return jnp.take(table, tokens, axis=0)
