"""Benchmark: autoregressive vs speculative decoding of a real pair, over batch size,
temperature and gamma, with acceptance, time to first token and greedy identity.

Cells are (batch, temperature). The first cell (batch 1, temperature 0 by default) sweeps every
`gammas`; the other cells run `gamma` alone, unless `full_sweep` (every gamma in every cell:
about 10 minutes of compilation alone on a 2-core CPU). In each cell AR and the gammas are
warmed up (compile, reported apart), then timed for `repeats` interleaved repeats, repeat r
decoding the r-th batch of the bench prompts (cycling through them). At temperature 0 every
speculative row is checked against the AR row of the same repeat: greedy speculative decoding
must give identical tokens.

`drafters` picks what drafts (spec_jax.drafting.build): the draft model, prompt lookup, suffix
matching (the row's text and the training corpora's n-gram table), or the hybrid of lookup and
the model (with `max_ngram` and the adaptive `draft_threshold`), the target's trained draft
head (`head`, spec_jax.drafting.head; `head_acceptance`: with its acceptance head deciding each
row's draft length, gamma the most it may draft); every drafter runs at every gamma of a cell.
`trees` (node counts N) adds, beside the gammas, each drafter's token tree of N nodes per round
(spec_jax.tree; `tree` column, 0 for chains), in the cells that sweep the gammas; `tree_auto`
adds tree=auto (plain, chains or trees chosen per chunk: spec_jax.autogamma) to the first cell. `prompt_set` is "open" (the open-ended bench prompts) or "grounded"
(code editing and reading prompts whose output repeats their input: experiments.common).
"""

import dataclasses
import functools
import sys

import ml_collections

import spec_jax
from experiments import common, framework
from models import settings
from spec_jax import drafting, metrics, timing
from spec_jax.decode import bucket_length
from spec_jax.drafting.lookup import MAX_NGRAM_LIMIT

TITLE = "Benchmark decode: autoregressive vs speculative tokens/s over batch, temperature and gamma"


MODEL_KEYS = ("target", "draft")
DTYPE_KEYS = ("target_dtype", "draft_dtype")
INT_RANGES = {
    "gamma": (1, 16),
    "num_prompts": (1, len(common.BENCH_PROMPTS)),
    "repeats": (1, 1000),
    "max_new_tokens": (2, 4096),
}
TUPLE_RANGES = {
    "batch_sizes": (int, 1, 64),
    "gammas": (int, 1, 16),
    "temperatures": (float, 0.0, 100.0),
    "trees": (int, 1, 31),
}
BENCH_DRAFTERS = ("model", "head", "head_acceptance", "prompt_lookup", "suffix", "hybrid")


def get_config(quick: bool = False) -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.target = "tiny" if quick else "qwen2.5-coder-1.5b"
    config.draft = "tiny-draft" if quick else "qwen2.5-coder-0.5b"
    config.target_dtype = "float32"  # models.precision.PRECISIONS
    config.draft_dtype = "float32"
    config.batch_sizes = (1, 2) if quick else (1, 4)
    config.temperatures = (0.0,) if quick else (0.0, 1.0)
    config.gammas = (2,) if quick else (1, 2, 3, 4, 5, 6)
    config.gamma = 2 if quick else 4  # the cells after the first
    config.auto = True  # also gamma=auto (spec_jax.autogamma) in the first cell
    config.trees = ()  # node counts: each drafter's tree of N nodes beside the gammas (empty: none)
    config.tree_auto = False  # also tree=auto (chains, trees or plain per chunk) in the first cell
    config.draft_vocab = 0  # VocabTrim: the draft's head keeps this many tokens (0 = all)
    config.drafters = ("model",)  # BENCH_DRAFTERS: each at every gamma of a cell
    config.max_ngram = 3  # prompt_lookup / suffix / hybrid
    config.draft_threshold = 0.0  # model / hybrid: per-row adaptive draft length (0 = off)
    config.suffix_threshold = 0.0  # suffix: the same, on the top successor's frequency
    config.prompt_set = "open"  # experiments.common.PROMPT_SETS
    config.full_sweep = False
    config.num_prompts = 2 if quick else len(common.BENCH_PROMPTS)
    config.repeats = 2 if quick else 3
    config.max_new_tokens = 8 if quick else 32
    return config


def validate(config) -> None:
    drafters = tuple(config.drafters)
    if not drafters or any(d not in BENCH_DRAFTERS for d in drafters):
        raise ValueError(f"drafters: each must be one of {', '.join(BENCH_DRAFTERS)}, got {drafters}")
    if config.prompt_set not in common.PROMPT_SETS:
        raise ValueError(
            f"prompt_set: must be one of {', '.join(common.PROMPT_SETS)}, got {config.prompt_set!r}"
        )
    settings.check_int_settings(
        config, {"max_ngram": (1, MAX_NGRAM_LIMIT)}
    )  # (INT_RANGES is shared with bench_peer)
    for key in ("draft_threshold", "suffix_threshold"):
        if not settings.is_number(config[key]) or not 0.0 <= config[key] < 1.0:
            raise ValueError(f"{key}: must be a number in [0, 1), got {config[key]!r}")
    if not settings.is_int(config.draft_vocab) or config.draft_vocab < 0:
        raise ValueError(
            f"draft_vocab: must be 0 (the full vocabulary) or a positive integer, got {config.draft_vocab!r}"
        )


def bench_prompts(tokenizer, num_prompts: int, prompt_set: str = "open") -> list[list[int]]:
    return [tokenizer.encode(p) for p in common.prompt_set(prompt_set, num_prompts)]


def batches_for(prompts, batch: int, repeats: int) -> list[list[list[int]]]:
    """The batch of each repeat: repeat r takes prompts r*B .. r*B + B - 1, cycling, so that
    repeats walk through every prompt instead of timing one (very predictable) prompt."""
    return [[prompts[(r * batch + i) % len(prompts)] for i in range(batch)] for r in range(repeats)]


def warmup_batches(batches) -> list:
    """One batch per distinct prompt bucket: warming up on each compiles every executable the
    timed repeats will use, so no timed repeat compiles."""
    by_width = {}
    for b in batches:
        by_width.setdefault(bucket_length(max(len(p) for p in b)), b)
    return list(by_width.values())


def throughput(seconds: list[float], tokens: list[int]) -> dict:
    """tokens_per_s: all tokens over all seconds; per_repeat_tokens_per_s: median/min/max."""
    per = timing.spread(t / s for t, s in zip(tokens, seconds, strict=True))
    return {
        "tokens_per_s": sum(tokens) / sum(seconds),
        "per_repeat_tokens_per_s": per["median"],
        "per_repeat_tokens_per_s_min": per["min"],
        "per_repeat_tokens_per_s_max": per["max"],
    }


_COMPILE_SECONDS: dict = {}  # loop -> seconds its first compile took, across experiments


def run_generate(
    target,
    prompts,
    draft,
    gamma: int,
    temperature: float,
    max_new_tokens: int,
    seed: int = 0,
    tree: int = 0,
    eos_id="auto",
):
    """spec_jax.generate(...) with stats["first_compile_seconds"]: what compiling this loop
    took, also when an earlier experiment in this process compiled it (generate then reports 0).
    eos_id: generate's (None: every row makes max_new_tokens, as llama.cpp's --ignore-eos)."""
    gen = spec_jax.generate(
        target,
        prompts,
        draft=draft,
        gamma=gamma if draft is not None else 4,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed,
        tree=tree if draft is not None else 0,
        eos_id=eos_id,
    )
    width = bucket_length(max(len(p) for p in prompts))
    key = (id(target), id(draft), gamma, tree, temperature, len(prompts), width, max_new_tokens)
    if gen.stats["compile_seconds"]:
        _COMPILE_SECONDS[key] = gen.stats["compile_seconds"]
    gen.stats["first_compile_seconds"] = _COMPILE_SECONDS.get(key, 0.0)
    return gen


def schedule_order(arm: str):
    """gamma=auto / tree=auto schedule entries in order: the gammas, then the trees by size."""
    return (arm.startswith("tree"), int(arm.removeprefix("tree")))


def drafts_for(target, config) -> dict:
    """{drafter name: what generate's `draft` gets} for config.drafters (spec_jax.drafting.build;
    the draft model is loaded once, only when one of them needs it)."""
    drafters = tuple(config.drafters)
    model = None
    if {"model", "hybrid"} & set(drafters):
        model = common.load_model(config.draft, config.draft_dtype)
    settings = drafting.Settings(
        draft=model,
        draft_vocab=config.draft_vocab,
        stop_ids=getattr(getattr(model, "tokenizer", None), "stop_ids", ()),
        max_ngram=config.max_ngram,
        threshold=config.draft_threshold,
        corpus=config.target not in common.TINY_MODELS,  # tiny models have no tokenizer: their own text
        head_dtype=config.draft_dtype,
    )
    out = {}
    for name in drafters:
        kind, changes = name, {}
        if name.startswith("head"):
            kind, changes = "head", {"acceptance": name == "head_acceptance"}
        elif name == "suffix":
            changes = {"threshold": config.suffix_threshold}
        out[name] = drafting.build(kind, target, dataclasses.replace(settings, **changes))
    return out


def run(config) -> framework.Result:
    target = common.load_model(config.target, config.target_dtype)
    drafts = drafts_for(target, config)
    prompts = bench_prompts(target.tokenizer, config.num_prompts, config.prompt_set)
    rows, identity = [], Identity()
    cells = [(b, t) for b in config.batch_sizes for t in config.temperatures]
    for i, (batch, temperature) in enumerate(cells):
        batches = batches_for(prompts, batch, config.repeats)
        variants = _variants(drafts, config, i)
        runs = _time_variants(target, config, variants, batches, temperature)
        ar = None  # the autoregressive row (the first): the speedups' reference
        for name, (_, gamma, drafter, tree) in variants.items():
            row = _row(
                config, runs[name], runs["autoregressive"], ar, batch, temperature, gamma, drafter, tree
            )
            if any(g.stats["compile_seconds"] for g in runs[name]["results"]) and gamma != "auto":
                print(f"warning: {name} compiled during a timed repeat", file=sys.stderr)
            if gamma and temperature == 0:
                identity.add(
                    row, runs[name]["results"], runs["autoregressive"]["results"], batches, tree, gamma
                )
            ar = ar or row
            rows.append(row)
            print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    return identity.result(rows, config, len(prompts))


def _variants(drafts: dict, config, cell: int) -> dict:
    """name -> (draft, gamma, drafter, tree) of one cell: autoregressive, each drafter at each
    gamma (the first cell, or every cell with full_sweep: all of config.gammas and the trees;
    else config.gamma), and in the first cell gamma auto and tree auto where asked for."""
    sweep = config.full_sweep or cell == 0
    variants = {"autoregressive": (None, 0, "", 0)}
    for name, draft in drafts.items():
        prefix = "" if name == "model" else f"{name} "
        variants |= {
            f"{prefix}gamma {g}": (draft, g, name, 0) for g in (config.gammas if sweep else (config.gamma,))
        }
        if sweep:  # a tree's paths are at most N long: its gamma is N (api.GammaPolicy)
            variants |= {f"{prefix}tree {n}": (draft, n, name, n) for n in config.trees}
        if config.auto and cell == 0:
            variants[f"{prefix}gamma auto"] = (draft, "auto", name, 0)
        if config.tree_auto and cell == 0:
            variants[f"{prefix}tree auto"] = (draft, "auto", name, "auto")
    return variants


def _time_variants(target, config, variants: dict, batches, temperature: float) -> dict:
    """timing.interleaved's runs of every variant over the batches (repeat r seeded r), each
    repeat's seconds less what it spent compiling (a loop first compiled in a timed repeat:
    auto's gammas)."""

    def one(inputs, draft_model, gamma, tree):
        r, batch_prompts = inputs
        return run_generate(
            target, batch_prompts, draft_model, gamma, temperature, config.max_new_tokens, seed=r, tree=tree
        )

    fns = {
        name: functools.partial(one, draft_model=d, gamma=g, tree=n)
        for name, (d, g, _, n) in variants.items()
    }
    runs = timing.interleaved(fns, list(enumerate(batches)), [(0, b) for b in warmup_batches(batches)])
    for result in runs.values():
        result["seconds"] = [
            t - g.stats["compile_seconds"] for t, g in zip(result["seconds"], result["results"], strict=True)
        ]
    return runs


def _row(config, result, ar_result, ar_row, batch, temperature, gamma, drafter, tree) -> dict:
    """One variant's row: throughput, decode speed, speedups over the autoregressive row
    (ar_row; None: this is it), the worst repeat's, time to first token, compile time, and a
    speculative variant's acceptance (_draft_fields)."""
    gens = result["results"]
    stats = [g.stats for g in gens]
    row = {
        "variant": "autoregressive" if gamma == 0 else "speculative",
        "drafter": drafter,
        "prompt_set": config.prompt_set,
        "target_dtype": config.target_dtype,
        "draft_dtype": config.draft_dtype,
        "draft_vocab": config.draft_vocab or "all",
        "batch": batch,
        "temperature": temperature,
        "gamma": gamma,
        "tree": tree,
        **throughput(result["seconds"], [s["num_new_tokens"] for s in stats]),
    }
    row["speedup"] = row["tokens_per_s"] / (ar_row or row)["tokens_per_s"]
    # After the prompt: every token but each row's first (drawn from the prefill's logits) over
    # the loop's seconds; long prompts make the prefill weigh on tokens_per_s.
    decode_tokens = sum(s["num_new_tokens"] - len(g.tokens) for s, g in zip(stats, gens, strict=True))
    row["decode_tokens_per_s"] = decode_tokens / sum(s["decode_seconds"] for s in stats)
    row["decode_speedup"] = row["decode_tokens_per_s"] / (ar_row or row)["decode_tokens_per_s"]
    # Repeat by repeat (the same batch of prompts as the autoregressive repeat; with batch 1,
    # one prompt): the worst decode speedup over plain decoding.
    row["worst_repeat_decode_speedup"] = min(
        (s["num_new_tokens"] - len(g.tokens))
        / s["decode_seconds"]
        / ((a.stats["num_new_tokens"] - len(g.tokens)) / a.stats["decode_seconds"])
        for s, a, g in zip(stats, ar_result["results"], gens, strict=True)
    )
    row |= _draft_fields(stats, gamma)
    ttft = timing.spread(1e3 * s["prefill_seconds"] for s in stats)
    row.update(ttft_ms=ttft["median"], ttft_ms_min=ttft["min"], ttft_ms_max=ttft["max"])
    row["compile_s"] = sum(g.stats["first_compile_seconds"] for g in result["warmup"])
    return row


def _draft_fields(stats, gamma) -> dict:
    """A speculative variant's pooled acceptance, drafts per round, the gammas gamma auto used
    and, for a hybrid, each drafter's share of rounds and acceptance; {} for autoregressive."""
    fields = {}
    if gamma == "auto":
        # An acceptance head runs gamma auto at a fixed cap (no schedule): it decides each
        # round's length itself, so gammas_used stays empty and drafted_per_round tells.
        chunks = [c for s in stats for c in s.get("gamma_schedule", ())]
        fields["gammas_used"] = " ".join(sorted({str(g) for g, _ in chunks}, key=schedule_order))
    if gamma:
        pooled = metrics.pool(stats)
        fields.update({k: pooled[k] for k in ("acceptance_rate", "mean_accepted_length", "alpha_hat")})
        fields["drafted_per_round"] = pooled["num_draft_tokens"] / max(pooled["num_rounds"], 1)
        if len(pooled.get("fraction_of_rounds_by_drafter", {})) > 1:
            fields["rounds_served"] = " ".join(
                f"{k}:{v:.2f}" for k, v in pooled["fraction_of_rounds_by_drafter"].items()
            )
            fields["acceptance_by_drafter"] = " ".join(
                f"{k}:{v:.3f}" for k, v in pooled["acceptance_rate_by_drafter"].items()
            )
    return fields


@dataclasses.dataclass
class Identity:
    """The greedy identity check over every greedy speculative variant: rows whose tokens equal
    the autoregressive run's of the same batch, the prompts they covered, the gammas checked."""

    same: int = 0
    rows: int = 0
    covered: set = dataclasses.field(default_factory=set)
    checked: set = dataclasses.field(default_factory=set)

    def add(self, row: dict, gens, ar_gens, batches, tree, gamma) -> None:
        """Counts one variant's rows (row gets identical_to_ar)."""
        same = sum(
            a == b
            for ar, sp in zip(ar_gens, gens, strict=True)
            for a, b in zip(ar.tokens, sp.tokens, strict=True)
        )
        total = sum(len(g.tokens) for g in gens)
        row["identical_to_ar"] = f"{same}/{total}"
        self.same += same
        self.rows += total
        self.covered.update(tuple(p) for b in batches for p in b)
        self.checked.add(f"tree {tree}" if tree else gamma)

    def result(self, rows, config, num_prompts: int) -> framework.Result:
        """The suite's Result: the rows, the check's summary, passed (None: no greedy cell)."""
        summary = {
            "check": "greedy identity: speculative tokens == autoregressive tokens, same batch",
            "identical_rows": f"{self.same}/{self.rows}" if self.rows else "not run (no temperature 0)",
            "prompts_covered": f"{len(self.covered)}/{num_prompts}",
            "gammas": ",".join(map(str, sorted(self.checked, key=str))),
            "batch_sizes": ",".join(map(str, config.batch_sizes)),
        }
        if self.rows and self.same != self.rows:
            print("warning: greedy speculative output differs from autoregressive", file=sys.stderr)
        return framework.Result.from_dicts(
            rows,
            sections={"greedy identity": [summary]},
            passed=None if not self.rows else self.same == self.rows,
        )
