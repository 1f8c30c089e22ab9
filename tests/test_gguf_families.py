"""GGUF files of the decoder families: models.gguf_loader against transformers.

Each case is a tiny random transformers model (norm scales perturbed, so a missing +1 or a
misplaced norm shows) written as a GGUF the way llama.cpp's converter writes that architecture
(tests/tiny_gguf.write_transformers: its metadata keys, tensor names, llama's permuted q / k
rows, Gemma 3's norms plus 1, Llama 3's rope_freqs.weight). What the loader reads back must give
transformers' logits: the config (ModelConfig(**read_config)), the parameters (load_params, the
stream a conversion writes), and at the GGUF precision the file's own blocks (load_block_params).

Tolerance: both sides compute in float32 on CPU from the same float32 weights (or the same
Q8_0 blocks); what differs is summation order. Seen: max |diff| <= 7e-7 (F32 files) and 9e-7
(Q8_0) for logits of magnitude <= 1. LOGIT_ATOL = 2e-5 is 20x that; a layout mistake (q / k left
permuted, a norm without its +1, a wrong rotary base or window) moves logits by 1e-3 to 0.3
(Q8_0 rounding alone moves them by 7e-3).

Needs torch and transformers (the `reference` extra): skipped with one line without them.
"""

import ast
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch and transformers (pip install -e .[reference])")
transformers = pytest.importorskip("transformers", reason="needs transformers (pip install -e .[reference])")

import gguf  # noqa: E402

from models import families, forward, gguf_loader, hf_config, init_cache, unstack_layers  # noqa: E402
from models.config import ModelConfig  # noqa: E402
from models.tokenizer import Tokenizer  # noqa: E402
from tests import tiny_gguf  # noqa: E402

LOGIT_ATOL = 2e-5
T = 12  # tokens per row: longer than the sliding windows below
COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
BYTE_VOCAB = 259  # tiny_gguf's byte-level vocabulary
SPM_VOCAB = len(tiny_gguf.spm_vocab()[0])
SLIDING, FULL = "sliding_attention", "full_attention"

# family case -> (config class name, its arguments, tiny_gguf.write_transformers options)
CASES = {
    "llama3": (
        "LlamaConfig",
        dict(
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
        {},
    ),
    # llama.cpp writes Mistral as arch llama and runs it without a window (as here: 4096 > T).
    "mistral": ("MistralConfig", dict(sliding_window=4096, tie_word_embeddings=True), {}),
    "qwen2": ("Qwen2Config", dict(), {}),
    "qwen3": ("Qwen3Config", dict(head_dim=32), {}),
    # llama.cpp's default pattern: layers 0-4 local, 5 global. Global layers scaled (linear 8).
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            num_hidden_layers=6,
            head_dim=32,
            query_pre_attn_scalar=32,
            sliding_window=4,
            rope_scaling=dict(rope_type="linear", factor=8.0),
        ),
        {},
    ),
    # A pattern llama.cpp cannot infer, written as per-layer flags; no rope.freq_base_swa (older
    # converters, the registry's Gemma 3 270M file): llama.cpp's local base 10000, as HF's.
    "gemma3_flags": (
        "Gemma3TextConfig",
        dict(
            head_dim=32,
            query_pre_attn_scalar=32,
            sliding_window=3,
            layer_types=[SLIDING, FULL, SLIDING, SLIDING],
        ),
        dict(swa_pattern=[True, False, True, True], swa_rope_base=False),
    ),
}
WINDOWED = ("gemma3", "gemma3_flags")


def _hf_model(case: str, **overrides):
    cls_name, extra, _ = CASES[case]
    vocab = SPM_VOCAB if cls_name.startswith("Gemma") else BYTE_VOCAB
    config = getattr(transformers, cls_name)(**{**COMMON, "vocab_size": vocab, **extra, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # non-trivial norm scales
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _tokens(vocab: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, vocab, (2, T))


def _hf_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def _logits(config: ModelConfig, params, tokens) -> np.ndarray:
    B = tokens.shape[0]
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    out = forward(config, params, jnp.asarray(tokens), positions, init_cache(config, B, 32))
    return np.asarray(out.logits)


def _written(tmp_path, case: str, ggml_type=gguf.GGMLQuantizationType.F32, **overrides):
    model = _hf_model(case, **overrides)
    path = tmp_path / f"{case}.gguf"
    tiny_gguf.write_transformers(path, model, ggml_type, **CASES[case][2])
    return model, path


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_of_each_family_gives_transformers_logits(case, tmp_path):
    model, path = _written(tmp_path, case)
    fields = gguf_loader.read_config(path)
    config = ModelConfig(**fields, attention_impl="xla", matmul_impl="xla").replace(max_seq_len=32)
    params = gguf_loader.load_params(path, config, progress=False)
    tokens = _tokens(config.vocab_size)
    ref = _hf_logits(model, tokens)
    layouts = (True, False) if case in WINDOWED else (True,)  # traced and Python layer indices
    for scan in layouts:
        c = config.replace(scan_layers=scan)
        p = params if scan else unstack_layers(params, c.num_layers)
        np.testing.assert_allclose(
            _logits(c, p, tokens), ref, atol=LOGIT_ATOL, rtol=0, err_msg=f"scan={scan}"
        )


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_config_is_the_checkpoint_config_as_llama_cpp_reads_it(case, tmp_path):
    """read_config of the GGUF agrees with models.hf_config of the same model's config.json on
    every family field, except what llama.cpp's llama architecture does not carry (Mistral's
    family and window) and the context length the tests set."""
    model, path = _written(tmp_path, case)
    from_gguf = gguf_loader.read_config(path)
    from_hf = hf_config.config_from_hf(json.loads(model.config.to_json_string()))
    if case == "mistral":
        assert (from_gguf["family"], from_gguf["local_layers"], from_gguf["sliding_window"]) == (
            "llama",
            (),
            None,
        )
        from_hf.update(family="llama", local_layers=(), sliding_window=None)
    if from_hf["rope_freq_divisors"] is not None:  # llama3: float32 factors in the file
        np.testing.assert_allclose(
            from_gguf.pop("rope_freq_divisors"), from_hf.pop("rope_freq_divisors"), rtol=1e-6
        )
    for key in set(gguf_loader.CONFIG_FIELDS) - {"name", "max_seq_len", "rope_freq_divisors"}:
        assert from_gguf[key] == pytest.approx(from_hf[key]), key


@pytest.mark.parametrize("case", ["mistral", "gemma3"])
def test_quantized_gguf_blocks_give_transformers_logits(case, tmp_path):
    """A file with Q8_0 matrices (llama's q / k rows permuted as whole rows of blocks) at dtype
    "gguf" (the blocks as the file ships them, ggml's kernels) against transformers reading the
    same GGUF (its own dequantization, un-permutation and norm shift). Without rope scaling:
    transformers' GGUF reader drops it (rope_freqs.weight and rope.scaling.factor are not read,
    so it runs Llama 3 and scaled Gemma 3 files with unscaled rope), and Gemma 3's head_dim at
    its config's default query_pre_attn_scalar (256), which llama.cpp's scale assumes."""
    pytest.importorskip("accelerate", reason="transformers reads a GGUF model only with accelerate")
    overrides = dict(rope_scaling=None)
    if case in WINDOWED:
        overrides.update(head_dim=256, query_pre_attn_scalar=256)
    _, path = _written(tmp_path, case, gguf.GGMLQuantizationType.Q8_0, **overrides)
    config = ModelConfig(
        **gguf_loader.read_config(path), attention_impl="xla", dtype="gguf", scan_layers=False
    )
    config = config.replace(max_seq_len=32)
    params = gguf_loader.load_block_params(path, config, progress=False)
    blocks = [
        x
        for x in jax.tree.leaves(params, is_leaf=lambda x: hasattr(x, "ggml_type"))
        if hasattr(x, "ggml_type")
    ]
    assert blocks and all(b.ggml_type == gguf.GGMLQuantizationType.Q8_0 for b in blocks)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32
    ).eval()
    tokens = _tokens(config.vocab_size)
    np.testing.assert_allclose(
        _logits(config, params, tokens), _hf_logits(reference, tokens), atol=LOGIT_ATOL, rtol=0
    )


def test_gemma3_sentencepiece_tokenizer_equals_transformers(tmp_path):
    """Gemma 3's SentencePiece-style GGUF vocabulary (no merges; byte tokens; spaces as "▁"):
    Tokenizer.from_gguf encodes and decodes as transformers' tokenizer of the same file, and so
    does its saved copy (what a conversion caches)."""
    _, path = _written(tmp_path, "gemma3")
    ours = Tokenizer.from_gguf(path)
    (tmp_path / "cache").mkdir()  # not beside the GGUF, where transformers would read it
    ours.save(tmp_path / "cache" / "tokenizer.json")
    cached = Tokenizer.load(tmp_path / "cache" / "tokenizer.json")
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    texts = [
        "hello world",
        "  the cat\n\nand   in",
        "héllo wörld!",  # ö is not a piece: byte fallback
        "<start_of_turn>hello<end_of_turn>",
        "<b>the</b> x",
        "",
    ]
    for text in texts:
        ids = theirs.encode(text)
        assert ours.encode(text) == ids, text
        assert cached.encode(text) == ids, text
        assert ours.decode(ids) == theirs.decode(ids), text
    assert ours.vocab_size == SPM_VOCAB and ours.bos_id == 2 and 1 in ours.stop_ids


@pytest.mark.parametrize("arch", ["phi3", "mistral3"])
def test_other_architectures_refused_naming_them(arch, tmp_path):
    path = tmp_path / "other.gguf"
    tiny_gguf.write(path, arch)
    with pytest.raises(
        ValueError, match=f"unsupported GGUF architecture '{arch}'; supported: llama, qwen2, qwen3, gemma3"
    ):
        gguf_loader.read_config(path)


def test_the_loader_names_no_architecture_each_is_its_family_entry():
    """What differs between GGUF architectures is read from models.families (a Family's gguf_*
    fields and its fixed settings): no string in models/gguf_loader.py names an architecture, so
    a family's GGUF support is its table entry (docs/design.md, "Adding a model family")."""
    tree = ast.parse(pathlib.Path(gguf_loader.__file__).read_text())
    named = {
        n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in families.GGUF_ARCHS
    }
    assert not named, f"gguf_loader names architectures: {sorted(named)}"
    assert gguf_loader.SUPPORTED_ARCHS == tuple(families.GGUF_ARCHS) == ("llama", "qwen2", "qwen3", "gemma3")
    assert gguf_loader.PERMUTED_ARCHS == ("llama",)
