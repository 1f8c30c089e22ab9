"""A tiny Qwen2-style model written as a GGUF file (float32 tensors, a byte-level vocabulary),
and a registry entry for it: models.convert and models.load run on it in a second, offline."""

import hashlib
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
