"""The decoder families: one Family entry each in FAMILIES, the one place a family is described.

An entry holds everything that differs between families: how a Hugging Face config.json maps
onto ModelConfig (hf_model_types, the settings the family fixes, defaults config.json may omit,
its sliding layers, its attention scale, extra scalars read from config.json), how a GGUF file
names it and what llama.cpp fixes for it (gguf_archs, whether llama.cpp permuted its q / k
rows, its vocabulary's kind, its MLP activation, sliding layers and attention scale), and how
its checkpoint stores the norms (norm_offset). The weight names are the same for every family
(models.weights.WEIGHTS), and so are the GGUF metadata keys of the shapes
(models.gguf_loader.GGUF_KEYS). models.hf_config, models.hf_checkpoint, models.gguf_loader and
models.tokenizer read this table; no other module names a family.

Adding a family (docs/design.md, "Adding a model family"): one entry here, and its tiny
checkpoint in scripts/tiny_checkpoints.FAMILIES, which tests/test_hf_sources.py compares with
transformers (logits and greedy speculative decoding). Granite is the worked example.
"""

import dataclasses
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

SLIDING, FULL = "sliding_attention", "full_attention"


def _no_local_layers(cfg: dict, num_layers: int) -> tuple[int, ...]:
    return ()


def _mistral_local_layers(cfg: dict, num_layers: int) -> tuple[int, ...]:
    return tuple(range(num_layers)) if cfg.get("sliding_window") else ()


def _qwen_local_layers(cfg: dict, num_layers: int) -> tuple[int, ...]:
    if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
        return tuple(range(int(cfg.get("max_window_layers", 28)), num_layers))
    return ()


# Gemma 3's default sliding_window_pattern (transformers' Gemma3TextConfig, llama.cpp's
# llama_model_gemma3): every 6th layer global, the others local.
GEMMA3_SWA_PATTERN = 6


def _gemma3_local_layers(cfg: dict, num_layers: int) -> tuple[int, ...]:
    pattern = int(cfg.get("sliding_window_pattern", GEMMA3_SWA_PATTERN))
    return tuple(i for i in range(num_layers) if (i + 1) % pattern)


def _no_attention_scale(cfg: dict, head_dim: int) -> float | None:
    return None


def _gemma3_attention_scale(cfg: dict, head_dim: int) -> float | None:
    scalar = cfg.get("query_pre_attn_scalar")
    return float(scalar) ** -0.5 if scalar and int(scalar) != head_dim else None


def _granite_attention_scale(cfg: dict, head_dim: int) -> float | None:
    return float(cfg.get("attention_multiplier", head_dim**-0.5))


# GGUF metadata: meta(key, default) is the file's value of "{general.architecture}.{key}".
Meta = Callable[[str, Any], Any]


def _no_gguf_local_layers(meta: Meta, num_layers: int) -> tuple[tuple[int, ...], int | None]:
    return (), None


def _gemma3_gguf_local_layers(meta: Meta, num_layers: int) -> tuple[tuple[int, ...], int | None]:
    """(local layers, window) of a Gemma 3 file as llama.cpp reads them: no sliding window (all
    global) without `attention.sliding_window`; else `attention.sliding_window_pattern`, either a
    per-layer array of flags or a period n (layer i local when i % n < n - 1; default 6)."""
    window = int(meta("attention.sliding_window", 0) or 0)
    if window <= 0:
        return (), None
    pattern = meta("attention.sliding_window_pattern", GEMMA3_SWA_PATTERN)
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ValueError(f"sliding_window_pattern has {len(pattern)} flags for {num_layers} layers")
        local = tuple(i for i, flag in enumerate(pattern) if flag)
    else:
        n = int(pattern)
        local = tuple(i for i in range(num_layers) if n == 0 or i % n < n - 1)
    return local, (window if local else None)


def _no_gguf_attention_scale(shape: dict) -> float | None:
    return None


def _gemma3_gguf_attention_scale(shape: dict) -> float | None:
    """llama.cpp scales Gemma 3's queries by head_dim ** -0.5, except the 27B's (62 layers):
    (d_model / heads) ** -0.5, its query_pre_attn_scalar (gemma_pytorch's config)."""
    if shape["num_layers"] != 62:
        return None
    return float(shape["d_model"] // shape["num_heads"]) ** -0.5


@dataclasses.dataclass(frozen=True)
class Family:
    """One decoder family (see the module docstring).

    fixed: ModelConfig fields the family sets whatever config.json says (qkv_bias, qk_norm,
      sandwich_norms, embed_scale).
    tied_by_default: tie_word_embeddings where config.json omits it (the transformers config
      class's own default).
    rope_theta: rope_theta where config.json omits it.
    local_rope_theta: the sliding layers rotate apart with this base (config.json's
      rope_local_base_freq or per-layer-type rope parameters override it); None: as the others.
    local_layers(cfg, num_layers): the layers HF runs with its sliding-window mask where
      config.json has no layer_types.
    attention_scale(cfg, head_dim): ModelConfig.attention_scale (None: head_dim ** -0.5).
    hf_scalars: ModelConfig field -> (config.json key, its default): scalars read as they are.
    hf_text_configs: config.json model_type -> the model_type of the decoder it holds in its
      `text_config` (a multimodal checkpoint whose text model this project runs).
    norm_offset: the checkpoint stores w of a norm that multiplies by norm_offset + w (Gemma: 1).
    gguf_archs: general.architecture values of its GGUF files (empty: no GGUF support).
    gguf_permuted_qk: llama.cpp's converter permuted the q / k rows (LlamaModel.permute).
    gguf_vocab: "bpe" (tokenizer.ggml.pre picks the pre-tokenizer, models.tokenizer) or
      "sentencepiece".
    gguf_activation: the MLP's activation (ModelConfig.mlp_activation), which llama.cpp fixes
      per architecture (a GGUF file does not name it).
    gguf_local_layers(meta, num_layers): (local layers, window) of a GGUF file (meta: Meta).
    gguf_attention_scale(shape): ModelConfig.attention_scale of a GGUF file from its d_model,
      num_heads and num_layers (None: head_dim ** -0.5).
    """

    hf_model_types: tuple[str, ...]
    fixed: MappingProxyType = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    tied_by_default: bool = False
    rope_theta: float = 10_000.0
    local_rope_theta: float | None = None
    local_layers: Callable[[dict, int], tuple[int, ...]] = _no_local_layers
    attention_scale: Callable[[dict, int], float | None] = _no_attention_scale
    hf_scalars: MappingProxyType = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    hf_text_configs: MappingProxyType = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    norm_offset: float = 0.0
    gguf_archs: tuple[str, ...] = ()
    gguf_permuted_qk: bool = False
    gguf_vocab: str = "bpe"
    gguf_activation: str = "silu"
    gguf_local_layers: Callable[[Meta, int], tuple[tuple[int, ...], int | None]] = _no_gguf_local_layers
    gguf_attention_scale: Callable[[dict], float | None] = _no_gguf_attention_scale

    def hf_fields(self, cfg: dict, head_dim: int) -> dict[str, Any]:
        """The ModelConfig fields of config.json `cfg` that this entry decides: its fixed ones,
        its scalars, the attention scale and the tie default."""
        return dict(
            self.fixed,
            **{field: float(cfg.get(key, default)) for field, (key, default) in self.hf_scalars.items()},
            attention_scale=self.attention_scale(cfg, head_dim),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", self.tied_by_default)),
        )

    def gguf_fields(self, meta: Meta, shape: dict) -> dict[str, Any]:
        """The ModelConfig fields of a GGUF file that this entry decides: its fixed ones, the MLP
        activation, the sliding layers with their window and rope base (`rope.freq_base_swa`,
        default local_rope_theta) and the attention scale. shape: the fields read from the
        file's shape keys (num_layers, d_model, num_heads)."""
        local_layers, window = self.gguf_local_layers(meta, shape["num_layers"])
        local_theta = meta("rope.freq_base_swa", self.local_rope_theta) if local_layers else None
        return dict(
            self.fixed,
            mlp_activation=self.gguf_activation,
            sliding_window=window,
            local_layers=local_layers,
            rope_local_theta=None if local_theta is None else float(local_theta),
            attention_scale=self.gguf_attention_scale(shape),
        )


def _fixed(**fields) -> MappingProxyType:
    return MappingProxyType(fields)


FAMILIES: dict[str, Family] = {
    "llama": Family(("llama",), gguf_archs=("llama",), gguf_permuted_qk=True),
    "qwen2": Family(
        ("qwen2",), fixed=_fixed(qkv_bias=True), local_layers=_qwen_local_layers, gguf_archs=("qwen2",)
    ),
    "qwen3": Family(
        ("qwen3",), fixed=_fixed(qk_norm=True), local_layers=_qwen_local_layers, gguf_archs=("qwen3",)
    ),
    # llama.cpp's converter writes Mistral's HF checkpoints as "llama" GGUF files.
    "mistral": Family(("mistral",), local_layers=_mistral_local_layers),
    # "gemma3" is the multimodal checkpoint: its text model is read from `text_config`.
    "gemma3": Family(
        ("gemma3_text", "gemma3"),
        hf_text_configs=_fixed(gemma3="gemma3_text"),
        fixed=_fixed(qk_norm=True, sandwich_norms=True, embed_scale=True),
        tied_by_default=True,
        rope_theta=1_000_000.0,
        local_rope_theta=10_000.0,
        local_layers=_gemma3_local_layers,
        attention_scale=_gemma3_attention_scale,
        norm_offset=1.0,
        gguf_archs=("gemma3",),
        gguf_vocab="sentencepiece",
        gguf_activation="gelu_tanh",
        gguf_local_layers=_gemma3_gguf_local_layers,
        gguf_attention_scale=_gemma3_gguf_attention_scale,
    ),
    # IBM Granite 3: Llama's layers with four scalars (embeddings, residual branches, attention
    # logits, output logits).
    "granite": Family(
        ("granite",),
        attention_scale=_granite_attention_scale,
        hf_scalars=MappingProxyType(
            {
                "embedding_multiplier": ("embedding_multiplier", 1.0),
                "residual_multiplier": ("residual_multiplier", 1.0),
                "logits_scaling": ("logits_scaling", 1.0),
            }
        ),
    ),
}
NAMES = tuple(FAMILIES)
# config.json model_type -> family
HF_MODEL_TYPES = {t: name for name, f in FAMILIES.items() for t in f.hf_model_types}
# config.json model_type of a multimodal checkpoint -> its text_config's model_type
HF_TEXT_CONFIGS = {outer: inner for f in FAMILIES.values() for outer, inner in f.hf_text_configs.items()}
# GGUF general.architecture -> family. Mistral's HF checkpoints are written as "llama" by
# llama.cpp's converter; its "mistral3" / "mistral4" (Mistral's own format, with yarn rope and
# attention temperature scaling) are not supported.
GGUF_ARCHS = {a: name for name, f in FAMILIES.items() for a in f.gguf_archs}
