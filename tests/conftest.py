"""Shared fixtures: tiny random models, built once per session."""

import jax
import jax.numpy as jnp
import pytest

import models

_forward = jax.jit(models.forward, static_argnums=0)


def apply(model: models.Model, tokens_bt, positions_bt, cache, logits_at=None):
    """`(logits, cache)` of models.forward for model's config and params, jit-compiled."""
    return _forward(model.config, model.params, tokens_bt, positions_bt, cache, logits_at)


def perturbed(model: models.Model, scale: float, seed: int) -> models.Model:
    """The same architecture with noise added to every weight: a draft that mostly agrees."""
    leaves, treedef = jax.tree.flatten(model.params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [
        x + scale * jnp.std(x) * jax.random.normal(k, x.shape, x.dtype)
        for x, k in zip(leaves, keys, strict=True)
    ]
    return model.replace(params=jax.tree.unflatten(treedef, noisy))


@pytest.fixture(scope="session")
def tiny_target():
    return models.random_model(vocab_size=64, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, seed=0)


@pytest.fixture(scope="session")
def tiny_draft(tiny_target):
    """Agrees with the target often but not always, so rounds accept partially."""
    return perturbed(tiny_target, 0.1, seed=7)
