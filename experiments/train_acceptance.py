"""Training an acceptance head (SpecDec++) for a trained draft head, as an experiment:
training/acceptance_run.py's settings and run (logged rounds of the real pair, the classifier,
the stop threshold chosen from its held-out curve), its report written with the others'
provenance. `python -m launch.train --config=launch/configs/acceptance_head.py` runs the same;
so does `python -m launch.experiment --experiment=train_acceptance`.
"""

from launch.results import Result
from training import acceptance_run

TITLE = acceptance_run.TITLE
get_config = acceptance_run.get_config
validate = acceptance_run.validate


def run(config) -> Result:
    return Result.from_report(acceptance_run.run(config))
