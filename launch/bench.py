"""Benchmarks: medians over repeats after warm-up, variants side by side in one run.

  python -m launch.bench --suite=loop       # compiled while_loop vs a Python loop of jitted steps
  python -m launch.bench --suite=overhead   # AR vs speculative (draft = target): bookkeeping cost

Each suite prints a Markdown table and writes .md and .json into --output_dir with the
command, git revision and machine. Timings are never asserted by tests; --quick exists so
the test suite can check that the harness runs.
"""

import functools
import os
import platform
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
from absl import flags

from launch import common

FLAGS = flags.FLAGS
SUITES = ("loop", "overhead", "decode")

flags.DEFINE_enum("suite", "loop", SUITES, "Which benchmark to run.")
flags.DEFINE_string("model", "random", "Model name (see models.known_models()).")
flags.DEFINE_integer("repeats", 5, "Timed repeats (after one warm-up).", lower_bound=1)
flags.DEFINE_integer("max_new_tokens", 128, "Tokens to generate per repeat.", lower_bound=2)
flags.DEFINE_integer("gamma", 4, "Draft tokens per round (overhead suite).", lower_bound=1)
flags.DEFINE_integer("batch_size", 1, "Rows decoded together.", lower_bound=1)
flags.DEFINE_string("draft", "qwen2.5-coder-0.5b", "Draft model name (decode suite).")
flags.DEFINE_list("gammas", ["1", "2", "3", "4", "5", "6"], "Gammas to sweep (decode suite).")
flags.DEFINE_list("temperatures", ["0", "1"], "Temperatures to sweep (decode suite).")
flags.DEFINE_bool("quick", False, "Tiny sizes, for tests: proves the harness runs.")
flags.DEFINE_string("output_dir", "benchmarks/results", "Where the .md and .json go.")


def timed(fn, repeats: int) -> dict:
    """Runs fn once to warm up, then `repeats` times; returns median/min/max seconds."""
    return timed_interleaved({"fn": fn}, repeats)["fn"]


def timed_interleaved(fns: dict, repeats: int) -> dict:
    """Warms each variant up, then times them in turn, round-robin, so that load from other
    work on a shared machine falls on all variants alike. Returns {name: median/min/max}."""
    for fn in fns.values():
        jax.block_until_ready(fn())
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - start)
    return {
        name: {"median": statistics.median(t), "min": min(t), "max": max(t), "repeats": repeats}
        for name, t in times.items()
    }


def machine() -> dict:
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        rev = "unknown"
    return {
        "command": " ".join(["python -m launch.bench", *sys.argv[1:]]),
        "git_revision": rev,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
        "devices": [str(d) for d in jax.devices()],
    }


def ar_setup(model, prompts, max_new_tokens):
    """The executables and the initial state of the autoregressive loop for these prompts."""
    from spec_jax import decode
    from spec_jax.sampling import SamplingParams

    width = decode.bucket_length(max(len(p) for p in prompts))
    static = decode.ARStatic(model.config, SamplingParams(0.0), max_new_tokens, width + max_new_tokens)
    tokens, lens = decode.pad_prompts(prompts, width)
    inputs = decode.PrefillInputs(
        jnp.asarray(tokens), jnp.asarray(lens), jnp.asarray(-1, jnp.int32), jax.random.key(0)
    )
    prefill = jax.jit(functools.partial(decode.ar_prefill, static))
    return static, prefill, inputs


def suite_loop(model, prompts) -> list[dict]:
    """Per-token time: the whole decode as one lax.while_loop vs a Python loop of the jitted step."""
    from spec_jax import decode

    n = FLAGS.max_new_tokens
    static, prefill, inputs = ar_setup(model, prompts, n)
    loop = jax.jit(functools.partial(decode.ar_loop, static), donate_argnums=1)
    step = jax.jit(functools.partial(decode.ar_step, static), donate_argnums=1)

    def compiled_loop():
        return loop(model.params, prefill(model.params, inputs), inputs.eos_id)

    def python_loop():
        state = prefill(model.params, inputs)
        while not bool(jnp.all(state.out.done)):  # a host check per token, as a Python loop does
            state = step(model.params, state, inputs.eos_id)
        return state

    variants = {
        "compiled lax.while_loop": compiled_loop,
        "python loop of jitted step": python_loop,
        "prefill alone": lambda: prefill(model.params, inputs),
    }
    results = timed_interleaved(variants, FLAGS.repeats)
    prefill_only = results.pop("prefill alone")
    rows = []
    for name, t in results.items():
        steps = n - 1  # tokens after the first, which prefill draws
        per_token = (t["median"] - prefill_only["median"]) / steps
        rows.append(
            {
                "variant": name,
                "ms_per_token": 1e3 * per_token,
                "total_ms_median": 1e3 * t["median"],
                "total_ms_min": 1e3 * t["min"],
                "total_ms_max": 1e3 * t["max"],
                "tokens": n,
                "prefill_ms_median": 1e3 * prefill_only["median"],
            }
        )
    return rows


def suite_overhead(model, prompts) -> list[dict]:
    """Time per committed token of AR and of speculative decoding with draft = target.

    With draft = target every draft is accepted, so a round commits gamma + 1 tokens for
    gamma draft steps plus one verification call; what the round costs beyond those model
    calls (measured alone, same shapes) is the loop's own bookkeeping.
    """
    import models
    import spec_jax
    from models.transformer import forward

    n, gamma = FLAGS.max_new_tokens, FLAGS.gamma
    kwargs = dict(max_new_tokens=n, temperature=0.0)
    ar = lambda: spec_jax.generate(model, prompts, **kwargs)  # noqa: E731
    spec = lambda: spec_jax.generate(model, prompts, draft=model, gamma=gamma, **kwargs)  # noqa: E731
    ar(), spec()  # compile
    ar_runs, spec_runs = [], []
    for _ in range(FLAGS.repeats):  # interleaved, so machine load falls on both alike
        ar_runs.append(ar().stats)
        spec_runs.append(spec().stats)

    # The model calls of one round (drafter: one T=2 call and gamma - 1 T=1 calls; target: one
    # T=gamma+1 call), alone, compiled in a fori_loop so per-call dispatch is not counted.
    batch, cache_len, reps = len(prompts), 16 + n + gamma, 32
    cache = models.init_cache(model.config, batch, cache_len)
    pos0 = jnp.full((batch, 1), cache_len // 2, jnp.int32)

    def repeated(widths):
        def body(_, carry):
            cache, acc = carry
            for offset, width in widths:
                logits, cache = forward(
                    model.config,
                    model.params,
                    jnp.zeros((batch, width), jnp.int32),
                    pos0 + offset + jnp.arange(width),
                    cache,
                )
                acc = acc + logits[:, -1, 0].sum()  # consumed, so the head is not dead code
            return cache, acc

        fn = jax.jit(lambda c: jax.lax.fori_loop(0, reps, body, (c, jnp.zeros(()))))
        return timed(lambda: fn(cache), FLAGS.repeats)["median"] / reps

    calls = repeated([(0, 2)] + [(2 + i, 1) for i in range(gamma - 1)] + [(0, gamma + 1)])
    ar_step = repeated([(0, 1)])

    def med(runs, key):
        return statistics.median(r[key] for r in runs)

    rounds = spec_runs[0]["target_calls"] - 1
    round_s = med(spec_runs, "decode_seconds") / rounds
    ar_token_s = med(ar_runs, "decode_seconds") / (ar_runs[0]["target_calls"] - 1)
    spec_token_s = med(spec_runs, "decode_seconds") / (spec_runs[0]["num_new_tokens"] - len(prompts))
    return [
        {
            "variant": "autoregressive",
            "ms_per_committed_token": 1e3 * ar_token_s,
            "ms_per_step_or_round": 1e3 * ar_token_s,
            "model_calls_ms": 1e3 * ar_step,
            "non_model_fraction": 1 - ar_step / ar_token_s,  # signed: negative = within noise
        },
        {
            "variant": f"speculative, draft = target, gamma {gamma}",
            "ms_per_committed_token": 1e3 * spec_token_s,
            "ms_per_step_or_round": 1e3 * round_s,
            "model_calls_ms": 1e3 * calls,
            "non_model_fraction": 1 - calls / round_s,
            "acceptance_rate": spec_runs[0]["acceptance_rate"],
            "mean_accepted_length": spec_runs[0]["mean_accepted_length"],
        },
    ]


# Code and English prompts for the decode suite (the Qwen pair are code models).
PROMPTS = [
    "def quicksort(arr):\n    ",
    "import numpy as np\n\ndef moving_average(x, window):\n    ",
    "class LinkedList:\n    def __init__(self):\n        ",
    "# Read a CSV file and print the sum of the second column\nimport csv\n",
    "def is_prime(n: int) -> bool:\n    ",
    "The history of the Roman Empire begins",
    "To make a cup of tea, first",
    "SELECT name, COUNT(*) FROM orders",
]


def suite_decode(target, prompts_text) -> list[dict]:
    """The target alone vs speculative decoding with the draft, over gamma and temperature.

    First a greedy identity check: all prompts decoded in one batch, autoregressively and
    speculatively, must give identical tokens. Then, at batch 1 on the first prompt, tokens/s
    (median over repeats after a warm-up; compile time reported apart) per (temperature, gamma).
    """
    import models
    import spec_jax

    draft = models.load(FLAGS.draft)
    tok = target.tokenizer
    prompts = [tok.encode(p) for p in prompts_text]
    n = FLAGS.max_new_tokens
    rows = []
    ar_all = spec_jax.generate(target, prompts, max_new_tokens=n, temperature=0.0)
    sp_all = spec_jax.generate(target, prompts, draft=draft, gamma=4, max_new_tokens=n, temperature=0.0)
    same = [a == b for a, b in zip(ar_all.tokens, sp_all.tokens, strict=True)]
    rows.append(
        {
            "variant": f"greedy identity, {len(prompts)} prompts batched, gamma 4",
            "identical_rows": f"{sum(same)}/{len(same)}",
            "acceptance_rate": sp_all.stats["acceptance_rate"],
            "mean_accepted_length": sp_all.stats["mean_accepted_length"],
            "tokens_per_s": sp_all.stats["tokens_per_second"],
            "ar_tokens_per_s": ar_all.stats["tokens_per_second"],
        }
    )
    first = prompts[:1]
    for temperature in (float(t) for t in FLAGS.temperatures):

        def run(gamma, draft_model, temperature=temperature):
            kw = dict(max_new_tokens=n, temperature=temperature, seed=0)
            compile_s = spec_jax.generate(target, first, draft=draft_model, gamma=gamma, **kw).stats[
                "compile_seconds"
            ]
            stats = [
                spec_jax.generate(target, first, draft=draft_model, gamma=gamma, **kw).stats
                for _ in range(FLAGS.repeats)
            ]
            tps = statistics.median(s["tokens_per_second"] for s in stats)
            return tps, stats, compile_s, [s["tokens_per_second"] for s in stats]

        ar_tps, ar_stats, ar_compile, ar_all_tps = run(1, None)
        rows.append(
            {
                "variant": "autoregressive",
                "temperature": temperature,
                "gamma": 0,
                "tokens_per_s": ar_tps,
                "tokens_per_s_min": min(ar_all_tps),
                "tokens_per_s_max": max(ar_all_tps),
                "speedup": 1.0,
                "compile_s": ar_compile,
            }
        )
        for gamma in (int(g) for g in FLAGS.gammas):
            tps, stats, compile_s, all_tps = run(gamma, draft)
            rows.append(
                {
                    "variant": "speculative",
                    "temperature": temperature,
                    "gamma": gamma,
                    "tokens_per_s": tps,
                    "tokens_per_s_min": min(all_tps),
                    "tokens_per_s_max": max(all_tps),
                    "speedup": tps / ar_tps,
                    "compile_s": compile_s,
                    "acceptance_rate": statistics.median(s["acceptance_rate"] for s in stats),
                    "mean_accepted_length": statistics.median(s["mean_accepted_length"] for s in stats),
                    "alpha_hat": statistics.median(s["alpha_hat"] for s in stats),
                }
            )
            print(rows[-1], flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main(argv):
    if len(argv) > 1:
        raise common.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    import models

    if FLAGS.quick:
        model = models.random_model(vocab_size=64, num_layers=1, d_model=32, num_heads=2, num_kv_heads=1)
        FLAGS.repeats, FLAGS.max_new_tokens = 1, 8
    else:
        model = models.load(FLAGS.model)
    if FLAGS.suite == "decode":
        if FLAGS.quick:
            model = models.load("random")
            FLAGS.draft, FLAGS.gammas, FLAGS.temperatures = "random-draft", ["2"], ["0"]
        rows = suite_decode(model, PROMPTS[:2] if FLAGS.quick else PROMPTS)
    else:
        prompts = [[1 + (7 * i + j) % 50 for j in range(8 + 3 * i)] for i in range(FLAGS.batch_size)]
        rows = {"loop": suite_loop, "overhead": suite_overhead}[FLAGS.suite](model, prompts)
    info = machine()
    info.update(
        suite=FLAGS.suite,
        model=FLAGS.model if not FLAGS.quick else "quick",
        draft=FLAGS.draft if FLAGS.suite == "decode" else None,
        batch_size=FLAGS.batch_size,
        max_new_tokens=FLAGS.max_new_tokens,
        repeats=FLAGS.repeats,
    )
    table = markdown(rows)
    print(table)
    os.makedirs(FLAGS.output_dir, exist_ok=True)
    base = os.path.join(FLAGS.output_dir, f"{FLAGS.suite}{'-quick' if FLAGS.quick else ''}")
    header = "\n".join(f"- {k}: {v}" for k, v in info.items())
    md_tmp = base + ".md.tmp"
    with open(md_tmp, "w") as f:
        f.write(f"# Benchmark: {FLAGS.suite}\n\n{header}\n\n{table}\n")
    os.replace(md_tmp, base + ".md")
    common.write_json_atomic(base + ".json", {"info": info, "rows": rows})


if __name__ == "__main__":
    common.run(main)
