"""models.load and the two layer layouts."""

import jax
import numpy as np
import pytest

import models
import spec_jax


def test_unknown_model_name_lists_the_known_ones():
    with pytest.raises(ValueError) as info:
        models.load("gpt-5")
    message = str(info.value)
    for name in ("random", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "smollm2-135m"):
        assert name in message


def test_bad_dtype_is_refused():
    with pytest.raises(ValueError, match="dtype"):
        models.load("random", dtype="float16")


@pytest.mark.xdist_group("tiny_target")  # the scanned run is test_speculative.py's draft = target loop
def test_scanned_and_unrolled_layers_give_identical_outputs(tiny_target):
    scanned = tiny_target
    unrolled = models.random_model(
        vocab_size=64, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, scan_layers=False
    )
    assert "layers" in scanned.params and "layers_1" in unrolled.params
    stacked_back = models.stack_layers(unrolled.params, 2)
    assert all(
        np.array_equal(a, b)
        for a, b in zip(
            jax.tree.leaves(stacked_back),
            jax.tree.leaves(scanned.params),
            strict=True,
        )
    )
    prompts = [[5, 9, 2], [1], [7, 7, 3, 8, 11, 4, 6, 2, 9, 10], [3, 3, 3, 1, 2, 60]]
    kwargs = dict(draft=scanned, gamma=4, max_new_tokens=13, temperature=1.0, seed=2)
    a = spec_jax.generate(scanned, prompts, **kwargs)
    b = spec_jax.generate(unrolled, prompts, **{**kwargs, "draft": unrolled})
    assert a.tokens == b.tokens


@pytest.mark.slow  # a real model's greedy identity; the default suite's twins use tiny models
@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_real_model_drafting_for_itself_accepts_everything(name):
    model = models.load(name, progress=False, scan_layers=True)  # scanned: compiles in seconds
    prompt = model.tokenizer.encode("def add(a, b):\n    return")
    # 11 tokens: the prefill's, then two whole rounds of gamma + 1.
    gen = spec_jax.generate(model, [prompt], draft=model, gamma=4, max_new_tokens=11, temperature=0.0)
    assert gen.stats["acceptance_rate"] == 1.0
    assert gen.stats["mean_accepted_length"] == 5.0 and gen.stats["num_rounds"] == 2
    ar = spec_jax.generate(model, [prompt], max_new_tokens=11, temperature=0.0)
    assert gen.tokens == ar.tokens


def test_a_plain_script_can_load_a_model_into_an_empty_cache(tmp_path):
    """A script whose top level calls models.load (no __main__ guard) on a cold cache: the
    conversion child must not re-import the script (multiprocessing's spawn did, and died with
    "An attempt has been made to start a new process before ... bootstrapping phase"). A tiny
    GGUF file stands in for a real model: the child converts it as it would one."""
    import os
    import subprocess
    import sys

    import tiny_gguf

    cache = tmp_path / "cache"
    gguf = tmp_path / "model.gguf"
    layers = tiny_gguf.write(gguf).config.num_layers
    script = tmp_path / "user_script.py"
    script.write_text(
        "import models\n"
        f"model = models.load({str(gguf)!r}, progress=False)\n"
        "print('layers', model.config.num_layers, model.tokenizer.encode('hi'))\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "SPEC_JAX_CACHE": str(cache), "PYTHONPATH": root, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"layers {layers} ")
    assert [p.name for p in (cache / "converted").glob("*/config.json")] == ["config.json"]


def test_a_conversion_killed_for_memory_is_one_clear_error(tmp_path, monkeypatch):
    import subprocess

    from models import convert

    monkeypatch.setattr(
        subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, returncode=-9, stdout="")
    )
    with pytest.raises(convert.ConversionError, match="SIGKILL, most likely by the out-of-memory killer"):
        convert.convert_in_child("smollm2-135m", tmp_path)


def test_errors_in_the_conversion_child_come_back_as_their_own_class(tmp_path):
    from models import convert, registry

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(registry.CacheNotWritableError, match="not writable"):
        convert.convert_in_child("smollm2-135m", blocker / "cache", progress=False)


# --- sources: paths and hub ids (models.sources; tests/test_hf_sources.py loads folders) ---------


def test_an_unknown_name_says_paths_and_hub_ids_are_accepted():
    with pytest.raises(ValueError) as info:
        models.load("gpt-5")
    assert "a local .gguf file, a Hugging Face checkpoint folder, or a Hugging Face hub id" in str(info.value)


def test_a_local_gguf_file_converts_through_the_same_pipeline_as_the_registry_model(tmp_path):
    import tiny_gguf

    from models import convert

    path = tmp_path / "weights" / "tiny.gguf"
    path.parent.mkdir()
    original = tiny_gguf.write(path)
    model = models.load(str(path), cache_dir=tmp_path / "cache", progress=False, scan_layers=True)
    for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(original.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert model.tokenizer.decode(model.tokenizer.encode("hi there")) == "hi there"
    entry = convert.converted_dir(str(path), tmp_path / "cache")
    assert entry.name.startswith("gguf-tiny.gguf-") and (entry / convert.MANIFEST).exists()
    assert models.fastest_precision(str(path)) == "int8"  # a toy: too small to gain from the GGUF kernel
    assert models.fastest_precision(str(tmp_path)) == "int8"  # a folder has no GGUF blocks


def test_place_gets_memory_maps_so_each_host_reads_only_its_shards(tmp_path):
    """models.load(place=...) hands the placement read-only memory maps of the cached
    checkpoint (what jax.make_array_from_callback slices per device, so a process of a
    multi-host mesh reads only its own shards), equal to the leaves of a plain load."""
    import tiny_gguf

    path = tmp_path / "tiny.gguf"
    tiny_gguf.write(path)
    plain = models.load(str(path), cache_dir=tmp_path / "cache", progress=False, scan_layers=True)
    seen = []

    def place(params):
        seen.extend(jax.tree.leaves(params))
        return jax.tree.map(lambda x: jax.device_put(np.asarray(x)), params)

    placed = models.load(
        str(path), cache_dir=tmp_path / "cache", progress=False, scan_layers=True, place=place
    )
    assert seen and all(isinstance(leaf, np.memmap) for leaf in seen)
    for a, b in zip(jax.tree.leaves(placed.params), jax.tree.leaves(plain.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_an_unsupported_architecture_is_refused_in_one_line_naming_it(tmp_path):
    import json

    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "phi3", "architectures": ["Phi3ForCausalLM"]})
    )
    with pytest.raises(ValueError) as info:
        models.load(str(tmp_path), cache_dir=tmp_path / "cache")
    assert "unsupported architecture Phi3ForCausalLM" in str(info.value) and "\n" not in str(info.value)


def test_a_hub_id_where_the_hub_is_unreachable_is_one_clear_error(tmp_path, monkeypatch):
    from models import registry

    constants = pytest.importorskip("huggingface_hub.constants", reason="huggingface_hub is not installed")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # no internet here either way
    with pytest.raises(registry.DownloadError) as info:
        models.load("someorg/somemodel", cache_dir=tmp_path / "cache")
    assert str(info.value).startswith(
        "someorg/somemodel: no such file or folder here, and the Hugging Face hub"
    )
    assert "\n" not in str(info.value)


def test_a_hub_id_without_huggingface_hub_is_one_clear_error(tmp_path, monkeypatch):
    import sys

    from models import registry

    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails: not installed
    with pytest.raises(
        registry.DownloadError, match="^someorg/somemodel: .*huggingface_hub is not installed"
    ):
        models.load("someorg/somemodel", cache_dir=tmp_path / "cache")


@pytest.mark.parametrize("flag", ["--target", "--draft"])
def test_what_a_model_flag_refuses_is_one_line_naming_the_flag(tmp_path, flag):
    from launch import common, runtime

    not_gguf = tmp_path / "weights.gguf"
    not_gguf.write_bytes(b"nope")
    for value, message in [
        (tmp_path / "nothing" / "here", "unknown model"),
        (not_gguf, "not a GGUF file"),
        (tmp_path, "not a Hugging Face checkpoint folder (no config.json)"),
    ]:
        with pytest.raises(common.UsageError) as info:
            runtime.check_model_flag(flag, str(value))
        assert str(info.value).startswith(f"{flag}: ") and message in str(info.value)
        assert "\n" not in str(info.value)
    for fine in ("random", "smollm2-135m", "someorg/somemodel"):  # a hub id is fetched by models.load
        runtime.check_model_flag(flag, fine)
