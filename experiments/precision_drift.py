"""Each weight precision's drift from float32, for one model.

Per precision (models.precision.PRECISIONS: float32, bfloat16, int8, gguf, gguf_q8):
  - logits against HF transformers' float32 logits recorded in tests/fixtures/MODEL.json
    (scripts/record_fixtures.py): the largest |difference| at the recorded top-32 ids and at
    256 fixed vocabulary ids, and top-1 agreement, over every position of the fixture prompts;
  - greedy decoding of the bench prompts against the float32 model's: rows identical over all
    max_new_tokens, and the mean length of the common prefix (a greedy row diverges for good
    at its first different token).
Speculative decoding at a precision is exact with respect to that precision's model (tests:
greedy speculative == greedy autoregressive per precision); this table says how far that model
is from the float32 one.
"""

import json
import pathlib

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

import spec_jax
from experiments import common, framework
from models import transformer
from models.precision import PRECISIONS

TITLE = "Precision drift: each weight precision against float32 and HF transformers"
FIXTURES = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures"

MODEL_KEYS = ("model",)
DTYPE_KEYS = ("precisions",)
INT_RANGES = {"num_prompts": (1, len(common.BENCH_PROMPTS)), "max_new_tokens": (1, 4096)}


def get_config(quick: bool = False) -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.model = "tiny" if quick else "qwen2.5-coder-1.5b"
    config.precisions = PRECISIONS
    config.num_prompts = 2 if quick else len(common.BENCH_PROMPTS)
    config.max_new_tokens = 8 if quick else 64
    return config


def fixture_logits(model, fixture) -> list[np.ndarray]:
    """[T, V] float32 logits of each fixture prompt (one batch, right-padded)."""
    prompts = [p["ids"] for p in fixture["prompts"]]
    width = max(map(len, prompts))
    tokens = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    positions = jnp.broadcast_to(jnp.arange(width), tokens.shape)
    cache = transformer.init_cache(model.config, len(prompts), width)
    logits = jax.jit(transformer.forward, static_argnums=0)(
        model.config, model.params, jnp.asarray(tokens), positions, cache
    ).logits
    return [np.asarray(logits[i, : len(p)], np.float32) for i, p in enumerate(prompts)]


def against_fixture(logits, fixture) -> dict:
    vocab_ids = np.asarray(fixture["vocab_ids"])
    diffs, top1 = [], []
    for row, p in zip(logits, fixture["prompts"], strict=True):
        diffs.append(
            np.abs(np.take_along_axis(row, np.asarray(p["top_ids"]), -1) - np.asarray(p["top_logits"]))
        )
        diffs.append(np.abs(row[:, vocab_ids] - np.asarray(p["logits_at_vocab_ids"])))
        top1.append(row.argmax(-1) == np.asarray(p["top1"]))
    top1 = np.concatenate(top1)
    return {
        "max_logit_diff_vs_hf": float(max(d.max() for d in diffs)),
        "top1_agreement_vs_hf": f"{int(top1.sum())}/{top1.size}",
    }


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def run(config) -> framework.Result | None:
    fixture = None
    if config.model not in common.TINY_MODELS:
        path = FIXTURES / f"{config.model}.json"
        if not path.exists():
            print(f"precision_drift: no fixture {path} (scripts/record_fixtures.py); skipped")
            return None
        fixture = json.loads(path.read_text(encoding="utf-8"))
    rows, reference = [], None
    for dtype in ("float32",) + tuple(p for p in config.precisions if p != "float32"):
        model = common.load_model(config.model, dtype)
        prompts = [model.tokenizer.encode(p) for p in common.BENCH_PROMPTS[: config.num_prompts]]
        greedy = spec_jax.generate(
            model, prompts, max_new_tokens=config.max_new_tokens, temperature=0.0
        ).tokens
        row = {"precision": dtype}
        if fixture is not None:
            row.update(against_fixture(fixture_logits(model, fixture), fixture))
        if reference is None:
            reference = greedy
        prefixes = [common_prefix(a, b) for a, b in zip(greedy, reference, strict=True)]
        row.update(
            greedy_rows_identical_to_float32=f"{sum(a == b for a, b in zip(greedy, reference, strict=True))}/{len(greedy)}",
            mean_common_prefix_tokens=float(np.mean(prefixes)),
            max_new_tokens=config.max_new_tokens,
        )
        if dtype in config.precisions:
            rows.append(row)
        print(row, flush=True)
    return framework.Result.from_dicts(rows)
