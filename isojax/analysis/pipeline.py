"""From a set of runs to every analysis of the playbook, as plain data.

`analyze` splits runs by difficulty and, per difficulty, fits the per-n curves at each
Bp, the joint (Bp, n) frontier, the n*(C) laws (in rollouts and tokens, for avg@k,
best@k and worst@k), the fixed-batch n*(M), the sensitivity comparison, an
extrapolation check, bootstrap intervals and prescriptions for a few budgets. Anything
that cannot be computed is recorded as a problem instead of stopping the analysis.

How a frontier is drawn is set by `FrontierOptions`, whose defaults are the paper's
procedure: records per run at a 0.005 reward bin, the upper envelope of the fitted
curves (no tie tolerance), and the n*(C) law fitted to the running average of n* along
the frontier (Fig. 7). Prescriptions come from the law `prescriptions.choose_law`
picks: the joint (Bp, n, M) study's when the runs hold one (App. C).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

import numpy as np

from isojax.analysis import allocation, records
from isojax.analysis import fits as fits_lib
from isojax.analysis import law_points as law_points_lib
from isojax.analysis import prescriptions as rx
from isojax.analysis.bootstrap import BootstrapResult
from isojax.analysis.extrapolation import ExtrapolationCheck, extrapolation_check
from isojax.analysis.frontier import (CurveSet, Frontier, fit_curves, frontier, key_label,
                                      log_grid)
from isojax.analysis.intervals import group_intervals, sweep_name, unresampled_curves
from isojax.analysis.runs import (LoadProblem, eval_metrics, evaluation_gaps,
                                  pass1_histogram)
from isojax.rundir import METRICS_FILE

_METRIC_RE = re.compile(r"^val/(avg|best|worst)@(\d+)$")


@dataclasses.dataclass(frozen=True)
class FrontierOptions:
  """How frontiers and n*(C) laws are drawn; the defaults are the paper's procedure.

  Attributes:
    bin_width: reward bin of the record-breaking points of each run (§4.1: 0.005).
    tie_tol: curves within tie_tol of the envelope count as tied and the smallest n
      among them wins; 0 (the paper) takes the upper envelope itself.
    law_points: the frontier points the n*(C) law is fitted to: "running_average"
      (Fig. 7) or "bins" (Fig. 15); see isojax.analysis.law_points.
    law_window: the running average's window, in decades of compute.
  """

  bin_width: float = 0.005
  tie_tol: float = 0.0
  law_points: str = law_points_lib.DEFAULT_METHOD
  law_window: float = law_points_lib.DEFAULT_WINDOW_DECADES

  def __post_init__(self):
    if not (math.isfinite(self.bin_width) and self.bin_width > 0):
      raise ValueError(f"bin_width must be > 0 and finite, got {self.bin_width!r}")
    if not (math.isfinite(self.tie_tol) and self.tie_tol >= 0):
      raise ValueError(f"tie_tol must be >= 0 and finite, got {self.tie_tol!r}")
    if self.law_points not in law_points_lib.METHODS:
      raise ValueError(f"law_points must be one of {sorted(law_points_lib.METHODS)}, "
                       f"got {self.law_points!r}")
    if not (math.isfinite(self.law_window) and self.law_window > 0):
      raise ValueError(f"law_window must be > 0 decades and finite, got {self.law_window!r}")

  def law_of(self, fr: Frontier, unit: str):
    """(LawPoints, NStarFit) of a frontier. Raises ValueError when no law fits."""
    return law_points_lib.fit_law(fr, unit=unit, method=self.law_points,
                                  window_decades=self.law_window,
                                  bin_width=self.bin_width)


@dataclasses.dataclass(frozen=True)
class FrontierFit:
  """One frontier: curves of `metric` vs `unit` compute over configurations.

  `frontier`, `law` and `law_points` are None (with the reason in `problems`) when
  they could not be computed.
  """

  label: str  # "bp=32" or "joint"
  metric: str
  unit: str
  curves: CurveSet
  frontier: Frontier | None
  law: fits_lib.NStarFit | None
  problems: tuple[str, ...] = ()
  law_points: law_points_lib.LawPoints | None = None


def fit_frontier(runs, *, metric: str, unit: str = "rollouts", key="n",
                 bin_width: float = 0.005, label: str = "", num: int = 200,
                 options: FrontierOptions | None = None) -> FrontierFit:
  """Curves per configuration, their frontier, and the n*(C) law fitted along it.

  `options` sets the tie tolerance and the law's points (default: the paper's
  procedure at `bin_width`); when given, its own bin width is used.
  """
  opts = options or FrontierOptions(bin_width=bin_width)
  curves = fit_curves(runs, metric=metric, key=key, unit=unit, bin_width=opts.bin_width)
  where = f"{label} {metric} vs {unit}"
  problems = [f"{where}: {key_label(k)} not fitted: {why}"
              for k, why in curves.skipped.items()]
  for k, f in curves.fits.items():
    if f.flags:
      problems.append(f"{where}: {key_label(k)} fit flags: {'; '.join(f.flags)}")
  if not curves.fits:
    return FrontierFit(label, metric, unit, curves, None, None, tuple(problems))
  fr = frontier(curves.fits, log_grid(curves.fits, num), tie_tol=opts.tie_tol)
  problems += [f"{where}: {note}" for note in fr.censoring_notes(unit)]
  points = law = None
  try:
    points, law = opts.law_of(fr, unit)
    if law.flags:
      problems.append(f"{where}: n* law flags: {'; '.join(law.flags)}")
  except ValueError as e:
    problems.append(f"{where}: no n* law: {e}")
  if law is not None:
    problems += _law_caveats(where, fr, law, opts)
  return FrontierFit(label, metric, unit, curves, fr, law, tuple(problems), points)


def _law_caveats(where: str, fr: Frontier, law, opts: FrontierOptions) -> list[str]:
  """What the law cannot tell: too few values of n*, an n*(C) that is no sigmoid, or a
  saturation where the n grid stops."""
  c, n = fr.n_star_points()
  steps = [0] + [i + 1 for i in np.flatnonzero(np.diff(n))]
  path = " -> ".join(f"{int(n[i])} (from C={c[i]:.3g})" for i in steps)
  out, distinct = [], len(set(n.astype(int)))
  largest = rx.n_grid_censored(fr, law)
  if largest is not None:
    # log2 n* -> L + b; a law refitted to a bootstrap resample can put that past any
    # float (2.0 ** 1100 raises OverflowError), so large ones are written as powers.
    top = law.L + law.b
    tends = f"{2.0 ** top:.3g}" if top < 1000 else f"2^{top:.4g}"
    out.append(f"{where}: n* reaches n={largest}, the largest n tried, at the frontier's "
               f"end (C={c[-1]:.3g}; the law's n* tends to {tends}): "
               f"the law's saturation comes from where the n grid stops, not from larger "
               f"n tried and lost (§4.1); try larger n before trusting n* beyond the data")
  if distinct < 3:
    out.append(f"{where}: n* takes fewer than 3 values along the frontier ({path}), so "
               f"the law's steepness k reflects how its points are drawn "
               f"({opts.law_points}) more than the data")
  if distinct > 1 and not law.r2 >= 0.8:
    out.append(f"{where}: the n* law explains R²={law.r2:.2f} of log2 n* along the "
               f"frontier ({path}): n*(C) is not a sigmoid in this data; read the law "
               f"as a summary, not a trend")
  return out


@dataclasses.dataclass(frozen=True)
class GroupAnalysis:
  """Everything computed for the runs of one difficulty.

  `law_choice` is the law the prescriptions come from and why (None without a law).
  """

  difficulty: str | None
  run_names: tuple[str, ...]
  metric: str
  primary: FrontierFit | None  # the main §4.1 sweep: fixed Bp, primary metric, rollouts
  sweeps: tuple[FrontierFit, ...]
  fixed_batches: tuple[allocation.FixedBatch, ...]
  sensitivity: allocation.Sensitivity
  extrapolation: ExtrapolationCheck | None
  prescriptions: tuple[rx.Prescription, ...]
  intervals: BootstrapResult | None
  pass1_runs: tuple  # runs that logged a training pass@1 histogram (for Fig. 11)
  problems: tuple[str, ...]
  law_choice: rx.LawChoice | None = None


@dataclasses.dataclass(frozen=True)
class Analysis:
  root: str
  metric: str
  groups: tuple[GroupAnalysis, ...]
  load_problems: tuple[LoadProblem, ...]
  options: FrontierOptions = FrontierOptions()


def primary_metric(runs, preferred: str | None = None) -> str:
  """`preferred` if given, else val/avg@k for the k logged most (k = 4 on ties)."""
  if preferred:
    return preferred
  avg = [m for m in eval_metrics(runs) if (g := _METRIC_RE.match(m)) and g[1] == "avg"]
  if not avg:
    raise ValueError("no 'val/avg@k' metric in any run; pass --metric")
  return sorted(avg, key=lambda m: (m != "val/avg@4", int(_METRIC_RE.match(m)[2])))[0]


def _sibling_metrics(runs, metric: str) -> list[str]:
  """best@k and worst@k for the k of `metric`, when logged."""
  g = _METRIC_RE.match(metric)
  if not g:
    return []
  have = set(eval_metrics(runs))
  return [m for m in (f"val/best@{g[2]}", f"val/worst@{g[2]}") if m in have]


def _primary_bp(runs) -> int | None:
  """The Bp with the most distinct n (smallest Bp on ties)."""
  ns: dict[int, set] = {}
  for r in runs:
    ns.setdefault(r.bp, set()).add(r.n)
  return min(ns, key=lambda bp: (-len(ns[bp]), bp)) if ns else None


def _b_max(runs) -> int | None:
  vals = [v for r in runs for v in (r.get("b_max"), r.get("budget.b_max"))
          if isinstance(v, (int, float)) and v > 0]
  return int(max(vals)) if vals else None


def _sweep_specs(runs, metric: str) -> tuple[list[tuple], list[str]]:
  """Which sweeps to run: (label, bp or None for joint, metric, unit, key)."""
  specs, problems = [], []
  bps = sorted({r.bp for r in runs})
  primary_bp = _primary_bp(runs)
  for b in bps:
    chosen = [r for r in runs if r.bp == b]
    if b != primary_bp and len({r.n for r in chosen}) < 2:
      continue  # one n at this Bp: no frontier to speak of (the joint one has it)
    specs.append((f"bp={b}", b, metric, "rollouts", "n"))
    if b != primary_bp:
      continue
    specs += [(f"bp={b}", b, m, "rollouts", "n") for m in _sibling_metrics(runs, metric)]
    no_tokens = [r.name for r in chosen if not np.isfinite(r.column("tokens")).any()]
    if len(no_tokens) < len(chosen):
      specs.append((f"bp={b}", b, metric, "tokens", "n"))
    if no_tokens:
      problems.append(f"bp={b}: no 'tokens' logged by {', '.join(no_tokens)}; "
                      f"left out of the token-compute frontier")
  if len(bps) >= 2:
    specs.append(("joint", None, metric, "rollouts", "bp_n"))
  return specs, problems


def _run_sweeps(runs, specs, opts: FrontierOptions) -> list[FrontierFit]:
  return [fit_frontier([r for r in runs if bp is None or r.bp == bp], metric=m, unit=u,
                        key=key, label=label, options=opts)
          for label, bp, m, u, key in specs]


def _run_fixed(runs, batches, metric, opts: FrontierOptions):
  fixed, problems = [], []
  for batch in batches:
    try:
      fb = allocation.fixed_batch(runs, batch=batch, metric=metric,
                                  bin_width=opts.bin_width, tie_tol=opts.tie_tol,
                                  law_points=opts.law_points, law_window=opts.law_window)
      fixed.append(fb)
      problems += [f"fixed B={batch}: {note}"
                   for note in fb.frontier.censoring_notes("steps")]
      if fb.law is None:
        problems.append(f"fixed B={batch}: no n*(M) law: {fb.problem}")
    except ValueError as e:
      problems.append(str(e))
  return fixed, problems


def _extrapolation(runs, primary, primary_bp, metric, opts, c_cut):
  """The primary sweep's extrapolation check, or (None, why not)."""
  if primary is None or primary.frontier is None:
    return None, None
  lo, hi = primary.frontier.compute[[0, -1]]
  cut = c_cut if c_cut is not None else float(lo * (hi / lo) ** 0.75)
  try:
    return extrapolation_check([r for r in runs if r.bp == primary_bp], c_cut=cut,
                               metric=metric, bin_width=opts.bin_width), None
  except ValueError as e:
    return None, f"extrapolation check: {e}"


def analyze_group(runs, *, metric: str, difficulty=None,
                  options: FrontierOptions | None = None, n_boot: int = 100,
                  seed: int = 0, budgets=None, bp: int | None = None,
                  c_cut: float | None = None,
                  unstable_runs=frozenset()) -> GroupAnalysis:
  """All analyses for runs of one difficulty (see the module docstring).

  `unstable_runs` names runs known to be unstable from loading (non-finite values);
  prescriptions avoid their Bp (see prescriptions.choose_law).
  """
  opts = options or FrontierOptions()
  runs = sorted(runs, key=lambda r: r.name)
  primary_bp = _primary_bp(runs)
  specs, problems = _sweep_specs(runs, metric)
  problems = (evaluation_gaps(runs, metric)
              + records.coarse_bin_warning(runs, metric, opts.bin_width) + problems)
  sweeps = _run_sweeps(runs, specs, opts)
  for s in sweeps:
    problems.extend(s.problems)
  primary = next((s for s, spec in zip(sweeps, specs)
                  if spec[1] == primary_bp and spec[2:4] == (metric, "rollouts")), None)
  batches = allocation.batch_sizes(runs)
  fixed, fixed_problems = _run_fixed(runs, batches, metric, opts)
  problems += fixed_problems
  extrap, why = _extrapolation(runs, primary, primary_bp, metric, opts, c_cut)
  problems += [why] if why else []

  prescriptions, intervals = (), None
  choice = rx.choose_law(sweeps, runs, primary=primary, primary_bp=primary_bp, bp=bp,
                         unstable_runs=unstable_runs)
  if choice is not None:
    budgets = list(budgets) if budgets else rx.default_budgets(choice.law)
    law_name = f"{choice.label}|{metric}|rollouts"
    if n_boot > 0:
      def refit(sample):
        return (_run_sweeps(sample, specs, opts),
                _run_fixed(sample, batches, metric, opts)[0])

      intervals, why = group_intervals(runs, refit, sweeps, fixed, law_name=law_name,
                                       budgets=budgets, n_boot=n_boot, seed=seed)
      problems += why
    unresampled = unresampled_curves(
        intervals, next((s for s in sweeps if sweep_name(s) == law_name), None))
    if unresampled:
      problems.append(f"bootstrap: the resamples lack {', '.join(unresampled)} of the "
                      f"{choice.label} law's frontier, so its intervals of n* and of the "
                      f"law's parameters rest on other curves and are not reported for "
                      f"prescriptions")
    n_star_intervals = {c: rx.n_star_interval(intervals, c) for c in budgets}
    prescriptions = rx.prescribe(choice, budgets, b_max=_b_max(runs),
                                 intervals=n_star_intervals, unresampled=unresampled)
  elif primary is not None:
    problems.append("no n*(C) law, so no prescriptions")
  else:
    problems.append(f"no curve for {metric!r} could be fitted")
  return GroupAnalysis(
      difficulty=difficulty, run_names=tuple(r.name for r in runs), metric=metric,
      primary=primary, sweeps=tuple(sweeps), fixed_batches=tuple(fixed),
      sensitivity=allocation.sensitivity(runs, metric=metric), extrapolation=extrap,
      prescriptions=prescriptions, intervals=intervals,
      pass1_runs=tuple(r for r in runs
                       if any(pass1_histogram(row) is not None for row in r.rows)),
      problems=tuple(problems), law_choice=choice)


def _unstable_runs(runs, load_problems) -> frozenset:
  """Names of runs whose metrics.jsonl had non-finite values dropped at loading."""
  bad = {os.path.normpath(p.path) for p in load_problems if p.kind == "non_finite"}
  return frozenset(r.name for r in runs
                   if os.path.normpath(os.path.join(r.path, METRICS_FILE)) in bad)


def analyze(runs, *, root: str = "", metric: str | None = None, bin_width: float = 0.005,
            tie_tol: float = 0.0, law_points: str = law_points_lib.DEFAULT_METHOD,
            law_window: float = law_points_lib.DEFAULT_WINDOW_DECADES, n_boot: int = 100,
            seed: int = 0, budgets=None, bp: int | None = None,
            load_problems=()) -> Analysis:
  """`analyze_group` for each difficulty (runs without one form a single group).

  bin_width, tie_tol, law_points and law_window are the `FrontierOptions`.

  Raises:
    ValueError: if there are no runs, no avg@k metric and none is named, or an
      option is out of range.
  """
  if not runs:
    raise ValueError(f"analyze: no runs to analyse under {root!r}")
  opts = FrontierOptions(bin_width=bin_width, tie_tol=tie_tol, law_points=law_points,
                         law_window=law_window)
  metric = primary_metric(runs, metric)
  unstable = _unstable_runs(runs, load_problems)
  by_difficulty: dict = {}
  for r in runs:
    by_difficulty.setdefault(r.difficulty, []).append(r)
  groups = tuple(
      analyze_group(rs, metric=metric, difficulty=d, options=opts, n_boot=n_boot,
                    seed=seed, budgets=budgets, bp=bp, unstable_runs=unstable)
      for d, rs in sorted(by_difficulty.items(), key=lambda kv: (kv[0] is None,
                                                                 kv[0] or "")))
  return Analysis(root=root, metric=metric, groups=groups,
                  load_problems=tuple(load_problems), options=opts)


def group_name(group: GroupAnalysis) -> str:
  return group.difficulty if group.difficulty is not None else "all"
