"""Model configuration: one frozen, hashable dataclass (a static argument of jax.jit)."""

import dataclasses

from models import precision
from models.families import NAMES
from models.kernels import cpu_matmul


def this_cpu_isa() -> str:
    """The CPU kernels' build a config made here uses (models.kernels.cpu_matmul.isa:
    $SPEC_JAX_CPU_ISA, else the widest this CPU runs): ModelConfig.cpu_isa's default, read when
    a config is made, never while a program is traced."""
    return cpu_matmul.isa()


# The decoder families a checkpoint may declare: models.families, one entry each.
FAMILIES = NAMES


# The fields that fix the weights' shapes: a checkpoint (GGUF, safetensors) must agree on each.
SHAPE_FIELDS = ("vocab_size", "num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim", "mlp_dim")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer of one of FAMILIES (its weights: models.weights.WEIGHTS).

    Rotary embeddings use the rotate-half (GPT-NeoX / HF) layout over the full head dimension.
    """

    vocab_size: int
    num_layers: int
    d_model: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    qkv_bias: bool = False
    tie_embeddings: bool = False
    max_seq_len: int = 2048
    # The decoder family (FAMILIES) the checkpoint declared: Qwen2 and Llama need none of the
    # fields below; each other family sets the pieces it needs (its models.families entry, read
    # by models.hf_config and models.gguf_loader) and the forward reads only those fields, never
    # the name.
    family: str = "qwen2"
    # Rotary frequency divisors of the global layers: inv_freq[j] / rope_freq_divisors[j]
    # (llama3 rope scaling; "linear" scaling is one divisor repeated); None: unscaled.
    rope_freq_divisors: tuple[float, ...] | None = None
    # Sliding-window attention: layers in local_layers see the last sliding_window positions
    # (HF's mask: p - s < window) and rotate with rope_local_theta (None: rope_theta, unscaled
    # when it is set). Mistral: every layer; Gemma 3: five local layers to one global.
    sliding_window: int | None = None
    local_layers: tuple[int, ...] = ()
    rope_local_theta: float | None = None
    qk_norm: bool = False  # RMSNorm over each head's query and key before the rotation (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # also norm the attention and MLP outputs before the residual add (Gemma 3)
    embed_scale: bool = False  # embeddings times sqrt(d_model) (Gemma)
    mlp_activation: str = "silu"  # of the gate: "silu" or "gelu_tanh" (Gemma)
    # Attention logits scale; None: head_dim ** -0.5 (Gemma 3: query_pre_attn_scalar ** -0.5).
    attention_scale: float | None = None
    # Scalars a family may set (models.families' hf_scalars): embeddings times
    # embedding_multiplier, each residual branch (attention, MLP) times residual_multiplier, the
    # output logits divided by logits_scaling.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # Precision (models.precision): "float32", "bfloat16" (weights and activations), "int8"
    # (int8 matrices with per-row scales, float32 activations), "gguf" / "gguf_q8" (the GGUF
    # file's own blocks with float32 / 8-bit activations).
    dtype: str = "float32"
    attention_impl: str = "auto"  # see models.kernels.IMPLS
    # The products (models.precision.MATMUL_IMPLS): "auto" and "cpu_kernel" run the CPU kernels
    # where a program is lowered for a CPU (precision.on_cpu) and XLA's dot where it is
    # lowered for anything else; "auto" also falls back to XLA where the kernels cannot be built.
    matmul_impl: str = "auto"
    # The CPU kernels' build ("avx2" or "avx512", models.kernels.cpu_matmul.ISAS): a static field,
    # so it is in every compiled program's key; chosen when the config is made (this_cpu_isa).
    cpu_isa: str = dataclasses.field(default_factory=this_cpu_isa)
    # True: products may take a many-row path whose rows differ in the last bits from a
    # one-row call's (gguf_q8's Q4_K through ggml's 4-row gemm). Set by the row-wise prefill
    # only (spec_jax.row_prefill.prefill_rows): a decode step and a verify call must agree bit for bit.
    bulk_products: bool = False
    attention_interpret: bool = False  # run Pallas kernels in interpret mode (CPU tests)
    # True: parameters stacked over layers and run by nn.scan (compiles in seconds; best on
    # TPU/GPU). False: one parameter subtree per layer (layers_0, layers_1, ...) and a Python
    # loop: XLA:CPU copies every slice of a stacked weight before its dot, so real models run
    # this way on CPU (docs/design.md, "Layer layouts", has the measured cost).
    scan_layers: bool = True
    name: str = "custom"
    # "decoder": a language model (embedding, layers, final norm, output head). "draft_head": an
    # EAGLE-style draft head (models.draft_head): an input projection of [target feature, token
    # embedding] and the layers, reading the target's embedding and output head.
    kind: str = "decoder"

    def __post_init__(self):
        for field in ("rope_freq_divisors", "local_layers"):  # lists when read back from JSON
            value = getattr(self, field)
            if isinstance(value, list):
                object.__setattr__(self, field, tuple(value))
        for field in (*SHAPE_FIELDS, "max_seq_len"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{field} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        precision.of(self.dtype)  # ValueError naming the precisions
        if self.kind not in ("decoder", "draft_head"):
            raise ValueError(f"kind must be one of decoder, draft_head, got {self.kind!r}")
        if self.matmul_impl not in ("auto", "xla", "cpu_kernel"):
            raise ValueError(f"matmul_impl must be one of auto, xla, cpu_kernel, got {self.matmul_impl!r}")
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {self.family!r}")
        if self.mlp_activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"mlp_activation must be one of silu, gelu_tanh, got {self.mlp_activation!r}")
        if self.rope_freq_divisors is not None and len(self.rope_freq_divisors) != self.head_dim // 2:
            raise ValueError(
                f"rope_freq_divisors must have head_dim / 2 = {self.head_dim // 2} entries, "
                f"got {len(self.rope_freq_divisors)}"
            )
        if self.sliding_window is not None and (
            not isinstance(self.sliding_window, int) or self.sliding_window < 1
        ):
            raise ValueError(
                f"sliding_window must be a positive integer or None, got {self.sliding_window!r}"
            )
        if any(not 0 <= i < self.num_layers for i in self.local_layers):
            raise ValueError(
                f"local_layers must be layer indices in [0, {self.num_layers}), got {self.local_layers}"
            )
        if self.local_layers and self.sliding_window is None:
            raise ValueError("local_layers needs a sliding_window")
        if self.cpu_isa not in ("avx2", "avx512"):
            raise ValueError(f"cpu_isa must be one of avx2, avx512, got {self.cpu_isa!r}")

    @property
    def jnp_dtype(self):
        """The activation, KV cache and unquantized weight dtype (models.precision.TABLE's
        activations: bfloat16 for bfloat16, else float32)."""
        return precision.of(self.dtype).dtype

    @property
    def is_decoder(self) -> bool:
        return self.kind == "decoder"

    def is_local(self, layer: int) -> bool:
        """Whether `layer` attends within the sliding window."""
        return layer in self.local_layers

    def portable(self) -> dict:
        """The fields as a dict for a config written to disk, without this machine's choice of
        CPU kernel build (cpu_isa): a config read back elsewhere takes that machine's. JSON's own
        types (tuples as lists), so it equals what is read back."""
        fields = dataclasses.asdict(self).items()
        return {k: list(v) if isinstance(v, tuple) else v for k, v in fields if k != "cpu_isa"}

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)
