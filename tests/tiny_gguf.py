"""A tiny Qwen2-style model written as a GGUF file (float32 tensors, a byte-level vocabulary),
and a registry entry for it: models.convert and models.load run on it in a second, offline."""

import hashlib
import math
import pathlib

import gguf
import jax
import numpy as np

import models
from models import gguf_loader, registry, weights

NAME = "tiny-gguf"
_BYTE_SYMBOLS = (
    list(range(ord("!"), ord("~") + 1))
    + list(range(ord("¡"), ord("¬") + 1))
    + list(range(ord("®"), ord("ÿ") + 1))
)


def _byte_tokens() -> list[str]:
    """GPT-2's byte-level alphabet: one printable character per byte."""
    extra = iter(range(256, 512))
    return [chr(b) if b in _BYTE_SYMBOLS else chr(next(extra)) for b in range(256)]


def write(
    path: pathlib.Path,
    arch: str = "qwen2",
    *,
    chat_template: str | None = None,
    add_bos: bool = False,
    **sizes,
) -> models.Model:
    """Writes the tiny model's GGUF to path; returns the model (float32 params as written).
    `arch` "llama" permutes the q / k rows as llama.cpp does; `sizes` (models.random_model's
    arguments) replace the tiny ones. `chat_template`: written as tokenizer.chat_template, with
    <|endoftext|> and <|im_end|> marked as control tokens (matched whole in text, as a real
    chat model's file marks them). `add_bos`: tokenizer.ggml.add_bos_token, <|endoftext|> the BOS."""
    tokens = _byte_tokens() + ["hi", "<|endoftext|>", "<|im_end|>"]
    sizes = {"num_layers": 2, "d_model": 32, "num_heads": 4, "num_kv_heads": 2, **sizes}
    model = models.random_model(vocab_size=len(tokens), seed=3, name=NAME, **sizes)
    c = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_layers)
    writer.add_embedding_length(c.d_model)
    writer.add_head_count(c.num_heads)
    writer.add_head_count_kv(c.num_kv_heads)
    writer.add_feed_forward_length(c.mlp_dim)
    writer.add_layer_norm_rms_eps(c.rms_eps)
    writer.add_context_length(c.max_seq_len)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges(["h i"])
    writer.add_eos_token_id(len(tokens) - 2)
    if chat_template is not None:
        writer.add_token_types([1] * (len(tokens) - 2) + [3, 3])
        writer.add_chat_template(chat_template)
    if add_bos:
        writer.add_bos_token_id(len(tokens) - 2)
        writer.add_add_bos_token(True)
    params = jax.tree.map(np.asarray, model.params)
    for w in weights.weights_of(c):
        node = params["layers"] if w.per_layer else params
        for key in w.path:
            node = node[key]
        for i in range(c.num_layers) if w.per_layer else [None]:
            x = node if i is None else node[i]
            rows = int(np.prod(x.shape[: x.ndim - w.contract])) if w.contract else 1
            if arch == "llama" and w.llama_permuted_heads:  # rows [heads * head_dim, ...]
                heads = getattr(c, w.llama_permuted_heads)
                x = gguf_loader.permute_llama_rows(x.reshape(x.shape[0] * x.shape[1], -1), heads)
            writer.add_tensor(w.gguf.format(i=i), np.ascontiguousarray(x.reshape(rows, -1), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


def install(cache: pathlib.Path, arch: str = "qwen2", **options) -> registry.ModelSpec:
    """Writes the tiny GGUF (write's arguments) as a verified cache entry of cache (as
    fetch_gguf would have) and returns its registry spec (register it in registry.MODELS)."""
    path = cache / "gguf" / f"{NAME}.gguf"
    path.parent.mkdir(parents=True, exist_ok=True)
    write(path, arch, **options)
    data = path.read_bytes()
    return registry.ModelSpec(NAME, (), hashlib.sha256(data).hexdigest(), len(data))


# ---- transformers models written as llama.cpp's converter writes them -------------------------
# (convert_hf_to_gguf.py of the llama.cpp source vendored in the llama-cpp-python sdist:
# conversion/base.py TextModel.set_gguf_parameters, llama.py LlamaModel, qwen.py Qwen2Model /
# Qwen3Model, gemma.py Gemma3Model). Tensor names come from the `gguf` package's own map
# (gguf.get_tensor_name_map), as the converter's map_tensor_name does, not from models.weights.

# transformers model_type -> the GGUF architecture the converter writes (Mistral: LlamaModel).
GGUF_ARCHS = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
}

# A SentencePiece-style vocabulary as Gemma 3's GGUF stores it: control tokens, the unknown
# token, 256 byte tokens, pieces with "▁" for a space (a piece of spaces only stored as spaces),
# one user-defined token. Tokenizer type "llama", no merges.
SPM_SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
SPM_PIECES = (
    ["▁", "  ", "   ", "\n", "\n\n", "<b>"]
    + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    + ["▁t", "he", "▁the", "▁a", "in", "▁in", "er", "▁w", "or", "ld", "▁wor", "▁world", "ll", "▁he"]
    + ["▁hell", "▁hello", "o", "an", "▁an", "▁and", "at", "▁c", "▁cat", "é", ".", ",", "!", "▁▁"]
)


def spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) of the SentencePiece-style test vocabulary."""
    tokens = SPM_SPECIAL + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES
    types = [gguf.TokenType.CONTROL] * len(SPM_SPECIAL) + [gguf.TokenType.BYTE] * 256
    types += [gguf.TokenType.USER_DEFINED if t == "<b>" else gguf.TokenType.NORMAL for t in SPM_PIECES]
    types[SPM_SPECIAL.index("<unk>")] = gguf.TokenType.UNKNOWN
    # Scores that do not follow the file order (as in Gemma's file): the merges follow the order.
    scores = [-1000.0] * (len(SPM_SPECIAL) + 256) + [float(i) for i in range(len(SPM_PIECES))]
    return tokens, scores, [int(t) for t in types]


def _add_vocab(writer: gguf.GGUFWriter, arch: str, vocab_size: int) -> None:
    """A vocabulary of exactly vocab_size tokens: Gemma 3's SentencePiece style (spm_vocab), else
    the byte-level one of `write` padded with placeholder tokens."""
    if arch == "gemma3":
        tokens, scores, types = spm_vocab()
        if len(tokens) != vocab_size:
            raise ValueError(f"the SentencePiece test vocabulary has {len(tokens)} tokens, not {vocab_size}")
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_bos_token_id(SPM_SPECIAL.index("<bos>"))
        writer.add_eos_token_id(SPM_SPECIAL.index("<eos>"))
        writer.add_unk_token_id(SPM_SPECIAL.index("<unk>"))
        writer.add_pad_token_id(SPM_SPECIAL.index("<pad>"))
        writer.add_add_bos_token(True)
        writer.add_add_space_prefix(False)  # Gemma3Model.set_vocab
        return
    tokens = _byte_tokens() + ["hi", "<|endoftext|>", "<|im_end|>"]
    tokens += [f"<|extra_{i}|>" for i in range(vocab_size - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens[:vocab_size])
    writer.add_token_merges(["h i"])
    writer.add_eos_token_id(257)


def llama3_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """LlamaModel.generate_extra_tensors: the rope_freqs.weight tensor of rope type llama3."""
    base = rope.get("rope_theta", 10000.0)
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)))
    factor, low, high = (
        rope.get("factor", 8.0),
        rope.get("low_freq_factor", 1.0),
        rope.get("high_freq_factor", 4.0),
    )
    old = rope.get("original_max_position_embeddings", 8192)
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, np.float32)


def write_transformers(
    path, model, ggml_type=gguf.GGMLQuantizationType.F32, swa_pattern=None, swa_rope_base=True
) -> str:
    """Writes a transformers causal LM (one of GGUF_ARCHS, float32) as a GGUF file the way
    llama.cpp's converter writes its architecture: the metadata keys, the tensor names, llama's
    q / k rows permuted, Gemma 3's norm scales plus 1 and no output.weight when the head is tied,
    llama3 rope scaling as rope_freqs.weight. Matrices in ggml_type (F32 or a block format,
    quantized by the gguf package), vectors F32. swa_pattern: Gemma 3's per-layer sliding flags
    (attention.sliding_window_pattern), which the converter leaves out (llama.cpp's default then:
    every 6th layer global). swa_rope_base=False leaves rope.freq_base_swa out, as converters
    before it did (the registry's Gemma 3 270M file): llama.cpp's default 10000 then. Returns the
    architecture."""
    cfg = model.config
    arch = GGUF_ARCHS[cfg.model_type]
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    full = rope.get("full_attention", rope)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    if full.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])
    writer.add_rope_freq_base(full["rope_theta"])
    if "sliding_attention" in rope and swa_rope_base:
        writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if arch == "llama":
        writer.add_vocab_size(cfg.vocab_size)
        writer.add_rope_dimension_count(head_dim)
    if arch == "gemma3":
        writer.add_sliding_window(cfg.sliding_window)
        if swa_pattern is not None:
            writer.add_sliding_window_pattern(swa_pattern)
    _add_vocab(writer, arch, cfg.vocab_size)
    names = gguf.get_tensor_name_map(
        next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), cfg.num_hidden_layers
    )
    tied = cfg.tie_word_embeddings
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue
        x = tensor.detach().float().numpy()
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            x = gguf_loader.permute_llama_rows(x, cfg.num_attention_heads)
        if arch == "llama" and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            x = gguf_loader.permute_llama_rows(x, cfg.num_key_value_heads)
        if arch == "gemma3" and hf_name.endswith("norm.weight"):
            x = x + np.float32(1.0)  # Gemma3Model.norm_shift
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"no GGUF name for {hf_name}")
        if x.ndim == 2 and ggml_type != gguf.GGMLQuantizationType.F32:
            q = gguf.quants.quantize(np.ascontiguousarray(x), ggml_type)
            writer.add_tensor(name, q, raw_shape=q.shape, raw_dtype=ggml_type)
        else:
            writer.add_tensor(name, np.ascontiguousarray(x, np.float32))
    if arch == "llama" and full.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(full, head_dim))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return arch
