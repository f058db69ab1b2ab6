"""report.md for the playbook's analysis: per group of runs, the n*(C) laws, the
frontier, the per-configuration fits, prescriptions, fixed-batch and sensitivity
tables, the extrapolation check and the problems met; the procedure first.
"""

from __future__ import annotations

import math

import numpy as np

from isojax.analysis.frontier import key_label
from isojax.analysis.intervals import LAW_PARAMS, sweep_name
from isojax.analysis.pipeline import Analysis, GroupAnalysis, group_name
from isojax.analysis.prescriptions import MAX_SPREAD, n_star_key


def _g(x, digits=4):
  return "–" if x is None or (isinstance(x, float) and not math.isfinite(x)) \
      else f"{x:.{digits}g}"


def _ci(group, name, digits=3):
  """ " [low, high]" of the bootstrap interval `name`, or "" without one."""
  boot = group.intervals
  if boot is None or name not in boot.intervals or boot[name].n_ok == 0:
    return ""
  return f" [{_g(boot[name].low, digits)}, {_g(boot[name].high, digits)}]"


def _law_md(g: GroupAnalysis, sweep) -> list[str]:
  law, pts = sweep.law, sweep.law_points
  if law is None:
    return []
  out = [f"### n*(C) law ({sweep.label}, {sweep.metric}, C in {sweep.unit})", "",
         "log2 n* = L / (1 + exp(-k (log10 C - x0))) + b", "",
         "| param | value | interval |", "|---|---|---|"]
  for name in LAW_PARAMS:
    out.append(f"| {name} | {getattr(law, name):.6g} |"
               f"{_ci(g, f'{sweep_name(sweep)}|law.{name}', 4)} |")
  how = ("the running average of log2 n* over "
         f"{pts.window_decades:g} decades of C (Fig. 7)" if pts.method == "running_average"
         else "the compute at which the frontier enters each higher reward bin "
         "(Fig. 15)")
  return out + ["", f"Fitted to {pts.compute.size} frontier points: {how}. Fit rms "
                f"{law.rms:.4f} (log2 n units), R² {_g(law.r2)}; C in "
                f"[{law.compute_range[0]:.3g}, {law.compute_range[1]:.3g}]."
                + (f" Flags: {'; '.join(law.flags)}." if law.flags else ""), ""]


def _group_md(g: GroupAnalysis) -> list[str]:
  out = [f"## {group_name(g)} ({len(g.run_names)} runs)", ""]
  p = g.primary
  if p is None:
    return out + ["No curve could be fitted.", ""] + _problems_md(g)
  if g.intervals is not None:
    out += _intervals_md(g)
  laws = [p] + [s for s in g.sweeps if g.law_choice is not None and s is not p
                and s.label == g.law_choice.label and s.metric == g.metric
                and s.unit == "rollouts"]
  for sweep in laws:
    out += _law_md(g, sweep)
  if p.frontier is not None:
    out += _frontier_md(g, p) + _curves_md(g, p)
  if g.prescriptions:
    out += _prescriptions_md(g)
  if g.fixed_batches:
    out += _fixed_batch_md(g)
  if g.sensitivity.across_bp or g.sensitivity.across_n:
    out += _sensitivity_md(g.sensitivity)
  if g.extrapolation is not None:
    out += _extrapolation_md(g.extrapolation)
  return out + _problems_md(g)


def _problems_md(g: GroupAnalysis) -> list[str]:
  if not g.problems:
    return []
  return ["### Problems found in the analysis", ""] + [f"- {q}" for q in g.problems] + [""]


def _intervals_md(g: GroupAnalysis) -> list[str]:
  level = f"{100 * g.intervals.level:.0f}%"
  return [f"Intervals: {level}, from resampling whole runs within each configuration "
          f"({g.intervals.n_boot} resamples of k - 1 of a configuration's k runs, "
          f"{g.intervals.n_failed} failed; t quantiles on k - 1 degrees of freedom). "
          f"They cover seed-to-seed variation, not the upward bias of record points "
          f"under evaluation noise.", ""]


def _frontier_md(g: GroupAnalysis, p) -> list[str]:
  """The primary frontier at 9 points of compute, beside its siblings' n*."""
  fr, unit = p.frontier, p.unit
  siblings = [s for s in g.sweeps if s.label == p.label and s is not p
              and s.frontier is not None and s.unit == unit]
  averaged = p.law_points is not None and p.law_points.method == "running_average"
  header = (["C", f"frontier {g.metric}", "n*"] + ["n* running avg"] * averaged
            + [f"n* ({s.metric})" for s in siblings])
  out = [f"### Frontier ({p.label}, {unit})", "",
         "| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
  for i in np.unique(np.linspace(0, fr.compute.size - 1, 9).round().astype(int)):
    cols = [f"{fr.compute[i]:.3g}", f"{fr.reward[i]:.4f}",
            str(fr.n_star[i]) + (" (censored)" if fr.censored[i] else "")]
    if averaged:
      j = np.flatnonzero(p.law_points.compute == fr.compute[i])
      cols.append(f"{p.law_points.n_star[j[0]]:.3g}" if j.size else "–")
    for s in siblings:
      j = int(np.argmin(np.abs(np.log(s.frontier.compute / fr.compute[i]))))
      cols.append(str(s.frontier.n_star[j]) if s.frontier.defined[j] else "–")
    out.append("| " + " | ".join(cols) + " |")
  return out


def _curves_md(g: GroupAnalysis, p) -> list[str]:
  out = ["", "Per-configuration sigmoids R = R0 + (A − R0)/(1 + (C_mid/C)^B):", "",
         "| config | runs | A | B | C_mid | R0 | rms | R² | flags |",
         "|---|---|---|---|---|---|---|---|---|"]
  for k, f in p.curves.fits.items():
    out.append(f"| {key_label(k)} | {p.curves.n_runs[k]} | {f.a:.4f}"
               f"{_ci(g, f'{sweep_name(p)}|curve[{key_label(k)}].a')} | "
               f"{f.b:.3f} | {f.c_mid:.4g} | "
               f"{f.r0:.4f} | {f.rms:.4f} | {_g(f.r2)} | {'; '.join(f.flags)} |")
  out.append("")
  return out


def _prescriptions_md(g: GroupAnalysis) -> list[str]:
  out = ["### Prescriptions", "", f"From {g.law_choice.reason}.", "",
         "| budget C | n* (law) | n | Bp | M | C used | note |",
         "|---|---|---|---|---|---|---|"]
  for pr in g.prescriptions:
    note = "; ".join(x for x in ("extrapolated outside the data"
                                 if pr.extrapolated else "", pr.note) if x)
    pt = pr.point
    cells = ([str(pt.n), str(pt.bp), str(pt.m), str(pt.compute)] if pt else
             ["–"] * 4)
    out.append(f"| {pr.budget:.3g} | {pr.n_star:.3g}"
               f"{_ci(g, n_star_key(pr.budget)) if pr.interval else ''} | "
               + " | ".join(cells)
               + f" | {note} |")
  return out + ["", "n is the n of the study nearest to n* (in log2); "
                "M = floor(C / (Bp·n)). A prescription whose n* interval spans more than a factor of "
                f"{MAX_SPREAD:g} is refused, and so is an extrapolation without an "
                "interval or with n* at the largest n tried.", ""]


def _fixed_batch_md(g: GroupAnalysis) -> list[str]:
  out = ["### Fixed batch B = Bp·n (n*(M), Bp*(M))", ""]
  for fb in g.fixed_batches:
    m, n = fb.frontier.n_star_points()
    idx = np.unique(np.linspace(0, m.size - 1, 5).round().astype(int))
    pts = ", ".join(f"M={m[i]:.3g}: n*={int(n[i])}, Bp*={fb.batch // int(n[i])}"
                    for i in idx)
    law_s = (f"; law L={fb.law.L:.4g}, k={fb.law.k:.4g}, x0={fb.law.x0:.4g}, "
             f"b={fb.law.b:.4g}" if fb.law else f"; no law ({fb.problem})")
    out.append(f"- B={fb.batch}: {pts}{law_s}")
  out.append("")
  return out


def _sensitivity_md(s) -> list[str]:
  def line(what, spreads, mean, name):
    if not spreads:
      return f"- across {what}: no comparison (needs >= 2 values)"
    per = ", ".join(f"{name}={k}: {100 * v:.2f}" for k, v in spreads.items())
    return f"- across {what}: mean range {100 * mean:.2f} points ({per})"

  return ["### Sensitivity (reward range at matched compute)", "",
          line("Bp at fixed n", s.spread_bp, s.mean_spread_bp, "n"),
          line("n at fixed Bp", s.spread_n, s.mean_spread_n, "Bp"), ""]


def _extrapolation_md(ex) -> list[str]:
  return ["### Extrapolation check", "",
          f"Curves fitted on C ≤ {ex.c_cut:.3g} predict the frontier beyond it with "
          f"RMSE {ex.frontier_rmse:.4f} (max {ex.frontier_max_error:.4f}) against the "
          f"all-data frontier; same n* at {100 * ex.n_star_agreement:.0f}% of the "
          f"grid; RMSE {ex.heldout_rmse:.4f} on {ex.n_heldout} held-out record "
          f"points." + (f" Not fittable below the cut: "
                        f"{', '.join(key_label(k) for k in ex.lost)}." if ex.lost else "")
          + (f" Cut fits at a bound (their extrapolation is unreliable): "
             f"{', '.join(key_label(k) for k in ex.flagged)}." if ex.flagged else ""),
          ""]


def _procedure_md(analysis: Analysis) -> str:
  o = analysis.options
  tie = ("the upper envelope of the fitted curves (tie tolerance 0)" if o.tie_tol == 0
         else f"the fitted curves' envelope with tie tolerance {o.tie_tol:g} (curves "
         f"within {o.tie_tol:g} of the best count as tied; the smallest n wins)")
  law = (f"the running average of n* over {o.law_window:g} decades (Fig. 7)"
         if o.law_points == "running_average" else
         "the compute where the frontier enters each higher reward bin (Fig. 15)")
  return (f"Procedure: record-breaking points per run (reward bin {o.bin_width:g}, the "
          f"base model's evaluation counted as observed); one sigmoid per configuration "
          f"on the union of its runs' records (R0 = the base model's reward when four "
          f"are too few to fit it), held at its last evaluation's value beyond it; "
          f"frontier = {tie}; n*(C) law fitted to {law}.")


def report_markdown(analysis: Analysis, figures=()) -> str:
  lines = ["# isojax analysis report", "",
           f"Runs: `{analysis.root}`. Metric: `{analysis.metric}`. Compute in rollouts "
           f"unless stated (C = Bp·n·M).", "", _procedure_md(analysis), ""]
  for g in analysis.groups:
    lines += _group_md(g)
  lines += ["## Problems found while loading", ""]
  lines += [f"- {p}" for p in analysis.load_problems] or ["- none"]
  if figures:
    lines += ["", "## Figures", ""] + [f"![{f}]({f})" for f in figures]
  return "\n".join(lines) + "\n"
