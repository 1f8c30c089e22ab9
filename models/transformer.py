"""A pure-functional Qwen2/Llama decoder in Flax linen, layers stacked and scanned.

`forward(config, params, tokens[B,T], positions[B,T], cache) -> (logits, cache)`: the cache
goes in and comes out; nothing is mutable. The same call does prefill (T = prompt bucket),
decode (T = 1), draft steps and verification (T = gamma + 1).
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from models import kernels
from models.cache import KVCache, write_layer
from models.config import ModelConfig


class RMSNorm(nn.Module):
    eps: float
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * scale.astype(jnp.float32)).astype(self.dtype)


def rotary(x_bthd, positions_bt, theta):
    """Rotate-half (GPT-NeoX / HF) rotary embedding of [B, T, H, Dh] at integer positions [B, T]."""
    half = x_bthd.shape[-1] // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) / half))  # [Dh/2]
    angles = positions_bt.astype(jnp.float32)[:, :, None] * inv_freq  # [B, T, Dh/2]
    sin = jnp.sin(angles)[:, :, None, :]
    cos = jnp.cos(angles)[:, :, None, :]
    x1, x2 = jnp.split(x_bthd.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_bthd.dtype)


def _project(x_btd, w_hkd):
    """x [B, T, D] times a weight [heads, Dh, D] -> [B, T, heads * Dh]."""
    return jnp.einsum("btd,nd->btn", x_btd, w_hkd.reshape(-1, w_hkd.shape[-1]))


def _dense_init(fan_in):
    return nn.initializers.normal(stddev=fan_in**-0.5)


class Attention(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x_btd, positions_bt, kv_lengths_b, cache: KVCache, layer):
        cfg = self.config
        d, h, kvh, dh, dt = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.jnp_dtype
        # Weights are [out, in] (the GGUF / PyTorch layout): see ModelConfig for why.
        wq = self.param("wq", _dense_init(d), (h, dh, d), dt)
        wk = self.param("wk", _dense_init(d), (kvh, dh, d), dt)
        wv = self.param("wv", _dense_init(d), (kvh, dh, d), dt)
        wo = self.param("wo", _dense_init(h * dh), (d, h, dh), dt)
        b, t = x_btd.shape[:2]
        with jax.named_scope("qkv_matmul"):
            # Contract against [heads * Dh, D] views (free reshapes of row-major weights): with
            # the head axes kept apart, XLA:CPU copies each weight into [D, heads * Dh] order
            # before its dot, every call (docs/design.md, "Weight layout").
            q = _project(x_btd, wq).reshape(b, t, h, dh)
            k = _project(x_btd, wk).reshape(b, t, kvh, dh)
            v = _project(x_btd, wv).reshape(b, t, kvh, dh)
            if cfg.qkv_bias:
                q = q + self.param("bq", nn.initializers.normal(0.1), (h, dh), dt)
                k = k + self.param("bk", nn.initializers.normal(0.1), (kvh, dh), dt)
                v = v + self.param("bv", nn.initializers.normal(0.1), (kvh, dh), dt)
        q = rotary(q, positions_bt, cfg.rope_theta)
        k = rotary(k, positions_bt, cfg.rope_theta)
        with jax.named_scope("cache_write"):
            cache = KVCache(
                k=write_layer(cache.k, layer, k, positions_bt), v=write_layer(cache.v, layer, v, positions_bt)
            )
        with jax.named_scope("attention"):
            out = kernels.attention(
                q,
                cache.k[layer],
                cache.v[layer],
                positions_bt,
                kv_lengths_b,
                impl=cfg.attention_impl,
                interpret=cfg.attention_interpret,
            )
        with jax.named_scope("out_proj"):
            return jnp.einsum("btn,dn->btd", out.reshape(b, t, h * dh), wo.reshape(d, h * dh)), cache


class MLP(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x_btd):
        d, f, dt = self.config.d_model, self.config.mlp_dim, self.config.jnp_dtype
        w_gate = self.param("w_gate", _dense_init(d), (f, d), dt)
        w_up = self.param("w_up", _dense_init(d), (f, d), dt)
        w_down = self.param("w_down", _dense_init(f), (d, f), dt)
        gate = jnp.einsum("btd,fd->btf", x_btd, w_gate)
        hidden = nn.silu(gate) * jnp.einsum("btd,fd->btf", x_btd, w_up)
        return jnp.einsum("btf,df->btd", hidden, w_down)


class DecoderLayer(nn.Module):
    """One pre-norm block; the scan carry is (activations, whole cache), the scanned input the layer index."""

    config: ModelConfig

    @nn.compact
    def __call__(self, carry, layer, positions_bt, kv_lengths_b):
        x, cache = carry
        cfg = self.config
        attn_out, cache = Attention(cfg, name="attn")(
            RMSNorm(cfg.rms_eps, cfg.jnp_dtype, name="attn_norm")(x), positions_bt, kv_lengths_b, cache, layer
        )
        x = x + attn_out
        x = x + MLP(cfg, name="mlp")(RMSNorm(cfg.rms_eps, cfg.jnp_dtype, name="mlp_norm")(x))
        return (x, cache), None


class Transformer(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, tokens_bt, positions_bt, cache: KVCache, logits_at=None):
        """Returns (logits [B, T or K, V] float32, cache).

        logits_at: optional [B, K] indices into T; only those positions get logits (prefill
        needs one per row, and a [B, T, V] float32 tensor over a 150k vocabulary is large).
        """
        cfg = self.config
        embed = nn.Embed(
            cfg.vocab_size,
            cfg.d_model,
            dtype=cfg.jnp_dtype,
            param_dtype=cfg.jnp_dtype,
            embedding_init=nn.initializers.normal(stddev=1.0),
            name="embed",
        )
        x = embed(tokens_bt)
        # Contiguous positions per row: the last query bounds what this call may read.
        kv_lengths_b = positions_bt[:, -1] + 1
        if cfg.scan_layers:
            layers = nn.scan(
                DecoderLayer,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                in_axes=(0, nn.broadcast, nn.broadcast),
                length=cfg.num_layers,
            )(cfg, name="layers")
            (x, cache), _ = layers((x, cache), jnp.arange(cfg.num_layers), positions_bt, kv_lengths_b)
        else:
            for i in range(cfg.num_layers):
                (x, cache), _ = DecoderLayer(cfg, name=f"layers_{i}")(
                    (x, cache), i, positions_bt, kv_lengths_b
                )
        x = RMSNorm(cfg.rms_eps, cfg.jnp_dtype, name="final_norm")(x)
        if logits_at is not None:
            x = jnp.take_along_axis(x, logits_at[:, :, None], axis=1)
        with jax.named_scope("lm_head"):
            # An untied head is a second [V, D] table, read the way a tied one is.
            head = embed
            if not cfg.tie_embeddings:
                head = nn.Embed(
                    cfg.vocab_size,
                    cfg.d_model,
                    dtype=cfg.jnp_dtype,
                    param_dtype=cfg.jnp_dtype,
                    embedding_init=_dense_init(cfg.d_model),
                    name="lm_head",
                )
            logits = head.attend(x)
        return logits.astype(jnp.float32), cache


def unstack_layers(params, num_layers: int):
    """Stacked layout (layers/... with a leading L axis) -> layers_0 .. layers_{L-1}."""
    params = dict(params)
    stacked = params.pop("layers")
    for i in range(num_layers):
        params[f"layers_{i}"] = jax.tree.map(lambda x, i=i: x[i], stacked)
    return params


def stack_layers(params, num_layers: int):
    """layers_0 .. layers_{L-1} -> the stacked layout."""
    params = dict(params)
    per_layer = [params.pop(f"layers_{i}") for i in range(num_layers)]
    params["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer)
    return params


def init_cache(config: ModelConfig, batch: int, max_len: int) -> KVCache:
    """An empty [L, B, max_len, KVH, Dh] cache in the model's dtype."""
    return KVCache.zeros(
        config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim, config.jnp_dtype
    )


def forward(config: ModelConfig, params, tokens_bt, positions_bt, cache: KVCache, logits_at=None):
    """`(logits, cache) = forward(config, params, tokens[B,T], positions[B,T], cache)`.

    Positions must be contiguous within a row (t, t+1, ...). Keys/values of the T tokens are
    written at their positions; each query sees keys at positions <= its own.
    """
    return Transformer(config).apply({"params": params}, tokens_bt, positions_bt, cache, logits_at)


def param_shapes(config: ModelConfig):
    """The parameter pytree as jax.ShapeDtypeStruct leaves (no computation)."""
    tokens = jnp.zeros((1, 1), jnp.int32)
    cache = jax.eval_shape(lambda: init_cache(config, 1, 1))
    variables = jax.eval_shape(Transformer(config).init, jax.random.key(0), tokens, tokens, cache)
    return variables["params"]


def init_params(config: ModelConfig, seed: int = 0):
    """Random parameters in the layout documented on ModelConfig.

    Drawn with NumPy from the shape tree rather than by compiling `Transformer.init`, which
    costs seconds per model: tests build many small models. Weights are normal with
    variance 1/fan_in, norms are ones, biases small.
    """
    rng = np.random.default_rng(seed)
    stacked_config = dataclasses.replace(config, scan_layers=True)  # same draws in either layout
    fan_in = {"wo": config.num_heads * config.head_dim, "w_down": config.mlp_dim}

    def leaf(path, spec):
        name = path[-1].key
        if name == "scale":
            value = np.ones(spec.shape)
        elif name in ("bq", "bk", "bv"):
            value = 0.1 * rng.standard_normal(spec.shape)
        elif name == "embedding" and path[0].key == "embed":
            value = rng.standard_normal(spec.shape)
        else:
            value = rng.standard_normal(spec.shape) / np.sqrt(fan_in.get(name, config.d_model))
        return jnp.asarray(value, spec.dtype)

    params = jax.tree_util.tree_map_with_path(leaf, param_shapes(stacked_config))
    return params if config.scan_layers else unstack_layers(params, config.num_layers)
