"""A Hugging Face `config.json` -> ModelConfig fields, for the families of models.families.FAMILIES
(each family's differences are its entry there; this module reads them, never a family's name).

`config_from_hf(cfg)` reads the keys transformers writes, in both of its formats: the rotary
settings as `rope_theta` + `rope_scaling` (checkpoints on the hub) or as `rope_parameters`, flat
or per layer type (what transformers 5 saves). Anything the decoder does not implement (another
architecture, partial rotary, rope types other than default / linear / llama3, logit
soft-capping, MLP biases) is refused with one ValueError naming it: a model that loads computes
what transformers computes.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from models.families import FAMILIES, FULL, HF_MODEL_TYPES, HF_TEXT_CONFIGS, SLIDING, Family

ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
ROPE_TYPES = ("default", "linear", "llama3")


def architecture(cfg: dict) -> str:
    """The checkpoint's architecture as its config names it (for messages)."""
    archs = cfg.get("architectures") or []
    return str(archs[0]) if archs else str(cfg.get("model_type", "unknown"))


def text_config(cfg: dict) -> dict:
    """The decoder's own config: the `text_config` of a multimodal checkpoint (a family's
    hf_text_configs, e.g. Gemma 3's), else cfg."""
    inner = HF_TEXT_CONFIGS.get(cfg.get("model_type"))
    return {"model_type": inner, **cfg.get("text_config", {})} if inner else cfg


def family_of(cfg: dict) -> str:
    """The models.families.FAMILIES name of a config.json; ValueError naming any other architecture."""
    family = HF_MODEL_TYPES.get(cfg.get("model_type"))
    if family is None:
        raise ValueError(
            f"unsupported architecture {architecture(cfg)} (model_type {cfg.get('model_type')!r}); "
            f"supported model types: {', '.join(HF_MODEL_TYPES)}"
        )
    return family


def _rope(cfg: dict, layer_type: str, default_theta: float) -> dict:
    """The rotary parameters of one layer type as a flat dict with rope_type and rope_theta."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and layer_type in params:  # transformers 5, per layer type
        params = params[layer_type]
    if not params:
        params = dict(cfg.get("rope_scaling") or {}) if layer_type == FULL else {}
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    if "rope_theta" not in params:
        key = (
            "rope_local_base_freq"
            if layer_type == SLIDING and "rope_local_base_freq" in cfg
            else "rope_theta"
        )
        params["rope_theta"] = cfg.get(key, default_theta)
    return params


def _divisors(params: dict, head_dim: int, max_positions: int) -> tuple[float, ...] | None:
    """ModelConfig.rope_freq_divisors of a rope_type: None (default), the factor (linear), or
    llama 3's per-frequency divisors (transformers' _compute_llama3_parameters, in float64)."""
    kind = params["rope_type"]
    if kind not in ROPE_TYPES:
        raise ValueError(f"unsupported rope type {kind!r}; supported: {', '.join(ROPE_TYPES)}")
    if kind == "default":
        return None
    factor = float(params["factor"])
    if kind == "linear":
        return (factor,) * (head_dim // 2)
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_len = float(params.get("original_max_position_embeddings", max_positions))
    inv_freq = 1.0 / (float(params["rope_theta"]) ** (np.arange(0, head_dim, 2) / head_dim))
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    scaled = np.where(medium, smoothed, scaled)
    return tuple(float(d) for d in inv_freq / scaled)


def _local_layers(cfg: dict, family: Family, num_layers: int) -> tuple[int, ...]:
    """Indices of the layers HF runs with its sliding-window mask: config.json's layer_types,
    else the family's rule."""
    if cfg.get("layer_types"):
        types = list(cfg["layer_types"])
        if len(types) != num_layers or set(types) - {SLIDING, FULL}:
            raise ValueError(f"layer_types must be {num_layers} of {SLIDING!r} / {FULL!r}, got {types}")
        return tuple(i for i, t in enumerate(types) if t == SLIDING)
    return family.local_layers(cfg, num_layers)


def _check_supported(cfg: dict) -> str:
    """ValueError naming what the decoder does not implement (soft-capping, MLP biases, partial
    rotary embeddings, another activation); returns the activation's ModelConfig name."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(key) is not None:
            raise ValueError(f"{architecture(cfg)}: {key}={cfg[key]} is not supported")
    if cfg.get("mlp_bias"):
        raise ValueError(f"{architecture(cfg)}: mlp_bias is not supported")
    if float(cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"{architecture(cfg)}: partial rotary embeddings are not supported")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise ValueError(
            f"{architecture(cfg)}: activation {act!r} is not supported ({', '.join(ACTIVATIONS)})"
        )
    return ACTIVATIONS[act]


def _rotary_fields(cfg: dict, family: Family, head_dim: int, max_positions: int) -> dict:
    """rope_theta, rope_freq_divisors and rope_local_theta of config.json `cfg`."""
    full = _rope(cfg, FULL, family.rope_theta)
    if family.local_rope_theta is None:
        return dict(
            rope_theta=float(full["rope_theta"]),
            rope_freq_divisors=_divisors(full, head_dim, max_positions),
            rope_local_theta=None,
        )
    local = _rope(cfg, SLIDING, family.local_rope_theta)  # the local layers rotate apart
    if local["rope_type"] != "default":
        raise ValueError(
            f"{architecture(cfg)}: sliding layers' rope type {local['rope_type']!r} is not supported"
        )
    return dict(
        rope_theta=float(full["rope_theta"]),
        rope_freq_divisors=_divisors(full, head_dim, max_positions),
        rope_local_theta=float(local["rope_theta"]),
    )


def config_from_hf(cfg: dict, name: str = "custom") -> dict[str, Any]:
    """ModelConfig fields (without dtype and the run-time fields) of a transformers config.json
    dict; `ModelConfig(**config_from_hf(cfg))` builds the config. ValueError naming what is not
    supported."""
    cfg = text_config(cfg)
    family = FAMILIES[family_of(cfg)]
    activation = _check_supported(cfg)
    num_heads = int(cfg["num_attention_heads"])
    d_model = int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or d_model // num_heads)
    num_layers = int(cfg["num_hidden_layers"])
    max_positions = int(cfg.get("max_position_embeddings", 2048))
    local_layers = _local_layers(cfg, family, num_layers)
    fields = dict(
        family=family_of(cfg),
        vocab_size=int(cfg["vocab_size"]),
        num_layers=num_layers,
        d_model=d_model,
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        mlp_dim=int(cfg["intermediate_size"]),
        **_rotary_fields(cfg, family, head_dim, max_positions),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        qkv_bias=bool(cfg.get("attention_bias", False)),
        max_seq_len=max_positions,
        sliding_window=int(cfg["sliding_window"]) if local_layers else None,
        local_layers=local_layers,
        qk_norm=False,
        sandwich_norms=False,
        embed_scale=False,
        mlp_activation=activation,
        name=name,
    )
    return fields | family.hf_fields(cfg, head_dim)  # the family's fixed fields win over config.json's
