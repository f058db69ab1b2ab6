"""From a set of runs to every analysis of the playbook, as plain data.

`analyze` splits runs by difficulty and, per difficulty, fits the per-n curves at each
Bp, the joint (Bp, n) frontier, the n*(C) laws (in rollouts and tokens, for avg@k,
best@k and worst@k), the fixed-batch n*(M), the sensitivity comparison, an
extrapolation check, bootstrap intervals and prescriptions for a few budgets. Anything
that cannot be computed is recorded as a problem instead of stopping the analysis.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

from isojax.analysis import allocation
from isojax.analysis import fits as fits_lib
from isojax.analysis.bootstrap import BootstrapResult, bootstrap
from isojax.analysis.frontier import (CurveSet, ExtrapolationCheck, Frontier,
                                      extrapolation_check, fit_curves, frontier, key_label,
                                      log_grid)
from isojax.analysis.plan import plan
from isojax.analysis.runs import LoadProblem, eval_metrics, pass1_histogram

_METRIC_RE = re.compile(r"^val/(avg|best|worst)@(\d+)$")
SIGMOID_PARAMS = ("a", "b", "c_mid", "r0")
LAW_PARAMS = ("L", "k", "x0", "b")


@dataclasses.dataclass(frozen=True)
class Sweep:
  """One frontier: curves of `metric` vs `unit` compute over configurations.

  `frontier` and `law` are None (with the reason in `problems`) when they could not
  be computed.
  """

  label: str  # "bp=32" or "joint"
  metric: str
  unit: str
  curves: CurveSet
  frontier: Frontier | None
  law: fits_lib.NStarFit | None
  problems: tuple[str, ...] = ()


def analyze_sweep(runs, *, metric: str, unit: str = "rollouts", key="n",
                  bin_width: float = 0.005, label: str = "", num: int = 200) -> Sweep:
  """Curves per configuration, their frontier, and the n*(C) law fitted along it."""
  curves = fit_curves(runs, metric=metric, key=key, unit=unit,
                                   bin_width=bin_width)
  problems = [f"{label} {metric} vs {unit}: {key_label(k)} not fitted: {why}"
              for k, why in curves.skipped.items()]
  for k, f in curves.fits.items():
    if f.flags:
      problems.append(f"{label} {metric} vs {unit}: {key_label(k)} "
                      f"fit flags: {'; '.join(f.flags)}")
  if not curves.fits:
    return Sweep(label, metric, unit, curves, None, None, tuple(problems))
  fr = frontier(curves.fits, log_grid(curves.fits, num), tie_tol=bin_width)
  law = None
  try:
    law = fits_lib.fit_n_star(*fr.n_star_points(), unit=unit)
    if law.flags:
      problems.append(f"{label} {metric} vs {unit}: n* law flags: "
                      f"{'; '.join(law.flags)}")
  except ValueError as e:
    problems.append(f"{label} {metric} vs {unit}: no n* law: {e}")
  return Sweep(label, metric, unit, curves, fr, law, tuple(problems))


@dataclasses.dataclass(frozen=True)
class Prescription:
  budget: float
  point: object  # isojax.budget.BudgetPoint, or None when infeasible
  n_star: float  # the law's unrounded n*
  extrapolated: bool  # budget beyond the data the law was fitted on
  note: str = ""


@dataclasses.dataclass(frozen=True)
class GroupAnalysis:
  """Everything computed for the runs of one difficulty."""

  difficulty: str | None
  run_names: tuple[str, ...]
  metric: str
  primary: Sweep | None  # the main §4.1 sweep: fixed Bp, primary metric, rollouts
  sweeps: tuple[Sweep, ...]
  fixed_batches: tuple[allocation.FixedBatch, ...]
  sensitivity: allocation.Sensitivity
  extrapolation: ExtrapolationCheck | None
  prescriptions: tuple[Prescription, ...]
  intervals: BootstrapResult | None
  pass1_runs: tuple  # runs that logged a training pass@1 histogram (for Fig. 11)
  problems: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Analysis:
  root: str
  metric: str
  groups: tuple[GroupAnalysis, ...]
  load_problems: tuple[LoadProblem, ...]


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


def default_budgets(law: fits_lib.NStarFit) -> list[float]:
  """Four budgets: two inside the law's data, its last point, and 10x beyond."""
  lo, hi = law.compute_range

  def round_down(c):  # two significant digits, never past the data
    scale = 10 ** (math.floor(math.log10(c)) - 1)
    return float(math.floor(c / scale) * scale)

  return [round_down(c) for c in (lo * (hi / lo) ** (1 / 3), lo * (hi / lo) ** (2 / 3),
                                  hi, 10 * hi)]


def prescribe(law: fits_lib.NStarFit, budgets, *, bp: int, b_max=None):
  out = []
  for c in budgets:
    n_pred = float(law.predict(c))
    extrapolated = c > law.compute_range[1] * (1 + 1e-9)
    try:
      point = plan(c, law, bp=bp, b_max=b_max)
      out.append(Prescription(c, point, n_pred, extrapolated))
    except ValueError as e:
      out.append(Prescription(c, None, n_pred, extrapolated, str(e)))
  return tuple(out)


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


def _run_sweeps(runs, specs, bin_width: float) -> list[Sweep]:
  return [analyze_sweep([r for r in runs if bp is None or r.bp == bp], metric=m, unit=u,
                        key=key, bin_width=bin_width, label=label)
          for label, bp, m, u, key in specs]


def _run_fixed(runs, batches, metric, bin_width):
  fixed, problems = [], []
  for batch in batches:
    try:
      fb = allocation.fixed_batch(runs, batch=batch, metric=metric,
                                  bin_width=bin_width)
      fixed.append(fb)
      if fb.law is None:
        problems.append(f"fixed B={batch}: no n*(M) law: {fb.problem}")
    except ValueError as e:
      problems.append(str(e))
  return fixed, problems


def sweep_name(sweep: Sweep) -> str:
  """The prefix of a sweep's parameters in bootstrap intervals."""
  return f"{sweep.label}|{sweep.metric}|{sweep.unit}"


def _params(sweeps, fixed, primary_name, budgets) -> dict[str, float]:
  """Every fitted number by a stable name, for the bootstrap."""
  out = {}
  tables = [(sweep_name(s), s.curves.fits, s.law) for s in sweeps]
  tables += [(f"fixed[B={fb.batch}]", fb.curves.fits, fb.law) for fb in fixed]
  for name, fits, law in tables:
    for k, f in fits.items():
      for p in SIGMOID_PARAMS:
        out[f"{name}|curve[{key_label(k)}].{p}"] = getattr(f, p)
    if law is not None:
      for p in LAW_PARAMS:
        out[f"{name}|law.{p}"] = getattr(law, p)
      if name == primary_name:
        for c in budgets:
          out[f"n_star@{c:g}"] = float(law.predict(c))
  return out


def analyze_group(runs, *, metric: str, difficulty=None, bin_width: float = 0.005,
                  n_boot: int = 100, seed: int = 0, budgets=None, bp: int | None = None,
                  c_cut: float | None = None) -> GroupAnalysis:
  """All analyses for runs of one difficulty (see the module docstring)."""
  runs = sorted(runs, key=lambda r: r.name)
  primary_bp = _primary_bp(runs)
  specs, problems = _sweep_specs(runs, metric)
  sweeps = _run_sweeps(runs, specs, bin_width)
  for s in sweeps:
    problems.extend(s.problems)
  primary = next((s for s, spec in zip(sweeps, specs)
                  if spec[1] == primary_bp and spec[2:4] == (metric, "rollouts")), None)
  batches = allocation.batch_sizes(runs)
  fixed, fixed_problems = _run_fixed(runs, batches, metric, bin_width)
  problems += fixed_problems

  extrap = None
  if primary is not None and primary.frontier is not None:
    lo, hi = primary.frontier.compute[[0, -1]]
    cut = c_cut if c_cut is not None else float(lo * (hi / lo) ** 0.75)
    try:
      extrap = extrapolation_check(
          [r for r in runs if r.bp == primary_bp], c_cut=cut, metric=metric,
          bin_width=bin_width)
    except ValueError as e:
      problems.append(f"extrapolation check: {e}")

  prescriptions, intervals = (), None
  law = primary.law if primary is not None else None
  if law is not None:
    budgets = list(budgets) if budgets else default_budgets(law)
    prescriptions = prescribe(law, budgets, bp=bp or primary_bp, b_max=_b_max(runs))
    if n_boot > 0:
      def fn(sample):
        sample_sweeps = _run_sweeps(sample, specs, bin_width)
        sample_fixed, _ = _run_fixed(sample, batches, metric, bin_width)
        return _params(sample_sweeps, sample_fixed, sweep_name(primary), budgets)

      replicated = len({r.config_key for r in runs}) < len(runs)
      intervals = bootstrap(runs, fn, n_boot=n_boot, seed=seed,
                            strata=(lambda r: r.config_key) if replicated else None)
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
      problems=tuple(problems))


def analyze(runs, *, root: str = "", metric: str | None = None, bin_width: float = 0.005,
            n_boot: int = 100, seed: int = 0, budgets=None, bp: int | None = None,
            load_problems=()) -> Analysis:
  """`analyze_group` for each difficulty (runs without one form a single group).

  Raises:
    ValueError: if there are no runs, or no avg@k metric and none is named.
  """
  if not runs:
    raise ValueError(f"analyze: no runs to analyse under {root!r}")
  metric = primary_metric(runs, metric)
  by_difficulty: dict = {}
  for r in runs:
    by_difficulty.setdefault(r.difficulty, []).append(r)
  groups = tuple(
      analyze_group(rs, metric=metric, difficulty=d, bin_width=bin_width, n_boot=n_boot,
                    seed=seed, budgets=budgets, bp=bp)
      for d, rs in sorted(by_difficulty.items(), key=lambda kv: (kv[0] is None,
                                                                 kv[0] or "")))
  return Analysis(root=root, metric=metric, groups=groups,
                  load_problems=tuple(load_problems))


def group_name(group: GroupAnalysis) -> str:
  return group.difficulty if group.difficulty is not None else "all"


def finite_or_none(x):
  """JSON-safe float: non-finite values become None."""
  x = float(x)
  return x if math.isfinite(x) else None
