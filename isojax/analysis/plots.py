"""Figures of the IsoCompute playbook (Figs. 5, 6, 7, 9, 10, 11, 24) and of ScaleRL's
recipe comparison, from analysis data.

Every function returns a `matplotlib.figure.Figure` built without pyplot: no global
figure state, nothing to close, rendered by the Agg canvas when saved, and shown inline
by Jupyter when it is the value of a cell.
"""

from __future__ import annotations

import math

import numpy as np
from matplotlib import colormaps, colors, ticker
from matplotlib.figure import Figure

from isojax.analysis.frontier import key_label, key_n
from isojax.analysis.runs import pass1_histogram

_UNIT_LABEL = {"rollouts": "compute C (rollouts)", "tokens": "compute C (generated tokens)",
               "steps": "updates M (steps)", "device_hours": "compute C (device-hours)"}
_FRONTIER_LW = 4.0


def _figure(ncols: int, nrows: int = 1, width: float = 5.2, height: float = 4.0):
  fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained")
  axes = fig.subplots(nrows, ncols, squeeze=False)
  return fig, axes


def n_colors(ns) -> dict:
  """A colour per n, ordered along viridis by log2 n (same n, same colour everywhere)."""
  ns = sorted({int(n) for n in ns})
  cmap = colormaps["viridis"]
  if len(ns) == 1:
    return {ns[0]: cmap(0.35)}
  lo, hi = math.log2(ns[0]), math.log2(ns[-1])
  return {n: cmap(0.9 * (math.log2(n) - lo) / (hi - lo)) for n in ns}


def _compact(v: float) -> str:
  if v <= 0:
    return "0"
  e = math.floor(math.log10(v) + 1e-9)
  if -2 <= e <= 3:
    return f"{v:g}"
  mantissa = v / 10**e
  return f"{mantissa:.2g}e{e}" if abs(mantissa - 1) > 1e-9 else f"1e{e}"


def _log_x(ax, values):
  """A log10 x axis. Over less than ~1.5 decades the 2x and 5x ticks are labelled
  (compactly), else only the decades: long minor labels must not collide.

  Without a finite positive value the axis stays linear: there is nothing to place on
  a log scale, and matplotlib fails to draw one with no positive limits."""
  v = np.asarray([x for x in np.ravel(values) if np.isfinite(x) and x > 0])
  if not v.size:
    return
  ax.set_xscale("log")
  if v.max() / v.min() < 30:
    ax.xaxis.set_minor_locator(ticker.LogLocator(subs=(2.0, 5.0)))
    ax.xaxis.set_minor_formatter(ticker.FuncFormatter(lambda x, _: _compact(x)))
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda x, _: _compact(x)))
  else:
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())


def _log2_axis(ax, values, axis="y"):
  """A log2 axis with ticks at the powers of two spanned by `values`."""
  values = np.asarray([v for v in values if v > 0 and math.isfinite(v)])
  lo = 2 ** math.floor(math.log2(values.min())) if values.size else 1
  hi = 2 ** math.ceil(math.log2(values.max())) if values.size else 2
  setter = ax.set_yscale if axis == "y" else ax.set_xscale
  setter("log", base=2)
  ticks = [2**e for e in range(int(math.log2(lo)), int(math.log2(hi)) + 1)]
  target = ax.yaxis if axis == "y" else ax.xaxis
  target.set_major_locator(ticker.FixedLocator(ticks))
  target.set_major_formatter(ticker.FixedFormatter([str(t) for t in ticks]))
  target.set_minor_locator(ticker.NullLocator())
  (ax.set_ylim if axis == "y" else ax.set_xlim)(lo / 1.3, hi * 1.3)


def plot_records(curves, *, title: str = "", max_panels: int = 12) -> Figure:
  """Fig. 5 / 15: evaluations (grey), record-breaking points (orange), fitted curve."""
  keys = sorted(curves.points)[:max_panels]
  ncols = min(4, max(1, len(keys)))
  nrows = max(1, math.ceil(len(keys) / ncols))
  fig, axes = _figure(ncols, nrows, width=3.6, height=3.0)
  for ax in axes.flat[len(keys):]:
    ax.set_visible(False)
  for ax, k in zip(axes.flat, keys):
    c, r = curves.points[k]
    if not c.size:  # e.g. a run still going, evaluated only at step 0 so far
      ax.text(0.5, 0.5, f"{key_label(k)}\nno evaluation at {curves.unit} > 0",
              ha="center", va="center", transform=ax.transAxes, fontsize=9)
      ax.set_axis_off()
      continue
    ax.scatter(c, r, s=9, color="0.65", label="evaluations")
    rc, rr = curves.records[k]
    ax.scatter(rc, rr, s=18, color="tab:orange", zorder=3, label="record-breaking")
    fit = curves.fits.get(k)
    if fit is not None:
      g = np.geomspace(*fit.compute_range, 200)
      ax.plot(g, fit.predict(g), "--", color="k", lw=1.2, label="sigmoid fit")
      ax.set_title(f"{key_label(k)}  (A={fit.a:.3f}, B={fit.b:.2f})", fontsize=9)
    else:
      ax.set_title(f"{key_label(k)}  (not fitted)", fontsize=9)
    _log_x(ax, c)
    ax.set_xlabel(_UNIT_LABEL[curves.unit], fontsize=8)
    ax.set_ylabel(curves.metric, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3, which="both", lw=0.4)
  drawn = [ax for ax, k in zip(axes.flat, keys) if curves.points[k][0].size]
  if drawn:
    drawn[0].legend(fontsize=7, loc="upper left")
  fig.suptitle(title or f"Record-breaking points, bin {curves.bin_width:g}")
  return fig


def _frontier_segments(ax, fr, palette):
  """The envelope drawn as thick segments coloured by the n attaining them."""
  i = 0
  w = fr.winner
  while i < w.size:
    if w[i] < 0:
      i += 1
      continue
    j = i
    while j + 1 < w.size and w[j + 1] == w[i]:
      j += 1
    stop = min(j + 2, w.size)  # overlap one point so segments join
    seg = slice(i, stop)
    ax.plot(fr.compute[seg], fr.reward[seg], color=palette[fr.n_star[i]],
            lw=_FRONTIER_LW, solid_capstyle="butt", zorder=4)
    if fr.extrapolated[i:j + 1].any():
      ax.plot(fr.compute[i:j + 1][fr.extrapolated[i:j + 1]],
              fr.reward[i:j + 1][fr.extrapolated[i:j + 1]], ":", color="w", lw=1.5,
              zorder=5)
    i = j + 1


def _shade_censored(ax, fr):
  """Grey bands where n* is censored: the winner there wins only because another
  configuration's runs ended early, so the colour of the envelope is not a finding."""
  c = fr.compute
  edges = np.flatnonzero(np.diff(np.concatenate([[0], fr.censored.astype(np.int8), [0]])))
  for k, (i, j) in enumerate(zip(edges[::2], edges[1::2] - 1)):
    # Out to the geometric midpoints with the neighbours: one point is a band too.
    lo, hi = np.sqrt(c[max(i - 1, 0)] * c[i]), np.sqrt(c[j] * c[min(j + 1, c.size - 1)])
    ax.axvspan(lo, hi, color="0.5", alpha=0.15, lw=0, zorder=1,
               label="n* censored (a run ended early)" if k == 0 else None)


def plot_frontier(sweep, *, title: str = "") -> Figure:
  """Fig. 6: reward vs compute per configuration, envelope coloured by n*; grey
  bands where n* is censored (`Frontier.censored`)."""
  fig, axes = _figure(1, width=7.0, height=4.6)
  ax = axes[0, 0]
  curves, fr = sweep.curves, sweep.frontier
  palette = n_colors(key_n(k) for k in curves.points)
  bps = sorted({k[0] for k in curves.points if isinstance(k, tuple)})
  styles = dict(zip(bps, ["-", "--", "-.", ":"] * 8))
  for k in sorted(curves.points):
    col = palette[key_n(k)]
    c, r = curves.points[k]
    ax.scatter(c, r, s=6, color=col, alpha=0.35, lw=0)
    fit = curves.fits.get(k)
    if fit is not None:
      g = np.geomspace(*fit.compute_range, 200)
      ax.plot(g, fit.predict(g), styles.get(k[0], "-") if isinstance(k, tuple)
              else "-", color=col, lw=1.2, label=key_label(k))
  if fr is not None:
    _frontier_segments(ax, fr, palette)
    _shade_censored(ax, fr)
    ax.plot([], [], color="0.3", lw=_FRONTIER_LW, label="frontier (colour = n*)")
  _log_x(ax, [x for c, _ in curves.points.values() for x in c])
  ax.set_xlabel(_UNIT_LABEL[sweep.unit])
  ax.set_ylabel(f"validation reward ({sweep.metric})")
  ax.grid(alpha=0.3, which="both", lw=0.4)
  ax.legend(fontsize=8, loc="upper left", ncol=2 if len(curves.points) > 6 else 1)
  ax.set_title(title or f"{sweep.label}: {sweep.metric} vs compute")
  return fig


def _law_text(law, var: str = "C") -> str:
  return (f"log2 n* = L/(1+exp(-k(log10 {var} - x0))) + b\n"
          f"L={law.L:.3g}  k={law.k:.3g}  x0={law.x0:.3g}  b={law.b:.3g}\n"
          f"rms {law.rms:.3f} (log2 units)")


def plot_n_star(sweeps, *, title: str = "") -> Figure:
  """Fig. 7 / 24: the frontier's n*(C) (grey), the points the law is fitted to
  (coloured by frontier reward) and the fitted sigmoid law.

  One panel per sweep, e.g. compute in rollouts and in tokens side by side."""
  sweeps = [s for s in sweeps if s.frontier is not None]
  fig, axes = _figure(max(1, len(sweeps)), width=5.6, height=4.2)
  for ax, s in zip(axes.flat, sweeps):
    c, n = s.frontier.n_star_points()
    ax.plot(c, n, color="0.6", lw=1, drawstyle="steps-post", label="frontier n*(C)")
    ns = list(n)
    pts = s.law_points
    if pts is not None:
      ns += list(pts.n_star)
      norm = colors.Normalize(np.nanmin(pts.reward), np.nanmax(pts.reward))
      sc = ax.scatter(pts.compute, pts.n_star, c=pts.reward, cmap="plasma", norm=norm,
                      s=14, zorder=3, label=("running average" if pts.method ==
                                             "running_average" else "per-bin points"))
      fig.colorbar(sc, ax=ax, label=f"frontier reward ({s.metric})", shrink=0.85)
    if s.law is not None:
      g = np.geomspace(c.min(), c.max(), 300)
      pred = s.law.predict(g)
      ns += list(pred)
      ax.plot(g, pred, color="red", lw=2, label="sigmoid fit")
      ax.text(0.02, 0.97, _law_text(s.law, "C"), transform=ax.transAxes,
              fontsize=7.5, va="top", family="monospace",
              bbox=dict(boxstyle="round", fc="w", ec="0.7", alpha=0.9))
    _log_x(ax, c)
    _log2_axis(ax, ns)
    ax.set_xlabel(_UNIT_LABEL[s.unit])
    ax.set_ylabel("compute-optimal n*")
    ax.grid(alpha=0.3, which="both", lw=0.4)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(f"{s.label}: n*({'tokens' if s.unit == 'tokens' else 'C'}), "
                 f"{s.metric}", fontsize=10)
  if title:
    fig.suptitle(title)
  return fig


def plot_fixed_batch(fb, *, title: str = "") -> Figure:
  """Fig. 9: under Bp * n = B, the compute-optimal n*(M) and Bp*(M)."""
  fig, axes = _figure(2, width=5.0, height=3.9)
  m, n = fb.frontier.n_star_points()
  bp = fb.batch / n
  g = np.geomspace(m.min(), m.max(), 300) if m.size else m
  for ax, vals, name, col in ((axes[0, 0], n, "n*", "tab:blue"),
                              (axes[0, 1], bp, "Bp*", "tab:green")):
    ax.scatter(m, vals, s=12, color=col, label=f"frontier {name}(M)", zorder=3)
    curve = []
    if fb.law is not None and m.size:
      curve = (fb.law.predict(g) if name == "n*"
               else np.exp2(fb.predict_bp_log2(g)))
      ax.plot(g, curve, color="red", lw=2, label="sigmoid fit")
    _log_x(ax, m)
    _log2_axis(ax, list(vals) + list(curve))
    ax.set_xlabel(_UNIT_LABEL["steps"])
    ax.set_ylabel(f"compute-optimal {name}")
    ax.grid(alpha=0.3, which="both", lw=0.4)
    ax.legend(fontsize=8)
  fig.suptitle(title or f"Fixed batch B = Bp·n = {fb.batch}: allocation vs updates M")
  return fig


def _bars(ax, table: dict, fixed: str, varied: str, metric: str):
  groups = sorted(table)
  varied_vals = sorted({v for row in table.values() for v in row})
  palette = n_colors(varied_vals) if varied == "n" else dict(
      zip(varied_vals, colormaps["Oranges"](np.linspace(0.35, 0.9, len(varied_vals)))))
  width = 0.8 / max(1, len(varied_vals))
  lo = min(x for row in table.values() for x in row.values())
  hi = max(x for row in table.values() for x in row.values())
  for j, v in enumerate(varied_vals):
    xs = [i + (j - (len(varied_vals) - 1) / 2) * width for i, g in enumerate(groups)
          if v in table[g]]
    ys = [table[g][v] for g in groups if v in table[g]]
    ax.bar(xs, ys, width=width, color=palette[v], label=f"{varied}={v}")
  ax.set_xticks(range(len(groups)), [f"{fixed}={g}" for g in groups])
  pad = max(0.01, 0.25 * (hi - lo))
  ax.set_ylim(max(0.0, lo - pad), hi + pad)
  ax.set_ylabel(f"reward at matched compute ({metric})")
  ax.legend(fontsize=7, ncol=2)
  ax.grid(alpha=0.3, axis="y", lw=0.4)


def plot_sensitivity(sens, *, title: str = "") -> Figure:
  """Fig. 10: reward across Bp at fixed n vs across n at fixed Bp, with the spreads."""
  fig, axes = _figure(2, width=5.2, height=3.9)
  for ax, table, fixed, varied, spread in (
          (axes[0, 0], sens.across_bp, "n", "Bp", sens.mean_spread_bp),
          (axes[0, 1], sens.across_n, "Bp", "n", sens.mean_spread_n)):
    if table:
      _bars(ax, table, fixed, varied, sens.metric)
      ax.set_title(f"varying {varied} at fixed {fixed}: mean range "
                   f"{100 * spread:.1f} points", fontsize=10)
    else:
      ax.text(0.5, 0.5, f"no {fixed} value was run at two or more {varied}",
              ha="center", va="center", transform=ax.transAxes)
      ax.set_axis_off()
  fig.suptitle(title or "Sensitivity of validation reward to Bp vs n")
  return fig


def _hist_rows(run):
  return [row for row in run.rows if pass1_histogram(row) is not None]


def pass1_pair(runs):
  """The smallest-n and largest-n runs (same Bp when possible) that logged pass@1
  histograms, and the compute both reached; None if no run logged one."""
  runs = [r for r in runs if _hist_rows(r)]
  if not runs:
    return None
  by_bp: dict = {}
  for r in runs:
    by_bp.setdefault(r.bp, []).append(r)
  pool = max(by_bp.values(), key=lambda rs: (len({r.n for r in rs}), -rs[0].bp))
  lo = min(pool, key=lambda r: (r.n, r.name))
  hi = max(pool, key=lambda r: (r.n, r.name))
  chosen = [lo] if lo is hi else [lo, hi]
  common = min(max(float(row.get("rollouts", 0)) for row in _hist_rows(r))
               for r in chosen)
  return chosen, common


def _hist_at(run, compute):
  rows = [row for row in _hist_rows(run)
          if float(row.get("rollouts", math.inf)) <= compute * (1 + 1e-9)]
  return rows[-1] if rows else None


def plot_pass1_hist(runs, *, title: str = "") -> Figure | None:
  """Fig. 11: training pass@1 distributions of small vs large n at matched compute."""
  pair = pass1_pair(runs)
  if pair is None:
    return None
  chosen, common = pair
  fig, axes = _figure(1, width=6.4, height=4.0)
  ax = axes[0, 0]
  palette = n_colors(r.n for r in chosen)
  width = 0.8 / len(chosen)
  for j, run in enumerate(chosen):
    row = _hist_at(run, common)
    if row is None:
      continue
    frac = pass1_histogram(row)
    edges = np.linspace(0, 1, frac.size + 1)
    centers = (edges[:-1] + edges[1:]) / 2
    zero = row.get("train/zero_pass_frac")
    label = f"n={run.n} (Bp={run.bp})" + (f", zero-pass {100 * zero:.1f}%"
                                          if isinstance(zero, (int, float)) else "")
    ax.bar(centers + (j - (len(chosen) - 1) / 2) * width / frac.size, frac,
           width=width / frac.size, color=palette[run.n], label=label)
  ax.set_xlabel("training pass@1 per problem")
  ax.set_ylabel("fraction of problems")
  ax.set_xlim(0, 1)
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3, axis="y", lw=0.4)
  ax.set_title(title or f"pass@1 distribution at matched compute C = {common:.3g} rollouts",
               fontsize=10)
  return fig


def plot_extrapolation(check, *, metric: str = "", unit: str = "rollouts") -> Figure:
  """Frontier predicted from fits on C <= C_cut against the full-data frontier."""
  fig, axes = _figure(1, width=6.4, height=4.2)
  ax = axes[0, 0]
  ax.plot(check.compute, check.reference, color="k", lw=2, label="fit on all data")
  ax.plot(check.compute, check.predicted, "--", color="tab:red", lw=2,
          label=f"fit on C ≤ {check.c_cut:.3g} (extrapolated)")
  ax.plot(check.compute, check.observed, color="0.6", lw=1, drawstyle="steps-post",
          label="best observed so far")
  ax.axvline(check.c_cut, color="0.4", ls=":", lw=1)
  _log_x(ax, check.compute)
  ax.set_xlabel(_UNIT_LABEL[unit])
  ax.set_ylabel(f"frontier reward ({metric})" if metric else "frontier reward")
  ax.grid(alpha=0.3, which="both", lw=0.4)
  ax.legend(fontsize=8, loc="lower right")
  ax.set_title(f"Extrapolation check: RMSE {check.frontier_rmse:.4f}, "
               f"max error {check.frontier_max_error:.4f}", fontsize=10)
  return fig


def plot_recipes(comparison, *, title: str = "") -> Figure:
  """Reward vs compute per recipe: evaluations, the fitted sigmoid, and where the
  extrapolation test ran, its region (shaded), the fit on the first part of the
  compute (dashed) and the final observed reward with the test's tolerance."""
  fig, axes = _figure(1, width=7.0, height=4.6)
  ax = axes[0, 0]
  palette = colormaps["tab10"]
  xs = []
  for i, rf in enumerate(comparison.recipes):
    col = palette(i % 10)
    c, r = comparison.curves.points.get(rf.label, (np.zeros(0), np.zeros(0)))
    xs += list(c)
    ax.scatter(c, r, s=6, color=col, alpha=0.35, lw=0)
    fit = rf.fit
    label = rf.label if fit is None else f"{rf.label}: A={fit.a:.3f}, B={fit.b:.2f}"
    if fit is not None:
      g = np.geomspace(*fit.compute_range, 200)
      ax.plot(g, fit.predict(g), color=col, lw=1.4, label=label)
    ex = rf.extrapolation
    if ex is not None and ex.fit is not None:
      ax.axvspan(ex.c_cut, ex.compute, color=col, alpha=0.07, lw=0)
      g = np.geomspace(ex.fit.compute_range[0], ex.compute, 200)
      ax.plot(g, ex.fit.predict(g), "--", color=col, lw=1.2)
      ax.errorbar([ex.compute], [ex.observed], yerr=ex.tolerance, fmt="o", ms=4,
                  color=col, capsize=3, zorder=4)
  if comparison.fit_fraction is not None:
    ax.plot([], [], "--", color="0.3", label=f"fit on the first "
            f"{100 * comparison.fit_fraction:g}% (shaded: extrapolated)")
    ax.errorbar([], [], yerr=[], fmt="o", color="0.3", capsize=3,
                label=f"final reward ± {comparison.tolerance:g}")
  _log_x(ax, xs)
  ax.set_xlabel(_UNIT_LABEL[comparison.unit])
  ax.set_ylabel(f"validation reward ({comparison.metric})")
  ax.grid(alpha=0.3, which="both", lw=0.4)
  ax.legend(fontsize=8, loc="upper left")
  ax.set_title(title or f"Recipes: {comparison.metric} vs compute")
  return fig
