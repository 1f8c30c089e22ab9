"""Weight precision: float32, bfloat16 or int8 weights, and the one matrix product every layer uses.

A model's precision is `ModelConfig.dtype`, the name of one entry of TABLE (a Precision: its
activations' dtype and how its matrices are held), which every entry point reads:
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
loaded or made) with its entry's Precision.matrix (this module's quantizers). `linear` is the
product of activations with a weight of any precision; in a program lowered for a CPU it runs the kernel of models/kernels/cpu_matmul.cc (one pass over the weight
for all the rows of a call, int8 / bfloat16 widened in registers), in one lowered for anything
else XLA's dot (an int8 weight is widened in the graph, which a TPU or GPU compiler fuses into
the product): `cpu_kernels(config)` and `on_cpu`.
"""

import contextlib
import contextvars
import dataclasses
import math

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType

from models.host_memory import huge_page_empty
from models.kernels import cpu_matmul, gguf_blocks, gguf_matmul, target

MATMUL_IMPLS = ("auto", "xla", "cpu_kernel")

# What `auto` (models.auto_precision) decides from. Where a model's weights come from: "gguf" (a
# registry model or a GGUF file: GGUF blocks), "folder" (a checkpoint folder or hub id: float
# tensors of one stored dtype), "random" (a random preset: no checkpoint).
SOURCE_KINDS = ("gguf", "folder", "random")
AUTO_PLATFORMS = ("cpu", "gpu", "tpu")
# Platforms whose products read GGUF blocks fast: ggml's CPU kernels (models.kernels.gguf_matmul).
# On a TPU or GPU a block weight is dequantized by XLA in every step (no Pallas block kernel).
FAST_BLOCK_PLATFORMS = ("cpu",)
# A checkpoint folder's stored dtype -> the precision that holds its numbers exactly.
FAITHFUL = {"bfloat16": "bfloat16", "float32": "float32", "float16": "float32"}


@dataclasses.dataclass(frozen=True)
class AutoPrecision:
    """What `auto` means for one model here: `precision` (one of PRECISIONS) and `note`, one line
    for the entry point to print at start-up where the choice is not the checkpoint's own
    numbers ("" where it is, or where there is no checkpoint)."""

    precision: str
    note: str = ""


def choose_auto(
    platform: str,
    kind: str,
    stored: str | None = None,
    *,
    batch: int = 1,
    devices: int = 1,
    gguf_kernel: bool = False,
    gguf_multirow: bool = False,
    flag: str = "dtype",
) -> AutoPrecision:
    """The precision `auto` means on `platform` (AUTO_PLATFORMS) for weights of `kind`
    (SOURCE_KINDS); stored: a folder's stored dtype (FAITHFUL's keys; None: unknown); flag: how
    the note names the setting (an entry point's flag, e.g. --target_dtype).

    TPU and GPU: the checkpoint's own numbers. A folder runs at the precision that holds its
    stored dtype (bfloat16 for bfloat16, float32 for float32 and float16), bfloat16 where it is
    unknown; a GGUF runs at its own blocks (gguf) where FAST_BLOCK_PLATFORMS has a fast block
    product, else at bfloat16 (its blocks dequantized once, at load), said in the note; a random
    preset at bfloat16. int8 is always `dtype=int8` away.
    CPU (one device): the fastest, as measured (models.fastest_precision's docstring): gguf_q8
    for a GGUF where the GGUF kernel builds (gguf_kernel), at batch 1 or with its multi-row build
    (gguf_multirow); else int8, with a note for a folder naming the faithful precision. A mesh of
    several CPU devices: int8."""
    if platform not in AUTO_PLATFORMS:
        raise ValueError(f"platform must be one of {AUTO_PLATFORMS}, got {platform!r}")
    if kind not in SOURCE_KINDS:
        raise ValueError(f"kind must be one of {SOURCE_KINDS}, got {kind!r}")
    faithful = FAITHFUL.get(stored, "bfloat16")
    if platform != "cpu":
        if kind == "folder":
            known = stored in FAITHFUL
            note = (
                ""
                if known
                else f"{flag}=auto: bfloat16 (the checkpoint's stored dtype is {stored or 'not known here'})"
            )
            return AutoPrecision(faithful, note)
        if kind == "gguf" and platform in FAST_BLOCK_PLATFORMS:
            return AutoPrecision("gguf")
        if kind == "gguf":
            return AutoPrecision(
                "bfloat16",
                f"{flag}=auto: bfloat16, the GGUF's blocks dequantized at load (a {platform.upper()} has no "
                f"fast GGUF block product); {flag}=gguf for the blocks themselves, {flag}=int8 for int8",
            )
        return AutoPrecision("bfloat16")
    if kind == "gguf" and devices == 1 and gguf_kernel and (batch == 1 or gguf_multirow):
        return AutoPrecision("gguf_q8")
    if kind == "folder":
        return AutoPrecision(
            "int8",
            f"{flag}=auto: int8 weights, the fastest on this CPU; {flag}={faithful} for the "
            f"checkpoint's own numbers (stored as {stored or 'an unknown dtype'})",
        )
    return AutoPrecision("int8")


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
    interleaved: Q4_K rows in groups of 8 (ggml's block_q4_Kx8, llama.cpp's CPU repack) or Q6_K
    rows in the kernel's Q6Kx8 (gguf_matmul.interleave_q6k); for_cpu_kernel: only the CPU
    kernel reads them."""

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


@dataclasses.dataclass(frozen=True)
class Precision:
    """One precision (an entry of TABLE): what a model at it holds and computes in.

    activations: the dtype of activations, the KV cache and every weight that is not a matrix
      (norms, biases); a matrix too where `matrices` is "float".
    matrices: how a matrix (a weight of models.weights' table with `contract` > 0) is held:
      "float" (an array of `activations`), "int8" (Int8Weight, quantize_int8) or "blocks"
      (BlockWeight: GGUF blocks, read from a GGUF file as it ships them, or quantized with
      ggml's quantizer in default_block_type).
    quantize_x: "blocks" only: the products quantize the activations to 8 bits (BlockWeight's).
    """

    activations: str = "float32"
    matrices: str = "float"
    quantize_x: bool = False

    @property
    def dtype(self) -> jnp.dtype:
        return jnp.dtype(self.activations)

    @property
    def from_gguf(self) -> bool:
        """Whether its matrices are a GGUF file's own blocks (it needs a GGUF source to load)."""
        return self.matrices == "blocks"

    def matrix(self, w: np.ndarray, contract: int, table: bool = False):
        """A float32 matrix [out..., in...] (last `contract` axes its input; table: an embedding
        table, whose rows are looked up) at this precision, on the host."""
        if self.matrices == "int8":
            return quantize_int8(w, contract)
        if self.matrices == "blocks":
            return for_cpu_kernel(quantize_blocks(w, contract, quantize_x=self.quantize_x), table=table)
        return np.asarray(w).astype(self.dtype, copy=False)

    def matrix_shape(self, shape: tuple[int, ...], contract: int):
        """What `matrix` gives for a matrix of `shape`, as jax.ShapeDtypeStruct leaves."""
        out, inputs = shape[: len(shape) - contract], shape[len(shape) - contract :]
        if self.matrices == "int8":
            return Int8Weight(jax.ShapeDtypeStruct(shape, jnp.int8), jax.ShapeDtypeStruct(out, jnp.float32))
        if self.matrices == "blocks":
            k = math.prod(inputs)
            kind = default_block_type(k)
            data = jax.ShapeDtypeStruct((*out, gguf_matmul.row_bytes(kind, k)), jnp.uint8)
            return BlockWeight(data, kind, tuple(inputs), self.quantize_x)
        return jax.ShapeDtypeStruct(shape, self.dtype)


# The precisions (ModelConfig.dtype, models.load's dtype, the entry points' --target_dtype and
# --draft_dtype), one entry each: see the module docstring.
TABLE = {
    "float32": Precision(),
    "bfloat16": Precision(activations="bfloat16"),
    "int8": Precision(matrices="int8"),
    "gguf": Precision(matrices="blocks"),
    "gguf_q8": Precision(matrices="blocks", quantize_x=True),
}
PRECISIONS = tuple(TABLE)
GGUF_PRECISIONS = tuple(name for name, p in TABLE.items() if p.from_gguf)


def of(name: str) -> Precision:
    """The TABLE entry of precision `name`; ValueError naming PRECISIONS for any other."""
    if name not in TABLE:
        raise ValueError(f"dtype must be one of {', '.join(PRECISIONS)}, got {name!r}")
    return TABLE[name]


def default_block_type(k: int) -> int:
    """The block format models.weights.cast_params gives a matrix with k inputs: Q4_K (256-value blocks, as
    the pair's files hold most matrices) where k allows it, else Q5_0 (32-value blocks)."""
    if k % 256 == 0:
        return GGMLQuantizationType.Q4_K.value
    if k % 32 == 0:
        return GGMLQuantizationType.Q5_0.value
    raise ValueError(f"a GGUF precision needs matrices whose inputs are a multiple of 32, got {k}")


def quantize_blocks(
    w: np.ndarray, contract: int, ggml_type: int | None = None, quantize_x: bool = False
) -> BlockWeight:
    """A float weight [out..., in...] (last `contract` axes its input) in a GGUF block format
    (default: default_block_type), quantized with ggml's own quantizer."""
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
    rows = math.prod(w.data.shape[:-1])
    kinds = (gguf_matmul.Q4K, gguf_matmul.Q6K)
    if table or w.interleaved or not w.quantize_x or w.ggml_type not in kinds or rows % 8:
        return w
    if target.current().platform != "cpu" or not gguf_matmul.available():
        return w
    host = np.asarray(w.data).reshape(rows, -1)
    if w.ggml_type == gguf_matmul.Q6K and not gguf_matmul.interleave_q6k_pays():
        return w
    out = huge_page_empty(host.shape, np.uint8)  # written once, where models.convert places it
    if w.ggml_type == gguf_matmul.Q6K:
        data = gguf_matmul.interleave_q6k(host, out=out)
    else:
        data = gguf_matmul.interleave_q4k(host, out=out)
    return w.replace(data=data.reshape(w.data.shape), interleaved=True)


def take_rows(weight, ids):
    """The output rows `ids` (int32 [N]) of a weight (an array, an Int8Weight or a BlockWeight:
    each leaf's rows): a Q6_K BlockWeight in the kernel's interleaved layout is read back into
    the file's rows first (its groups of 8 rows hold each other's values); an interleaved Q4_K
    one is a ValueError (no way back to rows is built)."""
    if isinstance(weight, BlockWeight) and weight.interleaved:
        if weight.ggml_type != gguf_matmul.Q6K:
            raise ValueError(
                "take_rows: a Q4_K weight interleaved for the CPU kernel has no row layout to take from"
            )
        rows = math.prod(weight.data.shape[:-1])
        host = gguf_matmul.interleave_q6k(np.asarray(weight.data).reshape(rows, -1), back=True)
        weight = weight.replace(data=jnp.asarray(host.reshape(weight.data.shape)), interleaved=False)
    return jax.tree.map(lambda a: a[ids], weight)


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
        _no_interleaved(w)
        k = math.prod(w.in_shape)
        return gguf_blocks.dequantize(w.data, w.ggml_type, k).reshape(w.shape)
    if not isinstance(w, Int8Weight):
        return w
    scale = w.scale.reshape(w.scale.shape + (1,) * (w.value.ndim - w.scale.ndim))
    return w.value.astype(jnp.float32) * scale


def cpu_kernels(config) -> bool:
    """Whether config's products have a CPU kernel path: matmul_impl "cpu_kernel", or "auto" where
    the CPU kernel library of config.cpu_isa builds on this machine (cpu_matmul.available: built
    and checked once per process). That path is taken only where a program is lowered for a CPU
    (on_cpu); lowered for a TPU or GPU the products are XLA's whatever this says. ValueError for
    "cpu_kernel" where the kernel cannot be built (the reason was warned)."""
    return has_cpu_kernels(config.matmul_impl, config.cpu_isa)


def has_cpu_kernels(matmul_impl: str, cpu_isa: str) -> bool:
    """cpu_kernels for a matmul_impl and a build of the CPU kernels (cpu_matmul.ISAS), before
    there is a config (an entry point's flags); ValueError on a bad matmul_impl too."""
    if matmul_impl not in MATMUL_IMPLS:
        raise ValueError(f"matmul impl must be one of {MATMUL_IMPLS}, got {matmul_impl!r}")
    if matmul_impl == "xla":
        return False
    available = cpu_matmul.available(cpu_isa)
    if matmul_impl == "cpu_kernel" and not available:
        raise ValueError("matmul impl cpu_kernel is unavailable here (see the warning); use auto or xla")
    return available


_PORTABLE = contextvars.ContextVar("spec_jax_portable_lowering", default=False)


@contextlib.contextmanager
def portable_lowering():
    """Within it, programs are traced for any platform (on_cpu stages both branches): wrap
    jax.export (or a lowering for a platform other than the one being traced for) in it, so a
    program exported for a TPU or GPU from a CPU host holds no CPU kernel call."""
    token = _PORTABLE.set(True)
    try:
        yield
    finally:
        _PORTABLE.reset(token)


def on_cpu(cpu, default, *args):
    """cpu(*args) in a program lowered for a CPU, default(*args) in one lowered for anything else.

    The platform is decided while tracing where it is known: the device traced for
    (models.kernels.target.current(): the abstract mesh's, jax.default_device, else the default
    backend's) is a CPU, or is not. Tracing one branch instead of both shortens a CPU-kernel
    model's tracing (a tiny pair's first generate: 2.76 -> 2.33 s). Within portable_lowering
    (jax.export for other platforms) both are traced (jax.lax.platform_dependent) and only the
    lowered platform's is compiled."""
    if not _PORTABLE.get():
        return cpu(*args) if target.current().platform == "cpu" else default(*args)
    return jax.lax.platform_dependent(*args, cpu=cpu, default=default)


def linear(x, w, contract: int, config, live=None):
    """x [..., in...] times a weight [out..., in...] (the last `contract` axes of w, matching the
    last `contract` axes of x) -> [..., out...], in x's dtype (float32 accumulation). config (a
    models.config.ModelConfig, static) picks the product: its matmul_impl and cpu_isa (cpu_kernels;
    the CPU kernel only where the program is lowered for a CPU), and bulk_products: a many-row
    path may be taken whose rows differ in the last bits from a one-row call's (prefill only).
    live: optional int32 scalar (may be traced): the rows of x's leading axes (flattened) from
    it on are padding: the CPU kernels (cpu_kernels) skip them, their outputs 0; XLA's product
    computes them. Either way the live rows' outputs are the same bits."""
    w_shape = w.shape
    out_shape, in_shape = w_shape[: len(w_shape) - contract], w_shape[len(w_shape) - contract :]
    if tuple(x.shape[x.ndim - contract :]) != tuple(in_shape):
        raise ValueError(f"linear: x {x.shape} does not end with the weight's input axes {in_shape}")
    lead = x.shape[: x.ndim - contract]
    x_mi = x.reshape(math.prod(lead), math.prod(in_shape))
    if isinstance(w, BlockWeight):
        y = _block_product(x_mi, w, config, live)
        return y.reshape(*lead, *out_shape).astype(x.dtype)
    value = w.value if isinstance(w, Int8Weight) else w
    w_oi = value.reshape(math.prod(out_shape), math.prod(in_shape))
    scale = w.scale.reshape(-1) if isinstance(w, Int8Weight) else None

    def by_xla(x_mi, w_oi, scale):
        compute = jnp.bfloat16 if w_oi.dtype == jnp.bfloat16 else jnp.float32
        y = jnp.einsum(
            "mi,oi->mo", x_mi.astype(compute), w_oi.astype(compute), preferred_element_type=jnp.float32
        )
        return y if scale is None else y * scale

    if cpu_kernels(config):

        def by_kernel(x_mi, w_oi, scale):
            return cpu_matmul.matmul(x_mi, w_oi, scale, config.cpu_isa, live)

        y = on_cpu(by_kernel, by_xla, x_mi, w_oi, scale)
    else:
        y = by_xla(x_mi, w_oi, scale)
    return y.reshape(*lead, *out_shape).astype(x.dtype)


def _block_product(x_mi, w: BlockWeight, config, live=None):
    """x [M, I] . W^T -> [M, O] float32 for a BlockWeight: ggml's CPU kernel (float32 or 8-bit
    activations, as the weight's precision says) where the CPU kernels run, else XLA's dot on
    the blocks dequantized in the graph (float32 activations). An interleaved weight is read by
    the kernel only, whatever the platform (precision.for_cpu_kernel made it for a CPU)."""
    data_oy = w.data.reshape(-1, w.data.shape[-1])

    def by_xla(x_mi, data_oy):
        _no_interleaved(w)
        w_oi = gguf_blocks.dequantize(data_oy, w.ggml_type, x_mi.shape[1])
        return jnp.einsum("mi,oi->mo", x_mi.astype(jnp.float32), w_oi, preferred_element_type=jnp.float32)

    if cpu_kernels(config) and gguf_matmul.available():

        def by_kernel(x_mi, data_oy):
            return gguf_matmul.matmul(
                x_mi,
                data_oy,
                w.ggml_type,
                quantize_x=w.quantize_x,
                interleaved=w.interleaved,
                bulk=config.bulk_products,
                live=live,
            )

        return by_kernel(x_mi, data_oy) if w.interleaved else on_cpu(by_kernel, by_xla, x_mi, data_oy)
    return by_xla(x_mi, data_oy)


def _no_interleaved(w: BlockWeight):
    if w.interleaved:
        raise ValueError(
            "a Q4_K or Q6_K weight interleaved for the CPU kernel (precision.for_cpu_kernel) is read by that "
            "kernel only: load the model for this device (models.load on it) instead"
        )


def lookup(table, tokens):
    """Rows of an embedding table [V, D] (any precision) at integer tokens [...]: [..., D]. A block
    table's rows come from ggml's kernel where the program is lowered for a CPU and the kernel
    builds (the same numbers as gguf_blocks' dequantization, which XLA runs elsewhere)."""
    if isinstance(table, BlockWeight):
        _no_interleaved(table)
        k = math.prod(table.in_shape)

        def by_xla(tokens, data):
            return gguf_blocks.dequantize(data[tokens], table.ggml_type, k)

        if not gguf_matmul.available():
            return by_xla(tokens, table.data)

        def by_kernel(tokens, data):
            return gguf_matmul.rows(tokens, data, table.ggml_type, k)

        return on_cpu(by_kernel, by_xla, tokens, table.data)
    if isinstance(table, Int8Weight):
        return table.value[tokens].astype(jnp.float32) * table.scale[tokens][..., None]
    return jnp.take(table, tokens, axis=0)
