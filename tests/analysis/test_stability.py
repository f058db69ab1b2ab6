"""stability.py: a collapse late in the run, and choosing a Bp from no runs."""

import numpy as np
import pytest

from isojax.analysis.stability import collapsed, smallest_stable_bp

from . import fake_runs

METRIC = "val/avg@4"


def _linear_run(fall_at: int):
  # One evaluation every 10 updates for 400 updates: 0.1 -> 0.6 by update 100, back
  # at the base reward after update `fall_at`.
  steps = np.arange(10, 410, 10)
  r = np.where(steps > fall_at, 0.1, 0.1 + 0.5 * np.minimum(steps / 100, 1))
  return fake_runs.PointsRun([0, *(steps * 128.0)], [0.1, *r])


def test_a_collapse_in_the_last_tenth_of_the_compute_is_a_collapse():
  # The last 4 of 40 evaluations are at the base reward: the run ended where it
  # began, though the mean of its last quarter (10 evaluations) is still 0.4.
  assert collapsed(_linear_run(fall_at=360), METRIC)
  assert collapsed(_linear_run(fall_at=320), METRIC)
  assert not collapsed(_linear_run(fall_at=400), METRIC)
  # A single low last evaluation is noise, not a collapse.
  run = _linear_run(fall_at=400)
  assert not collapsed(fake_runs.PointsRun(run.compute, run.reward[:-1] + [0.1]), METRIC)


def test_no_runs_is_a_clear_error():
  with pytest.raises(ValueError, match="no runs"):
    smallest_stable_bp([], set(), METRIC)
