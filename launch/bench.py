"""Benchmarks: the benchmark suites of the experiments registry, under their own flag.

  python -m launch.bench --suite=loop       # compiled while_loop vs a Python loop of jitted rounds
  python -m launch.bench --suite=overhead   # a round's bookkeeping beyond its model calls
  python -m launch.bench --suite=decode     # the Qwen pair: tokens/s over batch, temperature, gamma
  python -m launch.bench --suite=peer       # the same pair through HF transformers, OpenVINO GenAI, llama.cpp
  python -m launch.bench --suite=roofline   # bytes per step vs measured memory bandwidth
  python -m launch.bench --suite=attention  # the attention kernels vs the XLA reference
  python -m launch.bench --suite=serve      # launch.serve vs llama-server, concurrent streams
  python -m launch.bench --suite=profile    # a decode step's and a prefill chunk's time by kind of work
  python -m launch.bench --suite=workloads  # by category (code, editing, quoting, summaries, chat, translation) vs llama.cpp
  python -m launch.bench --suite=peer,decode,roofline   # together: the models load once
  python -m launch.bench --suite=decode --config.gammas=3,4 --config.repeats=5

Each suite is an experiment (experiments/bench_*.py) and `--suite=X` is `python -m
launch.experiment --experiment=X`: the same --quick, --output_dir, --config.KEY=VALUE and
--gammas / --seed flags, the same outputs (X.md, X.csv, X.json in experiments/results/, with
the command, git revision, machine and peak RSS). Suites given together run in the order
above (peer before decode, so that the peer libraries load before this project's models are resident).
Timings are medians over interleaved repeats after a warm-up; they are never asserted by
tests (--quick runs each suite on tiny models to prove the harness). docs/benchmarks.md
explains every column.
"""

from absl import flags

import experiments
from launch import common
from launch import experiment as experiment_launcher

FLAGS = flags.FLAGS

flags.DEFINE_list("suite", None, "Suites to run, comma-separated, from: " + ", ".join(experiments.BENCHMARKS))


def main(argv):
    if len(argv) > 1:
        raise common.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    suites = FLAGS.suite or []
    unknown = [s for s in suites if s not in experiments.BENCHMARKS]
    if unknown or not suites:
        raise common.UsageError(
            f"--suite: each value must be one of {', '.join(experiments.BENCHMARKS)}, got {','.join(suites)!r}"
        )
    if FLAGS.experiment:
        raise common.UsageError("--experiment: use --suite with launch.bench")
    return experiment_launcher.run_named([s for s in experiments.BENCHMARKS if s in suites], flag="suite")


def cli():
    """The command line: main under launch.common.run (bad input: one line, exit 2)."""
    common.run(main, config_overrides=True)


if __name__ == "__main__":
    cli()
