"""Comparing RL recipes by their fitted compute-performance curves (ScaleRL §2).

Each recipe gets one sigmoid R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B), fitted the
way each configuration of a frontier is (record-breaking points per run, united over
the recipe's runs; `frontier.fit_curves`), and is summarised by its asymptote A, its
efficiency B and C_mid, with bootstrap intervals from resampling its runs. ScaleRL's
extrapolation test asks whether a recipe's curve is predictable at all: a fit on the
first half of its compute must predict its final reward within ±0.02.

Runs are grouped into recipes by `group_by` when given (a dotted config field, or a
function of the run). Otherwise by the config's top-level `recipe` field, else its
`name` field, when every run has one and runs that share a value share their config;
else by the config fields that differ between runs (`recipe_labels`).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
from collections.abc import Callable, Mapping

import numpy as np

from isojax.analysis import fits as fits_lib
from isojax.analysis import pipeline
from isojax.analysis.bootstrap import Interval, bootstrap
from isojax.analysis.frontier import CurveSet, fit_curves
from isojax.rundir import RUNTIME_FIELDS

# Fields that say how a run was carried out, not what it trains: one recipe run with
# two seeds, to two budgets, or evaluated at another cadence is still one recipe. The
# budget's derived fields go with it (m, lr, budget.*); Bp and n stay (as run.bp and
# run.n, whichever layout the config uses): the batch is part of a recipe.
_NOT_RECIPE = ("seed", "budget", "m", "lr", "eval_every", "eval_steps",
               "evals_per_doubling", "checkpoint_every", "max_consecutive_skips", "workdir",
               *sorted(RUNTIME_FIELDS))
NAME_FIELDS = ("recipe", "name")
BASE_LABEL = "base"  # the recipe that has every field at its most common value


def _flatten(node: Mapping, prefix: str = "") -> dict:
  out = {}
  for k, v in node.items():
    if isinstance(v, Mapping):
      out.update(_flatten(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def _recipe_fields(run) -> dict[str, str]:
  """The run's config as dotted field -> printed value, without `_NOT_RECIPE`."""
  out = {k: v if isinstance(v, str) else json.dumps(v, sort_keys=True)
         for k, v in _flatten(run.config).items()
         if not any(k == p or k.startswith(p + ".") for p in _NOT_RECIPE)}
  out.update(bp=str(run.bp), n=str(run.n))
  return out


def _diff_labels(runs) -> dict[str, str]:
  """Each run's recipe named by the fields where it differs from the common value.

  A field's common value is the one most recipes share (none on a tie); a recipe is
  labelled by its fields away from it, so a leave-one-out study (ScaleRL Fig. 8)
  reads "rl.kind=ppo_clip", "rl.agg=token_mean", ... beside "base".
  """
  fields = {r.name: _recipe_fields(r) for r in runs}
  keys = sorted(set().union(*fields.values()))
  varying = [k for k in keys if len({f.get(k) for f in fields.values()}) > 1]
  if not varying:
    return {name: "all runs" for name in fields}
  recipe_of = {name: tuple(f.get(k) for k in varying) for name, f in fields.items()}
  recipes = set(recipe_of.values())
  common = []
  for i in range(len(varying)):
    (top, count), *rest = collections.Counter(r[i] for r in recipes).most_common()
    common.append(top if not rest or rest[0][1] < count else object())

  def label(recipe):
    return ", ".join(f"{k}={'unset' if v is None else v}"
                     for k, v, c in zip(varying, recipe, common) if v != c) or BASE_LABEL
  return {name: label(recipe) for name, recipe in recipe_of.items()}


def _field_labels(runs, field: str) -> dict[str, str]:
  labels = {}
  for r in runs:
    v = r.get(field)
    if v is None or v == "":
      raise ValueError(f"run {r.name!r} ({r.path}) has no config field {field!r} to "
                       f"name its recipe by")
    labels[r.name] = v if isinstance(v, str) else json.dumps(v, sort_keys=True)
  return labels


def _mixed(runs, labels) -> str:
  """'' when runs sharing a label share their config, else an example of a mix."""
  seen: dict = {}
  for r in runs:
    fields = _recipe_fields(r)
    other = seen.setdefault(labels[r.name], (r, fields))
    diff = sorted(k for k in set(fields) | set(other[1])
                  if fields.get(k) != other[1].get(k))
    if diff:
      return f"{other[0].name} and {r.name} differ in {', '.join(diff[:3])}"
  return ""


def group_recipes(runs, group_by: str | Callable | None = None) -> tuple[dict, str]:
  """(run name -> recipe label, how the labels were found); see the module docstring.

  Raises:
    ValueError: if `group_by` names a config field a run lacks.
  """
  if callable(group_by):
    return {r.name: str(group_by(r)) for r in runs}, "a function of the run"
  if group_by is not None:
    return _field_labels(runs, group_by), f"config field {group_by!r}"
  notes = []
  for field in NAME_FIELDS:
    if all(r.get(field) not in (None, "") for r in runs):
      labels = _field_labels(runs, field)
      mix = _mixed(runs, labels)
      if not mix:
        return labels, f"config field {field!r}"
      notes.append(f"not by config field {field!r}: {mix}")
  how = "the config fields that differ between runs"
  return _diff_labels(runs), how + (f" ({'; '.join(notes)})" if notes else "")


def recipe_labels(runs, group_by: str | Callable | None = None) -> dict[str, str]:
  """Run name -> the label of its recipe (see `group_recipes`)."""
  return group_recipes(runs, group_by)[0]


@dataclasses.dataclass(frozen=True)
class RecipeExtrapolation:
  """ScaleRL's extrapolation test of one recipe.

  Attributes:
    c_cut: the fit saw only points at compute <= c_cut (fit_fraction x the recipe's
      last compute).
    fit: the sigmoid fitted below the cut; None when it could not be fitted.
    compute: mean compute of the final evaluations compared (one per run that got
      beyond the cut).
    predicted: mean over those runs of the cut fit at each run's final compute.
    observed: mean of those runs' final evaluations.
    tolerance: the largest |predicted - observed| that passes.
    n_runs: runs whose final evaluation is compared.
    problem: why there is no prediction ("" when there is one).
  """

  c_cut: float
  fit: fits_lib.SigmoidFit | None
  compute: float
  predicted: float
  observed: float
  tolerance: float
  n_runs: int
  problem: str = ""

  @property
  def error(self) -> float:
    return self.predicted - self.observed

  @property
  def passed(self) -> bool:
    return not self.problem and abs(self.error) <= self.tolerance


@dataclasses.dataclass(frozen=True)
class RecipeFit:
  """One recipe's fitted curve.

  Attributes:
    label: the recipe's name.
    run_names: its runs.
    fit: the sigmoid on the union of its runs' records; None when not fittable.
    intervals: parameter ("a", "b", "c_mid", "r0") -> bootstrap interval over the
      recipe's runs; empty with one run (resampling one run says nothing) or n_boot=0.
    extrapolation: the extrapolation test; None when not asked for.
    problem: why `fit` is None ("" otherwise).
  """

  label: str
  run_names: tuple[str, ...]
  fit: fits_lib.SigmoidFit | None
  intervals: Mapping[str, Interval]
  extrapolation: RecipeExtrapolation | None
  problem: str = ""


def _extrapolate(runs, label: str, *, metric: str, unit: str, bin_width: float,
                 fit_fraction: float, tolerance: float) -> RecipeExtrapolation:
  finals = []  # (compute, reward) of each run's last evaluation
  for run in runs:
    c, r = run.points(metric, unit)
    if (c > 0).any():
      i = int(np.argmax(np.where(c > 0, c, -np.inf)))
      finals.append((c[i], r[i]))
  if not finals:
    return RecipeExtrapolation(math.nan, None, math.nan, math.nan, math.nan, tolerance,
                               0, f"no '{metric}' points with {unit} > 0")
  c_cut = fit_fraction * max(c for c, _ in finals)
  beyond = np.array([(c, r) for c, r in finals if c > c_cut])
  cut = fit_curves(runs, metric=metric, key=lambda _: label, unit=unit,
                   bin_width=bin_width, max_compute=c_cut)
  if label not in cut.fits:
    why = cut.skipped.get(label, "nothing below the cut")
    return RecipeExtrapolation(c_cut, None, float(beyond[:, 0].mean()), math.nan,
                               float(beyond[:, 1].mean()), tolerance, len(beyond),
                               f"no fit on compute <= {c_cut:.3g}: {why}")
  fit = cut.fits[label]
  return RecipeExtrapolation(c_cut, fit, float(beyond[:, 0].mean()),
                             float(fit.predict(beyond[:, 0]).mean()),
                             float(beyond[:, 1].mean()), tolerance, len(beyond))


def _intervals(runs, key, *, metric, unit, bin_width, n_boot, seed, level):
  """The bootstrap of every recipe's (A, B, C_mid), None when no recipe has two runs."""
  def params(sample):
    fits = fit_curves(sample, metric=metric, key=key, unit=unit,
                      bin_width=bin_width).fits
    return {f"{label}|{p}": getattr(f, p) for label, f in fits.items()
            for p in fits_lib.SIGMOID_PARAMS}

  sizes = collections.Counter(key(r) for r in runs)
  if max(sizes.values()) < 2:
    return None
  # Within each recipe, so every recipe stays in every resample; a recipe's
  # parameters rest on its own runs alone, hence its own degrees of freedom.
  return bootstrap(runs, params, n_boot=n_boot, seed=seed, level=level, strata=key,
                   log_scale=lambda name: name.endswith("|c_mid"),
                   dof=lambda name: max(sizes[name.rsplit("|", 1)[0]] - 1, 1),
                   support=lambda name: fits_lib.SIGMOID_SUPPORT[name.rsplit("|", 1)[1]])


def compare_recipes(runs, *, metric: str | None = None, unit: str = "rollouts",
                    group_by: str | Callable | None = None,
                    fit_fraction: float | None = 0.5, tolerance: float = 0.02,
                    bin_width: float = 0.005, n_boot: int = 200, seed: int = 0,
                    level: float = 0.9) -> RecipeComparison:
  """One sigmoid per recipe with bootstrap intervals, and ScaleRL's extrapolation test.

  Args:
    runs: the runs (from `load_runs`).
    metric: the validation metric (default val/avg@4, else the avg@k logged most).
    unit: compute axis: "rollouts", "tokens", "steps" or "device_hours".
    group_by: a dotted config field or a function run -> label naming the recipe;
      None: see the module docstring.
    fit_fraction: fit each recipe on compute <= fit_fraction x its last compute and
      compare the fit's prediction with the final evaluations beyond it (ScaleRL: the
      first half); None skips the test.
    tolerance: the test passes when |predicted - observed| <= tolerance.
    bin_width: reward bin of the record-breaking points.
    n_boot, seed, level: the bootstrap over each recipe's runs (0: no intervals).

  Raises:
    ValueError: on no runs, a bad option, a `group_by` field a run lacks, or a unit a
      run does not log (device_hours from a run without that column names the run).
  """
  if not runs:
    raise ValueError("compare_recipes: no runs")
  if fit_fraction is not None and not 0 < fit_fraction < 1:
    raise ValueError(f"compare_recipes: fit_fraction must be in (0, 1), got "
                     f"{fit_fraction!r}")
  if not (math.isfinite(tolerance) and tolerance > 0):
    raise ValueError(f"compare_recipes: tolerance must be > 0 and finite, got {tolerance!r}")
  runs = sorted(runs, key=lambda r: r.name)
  metric = pipeline.primary_metric(runs, metric)
  labels, how = group_recipes(runs, group_by)

  def key(run) -> str:
    return labels[run.name]

  curves = fit_curves(runs, metric=metric, key=key, unit=unit, bin_width=bin_width)
  boot = (_intervals(runs, key, metric=metric, unit=unit, bin_width=bin_width,
                     n_boot=n_boot, seed=seed, level=level) if n_boot > 0 else None)
  recipes = []
  for label in sorted(set(labels.values())):
    members = [r for r in runs if labels[r.name] == label]
    intervals = {} if boot is None or len(members) < 2 else {
        p: boot.intervals[f"{label}|{p}"] for p in fits_lib.SIGMOID_PARAMS
        if f"{label}|{p}" in boot.intervals}
    extrapolation = None if fit_fraction is None else _extrapolate(
        members, label, metric=metric, unit=unit, bin_width=bin_width,
        fit_fraction=fit_fraction, tolerance=tolerance)
    recipes.append(RecipeFit(label, tuple(r.name for r in members),
                             curves.fits.get(label), intervals, extrapolation,
                             curves.skipped.get(label, "")))
  return RecipeComparison(
      metric=metric, unit=unit, grouped_by=how, recipes=tuple(recipes), curves=curves,
      fit_fraction=fit_fraction, tolerance=tolerance,
      n_boot=n_boot if boot else 0, n_failed=boot.n_failed if boot else 0, level=level)


def _num(x, digits: int = 4) -> str:
  return "–" if x is None or not math.isfinite(x) else f"{x:.{digits}g}"


@dataclasses.dataclass(frozen=True)
class RecipeComparison:
  """The table of `compare_recipes`: (A, B, C_mid) per recipe with intervals.

  `recipes` is sorted by label; `curves` holds every recipe's evaluations and record
  points (for figures). Index by label: comparison["base"].
  """

  metric: str
  unit: str
  grouped_by: str
  recipes: tuple[RecipeFit, ...]
  curves: CurveSet
  fit_fraction: float | None
  tolerance: float
  n_boot: int
  n_failed: int
  level: float

  def __getitem__(self, label: str) -> RecipeFit:
    for r in self.recipes:
      if r.label == label:
        return r
    raise KeyError(f"no recipe {label!r}; recipes: {[r.label for r in self.recipes]}")

  def to_dict(self) -> dict:
    """Plain Python types (full precision; NaN where a value is undefined)."""
    recipes = {}
    for r in self.recipes:
      ex = r.extrapolation
      recipes[r.label] = {
          "runs": list(r.run_names), "problem": r.problem,
          "fit": None if r.fit is None else r.fit.to_dict(),
          "interval": {p: iv.to_dict() for p, iv in r.intervals.items()},
          "extrapolation": None if ex is None else {
              "c_cut": ex.c_cut, "compute": ex.compute, "predicted": ex.predicted,
              "observed": ex.observed, "error": ex.error, "tolerance": ex.tolerance,
              "passed": ex.passed, "n_runs": ex.n_runs, "problem": ex.problem,
              "fit": None if ex.fit is None else ex.fit.to_dict()}}
    return {"metric": self.metric, "unit": self.unit, "grouped_by": self.grouped_by,
            "formula": "R = r0 + (a - r0) / (1 + (c_mid / C)^b)",
            "records": "per run", "bin_width": self.curves.bin_width,
            "fit_fraction": self.fit_fraction, "tolerance": self.tolerance,
            "bootstrap": {"n_boot": self.n_boot, "n_failed": self.n_failed,
                          "level": self.level, "resampled": "runs within each recipe"},
            "recipes": recipes}

  def _cell(self, r: RecipeFit, p: str, digits: int) -> str:
    iv = r.intervals.get(p)
    ci = (f" [{_num(iv.low, digits)}, {_num(iv.high, digits)}]"
          if iv is not None and iv.n_ok else "")
    return _num(getattr(r.fit, p), digits) + ci

  def to_markdown(self) -> str:
    """A "## Recipe comparison" section: the fit table and the extrapolation test."""
    boot = (f"{100 * self.level:.0f}% bootstrap intervals over each recipe's runs "
            f"({self.n_boot} resamples; none for a recipe with one run)"
            if self.n_boot else "no bootstrap intervals")
    out = ["## Recipe comparison", "",
           f"`{self.metric}` vs compute in {self.unit}; recipes grouped by "
           f"{self.grouped_by}. One sigmoid R = R0 + (A − R0)/(1 + (C_mid/C)^B) per "
           f"recipe on the union of its runs' record-breaking points (reward bin "
           f"{self.curves.bin_width:g}); {boot}.", "",
           f"| recipe | runs | A | B | C_mid ({self.unit}) | R0 | rms | flags |",
           "|---|---|---|---|---|---|---|---|"]
    for r in self.recipes:
      if r.fit is None:
        out.append(f"| {r.label} | {len(r.run_names)} | not fitted: {r.problem} "
                   f"| | | | | |")
        continue
      out.append(f"| {r.label} | {len(r.run_names)} | {self._cell(r, 'a', 3)} | "
                 f"{self._cell(r, 'b', 3)} | {self._cell(r, 'c_mid', 3)} | "
                 f"{self._cell(r, 'r0', 3)} | {r.fit.rms:.4f} | "
                 f"{'; '.join(r.fit.flags)} |")
    if self.fit_fraction is not None:
      out += ["", "### Extrapolation test", "",
              f"Each recipe fitted on its first {100 * self.fit_fraction:g}% of compute "
              f"predicts its final reward (the mean of its runs' last evaluations beyond "
              f"the cut) within ±{self.tolerance:g}, or not.", "",
              "| recipe | fit on C ≤ | final C | predicted | observed | error | "
              f"within ±{self.tolerance:g} |", "|---|---|---|---|---|---|---|"]
      for r in self.recipes:
        ex = r.extrapolation
        verdict = ("pass" if ex.passed else "FAIL") + (f" ({ex.problem})" if ex.problem
                                                       else "")
        out.append(f"| {r.label} | {_num(ex.c_cut, 3)} | {_num(ex.compute, 3)} | "
                   f"{_num(ex.predicted)} | {_num(ex.observed)} | "
                   f"{_num(ex.error, 2)} | {verdict} |")
    return "\n".join(out) + "\n"
