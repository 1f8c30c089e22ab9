"""Acceptance-head training: `python -m launch.train --config=launch/configs/acceptance_head.py`.

Needs a trained draft head for the target (launch/configs/draft_head.py) in --workdir (default
$SPEC_JAX_CACHE/heads/TARGET/); the acceptance head is written beside it, in acceptance/.
`:quick` is the tiny variant the tests run. Settings: training/acceptance_run.py.
"""

from training import acceptance_run


def get_config(variant: str | None = None):
    if variant not in (None, "", "quick"):
        raise ValueError(f"config variant must be empty or 'quick', got {variant!r}")
    config = acceptance_run.get_config(quick=variant == "quick")
    config.kind = "acceptance_head"
    return config
