"""The target's features over text: what a draft head (models.draft_head) trains on.

`windows(...)` cuts tokenized documents into fixed windows; `extract(...)` runs the target over
them and keeps its last hidden state after the final norm at every position (float16 on the
host); `cached(...)` does both once per (target, precision, data settings) and keeps the result
under `$SPEC_JAX_CACHE/features/` as .npy files, written to temporary names and renamed into
place when complete (models.registry.cached_entry: locked, checked when read, rebuilt once).

Speed: the target runs with XLA's products and float32 weights (an int8 target's weights are
dequantized to the very values its int8 products use; a bfloat16 target's are widened), because
XLA's GEMM is the fast path for hundreds of rows on a CPU (the project's small-M kernel is
for decode and verification: docs/design.md). The features then equal those of the target at
its precision up to float32 rounding (bfloat16 targets: up to bfloat16 activations).
"""

import hashlib
import json
import pathlib
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from models import precision, registry
from models.config import ModelConfig
from models.transformer import forward, init_cache

FEATURE_DTYPE = np.float16  # on the host and on disk: half the bytes; features are O(1..100)


@flax.struct.dataclass
class Windows:
    tokens: np.ndarray  # int32 [N, T]
    mask: np.ndarray  # bool [N, T]: real tokens (a document's last window may be shorter)


def windows(sequences: Sequence[Sequence[int]], seq_len: int, max_tokens: int, seed: int) -> Windows:
    """Non-overlapping windows of seq_len tokens cut from each sequence (a document's tail of at
    least seq_len / 4 tokens makes a padded window), taken from the documents in an order
    shuffled by seed, one window per document per pass, until max_tokens real tokens."""
    if seq_len < 4:
        raise ValueError(f"seq_len must be at least 4, got {seq_len}")
    per_doc = []
    for seq in sequences:
        seq = np.asarray(seq, np.int32)
        cuts = [seq[i : i + seq_len] for i in range(0, len(seq), seq_len)]
        per_doc.append([c for c in cuts if len(c) >= max(2, seq_len // 4)])
    order = np.random.default_rng(seed).permutation(len(per_doc))
    chosen, total, depth = [], 0, 0
    while total < max_tokens and any(depth < len(d) for d in per_doc):
        for i in order:
            if depth < len(per_doc[i]) and total < max_tokens:
                chosen.append(per_doc[i][depth])
                total += len(per_doc[i][depth])
        depth += 1
    tokens = np.zeros((len(chosen), seq_len), np.int32)
    mask = np.zeros((len(chosen), seq_len), bool)
    for n, c in enumerate(chosen):
        tokens[n, : len(c)] = c
        mask[n, : len(c)] = True
    return Windows(tokens=tokens, mask=mask)


def float32_twin(config: ModelConfig, params) -> tuple[ModelConfig, object]:
    """(config, params) of the same target with float32 weights and XLA's products: int8
    matrices dequantized (the values the int8 products use), bfloat16 widened."""
    params = jax.tree.map(
        lambda w: precision.dequantize(w).astype(jnp.float32),
        params,
        is_leaf=lambda x: isinstance(x, precision.Int8Weight),
    )
    return config.replace(dtype="float32", matmul_impl="xla"), params


def extract(config: ModelConfig, params, data: Windows, batch_size: int = 4, progress: bool = True):
    """(features float16 [N, T, D], greedy int32 [N, T]) of `config` / `params` (a decoder at any
    precision, run as its float32 twin) at every position of every window (from position 0 of
    each window): the last hidden state after the final norm, and the argmax of the logits
    there (the token the target would emit next at temperature 0)."""
    config, params = float32_twin(config, params)
    n, width = data.tokens.shape

    @jax.jit
    def run(params, tokens):
        positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), tokens.shape)
        cache = init_cache(config, tokens.shape[0], width)
        out = forward(config, params, tokens, positions, cache, with_features=True)
        return out.features, jnp.argmax(out.logits, axis=-1).astype(jnp.int32)

    features = np.zeros((n, width, config.d_model), FEATURE_DTYPE)
    greedy = np.zeros((n, width), np.int32)
    with tqdm(total=int(data.mask.sum()), unit="tok", desc="target features", disable=not progress) as bar:
        for start in range(0, n, batch_size):
            chunk = data.tokens[start : start + batch_size]
            pad = batch_size - len(chunk)
            if pad:  # one compiled shape
                chunk = np.concatenate([chunk, np.zeros((pad, width), np.int32)])
            f, g = jax.device_get(run(params, jnp.asarray(chunk)))
            features[start : start + batch_size] = f[: batch_size - pad].astype(FEATURE_DTYPE)
            greedy[start : start + batch_size] = g[: batch_size - pad]
            bar.update(int(data.mask[start : start + batch_size].sum()))
    return features, greedy


def cache_key(model_key: dict, data_key: dict) -> str:
    blob = json.dumps({"model": model_key, "data": data_key}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@flax.struct.dataclass
class FeatureSet:
    windows: Windows
    features: np.ndarray  # float16 [N, T, D] (memory-mapped when read from the cache)
    greedy: np.ndarray  # int32 [N, T]: the target's argmax after each position

    def __len__(self) -> int:
        return self.windows.tokens.shape[0]


FEATURE_FILES = {"tokens": np.int32, "mask": np.bool_, "greedy": np.int32, "features": FEATURE_DTYPE}


def cached(
    folder, make_windows, config: ModelConfig, params, batch_size: int = 4, progress=True
) -> FeatureSet:
    """The FeatureSet in `folder`, computed on first use (make_windows() -> Windows, then
    extract) and written there (models.registry.cached_entry: two processes never compute the
    same set at once; a damaged set is computed again once). Each file is written atomically,
    the features last: their presence marks a complete set, and a rebuild removes them first.
    A set is damaged when a file does not load or the four disagree in shape or type."""
    folder = pathlib.Path(folder)
    files = {name: folder / f"{name}.npy" for name in FEATURE_FILES}

    def load(folder):
        if not files["features"].exists():
            raise FileNotFoundError(f"no {files['features'].name}: an incomplete set")
        arrays = {
            name: np.load(path, mmap_mode="r" if name == "features" else None, allow_pickle=False)
            for name, path in files.items()
        }
        tokens, features = arrays["tokens"], arrays["features"]
        if (
            any(arrays[k].dtype != dtype for k, dtype in FEATURE_FILES.items())
            or tokens.ndim != 2
            or any(arrays[k].shape != tokens.shape for k in ("mask", "greedy"))
            or features.shape != (*tokens.shape, config.d_model)
        ):
            raise ValueError("files whose shapes or types disagree")
        return FeatureSet(Windows(tokens=arrays["tokens"], mask=arrays["mask"]), features, arrays["greedy"])

    def write(folder):
        folder.mkdir(parents=True, exist_ok=True)
        files["features"].unlink(missing_ok=True)  # the set is incomplete until they are back
        data = make_windows()
        features, greedy = extract(config, params, data, batch_size, progress)
        for name, array in (
            ("tokens", data.tokens),
            ("mask", data.mask),
            ("greedy", greedy),
            ("features", features),
        ):
            array = np.asarray(array, FEATURE_FILES[name])
            registry.atomic_write(files[name], lambda f, a=array: np.save(f, a))

    return registry.cached_entry(folder, load, write)
