"""Record reference fixtures (token ids and logits) with HF transformers, for tests/fixtures/.

The reference stack is NOT a test dependency. It lives in its own venv (gitignored):

    python3 -m venv .venv-ref
    .venv-ref/bin/pip install torch==2.13.0 transformers accelerate gguf numpy
    .venv-ref/bin/python scripts/record_fixtures.py            # all default models
    .venv-ref/bin/python scripts/record_fixtures.py --models smollm2-135m

Versions the committed fixtures were recorded with (also stored in each fixture's "versions"):
    torch 2.13.0+cpu, transformers 5.23.0, accelerate 1.15.0, gguf 0.19.0, numpy 2.4.6,
    tokenizers 0.23.3, Python 3.11.

What is recorded, per model (tests/fixtures/{model}.json, well under 2 MB each):
  * "strings" / "token_ids": AutoTokenizer(gguf_file=...) ids of a fixed set of texts (code,
    English, numbers, accents, CJK, emoji incl. ZWJ sequences, whitespace runs, tabs, CR/LF,
    special-token text, the empty string). No BOS is added by either model family.
  * "prompts" (logit models only): for each prompt and each position t of its ids, from
    AutoModelForCausalLM(gguf_file=..., dtype=float32) run on the whole prompt at once:
      top1[t], top_ids[t][32], top_logits[t][32]  (descending),
      logits_at_vocab_ids[t][256]                 (at the shared, seeded "vocab_ids"),
      logsumexp[t]                                (of the full row of V logits).
    That is enough to test top-1 agreement and max |logit difference| without storing [T, V].
  * "hf_config": the transformers config fields the GGUF mapped to, for cross-checking
    models.gguf_loader.read_config.
The GGUF itself comes from models.registry.fetch_gguf (pinned packages, sha256 checked); its
sha256 is stored too, so a fixture can never silently refer to other weights.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import platform
import sys
import time
from importlib.metadata import PackageNotFoundError, version

# The reference stack: this script runs only in .venv-ref, which has all of it (see above).
import accelerate
import gguf
import numpy as np
import tokenizers
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load_registry():
    # By file path: `import models` would run models/__init__.py, which pulls in jax/flax,
    # and the reference venv has neither. registry.py itself needs only the standard library + tqdm.
    spec = importlib.util.spec_from_file_location("spec_jax_registry", ROOT / "models" / "registry.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses looks its module up there
    spec.loader.exec_module(module)
    return module


registry = _load_registry()

FIXTURES = ROOT / "tests" / "fixtures"
TOP_K = 32
NUM_VOCAB_IDS = 256
VOCAB_SEED = 1234

STRINGS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. It's 3:45 pm, isn't it? I'll say we've won.",
    "I'M HERE, YOU'RE THERE, WE'VE GONE and THEY'LL stay; she'd've known.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    'import numpy as np\nx = np.arange(10)  # comment\nprint(f"{x.sum():.3f}")\n',
    "class Foo(Bar):\n\tdef __init__(self, *args, **kwargs) -> None:\n\t\tsuper().__init__()\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }  // C++\n",
    "In 2024, pi is about 3.14159 and 1,000,000 people paid $12.50 each (version 10.2.3).",
    "Ünïcödé naïve café résumé — “quotes” ‘single’ … ©®™ ½ µ ß Æ",
    "你好，世界！这是一个测试。日本語のテキスト、한국어 텍스트",
    "مرحبا بالعالم नमस्ते दुनिया Привет мир Γειά σου",
    "Emoji: 😀👍🏽🚀 family: 👨‍👩‍👧‍👦 flags: 🇺🇸🇯🇵 ❤️",
    "a  b   c    d\t\te\n\n\nf \n \n g     ",
    "\tindented\n\t\tdouble\r\nwindows\rcarriage\n",
    "   leading and trailing   ",
    "<|im_start|>user\nWrite a haiku.<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "URL: https://example.com/path?q=1&r=2#frag email@test.org",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa!!!!!!!!????    ",
    "",
]

PROMPTS = [
    'def add(a, b):\n    """Return the sum of a and b."""\n    return',
    "The capital of France is Paris. The capital of Germany is",
    "Once upon a time, there was a little girl who",
    "for i in range(10):\n    print(i",
]

# Models whose tokens and logits are recorded (the 1.5B takes ~2.5 min and 9 GB).
LOGIT_MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")


def versions() -> dict:
    def version_of(mod):
        return getattr(mod, "__version__", None) or _dist_version(mod.__name__)

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "gguf": version_of(gguf),
        "tokenizers": tokenizers.__version__,
        "numpy": np.__version__,
    }


def _dist_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _floats(x) -> list:
    # float32 -> Python float keeps every bit; JSON size stays small enough (< 1 MB per model).
    return [float(v) for v in np.asarray(x, dtype=np.float32).ravel()]


def record(name: str) -> dict:
    path = registry.fetch_gguf(name)
    spec = registry.get_spec(name)
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    print(f"[{name}] tokenizer loaded in {time.time() - t0:.1f}s: {type(tok).__name__}", flush=True)
    token_ids = [tok(s, add_special_tokens=True)["input_ids"] for s in STRINGS]
    for s, ids in zip(STRINGS, token_ids, strict=True):
        back = tok.decode(ids)
        if back != s:
            print(f"[{name}] note: HF decode does not round-trip {s!r} -> {back!r}", flush=True)
    out = {
        "model": name,
        "gguf_sha256": spec.sha256,
        "gguf_file": spec.parts[0].requirement
        if len(spec.parts) == 1
        else f"{len(spec.parts)} chunk packages",
        "recorded_with": versions(),
        "tokenizer": {
            "class": type(tok).__name__,
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
            "vocab_size_with_added": len(tok),
        },
        "strings": STRINGS,
        "token_ids": token_ids,
    }

    t0 = time.time()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    except TypeError:  # transformers < 4.56 spells it torch_dtype
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, torch_dtype=torch.float32
        )
    model.eval()
    print(f"[{name}] model loaded in {time.time() - t0:.1f}s", flush=True)
    out["hf_config"] = _hf_config(model)
    vocab = int(model.get_output_embeddings().weight.shape[0])
    rng = np.random.default_rng(VOCAB_SEED)
    vocab_ids = np.sort(rng.choice(vocab, NUM_VOCAB_IDS, replace=False))
    out["vocab_ids"] = [int(i) for i in vocab_ids]
    out["top_k"] = TOP_K
    out["prompts"] = [_prompt_record(name, model, tok, text, vocab_ids) for text in PROMPTS]
    return out


def _hf_config(model) -> dict:
    """The settings of the transformers model that the fixture's tests compare with ours."""
    cfg = model.config
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    return {
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        "intermediate_size": cfg.intermediate_size,
        "rope_theta": _rope_theta(cfg),
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": bool(cfg.tie_word_embeddings),
        "lm_head_is_embedding": bool(embed.data_ptr() == head.data_ptr() or torch.equal(embed, head)),
        "dtype": str(embed.dtype),
    }


def _prompt_record(name: str, model, tok, text: str, vocab_ids) -> dict:
    """One prompt's token ids and the model's logits at each position: top-1, the TOP_K best ids
    and logits, the logits at vocab_ids, log-sum-exp and spread."""
    ids = tok(text, add_special_tokens=True)["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float().numpy()  # [T, V]
    top = np.argsort(-logits, axis=-1, kind="stable")[:, :TOP_K]
    m = logits.max(-1, keepdims=True)
    lse = (m[:, 0] + np.log(np.exp(logits - m).sum(-1))).astype(np.float32)
    record = {
        "text": text,
        "ids": [int(i) for i in ids],
        "top1": [int(i) for i in logits.argmax(-1)],
        "top_ids": [[int(i) for i in row] for row in top],
        "top_logits": [_floats(np.take_along_axis(logits[t], top[t], -1)) for t in range(len(ids))],
        "logits_at_vocab_ids": [_floats(logits[t, vocab_ids]) for t in range(len(ids))],
        "logsumexp": _floats(lse),
        "logit_std": _floats(logits.std(-1)),
    }
    greedy = tok.decode(logits.argmax(-1)[-1:])
    print(f"[{name}] {text!r}: {len(ids)} tokens, next greedy token {greedy!r}", flush=True)
    return record


def _rope_theta(cfg) -> float | None:
    theta = getattr(cfg, "rope_theta", None)
    if theta is None:  # transformers >= 5 keeps it in rope_parameters
        params = getattr(cfg, "rope_parameters", None) or {}
        theta = params.get("rope_theta")
    return None if theta is None else float(theta)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(LOGIT_MODELS), help="models to record logits for")
    parser.add_argument("--out", default=str(FIXTURES))
    args = parser.parse_args(argv)
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in args.models:
        data = record(name)
        path = out_dir / f"{name}.json"
        path.write_text(json.dumps(data, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8")
        print(f"[{name}] wrote {path} ({path.stat().st_size / 1e3:.0f} kB)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
