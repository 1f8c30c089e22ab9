"""Issue 39: a fresh cache's first run converts each model straight into the precision it runs
at. It wrote the whole model as float32 first (6.7 GB for the 1.5B, read back to cast it to
int8, 1.7 GB) and converted float32 parameters even for a GGUF precision, which reads the GGUF's
own blocks. An entry of the older layout (its manifest covering params/) still loads. And the
conversion reads the GGUF's header by struct, not through a GGUFReader."""

import json

import jax
import numpy as np
import pytest
import tiny_gguf

import models
from models import convert, gguf_loader, registry
from models.convert import MANIFEST
from models.tokenizer import Tokenizer


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """A cache holding the tiny model's verified GGUF, registered, converted in this process.
    (cache, entry folder, the model as written)."""
    cache = tmp_path / "cache"
    spec = tiny_gguf.install(cache)
    monkeypatch.setitem(registry.MODELS, spec.name, spec)
    monkeypatch.setattr(
        convert,
        "convert_in_child",
        lambda name, cache_dir=None, progress=True, **kw: convert.convert(name, cache_dir, progress, **kw),
    )
    return cache, cache / "converted" / spec.name, tiny_gguf.write(tmp_path / "copy.gguf")


def _load(cache, dtype):
    return models.load(tiny_gguf.NAME, dtype=dtype, cache_dir=cache, progress=False, scan_layers=True)


def _host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_an_int8_run_on_a_fresh_cache_writes_no_float32_parameters(tiny):
    cache, entry, _ = tiny
    _load(cache, "int8")
    assert sorted(p.name for p in entry.iterdir()) == [
        "config.json",
        "params-int8",
        MANIFEST,
        "tokenizer.json",
    ]
    assert set(json.loads((entry / MANIFEST).read_text())["files"]) == {"config.json", "tokenizer.json"}
    float32 = _load(cache, "float32")  # asked for later: added beside it, from the GGUF
    assert (entry / "params" / MANIFEST).exists()
    assert float32.config.dtype == "float32"


def test_a_gguf_precision_converts_no_parameters_at_all(tiny, monkeypatch):
    cache, entry, _ = tiny
    monkeypatch.setattr(convert.gguf_loader, "load_block_params", lambda path, config, progress=True: {})
    convert.load_converted(tiny_gguf.NAME, cache, progress=False, dtype="gguf")
    assert not any(p.name.startswith("params") for p in entry.iterdir())


def test_an_entry_of_the_older_layout_loads_and_takes_a_new_precision(tiny):
    cache, entry, original = tiny
    first = _load(cache, "float32")
    # The older layout: params/ without a manifest of its own, covered by the entry's.
    files = json.loads((entry / "params" / MANIFEST).read_text())["files"]
    (entry / "params" / MANIFEST).unlink()
    manifest = json.loads((entry / MANIFEST).read_text())
    manifest["files"].update({f"params/{rel}": v for rel, v in files.items()})
    (entry / MANIFEST).write_text(json.dumps(manifest))
    again = _load(cache, "float32")
    assert all(np.array_equal(a, b) for a, b in zip(_host(first.params), _host(again.params), strict=True))
    assert not (entry / "params" / MANIFEST).exists()  # used as it is, not converted again
    int8 = _load(cache, "int8")
    assert (entry / "params-int8" / MANIFEST).exists() and int8.config.dtype == "int8"


def test_the_conversion_reads_the_gguf_without_a_gguf_reader(tiny, monkeypatch):
    """A GGUFReader parsed every metadata item before the conversion could start (~9 s per Qwen
    file, twice in a fresh demo); the conversion reads the header by struct (read_index), and
    gets the same config, tokenizer and parameters."""
    cache, entry, original = tiny
    path = cache / "gguf" / f"{tiny_gguf.NAME}.gguf"
    reader = gguf_loader.GGUFReader(str(path), "r")
    index = gguf_loader.read_index(path)
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
        assert gguf_loader.metadata_value(index, key) == gguf_loader.metadata_value(reader, key), key
    assert gguf_loader.read_config(index, name="x") == gguf_loader.read_config(reader, name="x")
    text = "def f(x):\n    return x"
    expected = Tokenizer.from_gguf(reader).encode(text)

    class NoReader:
        def __init__(self, *args, **kwargs):
            raise AssertionError("a GGUFReader was opened")

    monkeypatch.setattr(gguf_loader, "GGUFReader", NoReader)
    model = _load(cache, "float32")
    assert all(np.array_equal(a, b) for a, b in zip(_host(model.params), _host(original.params), strict=True))
    assert model.tokenizer.encode(text) == expected
