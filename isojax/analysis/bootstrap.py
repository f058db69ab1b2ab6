"""Confidence intervals by resampling whole runs.

Points within one run are strongly correlated (each checkpoint continues the last), so
resampling points would understate the uncertainty. The unit of resampling is the run.

A study has few runs per configuration (seeds), and the plain percentile bootstrap is
then too narrow: with k runs its variance is (k - 1) / k of the truth, its resamples
take few distinct values, and a normal quantile ignores that the spread itself rests on
k - 1 degrees of freedom. In simulated studies with 3 seeds its 90 % intervals of n*
covered 38-81 %. So each resample draws k - 1 of a stratum's k runs (the rescaled
bootstrap of Rao & Wu 1988, whose variance of a stratum mean is the unbiased s^2 / k),
and the interval is estimate -/+ t(df) x the resamples' standard deviation, with df =
k - 1 (on a log scale for quantities that are ratios by nature, e.g. n*). The same
simulations then covered 85-100 %. Where some resamples found a quantity infinite (an
unbounded n*), the interval also spans their percentiles: unbounded once they pass
the tail, never narrower than the finite resamples' own interval.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np
from scipy import stats


@dataclasses.dataclass(frozen=True)
class Interval:
  """A point estimate with its bootstrap interval.

  Attributes:
    estimate: fn on the original runs.
    low, high: estimate -/+ t x the resamples' standard deviation (see the module
      docstring), widened to the percentiles (100-level)/2 and 100-(100-level)/2
      of the resamples when one of them is infinite; NaN without an estimate.
    n_ok: resamples in which fn returned a value (finite or infinite, not NaN) for
      this quantity.
  """

  estimate: float
  low: float
  high: float
  n_ok: int

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class BootstrapResult:
  """Intervals per named quantity, plus how the resampling went.

  Attributes:
    intervals: quantity name -> Interval (a scalar fn is named "value").
    n_boot: resamples drawn.
    n_failed: resamples where fn raised ValueError (e.g. a curve lost all its runs).
    level: the interval's coverage, e.g. 0.9.
    stratified: whether runs were resampled within strata.
  """

  intervals: Mapping[str, Interval]
  n_boot: int
  n_failed: int
  level: float
  stratified: bool

  def __getitem__(self, name: str) -> Interval:
    return self.intervals[name]


def _percentiles(values, qs) -> list[float]:
  """NumPy's (linear) percentiles, where infinite values are allowed.

  Interpolating towards an infinite value gives that value (its limit); NumPy's
  percentile gives NaN there, which would hide an unbounded interval.
  """
  v = np.sort(np.asarray(values, dtype=np.float64))
  if np.all(np.isfinite(v)):
    return [float(x) for x in np.percentile(v, qs)]
  out = []
  for q in qs:
    h = (v.size - 1) * q / 100
    i = math.floor(h)
    a, b = v[i], v[min(i + 1, v.size - 1)]
    if h == i or a == b:
      out.append(float(a))
    elif a == -math.inf:
      out.append(math.nan if b == math.inf else -math.inf)
    else:
      out.append(math.inf if b == math.inf else float(a + (h - i) * (b - a)))
  return out


def _as_dict(value) -> dict[str, float]:
  if isinstance(value, Mapping):
    return {str(k): float(v) for k, v in value.items()}
  return {"value": float(value)}


def _t_interval(estimate: float, values: np.ndarray, q: float, log: bool):
  """estimate -/+ q x sd(values), on a log scale when `log` (all positive)."""
  log = log and estimate > 0 and bool(np.all(values > 0))
  fwd, inv = (np.log, np.exp) if log else (lambda x: x, lambda x: x)
  half = q * float(np.std(fwd(values), ddof=1))
  return float(inv(fwd(estimate) - half)), float(inv(fwd(estimate) + half))


def bootstrap(runs: Sequence, fn: Callable, *, n_boot: int = 200, seed: int = 0,
              level: float = 0.9, strata: Callable | None = None,
              log_scale: Callable[[str], bool] | None = None,
              dof: Callable[[str], int] | None = None,
              support: Callable[[str], tuple[float, float] | None] | None = None
              ) -> BootstrapResult:
  """Intervals of fn(runs) from resampling whole runs (see the module docstring).

  Args:
    runs: the runs (their order does not matter: they are sorted by name first).
    fn: runs -> float, or runs -> {name: float}. Names missing or NaN in a resample
      are not counted for that name; infinite values are (an unbounded estimate
      makes an unbounded interval). A ValueError counts the resample failed.
    n_boot: number of resamples.
    seed: seed of NumPy's generator: the same inputs give the same intervals.
    level: coverage of the interval, in (0, 1).
    strata: optional run -> hashable; resampling then happens within each stratum
      (e.g. per configuration, so every configuration stays represented). A
      stratum of k >= 2 runs gives each resample k - 1 of them; a one-run stratum
      is always that run, and adds no variation.
    log_scale: name -> whether that quantity's interval is formed on a log scale.
    dof: name -> the degrees of freedom of its t quantile, or None for the
      default: the smallest k - 1 of the strata with two runs or more (what a
      quantity that depends on every stratum can count on).
    support: name -> the (low, high) values the quantity can take, or None; its
      interval is cut to them (e.g. a reward's [0, 1]), which keeps its coverage.

  Raises:
    ValueError: on empty runs, n_boot < 1, a bad level, no stratum with two runs
      (nothing to resample), or if fn fails on `runs`.
  """
  if not runs:
    raise ValueError("bootstrap: no runs")
  if n_boot < 1:
    raise ValueError(f"bootstrap: n_boot must be >= 1, got {n_boot}")
  if not 0 < level < 1:
    raise ValueError(f"bootstrap: level must be in (0, 1), got {level}")
  runs = sorted(runs, key=lambda r: r.name)
  groups: dict = {}
  for i, run in enumerate(runs):
    groups.setdefault(strata(run) if strata else None, []).append(i)
  index_groups = [np.array(groups[k]) for k in sorted(groups, key=repr)]
  sizes = [g.size for g in index_groups if g.size > 1]
  if not sizes:
    raise ValueError(f"bootstrap: every stratum has one run ({len(runs)} runs): "
                     f"resampling cannot vary them")
  estimate = _as_dict(fn(runs))
  rng = np.random.default_rng(seed)
  samples: dict[str, list[float]] = {name: [] for name in estimate}
  failed = 0
  for _ in range(n_boot):
    idx = np.concatenate([rng.choice(g, size=max(g.size - 1, 1), replace=True)
                          for g in index_groups])
    try:
      out = _as_dict(fn([runs[i] for i in np.sort(idx)]))
    except ValueError:
      failed += 1
      continue
    for name, v in out.items():
      if not math.isnan(v):
        samples.setdefault(name, []).append(v)
  tail = 100 * (1 - level) / 2
  intervals = {}
  for name, vals in samples.items():
    v = np.asarray(vals, dtype=np.float64)
    est = estimate.get(name, math.nan)
    finite = v[np.isfinite(v)]
    lo = hi = math.nan
    if math.isnan(est) or v.size < 2:
      pass  # nothing to centre an interval on, or no spread
    elif math.isinf(est) or finite.size < 2:
      lo, hi = _percentiles(v, [tail, 100 - tail])
    else:
      df = dof(name) if dof else None
      q = float(stats.t.ppf(1 - tail / 100, min(sizes) - 1 if df is None else df))
      lo, hi = _t_interval(est, finite, q, bool(log_scale and log_scale(name)))
      bounds = support(name) if support else None
      if bounds is not None:  # never past the estimate itself
        lo, hi = min(max(lo, bounds[0]), est), max(min(hi, bounds[1]), est)
      if finite.size < v.size:
        p_lo, p_hi = _percentiles(v, [tail, 100 - tail])
        lo, hi = min(lo, p_lo), max(hi, p_hi)
    intervals[name] = Interval(estimate=est, low=float(lo), high=float(hi), n_ok=len(vals))
  return BootstrapResult(intervals=intervals, n_boot=n_boot, n_failed=failed,
                         level=level, stratified=strata is not None)
