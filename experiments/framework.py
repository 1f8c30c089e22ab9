"""Running a registered experiment (a paper reproduction or a benchmark suite): its config
(make_config, validate, parse_setting) and its run (run_experiment), whose outputs the one
results writer of the project, launch.results, writes with their provenance (NAME.csv, .json,
.md and .png in experiments/results/ by default). Its names are named here too, as before.
"""

import os
import shlex
import sys
import time

import ml_collections

import experiments
from experiments import common
from launch.results import RESULTS_DIR as RESULTS_DIR
from launch.results import Result as Result
from launch.results import dict_table as dict_table
from launch.results import git_revision as git_revision
from launch.results import markdown_table as markdown_table
from launch.results import new_figure as new_figure
from launch.results import prepare_output_dir as prepare_output_dir
from launch.results import provenance, write_results
from launch.results import write_files_atomic as write_files_atomic
from models import settings
from models.precision import PRECISIONS


def make_config(
    name: str, *, quick: bool = False, overrides: dict | None = None
) -> ml_collections.ConfigDict:
    """The experiment's (quick or full) config with overrides applied, validated.

    Raises ValueError for an unknown name, an override key the config does not have, or a
    value the experiment's validate() rejects (the message starts with the key).
    """
    module = experiments.load(name)
    config = module.get_config(quick)
    for key, value in (overrides or {}).items():
        if key not in config:
            raise ValueError(
                f"{key}: does not apply to experiment {name} (its settings: {', '.join(sorted(config.keys()))})"
            )
        config[key] = value
    validate(module, config)
    return config


def validate(module, config) -> None:
    """Checks a config against what its experiment module declares, then the module's own
    validate(config) if it has one. Declarations (all optional):
      MODEL_KEYS = ("target", ...)           each a model name the experiments can load
      DTYPE_KEYS = ("target_dtype", ...)     each a precision (models.precision.PRECISIONS)
      INT_RANGES = {"key": (low, high)}      each an integer (not a bool) in [low, high]
      TUPLE_RANGES = {"key": (int | float, low, high)}   each a non-empty tuple of those (or
                                             empty, where the full config's default is)
    ValueError("<key>: ...") on the first bad value."""
    for key in getattr(module, "MODEL_KEYS", ()):
        common.check_model_name(key, config[key])
    for key in getattr(module, "DTYPE_KEYS", ()):
        values = config[key] if isinstance(config[key], tuple) else (config[key],)
        if not values or any(v not in PRECISIONS for v in values):
            raise ValueError(f"{key}: each value must be one of {', '.join(PRECISIONS)}, got {config[key]!r}")
    settings.check_int_settings(config, getattr(module, "INT_RANGES", {}))
    for key, (kind, low, high) in getattr(module, "TUPLE_RANGES", {}).items():
        if len(config[key]) or len(module.get_config()[key]):  # an empty default: an option left off
            common.check_tuple(config, key, kind, low, high)
    if hasattr(module, "validate"):
        module.validate(config)


def parse_setting(config: ml_collections.ConfigDict, key: str, text: str, kind=None):
    """The command-line text for config[key], cast to the type of its current value.

    Tuples take comma-separated items of their first item's type (of `kind`, the module's
    TUPLE_RANGES type, where the current tuple is empty); bools take true/false.
    Raises ValueError starting with the key if the config has no such key or the text
    does not parse.
    """
    if key not in config:
        raise ValueError(
            f"{key}: not a setting of this experiment (its settings: {', '.join(sorted(config.keys()))})"
        )
    current = config[key]

    def cast(kind, item: str):
        if kind is bool:
            if item.lower() in ("true", "1", "yes", "false", "0", "no"):
                return item.lower() in ("true", "1", "yes")
            raise ValueError(item)
        return kind(item)

    if not (kind is not None and isinstance(current, tuple | list) and not current):
        kind = type(current[0]) if isinstance(current, tuple | list) and current else type(current)
    if current is None:
        kind = str
    try:
        if isinstance(current, tuple | list):
            return tuple(cast(kind, item.strip()) for item in text.split(",") if item.strip())
        return cast(kind, text)
    except ValueError:
        raise ValueError(f"{key}: {text!r} is not a valid {kind.__name__}") from None


def run_experiment(
    name: str,
    *,
    quick: bool = False,
    overrides: dict | None = None,
    output_dir: str | None = None,
    command: str | None = None,
) -> tuple[Result, dict[str, str]]:
    """Runs experiment `name` and writes its outputs; returns (result, {filename: path}).

    output_dir defaults to experiments/results/ and is created if missing. command is the
    command line recorded in the provenance (default: this process's argv). An experiment that
    cannot run here (a benchmark whose peer system is not installed) returns None from its run
    after printing why: then nothing is written and this returns (None, {}).
    """
    config = make_config(name, quick=quick, overrides=overrides)
    module = experiments.load(name)
    directory = prepare_output_dir(output_dir)

    prov = provenance(
        command if command is not None else shlex.join([os.path.basename(sys.executable), *sys.argv])
    )
    start = time.perf_counter()
    result = module.run(config)
    seconds = time.perf_counter() - start
    if result is None:
        return None, {}
    paths = write_results(
        directory, name, module.TITLE, result, config=config, prov=prov, seconds=seconds, quick=quick
    )
    return result, paths
