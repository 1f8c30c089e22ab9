"""models.gguf_loader: config from metadata, the llama q/k permutation, and converted weights.

The converted weights are checked end to end with a plain-NumPy forward pass (written here from
ModelConfig's docstring, independent of models/transformer.py) against the logits transformers
recorded in tests/fixtures. That catches any transposition, reshape or permutation mistake:
skipping the llama un-permutation, for instance, moves SmolLM2's logits by up to ~13.
"""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from models import registry
from models.config import ModelConfig
from models.gguf_loader import (
    load_params,
    open_gguf,
    permute_llama_rows,
    read_config,
    unpermute_llama_rows,
)

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
ROOT = pathlib.Path(__file__).resolve().parents[1]

# Architecture numbers from DESIGN.md and the models' published configs.
KNOWN = {
    "smollm2-135m": dict(
        vocab_size=49152, num_layers=30, d_model=576, num_heads=9, num_kv_heads=3, head_dim=64, mlp_dim=1536,
        rope_theta=100000.0, rms_eps=1e-5, qkv_bias=False, tie_embeddings=True, max_seq_len=8192,
    ),
    "qwen2.5-coder-0.5b": dict(
        vocab_size=151936, num_layers=24, d_model=896, num_heads=14, num_kv_heads=2, head_dim=64,
        mlp_dim=4864, rope_theta=1e6, rms_eps=1e-6, qkv_bias=True, max_seq_len=32768,
        # Qwen2.5-0.5B ties its head in HF, but this GGUF stores output.weight (Q8_0) apart from
        # token_embd (Q5_0), so the dequantized matrices differ and the head is untied.
        tie_embeddings=False,
    ),
    "qwen2.5-coder-1.5b": dict(
        vocab_size=151936, num_layers=28, d_model=1536, num_heads=12, num_kv_heads=2, head_dim=128,
        mlp_dim=8960, rope_theta=1e6, rms_eps=1e-6, qkv_bias=True, tie_embeddings=False, max_seq_len=32768,
    ),
}  # fmt: skip

# The numpy forward below runs in float64 on float32 weights; transformers ran float32. Seen:
# max |diff| 5e-5 (SmolLM2) and 1e-4 (Qwen 0.5B) for logits of std ~2-4, so 1e-3 is 10x headroom
# and still 4 orders of magnitude below the error of a layout mistake.
LOGIT_ATOL = 1e-3

_PARAMS: dict = {}
_READERS: dict = {}


def _path(name):
    return registry.fetch_gguf(name, progress=False)


def _reader(name):
    # Opening parses all metadata (3 s for SmolLM2, 9 s for a Qwen vocabulary): once per model.
    if name not in _READERS:
        _READERS[name] = open_gguf(_path(name))
    return _READERS[name]


def _loaded(name):
    """(config dict, numpy params); only SmolLM2's are kept (several tests use them)."""
    if name in _PARAMS:
        return _PARAMS[name]
    reader = _reader(name)
    config = read_config(reader, name=name)
    loaded = (config, load_params(reader, config, progress=False))
    if name == "smollm2-135m":
        _PARAMS[name] = loaded
    return loaded


def _fixture(name):
    return json.loads((FIXTURES / f"{name}.json").read_text(encoding="utf-8"))


# ---- permutation (no download) --------------------------------------------------------------------


@pytest.mark.parametrize(
    "n_head, head_dim, rest", [(9, 64, (576,)), (3, 64, (5,)), (2, 8, ()), (4, 6, (3, 2))]
)
def test_llama_permutation_inverse_round_trips(n_head, head_dim, rest):
    w = np.random.default_rng(0).standard_normal((n_head * head_dim, *rest))
    p = permute_llama_rows(w, n_head)
    assert not np.array_equal(p, w), "the permutation must move rows"
    np.testing.assert_array_equal(unpermute_llama_rows(p, n_head), w)
    np.testing.assert_array_equal(permute_llama_rows(unpermute_llama_rows(w, n_head), n_head), w)


def _rope_rotate_half(x, pos, theta=10000.0):
    half = x.shape[-1] // 2
    ang = (pos[:, None] * theta ** (-np.arange(half) / half))[:, None, :]  # [T, 1, Dh/2]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], -1)


def _rope_interleaved(x, pos, theta=10000.0):
    """GPT-J / llama.cpp 'normal' rope: rotates pairs (2j, 2j + 1) by angle j."""
    half = x.shape[-1] // 2
    ang = (pos[:, None] * theta ** (-np.arange(half) / half))[:, None, :]
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * np.cos(ang) - b * np.sin(ang)
    out[..., 1::2] = b * np.cos(ang) + a * np.sin(ang)
    return out


def test_permutation_maps_rotate_half_to_interleaved_rope():
    """What llama.cpp stores (P W) under interleaved rope == P (rotate-half rope of W x): so the
    un-permuted rows are exactly what a rotate-half model needs."""
    rng = np.random.default_rng(1)
    n_head, dh, d, t = 3, 16, 24, 5
    w = rng.standard_normal((n_head * dh, d))
    x = rng.standard_normal((t, d))
    pos = np.arange(t, dtype=np.float64) * 3.0
    hf = _rope_rotate_half((x @ w.T).reshape(t, n_head, dh), pos)  # [T, H, Dh]
    stored = permute_llama_rows(w, n_head)
    ggml = _rope_interleaved((x @ stored.T).reshape(t, n_head, dh), pos)
    # Permuting the per-head rows of the HF result gives the llama.cpp result.
    np.testing.assert_allclose(
        permute_llama_rows(hf.reshape(t, -1).T, n_head).T.reshape(t, n_head, dh), ggml, atol=1e-12
    )
    back = unpermute_llama_rows(stored, n_head)
    np.testing.assert_allclose(_rope_rotate_half((x @ back.T).reshape(t, n_head, dh), pos), hf, atol=1e-12)


# ---- real files -----------------------------------------------------------------------------------


def test_smollm2_config_from_metadata():
    cfg = read_config(_reader("smollm2-135m"))
    assert {k: cfg[k] for k in KNOWN["smollm2-135m"]} == KNOWN["smollm2-135m"]
    assert cfg["name"] == "Smollm2 135M 8k Lc100K Mix1 Ep2"  # general.name unless given
    assert read_config(_reader("smollm2-135m"), name="smollm2-135m")["name"] == "smollm2-135m"
    ModelConfig(**cfg)  # valid as a config


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_qwen_config_from_metadata(name):
    cfg = read_config(_reader(name), name=name)
    assert {k: cfg[k] for k in KNOWN[name]} == KNOWN[name]
    assert cfg["name"] == name
    ModelConfig(**cfg)


@pytest.mark.parametrize(
    "name",
    [
        "smollm2-135m",
        pytest.param("qwen2.5-coder-0.5b", marks=pytest.mark.slow),
        pytest.param("qwen2.5-coder-1.5b", marks=pytest.mark.slow),
    ],
)
def test_config_agrees_with_transformers(name):
    hf = _fixture(name)["hf_config"]
    cfg = read_config(_reader(name))
    assert cfg["vocab_size"] == hf["vocab_size"]
    assert cfg["num_layers"] == hf["num_hidden_layers"]
    assert cfg["d_model"] == hf["hidden_size"]
    assert cfg["num_heads"] == hf["num_attention_heads"]
    assert cfg["num_kv_heads"] == hf["num_key_value_heads"]
    assert cfg["head_dim"] == hf["head_dim"]
    assert cfg["mlp_dim"] == hf["intermediate_size"]
    assert cfg["rope_theta"] == hf["rope_theta"]
    assert cfg["rms_eps"] == pytest.approx(hf["rms_norm_eps"], rel=1e-6)
    assert cfg["tie_embeddings"] == hf["lm_head_is_embedding"]
    assert cfg["max_seq_len"] == hf["max_position_embeddings"]


def _expected_shapes(c):
    L, D, H, KVH, Dh, F, V = (
        c.num_layers,
        c.d_model,
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
        c.mlp_dim,
        c.vocab_size,
    )
    attn = {"wq": (L, H, Dh, D), "wk": (L, KVH, Dh, D), "wv": (L, KVH, Dh, D), "wo": (L, D, H, Dh)}
    if c.qkv_bias:
        attn |= {"bq": (L, H, Dh), "bk": (L, KVH, Dh), "bv": (L, KVH, Dh)}
    shapes = {
        "embed": {"embedding": (V, D)},
        "layers": {
            "attn_norm": {"scale": (L, D)},
            "attn": attn,
            "mlp_norm": {"scale": (L, D)},
            "mlp": {"w_gate": (L, F, D), "w_up": (L, F, D), "w_down": (L, D, F)},
        },
        "final_norm": {"scale": (D,)},
    }
    if not c.tie_embeddings:
        shapes["lm_head"] = {"embedding": (V, D)}
    return shapes


def _shapes(tree):
    return {k: _shapes(v) if isinstance(v, dict) else tuple(v.shape) for k, v in tree.items()}


def test_load_params_layout_smollm2():
    cfg, params = _loaded("smollm2-135m")
    config = ModelConfig(**cfg)
    assert _shapes(params) == _expected_shapes(config)
    assert "lm_head" not in params  # tied
    leaves = [params["embed"]["embedding"], params["layers"]["attn"]["wq"], params["layers"]["mlp"]["w_down"]]
    assert all(x.dtype == np.float32 and np.isfinite(x).all() for x in leaves)
    # The same tree the Flax model builds (models/transformer.py), when it is there.
    transformer = pytest.importorskip("models.transformer")
    flax_shapes = transformer.param_shapes(config)
    assert _shapes(params) == _shapes(flax_shapes)


def test_load_params_rejects_a_mismatched_config():
    reader = _reader("smollm2-135m")
    cfg = dict(read_config(reader), num_layers=29)
    with pytest.raises(ValueError, match="num_layers=29 does not match the GGUF file"):
        load_params(reader, cfg, progress=False)


def test_load_params_bfloat16():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    params = load_params(_reader("smollm2-135m"), dtype=ml_dtypes.bfloat16, progress=False)
    wq = params["layers"]["attn"]["wq"]
    assert wq.dtype == ml_dtypes.bfloat16
    f32 = _loaded("smollm2-135m")[1]["layers"]["attn"]["wq"]
    np.testing.assert_allclose(wq.astype(np.float32), f32, rtol=1e-2, atol=1e-6)


# ---- numpy reference forward -----------------------------------------------------------------------


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def numpy_forward(params, c: dict, ids) -> np.ndarray:
    """Logits [T, V] of one sequence, full causal attention from position 0; float64 activations."""
    ids = np.asarray(ids)
    t = len(ids)
    pos = np.arange(t, dtype=np.float64)
    x = params["embed"]["embedding"][ids].astype(np.float64)
    lay, a = params["layers"], params["layers"]["attn"]
    group = c["num_heads"] // c["num_kv_heads"]
    causal = np.tril(np.ones((t, t), bool))
    for i in range(c["num_layers"]):
        h = _rms(x, lay["attn_norm"]["scale"][i], c["rms_eps"])
        q, k, v = (np.einsum("td,hkd->thk", h, a[w][i]) for w in ("wq", "wk", "wv"))
        if c["qkv_bias"]:
            q, k, v = q + a["bq"][i], k + a["bk"][i], v + a["bv"][i]
        q, k = _rope_rotate_half(q, pos, c["rope_theta"]), _rope_rotate_half(k, pos, c["rope_theta"])
        k, v = (
            np.repeat(k, group, axis=1),
            np.repeat(v, group, axis=1),
        )  # query head h reads kv head h // group
        s = np.einsum("thk,shk->hts", q, k) / np.sqrt(q.shape[-1])
        s = np.where(causal, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        x = x + np.einsum("thk,dhk->td", np.einsum("hts,shk->thk", p, v), a["wo"][i])
        h = _rms(x, lay["mlp_norm"]["scale"][i], c["rms_eps"])
        gate = h @ lay["mlp"]["w_gate"][i].T
        x = x + (gate / (1 + np.exp(-gate)) * (h @ lay["mlp"]["w_up"][i].T)) @ lay["mlp"]["w_down"][i].T
    x = _rms(x, params["final_norm"]["scale"], c["rms_eps"]).astype(np.float32)
    head = params["embed"]["embedding"] if c["tie_embeddings"] else params["lm_head"]["embedding"]
    return x @ head.T


@pytest.mark.parametrize("name", ["smollm2-135m", pytest.param("qwen2.5-coder-0.5b", marks=pytest.mark.slow)])
def test_converted_weights_reproduce_reference_logits(name):
    cfg, params = _loaded(name)
    fixture = _fixture(name)
    vocab_ids = np.array(fixture["vocab_ids"])
    for prompt in fixture["prompts"]:
        logits = numpy_forward(params, cfg, prompt["ids"])
        np.testing.assert_array_equal(logits.argmax(-1), prompt["top1"], err_msg=prompt["text"])
        np.testing.assert_allclose(
            logits[:, vocab_ids], prompt["logits_at_vocab_ids"], atol=LOGIT_ATOL, rtol=0
        )
        top = np.take_along_axis(logits, np.array(prompt["top_ids"]), -1)
        np.testing.assert_allclose(top, prompt["top_logits"], atol=LOGIT_ATOL, rtol=0)
        m = logits.max(-1)
        lse = m + np.log(np.exp(logits - m[:, None]).sum(-1))
        np.testing.assert_allclose(lse, prompt["logsumexp"], atol=LOGIT_ATOL, rtol=0)


@pytest.mark.slow
def test_largest_model_converts_within_memory():
    """The 1.5B model (7.1 GB of float32) must convert well under the machine's 24 GB."""
    code = (
        "import resource, sys\n"
        "from models import registry\n"
        "from models.gguf_loader import load_params\n"
        "p = load_params(registry.fetch_gguf('qwen2.5-coder-1.5b', progress=False), progress=False)\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    peak_gb = int(out.stdout.split()[-1]) / 1e6  # ru_maxrss is in KiB on Linux
    assert peak_gb < 10.0, f"peak RSS {peak_gb:.1f} GB"
