"""Helpers shared by the model-based experiments (table3, walltime)."""

import numpy as np

import models

# Tiny random models for the quick modes: they compile in seconds. Vocabulary 256 = bytes, so
# models.ByteTokenizer drives them with text.
TINY_MODELS = {
    "tiny": dict(vocab_size=256, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, seed=0),
    "tiny-draft": dict(vocab_size=256, num_layers=1, d_model=16, num_heads=2, num_kv_heads=1, seed=1),
}


def model_names() -> list[str]:
    """Every model name the experiments accept."""
    return sorted(TINY_MODELS) + models.known_models()


def check_model_name(key: str, name: str) -> None:
    """ValueError("<key>: ...") unless name is a model the experiments can load."""
    if name not in model_names():
        raise ValueError(f"{key}: unknown model {name!r}; known models: {', '.join(model_names())}")


def check_int_settings(config, ranges: dict) -> None:
    """ValueError("<key>: ...") unless config[key] is an integer (not a bool) in [low, high]
    for every key: (low, high) in ranges."""
    for key, (low, high) in ranges.items():
        value = config[key]
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"{key}: must be an integer in [{low}, {high}], got {value!r}")


def load_model(name: str) -> models.Model:
    """A tiny random model (quick modes) or anything models.load knows (with its tokenizer)."""
    if name in TINY_MODELS:
        return models.random_model(**TINY_MODELS[name], name=name).replace(tokenizer=models.ByteTokenizer())
    return models.load(name, progress=False)


def encode_all(tokenizer, texts) -> list[list[int]]:
    """Token ids of each text (in parallel where the tokenizer can)."""
    if hasattr(tokenizer, "encode_batch"):
        return tokenizer.encode_batch(list(texts))
    return [tokenizer.encode(t) for t in texts]


def bootstrap_ratio_ci(numerators, denominators, resamples: int, seed: int, level: float = 0.95):
    """Percentile bootstrap interval over units (prompts) for sum(numerators) / sum(denominators).

    Units are resampled with replacement, `resamples` times; returns (low, high).
    """
    num = np.asarray(numerators, np.float64)
    den = np.asarray(denominators, np.float64)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, num.size, (resamples, num.size))
    ratios = num[idx].sum(1) / np.maximum(den[idx].sum(1), 1e-300)
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(ratios, [tail, 100 - tail])
    return float(low), float(high)
