"""Reproductions of the paper's tables and figures, and the benchmark suites, each runnable by name.

An experiment is one module that defines

  TITLE: str                      one line, the heading of its Markdown output
  get_config(quick: bool) -> ml_collections.ConfigDict
                                  quick = small sample counts, for the test suite
  run(config) -> experiments.framework.Result (or None: skipped, having printed why)

and, checked by experiments.framework.validate before it runs (each optional):

  MODEL_KEYS, INT_RANGES, TUPLE_RANGES   declared settings (model names, integer ranges,
                                  tuples of numbers in a range)
  validate(config) -> None        any other check; raises ValueError("<config key>: ...")

plus one line in EXPERIMENTS below. `experiments.framework.run_experiment(name, ...)` (and
`python -m launch.experiment --experiment=NAME[,NAME...]`, or `python -m launch.bench
--suite=NAME[,NAME...]` for the benchmarks) runs it and writes NAME.csv, NAME.md, NAME.json
and, when the experiment draws one, NAME.png into experiments/results/.
"""

import importlib
import types

# name -> module. Adding an experiment: write the module, add its line here.
EXPERIMENTS = {
    "table1": "experiments.table1",
    "table3": "experiments.table3",
    "theory_vs_simulation": "experiments.theory_vs_simulation",
    "walltime": "experiments.walltime",
    "precision_drift": "experiments.precision_drift",
    "predicted_speed": "experiments.predicted_speed",
    "pod_pairs": "experiments.pod_pairs",
    "train_head": "experiments.train_head",
    "train_acceptance": "experiments.train_acceptance",
    # Benchmark suites (launch.bench runs these, in this order when given together).
    "loop": "experiments.bench_loop",
    "overhead": "experiments.bench_overhead",
    "peer": "experiments.bench_peer",
    "decode": "experiments.bench_decode",
    "roofline": "experiments.bench_roofline",
    "attention": "experiments.bench_attention",
    "serve": "experiments.bench_serve",
    "profile": "experiments.bench_profile",
    "workloads": "experiments.bench_workloads",
}
BENCHMARKS = ("loop", "overhead", "peer", "decode", "roofline", "attention", "serve", "profile", "workloads")


def names() -> list[str]:
    """The registered experiment names, sorted."""
    return sorted(EXPERIMENTS)


def load(name: str) -> types.ModuleType:
    """The module of experiment `name`; ValueError listing the known names if there is none."""
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; known experiments: {', '.join(names())}")
    return importlib.import_module(EXPERIMENTS[name])
