"""Training the drafters that are trained rather than given: a draft head (EAGLE-1) on the
target's features, and an acceptance head (SpecDec++) that decides how many of its drafts to
propose (docs/training.md).

A package beside the inference code: it may import `models` and `spec_jax`, and neither of them
imports it (tests/test_layering.py checks both).

  config.py      the settings of a draft-head run: schema, ranges (validate), the head's config
  features.py    the target's features over text: what a draft head trains on (cached)
  loss.py        the EAGLE-1 loss and the batches it reads
  evaluation.py  held-out accepted length of a head drafting as in the loop
  checkpoint.py  orbax checkpoints of a run, and resuming from them
  head.py        the draft-head training loop (train)
  acceptance.py  the acceptance head (SpecDec++): logged rounds, its optax loop, the threshold
  targets.py     the models a run loads by name (the quick configs' tiny ones) and its texts' ids
  report.py      what a run reports (Report: table, reading, summary, plot), as data
  head_run.py    a draft head's run: settings, the data, train, its report (launch.train)
  acceptance_run.py  an acceptance head's run: settings, logged rounds, train, threshold, report
"""

from training.config import default_config, head_config, validate
from training.head import RunResult, scale_note, train

__all__ = ["RunResult", "default_config", "head_config", "scale_note", "train", "validate"]
