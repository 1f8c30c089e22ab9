"""One rule for checking settings and arguments: what counts as an integer or a number, and the
one-line error a setting out of range gets.

It lives in `models` because every package may import `models` (models, spec_jax, training,
experiments, launch), so the library's arguments and the experiments' configs share it.
A bool is never an integer or a number here (Python's `True` is an `int`).
"""

import numpy as np


def is_int(value) -> bool:
    """True for a Python or NumPy integer, False for a bool and anything else."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def is_number(value) -> bool:
    """True for a Python or NumPy integer or float, False for a bool and anything else."""
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)


def check_int_settings(config, ranges: dict) -> None:
    """ValueError("<key>: must be an integer in [low, high], got v") unless config[key] is an
    integer in [low, high], for every key: (low, high) of ranges (config: a mapping)."""
    for key, (low, high) in ranges.items():
        value = config[key]
        if not is_int(value) or not low <= value <= high:
            raise ValueError(f"{key}: must be an integer in [{low}, {high}], got {value!r}")


def check_number_settings(config, ranges: dict) -> None:
    """ValueError("<key>: must be a number in [low, high], got v") unless config[key] is a
    number in [low, high], for every key: (low, high) of ranges."""
    for key, (low, high) in ranges.items():
        value = config[key]
        if not is_number(value) or not low <= value <= high:
            raise ValueError(f"{key}: must be a number in [{low}, {high}], got {value!r}")
