"""How well curves fitted on early compute predict the frontier beyond it.

The playbook's extrapolation test (ScaleRL-style): fit the per-configuration curves to
points at compute <= c_cut only, draw their frontier (extrapolated), and compare it with
the frontier of fits to all the data, and with the best reward actually seen.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from isojax.analysis.frontier import R0_FROM_BASE, CurveSet, fit_curves, frontier


def observed_frontier(curve_set: CurveSet, grid) -> np.ndarray:
  """Best reward seen at compute <= C across all configurations (model-free; noisy
  and biased upward by taking maxima, but independent of any fit)."""
  grid = np.asarray(grid, dtype=np.float64)
  out = np.full(grid.shape, np.nan)
  for c, r in curve_set.points.values():
    if c.size:
      best = np.maximum.accumulate(r[np.argsort(c, kind="stable")])
      idx = np.searchsorted(np.sort(c), grid, side="right") - 1
      seen = np.where(idx >= 0, best[np.maximum(idx, 0)], np.nan)
      out = np.fmax(out, seen)
  return out


@dataclasses.dataclass(frozen=True)
class ExtrapolationCheck:
  """How well curves fitted on compute <= c_cut predict the frontier beyond it.

  Attributes:
    c_cut: the cut; fits saw only points at or below it.
    compute: grid over (c_cut, last data point].
    predicted: the frontier from the cut fits (extrapolated) on that grid.
    reference: the frontier from fits to all the data on that grid.
    observed: the model-free best reward seen at compute <= C.
    frontier_rmse, frontier_max_error: |predicted - reference| over the grid.
    n_star_agreement: fraction of grid points where both give the same n*.
    heldout_rmse: RMS error of the cut fits at the held-out record points.
    n_heldout: number of held-out record points.
    lost: curve keys the cut data could not fit (they never reach the prediction).
    flagged: curve keys whose cut fit ended at a bound (typically a curve cut before
      its midpoint, whose asymptote the early data cannot pin down).
  """

  c_cut: float
  compute: np.ndarray
  predicted: np.ndarray
  reference: np.ndarray
  observed: np.ndarray
  frontier_rmse: float
  frontier_max_error: float
  n_star_agreement: float
  heldout_rmse: float
  n_heldout: int
  lost: tuple
  flagged: tuple = ()


def extrapolation_check(runs, *, c_cut: float, metric: str, key: str | Callable = "n",
                        unit: str = "rollouts", bin_width: float = 0.005,
                        num: int = 100) -> ExtrapolationCheck:
  """Fits on points with compute <= c_cut and measures the error beyond it.

  Raises:
    ValueError: if nothing lies beyond `c_cut` or nothing can be fitted below it.
  """
  full = fit_curves(runs, metric=metric, key=key, unit=unit, bin_width=bin_width)
  cut = fit_curves(runs, metric=metric, key=key, unit=unit, bin_width=bin_width,
                   max_compute=c_cut)
  if not full.fits or not cut.fits:
    raise ValueError(f"extrapolation_check: no curve could be fitted "
                     f"({'below c_cut=' + repr(c_cut) if full.fits else 'at all'})")
  c_max = max(f.compute_range[1] for f in full.fits.values())
  if not c_max > c_cut:
    raise ValueError(f"extrapolation_check: c_cut={c_cut!r} leaves no data beyond "
                     f"it (last point at {c_max!r})")
  grid = np.geomspace(c_cut, c_max, num + 1)[1:]
  predicted = frontier(cut.fits, grid, extrapolate=math.inf)
  reference = frontier(full.fits, grid)
  both = predicted.defined & reference.defined
  err = np.abs(predicted.reward - reference.reward)[both]
  held = []
  for k, f in cut.fits.items():
    c, r = full.records[k]
    beyond = c > c_cut
    held.append(f.predict(c[beyond]) - r[beyond])
  held = np.concatenate(held) if held else np.zeros(0)
  return ExtrapolationCheck(
      c_cut=float(c_cut), compute=grid, predicted=predicted.reward,
      reference=reference.reward, observed=observed_frontier(full, grid),
      frontier_rmse=float(np.sqrt(np.mean(err**2))) if err.size else math.nan,
      frontier_max_error=float(err.max()) if err.size else math.nan,
      n_star_agreement=float(np.mean(predicted.n_star[both] == reference.n_star[both]))
      if both.any() else math.nan,
      heldout_rmse=float(np.sqrt(np.mean(held**2))) if held.size else math.nan,
      n_heldout=int(held.size), lost=tuple(k for k in full.fits if k not in cut.fits),
      flagged=tuple(k for k, f in cut.fits.items()
                    if any(not x.startswith(R0_FROM_BASE) for x in f.flags)))
