"""Benchmark workloads: speculative decoding by category, as Spec-Bench reports it, against this
project's plain decoding and llama.cpp's plain, draft-model and n-gram decoding of the same GGUF.

The prompts (experiments/prompts/workloads/{bench,heldout}.jsonl, built offline and
deterministically by scripts/workload_prompts.py, the two sets from disjoint documents) fall in
six categories: code completion, code editing, quoting QA / retrieval, summarization, chat and
translation. Each of the first `prompts_per_category` prompts of each category of `prompt_set`
runs, greedy, `max_new_tokens` new tokens, EOS ignored, through every system:

  spec-jax, plain            spec_jax.generate with no draft (the same loop machinery)
  spec-jax, DRAFTER          this project's defaults: the draft model (`drafters`: also prompt
                             lookup, hybrid, ...), gamma=auto, through spec_jax.generate
  llama.cpp, plain           llama-completion (launch/llama_peer_worker.py's backend, as the peer
                             suite runs it: the same GGUF files, threads, flags and timers)
  llama.cpp, draft-simple K  llama-speculative-simple --spec-type draft-simple with the draft GGUF,
                             K drafts per round (`llama_draft_n_max`)
  llama.cpp, ngram-simple    llama-speculative-simple --spec-type ngram-simple (no draft model: the
                             m tokens after the latest earlier match of the last n, prompt lookup)

Ours are warmed up first (one prompt per length bucket: compiles and gamma=auto's cost
measurements); then each prompt runs through every system in turn, the first system rotating.
A system's time is its generate call (prefill included; llama.cpp's: what its programs measure,
after loading). Per category and system: tokens/s (all tokens over all seconds), the speedup over
spec-jax plain and over llama.cpp plain, acceptance (accepted / drafted), tokens per target call
(ours: new tokens / target calls, prefill included, which makes the first token; llama.cpp's:
decoded tokens / verify calls, decoded - accepted), and greedy identity with spec-jax plain per
prompt (llama.cpp's by text). The run passes when every spec-jax speculative output equals
spec-jax plain's. `--quick`: the tiny models and llama.cpp's worker's fake backend (no programs).
"""

import dataclasses
import json
import os
import time

import ml_collections

from experiments import bench_decode, bench_peer, common, framework
from launch import llama_peer_worker, peer_protocol
from models import registry
from models.kernels import llama_cpp
from spec_jax import timing

TITLE = "Benchmark workloads: speculative decoding by category against plain decoding and llama.cpp"

CATEGORIES = ("code_completion", "code_editing", "quoting_qa", "summarization", "chat", "translation")
PROMPT_SETS = ("bench", "heldout")
PROMPTS_DIR = os.path.join(bench_peer.ROOT, "experiments", "prompts", "workloads")
PLAIN = "spec-jax, plain"
LLAMA_PLAIN = "llama.cpp, plain"
DRAFTERS = ("model", "prompt_lookup", "hybrid", "suffix")
LLAMA_PROGRAMS = (llama_peer_worker.PLAIN, llama_peer_worker.SPECULATIVE)  # built here once

MODEL_KEYS = ("target", "draft")
DTYPE_KEYS = ("target_dtype", "draft_dtype")
INT_RANGES = {
    "prompts_per_category": (1, 32),
    "repeats": (1, 100),
    "max_new_tokens": (2, 1024),
    "max_prompt_tokens": (0, 4096),
    "max_ngram": (1, 8),
    "llama_ngram_size_n": (1, 64),
    "llama_ngram_size_m": (1, 64),
}
TUPLE_RANGES = {"llama_draft_n_max": (int, 1, 16)}


def get_config(quick: bool = False) -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.target = "tiny" if quick else "qwen2.5-coder-1.5b"
    config.draft = "tiny-draft" if quick else "qwen2.5-coder-0.5b"
    config.target_dtype = "float32" if quick else "gguf_q8"  # launch.generate's auto on this CPU
    config.draft_dtype = "float32" if quick else "gguf_q8"
    config.prompt_set = "bench"  # PROMPT_SETS
    config.categories = CATEGORIES
    config.prompts_per_category = 1 if quick else 4
    config.repeats = 1  # runs of each prompt through each system
    config.max_new_tokens = 8 if quick else 48
    # ours: "auto" (launch.generate's default) or drafts per round, 1..16 (quick: 2, one loop to
    # compile where auto compiles one per gamma it tries)
    config.gamma = "2" if quick else "auto"
    # quick: each prompt's last 16 tokens, so that every prompt shares one compiled length
    # bucket; 0 = whole prompts (the real runs)
    config.max_prompt_tokens = 16 if quick else 0
    config.drafters = ("model",)  # DRAFTERS (spec_jax.drafting.build), each a system
    config.max_ngram = 3  # prompt_lookup / hybrid / suffix (launch.generate's default)
    config.llama = True  # the llama.cpp systems
    config.llama_draft_n_max = (3,)  # llama.cpp draft-simple systems: drafts per round
    # ngram-simple: the n-gram matched (prompt lookup's usual 3: our --max_ngram) and the tokens
    # drafted after it (up to 16, as issue 53 asks of ours; llama.cpp's defaults, 12 and 48, find
    # no match in most of these prompts)
    config.llama_ngram_size_n = 3
    config.llama_ngram_size_m = 16
    config.fake_peer = quick  # llama.cpp's worker's fake backend: no programs
    return config


def validate(config) -> None:
    if config.prompt_set not in PROMPT_SETS:
        raise ValueError(f"prompt_set: must be one of {', '.join(PROMPT_SETS)}, got {config.prompt_set!r}")
    categories = tuple(config.categories)
    if (
        not categories
        or any(c not in CATEGORIES for c in categories)
        or len(set(categories)) < len(categories)
    ):
        raise ValueError(
            f"categories: distinct values from {', '.join(CATEGORIES)}, got {','.join(categories)!r}"
        )
    drafters = tuple(config.drafters)
    if not drafters or any(d not in DRAFTERS for d in drafters) or len(set(drafters)) < len(drafters):
        raise ValueError(f"drafters: distinct values from {', '.join(DRAFTERS)}, got {','.join(drafters)!r}")
    load_prompts(config.prompt_set, categories, config.prompts_per_category)  # the files hold enough
    gamma = str(config.gamma)
    if gamma != "auto" and not (gamma.isdigit() and 1 <= int(gamma) <= 16):
        raise ValueError(f"gamma: must be auto or an integer in [1, 16], got {config.gamma!r}")


def load_prompts(prompt_set: str, categories, per_category: int) -> list[dict]:
    """The first `per_category` records ({"prompt", "category", "source"}) of each category of a
    prompt set, categories in the order given; ValueError naming the setting if a file is missing
    or a category has fewer."""
    path = os.path.join(PROMPTS_DIR, f"{prompt_set}.jsonl")
    if not os.path.exists(path):
        raise ValueError(f"prompt_set: no file {path} (build it: python scripts/workload_prompts.py)")
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    chosen = []
    for category in categories:
        of_category = [r for r in records if r["category"] == category]
        if len(of_category) < per_category:
            raise ValueError(
                f"prompts_per_category: {path} holds {len(of_category)} {category} prompts, asked for {per_category}"
            )
        chosen += of_category[:per_category]
    return chosen


class LlamaPrograms(llama_peer_worker.LlamaCppBackend):
    """The peer suite's llama.cpp backend, and its n-gram mode: llama-speculative-simple
    --spec-type ngram-simple, no draft model."""

    def generate_ngram(self, request: peer_protocol.Request, size_n: int, size_m: int) -> dict:
        stdout, stderr = self._run(
            [llama_peer_worker.SPECULATIVE, "-m", self.target, "--spec-type", "ngram-simple"]
            + ["--spec-ngram-simple-size-n", size_n, "--spec-ngram-simple-size-m", size_m]
            + ["-p", request.text, "-n", request.max_new_tokens - 1, "--color", "off"]
        )
        return llama_peer_worker.parse_speculative(stdout, stderr, request.text)


class FakePrograms(llama_peer_worker.FakeTextBackend):
    """The worker's fake backend (text from deterministic tokens; no programs), n-gram mode too."""

    def generate_ngram(self, request: peer_protocol.Request, size_n: int, size_m: int) -> dict:
        return self.generate(dataclasses.replace(request, speculative=True))


def _llama_backend(config):
    """LlamaPrograms on the pair's GGUF files (llama.cpp's programs built once here), or
    FakePrograms in quick mode; None, having printed why, where llama.cpp cannot run."""
    if config.fake_peer:
        return FakePrograms()
    try:
        if not llama_cpp.built(LLAMA_PROGRAMS):
            llama_cpp.check_tools()
            print(f"workloads: building {', '.join(LLAMA_PROGRAMS)} (once, cached; minutes) ...", flush=True)
        llama_cpp.build(LLAMA_PROGRAMS)
    except llama_cpp.Unavailable as e:
        print(f"workloads: llama.cpp skipped: {e}")
        return None
    paths = [str(registry.fetch_gguf(name)) for name in (config.target, config.draft)]
    return LlamaPrograms(str(llama_cpp.build_dir() / "bin"), *paths, os.cpu_count())


def _llama_systems(config, backend, prompts, texts) -> dict:
    """{system name: fn(prompt index) -> result} of llama.cpp's plain, draft-simple and
    ngram-simple decoding; each result carries its seconds (the program's own timers)."""
    n = config.max_new_tokens

    def call(fn, i, **changes):
        request = peer_protocol.Request(prompts[i], n, **{"speculative": False, "text": texts[i], **changes})
        start = time.perf_counter()
        result = fn(request)
        result.setdefault("seconds", time.perf_counter() - start)
        result.setdefault("decode_tokens", result["num_tokens"])
        return result

    systems = {LLAMA_PLAIN: lambda i: call(backend.generate, i)}
    for k in config.llama_draft_n_max:
        systems[f"llama.cpp, draft-simple {k}"] = lambda i, k=k: call(
            backend.generate, i, speculative=True, draft_max=k
        )
    size_n, size_m = config.llama_ngram_size_n, config.llama_ngram_size_m
    systems[f"llama.cpp, ngram-simple {size_n}/{size_m}"] = lambda i: call(
        lambda r: backend.generate_ngram(r, size_n, size_m), i
    )
    return systems


def _our_result(target, prompt, draft, gamma, max_new_tokens: int) -> dict:
    """bench_peer's result of one generate call, with eos_id=None: every system makes
    max_new_tokens (llama.cpp's runs use --ignore-eos)."""
    return bench_peer.our_result(target, prompt, draft, gamma, max_new_tokens, eos_id=None)


@dataclasses.dataclass
class Runs:
    """What every system measured: records (the prompts run), texts; runs: timing.interleaved's
    {system: {"results"}} over `order` (each run's prompt index); ours: spec-jax's systems."""

    records: list
    runs: dict
    order: list
    ours: list
    info: dict


def _run_systems(config) -> Runs:
    """Every system on every chosen prompt, ours warmed up first, then interleaved."""
    records = load_prompts(config.prompt_set, config.categories, config.prompts_per_category)
    backend = _llama_backend(config) if config.llama else None
    target = common.load_model(config.target, config.target_dtype)
    prompts = [target.tokenizer.encode(r["prompt"]) for r in records]
    if config.max_prompt_tokens:
        prompts = [p[-config.max_prompt_tokens :] for p in prompts]
    texts = [
        target.tokenizer.decode(p) if config.max_prompt_tokens else r["prompt"]
        for p, r in zip(prompts, records, strict=True)
    ]
    n, gamma = config.max_new_tokens, config.gamma if config.gamma == "auto" else int(config.gamma)
    drafts = bench_decode.drafts_for(target, _drafter_config(config))

    def plain(i):
        print(f"workloads: prompt {i + 1}/{len(prompts)} ({records[i]['category']})", flush=True)
        return _our_result(target, prompts[i], None, 4, n)

    systems = {PLAIN: plain}
    for name, draft in drafts.items():
        systems[f"spec-jax, {name}, gamma {gamma}"] = lambda i, d=draft: _our_result(
            target, prompts[i], d, gamma, n
        )
    ours = list(systems)
    warm = [prompts.index(b[0]) for b in bench_decode.warmup_batches([[p] for p in prompts])]
    print(f"workloads: warming up spec-jax on {len(warm)} prompt lengths ...", flush=True)
    timing.interleaved(systems, [], warm)
    if backend is not None:
        systems.update(_llama_systems(config, backend, prompts, texts))
    order = [i for _ in range(config.repeats) for i in range(len(prompts))]
    runs = timing.interleaved(systems, order, [])
    info = backend.info() if backend is not None else {}
    return Runs(
        records,
        runs,
        order,
        ours,
        {"tokenizer": target.tokenizer, "llama": info, "prompt_tokens": [len(p) for p in prompts]},
    )


def _drafter_config(config) -> ml_collections.ConfigDict:
    """The settings bench_decode.drafts_for reads, from ours (no trimmed vocabulary, no threshold)."""
    return ml_collections.ConfigDict(
        dict(
            drafters=tuple(config.drafters), draft=config.draft, draft_dtype=config.draft_dtype,
            target=config.target, draft_vocab=0, max_ngram=config.max_ngram, draft_threshold=0.0,
            suffix_threshold=0.0,
        )
    )  # fmt: skip


def _same_as_plain(runs: Runs, name: str, r: int) -> bool:
    """Whether run r of system `name` gave spec-jax plain's tokens (by text for llama.cpp)."""
    result, plain = runs.runs[name]["results"][r], runs.runs[PLAIN]["results"][r]["tokens"]
    if "tokens" in result:
        return result["tokens"] == plain
    decode = runs.info["tokenizer"].decode
    return bench_peer.first_text_difference(result["text"], plain, decode) is None


def _calls(result: dict) -> int:
    """Target calls that made tokens: ours as counted; llama.cpp's, one per round (decoded - accepted)."""
    if "target_calls" in result:
        return result["target_calls"]
    return result["num_tokens"] - result.get("num_accepted", 0)


def _cell(runs: Runs, name: str, category: str) -> dict:
    """One system's figures over one category's runs (category "all": every run)."""
    picked = [r for r, i in enumerate(runs.order) if category in ("all", runs.records[i]["category"])]
    results = [runs.runs[name]["results"][r] for r in picked]
    tokens = sum(x["num_tokens"] for x in results)
    drafted = sum(x.get("num_drafted", 0) for x in results)
    cell = {
        "category": category,
        "system": name,
        "prompts": len({runs.order[r] for r in picked}),
        "runs": len(picked),
        "new_tokens": sum(x["num_tokens"] for x in results) / len(results),
        "tokens_per_s": tokens / sum(x["seconds"] for x in results),
        "acceptance_rate": sum(x.get("num_accepted", 0) for x in results) / drafted if drafted else "",
        "drafted_per_run": drafted / len(results),
        "tokens_per_target_call": tokens / sum(_calls(x) for x in results),
        "prefill_ms": timing.spread(1e3 * x["prefill_seconds"] for x in results)["median"],
        "same_as_spec_jax_plain": f"{sum(_same_as_plain(runs, name, r) for r in picked)}/{len(picked)}",
    }
    return cell


def _rows(runs: Runs) -> list[dict]:
    """Every (category, system) cell, then each system over all categories, with speedups."""
    categories = list(dict.fromkeys(r["category"] for r in runs.records))
    rows = []
    for category in [*categories, "all"]:
        cells = {name: _cell(runs, name, category) for name in runs.runs}
        for cell in cells.values():
            cell["over_spec_jax_plain"] = cell["tokens_per_s"] / cells[PLAIN]["tokens_per_s"]
            if LLAMA_PLAIN in cells:
                cell["over_llama_cpp_plain"] = cell["tokens_per_s"] / cells[LLAMA_PLAIN]["tokens_per_s"]
            rows.append(cell)
    return rows


def _by_category(rows: list[dict], ours: list[str]) -> list[dict]:
    """One line per category: the defaults (our first speculative system), then every other
    speculative system's speed over llama.cpp's plain decoding."""
    default = ours[1]
    table = []
    for category in dict.fromkeys(r["category"] for r in rows):
        cells = {r["system"]: r for r in rows if r["category"] == category}
        mine = cells[default]
        line = {
            "category": category,
            "prompts": mine["prompts"],
            "acceptance": mine["acceptance_rate"],
            "tokens_per_target_call": mine["tokens_per_target_call"],
            "over_own_plain": mine["over_spec_jax_plain"],
            "exact": mine["same_as_spec_jax_plain"],
        }
        if LLAMA_PLAIN in cells:
            line["over_llama_cpp_plain"] = mine["over_llama_cpp_plain"]
            for name, cell in cells.items():
                if name not in (PLAIN, default, LLAMA_PLAIN):
                    line[f"{name} / llama.cpp plain"] = cell["over_llama_cpp_plain"]
        table.append(line)
    return table


def run(config) -> framework.Result:
    runs = _run_systems(config)
    rows = _rows(runs)
    speculative = runs.ours[1:]
    exact = all(_same_as_plain(runs, name, r) for name in speculative for r in range(len(runs.order)))
    if not exact:
        print(
            "workloads: a spec-jax speculative output differs from spec-jax plain (see same_as_spec_jax_plain)"
        )
    per_prompt = [
        {
            "category": record["category"],
            "source": record["source"],
            "prompt_tokens": runs.info["prompt_tokens"][i],
            **{name: runs.runs[name]["results"][i]["num_tokens"] / runs.runs[name]["results"][i]["seconds"]
               for name in runs.runs},
        }
        for i, record in enumerate(runs.records)
    ]  # fmt: skip
    summary = {
        "prompt_set": config.prompt_set,
        "prompts_per_category": config.prompts_per_category,
        "exact": exact,
        "llama_cpp": {k: v for k, v in runs.info["llama"].items() if k != "ready"},
        "threads": f"{os.cpu_count()} = os.cpu_count() (XLA:CPU; llama.cpp -t and -tb)",
    }
    return framework.Result.from_dicts(
        rows,
        sections={
            "by category: the defaults and llama.cpp's modes (speedups in tokens/s)": _by_category(
                rows, runs.ours
            ),
            "tokens/s per prompt (first run)": per_prompt,
        },
        summary=summary,
        passed=exact,
    )
