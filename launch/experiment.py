"""Run a registered experiment and write its CSV, Markdown, JSON sidecar and plot.

Examples:
  python -m launch.experiment --experiment=table1
  python -m launch.experiment --experiment=theory_vs_simulation --quick --output_dir=/tmp/out
  python -m launch.experiment --experiment=theory_vs_simulation --alphas=0.5,0.99 --gammas=1,20

--alphas, --gammas, --num_rounds and --seed override the experiment's config where it has
that setting; --set=KEY=VALUE overrides any other setting (e.g. --set=vocab_size=16).
Bad flags and bad input exit with code 2 and one line on stderr; an experiment whose own
check fails (e.g. simulation off theory) still writes its outputs, then exits 1; data that
cannot be fetched (a corpus or model download) is one line on stderr and exit code 1.
"""

import shlex
import sys

from absl import flags

import experiments
from experiments import framework
from launch import common

FLAGS = flags.FLAGS

flags.DEFINE_string("experiment", None, "Experiment name (see experiments.names()).")
flags.DEFINE_bool("quick", False, "Small sample counts (what the test suite runs).")
flags.DEFINE_string("output_dir", None, "Where the outputs go (default: experiments/results/).")
flags.DEFINE_list("alphas", None, "Comma-separated acceptance rates in [0, 1], overriding the config.")
flags.DEFINE_list(
    "gammas", None, "Comma-separated integers >= 1 (draft tokens per round), overriding the config."
)
flags.DEFINE_integer("num_rounds", None, "Simulated rounds per cell, overriding the config.")
flags.DEFINE_integer("seed", None, "Random seed, overriding the config.")
flags.DEFINE_multi_string(
    "set", [], "KEY=VALUE: override any config setting (repeatable; tuples as comma-separated items)."
)
flags.mark_flag_as_required("experiment")


def _numbers(flag: str, values: list[str], kind) -> tuple:
    parsed = []
    for text in values:
        try:
            parsed.append(kind(text))
        except ValueError:
            noun = "an integer" if kind is int else "a number"
            raise common.UsageError(f"--{flag}: {text!r} is not {noun}") from None
    return tuple(parsed)


def overrides_from_flags() -> dict:
    """The config overrides given on the command line (a dedicated flag's name = its config key)."""
    overrides = {}
    if FLAGS.alphas is not None:
        alphas = _numbers("alphas", FLAGS.alphas, float)
        bad = [a for a in alphas if not 0.0 <= a <= 1.0]
        if bad:
            raise common.UsageError(f"--alphas: each alpha must be in [0, 1], got {bad[0]}")
        overrides["alphas"] = alphas
    if FLAGS.gammas is not None:
        gammas = _numbers("gammas", FLAGS.gammas, int)
        bad = [g for g in gammas if g < 1]
        if bad:
            raise common.UsageError(f"--gammas: each gamma must be an integer >= 1, got {bad[0]}")
        overrides["gammas"] = gammas
    for key in ("num_rounds", "seed"):
        if FLAGS[key].value is not None:
            overrides[key] = FLAGS[key].value
    if FLAGS.set:
        config = experiments.load(FLAGS.experiment).get_config(FLAGS.quick)
        for item in FLAGS.set:
            key, sep, text = item.partition("=")
            if not sep or not key:
                raise common.UsageError(f"--set: expected KEY=VALUE, got {item!r}")
            try:
                overrides[key] = framework.parse_setting(config, key, text)
            except ValueError as e:
                raise common.UsageError(f"--set {e}") from None
    return overrides


def main(argv):
    if len(argv) > 1:
        raise common.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    if FLAGS.experiment not in experiments.EXPERIMENTS:
        raise common.UsageError(
            f"--experiment: unknown experiment {FLAGS.experiment!r}; known: {', '.join(experiments.names())}"
        )
    overrides = overrides_from_flags()
    try:
        framework.make_config(FLAGS.experiment, quick=FLAGS.quick, overrides=overrides)
        framework.prepare_output_dir(FLAGS.output_dir)
    except ValueError as e:  # the message starts with the config key, a flag's name or a --set key
        key = str(e).split(":", 1)[0]
        raise common.UsageError(f"--{e}" if key in FLAGS else f"--set {e}") from None

    command = shlex.join(["python", "-m", "launch.experiment", *sys.argv[1:]])
    # Data that cannot be fetched (a corpus, a model) is one line and exit code 1: common.run.
    result, paths = framework.run_experiment(
        FLAGS.experiment, quick=FLAGS.quick, overrides=overrides, output_dir=FLAGS.output_dir, command=command
    )
    for path in paths.values():
        print(f"wrote {path}")
    if result.passed is False:
        print(f"{FLAGS.experiment}: the experiment's check FAILED (see {paths[FLAGS.experiment + '.md']})")
        return 1
    if result.passed:
        print(f"{FLAGS.experiment}: the experiment's check passed")
    return 0


if __name__ == "__main__":
    common.run(main)
