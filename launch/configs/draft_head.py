"""Draft-head training: `python -m launch.train --config=launch/configs/draft_head.py`.

`--config=launch/configs/draft_head.py:quick` is the tiny variant the tests run (a random
target, seconds). Override any setting on the command line, e.g. `--config.steps=2000
--config.head_mlp_dim=2048`; the settings are documented in training/config.py
(default_config) and docs/training.md.
"""

from training import head_run


def get_config(variant: str | None = None):
    if variant not in (None, "", "quick"):
        raise ValueError(f"config variant must be empty or 'quick', got {variant!r}")
    config = head_run.get_config(quick=variant == "quick")
    config.kind = "draft_head"
    return config
