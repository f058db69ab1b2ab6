"""Record-breaking points: the compute-optimal envelope of noisy learning curves.

A checkpoint that does not beat every earlier one is dominated: an earlier checkpoint
reached at least as much reward with less compute, so it cannot lie on a compute-
optimal frontier. Keeping only the records also stops long, correlated runs from
outweighing short ones in the fit (IsoCompute playbook §4, Fig. 5 and Fig. 15).

Records are taken per run, then the records of a configuration's runs (its seeds) are
united (§4.1: "subsample each training run to a compact set of record-breaking
points"). Taking records of the seeds pooled into one best-so-far curve instead would
fit a running maximum over seeds: biased upward, the more so the more seeds or
evaluations a configuration has, which tilts the frontier towards well-replicated
configurations.
"""

from __future__ import annotations

import numpy as np


def record_breaking_points(compute, reward, *, bin_width: float = 0.005,
                           baseline: float | None = None) -> np.ndarray:
  """Indices of the earliest points whose reward bin beats every earlier point.

  Reward is discretised as floor(reward / bin_width); a point is a record when its bin
  is higher than the bins of all points with smaller compute, and of `baseline`.
  Discretising makes noise within one bin unable to create a record. Points at equal
  compute are taken best first, so among ties only the highest can be a record. NaN
  points are ignored.

  Args:
    compute: compute at each point (any order; several runs may be pooled).
    reward: reward at each point, same length.
    bin_width: the reward resolution, > 0 (the paper uses 0.005).
    baseline: a reward observed before every point (the base model's, at compute
      0), or None. A checkpoint no better than it is dominated by it.

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
    raise ValueError(f"record_breaking_points: bin_width must be > 0 and finite, got {bin_width}")
  valid = np.flatnonzero(np.isfinite(compute) & np.isfinite(reward))
  if valid.size == 0:
    return np.zeros(0, dtype=np.int64)
  # lexsort: last key is primary. Ties in compute: higher reward first, then index,
  # so the result does not depend on the order the points were pooled in.
  order = valid[np.lexsort((valid, -reward[valid], compute[valid]))]
  # The small offset keeps a reward sitting exactly on a bin edge (0.5 / 0.005) in
  # its bin despite float error in the division.
  bins = np.floor(reward[order] / bin_width + 1e-9)
  start = -np.inf
  if baseline is not None and np.isfinite(baseline):
    start = np.floor(baseline / bin_width + 1e-9)
  best_before = np.concatenate([[start], np.maximum.accumulate(np.maximum(bins, start))[:-1]])
  return order[bins > best_before]


def _run_points(run, metric: str, unit: str, max_compute: float | None):
  """(compute, metric) of one run at compute > 0 (<= max_compute when given).

  Points at compute <= 0 (an evaluation before any training) have no place on a log
  compute axis.
  """
  c, r = run.points(metric, unit)
  keep = c > 0
  if max_compute is not None:
    keep &= c <= max_compute
  return c[keep], r[keep]


def base_reward(run, metric: str, unit: str = "rollouts") -> float | None:
  """The run's `metric` before any training (its step-0 evaluation), or None."""
  c, r = run.points(metric, unit)
  return float(r[c <= 0].max()) if np.any(c <= 0) else None


def _sorted_union(parts) -> tuple[np.ndarray, np.ndarray]:
  """Concatenated (compute, reward) pairs sorted by (compute, -reward)."""
  c = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0)
  r = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0)
  order = np.lexsort((-r, c))
  return c[order], r[order]


def pool_points(runs, metric: str, unit: str = "rollouts", *,
                max_compute: float | None = None) -> tuple[np.ndarray, np.ndarray]:
  """All (compute, metric) points of `runs` together, sorted by (compute, -reward).

  Points at compute <= 0 are left out; `max_compute` drops later points
  (extrapolation checks fit on the early part only).
  """
  return _sorted_union([_run_points(run, metric, unit, max_compute) for run in runs])


def record_points(runs, metric: str, unit: str = "rollouts", *, bin_width: float = 0.005,
                  max_compute: float | None = None) -> tuple[np.ndarray, np.ndarray]:
  """(compute, reward) of the record-breaking points of each run, united over `runs`.

  Each run contributes its own records (a run drawn twice by the bootstrap
  contributes them twice); the union is sorted by (compute, -reward). A run's
  evaluation before training counts as observed (§4: a record exceeds "all
  previously observed values"), so no checkpoint at or below the base model's bin
  is a record.
  """
  parts = []
  for run in runs:
    c, r = _run_points(run, metric, unit, max_compute)
    idx = record_breaking_points(c, r, bin_width=bin_width,
                                 baseline=base_reward(run, metric, unit))
    parts.append((c[idx], r[idx]))
  return _sorted_union(parts)


# A reward bin is coarse for runs whose median rise spans fewer bins than this.
MIN_BINS_PER_RISE = 10


def coarse_bin_warning(runs, metric: str, bin_width: float) -> list[str]:
  """One line for the report when `bin_width` is coarse for `runs` (else none).

  A run's records are at most its rise over the base model in bins, so a bin near
  the rise leaves each configuration a handful of records and curves that cannot be
  fitted; the paper tailors the bin to the task's difficulty (App. A, Fig. 15).
  """
  rises = []
  for run in runs:
    c, r = run.points(metric, "rollouts")
    after = r[c > 0]
    if after.size >= 3:
      start = base_reward(run, metric)
      start = after[0] if start is None else start
      # A run learned when its last third of evaluations sits above its start by more
      # than 3 sd of their noise (estimated from second differences, which a smooth
      # rise leaves near 0): a flat noisy run learned nothing a finer bin can show.
      last = after[-max(1, after.size // 3):]
      noise = np.median(np.abs(np.diff(after, 2))) / (0.6745 * np.sqrt(6))
      learned = last.mean() - start > 3 * noise * np.sqrt(1 + 1 / last.size)
      rises.append(float(after.max() - start) if learned else 0.0)
  rise = float(np.median(rises)) if rises else 0.0
  if not 0 < rise < MIN_BINS_PER_RISE * bin_width:
    return []  # fine enough, or nothing learned (no bin helps)
  finer = 10 ** np.floor(np.log10(rise / (2 * MIN_BINS_PER_RISE)))
  return [f"reward bin {bin_width:g} is coarse for these runs: their median rise in "
          f"{metric} is {rise:.3g} ({rise / bin_width:.1f} bins), so each run has few "
          f"record points; the paper tailors the bin to difficulty (App. A): try "
          f"--bin-width {finer:g}"]
