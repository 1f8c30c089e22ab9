"""The data trained drafters train on: the corpora's training split through the target
(training.features) and the drafted token set. Where a trained head lives and loading it as a
drafter: spec_jax.drafting.head (default_workdir, load_drafter).
"""

import numpy as np

from experiments import common
from experiments.common import TINY_MODELS
from models import corpora, registry
from spec_jax.drafting.tables import frequent_tokens
from training import features


def token_ids(config, target) -> np.ndarray:
    """The drafted token set: the config.vocab most frequent tokens of the training split (and the
    stop tokens), as VocabTrim's; every token when config.vocab is 0 or covers the vocabulary."""
    vocab = target.config.vocab_size
    if (
        config.vocab == 0
        or config.vocab >= vocab
        or target.tokenizer is None
        or config.target in common.TINY_MODELS
    ):
        return np.arange(vocab, dtype=np.int32)
    stops = list(getattr(target.tokenizer, "stop_ids", ()) or ())
    return np.asarray(frequent_tokens(config.target, target.tokenizer, vocab, config.vocab, always=stops))


def _sequences(config, target, split_index: int) -> list[list[int]]:
    """Tokenized documents of the configured corpora: split_index 0 the training split, 1 the
    held-out one (corpora.TRIM_TEST_FRACTION, the split of table 3 and the trimmed heads)."""
    docs = []
    for task in config.corpora:
        docs += [
            text
            for _, text in corpora.split(corpora.documents(task), corpora.TRIM_TEST_FRACTION)[split_index]
        ]
    return common.encode_all(target.tokenizer, docs)


def feature_sets(config, target, progress: bool = True, cache_dir=None):
    """(train, eval) training.features.FeatureSet for a training config: windows of the corpora's
    training split (config.train_tokens) and of the held-out split (config.eval_tokens) through
    the target, computed once and cached under `$SPEC_JAX_CACHE/features/`."""
    if target.tokenizer is None:
        raise ValueError(f"target: {config.target!r} has no tokenizer to read the corpora with")
    sets = []
    for split_index, (name, budget) in enumerate(
        (("train", config.train_tokens), ("eval", config.eval_tokens))
    ):
        data_key = {
            "corpora": list(config.corpora),
            "split": name,
            "tokens": budget,
            "seq_len": config.seq_len,
            "seed": config.seed,
            "tiny": config.target in TINY_MODELS,
        }
        model_key = {"target": config.target, "dtype": config.target_dtype}
        folder = (
            registry.cache_root(cache_dir)
            / "features"
            / f"{config.target}-{features.cache_key(model_key, data_key)}"
        )
        sets.append(
            features.cached(
                folder / name,
                lambda si=split_index, b=budget: features.windows(
                    _sequences(config, target, si), config.seq_len, b, config.seed
                ),
                target.config,
                target.params,
                progress=progress,
            )
        )
    return tuple(sets)
