"""The conversion streams: a GGUF converts, and a precision is derived, one block of one tensor
at a time, into exactly the parameters the whole-model path gives (models.convert)."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
import tiny_gguf

import models
from models import convert, gguf_loader, host_memory, registry, weights

ROOT = pathlib.Path(__file__).resolve().parent.parent
MB = 1 << 20


def _install(tmp_path, monkeypatch, arch="qwen2", **sizes):
    """The tiny model as a verified GGUF in a fresh cache, registered, converted in this process.
    (cache, the model written)."""
    cache = tmp_path / "cache"
    spec = tiny_gguf.install(cache, arch, **sizes)
    monkeypatch.setitem(registry.MODELS, spec.name, spec)
    monkeypatch.setattr(
        convert,
        "convert_in_child",
        lambda name, cache_dir=None, progress=True, **kw: convert.convert(name, cache_dir, progress, **kw),
    )
    return cache, tiny_gguf.write(tmp_path / "copy.gguf", arch, **sizes)


def _host(tree):
    return jax.tree.map(np.asarray, tree)


def _assert_equal(a, b):
    pa, pb = jax.tree_util.tree_flatten_with_path(a), jax.tree_util.tree_flatten_with_path(b)
    assert pa[1] == pb[1]
    for (path, x), (_, y) in zip(pa[0], pb[0], strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape, path
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), jax.tree_util.keystr(path)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_conversion_streamed_in_small_blocks_gives_the_written_parameters_exactly(
    tmp_path, monkeypatch, arch
):
    """Blocks of 2 KiB: every matrix is read in several blocks (whole heads for llama's q / k,
    whose rows the conversion un-permutes); the entry holds the float32 values written."""
    monkeypatch.setattr(gguf_loader, "BLOCK_BYTES", 2048)
    cache, original = _install(tmp_path, monkeypatch, arch)
    model = models.load(tiny_gguf.NAME, cache_dir=cache, progress=False, scan_layers=True)
    _assert_equal(_host(model.params), _host(original.params))
    tree = json.loads((cache / "converted" / tiny_gguf.NAME / "params" / convert.PARAMS_TREE).read_text())
    assert {tuple(leaf["path"]) for leaf in tree["leaves"]} == {
        tuple(weights.path_keys(p)) for p, _ in jax.tree_util.tree_flatten_with_path(original.params)[0]
    }


@pytest.mark.parametrize("dtype", ["int8", "bfloat16"])
def test_a_precision_derived_in_blocks_equals_casting_the_whole_model(tmp_path, monkeypatch, dtype):
    monkeypatch.setattr(gguf_loader, "BLOCK_BYTES", 2048)  # a few rows (or one layer) at a time
    cache, original = _install(tmp_path, monkeypatch)
    model = models.load(tiny_gguf.NAME, dtype=dtype, cache_dir=cache, progress=False, scan_layers=True)
    whole = weights.cast_params(_host(original.params), original.config.replace(dtype=dtype))
    _assert_equal(_host(model.params), _host(whole))


def conversion_peak_growth(source: str, cache, setup: str = "") -> int:
    """Bytes the peak RSS of a child process grows by while it converts `source` into `cache`
    (`setup`: Python run first, e.g. registering a model), measured from its RSS after jax has
    started (the old conversion started the backend, so it is started before the measurement)."""
    script = f"""
import json
import jax
from models import convert, registry
{setup}
jax.devices()
def status(key):
    return int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith(key))) * 1024
open("/proc/self/clear_refs", "w").write("5")  # the peak RSS is reset to the current RSS
start = status("VmRSS:")
convert.convert({source!r}, {str(cache)!r}, progress=False)
print(json.dumps({{"growth": status("VmHWM:") - start}}))
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])["growth"]


def test_converting_a_model_of_large_tensors_holds_about_one_tensor_at_a_time(tmp_path):
    """Ten 16 MB float32 matrices (two layers of d_model = mlp_dim = 2048), 168 MB in all: the
    conversion child's peak RSS grows by at most 1.5 tensors plus a fixed allowance (the old
    conversion held the whole model, and orbax's buffers, at once: it grew by about 2x the model)."""
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("no /proc/self/clear_refs: the peak RSS cannot be reset before the conversion")
    cache = tmp_path / "cache"
    sizes = {"d_model": 2048, "mlp_dim": 2048, "num_heads": 16, "num_kv_heads": 2}
    spec = tiny_gguf.install(cache, **sizes)
    tensor = 2048 * 2048 * 4
    register = f"registry.MODELS[{spec.name!r}] = registry.ModelSpec({spec.name!r}, (), {spec.sha256!r}, {spec.size})"
    growth = conversion_peak_growth(spec.name, cache, register)
    bound = 1.5 * tensor + 32 * MB
    assert growth < bound, f"peak RSS grew by {growth / MB:.0f} MB, bound {bound / MB:.0f} MB"


def test_converting_a_safetensors_folder_of_large_tensors_holds_about_one_tensor_at_a_time(tmp_path):
    """Nine 16 MB bfloat16 matrices of a one-layer llama folder (d_model = mlp_dim = vocab =
    2048), converted in a child: its peak RSS grows by at most 1.5 float32 tensors plus a fixed
    allowance (safetensors' maps of every file held open grew with the model)."""
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("no /proc/self/clear_refs: the peak RSS cannot be reset before the conversion")
    import ml_dtypes
    from safetensors.numpy import save_file

    from models.tokenizer import Tokenizer

    d = 2048
    folder = tmp_path / "big"
    folder.mkdir()
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": d,
        "hidden_size": d, "intermediate_size": d, "num_hidden_layers": 1, "num_attention_heads": 16,
        "num_key_value_heads": 16, "rms_norm_eps": 1e-5, "max_position_embeddings": 256,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)
    names = ["model.embed_tokens.weight", "lm_head.weight"] + [
        f"model.layers.0.{m}.weight"
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
        + ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    ]
    tensors = {n: rng.standard_normal((d, d), np.float32).astype(ml_dtypes.bfloat16) for n in names}
    for n in (
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
    ):
        tensors[n] = np.ones(d, ml_dtypes.bfloat16)
    save_file(tensors, str(folder / "model.safetensors"))
    del tensors
    gguf = tmp_path / "tok.gguf"
    tiny_gguf.write(gguf)
    (folder / "tokenizer.json").write_text(Tokenizer.from_gguf(gguf).backend.to_str())
    tensor = d * d * 4
    growth = conversion_peak_growth(str(folder), tmp_path / "cache")
    bound = 1.5 * tensor + 32 * MB
    assert growth < bound, f"peak RSS grew by {growth / MB:.0f} MB, bound {bound / MB:.0f} MB"


def _mapping_of(address: int) -> dict:
    """/proc/self/smaps' fields of the mapping that holds `address` (VmFlags as a set)."""
    fields, inside = {}, False
    for line in pathlib.Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
            start, end = (int(v, 16) for v in head.split("-"))
            inside = start <= address < end
        elif inside:
            name, _, value = line.partition(":")
            fields[name] = set(value.split()) if name == "VmFlags" else value.strip()
    return fields


def _thp_setting() -> str:
    try:
        text = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "never"
    return text.split("[")[1].split("]")[0]


def _mapped_path(address: int) -> str:
    """The path of the file mapped at `address` ("" for anonymous memory), from /proc/self/maps."""
    for line in pathlib.Path("/proc/self/maps").read_text().splitlines():
        head, *rest = line.split(maxsplit=5)
        start, end = (int(v, 16) for v in head.split("-"))
        if start <= address < end:
            return rest[4] if len(rest) == 5 else ""
    raise AssertionError(f"{address:#x} is in no mapping")


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="huge pages are for a CPU backend's weights")
@pytest.mark.skipif(_thp_setting() == "never", reason="this kernel has transparent huge pages off")
def test_a_leaf_read_from_the_cache_lands_on_huge_pages_and_is_used_there_without_a_copy(tmp_path):
    # one pass from the page cache: a copy of 1.8 GB of int8 weights after the read cost seconds
    a = np.arange(3 * host_memory.HUGE_PAGE // 4, dtype=np.float32).reshape(-1, 1024)
    np.save(tmp_path / "w.npy", a)
    leaf = {"file": "w.npy", "shape": list(a.shape), "dtype": "float32"}
    (host,) = convert._leaf_blocks(tmp_path, leaf)
    assert host.ctypes.data % host_memory.HUGE_PAGE == 0 and "hg" in _mapping_of(host.ctypes.data)["VmFlags"]
    view = host[1:]
    assert convert.on_huge_pages(host) is host and convert.on_huge_pages(view) is view  # no copy
    placed = convert.to_device([host], jax.tree.structure(0))
    np.testing.assert_array_equal(np.asarray(placed), a)
    assert placed.unsafe_buffer_pointer() == host.ctypes.data  # the read's memory, in place


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU client uses host arrays in place")
def test_to_device_copies_memory_mapped_leaves_so_no_weight_aliases_the_cache_file(tmp_path):
    # models.load hands to_device read-only memory maps of the cache's .npy files: a device
    # array in place over one would change (or fault) if that file were rewritten
    arrays = {
        "big": np.arange(3 * host_memory.HUGE_PAGE // 4, dtype=np.float32).reshape(-1, 1024),
        "small": np.arange(16, dtype=np.float32).reshape(4, 4),
    }
    maps = {}
    for name, a in arrays.items():
        np.save(tmp_path / f"{name}.npy", a)
        maps[name] = np.load(tmp_path / f"{name}.npy", mmap_mode="r")
    params = convert.to_device(*jax.tree.flatten(maps))
    for name, a in arrays.items():
        np.testing.assert_array_equal(np.asarray(params[name]), a)
        assert str(tmp_path) not in _mapped_path(params[name].unsafe_buffer_pointer()), name


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="huge pages are for a CPU backend's weights")
@pytest.mark.skipif(_thp_setting() == "never", reason="this kernel has transparent huge pages off")
def test_to_device_puts_weights_of_a_huge_page_or_more_on_huge_pages_in_place():
    big = np.arange(3 * host_memory.HUGE_PAGE // 4, dtype=np.float32).reshape(-1, 1024)  # 3 huge pages
    small = np.arange(16, dtype=np.float32).reshape(4, 4)
    params = convert.to_device(*jax.tree.flatten({"big": big, "small": small}))
    np.testing.assert_array_equal(np.asarray(params["big"]), big)
    np.testing.assert_array_equal(np.asarray(params["small"]), small)
    address = params["big"].unsafe_buffer_pointer()  # the CPU client uses the copy in place
    mapping = _mapping_of(address)
    assert address % host_memory.HUGE_PAGE == 0
    assert "hg" in mapping["VmFlags"]  # advised (MADV_HUGEPAGE) ...
    assert int(mapping["AnonHugePages"].split()[0]) * 1024 >= host_memory.HUGE_PAGE  # ... and on them
    assert convert.on_huge_pages(small) is small
