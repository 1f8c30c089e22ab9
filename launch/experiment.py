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

import os
import shlex
import sys

from absl import flags

import experiments
from experiments import framework
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


def _numbers(flag: str, values: list[str], kind) -> tuple:
    parsed = []
    for text in values:
        try:
            parsed.append(kind(text))
        except ValueError:
            noun = "an integer" if kind is int else "a number"
            raise common.UsageError(f"--{flag}: {text!r} is not {noun}") from None
    return tuple(parsed)


def overrides_from_flags(name: str) -> dict:
    """The config overrides of experiment `name` given on the command line (a dedicated flag's
    name = its config key); settings the experiment does not have are skipped."""
    module = experiments.load(name)
    config = module.get_config(FLAGS.quick)
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
    for item in FLAGS.set:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise common.UsageError(f"--config.KEY=VALUE expected, got --set={item!r}")
        if key in config:
            try:
                kind = getattr(module, "TUPLE_RANGES", {}).get(key, (None,))[0]
                overrides[key] = framework.parse_setting(config, key, text, kind)
            except ValueError as e:
                raise common.UsageError(f"--config.{e}") from None
    return {k: v for k, v in overrides.items() if k in config}


def check_every_setting_applies(names: list[str]) -> None:
    """UsageError for a --config.KEY or dedicated flag that none of the named experiments has."""
    configs = [experiments.load(n).get_config(FLAGS.quick) for n in names]
    given = [(f"--{k}", k) for k in ("alphas", "gammas", "num_rounds", "seed") if FLAGS[k].value is not None]
    given += [(f"--config.{item.partition('=')[0]}", item.partition("=")[0]) for item in FLAGS.set]
    for flag, key in given:
        if key and not any(key in c for c in configs):
            known = sorted({k for c in configs for k in c.to_dict()})
            raise common.UsageError(
                f"{flag}: not a setting of {', '.join(names)} (settings: {', '.join(known)})"
            )


def run_named(names: list[str], flag: str = "experiment") -> int:
    """Checks every named experiment's config first, then runs them in the order given; returns
    the exit code (1 if an experiment's own check failed)."""
    unknown = [n for n in names if n not in experiments.EXPERIMENTS]
    if unknown or not names:
        raise common.UsageError(
            f"--{flag}: unknown experiment {','.join(unknown) or '(none)'!r}; known: {', '.join(experiments.names())}"
        )
    check_every_setting_applies(names)
    overrides = {name: overrides_from_flags(name) for name in names}
    for name in names:
        try:
            framework.make_config(name, quick=FLAGS.quick, overrides=overrides[name])
            framework.prepare_output_dir(FLAGS.output_dir)
        except ValueError as e:  # the message starts with the config key or a flag's name
            key = str(e).split(":", 1)[0]
            raise common.UsageError(f"--{e}" if key in FLAGS else f"--config.{e}") from None

    module = "launch." + os.path.basename(sys.argv[0]).removesuffix(".py")
    command = shlex.join(["python", "-m", module, *sys.argv[1:]])
    code = 0
    for name in names:
        # Data that cannot be fetched (a corpus, a model) is one line and exit code 1: common.run.
        result, paths = framework.run_experiment(
            name, quick=FLAGS.quick, overrides=overrides[name], output_dir=FLAGS.output_dir, command=command
        )
        for path in paths.values():
            print(f"wrote {path}")
        if result is not None and result.passed is False:
            print(f"{name}: the experiment's check FAILED (see {paths[name + '.md']})")
            code = 1
        elif result is not None and result.passed:
            print(f"{name}: the experiment's check passed")
    return code


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
