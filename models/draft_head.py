"""A draft head on the target's own features (EAGLE-1: Li et al. 2024, "EAGLE: Speculative
Sampling Requires Rethinking Feature Uncertainty", arXiv 2401.15077).

At position j the head reads the target's feature f_j (its last hidden state after the final
norm: what the target's output head reads) and the target's embedding of the token at j + 1,
projects [f_j, e(t_{j+1})] to the model width (`fc`), and runs its own decoder layer(s) with
their own KV cache (slot j holds position j, as for every model here). Its output h_j is a
prediction of f_{j+1}; the target's output head (trimmed to a token subset where the drafter
wants it cheap) turns h_j into the draft distribution of the token at j + 2. Drafting further
feeds h_j back in place of the target feature it predicts.

The head is a `ModelConfig` of kind "draft_head": the same weight table (models.weights) as a
decoder, with `fc/weight` [D, 2D] and the layers, but no embedding, final norm or output head
of its own, so casting to int8 / bfloat16, sharding by logical axes and byte counts work as
for any model. Its width is the target's (it predicts the target's features); its heads, MLP
width and depth may be smaller.
"""

import flax.linen as nn
import jax.numpy as jnp

from models import precision
from models.cache import KVCache
from models.config import ModelConfig
from models.settings import is_int
from models.transformer import DecoderLayer, init_cache, param, tree_slots


def config_for(
    target: ModelConfig,
    *,
    num_layers: int = 1,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    mlp_dim: int | None = None,
    dtype: str = "float32",
    matmul_impl: str = "auto",
) -> ModelConfig:
    """The config of a draft head for `target`: the target's width, head size, rotary and norm
    settings; num_heads / num_kv_heads / mlp_dim default to the target's and may not exceed
    them (a head is a cheap fraction of one target layer or a few). ValueError naming the
    argument otherwise."""
    if not target.is_decoder:
        raise ValueError(f"target must be a decoder config, got kind {target.kind!r}")
    num_heads = target.num_heads if num_heads is None else num_heads
    num_kv_heads = target.num_kv_heads if num_kv_heads is None else num_kv_heads
    mlp_dim = target.mlp_dim if mlp_dim is None else mlp_dim
    limits = {
        "num_layers": (num_layers, target.num_layers),
        "num_heads": (num_heads, target.num_heads),
        "num_kv_heads": (num_kv_heads, target.num_kv_heads),
        "mlp_dim": (mlp_dim, target.mlp_dim),
    }
    for name, (value, most) in limits.items():
        if not is_int(value) or not 1 <= value <= most:
            raise ValueError(
                f"{name} must be an integer in [1, {most}] (a head no wider or deeper than its "
                f"target {target.name!r}), got {value!r}"
            )
    return ModelConfig(
        vocab_size=target.vocab_size,
        num_layers=num_layers,
        d_model=target.d_model,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=target.head_dim,
        mlp_dim=mlp_dim,
        rope_theta=target.rope_theta,
        rms_eps=target.rms_eps,
        qkv_bias=target.qkv_bias,
        max_seq_len=target.max_seq_len,
        dtype=dtype,
        attention_impl=target.attention_impl,
        matmul_impl=matmul_impl,
        cpu_isa=target.cpu_isa,
        attention_interpret=target.attention_interpret,
        scan_layers=False,
        name=f"{target.name}-head",
        kind="draft_head",
    )


class Projection(nn.Module):
    """x [..., in] -> [..., out] by the weight table entry `<name>/weight`."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x):
        return precision.linear(x, param(self, self.name, "weight"), 1, self.config)


class DraftHead(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, features_btd, embeddings_btd, positions_bt, cache: KVCache, tree=None):
        cfg = self.config
        dtype = cfg.jnp_dtype
        x = jnp.concatenate([features_btd.astype(dtype), embeddings_btd.astype(dtype)], axis=-1)
        x = Projection(cfg, name="fc")(x)
        # Contiguous slots per row, as in the decoder: the last query's bounds what the call reads.
        kv_lengths_b = (positions_bt if tree is None else tree_slots(positions_bt))[:, -1] + 1
        for i in range(cfg.num_layers):
            (x, cache), _ = DecoderLayer(cfg, name=f"layers_{i}")(
                (x, cache), i, positions_bt, kv_lengths_b, tree
            )
        return x, cache


def forward(
    config: ModelConfig, params, features_btd, tokens_bt, positions_bt, cache: KVCache, embed, tree=None
):
    """`(hidden [B, T, D], cache)`: the head over T positions of each row.

    features_btd: the target's features at positions [B, T] (or the head's own earlier outputs
    when drafting); tokens_bt: the token at each position + 1; embed: the target's input
    embedding table [V, D] (any precision). hidden[:, t] predicts the target's feature at
    positions[:, t] + 1. Positions must be contiguous within a row, unless `tree` (int32 [B, T]
    ancestor bits, models.transformer.forward's) makes the T pairs a token tree: written at
    contiguous slots from the first one's position, each at the position of its depth and
    reading the committed pairs and its ancestors only.
    """
    if config.kind != "draft_head":
        raise ValueError(f"models.draft_head.forward runs draft heads, got a config of kind {config.kind!r}")
    embeddings = precision.lookup(embed, tokens_bt)
    return DraftHead(config).apply({"params": params}, features_btd, embeddings, positions_bt, cache, tree)


def logits(hidden_btd, out_head, config: ModelConfig):
    """float32 [B, T, R] logits of the head's hidden states through an output weight [R, D] (the
    target's head, or its rows for a token subset), with the products config (the head's) asks
    for (models.precision.linear)."""
    return precision.linear(hidden_btd, out_head, 1, config).astype(jnp.float32)


def new_cache(config: ModelConfig, batch: int, max_len: int) -> KVCache:
    """An empty cache for the head's layers."""
    return init_cache(config, batch, max_len)
