"""Record-breaking points: the compute-optimal envelope of noisy learning curves.

A checkpoint that does not beat every earlier one is dominated: an earlier checkpoint
reached at least as much reward with less compute, so it cannot lie on a compute-
optimal frontier. Keeping only the records also stops long, correlated runs from
outweighing short ones in the fit (IsoCompute playbook §4, Fig. 5 and Fig. 15).
"""

from __future__ import annotations

import numpy as np


def record_breaking_points(compute, reward, *, bin_width: float = 0.005) -> np.ndarray:
  """Indices of the earliest points whose reward bin beats every earlier point.

  Reward is discretised as floor(reward / bin_width); a point is a record when its bin
  is higher than the bins of all points with smaller compute. Discretising makes
  noise within one bin unable to create a record. Points at equal compute are taken
  best first, so among ties only the highest can be a record. NaN points are ignored.

  Args:
    compute: compute at each point (any order; several runs may be pooled).
    reward: reward at each point, same length.
    bin_width: the reward resolution, > 0 (the paper uses 0.005).

  Returns:
    Indices into the inputs, in increasing compute order.

  Raises:
    ValueError: on mismatched lengths or a non-positive bin width.
  """
  compute = np.asarray(compute, dtype=np.float64).ravel()
  reward = np.asarray(reward, dtype=np.float64).ravel()
  if compute.shape != reward.shape:
    raise ValueError(f"record_breaking_points: compute has {compute.size} points, "
                     f"reward has {reward.size}")
  if not (np.isfinite(bin_width) and bin_width > 0):
    raise ValueError(f"record_breaking_points: bin_width must be > 0, got {bin_width}")
  valid = np.flatnonzero(np.isfinite(compute) & np.isfinite(reward))
  if valid.size == 0:
    return np.zeros(0, dtype=np.int64)
  # lexsort: last key is primary. Ties in compute: higher reward first, then index,
  # so the result does not depend on the order the points were pooled in.
  order = valid[np.lexsort((valid, -reward[valid], compute[valid]))]
  # The small offset keeps a reward sitting exactly on a bin edge (0.5 / 0.005) in
  # its bin despite float error in the division.
  bins = np.floor(reward[order] / bin_width + 1e-9)
  best_before = np.concatenate([[-np.inf], np.maximum.accumulate(bins)[:-1]])
  return order[bins > best_before]


def pool_points(runs, metric: str, unit: str = "rollouts", *,
                max_compute: float | None = None) -> tuple[np.ndarray, np.ndarray]:
  """All (compute, metric) points of `runs` pooled, sorted by (compute, -reward).

  Points at compute <= 0 (an evaluation before any training) are left out: they have
  no place on a log compute axis. `max_compute` drops later points (extrapolation
  checks fit on the early part only).
  """
  cs, rs = [], []
  for run in runs:
    c, r = run.points(metric, unit)
    cs.append(c)
    rs.append(r)
  c = np.concatenate(cs) if cs else np.zeros(0)
  r = np.concatenate(rs) if rs else np.zeros(0)
  keep = c > 0
  if max_compute is not None:
    keep &= c <= max_compute
  c, r = c[keep], r[keep]
  order = np.lexsort((-r, c))
  return c[order], r[order]


def record_points(runs, metric: str, unit: str = "rollouts", *, bin_width: float = 0.005,
                  max_compute: float | None = None) -> tuple[np.ndarray, np.ndarray]:
  """(compute, reward) of the record-breaking points of `runs` pooled together."""
  c, r = pool_points(runs, metric, unit, max_compute=max_compute)
  idx = record_breaking_points(c, r, bin_width=bin_width)
  return c[idx], r[idx]
