"""Train a drafter: a draft head on the target's features (EAGLE-1) or an acceptance head.

Examples:
  python -m launch.train --config=launch/configs/draft_head.py
  python -m launch.train --config=launch/configs/draft_head.py --config.steps=2000 --workdir=/tmp/head
  python -m launch.train --config=launch/configs/draft_head.py:quick --output_dir=/tmp/out   # seconds
  python -m launch.train --config=launch/configs/acceptance_head.py   # after a draft head

The config file's `kind` names what it trains (draft_head: training/head_run.py;
acceptance_head: training/acceptance_run.py). A draft head's run writes its checkpoints
into --workdir (default $SPEC_JAX_CACHE/heads/TARGET/) and resumes there if it was interrupted
(the same settings); an acceptance head reads the draft head there and is written beside it; its learning curves and summary go to
--output_dir (default experiments/results/) as NAME.csv/.md/.json/.png (launch.results, the
experiments' writer: NAME is train_head or train_acceptance, as `python -m launch.experiment`
names the same runs). Bad settings exit with code 2 and one line; data that cannot be fetched
exits 1.
"""

import os
import shlex
import sys
import time

import ml_collections
from absl import flags
from ml_collections import config_flags

from launch import common, results
from training import acceptance_run, head_run

FLAGS = flags.FLAGS
DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "draft_head.py")
KINDS = {"draft_head": head_run, "acceptance_head": acceptance_run}  # config kind -> its run


def check_override_keys(config, argv) -> None:
    """ValueError("--config.KEY: not a setting ...") naming the settings, for an override of a
    key the config does not have (ml_collections would raise AttributeError: a traceback)."""
    for arg in argv:
        if not arg.startswith(("--config.", "-config.", "--noconfig.", "-noconfig.")):
            continue
        key = arg.split("=", 1)[0].split(".", 1)[1]
        node = config
        for part in key.split("."):
            if not isinstance(node, ml_collections.ConfigDict) or part not in node:
                known = ", ".join(sorted(config.keys()))
                raise ValueError(f"--config.{key}: not a setting of this config (settings: {known})")
            node = node[part]


class OneLineConfigErrors(flags.ArgumentParser):
    """ml_collections' config-file parser (inner), with what can go wrong in the file as one line
    (a ValueError, which absl reports as `flag --config=...: <line>`, exit 2): a missing file
    (inner deferred it to the first use of the config, an OSError traceback), a Python syntax
    error (a traceback), and an error from get_config (its first line was only 'Error whilst
    parsing config file:')."""

    def __init__(self, inner: flags.ArgumentParser):
        self.inner = inner

    def parse(self, path):
        file = path.split(":", 1)[0]
        if not os.path.isfile(file):
            raise ValueError(f"no such config file: {file}")
        try:
            config = self.inner.parse(path)
        except SyntaxError as e:
            raise ValueError(f"{e.filename} line {e.lineno}: {type(e).__name__}: {e.msg}") from None
        except (TypeError, ValueError) as e:  # inner put the traceback first; its last line says what
            raise ValueError(f"{file}: {str(e).strip().splitlines()[-1]}") from None
        check_override_keys(config, sys.argv[1:])
        return config

    def flag_type(self):
        return self.inner.flag_type()


_CONFIG = config_flags.DEFINE_config_file("config", None, "Training config file (PATH[:variant]).")
FLAGS["config"].parser = OneLineConfigErrors(FLAGS["config"].parser)
try:  # the default is parsed here, with the command line's --config.KEY overrides
    FLAGS["config"]._set_default(DEFAULT_CONFIG)
except flags.Error as e:
    common.fail(str(e).splitlines()[0])
flags.DEFINE_string("workdir", None, "Checkpoint folder (default: $SPEC_JAX_CACHE/heads/TARGET/).")
flags.DEFINE_string("output_dir", None, "Where the results go (default: experiments/results/).")


def make_config(kind: str, overrides: dict, quick: bool) -> ml_collections.ConfigDict:
    """The run's (quick or full) settings with the command line's config applied, validated
    (ValueError("<key>: ...") for a key the run does not have or a value it refuses)."""
    program = KINDS[kind]
    config = program.get_config(quick)
    for key, value in overrides.items():
        if key not in config:
            raise ValueError(
                f"{key}: does not apply to experiment {program.NAME} (its settings: {', '.join(sorted(config.keys()))})"
            )
        config[key] = value
    program.validate(config)
    return config


def train(kind: str, overrides: dict, output_dir: str | None, command: str) -> dict[str, str]:
    """Runs the training of `kind` with the settings `overrides` and writes its report into
    output_dir (default experiments/results/) as NAME.csv/.md/.json/.png; returns {filename: path}."""
    program = KINDS[kind]
    quick = overrides.get("target") in ("tiny",)
    config = make_config(kind, overrides, quick)
    directory = results.prepare_output_dir(output_dir)
    prov = results.provenance(command)
    start = time.perf_counter()
    result = results.Result.from_report(program.run(config))
    seconds = time.perf_counter() - start
    return results.write_results(
        directory, program.NAME, program.TITLE, result, config=config, prov=prov, seconds=seconds, quick=quick
    )


def main(argv):
    if len(argv) > 1:
        raise common.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    config = _CONFIG.value
    kind = config.get("kind")
    if kind not in KINDS:
        raise common.UsageError(f"--config: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    overrides = {k: v for k, v in config.items() if k != "kind"}
    if FLAGS.workdir:
        overrides["workdir" if kind == "draft_head" else "head_workdir"] = FLAGS.workdir
    command = shlex.join([os.path.basename(sys.executable), "-m", "launch.train", *sys.argv[1:]])
    for path in train(kind, overrides, FLAGS.output_dir, command).values():
        print(f"wrote {path}")


def cli():
    """The command line: main under launch.common.run (bad input: one line, exit 2)."""
    common.run(main)


if __name__ == "__main__":
    cli()
