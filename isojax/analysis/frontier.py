"""Per-configuration reward curves, their upper envelope, and where it decides n*.

(How well early fits predict it: isojax.analysis.extrapolation.)

The workflow of the IsoCompute playbook (§4.1, Appendix A): keep the record-breaking
points of each run, fit one monotone sigmoid per configuration to the union of its
runs' records, and take the upper envelope of the fitted curves over a log-spaced
compute grid. The configuration attaining the envelope at C gives n*(C).

A fitted curve is only evaluated where its data are, between its first and last point
(further only when the caller asks for extrapolation, and then every grid point that
relies on it is marked). Past that it is held at its last value: the frontier at C is
the best reward achievable with compute <= C (§4), and a run that reached a reward
earlier has achieved it within any larger budget.

The hold keeps the reward envelope honest but not n*: a configuration whose runs
ended early is beaten beyond its end only because it stopped. The playbook compares
configurations each run at the budget C (App. C), so where such a curve, carried on
along its own fit, would reach the winner's reward, the grid point is *censored*:
the data do not decide n* there, and the n*(C) law is fitted to the other points.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Hashable, Mapping

import numpy as np

from isojax.analysis import fits as fits_lib
from isojax.analysis import records
from isojax.analysis.plan import is_n

_KEYS: dict[str, Callable] = {
    "n": lambda run: run.n,
    "bp_n": lambda run: (run.bp, run.n),
}


def key_n(key) -> int:
  """The n of a curve key: keys are n, or (bp, n) for joint (Bp, n, M) frontiers."""
  return int(key[-1]) if isinstance(key, tuple) else int(key)


def key_label(key) -> str:
  return f"Bp={key[0]}, n={key[1]}" if isinstance(key, tuple) else f"n={key}"


@dataclasses.dataclass(frozen=True)
class CurveSet:
  """Per-configuration fits of one metric against one compute unit.

  Attributes:
    fits: curve key -> SigmoidFit, for keys with enough record points (with R0
      fixed to the base model's reward, and flagged, when too few to fit R0).
    points: key -> (compute, reward) of every evaluation of the key's runs.
    records: key -> (compute, reward) of the record-breaking points of each run,
      united (the points the curve is fitted to).
    skipped: key -> why it was not fitted.
    n_runs: key -> number of runs of the configuration.
  """

  metric: str
  unit: str
  bin_width: float
  fits: Mapping[Hashable, fits_lib.SigmoidFit]
  points: Mapping[Hashable, tuple[np.ndarray, np.ndarray]]
  records: Mapping[Hashable, tuple[np.ndarray, np.ndarray]]
  skipped: Mapping[Hashable, str]
  n_runs: Mapping[Hashable, int]


@functools.lru_cache(maxsize=4096)
def _fit_records(compute_bytes: bytes, reward_bytes: bytes,
                 r0: float | None) -> fits_lib.SigmoidFit:
  # Bootstrap resamples refit the same record sets over and over (a configuration with
  # one run, or the same draw of its seeds); the fit is a pure function of the points,
  # so memoise it.
  return fits_lib.fit_sigmoid(np.frombuffer(compute_bytes), np.frombuffer(reward_bytes),
                              r0=r0)


# The flag of a curve whose R0 is the base model's reward (`_base_r0`).
R0_FROM_BASE = "r0 = the base model's reward"


def _base_r0(runs, metric: str, unit: str, num_records: int) -> float | None:
  """R0 for a configuration with too few records (at distinct compute) to fit it:
  its runs' mean reward before training, when they evaluated it. Otherwise (None)
  R0 is fitted.

  Such configurations are typically the largest n (fewest updates, so fewest
  evaluations) or runs on a hard set that rise by a few bins; leaving them out
  would bias n* towards small n. R(C -> 0) = R0 is the base model's reward, which
  the step-0 evaluation measures.
  """
  if num_records >= fits_lib.SIGMOID_MIN_POINTS:
    return None
  base = [b for run in runs if (b := records.base_reward(run, metric, unit)) is not None]
  return float(np.clip(np.mean(base), 0.0, 1.0)) if base else None


def _check_seeds(groups) -> None:
  """Raises unless the runs of each curve differ only in seed: pooling another Bp or
  difficulty as seeds would fit one curve through two configurations."""
  for k, group in groups.items():
    settings: dict = {}
    for run in group:
      settings.setdefault((run.difficulty or "", run.bp), []).append(run.name)
    if len(settings) > 1:
      which = "; ".join(f"difficulty={d!r}, Bp={bp}: {', '.join(names[:3])}"
                        + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")
                        for (d, bp), names in sorted(settings.items()))
      raise ValueError(f"fit_curves: the runs of {key_label(k)} differ in (difficulty, "
                       f"Bp), so they are not seeds of one configuration ({which}); "
                       f"select one Bp and difficulty first, or use key='bp_n'")


def _no_records(runs, metric: str, unit: str, bin_width: float) -> str:
  """Why runs with evaluations after training have no record-breaking point."""
  base = max(b for run in runs
             if (b := records.base_reward(run, metric, unit)) is not None)
  return (f"no evaluation beat the base model's reward bin "
          f"{math.floor(base / bin_width) * bin_width:.4g} (base {base:.4g}, bin width "
          f"{bin_width:g}); try a finer --bin-width")


def fit_curves(runs, *, metric: str, key: str | Callable = "n", unit: str = "rollouts",
               bin_width: float = 0.005, max_compute: float | None = None) -> CurveSet:
  """Fits one sigmoid per configuration to the union of its runs' record points.

  Records are taken per run (`records.record_points`), never of the runs pooled
  into one best-so-far curve, which would fit a maximum over seeds. With key "n" or
  "bp_n" the runs of one curve must be seeds of one configuration: the same
  difficulty and Bp. A configuration
  with fewer records than a free fit needs has R0 fixed to its base reward
  (`_base_r0`), and a flag saying so.

  Args:
    runs: the runs to use (already restricted to one difficulty / Bp as wanted).
    metric: e.g. "val/avg@4".
    key: "n", "bp_n", or a function run -> hashable naming a configuration.
    unit: compute unit, one of `runs.UNITS`.
    bin_width: reward bin of the record-breaking extraction.
    max_compute: use only points at compute <= this (for extrapolation checks).

  Raises:
    ValueError: naming the runs, when runs of one curve differ in difficulty or Bp
      (with key "n" or "bp_n").
  """
  key_fn = _KEYS[key] if isinstance(key, str) else key
  groups: dict = {}
  for run in runs:
    groups.setdefault(key_fn(run), []).append(run)
  if isinstance(key, str):  # a key function of the caller's defines its own pooling
    _check_seeds(groups)
  fits, points, recs, skipped = {}, {}, {}, {}
  for k in sorted(groups):
    points[k] = records.pool_points(groups[k], metric, unit, max_compute=max_compute)
    recs[k] = records.record_points(groups[k], metric, unit, bin_width=bin_width,
                                    max_compute=max_compute)
    if points[k][0].size == 0:
      skipped[k] = f"no '{metric}' points with {unit} > 0"
      continue
    if recs[k][0].size == 0:  # every evaluation sat in or below the base model's bin
      skipped[k] = _no_records(groups[k], metric, unit, bin_width)
      continue
    distinct = np.unique(recs[k][0]).size  # records at distinct compute
    r0 = _base_r0(groups[k], metric, unit, distinct)
    try:
      fit = _fit_records(recs[k][0].tobytes(), recs[k][1].tobytes(), r0)
    except ValueError as e:
      skipped[k] = f"{recs[k][0].size} record-breaking point(s): {e}"
      continue
    flags = fit.flags
    if r0 is not None:
      flags += (f"{R0_FROM_BASE}: records at {distinct} compute values are too few "
                f"to fit it",)
    # The curve is supported up to the last evaluation, not just the last record:
    # the evaluations after it show the plateau the fit predicts.
    fits[k] = dataclasses.replace(
        fit, compute_range=(fit.compute_range[0], float(points[k][0].max())), flags=flags)
  return CurveSet(metric=metric, unit=unit, bin_width=bin_width, fits=fits,
                  points=points, records=recs, skipped=skipped,
                  n_runs={k: len(v) for k, v in groups.items()})


@dataclasses.dataclass(frozen=True)
class Frontier:
  """The upper envelope of per-configuration curves on a compute grid (G points).

  Attributes:
    compute: the grid, increasing.
    reward: envelope value per grid point (NaN where no curve is supported).
    n_star: n of the attaining curve (0 where undefined).
    winner: index into `keys` of the attaining curve (-1 where undefined).
    extrapolated: True where the attaining curve is used beyond its last data point.
    keys: the curve keys, sorted.
    curves: reward of each curve per grid point, shape (len(keys), G): NaN below its
      first data point, held at its last allowed value beyond its reach.
    censors: shape (len(keys), G): True where the curve's runs ended before C (by
      more than END_TOLERANCE) and its fit, carried on to C, reaches the winner's
      reward there: it might have won at C had it been run that far.
    ends: the last data point of each curve (its runs' last evaluation).
  """

  compute: np.ndarray
  reward: np.ndarray
  n_star: np.ndarray
  winner: np.ndarray
  extrapolated: np.ndarray
  keys: tuple
  curves: np.ndarray
  censors: np.ndarray
  ends: np.ndarray

  @property
  def defined(self) -> np.ndarray:
    return self.winner >= 0

  @property
  def censored(self) -> np.ndarray:
    """True where a curve that ended early might attain the frontier: n* undecided."""
    return self.defined & self.censors.any(axis=0)

  @property
  def decided(self) -> np.ndarray:
    """True where the frontier is defined and its n* is decided by the data."""
    return self.defined & ~self.censored

  def n_star_points(self) -> tuple[np.ndarray, np.ndarray]:
    """(compute, n*) where n* is decided (`decided`), for `fit_n_star`: a censored
    point's n* is the winner only because another configuration stopped early."""
    d = self.decided
    return self.compute[d], self.n_star[d].astype(np.float64)

  def censoring(self) -> dict:
    """Curve key -> (its end, first and last compute of the grid points it censors)."""
    out = {}
    for i, k in enumerate(self.keys):
      c = self.compute[self.censors[i] & self.defined]
      if c.size:
        out[k] = (float(self.ends[i]), float(c[0]), float(c[-1]))
    return out

  def censoring_notes(self, unit: str, keys=None) -> list[str]:
    """One sentence per curve in `keys` (default: all) that censors the frontier."""
    return [f"{key_label(k)}'s runs end at {end:.2g} {unit}; beyond, its own curve "
            f"would reach the frontier (C = {first:.2g} to {last:.2g}), so n* there is "
            f"not decided by the data: run it to the full budget"
            for k, (end, first, last) in self.censoring().items()
            if keys is None or k in keys]

  def index_at(self, compute: float) -> int:
    """The grid point at or below `compute` (the last point past the grid's end, the
    first before its start)."""
    return int(np.clip(np.searchsorted(self.compute, compute, side="right") - 1, 0,
                       self.compute.size - 1))

  def censoring_at(self, compute: float) -> tuple:
    """The keys censoring the grid point at `index_at(compute)`."""
    i = self.index_at(compute)
    if not self.censored[i]:
      return ()
    return tuple(k for j, k in enumerate(self.keys) if self.censors[j, i])

  def winner_keys(self) -> list:
    return [self.keys[i] if i >= 0 else None for i in self.winner]


# A curve censors only grid points beyond END_TOLERANCE x its last evaluation. Runs of
# one budget end a little apart: M = floor(C / (Bp n)) leaves up to Bp n rollouts
# unused, and the last evaluation can fall an evaluation interval before the end
# (a run evaluated ~8 times or more loses at most ~1/8 of its compute to it). A
# quarter of an octave (19 %) covers both; a run stopped at a smaller budget of a
# study's ladder (budgets a factor 2 or more apart) ends well short of it.
END_TOLERANCE = 2.0 ** 0.25


def _censors(fits, keys, grid, curves, winner, tie_tol: float) -> np.ndarray:
  """(len(keys), G): where each curve, ended early, might attain the frontier.

  Curve j censors C when C > END_TOLERANCE x its last data point and its fit carried
  on to C (not held) reaches the winner's reward at C, less tie_tol (within it, j
  could win a tie). The winner never censors itself: carried on, it only wins by more.
  """
  out = np.zeros((len(keys), grid.size), dtype=bool)
  cols = np.arange(grid.size)
  bar = np.where(winner >= 0, curves[np.maximum(winner, 0), cols], np.inf) - tie_tol
  for j, k in enumerate(keys):
    lo, hi = fits[k].compute_range
    after = (grid > hi * END_TOLERANCE) & (grid >= lo) & (winner != j)
    if after.any():
      carried = np.full(grid.size, -np.inf)
      carried[after] = fits[k].predict(grid[after])
      out[j] = after & (carried >= bar)
  return out


def log_grid(fits: Mapping, num: int = 200) -> np.ndarray:
  """A log-spaced grid spanning the union of the curves' data ranges."""
  if not fits:
    raise ValueError("log_grid: no fitted curves")
  lo = min(f.compute_range[0] for f in fits.values())
  hi = max(f.compute_range[1] for f in fits.values())
  return np.geomspace(lo, hi, num) if hi > lo else np.array([lo])


def _check_keys(keys) -> None:
  """Raises naming a curve key that gives no n: the frontier reads n* off its keys."""
  if len({isinstance(k, tuple) for k in keys}) > 1:
    raise ValueError(f"frontier: curve keys mix n and (bp, n): {sorted(map(repr, keys))}")
  for k in keys:
    if not is_n(k[-1] if isinstance(k, tuple) and k else k):
      raise ValueError(f"frontier: curve key {k!r} names no n: a key is n (a positive "
                       f"integer), or (bp, n) for a joint frontier")


def frontier(fits: Mapping[Hashable, fits_lib.SigmoidFit], compute_grid=None, *,
             extrapolate: float = 1.0, tie_tol: float = 0.0) -> Frontier:
  """Upper envelope of fitted curves and the n attaining it at each compute.

  Args:
    fits: curve key (n, or (bp, n)) -> SigmoidFit.
    compute_grid: compute values (> 0, any order; sorted and repeats dropped);
      default a 200-point log grid over the data.
    extrapolate: a curve is evaluated up to `extrapolate` x its last data point
      (1.0: never beyond its data; math.inf: anywhere above its first point) and
      held at that value further on. Grid points whose winner relies on an
      evaluation beyond its data are marked in `Frontier.extrapolated`.
    tie_tol: 0 (default, the paper) gives the upper envelope. An explicit option:
      curves within tie_tol of the best count as tied and a tie goes to the smallest
      n (then the smallest key). Beware: it moves n* towards small n wherever curves
      lie close, which makes n* look saturated early. The envelope value stays the
      maximum.

  Grid points where a curve that ended early might attain the frontier are marked
  in `Frontier.censors` (see `_censors`); the envelope and n* there are left as they
  are, but `Frontier.n_star_points` leaves them out.

  The result does not depend on the order of the mapping.
  """
  if not fits:
    raise ValueError("frontier: no fitted curves (every configuration was skipped?)")
  if not extrapolate >= 1.0:
    raise ValueError(f"frontier: extrapolate must be >= 1, got {extrapolate}")
  if not tie_tol >= 0:
    raise ValueError(f"frontier: tie_tol must be >= 0, got {tie_tol}")
  _check_keys(fits)
  keys = tuple(sorted(fits))
  grid = log_grid(fits) if compute_grid is None else np.asarray(
      compute_grid, dtype=np.float64).ravel()
  if grid.size == 0 or not np.all(np.isfinite(grid)) or np.any(grid <= 0):
    raise ValueError("frontier: compute grid must be non-empty, finite and > 0")
  # Lookups (index_at) and the law's running average read the grid as increasing;
  # a repeated point would count twice in that average.
  grid = np.unique(grid)
  curves = np.full((len(keys), grid.size), np.nan)
  beyond = np.zeros((len(keys), grid.size), dtype=bool)
  rel = 1e-9  # grid end points computed by geomspace may miss the data range by ulps
  for i, k in enumerate(keys):
    lo, hi = fits[k].compute_range
    ok = grid >= lo * (1 - rel)
    # Runs of one budget end at slightly different compute (M = floor(C / (Bp n))),
    # and some end early: without the hold, the envelope near a curve's end would
    # be decided by which runs happened to end last.
    curves[i, ok] = fits[k].predict(np.minimum(grid[ok], hi * extrapolate))
    beyond[i] = ok & (grid > hi * (1 + rel)) & (extrapolate > 1.0)
  filled = np.where(np.isfinite(curves), curves, -np.inf)
  defined = np.any(np.isfinite(curves), axis=0)
  best = filled.max(axis=0)
  reward = np.where(defined, best, np.nan)
  # Among curves within tie_tol of the best, the smallest (n, key) wins.
  preference = sorted(range(len(keys)), key=lambda i: (key_n(keys[i]), i))
  winner = np.full(grid.size, -1)
  for i in reversed(preference):
    winner = np.where(defined & (filled[i] >= best - tie_tol), i, winner)
  cols = np.arange(grid.size)
  n_star = np.array([key_n(keys[w]) if w >= 0 else 0 for w in winner], dtype=np.int64)
  extrapolated = defined & beyond[np.maximum(winner, 0), cols]
  return Frontier(compute=grid, reward=reward, n_star=n_star, winner=winner,
                  extrapolated=extrapolated, keys=keys, curves=curves,
                  censors=_censors(fits, keys, grid, curves, winner, tie_tol),
                  ends=np.array([fits[k].compute_range[1] for k in keys]))
