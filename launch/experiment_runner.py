"""What launch.experiment and launch.bench run once their flags are parsed (the flags are
launch.experiment's): each named experiment's config from its defaults and the command line's
overrides, every one checked before the first runs, then the runs in the order given."""

import os
import shlex
import sys

from absl import flags

import experiments
from experiments import framework
from launch import common

FLAGS = flags.FLAGS


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
