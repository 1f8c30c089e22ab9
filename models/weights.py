"""The weight table: every parameter of the decoder declared once.

Each `Weight` says where the parameter lives in the pytree, its shape in terms of the config,
its logical axes (for spec_jax.sharding's rule table), the GGUF tensor it is read from, how it
is initialised for random models, and how a model call reads it. Everything else is derived
from WEIGHTS: the Flax modules' `self.param` calls (models.transformer.param), the parameter
shapes (param_shapes) and the parameters in a precision (cast_params), random parameters (models.transformer.init_params), the GGUF loader
(models.gguf_loader.load_params), the sharding axes (spec_jax.sharding.param_logical_axes) and
the bytes a call reads (read_bytes).

Layout. Per-layer weights are stacked over layers (a leading L axis, under `layers/`) for
`nn.scan`; with scan_layers=False the same leaves without the L axis sit under `layers_0` ..
`layers_{L-1}`. Matrices are [out..., in...], the layout of the GGUF file and of PyTorch
(XLA:CPU runs the small-T products of decode and verification 1.3-2x faster with the weight in
this order than in [in, out]; docs/design.md, "Weight layout"); `contract` is the number of
trailing (input) axes a matrix is contracted over. Query head h reads kv head h // (H // KVH).

Shape letters (docs/design.md): V vocab, D model width, H query heads, K kv heads, E head dim,
F mlp width, L layers.
"""

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from models import precision
from models.config import ModelConfig


def _always(config: ModelConfig) -> bool:
    return True


def _decoder(config: ModelConfig) -> bool:
    return config.is_decoder


@dataclasses.dataclass(frozen=True)
class Weight:
    path: tuple[str, ...]  # under layers/ (per_layer) or at the top of the pytree
    shape: Callable[[ModelConfig], tuple[int, ...]]  # without the L axis
    axes: tuple[str, ...]  # logical axes, one per dimension of `shape`
    gguf: str  # GGUF tensor name; "{i}" is the layer index
    init: str  # "ones", "normal" (stddev fan_in^-1/2), "embedding" (stddev 1), "bias" (stddev 0.1)
    per_layer: bool = True
    contract: int = 0  # matrices: trailing (input) axes contracted by the product; 0 = not a matrix
    present: Callable[[ModelConfig], bool] = _always
    llama_permuted_heads: str | None = None  # config field whose heads llama.cpp permuted (q, k rows)
    lookup: bool = False  # read by row lookup (the input embedding): a call reads B * T rows of it
    # Hugging Face tensor name ("{i}" the layer index), or a function of the config giving it
    # (families that name a weight differently). Norm scales ("ones") of a Gemma checkpoint are
    # stored as scale - 1 (its RMSNorm multiplies by 1 + w): the loaders add the 1.
    hf: str | Callable[[ModelConfig], str] = ""

    def hf_name(self, config: ModelConfig, layer: int | None = None) -> str:
        """The Hugging Face tensor name of this weight (of `layer` for a per-layer weight)."""
        name = self.hf(config) if callable(self.hf) else self.hf
        return name.format(i=layer)

    @property
    def name(self) -> str:
        return "/".join(self.path)

    def fan_in(self, config: ModelConfig) -> int:
        shape = self.shape(config)
        return math.prod(shape[len(shape) - self.contract :]) if self.contract else 1


WEIGHTS: tuple[Weight, ...] = (
    Weight(
        ("embed", "embedding"),
        lambda c: (c.vocab_size, c.d_model),
        ("vocab", "embed"),
        "token_embd.weight",
        "embedding",
        per_layer=False,
        contract=1,  # also the output head when tie_embeddings
        present=_decoder,
        lookup=True,
        hf="model.embed_tokens.weight",
    ),
    Weight(  # a draft head's input projection: [target feature, token embedding] -> D
        ("fc", "weight"),
        lambda c: (c.d_model, 2 * c.d_model),
        ("embed", "embed"),
        "",
        "normal",
        per_layer=False,
        contract=1,
        present=lambda c: c.kind == "draft_head",
    ),
    Weight(
        ("attn_norm", "scale"),
        lambda c: (c.d_model,),
        ("embed",),
        "blk.{i}.attn_norm.weight",
        "ones",
        hf="model.layers.{i}.input_layernorm.weight",
    ),
    Weight(
        ("attn", "wq"),
        lambda c: (c.num_heads, c.head_dim, c.d_model),
        ("heads", "head_dim", "embed"),
        "blk.{i}.attn_q.weight",
        "normal",
        contract=1,
        hf="model.layers.{i}.self_attn.q_proj.weight",
        llama_permuted_heads="num_heads",
    ),
    Weight(
        ("attn", "wk"),
        lambda c: (c.num_kv_heads, c.head_dim, c.d_model),
        ("kv_heads", "head_dim", "embed"),
        "blk.{i}.attn_k.weight",
        "normal",
        contract=1,
        hf="model.layers.{i}.self_attn.k_proj.weight",
        llama_permuted_heads="num_kv_heads",
    ),
    Weight(
        ("attn", "wv"),
        lambda c: (c.num_kv_heads, c.head_dim, c.d_model),
        ("kv_heads", "head_dim", "embed"),
        "blk.{i}.attn_v.weight",
        "normal",
        contract=1,
        hf="model.layers.{i}.self_attn.v_proj.weight",
    ),
    Weight(
        ("attn", "bq"),
        lambda c: (c.num_heads, c.head_dim),
        ("heads", "head_dim"),
        "blk.{i}.attn_q.bias",
        "bias",
        present=lambda c: c.qkv_bias,
        hf="model.layers.{i}.self_attn.q_proj.bias",
        llama_permuted_heads="num_heads",
    ),
    Weight(
        ("attn", "bk"),
        lambda c: (c.num_kv_heads, c.head_dim),
        ("kv_heads", "head_dim"),
        "blk.{i}.attn_k.bias",
        "bias",
        present=lambda c: c.qkv_bias,
        hf="model.layers.{i}.self_attn.k_proj.bias",
        llama_permuted_heads="num_kv_heads",
    ),
    Weight(
        ("attn", "bv"),
        lambda c: (c.num_kv_heads, c.head_dim),
        ("kv_heads", "head_dim"),
        "blk.{i}.attn_v.bias",
        "bias",
        present=lambda c: c.qkv_bias,
        hf="model.layers.{i}.self_attn.v_proj.bias",
    ),
    Weight(  # Qwen3, Gemma 3: RMSNorm over each head's query / key before the rotation
        ("attn", "q_norm"),
        lambda c: (c.head_dim,),
        ("head_dim",),
        "blk.{i}.attn_q_norm.weight",
        "ones",
        present=lambda c: c.qk_norm,
        hf="model.layers.{i}.self_attn.q_norm.weight",
    ),
    Weight(
        ("attn", "k_norm"),
        lambda c: (c.head_dim,),
        ("head_dim",),
        "blk.{i}.attn_k_norm.weight",
        "ones",
        present=lambda c: c.qk_norm,
        hf="model.layers.{i}.self_attn.k_norm.weight",
    ),
    Weight(
        ("attn", "wo"),
        lambda c: (c.d_model, c.num_heads, c.head_dim),
        ("embed", "heads", "head_dim"),
        "blk.{i}.attn_output.weight",
        "normal",
        contract=2,
        hf="model.layers.{i}.self_attn.o_proj.weight",
    ),
    Weight(  # Gemma 3: the attention output's norm before the residual add
        ("post_attn_norm", "scale"),
        lambda c: (c.d_model,),
        ("embed",),
        "blk.{i}.post_attention_norm.weight",
        "ones",
        present=lambda c: c.sandwich_norms,
        hf="model.layers.{i}.post_attention_layernorm.weight",
    ),
    Weight(
        ("mlp_norm", "scale"),
        lambda c: (c.d_model,),
        ("embed",),
        "blk.{i}.ffn_norm.weight",
        "ones",
        # Llama's "post-attention" norm is the MLP's input norm; Gemma's is the sandwich norm above.
        hf=lambda c: (
            "model.layers.{i}."
            + ("pre_feedforward_layernorm" if c.sandwich_norms else "post_attention_layernorm")
            + ".weight"
        ),
    ),
    Weight(
        ("mlp", "w_gate"),
        lambda c: (c.mlp_dim, c.d_model),
        ("mlp", "embed"),
        "blk.{i}.ffn_gate.weight",
        "normal",
        contract=1,
        hf="model.layers.{i}.mlp.gate_proj.weight",
    ),
    Weight(
        ("mlp", "w_up"),
        lambda c: (c.mlp_dim, c.d_model),
        ("mlp", "embed"),
        "blk.{i}.ffn_up.weight",
        "normal",
        contract=1,
        hf="model.layers.{i}.mlp.up_proj.weight",
    ),
    Weight(
        ("mlp", "w_down"),
        lambda c: (c.d_model, c.mlp_dim),
        ("embed", "mlp"),
        "blk.{i}.ffn_down.weight",
        "normal",
        contract=1,
        hf="model.layers.{i}.mlp.down_proj.weight",
    ),
    Weight(  # Gemma 3: the MLP output's norm before the residual add
        ("post_mlp_norm", "scale"),
        lambda c: (c.d_model,),
        ("embed",),
        "blk.{i}.post_ffw_norm.weight",
        "ones",
        present=lambda c: c.sandwich_norms,
        hf="model.layers.{i}.post_feedforward_layernorm.weight",
    ),
    Weight(
        ("final_norm", "scale"),
        lambda c: (c.d_model,),
        ("embed",),
        "output_norm.weight",
        "ones",
        per_layer=False,
        present=_decoder,
        hf="model.norm.weight",
    ),
    Weight(
        ("lm_head", "embedding"),
        lambda c: (c.vocab_size, c.d_model),
        ("vocab", "embed"),
        "output.weight",
        "normal",
        per_layer=False,
        contract=1,
        present=lambda c: c.is_decoder and not c.tie_embeddings,
        hf="lm_head.weight",
    ),
)

BY_PATH: dict[tuple[str, ...], Weight] = {w.path: w for w in WEIGHTS}
LAYER_PREFIX = "layers"


def weights_of(config: ModelConfig) -> tuple[Weight, ...]:
    """The weights this config has (biases only with qkv_bias, lm_head only when untied)."""
    return tuple(w for w in WEIGHTS if w.present(config))


def path_keys(path) -> tuple[str, ...]:
    """A pytree path (jax key path, or strings) as its names: ("layers", "attn", "wq")."""
    return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


QUANTIZED_FIELDS = ("value", "scale", "data")  # the leaves of models.precision.Int8Weight / BlockWeight


def entry(path) -> tuple[Weight, bool, str | None]:
    """(the table entry of a parameter leaf, whether the leaf is stacked over layers, which part
    of a quantized weight it is: "value", "scale", "data" or None) from its pytree path (jax key path or
    strings): layers/..., layers_N/... or a top-level path. KeyError for a leaf the table does
    not declare."""
    keys = path_keys(path)
    field = None
    if keys[-1] in QUANTIZED_FIELDS and (keys[-2], keys[-1]) not in BY_PATH:  # not a norm's scale
        keys, field = keys[:-1], keys[-1]
    if keys[0] == LAYER_PREFIX:
        w, stacked = BY_PATH[keys[1:]], True
    elif keys[0].startswith(LAYER_PREFIX + "_"):
        w, stacked = BY_PATH[keys[1:]], False
    else:
        w, stacked = BY_PATH[keys], False
    if w.per_layer != (keys[0].startswith(LAYER_PREFIX)):
        raise KeyError(f"{'/'.join(keys)}: {w.name} is {'' if w.per_layer else 'not '}a per-layer weight")
    if field is not None and not w.contract:
        raise KeyError(f"{'/'.join(keys)}/{field}: {w.name} is not a matrix, so it is never quantized")
    return w, stacked, field


def param_shapes(config: ModelConfig):
    """The parameter pytree as jax.ShapeDtypeStruct leaves, in the config's layout and precision
    (its models.precision.TABLE entry: a matrix as Precision.matrix_shape, int8's an Int8Weight of
    an int8 value and float32 scales, the GGUF precisions' a BlockWeight in
    models.precision.default_block_type; everything else in the activations' dtype)."""
    p = precision.of(config.dtype)
    tree: dict = {}

    def put(prefix: tuple[str, ...], w: Weight, shape):
        node = tree
        for key in prefix + w.path[:-1]:
            node = node.setdefault(key, {})
        leaf = p.matrix_shape(shape, w.contract) if w.contract else jax.ShapeDtypeStruct(shape, p.dtype)
        node[w.path[-1]] = leaf

    for w in weights_of(config):
        if not w.per_layer:
            put((), w, w.shape(config))
        elif config.scan_layers:
            put((LAYER_PREFIX,), w, (config.num_layers, *w.shape(config)))
        else:
            for i in range(config.num_layers):
                put((f"{LAYER_PREFIX}_{i}",), w, w.shape(config))
    return tree


def cast_params(params, config, to_device=None):
    """float32 parameters (host or device arrays) in the precision `config.dtype`.

    The concrete counterpart of param_shapes: matrices as the precision's models.precision.TABLE
    entry holds them (Precision.matrix: Int8Weight for int8, BlockWeight in
    precision.default_block_type, quantized by ggml, for the GGUF precisions), everything else
    in its activations' dtype (float32; bfloat16 for bfloat16). One leaf at a time (cast_leaf),
    each passed through `to_device` (e.g. jax.device_put) when given, so a host copy of the
    whole model is never held twice.
    """
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: cast_leaf(path, leaf, config, to_device), params
    )


def cast_leaf(path, leaf, config, to_device=None):
    """One float32 leaf of cast_params, at pytree path `path`. Every output unit is cast on its
    own, so rows of a leaf along its first axis (layers, or a matrix's output units) cast alone
    give the rows of the whole leaf's cast (models.convert derives a precision that way)."""
    p = precision.of(config.dtype)
    w, _, _ = entry(path)
    if w.contract:
        value = p.matrix(np.asarray(leaf), w.contract, table=w.init == "embedding")
    else:
        value = np.asarray(leaf).astype(p.dtype, copy=False)
    return value if to_device is None else jax.tree.map(to_device, value)


def logical_axes(params):
    """The logical axis names of every parameter leaf: a pytree of tuples matching params (either
    layout; "layers" leads stacked leaves). KeyError on a leaf the table does not declare,
    ValueError on one whose rank does not match its declaration."""

    def axes(path, leaf):
        w, stacked, field = entry(path)
        if field == "scale":
            own = w.axes[: len(w.axes) - w.contract]
        elif field == "data":  # a BlockWeight's rows of blocks: the input axes are bytes here
            own = w.axes[: len(w.axes) - w.contract] + ("blocks",)
        else:
            own = w.axes
        names = (("layers",) if stacked else ()) + own
        if len(names) != len(jnp.shape(leaf)):
            raise ValueError(f"parameter {w.name} has shape {jnp.shape(leaf)}, expected axes {names}")
        return names

    return jax.tree_util.tree_map_with_path(axes, params)


def read_bytes(config: ModelConfig, params, tokens: int) -> int:
    """Bytes of parameters one model call over `tokens` tokens (B * T) reads: every weight once,
    except an input embedding that is only looked up (untied), of which it reads `tokens` rows."""
    total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        w, _, _ = entry(path)
        nbytes = leaf.size * leaf.dtype.itemsize
        if w.lookup and not config.tie_embeddings:
            nbytes = min(nbytes, tokens * nbytes // leaf.shape[0])
        total += nbytes
    return total
