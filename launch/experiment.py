"""Run registered experiments and write their CSV, Markdown, JSON sidecar and plot.

Examples:
  python -m launch.experiment --experiment=table1
  python -m launch.experiment --experiment=theory_vs_simulation --quick --output_dir=/tmp/out
  python -m launch.experiment --experiment=theory_vs_simulation --alphas=0.5,0.99 --gammas=1,20
  python -m launch.experiment --experiment=peer,decode,roofline   # one process: models load once
  python -m launch.experiment --list   # the experiments' names, one line each with its title

--alphas, --gammas, --num_rounds and --seed override the config of each experiment that has
that setting; --config.KEY=VALUE overrides any other setting (e.g. --config.vocab_size=16), in
every named experiment that has it (it is an error if none has): the override syntax of
launch.train's configs (--set=KEY=VALUE is the same thing, read by the same parser). Bad flags and bad input exit with
code 2 and one line on stderr; an experiment whose own check fails (e.g. simulation off
theory) still writes its outputs, then exits 1; data that cannot be fetched (a corpus or model
download) is one line on stderr and exit code 1.
"""

from absl import flags

import experiments
from launch import common

FLAGS = flags.FLAGS

flags.DEFINE_list("experiment", None, "Experiment names, comma-separated (see experiments.names()).")
flags.DEFINE_bool("list", False, "Print each experiment's name and title, one a line, and exit.")
flags.DEFINE_bool("quick", False, "Small sample counts and tiny models (what the test suite runs).")
flags.DEFINE_string("output_dir", None, "Where the outputs go (default: experiments/results/).")
flags.DEFINE_list("alphas", None, "Comma-separated acceptance rates in [0, 1], overriding the config.")
flags.DEFINE_list(
    "gammas", None, "Comma-separated integers >= 1 (draft tokens per round), overriding the config."
)
flags.DEFINE_integer("num_rounds", None, "Simulated rounds per cell, overriding the config.")
flags.DEFINE_integer("seed", None, "Random seed, overriding the config.")
flags.DEFINE_multi_string(
    "set",
    [],
    "KEY=VALUE: the same as --config.KEY=VALUE, which overrides any config setting (repeatable; "
    "tuples as comma-separated items).",
)


def run_named(names: list[str], flag: str = "experiment") -> int:
    """launch.experiment_runner.run_named: checks every named experiment's config first, then
    runs them in the order given; returns the exit code (1 if an experiment's own check failed)."""
    # Late (measured start-up cost): the runner imports experiments.framework, and with it jax and
    # the models, 1.8 s wall on the 2-core EPYC; imported here, once the flags are parsed, --help
    # and bad flags of launch.experiment and launch.bench answer in 0.15 s.
    from launch import experiment_runner

    return experiment_runner.run_named(names, flag)


def list_experiments() -> None:
    """Prints `NAME  TITLE` for each registered experiment, sorted, one a line."""
    width = max(map(len, experiments.names()))
    for name in experiments.names():
        print(f"{name:<{width}}  {experiments.load(name).TITLE}")


def main(argv):
    if len(argv) > 1:
        raise common.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    if FLAGS.list:
        return list_experiments()
    if not FLAGS.experiment:
        raise common.UsageError(
            f"--experiment is required (--list names them); known: {', '.join(experiments.names())}"
        )
    return run_named(FLAGS.experiment)


def cli():
    """The command line: main under launch.common.run (bad input: one line, exit 2)."""
    common.run(main, config_overrides=True)


if __name__ == "__main__":
    cli()
