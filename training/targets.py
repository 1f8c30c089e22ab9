"""The models a run loads by name: a tiny random model (the quick configs of training and of the
experiments: seconds to compile) or anything models.load takes, with its tokenizer; and the
texts' token ids. experiments/common.py names these too (its quick modes load the same)."""

import models
from models.precision import PRECISIONS

# Tiny random models for the quick modes: they compile in seconds. Vocabulary 256 = bytes, so
# models.ByteTokenizer drives them with text.
TINY_MODELS = {
    "tiny": dict(vocab_size=256, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, seed=0),
    "tiny-draft": dict(vocab_size=256, num_layers=1, d_model=16, num_heads=2, num_kv_heads=1, seed=1),
}

# Models loaded by this process, so that runs made together (`--experiment=peer,decode`) load
# each model once. At most two real models stay resident (a target and its draft).
_LOADED: dict = {}


def model_names() -> list[str]:
    """Every model name the runs accept."""
    return sorted(TINY_MODELS) + models.known_models()


def check_model_name(key: str, name: str) -> None:
    """ValueError("<key>: ...") unless name is a model a run can load: a tiny model, or anything
    models.load takes (models.check_source: names, GGUF files, checkpoint folders, hub ids)."""
    if name in TINY_MODELS:
        return
    try:
        models.check_source(name, known=model_names())
    except ValueError as e:
        raise ValueError(f"{key}: {str(e).splitlines()[0]}") from None


def load_model(name: str, dtype: str = "float32") -> models.Model:
    """A tiny random model (quick modes) or anything models.load knows (with its tokenizer), at
    a precision (models.precision.PRECISIONS); loaded once per process while it is one of the
    last two real (model, precision) pairs asked for."""
    if name in TINY_MODELS:
        model = models.random_model(**TINY_MODELS[name], name=name, dtype=dtype)
        return model.replace(tokenizer=models.ByteTokenizer())
    key = (name, dtype)
    if key not in _LOADED:
        for old in list(_LOADED)[: max(0, len(_LOADED) - 1)]:
            del _LOADED[old]
        _LOADED[key] = models.load(name, dtype=dtype, progress=False)
    _LOADED[key] = _LOADED.pop(key)  # most recently used last
    return _LOADED[key]


def encode_all(tokenizer, texts) -> list[list[int]]:
    """Token ids of each text (in parallel where the tokenizer can)."""
    if hasattr(tokenizer, "encode_batch"):
        return tokenizer.encode_batch(list(texts))
    return [tokenizer.encode(t) for t in texts]


def check_target(config) -> None:
    """ValueError("<key>: ...") unless config.target is a model a run can load and
    config.target_dtype a precision (models.precision.PRECISIONS)."""
    check_model_name("target", config.target)
    if config.target_dtype not in PRECISIONS:
        raise ValueError(
            f"target_dtype: each value must be one of {', '.join(PRECISIONS)}, got {config.target_dtype!r}"
        )
