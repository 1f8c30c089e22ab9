"""models.load of Hugging Face checkpoint folders, local GGUF files and hub ids (models.sources):
tiny random transformers models of each family give transformers' logits and exact greedy
speculative decoding; the cache entry of a folder is reused until the folder changes."""

import ast
import copy
import json
import os
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch and transformers: pip install -e '.[hf]'")
transformers = pytest.importorskip(
    "transformers", reason="needs torch and transformers: pip install -e '.[hf]'"
)

import tiny_gguf  # noqa: E402
from conftest import apply, cache_with_kernels  # noqa: E402

import models  # noqa: E402
import spec_jax  # noqa: E402
from models import convert, families, hf_checkpoint, hf_config  # noqa: E402
from models.tokenizer import Tokenizer  # noqa: E402
from scripts import tiny_checkpoints  # noqa: E402  (the tiny checkpoints of every family)

ROOT = pathlib.Path(__file__).resolve().parent.parent
VOCAB = tiny_checkpoints.VOCAB  # tiny_gguf's byte-level vocabulary: a GGUF draft pairs with every folder
EOS = tiny_checkpoints.EOS  # "<|endoftext|>"
T = 12  # the logits test's sequence: longer than the sliding windows below
ATOL = 2e-5  # float32 logits of magnitude ~1; measured differences are below 1e-6

FAMILIES = tiny_checkpoints.FAMILIES
CHAT_TEMPLATE = tiny_checkpoints.CHAT_TEMPLATE
_hf_model = tiny_checkpoints.hf_model


def _noisy_copy(model, scale: float):
    """The model with noise added to each weight (scale x its std): a draft that mostly agrees."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * p.std() * torch.randn_like(p))
    return model


_save = tiny_checkpoints.save


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (target folder, draft folder (the target with noise: it mostly agrees), the
    target's transformers model), and the tiny
    GGUF (its tokenizer is every folder's); conversions run in this process."""
    root = tmp_path_factory.mktemp("hf")
    gguf = root / "draft.gguf"
    tiny_gguf.write(gguf)
    tokenizer_json = Tokenizer.from_gguf(gguf).backend.to_str()
    out = {}
    for family in FAMILIES:
        target = _hf_model(family, 4 if family == "gemma3" else 3, seed=0)
        draft = _noisy_copy(target, 0.3)
        out[family] = (
            _save(target, root / family, tokenizer_json),
            _save(draft, root / f"{family}-draft", tokenizer_json),
            target,
        )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            convert,
            "convert_in_child",
            lambda name, cache_dir=None, progress=True, **kw: convert.convert(
                name, cache_dir, progress, **kw
            ),
        )
        yield out, gguf, cache_with_kernels(root / "cache")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_checkpoint_folder_loads_to_the_logits_of_transformers(checkpoints, family):
    """Both layer layouts, float32: max |ours - transformers'| < ATOL."""
    folders, _, cache = checkpoints
    folder, _, hf = folders[family]
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, T))
    with torch.no_grad():
        want = hf(torch.tensor(tokens)).logits.numpy()
    for scan in (True, False):
        model = models.load(str(folder), cache_dir=cache, progress=False, scan_layers=scan)
        assert model.config.family == family and model.tokenizer.stop_ids == (EOS,)
        config = model.config.replace(attention_impl="xla", matmul_impl="xla")
        positions = jnp.broadcast_to(jnp.arange(T), (2, T))
        got = apply(
            model.replace(config=config), jnp.asarray(tokens), positions, models.init_cache(config, 2, 32)
        )
        np.testing.assert_allclose(np.asarray(got.logits), want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_speculative_decoding_of_folders_equals_transformers_greedy_decoding(checkpoints, family):
    """A folder target, a folder draft of its family (the target with noise): greedy speculative output (one
    batch of two prompts) equals transformers' own greedy autoregressive decoding of the target,
    token for token (a comparison with transformers instead of this project's plain loop: the
    same property, and no second loop to compile)."""
    folders, _, cache = checkpoints
    target_folder, draft_folder, hf = folders[family]
    xla = dict(attention_impl="xla", matmul_impl="xla")  # the faster compile
    target, draft = (
        (m := models.load(str(f), cache_dir=cache, progress=False, scan_layers=True)).replace(
            config=m.config.replace(**xla)
        )
        for f in (target_folder, draft_folder)
    )
    prompts = [target.tokenizer.encode("hi there"), [5, 9, 2, 7, 7, 3, 8, 11, 4]]
    new = 10
    spec = spec_jax.generate(target, prompts, draft=draft, gamma=3, max_new_tokens=new, temperature=0.0)
    with torch.no_grad():
        want = [
            hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=new, min_new_tokens=new)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]
    assert spec.tokens == want
    assert 0 < spec.stats["num_accepted_tokens"] < spec.stats["num_draft_tokens"]


def _entry(cache, folder) -> pathlib.Path:
    return convert.converted_dir(str(folder), cache)


def test_granite_is_added_through_its_family_entry_alone():
    """The recipe's worked example (docs/design.md, "Adding a model family"): Granite is one entry
    in models.families.FAMILIES (its config.json mapping) plus its tiny checkpoint in
    scripts/tiny_checkpoints.FAMILIES; no other module of models/ names it, and the two tests
    above, run for every family, compare its logits and its greedy speculative decoding with
    transformers'."""
    named = sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "models").rglob("*.py")
        if "granite" in p.read_text().lower()
    )
    assert named == ["models/families.py"]
    assert "granite" in FAMILIES and "granite" in families.FAMILIES
    config = models.ModelConfig(**hf_config.config_from_hf(_hf_model("granite", 2).config.to_dict()))
    assert (config.embedding_multiplier, config.residual_multiplier, config.logits_scaling) == (3.0, 0.4, 2.5)
    assert config.attention_scale == 0.15


def test_a_folders_cache_entry_is_reused_and_converted_again_after_the_folder_changes(checkpoints, tmp_path):
    folders, _, _ = checkpoints
    cache = tmp_path / "cache"
    folder = folders["qwen2"][0]
    first = models.load(str(folder), cache_dir=cache, progress=False, scan_layers=True)
    entry = _entry(cache, folder)
    manifest = json.loads((entry / convert.MANIFEST).read_text())
    models.load(str(folder), cache_dir=cache, progress=False, scan_layers=True)
    assert json.loads((entry / convert.MANIFEST).read_text())["id"] == manifest["id"]  # reused
    # The checkpoint re-saved with other weights (the same names, shapes and config).
    hf = folders["qwen2"][2]
    with torch.no_grad():
        hf.model.embed_tokens.weight.mul_(2.0)
    try:
        hf.save_pretrained(folder)
        again = models.load(str(folder), cache_dir=cache, progress=False, scan_layers=True)
    finally:
        with torch.no_grad():
            hf.model.embed_tokens.weight.div_(2.0)
        hf.save_pretrained(folder)
    assert json.loads((entry / convert.MANIFEST).read_text())["id"] != manifest["id"]
    np.testing.assert_array_equal(
        np.asarray(again.params["embed"]["embedding"]), 2 * np.asarray(first.params["embed"]["embedding"])
    )
    assert [p.name for p in (cache / "converted").iterdir() if not p.name.startswith(".")] == [entry.name]


def test_a_folders_chat_template_reaches_the_loaded_tokenizer(checkpoints):
    """chat_template.jinja is kept with the converted tokenizer and renders a conversation."""
    folders, _, cache = checkpoints
    model = models.load(str(folders["qwen2"][0]), cache_dir=cache, progress=False)
    assert model.tokenizer.chat_template == CHAT_TEMPLATE
    text = model.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<user>hi\n<assistant>"


def test_a_folder_at_a_gguf_precision_is_refused_naming_the_allowed_ones(checkpoints):
    """(models.load of a GGUF file, the hub and bad paths: tests/test_load.py, no torch needed.)"""
    folders, _, cache = checkpoints
    with pytest.raises(ValueError, match=r"loads at float32, bfloat16, int8; gguf_q8 .* needs a GGUF source"):
        models.load(str(folders["qwen2"][0]), dtype="gguf_q8", cache_dir=cache, progress=False)
    assert models.fastest_precision(str(folders["qwen2"][0])) == "int8"


def _cli(*args, cache):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "SPEC_JAX_CACHE": str(cache)}
    return subprocess.run(
        [sys.executable, "-m", "launch.generate", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_cli_runs_a_folder_target_with_a_gguf_draft(checkpoints, tmp_path):
    """--target=FOLDER --draft=FILE.gguf, each converted by the conversion child."""
    folders, gguf, _ = checkpoints
    report = tmp_path / "report.json"
    result = _cli(
        f"--target={folders['qwen2'][0]}",
        f"--draft={gguf}",
        "--prompt=hi there",
        "--max_new_tokens=6",
        "--temperature=0",
        "--gamma=2",
        "--target_dtype=float32",
        "--draft_dtype=float32",
        "--attention_impl=xla",  # the CPU kernels' library would be built in the fresh cache
        "--matmul_impl=xla",
        f"--output_json={report}",
        cache=tmp_path / "cache",
    )
    assert result.returncode == 0, result.stderr
    assert f"converted {folders['qwen2'][0]}: peak memory" in result.stderr
    out = json.loads(report.read_text())
    assert out["target"] == str(folders["qwen2"][0]) and len(out["outputs"][0]["tokens"]) == 6


def test_a_bad_path_is_one_line_naming_the_flag_exit_2(tmp_path):
    """A folder without config.json as --draft: exit 2 before anything is loaded, one line
    naming the flag and what is wrong (tests/test_load.py checks the other bad paths)."""
    result = _cli("--target=random", f"--draft={tmp_path}", "--prompt=hi", cache=tmp_path / "cache")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert f"error: --draft: {tmp_path}: not a Hugging Face checkpoint folder (no config.json)" in lines[0]


def test_the_hf_config_reader_names_no_model_type_each_is_its_family_entry():
    """What differs between config.json model types is read from models.families (a Family's
    hf_model_types, hf_text_configs, fixed settings and scalars): no string constant in
    models/hf_config.py or models/hf_checkpoint.py is a model_type, so a family's checkpoint
    support is its table entry (docs/design.md, "Adding a model family")."""
    model_types = set(families.HF_MODEL_TYPES) | set(families.HF_TEXT_CONFIGS)
    for module in (hf_config, hf_checkpoint):
        tree = ast.parse(pathlib.Path(module.__file__).read_text())
        named = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in model_types}
        assert not named, f"{module.__name__} names model types: {sorted(named)}"
    assert hf_config.text_config({"model_type": "gemma3", "text_config": {"x": 1}}) == {
        "model_type": "gemma3_text",
        "x": 1,
    }
