"""Compile every attention call and model step of the registered models, and the speculative loop,
for every TPU / GPU target.

Runs the real device compilers on this CPU-only machine (libtpu and the CUDA PJRT plugin's
compile-only devices; models/kernels/compile_targets.py) and prints a Markdown table: targets x
(kind, dtype) with the cases that compiled, and each distinct error with one case that hit it.

    JAX_PLATFORMS=cpu python scripts/compile_sweep.py                       # everything
    JAX_PLATFORMS=cpu python scripts/compile_sweep.py --targets=gpu-l4,tpu-v3 --kinds=kernel
    make compile-sweep ARGS="--jobs=2 --output_json=/tmp/sweep.json"

Grid: kernel calls over B x S x T x model x dtype (T <= S), model steps (2 scanned layers) over
--model_batches x --model_num_queries x model x dtype at S = --model_cache_len, and the whole
speculative decoding program (experiments.compile_loop: spec_prefill and spec_loop of the Qwen pair at
full depth, at `make demo`'s shapes) over --loop_batches x dtype, each with the target's Pallas impl
forced; where "auto" picks something else for the target (XLA attention on pre-Ampere GPUs) the
model steps and the loop are compiled with "auto" too. "refused" is a trace-time ValueError of
the kernels (e.g. pallas_gpu forced on a pre-Ampere GPU): a clear error instead of a compiler
failure. "pods" (not per target): the big pairs' loops compiled sharded for pod slices,
experiments/pod_pairs.py's table (about 19 minutes, one compile at a time; docs/pods.md).
"""

import argparse
import collections
import concurrent.futures
import json
import multiprocessing
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
# Where `make test` puts libtpu and the CUDA plugin (pip --target; see tests/conftest.py).
_DEPS = os.environ.get("SPEC_JAX_COMPILE_DEPS", os.path.join(_ROOT, ".venv-compile"))
if os.path.isdir(_DEPS):
    sys.path.append(_DEPS)

from experiments import compile_loop, framework, pod_pairs  # noqa: E402
from models.kernels import compile_targets as ct  # noqa: E402

KINDS = (*ct.KINDS, "loop", "pods")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _names(text: str, allowed, what: str) -> list[str]:
    names = [x for x in text.split(",") if x]
    bad = [x for x in names if x not in allowed]
    if bad or not names:
        raise SystemExit(
            f"compile_sweep.py: error: --{what} must be a comma list out of {', '.join(allowed)}"
        )
    return names


def build_cases(args) -> list[tuple[str, ct.Case]]:
    cases = []
    for target in args.targets:
        for model in args.models:
            for dtype in args.dtypes:
                if "kernel" in args.kinds:
                    for b in args.batches:
                        for s in args.cache_lens:
                            for t in args.num_queries:
                                if t <= s:
                                    cases.append((target, ct.Case("kernel", model, b, s, t, dtype)))
                if "model" in args.kinds:
                    for b in args.model_batches:
                        for t in args.model_num_queries:
                            case = ct.Case("model", model, b, args.model_cache_len, t, dtype)
                            cases.append((target, case))
                            if ct.auto_differs(target):
                                cases.append(
                                    (
                                        target,
                                        ct.Case("model", model, b, args.model_cache_len, t, dtype, "auto"),
                                    )
                                )
        if "loop" in args.kinds:
            for dtype in args.loop_dtypes:
                for b in args.loop_batches:
                    for phase in compile_loop.PHASES:
                        cases.append((target, compile_loop.LoopCase(phase, b, dtype)))
                        if ct.auto_differs(target):
                            cases.append((target, compile_loop.LoopCase(phase, b, dtype, impl="auto")))
    return cases


def _run(job):
    target, case = job
    return target, case, compile_loop.compile_any(case, target)


def table(results) -> str:
    """Markdown: one row per target, one column per (kind, dtype), 'ok / total' (+ refused)."""
    columns = sorted({(c.kind + (" auto" if c.impl == "auto" else ""), c.dtype) for _, c, _ in results})
    counts = collections.defaultdict(collections.Counter)
    for target, case, result in results:
        counts[target, (case.kind + (" auto" if case.impl == "auto" else ""), case.dtype)][result.status] += 1
    head = "| target | " + " | ".join(f"{k} {d}" for k, d in columns) + " |"
    lines = [head, "|" + "---|" * (len(columns) + 1)]
    for target in dict.fromkeys(t for t, _, _ in results):
        cells = []
        for column in columns:
            c = counts[target, column]
            total = sum(c.values())
            cell = f"{c['ok']}/{total}" if total else "-"
            if c["refused"]:
                cell += f" ({c['refused']} refused)"
            if c["FAIL"]:
                cell = f"**{cell}**"
            cells.append(cell)
        lines.append(f"| {target} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def failures(results) -> str:
    groups = collections.defaultdict(list)
    for target, case, result in results:
        if not result.ok:
            groups[result.status, target, result.error[:200]].append(case)
    lines = []
    for (status, target, error), cases in sorted(groups.items()):
        lines.append(f"- {status} {target}, {len(cases)} case(s), e.g. `{cases[0].label()}`: {error}")
    return "\n".join(lines) or "(none)"


def pod_table() -> str:
    """experiments/pod_pairs.py's full table (Markdown), run in this process (its files not written:
    `python -m launch.experiment --experiment=pod_pairs` writes them)."""
    start = time.perf_counter()
    result = pod_pairs.run(framework.make_config("pod_pairs"))
    if result is None:
        return "pods: skipped"
    return (
        f"{result.markdown}\n\npods: {len(result.rows)} rows in {(time.perf_counter() - start) / 60:.1f} min"
    )


def main(argv=None):
    args = parse_args(argv)
    jobs = build_cases(args)
    print(f"{len(jobs)} compiles on {args.jobs} process(es)", file=sys.stderr, flush=True)
    start = time.perf_counter()
    results = []
    # Spawned, not forked: the parent has loaded libtpu (to ask what "auto" means per target), and a
    # forked copy of its threads and locks aborts inside libtpu.
    spawn = multiprocessing.get_context("spawn")
    pool = concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=spawn) if args.jobs > 1 else None
    outcomes = pool.map(_run, jobs, chunksize=4) if pool else map(_run, jobs)
    for i, (target, case, result) in enumerate(outcomes, 1):
        results.append((target, case, result))
        mark = "" if result.ok else f"  {result.error[:160]}"
        print(f"[{i}/{len(jobs)}] {target} {case.label()}: {result.status} {result.seconds:.1f}s{mark}",
              file=sys.stderr, flush=True)  # fmt: skip
    if pool:
        pool.shutdown()
    elapsed = time.perf_counter() - start
    print(table(results))
    print()
    print(failures(results))
    print(f"\n{len(results)} compiles in {elapsed / 60:.1f} min ({sum(r.ok for _, _, r in results)} ok)")
    if "pods" in args.kinds:
        print(f"\n{pod_table()}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(
                [{"target": t, "kind": c.kind, **vars(c), "step": c.step, **vars(r)} for t, c, r in results],
                f,
                indent=1,
            )


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, each list parsed and checked (SystemExit naming a bad one, or the compile-only
    backends that are not installed)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default=",".join(ct.TARGETS))
    parser.add_argument("--models", default=",".join(ct.MODELS))
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--cache_lens", default="256,1000,2048", help="S of the kernel calls")
    parser.add_argument("--num_queries", default="1,5,16,37,128,512", help="T of the kernel calls")
    parser.add_argument("--model_batches", default="1,8", help="B of the model steps")
    parser.add_argument("--model_cache_len", type=int, default=1000, help="S of the model steps")
    parser.add_argument("--model_num_queries", default="1,5,16,128", help="T of the model steps")
    parser.add_argument(
        "--loop_batches", default="1,8", help="B of the speculative loop (make demo's shapes)"
    )
    parser.add_argument(
        "--loop_dtypes",
        default="float32,bfloat16,int8",
        help="precisions of the speculative loop's models (int8: make demo's default)",
    )
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (each loads libtpu: ~1 GB)")
    parser.add_argument("--output_json", default="", help="also write every result here")
    args = parser.parse_args(argv)
    args.targets = _names(args.targets, ct.TARGETS, "targets")
    args.models = _names(args.models, tuple(ct.MODELS), "models")
    args.dtypes = _names(args.dtypes, ("float32", "bfloat16"), "dtypes")
    args.loop_dtypes = _names(args.loop_dtypes, ("float32", "bfloat16", "int8"), "loop_dtypes")
    args.kinds = _names(args.kinds, KINDS, "kinds")
    args.batches, args.cache_lens = _ints(args.batches), _ints(args.cache_lens)
    args.model_batches, args.loop_batches = _ints(args.model_batches), _ints(args.loop_batches)
    args.num_queries, args.model_num_queries = _ints(args.num_queries), _ints(args.model_num_queries)
    if args.jobs < 1:
        raise SystemExit(f"compile_sweep.py: error: --jobs must be >= 1, got {args.jobs}")
    if missing := ct.missing_packages():
        raise SystemExit(f"compile_sweep.py: error: {', '.join(missing)} not installed: {ct.INSTALL_HINT}")
    return args


if __name__ == "__main__":
    main()
