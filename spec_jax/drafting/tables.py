"""The drafters' tables fitted on the corpora's training split (models.corpora), cached under
`$SPEC_JAX_CACHE`: the token set of a vocabulary-trimmed draft model (frequent_tokens) and the
suffix drafter's n-gram table (suffix_tables). drafting/build.py hands them to the drafters; no
drafter imports the corpora.
"""

import jax.numpy as jnp
import numpy as np

from models import corpora, registry
from spec_jax.drafting.ngram import most_frequent
from spec_jax.drafting.suffix_table import SuffixTables, fit_suffix_tables


def frequent_tokens(model_name: str, tokenizer, vocab_size: int, count: int, always=(), cache_dir=None):
    """The token set of a vocabulary-trimmed draft head (spec_jax.drafting.model.trim_vocabulary):
    the `count` most frequent tokens of the training documents of both tasks, with `always`
    (the stop tokens) included: sorted, distinct ids in [0, vocab_size), int64 [count].
    Counted once per model and count, cached as `$SPEC_JAX_CACHE/vocab_trim/MODEL-COUNT-ALWAYS.npy`
    (registry.cached_entry: locked, written atomically, a damaged file rebuilt once)."""
    always = sorted({int(i) for i in always})
    path = (
        registry.cache_root(cache_dir)
        / "vocab_trim"
        / f"{model_name}-{count}-{'_'.join(map(str, always))}.npy"
    )

    def load(path):
        ids = np.load(path, allow_pickle=False)
        if (
            ids.shape != (count,)
            or not np.issubdtype(ids.dtype, np.integer)
            or (count and (ids[0] < 0 or ids[-1] >= vocab_size))
            or np.any(np.diff(ids) <= 0)
            or not np.isin(always, ids).all()
        ):
            raise ValueError(f"not {count} sorted distinct token ids in [0, {vocab_size}) holding {always}")
        return ids

    def write(path):
        ids = most_frequent(corpora.training_sequences(tokenizer, cache_dir), vocab_size, count, always)
        registry.atomic_write(path, lambda f: np.save(f, ids))

    return registry.cached_entry(path, load, write)


SUFFIX_TABLE_FIELDS = ("keys", "next_ids", "next_counts")


def suffix_tables(model_name: str, tokenizer, vocab_size: int, max_ngram: int, cache_dir=None):
    """The suffix drafter's n-gram table (spec_jax.drafting.suffix_table.fit_suffix_tables) of the training
    documents of both tasks, fitted once per model and max_ngram and cached as
    `$SPEC_JAX_CACHE/suffix/MODEL-N.npz` (registry.cached_entry: locked, written atomically, a
    damaged file (a zip or CRC error, a missing table, shapes that do not fit) rebuilt once)."""
    path = registry.cache_root(cache_dir) / "suffix" / f"{model_name}-{max_ngram}.npz"

    def load(path):
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in SUFFIX_TABLE_FIELDS}  # reads (and CRC-checks) each member
        keys, ids, counts = (arrays[k] for k in SUFFIX_TABLE_FIELDS)
        if (
            (keys.dtype, ids.dtype, counts.dtype) != (np.uint32, np.int32, np.float32)
            or keys.ndim != 2
            or keys.shape[1] != 2
            or ids.ndim != 2
            or ids.shape != counts.shape
            or ids.shape[0] != keys.shape[0]
            or (ids.size and (ids.min() < 0 or ids.max() >= vocab_size))
            or not np.isfinite(counts).all()
        ):
            raise ValueError("not tables of the shapes, types and token ids suffix_table.SuffixTables holds")
        return SuffixTables(**{k: jnp.asarray(a) for k, a in arrays.items()})

    def write(path):
        tables = fit_suffix_tables(corpora.training_sequences(tokenizer, cache_dir), vocab_size, max_ngram)
        arrays = {k: np.asarray(getattr(tables, k)) for k in SUFFIX_TABLE_FIELDS}
        registry.atomic_write(path, lambda f: np.savez(f, **arrays))

    return registry.cached_entry(path, load, write)
