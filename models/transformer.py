"""A pure-functional Qwen2/Llama decoder in Flax linen, layers stacked and scanned.

`forward(config, params, tokens[B,T], positions[B,T], cache) -> ForwardOutput` (logits, the
cache, features when asked): the cache goes in and comes out; nothing is mutable. The same call
does prefill (T = prompt bucket), decode (T = 1), draft steps and verification (T = gamma + 1).
"""

import dataclasses
import functools

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from models import kernels, precision, weights
from models.cache import KVCache, write_layer
from models.config import ModelConfig
from models.kernels import cpu_matmul
from models.weights import param_shapes  # noqa: F401  (part of this module's API)


@flax.struct.dataclass
class ForwardOutput:
    """What forward returns: a pytree, so it comes out of jax.jit and lax loops as it is."""

    logits: jax.Array  # float32 [B, T or K, V] (K: logits_at's positions; R for a trimmed head)
    cache: KVCache  # the cache with the T tokens' keys and values written at their positions
    features: jax.Array | None = None  # [B, T, D] in the model's dtype with with_features, else None


def param(module: nn.Module, *path: str):
    """The parameter `path` (an entry of models.weights.WEIGHTS) of `module`, declared with the
    table's shape and initialiser in the config's dtype. The module's own name and nesting give
    the pytree path, so the last element of `path` is the parameter's name in the module."""
    w = weights.BY_PATH[path]
    cfg = module.config
    init = {
        "ones": nn.initializers.ones,
        "normal": nn.initializers.normal(stddev=w.fan_in(cfg) ** -0.5),
        "embedding": nn.initializers.normal(stddev=1.0),
        "bias": nn.initializers.normal(stddev=0.1),
    }[w.init]
    if module.has_variable("params", path[-1]):
        # Checked here rather than by module.param, which traces the initialiser (jax.eval_shape)
        # for every parameter at every trace: half of tracing a tiny model's loop went there.
        value = module.get_variable("params", path[-1])
        if tuple(value.shape) != tuple(w.shape(cfg)):
            raise ValueError(f"parameter {w.name}: shape {tuple(value.shape)}, expected {w.shape(cfg)}")
        return value
    return module.param(path[-1], init, w.shape(cfg), cfg.jnp_dtype)


def rms_norm(cfg: ModelConfig, x, scale):
    """x [..., N] * rsqrt(mean(x^2) + eps) * scale [N] in float32, out in the model's dtype."""

    def by_xla(x, scale):
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + cfg.rms_eps)
        return x32 * scale.astype(jnp.float32)

    if attention_impl(cfg) == "cpu":  # the CPU kernels: each row alone, fixed order

        def by_kernel(x, scale):
            return cpu_matmul.rms_norm(x, scale, cfg.rms_eps, cfg.cpu_isa)

        return on_cpu(cfg, by_kernel, by_xla, x, scale).astype(cfg.jnp_dtype)
    return by_xla(x, scale).astype(cfg.jnp_dtype)


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale; its name (attn_norm, mlp_norm, final_norm,
    post_attn_norm, post_mlp_norm) is its weight table entry."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x):
        return rms_norm(self.config, x, param(self, self.name, "scale"))


class Embedding(nn.Module):
    """A [V, D] table read by row (the input embedding), or the output head's weight (head_logits);
    its name (embed, lm_head) is its weight table entry."""

    config: ModelConfig

    def setup(self):
        self.embedding = param(self, self.name, "embedding")

    def __call__(self, tokens_bt):
        x = precision.lookup(self.embedding, tokens_bt).astype(self.config.jnp_dtype)
        if self.config.embed_scale:  # Gemma: times sqrt(D), rounded to the model's dtype first
            x = x * jnp.asarray(np.float32(self.config.d_model) ** 0.5, x.dtype)
        if self.config.embedding_multiplier != 1.0:
            x = x * jnp.asarray(self.config.embedding_multiplier, x.dtype)
        return x


def inv_freq(head_dim: int, theta: float, divisors=None):
    """Rotary inverse frequencies [E/2] (float32, as transformers computes them), each divided by
    its entry of `divisors` (ModelConfig.rope_freq_divisors) when given."""
    half = head_dim // 2
    out = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) / half))
    return out if divisors is None else out / jnp.asarray(divisors, jnp.float32)


def layer_rotation(cfg: ModelConfig, is_local):
    """The inverse frequencies of a layer: the local layers' own (rope_local_theta, unscaled) where
    the config sets them apart, else the global ones. `is_local` a bool or a traced scalar."""
    global_freq = inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_freq_divisors)
    if cfg.rope_local_theta is None or is_local is False:
        return global_freq
    local_freq = inv_freq(cfg.head_dim, cfg.rope_local_theta)
    return local_freq if is_local is True else jnp.where(is_local, local_freq, global_freq)


def layer_window(cfg: ModelConfig, layer):
    """The attention window of `layer` (models.kernels.attention's `window`): None where no layer
    is local, the window where every layer is, else a traced choice (layers scanned)."""
    if not cfg.local_layers:
        return None
    if len(cfg.local_layers) == cfg.num_layers:
        return cfg.sliding_window
    if isinstance(layer, int):
        return cfg.sliding_window if cfg.is_local(layer) else None
    local = jnp.zeros(cfg.num_layers, bool).at[jnp.asarray(cfg.local_layers)].set(True)[layer]
    return jnp.where(local, cfg.sliding_window, jnp.iinfo(jnp.int32).max)


def is_local_layer(cfg: ModelConfig, layer):
    """Whether `layer` is local: a bool for a Python index, a traced bool inside a scan."""
    if not cfg.local_layers or len(cfg.local_layers) == cfg.num_layers:
        return bool(cfg.local_layers)
    if isinstance(layer, int):
        return cfg.is_local(layer)
    return jnp.zeros(cfg.num_layers, bool).at[jnp.asarray(cfg.local_layers)].set(True)[layer]


def rotary(x_bthe, positions_bt, freq):
    """Rotate-half (GPT-NeoX / HF) rotary embedding of [B, T, H, E] at integer positions [B, T]
    with inverse frequencies freq [E/2] (inv_freq)."""
    angles = positions_bt.astype(jnp.float32)[:, :, None] * freq  # [B, T, E/2]
    sin = jnp.sin(angles)[:, :, None, :]
    cos = jnp.cos(angles)[:, :, None, :]
    x1, x2 = jnp.split(x_bthe.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_bthe.dtype)


def attention_impl(cfg: ModelConfig) -> str:
    """The attention a model call lowered for a CPU uses: cfg.attention_impl, where "auto" is the
    CPU attention kernel when the products have their CPU kernel path
    (models.precision.cpu_kernels), so that a verification call's rows equal decode steps' bit
    for bit. With "cpu" the RMSNorms run in the CPU kernel library too (the other reduction of a
    layer). "auto" takes that path only where the program is lowered for a CPU (on_cpu)."""
    cpu = cfg.attention_impl == "auto" and precision.cpu_kernels(cfg)
    return "cpu" if cpu else cfg.attention_impl


def on_cpu(cfg: ModelConfig, cpu, default, *args):
    """cpu(*args), the CPU kernels' path of attention_impl(cfg) == "cpu": unconditionally when
    cfg.attention_impl asks for "cpu" itself, else (auto) only where the program is lowered for
    a CPU, default(*args) elsewhere (models.precision.on_cpu)."""
    return cpu(*args) if cfg.attention_impl == "cpu" else precision.on_cpu(cpu, default, *args)


class Attention(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x_btd, positions_bt, kv_lengths_b, cache: KVCache, layer, tree_bt=None, live=None):
        cfg = self.config
        # Weights are [out, in] (the GGUF / PyTorch layout): see models.weights for why.
        wq, wk, wv, wo = (param(self, "attn", name) for name in ("wq", "wk", "wv", "wo"))
        with jax.named_scope("qkv_matmul"):
            # precision.linear contracts [heads * E, D] views (free reshapes of row-major
            # weights): with the head axes kept apart, XLA:CPU copied each weight into
            # [D, heads * E] order before its dot, every call (docs/design.md, "Weight layout").
            q_bthe = precision.linear(x_btd, wq, 1, cfg, live)
            k_btke = precision.linear(x_btd, wk, 1, cfg, live)
            v_btke = precision.linear(x_btd, wv, 1, cfg, live)
            if cfg.qkv_bias:
                q_bthe = q_bthe + param(self, "attn", "bq")
                k_btke = k_btke + param(self, "attn", "bk")
                v_btke = v_btke + param(self, "attn", "bv")
        if cfg.qk_norm:
            q_bthe = rms_norm(cfg, q_bthe, param(self, "attn", "q_norm"))
            k_btke = rms_norm(cfg, k_btke, param(self, "attn", "k_norm"))
        freq = layer_rotation(cfg, is_local_layer(cfg, layer))
        q_bthe = rotary(q_bthe, positions_bt, freq)
        k_btke = rotary(k_btke, positions_bt, freq)
        if cfg.attention_scale is not None:  # the kernels scale by head_dim ** -0.5
            q_bthe = q_bthe * jnp.asarray(cfg.attention_scale * cfg.head_dim**0.5, q_bthe.dtype)
        # A tree call's tokens sit in contiguous slots from its first (the root, whose position is
        # its slot); their positions are the root's plus their depths (tree_slots).
        slots_bt = positions_bt if tree_bt is None else tree_slots(positions_bt)
        with jax.named_scope("cache_write"):
            cache = KVCache(
                k=write_layer(cache.k, layer, k_btke, slots_bt),
                v=write_layer(cache.v, layer, v_btke, slots_bt),
            )
        window = layer_window(cfg, layer)
        if tree_bt is not None and window is not None:  # the window on the tree's own keys
            tree_bt = tree_bt & kernels.tree_window_bits(positions_bt, window)
        with jax.named_scope("attention"):
            attend = functools.partial(
                kernels.attention, window=window, tree=tree_bt, interpret=cfg.attention_interpret
            )
            # The whole stacked cache and the layer: the CPU kernel reads the layer's live slots in
            # place, where its slice was a copy of every slot per layer and call.
            args = (q_bthe, cache.k, cache.v, positions_bt, kv_lengths_b)
            attend = functools.partial(attend, layer=layer)
            if attention_impl(cfg) == "cpu":
                cpu = functools.partial(attend, impl="cpu", cpu_isa=cfg.cpu_isa)
                out_bthe = on_cpu(cfg, cpu, functools.partial(attend, impl=cfg.attention_impl), *args)
            else:
                out_bthe = attend(*args, impl=cfg.attention_impl)
        with jax.named_scope("out_proj"):
            return precision.linear(out_bthe, wo, 2, cfg, live), cache


class MLP(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x_btd, live=None):
        w_gate, w_up, w_down = (param(self, "mlp", name) for name in ("w_gate", "w_up", "w_down"))
        cfg = self.config
        gate = precision.linear(x_btd, w_gate, 1, cfg, live)
        gate = nn.silu(gate) if cfg.mlp_activation == "silu" else nn.gelu(gate, approximate=True)
        hidden = gate * precision.linear(x_btd, w_up, 1, cfg, live)
        return precision.linear(hidden, w_down, 1, cfg, live)


class DecoderLayer(nn.Module):
    """One pre-norm block; the scan carry is (activations, whole cache), the scanned input the layer index."""

    config: ModelConfig

    @nn.compact
    def __call__(self, carry, layer, positions_bt, kv_lengths_b, tree_bt=None, live=None):
        x, cache = carry
        cfg = self.config
        attn_out, cache = Attention(cfg, name="attn")(
            RMSNorm(cfg, name="attn_norm")(x), positions_bt, kv_lengths_b, cache, layer, tree_bt, live
        )
        if cfg.sandwich_norms:
            attn_out = RMSNorm(cfg, name="post_attn_norm")(attn_out)
        x = x + _residual(cfg, attn_out)
        mlp_out = MLP(cfg, name="mlp")(RMSNorm(cfg, name="mlp_norm")(x), live)
        if cfg.sandwich_norms:
            mlp_out = RMSNorm(cfg, name="post_mlp_norm")(mlp_out)
        x = x + _residual(cfg, mlp_out)
        return (x, cache), None


def _residual(cfg: ModelConfig, branch):
    """A residual branch's output as it is added: times residual_multiplier."""
    return (
        branch
        if cfg.residual_multiplier == 1.0
        else branch * jnp.asarray(cfg.residual_multiplier, branch.dtype)
    )


class Transformer(nn.Module):
    config: ModelConfig

    # forward(config, params, ...) below is the functional form of this call, which every caller
    # uses: its arguments are this call's, their defaults and meaning written there once.
    @nn.compact
    def __call__(self, tokens_bt, positions_bt, cache: KVCache, logits_at, head, with_features, tree, live):
        """forward's ForwardOutput (see forward for the arguments)."""
        cfg = self.config
        if not cfg.is_decoder:
            raise ValueError(f"forward runs decoders; a {cfg.kind} runs with models.draft_head.forward")
        if live is not None and tokens_bt.shape[0] != 1:
            raise ValueError(f"forward: live_tokens needs one row of tokens, got {tokens_bt.shape[0]}")
        embed = Embedding(cfg, name="embed")
        x = embed(tokens_bt)
        # Contiguous slots per row: the last query's bounds what this call may read.
        kv_lengths_b = (positions_bt if tree is None else tree_slots(positions_bt))[:, -1] + 1
        if cfg.scan_layers:
            layers = nn.scan(
                DecoderLayer,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
                length=cfg.num_layers,
            )(cfg, name="layers")
            (x, cache), _ = layers(
                (x, cache), jnp.arange(cfg.num_layers), positions_bt, kv_lengths_b, tree, live
            )
        else:
            for i in range(cfg.num_layers):
                (x, cache), _ = DecoderLayer(cfg, name=f"layers_{i}")(
                    (x, cache), i, positions_bt, kv_lengths_b, tree, live
                )
        x = features_btd = RMSNorm(cfg, name="final_norm")(x)
        features = features_btd if with_features else None
        if isinstance(logits_at, str):
            if logits_at != "none":
                raise ValueError(f'forward: logits_at must be indices, None or "none", got {logits_at!r}')
            return ForwardOutput(logits=None, cache=cache, features=features)
        if logits_at is not None:
            x = jnp.take_along_axis(x, logits_at[:, :, None], axis=1)
        if head is None:  # an untied head is a second [V, D] table, read the way a tied one is
            head = (embed if cfg.tie_embeddings else Embedding(cfg, name="lm_head")).embedding
        return ForwardOutput(logits=head_logits(cfg, head, x), cache=cache, features=features)


def head_logits(config: ModelConfig, head, features_btd):
    """Logits [..., V] float32 of final-normed features through an output weight head [V, D]
    (output_head(config, params), or a trimmed one): forward's last step, and what a caller
    that asked forward for no logits (logits_at="none") computes where it needs them."""
    with jax.named_scope("lm_head"):
        logits = precision.linear(features_btd, head, 1, config)
    if config.logits_scaling != 1.0:
        logits = logits / jnp.asarray(config.logits_scaling, logits.dtype)
    return logits.astype(jnp.float32)


def output_head(config: ModelConfig, params):
    """The output weight [V, D] of a model's parameters (the embedding when tied)."""
    return params["embed" if config.tie_embeddings else "lm_head"]["embedding"]


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
    """An empty [L, B, max_len, K, E] cache in the model's dtype."""
    return KVCache.zeros(
        config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim, config.jnp_dtype
    )


def forward(
    config: ModelConfig,
    params,
    tokens_bt,
    positions_bt,
    cache: KVCache,
    logits_at=None,
    head=None,
    with_features=False,
    tree=None,
    live_tokens=None,
) -> ForwardOutput:
    """`out = forward(config, params, tokens[B,T], positions[B,T], cache)` (Transformer(config)'s
    call): a ForwardOutput, out.logits [B, T or K, V] float32, out.cache, and out.features
    [B, T, D] with with_features (else None).

    Positions must be contiguous within a row (t, t+1, ...). Keys/values of the T tokens are
    written at their positions; each query sees keys at positions <= its own.
    logits_at: optional [B, K] indices into T; only those positions get logits (prefill
    needs one per row, and a [B, T, V] float32 tensor over a 150k vocabulary is large); "none":
    no logits (out.logits None; head_logits computes them from out.features where needed).
    head: optional output weight [R, D] (any precision) used instead of the model's own
    head: logits are then [..., R] (a vocabulary-trimmed draft, spec_jax.drafting.model).
    with_features: also return the last hidden state after the final norm at every
    position (what the output head reads; a draft head's input, models.draft_head).
    tree: optional int32 [B, T] ancestor bits (models.kernels' `tree`; spec_jax.tree.query_bits):
    the T tokens are a token tree's root and nodes, written at contiguous slots from the
    first token's position (tree_slots), each at the position of its depth (positions_bt) and
    reading the committed text and its ancestors only.
    live_tokens: optional int32 scalar (may be traced), with one row (B = 1): only its first
    live_tokens tokens are real, the rest padding (a prefill's last chunk). The CPU kernels'
    products skip the padding's rows; its outputs (logits, features, and the cache entries it writes past
    the live tokens) are then unspecified but finite. The live tokens' outputs are the same bits.
    """
    return Transformer(config).apply(
        {"params": params}, tokens_bt, positions_bt, cache, logits_at, head, with_features, tree, live_tokens
    )


def tree_slots(positions_bt):
    """int32 [B, T]: the cache slots of a tree call's tokens, contiguous from the first's position."""
    return positions_bt[:, :1] + jnp.arange(positions_bt.shape[1], dtype=positions_bt.dtype)[None, :]


def init_params(config: ModelConfig, seed: int = 0):
    """Random parameters in the layout of models.weights, drawn by each weight's `init`.

    Drawn with NumPy from the weight table rather than by compiling `Transformer.init`, which
    costs seconds per model: tests build many small models. The draws are the same in either
    layer layout (stacked draws, then unstacked for scan_layers=False).
    """
    rng = np.random.default_rng(seed)
    stacked = dataclasses.replace(config, scan_layers=True)
    scales = {"embedding": lambda w: 1.0, "bias": lambda w: 0.1, "normal": lambda w: w.fan_in(config) ** -0.5}

    def leaf(path, spec):
        w, _, _ = weights.entry(path)
        if w.init == "ones":
            value = np.ones(spec.shape)
        else:
            value = scales[w.init](w) * rng.standard_normal(spec.shape)
        return value.astype(np.float32)

    stacked_f32 = dataclasses.replace(stacked, dtype="float32")
    params = jax.tree_util.tree_map_with_path(leaf, weights.param_shapes(stacked_f32))
    params = weights.cast_params(params, stacked, to_device=jnp.asarray)
    return params if config.scan_layers else unstack_layers(params, config.num_layers)
