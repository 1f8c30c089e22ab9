"""Table 3 of the paper: alpha for several drafts of one target, on code and on English news.

For each target and draft, task (code: the standard library's source; news: BBC News) and
temperature, prompts cut from held-out documents are decoded speculatively and alpha is
measured two ways over the positions the target scored on the committed prefix (the drafts
up to and including the first rejection; see spec_jax.metrics):
  alpha_hat      mean of sum_x min(p, q), the sampler's own metric
  accepted/scored  the fraction of those drafts the rule accepted (each is accepted with
                 probability sum_x min(p, q), so it estimates the same alpha, with more noise
                 at temperature > 0; at temperature 0 the two are equal)
Drafts: "unigram" and "bigram" are n-gram drafters (spec_jax.drafting.ngram) fitted on the task's
training documents tokenized with the target's tokenizer; "prompt_lookup" copies from the
prompt and output (spec_jax.drafting.lookup), "suffix" samples the continuation of the longest earlier
suffix in the prompt + output or in the task's training documents (spec_jax.drafting.suffix, max_ngram 3),
"hybrid@MODEL" is prompt lookup with MODEL where it finds nothing; "head" is the target's draft
head trained on its features (the training package, `python -m launch.train`; read from its default
workdir); any other name is a draft model. The lookup drafts and the head are left out of the
ordering check (the lookups' alpha is over the positions they chose to propose; the head is
not one of the paper's drafts).
Token trees (`trees`, e.g. 4,8,16): each draft also runs as a chain of gamma = N drafts and as
a tree of N nodes (spec_jax.tree: the draft's own kind of tree; a drafter without one proposes
its chain) for each N, the same number of verified positions per target call, and a second
table reports the mean accepted length per verify call of each, with the tree's ratio to the
chain's.
Confidence intervals: percentile bootstrap over prompts (each estimate is a ratio of sums
over prompts, resampled with replacement), because positions within one prompt are not
independent. Runs use experiments.per_prompt, which keeps the metrics per prompt.
"""

import time

import jax
import ml_collections
import numpy as np
import tqdm

from experiments import common, framework, per_prompt
from models import corpora
from spec_jax import drafting, metrics
from spec_jax.drafting import ngram, suffix_table

TITLE = "Table 3 of Leviathan et al. (2023): alpha for n-gram and model drafts, code and news"
NGRAM_DRAFTS = ("unigram", "bigram")
LOOKUP = "prompt_lookup"
SUFFIX = "suffix"
SUFFIX_NGRAM = 3
HYBRID_PREFIX = "hybrid@"
# the target's trained draft head (spec_jax.drafting.trained_head.load_drafter, default workdir)
HEAD = "head"


def is_lookup(draft: str) -> bool:
    return draft in (LOOKUP, SUFFIX) or draft.startswith(HYBRID_PREFIX)


def unordered(draft: str) -> bool:
    """Drafts left out of the ordering check: the lookups (their alpha is over the positions they
    chose to propose) and the trained head (not one of the paper's drafts)."""
    return is_lookup(draft) or draft == HEAD


COLUMNS = (
    "target",
    "draft",
    "task",
    "temperature",
    "gamma",
    "tree",
    "num_prompts",
    "num_rounds",
    "num_scored_positions",
    "num_draft_tokens",
    "alpha_hat",
    "alpha_hat_ci_low",
    "alpha_hat_ci_high",
    "accepted_per_scored",
    "accepted_per_scored_ci_low",
    "accepted_per_scored_ci_high",
    "acceptance_rate",
    "mean_accepted_length",
    "mean_accepted_length_ci_low",
    "mean_accepted_length_ci_high",
    "seconds",
)


def get_config(quick: bool = False) -> ml_collections.ConfigDict:
    """Full: the Qwen pair and SmolLM2 on both tasks at temperatures 0 and 1, 16 prompts of 32
    tokens, 24 new tokens each, gamma 2. Quick: a tiny random target with the n-gram drafts, code
    only, temperature 1, 4 prompts (model drafts run through the same code in walltime's quick mode
    and the sampler's tests)."""
    config = ml_collections.ConfigDict()
    # "TARGET:DRAFT+DRAFT+...", drafts in the order their alpha should increase.
    config.runs = (
        ("tiny:unigram+bigram+suffix",)
        if quick
        else (
            "qwen2.5-coder-1.5b:unigram+bigram+qwen2.5-coder-0.5b+prompt_lookup+suffix"
            "+hybrid@qwen2.5-coder-0.5b",
            "smollm2-135m:unigram+bigram",
        )
    )
    config.tasks = ("code",) if quick else corpora.TASKS
    config.temperatures = (1.0,) if quick else (0.0, 1.0)
    config.num_prompts = 4 if quick else 16
    config.batch_size = 4 if quick else 8  # prompts per compiled call
    config.prompt_tokens = 16 if quick else 32
    config.max_new_tokens = 8 if quick else 24
    config.gamma = 2
    # The models' precision (models.precision.PRECISIONS): float32 is the checkpoints' own
    # distributions; gguf_q8 runs the GGUF's blocks several times faster on a CPU.
    config.dtype = "float32"
    # Node counts N: each draft also as a chain of N drafts and a tree of N nodes (empty: none).
    config.trees = ()
    config.test_fraction = 0.2  # share of documents held out for prompts
    config.max_train_documents = 20 if quick else 0  # 0: every training document
    config.add_k = ngram.DEFAULT_ADD_K
    config.prior = ngram.DEFAULT_PRIOR
    config.bootstrap_resamples = 2000
    # Random models have no reason to order their drafts; the check is for real ones.
    config.check_ordering = not quick
    config.seed = 0
    return config


def parse_run(run: str) -> tuple[str, tuple[str, ...]]:
    """ "TARGET:DRAFT+DRAFT" -> (target, drafts); ValueError("runs: ...") if malformed."""
    target, sep, drafts = run.partition(":")
    names = tuple(d.strip() for d in drafts.split("+") if d.strip())
    if not sep or not target.strip() or not names:
        raise ValueError(f"runs: expected 'TARGET:DRAFT+DRAFT+...', got {run!r}")
    return target.strip(), names


DTYPE_KEYS = ("dtype",)
INT_RANGES = {
    "num_prompts": (2, 10_000),
    "batch_size": (1, 1024),
    "prompt_tokens": (1, 1024),
    "max_new_tokens": (2, 1024),
    "gamma": (1, 64),
    "max_train_documents": (0, 10**9),
    "bootstrap_resamples": (100, 10**6),
}
TUPLE_RANGES = {"temperatures": (float, 0.0, 1e6), "trees": (int, 1, 31)}


def validate(config) -> None:
    """Raises ValueError starting with the offending key."""
    if not config.runs:
        raise ValueError("runs: give at least one 'TARGET:DRAFT+...'")
    for run in config.runs:
        target, drafts = parse_run(run)
        common.check_model_name("runs", target)
        for draft in drafts:
            if draft.startswith(HYBRID_PREFIX):
                common.check_model_name("runs", draft[len(HYBRID_PREFIX) :])
            elif draft not in NGRAM_DRAFTS and draft not in (LOOKUP, SUFFIX, HEAD):
                common.check_model_name("runs", draft)
    if not config.tasks or any(t not in corpora.TASKS for t in config.tasks):
        raise ValueError(
            f"tasks: each task must be one of {', '.join(corpora.TASKS)}, got {tuple(config.tasks)}"
        )
    if not 0.0 < config.test_fraction < 1.0:
        raise ValueError(f"test_fraction: must be in (0, 1), got {config.test_fraction}")
    for key in ("add_k", "prior"):
        if not config[key] > 0:
            raise ValueError(f"{key}: must be a number > 0, got {config[key]}")


def task_data(task: str, tokenizer, config) -> tuple[list[list[int]], list[list[int]], dict]:
    """(training token sequences, prompts of exactly prompt_tokens ids, sizes) for one task."""
    train, test = corpora.split(corpora.documents(task), config.test_fraction)
    if config.max_train_documents:
        train = train[: config.max_train_documents]
    windows = corpora.prompt_texts(test, config.num_prompts, 8 * config.prompt_tokens, config.seed)
    prompts = []
    for i, ids in enumerate(common.encode_all(tokenizer, windows)):
        if len(ids) < config.prompt_tokens:
            raise ValueError(f"prompt_tokens: prompt {i} of {task} has only {len(ids)} tokens")
        prompts.append(ids[: config.prompt_tokens])
    sequences = common.encode_all(tokenizer, [text for _, text in train])
    sizes = {
        "train_documents": len(train),
        "train_tokens": int(sum(len(s) for s in sequences)),
        "test_documents": len(test),
    }
    return sequences, prompts, sizes


def cell(target, draft, prompts, temperature, config, gamma=None, tree=0) -> dict:
    """Runs every prompt (in batches) and pools the per-prompt metrics of one table cell (chains
    of gamma drafts, default config.gamma; or tree rounds of `tree` nodes)."""
    start = time.perf_counter()
    rows = []
    for i in range(0, len(prompts), config.batch_size):
        _, batch_rows, _ = per_prompt.run(
            target,
            draft,
            prompts[i : i + config.batch_size],
            gamma=config.gamma if gamma is None else gamma,
            max_new_tokens=config.max_new_tokens,
            temperature=temperature,
            seed=config.seed + i,
            tree=tree,
        )
        rows += batch_rows
    pooled = metrics.pool(rows)
    # Per-prompt sums for the bootstrap over prompts (a prompt with no scored position adds 0).
    scored = np.array([r["num_scored_positions"] for r in rows], np.float64)
    overlap = np.array(
        [r["alpha_hat"] * r["num_scored_positions"] if r["num_scored_positions"] else 0.0 for r in rows]
    )
    accepted = np.array([r["num_accepted_tokens"] for r in rows], np.float64)
    rounds = np.array([r["num_rounds"] for r in rows], np.float64)
    resamples, seed = config.bootstrap_resamples, config.seed
    return {
        "gamma": config.gamma if gamma is None else gamma,
        "tree": tree,
        "num_prompts": len(rows),
        "num_rounds": pooled["num_rounds"],
        "num_draft_tokens": pooled["num_draft_tokens"],
        "num_scored_positions": pooled["num_scored_positions"],
        "alpha_hat": pooled["alpha_hat"],
        "alpha_hat_ci": common.bootstrap_ratio_ci(overlap, scored, resamples, seed),
        "accepted_per_scored": float(accepted.sum() / scored.sum()),
        "accepted_per_scored_ci": common.bootstrap_ratio_ci(accepted, scored, resamples, seed),
        "acceptance_rate": pooled["acceptance_rate"],
        "mean_accepted_length": pooled["mean_accepted_length"],
        # tokens per verify call, (accepted + rounds) / rounds, as a ratio of per-prompt sums
        "mean_accepted_length_ci": common.bootstrap_ratio_ci(accepted + rounds, rounds, resamples, seed),
        "seconds": time.perf_counter() - start,
        "per_prompt": {
            "num_rounds": rounds.astype(int).tolist(),
            "num_scored_positions": scored.astype(int).tolist(),
            "overlap_sum": overlap.tolist(),
            "num_accepted_tokens": accepted.astype(int).tolist(),
        },
    }


def same_shapes(pairs):
    """Bigram (drafter, tables) pairs padded to one max_row_len and one table length, so every
    task's bigram shares one compiled loop (a new shape or static width would recompile)."""
    width = max(d.max_row_len for d, _ in pairs)
    length = max(t.next_ids.shape[0] - d.max_row_len for d, t in pairs) + width
    out = []
    for d, t in pairs:
        pad = length - t.next_ids.shape[0]
        t = t.replace(
            next_ids=jax.numpy.pad(t.next_ids, (0, pad)), next_counts=jax.numpy.pad(t.next_counts, (0, pad))
        )
        out.append((type(d)(d.vocab_size, width), t))
    return out


def same_width_suffix(target, data, tasks) -> dict:
    """{task: suffix (drafter, tables)} fitted on each task's training sequences, every table
    with one number of buckets so the tasks share one compiled loop."""
    vocab = target.config.vocab_size
    fits = {t: suffix_table.fit_suffix_tables(data[t][0], vocab, SUFFIX_NGRAM) for t in tasks}
    buckets = max(t.keys.shape[0] for t in fits.values())
    out = {}
    for task, tables in fits.items():
        if tables.keys.shape[0] != buckets:
            tables = suffix_table.fit_suffix_tables(data[task][0], vocab, SUFFIX_NGRAM, num_buckets=buckets)
        out[task] = drafting.build(SUFFIX, target, drafting.Settings(max_ngram=SUFFIX_NGRAM, tables=tables))
    return out


def measure(config) -> list[dict]:
    """Every cell of the table, as dicts (target, draft, task, temperature and cell())."""
    cells = []
    for run in config.runs:
        target_name, draft_names = parse_run(run)
        target = common.load_model(target_name, config.dtype)
        vocab = target.config.vocab_size
        data = {task: task_data(task, target.tokenizer, config) for task in config.tasks}
        drafts = {}
        if "unigram" in draft_names:
            drafts["unigram"] = {t: ngram.fit_unigram(data[t][0], vocab, config.add_k) for t in config.tasks}
        if "bigram" in draft_names:
            fits = [ngram.fit_bigram(data[t][0], vocab, config.add_k, config.prior) for t in config.tasks]
            drafts["bigram"] = dict(zip(config.tasks, same_shapes(fits), strict=True))
        if SUFFIX in draft_names:
            drafts[SUFFIX] = same_width_suffix(target, data, config.tasks)
        for name in draft_names:
            if name == LOOKUP:
                drafts[name] = dict.fromkeys(config.tasks, drafting.build(LOOKUP, target))
            elif name == HEAD:
                drafts[name] = dict.fromkeys(config.tasks, drafting.build(HEAD, target))
            elif name.startswith(HYBRID_PREFIX):
                model = common.load_model(name[len(HYBRID_PREFIX) :], config.dtype)
                drafts[name] = dict.fromkeys(
                    config.tasks, drafting.build("hybrid", target, drafting.Settings(draft=model))
                )
            elif name not in NGRAM_DRAFTS and name not in (SUFFIX, HEAD):
                model = common.load_model(name, config.dtype)
                drafts[name] = dict.fromkeys(config.tasks, model)
        # (draft, temperature, task, gamma, tree): the table's cells, then chain and tree per N
        shapes = [(None, 0)] + [shape for n in config.trees for shape in ((n, 0), (n, n))]
        grid = [
            (name, t, task, gamma, tree)
            for name in draft_names
            for t in config.temperatures
            for task in config.tasks
            for gamma, tree in shapes
        ]
        for name, temperature, task, gamma, tree in tqdm.tqdm(
            grid, desc=f"table3 {target_name}", unit="cell"
        ):
            result = cell(target, drafts[name][task], data[task][1], temperature, config, gamma, tree)
            cells.append(
                {
                    "target": target_name,
                    "draft": name,
                    "task": task,
                    "temperature": float(temperature),
                    "data": data[task][2],
                    "main": gamma is None,  # a cell of Table 3 itself (else of the trees' table)
                    **result,
                }
            )
        del target, drafts
    return cells


def ordering_checks(cells, config) -> list[dict]:
    """For each (target, task, temperature): are the drafts' alpha_hat in the listed order?"""
    cells = [c for c in cells if c["main"]]
    checks = []
    for run in config.runs:
        target, drafts = parse_run(run)
        drafts = tuple(d for d in drafts if not unordered(d))
        if len(drafts) < 2:
            continue
        for task in config.tasks:
            for temperature in config.temperatures:
                row = {
                    c["draft"]: c
                    for c in cells
                    if (c["target"], c["task"], c["temperature"]) == (target, task, float(temperature))
                }
                chain = [row[d] for d in drafts]
                pairs = list(zip(chain, chain[1:], strict=False))
                checks.append(
                    {
                        "target": target,
                        "task": task,
                        "temperature": float(temperature),
                        "order": " < ".join(drafts),
                        "holds": all(a["alpha_hat"] < b["alpha_hat"] for a, b in pairs),
                        "cis_disjoint": all(a["alpha_hat_ci"][1] < b["alpha_hat_ci"][0] for a, b in pairs),
                    }
                )
    return checks


def _ci(value, ci) -> str:
    return f"{value:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]"


def tree_rows(cells) -> list[list]:
    """The trees' table: per target, draft, task, temperature and N, the mean accepted length
    per verify call of the chain (gamma = N) and of the tree (N nodes), with intervals."""
    by_key = {}
    for c in cells:
        if not c["main"]:
            key = (c["target"], c["draft"], c["task"], c["temperature"], c["gamma"])
            by_key.setdefault(key, {})["tree" if c["tree"] else "chain"] = c
    rows = []
    for (target, draft, task, t, n), pair in by_key.items():
        chain, tree = pair["chain"], pair["tree"]
        rows.append(
            [
                target,
                draft,
                task,
                f"{t:g}",
                n,
                _ci(chain["mean_accepted_length"], chain["mean_accepted_length_ci"]),
                _ci(tree["mean_accepted_length"], tree["mean_accepted_length_ci"]),
                f"{tree['mean_accepted_length'] / chain['mean_accepted_length']:.2f}x",
                f"{chain['seconds']:.1f} / {tree['seconds']:.1f}",
            ]
        )
    return rows


def markdown(cells, checks, config, passed) -> str:
    temps = [float(t) for t in config.temperatures]
    trees = tree_rows(cells)
    cells = [c for c in cells if c["main"]]
    lines = [
        "## Table 3 analog: alpha per draft",
        "",
        "Each cell: alpha_hat = mean sum_x min(p, q) over the scored positions, then "
        "[95% percentile bootstrap interval over prompts]; beside it the observed acceptance "
        "(accepted / scored positions) with its interval. n = scored positions over "
        f"{config.num_prompts} prompts of {config.prompt_tokens} tokens, {config.max_new_tokens} "
        f"new tokens each, gamma {config.gamma}, the models at {config.dtype}.",
        "",
        _alpha_table(cells, config, temps),
        "",
        *_ordering_section(checks, passed),
    ]
    if trees:
        lines += _trees_section(trees)
    return "\n".join(lines + _data_section(cells, config))


def _alpha_table(cells, config, temps) -> str:
    """Table 3's cells: per (target, task, draft) alpha_hat and the observed acceptance with
    their intervals, and n, at each temperature."""
    columns = ["target", "task", "draft"]
    for t in temps:
        columns += [f"alpha_hat (T={t:g})", f"accepted/scored (T={t:g})", f"n (T={t:g})"]
    rows = []
    for run in config.runs:
        target, drafts = parse_run(run)
        for task in config.tasks:
            for draft in drafts:
                row = [target, task, draft]
                for t in temps:
                    (c,) = [
                        c
                        for c in cells
                        if (c["target"], c["task"], c["draft"], c["temperature"]) == (target, task, draft, t)
                    ]
                    row += [
                        _ci(c["alpha_hat"], c["alpha_hat_ci"]),
                        _ci(c["accepted_per_scored"], c["accepted_per_scored_ci"]),
                        c["num_scored_positions"],
                    ]
                rows.append(row)
    return framework.markdown_table(columns, rows)


def _ordering_section(checks, passed) -> list[str]:
    """The ordering check's table and verdict (passed None: not checked, random models)."""
    lines = []
    lines += ["## The ordering check", ""]
    lines += [
        framework.markdown_table(
            [
                "target",
                "task",
                "temperature",
                "expected order of alpha_hat",
                "holds",
                "95% intervals disjoint",
            ],
            [
                [c["target"], c["task"], f"{c['temperature']:g}", c["order"], c["holds"], c["cis_disjoint"]]
                for c in checks
            ],
        ),
        "",
    ]
    held = sum(c["holds"] for c in checks)
    if passed is None:
        lines.append(f"Ordering held in {held} of {len(checks)} cases (not checked: random models).")
    else:
        lines.append(
            f"Ordering held in {held} of {len(checks)} cases: the check {'passed' if passed else 'FAILED'}."
        )
    return lines


def _trees_section(trees) -> list[str]:
    """Chains against trees at the same number of verified positions (tree_rows)."""
    lines = []
    lines += [
        "",
        "## Chains and trees at the same number of verified positions",
        "",
        "Mean accepted length per verify call (tokens a target call commits, the drafts accepted "
        "plus the target's own), [95% percentile bootstrap interval over prompts], for a chain of "
        "N drafts and a tree of N nodes (the draft's own tree: prompt lookup and suffix tries of "
        "their matches, a draft model's EAGLE-2 expansion, around the chain it samples at "
        "T > 0; any other draft proposes its chain); "
        "seconds are the cell's wall time on this machine, compilation included.",
        "",
        framework.markdown_table(
            [
                "target",
                "draft",
                "task",
                "T",
                "N",
                "chain",
                "tree",
                "tree / chain",
                "seconds (chain / tree)",
            ],
            trees,
        ),
    ]
    return lines


def _data_section(cells, config) -> list[str]:
    """What each (target, task)'s n-grams were fitted on and where its prompts came from, and
    the n-gram smoothing."""
    lines = []
    lines += ["", "## Data", ""]
    seen = set()
    for c in cells:
        key = (c["target"], c["task"])
        if key not in seen:
            seen.add(key)
            d = c["data"]
            lines.append(
                f"- {c['target']}, {c['task']}: n-grams fitted on {d['train_documents']} training documents "
                f"({d['train_tokens']:,} tokens); prompts from {d['test_documents']} held-out documents."
            )
    lines += [
        "",
        f"n-gram smoothing: unigram add-k = {config.add_k}; bigram Dirichlet prior = {config.prior} "
        "pseudo-counts on the unigram (spec_jax/drafting/ngram.py). `acceptance_rate` in the CSV is "
        "accepted / drafted, the serving engines' metric: it counts drafts after a rejection as "
        "rejected, so it is below alpha for gamma > 1.",
    ]
    return lines


def figure(cells, config):
    cells = [c for c in cells if c["main"]]
    runs = [parse_run(r) for r in config.runs]
    fig, axes = framework.new_figure(6 * len(runs), 4.2, len(runs))
    groups = [(task, float(t)) for task in config.tasks for t in config.temperatures]
    for ax, (target, drafts) in zip(axes, runs, strict=True):
        width = 0.8 / len(drafts)
        for j, draft in enumerate(drafts):
            values, errors = [], [[], []]
            for task, t in groups:
                (c,) = [
                    c
                    for c in cells
                    if (c["target"], c["task"], c["draft"], c["temperature"]) == (target, task, draft, t)
                ]
                values.append(c["alpha_hat"])
                errors[0].append(c["alpha_hat"] - c["alpha_hat_ci"][0])
                errors[1].append(c["alpha_hat_ci"][1] - c["alpha_hat"])
            x = np.arange(len(groups)) + (j - (len(drafts) - 1) / 2) * width
            ax.bar(x, values, width, yerr=errors, capsize=3, label=draft)
        ax.set_xticks(np.arange(len(groups)), [f"{task}\nT={t:g}" for task, t in groups])
        ax.set_ylim(0, 1)
        ax.set_ylabel("alpha (mean sum min(p, q)), 95% CI")
        ax.set_title(f"target {target}")
        ax.legend(fontsize=8)
    return fig


def run(config) -> framework.Result:
    cells = measure(config)
    checks = ordering_checks(cells, config)
    passed = all(c["holds"] for c in checks) if config.check_ordering else None
    rows = [
        [
            c["target"],
            c["draft"],
            c["task"],
            c["temperature"],
            c["gamma"],
            c["tree"],
            c["num_prompts"],
            c["num_rounds"],
            c["num_scored_positions"],
            c["num_draft_tokens"],
            c["alpha_hat"],
            *c["alpha_hat_ci"],
            c["accepted_per_scored"],
            *c["accepted_per_scored_ci"],
            c["acceptance_rate"],
            c["mean_accepted_length"],
            *c["mean_accepted_length_ci"],
            round(c["seconds"], 2),
        ]
        for c in cells
    ]
    summary = {"cells": cells, "ordering": checks}
    return framework.Result(
        columns=COLUMNS,
        rows=rows,
        markdown=markdown(cells, checks, config, passed),
        summary=summary,
        figure=figure(cells, config),
        passed=passed,
    )
