"""Bounded batch (IsoCompute §4.2): splitting a fixed B = Bp * n, and sensitivity.

With the batch fixed, compute is B * M, so the question becomes which n (and hence
Bp = B / n) is best after M updates: n*(M) and Bp*(M) (paper Fig. 9). The sensitivity
analysis compares how much the final reward moves across Bp at fixed n with how much it
moves across n at fixed Bp (paper Fig. 10: 1.9 % vs 9.2 % on the Easy set).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from isojax.analysis import fits as fits_lib
from isojax.analysis import law_points as law_points_lib
from isojax.analysis.frontier import CurveSet, Frontier, fit_curves, frontier, log_grid


@dataclasses.dataclass(frozen=True)
class FixedBatch:
  """n*(M) and Bp*(M) under Bp * n = batch.

  Attributes:
    batch: B = Bp * n shared by the runs used.
    curves: per-n fits of reward against M (unit "steps").
    frontier: their envelope over a grid of M; `frontier.n_star` is n*(M).
    law: the sigmoid law of log2 n* against log10 M, or None if it could not be fit.
    problem: why `law` is None (empty otherwise).
    law_points: the frontier points the law was fitted to.
  """

  batch: int
  curves: CurveSet
  frontier: Frontier
  law: fits_lib.NStarFit | None
  problem: str = ""
  law_points: law_points_lib.LawPoints | None = None

  @property
  def bp_star(self) -> np.ndarray:
    """Bp*(M) = B / n*(M) on the frontier grid (NaN where undefined)."""
    n = self.frontier.n_star.astype(np.float64)
    return np.where(n > 0, self.batch / np.where(n > 0, n, 1.0), np.nan)

  def predict_bp_log2(self, steps) -> np.ndarray:
    """log2 Bp*(M) implied by the n* law: log2 B - log2 n*(M)."""
    if self.law is None:
      raise ValueError(f"fixed batch B={self.batch}: no n*(M) law ({self.problem})")
    return math.log2(self.batch) - self.law.predict_log2(steps)


def batch_sizes(runs) -> list[int]:
  """Batch sizes B shared by runs of at least two different n (candidates for §4.2)."""
  by_batch: dict[int, set] = {}
  for r in runs:
    by_batch.setdefault(r.batch, set()).add(r.n)
  return sorted(b for b, ns in by_batch.items() if len(ns) >= 2)


def fixed_batch(runs, *, batch: int, metric: str, bin_width: float = 0.005,
                num: int = 200, tie_tol: float = 0.0,
                law_points: str = law_points_lib.DEFAULT_METHOD,
                law_window: float = law_points_lib.DEFAULT_WINDOW_DECADES) -> FixedBatch:
  """n*(M) and Bp*(M) among the runs with Bp * n == batch.

  The frontier and its law are drawn as for compute (`frontier`, `law_points.fit_law`),
  with M in place of C.

  Raises:
    ValueError: if fewer than two values of n with fittable curves share the batch.
  """
  chosen = [r for r in runs if r.batch == batch]
  curves = fit_curves(chosen, metric=metric, key="n", unit="steps", bin_width=bin_width)
  if len(curves.fits) < 2:
    raise ValueError(
        f"fixed_batch: B={batch} has {len(curves.fits)} fittable n value(s) among "
        f"{sorted({r.n for r in chosen})}; need 2 (skipped: {dict(curves.skipped)})")
  fr = frontier(curves.fits, log_grid(curves.fits, num), tie_tol=tie_tol)
  points, law, problem = None, None, ""
  try:
    points, law = law_points_lib.fit_law(fr, unit="steps", method=law_points,
                                         window_decades=law_window, bin_width=bin_width)
  except ValueError as e:
    problem = str(e)
  return FixedBatch(batch=batch, curves=curves, frontier=fr, law=law, problem=problem,
                    law_points=points)


def _value_at(run, metric: str, compute: float, window: int) -> float:
  """Mean of the last `window` evaluations at rollouts <= compute (NaN if none)."""
  c, v = run.points(metric, "rollouts")
  v = v[c <= compute * (1 + 1e-9)]
  return float(np.mean(v[-window:])) if v.size else math.nan


@dataclasses.dataclass(frozen=True)
class Sensitivity:
  """Spread of final reward across Bp at fixed n, and across n at fixed Bp.

  Rewards are compared at matched compute: within each comparison, the largest
  compute that every configuration reached; the seeds of a configuration that got
  that far are averaged.

  Attributes:
    across_bp: n -> {bp: reward} for each n run with >= 2 values of Bp.
    across_n: bp -> {n: reward} for each Bp run with >= 2 values of n.
    compute_bp, compute_n: the matched compute of each comparison.
  """

  metric: str
  across_bp: dict
  across_n: dict
  compute_bp: dict
  compute_n: dict

  @staticmethod
  def _spread(table: dict) -> dict:
    return {k: max(v.values()) - min(v.values()) for k, v in table.items()}

  @property
  def spread_bp(self) -> dict:
    """n -> max - min reward over Bp (absolute reward units)."""
    return self._spread(self.across_bp)

  @property
  def spread_n(self) -> dict:
    """bp -> max - min reward over n."""
    return self._spread(self.across_n)

  @property
  def mean_spread_bp(self) -> float:
    s = list(self.spread_bp.values())
    return float(np.mean(s)) if s else math.nan

  @property
  def mean_spread_n(self) -> float:
    s = list(self.spread_n.values())
    return float(np.mean(s)) if s else math.nan


def _compare(runs, metric, fixed: str, varied: str, window: int):
  groups: dict = {}
  for r in runs:
    groups.setdefault(getattr(r, fixed), {}).setdefault(getattr(r, varied), []).append(r)
  table, computes = {}, {}
  for f, by_v in sorted(groups.items()):
    reach = {r.name: (c.max() if (c := r.points(metric, "rollouts")[0]).size else 0.0)
             for rs in by_v.values() for r in rs}
    # A configuration with no evaluation after step 0 (a run just started) has no
    # reward to compare; left in, it would set the common compute to 0 and drop the
    # comparison of all the others.
    by_v = {v: rs for v, rs in by_v.items() if max(reach[r.name] for r in rs) > 0}
    if len(by_v) < 2:
      continue
    # The compute every configuration reached with at least one of its runs; a
    # crashed seed must not drag the whole comparison down to its last step.
    common = min(max(reach[r.name] for r in rs) for rs in by_v.values())
    if common <= 0:
      continue
    row = {}
    for v, rs in sorted(by_v.items()):
      vals = [_value_at(r, metric, common, window) for r in rs
              if reach[r.name] >= common * (1 - 1e-9)]
      if vals:
        row[v] = float(np.mean(vals))
    if len(row) >= 2:
      table[f], computes[f] = row, common
  return table, computes


def sensitivity(runs, *, metric: str, window: int = 1) -> Sensitivity:
  """Reward spread across Bp (n fixed) versus across n (Bp fixed), paper Fig. 10.

  Args:
    runs: runs of one difficulty.
    metric: e.g. "val/avg@4".
    window: average this many last evaluations per run (noise reduction).
  """
  if window < 1:
    raise ValueError(f"sensitivity: window must be >= 1, got {window}")
  across_bp, c_bp = _compare(runs, metric, "n", "bp", window)
  across_n, c_n = _compare(runs, metric, "bp", "n", window)
  return Sensitivity(metric=metric, across_bp=across_bp, across_n=across_n,
                     compute_bp=c_bp, compute_n=c_n)
