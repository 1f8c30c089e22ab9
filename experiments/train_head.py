"""Training a draft head (EAGLE-1 style) for a target, as an experiment: training/head_run.py's
settings and run (the target's features, training.train, its learning curves and what it
reached), its report written with the others' provenance. `python -m launch.train
--config=launch/configs/draft_head.py` runs the same; so does `python -m launch.experiment
--experiment=train_head`.
"""

from launch.results import Result
from training import head_run

TITLE = head_run.TITLE
get_config = head_run.get_config
validate = head_run.validate


def run(config) -> Result:
    return Result.from_report(head_run.run(config))
