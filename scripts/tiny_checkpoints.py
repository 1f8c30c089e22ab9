"""Tiny random checkpoints of every supported family, to try `--target=FOLDER --draft=FILE.gguf`.

  .venv/bin/python scripts/tiny_checkpoints.py --out=/tmp/tiny
  .venv/bin/python -m launch.generate --target=/tmp/tiny/llama --draft=/tmp/tiny/draft.gguf \\
      --prompt="def f(x):" --temperature=0 --max_new_tokens=16 --compare_autoregressive

Writes one Hugging Face checkpoint folder per family (transformers' save_pretrained: config.json,
model.safetensors, generation_config.json, plus tokenizer.json, tokenizer_config.json and a chat
template) — Llama with Llama 3 rope scaling, Qwen2, Qwen3, Mistral and Gemma 3 with sliding
windows of 5 and 4, shorter than a prompt — and one GGUF draft (tests/tiny_gguf.py: a byte-level vocabulary
that every folder's tokenizer.json shares, so it pairs with each). Needs the `hf` extra (torch,
transformers). Random weights: the text is noise; the point is that each family loads, decodes,
and speculates to the same tokens as plain decoding.
"""

import argparse
import json
import pathlib
import sys

try:  # optional (the hf extra): main says how to install it where it is missing
    import torch
    import transformers
except ImportError:
    torch = transformers = None

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import tiny_gguf  # noqa: E402  (from tests/, on the path set above)

from models.tokenizer import Tokenizer  # noqa: E402

VOCAB = 259  # tiny_gguf's byte-level vocabulary
EOS = 257  # its "<|endoftext|>"
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    bos_token_id=None,
    eos_token_id=EOS,
    pad_token_id=None,
)
# family -> (config class, its settings): Llama 3's rope scaling, Mistral's and Gemma 3's sliding
# windows shorter than a short prompt, Gemma 3's local/global pattern, linear rope scaling and a
# query scalar that is not head_dim; Granite's scalars. tests/test_hf_sources.py checks these against
# transformers.
FAMILIES = {
    "llama": (
        "LlamaConfig",
        dict(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
            rope_theta=500000.0,
        ),
    ),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", dict(head_dim=32)),
    "mistral": ("MistralConfig", dict(sliding_window=5)),
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            head_dim=32,
            sliding_window=4,
            query_pre_attn_scalar=24,
            rope_scaling={"rope_type": "linear", "factor": 8.0},
        ),
    ),
    # models.families' worked example: four scalars, none of them 1 (nor head_dim ** -0.5).
    "granite": (
        "GraniteConfig",
        dict(
            embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.15, logits_scaling=2.5
        ),
    ),
}
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def hf_model(family: str, num_layers: int = 4, seed: int = 0):
    """A random float32 transformers model of `family` (norm scales not all ones)."""
    cls, extra = FAMILIES[family]
    if family == "gemma3":
        kinds = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
        extra = {**extra, "layer_types": (kinds * num_layers)[:num_layers]}
    config = getattr(transformers, cls)(**COMMON, **extra, num_hidden_layers=num_layers)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # norms that are not all ones (or zeros, Gemma's)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def save(model, folder: pathlib.Path, tokenizer_json: str) -> pathlib.Path:
    """The model as a checkpoint folder with the tokenizer files and a chat template."""
    model.save_pretrained(folder)
    (folder / "tokenizer.json").write_text(tokenizer_json)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return folder


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="folder to write into (created)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if torch is None or transformers is None:
        parser.exit(2, "error: needs torch and transformers: pip install -c constraints.txt -e '.[hf]'\n")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    draft = out / "draft.gguf"
    tiny_gguf.write(draft)
    tokenizer_json = Tokenizer.from_gguf(draft).backend.to_str()
    for family, (cls, _) in FAMILIES.items():
        print(f"{save(hf_model(family, seed=args.seed), out / family, tokenizer_json)} ({cls})")
    print(draft)
    return 0


if __name__ == "__main__":
    sys.exit(main())
