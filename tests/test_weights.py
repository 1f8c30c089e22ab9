"""The weight table: every parameter is declared once, and everything that lists parameters
(the Flax modules, the shapes, random init, the GGUF loader, the sharding axes) agrees with it."""

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest

import models
from models import transformer, weights

CONFIGS = {
    "qwen-like (bias, untied)": dict(qkv_bias=True, tie_embeddings=False),
    "llama-like (no bias, tied)": dict(qkv_bias=False, tie_embeddings=True),
}


def table_entries(params) -> collections.Counter:
    """How many leaves each table entry has (KeyError for a leaf the table does not declare)."""
    return collections.Counter(
        weights.entry(path)[0].name for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]
    )


def expected_entries(config) -> collections.Counter:
    per_layer = 1 if config.scan_layers else config.num_layers
    return collections.Counter({w.name: per_layer if w.per_layer else 1 for w in weights.weights_of(config)})


@pytest.mark.parametrize("kind", list(CONFIGS))
@pytest.mark.parametrize("scan_layers", [True, False])
def test_every_parameter_of_a_model_has_exactly_one_table_entry(kind, scan_layers):
    model = models.random_model(
        vocab_size=64,
        num_layers=3,
        d_model=32,
        num_heads=4,
        num_kv_heads=2,
        scan_layers=scan_layers,
        **CONFIGS[kind],
    )
    assert table_entries(model.params) == expected_entries(model.config)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_the_flax_modules_declare_exactly_the_tables_shapes(kind):
    """Transformer.init (the modules' own param calls) builds the tree param_shapes derives."""
    config = models.random_model(
        vocab_size=64, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, **CONFIGS[kind]
    ).config
    tokens = jnp.zeros((1, 1), jnp.int32)
    cache = jax.eval_shape(lambda: transformer.init_cache(config, 1, 1))
    init = functools.partial(  # forward's defaults, static
        transformer.Transformer(config).init,
        logits_at=None,
        head=None,
        with_features=False,
        tree=None,
        live=None,
    )
    flax_params = jax.eval_shape(init, jax.random.key(0), tokens, tokens, cache)["params"]
    as_shapes = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)  # noqa: E731
    assert as_shapes(dict(flax_params)) == as_shapes(weights.param_shapes(config))


@pytest.mark.parametrize("scan_layers", [True, False])
def test_a_loaded_real_model_has_one_table_entry_per_parameter(scan_layers):
    model = models.load("smollm2-135m", progress=False, scan_layers=scan_layers)
    assert table_entries(model.params) == expected_entries(model.config)


def test_logical_axes_come_from_the_table_and_match_every_rank():
    config = dataclasses.replace(models.random_model(num_layers=2).config, scan_layers=True)
    axes = weights.logical_axes(weights.param_shapes(config))
    assert axes["layers"]["attn"]["wq"] == ("layers", "heads", "head_dim", "embed")
    assert axes["embed"]["embedding"] == ("vocab", "embed")
    with pytest.raises(KeyError):
        weights.logical_axes({"layers": {"attn": {"w_extra": jnp.zeros((2, 3))}}})


def test_read_bytes_counts_only_the_looked_up_rows_of_an_untied_embedding():
    model = models.random_model(vocab_size=64, num_layers=1, d_model=32, tie_embeddings=False)
    everything = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(model.params))
    row = 32 * 4
    assert weights.read_bytes(model.config, model.params, tokens=5) == everything - 64 * row + 5 * row
    tied = models.random_model(vocab_size=64, num_layers=1, d_model=32, tie_embeddings=True)
    assert weights.read_bytes(tied.config, tied.params, tokens=5) == sum(
        x.size * x.dtype.itemsize for x in jax.tree.leaves(tied.params)
    )
