"""Writing an analysis out: figures (PNG), fits.json (full precision) and report.md.

`write_report` writes the playbook's analysis (an `Analysis`; its report.md is
`isojax.analysis.markdown`'s); `write_recipe_report` a recipe comparison (a
`RecipeComparison`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import numpy as np

from isojax import files
from isojax.analysis import plots
from isojax.analysis.fits import SIGMOID_PARAMS
from isojax.analysis.frontier import key_label
from isojax.analysis.markdown import report_markdown
from isojax.analysis.intervals import LAW_PARAMS, sweep_name
from isojax.analysis.pipeline import Analysis, GroupAnalysis, group_name
from isojax.analysis.prescriptions import n_star_key


def finite_or_none(x):
  """JSON-safe float: non-finite values become None."""
  x = float(x)
  return x if math.isfinite(x) else None


def _jsonable(x):
  """Plain JSON types; floats keep full precision (json writes repr), NaN -> null."""
  if isinstance(x, dict):
    return {str(k): _jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  if isinstance(x, np.ndarray):
    return _jsonable(x.tolist())
  if isinstance(x, (bool, np.bool_)):
    return bool(x)
  if isinstance(x, (int, np.integer)):
    return int(x)
  if isinstance(x, (float, np.floating)):
    return finite_or_none(x)
  return x


def _interval(group: GroupAnalysis, name: str):
  if group.intervals is None or name not in group.intervals.intervals:
    return None
  iv = group.intervals[name]
  return {"low": iv.low, "high": iv.high, "n_ok": iv.n_ok}


def _curves_dict(group, prefix, fits, n_runs=None) -> dict:
  out = {}
  for k, f in fits.items():
    d = f.to_dict()
    if n_runs is not None:
      d["runs"] = n_runs[k]
    d["interval"] = {p: _interval(group, f"{prefix}|curve[{key_label(k)}].{p}")
                     for p in SIGMOID_PARAMS}
    out[key_label(k)] = d
  return out


def _law_dict(group, prefix, law) -> dict | None:
  if law is None:
    return None
  d = law.to_dict()
  d["formula"] = "log2 n* = L / (1 + exp(-k (log10 C - x0))) + b"
  d["interval"] = {p: _interval(group, f"{prefix}|law.{p}") for p in LAW_PARAMS}
  return d


def _points_dict(points) -> dict | None:
  return None if points is None else dataclasses.asdict(points)


def _sweep_dict(group: GroupAnalysis, sweep) -> dict:
  name = sweep_name(sweep)
  fr = sweep.frontier
  return {
      "label": sweep.label, "metric": sweep.metric, "unit": sweep.unit,
      "primary": sweep is group.primary,
      "sigmoid_formula": "R = r0 + (a - r0) / (1 + (c_mid / C)^b)",
      "curves": _curves_dict(group, name, sweep.curves.fits, sweep.curves.n_runs),
      "skipped": {key_label(k): v for k, v in sweep.curves.skipped.items()},
      "n_star_law": _law_dict(group, name, sweep.law),
      "law_points": _points_dict(sweep.law_points),
      "frontier": None if fr is None else {
          "compute": fr.compute, "reward": fr.reward, "n_star": fr.n_star,
          "extrapolated": fr.extrapolated, "censored": fr.censored},
  }


def fits_dict(analysis: Analysis) -> dict:
  """Every fitted parameter, in full precision, with its bootstrap interval."""
  groups = {}
  for g in analysis.groups:
    fixed = [{"batch": fb.batch,
              "curves": _curves_dict(g, f"fixed[B={fb.batch}]", fb.curves.fits,
                                     fb.curves.n_runs),
              "n_star_law": _law_dict(g, f"fixed[B={fb.batch}]", fb.law),
              "law_points": _points_dict(fb.law_points),
              "frontier": {"steps": fb.frontier.compute, "n_star": fb.frontier.n_star,
                           "bp_star": fb.bp_star}}
             for fb in g.fixed_batches]
    s = g.sensitivity
    ex = g.extrapolation
    groups[group_name(g)] = {
        "runs": list(g.run_names),
        "sweeps": [_sweep_dict(g, sw) for sw in g.sweeps],
        "fixed_batch": fixed,
        "sensitivity": {"across_bp": s.across_bp, "across_n": s.across_n,
                        "spread_bp": s.spread_bp, "spread_n": s.spread_n,
                        "mean_spread_bp": s.mean_spread_bp,
                        "mean_spread_n": s.mean_spread_n},
        "extrapolation": None if ex is None else {
            f.name: getattr(ex, f.name) for f in dataclasses.fields(ex)
            if f.name not in ("predicted", "reference", "observed", "compute")},
        "prescription_law": None if g.law_choice is None else {
            "label": g.law_choice.label, "joint": g.law_choice.joint,
            "bp": g.law_choice.bp, "reason": g.law_choice.reason},
        "prescriptions": [{"budget": p.budget, "n_star": p.n_star, "law": p.law,
                           "extrapolated": p.extrapolated, "refused": p.refused,
                           "note": p.note,
                           "point": None if p.point is None else p.point.to_dict(),
                           "n_star_interval": _interval(g, n_star_key(p.budget))
                           if p.interval else None}
                          for p in g.prescriptions],
        "bootstrap": None if g.intervals is None else {
            "n_boot": g.intervals.n_boot, "n_failed": g.intervals.n_failed,
            "level": g.intervals.level, "stratified": g.intervals.stratified},
        "problems": list(g.problems),
    }
  opts = analysis.options
  return _jsonable({"metric": analysis.metric, "root": analysis.root,
                    "options": {"records": "per run", "bin_width": opts.bin_width,
                                "tie_tol": opts.tie_tol, "law_points": opts.law_points,
                                "law_window_decades": opts.law_window},
                    "groups": groups,
                    "load_problems": [str(p) for p in analysis.load_problems]})


def write_figures(analysis: Analysis, out_dir: str) -> list[str]:
  """Saves every figure as PNG under out_dir; returns the file names written."""
  written = []

  def save(fig, name):
    if fig is not None:
      fig.savefig(os.path.join(out_dir, name), dpi=120)
      written.append(name)

  for g in analysis.groups:
    tag = group_name(g)
    if g.primary is not None:
      save(plots.plot_records(g.primary.curves, title=f"{tag}, {g.primary.label}: "
                              f"record-breaking points ({g.metric})"),
           f"fig5_records_{tag}.png")
    for sw in g.sweeps:
      if sw.frontier is None:
        continue
      metric = sw.metric.split("/")[-1].replace("@", "at")
      save(plots.plot_frontier(sw, title=f"{tag}, {sw.label}: {sw.metric} vs "
                               f"{sw.unit}"),
           f"fig6_frontier_{tag}_{sw.label.replace('=', '')}_{metric}_{sw.unit}.png")
    laws = [sw for sw in g.sweeps if sw.frontier is not None and sw.metric == g.metric
            and (sw is g.primary or sw.label == "joint"
                 or (g.primary and sw.label == g.primary.label))]
    if laws:
      save(plots.plot_n_star(laws, title=f"{tag}: compute-optimal n*"),
           f"fig7_nstar_{tag}.png")
    for fb in g.fixed_batches:
      save(plots.plot_fixed_batch(fb, title=f"{tag}: fixed B = Bp·n = {fb.batch}"),
           f"fig9_fixed_batch_{tag}_B{fb.batch}.png")
    if g.sensitivity.across_bp or g.sensitivity.across_n:
      save(plots.plot_sensitivity(g.sensitivity, title=f"{tag}: sensitivity to Bp vs n"),
           f"fig10_sensitivity_{tag}.png")
    if g.pass1_runs:
      save(plots.plot_pass1_hist(g.pass1_runs), f"fig11_pass1_hist_{tag}.png")
    if g.extrapolation is not None:
      save(plots.plot_extrapolation(g.extrapolation, metric=g.metric),
           f"extrapolation_{tag}.png")
  return written


def write_report(analysis: Analysis, out_dir: str) -> dict:
  """Writes figures, fits.json and report.md into out_dir (created if needed)."""
  os.makedirs(out_dir, exist_ok=True)
  _remove_previous(out_dir)
  figures = write_figures(analysis, out_dir)
  _write(out_dir, fits_dict(analysis), report_markdown(analysis, figures))
  return {"figures": figures, "fits": "fits.json", "report": "report.md"}


# The names of the figures `write_figures` and `write_recipe_report` save.
_FIGURE_NAME = re.compile(r"(fig\d+|extrapolation|recipes)_.*\.png")


def _remove_previous(out_dir: str) -> None:
  """Deletes an earlier analysis's report.md, fits.json and figures (other files
  are left), so that one failing part way, or one drawing other groups or
  metrics, leaves nothing that looks current."""
  for name in os.listdir(out_dir):
    path = os.path.join(out_dir, name)
    if (name in ("report.md", "fits.json") or _FIGURE_NAME.fullmatch(name)) and (
        os.path.isfile(path)):
      os.remove(path)


def _write(out_dir: str, fits: dict, markdown: str) -> None:
  """fits.json, then report.md, each whole or not at all: an analysis killed or out
  of disk while writing leaves no cut file that reads as its result."""
  files.write_atomic(os.path.join(out_dir, "fits.json"),
                     json.dumps(_jsonable(fits), indent=1, allow_nan=False), fsync=False)
  files.write_atomic(os.path.join(out_dir, "report.md"), markdown, fsync=False)


def write_recipe_report(comparison, out_dir: str, *, root: str = "",
                        load_problems=()) -> dict:
  """Writes a recipe comparison into out_dir (created if needed): its figure,
  fits.json (every fitted parameter with its interval) and report.md."""
  os.makedirs(out_dir, exist_ok=True)
  _remove_previous(out_dir)
  figure = f"recipes_{comparison.unit}.png"
  plots.plot_recipes(comparison).savefig(os.path.join(out_dir, figure), dpi=120)
  problems = [f"- {p}" for p in load_problems] or ["- none"]
  markdown = "\n".join(
      ["# isojax recipe comparison", "", f"Runs: `{root}`.", "",
       comparison.to_markdown(), "## Problems found while loading", "", *problems, "",
       "## Figures", "", f"![{figure}]({figure})"]) + "\n"
  _write(out_dir, {"root": root, **comparison.to_dict(),
                   "load_problems": [str(p) for p in load_problems]}, markdown)
  return {"figures": [figure], "fits": "fits.json", "report": "report.md"}
