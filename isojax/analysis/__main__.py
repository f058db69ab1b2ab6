"""isojax-analyze: from a directory of runs to figures, fits.json and report.md.

    python -m isojax.analysis RUNS_DIR --out REPORT_DIR [--metric val/avg@4]
        [--bin-width 0.005] [--tie-tol 0] [--law-points running_average|bins]
        [--law-window 0.5] [--n-boot 100] [--seed 0] [--budgets 1e5,1e6] [--bp 32]
    python -m isojax.analysis RUNS_DIR --out REPORT_DIR --compare-recipes
        [--unit rollouts|tokens|steps|device_hours] [--group-by recipe]
        [--fit-fraction 0.5] [--tolerance 0.02] [--metric ...] [--n-boot 100]
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
from collections.abc import Callable

import matplotlib

from isojax.analysis import law_points, pipeline, recipes, report
from isojax.analysis.runs import UNITS, eval_metrics, read_runs


# argparse prefixes these types' messages with the flag ("argument --bp: ..."), so a
# bad value stops at parsing (exit 2) rather than failing later per row of the report.
def _budgets(text: str) -> list[float]:
  try:
    values = [float(x) for x in text.split(",") if x.strip()]
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from None
  if not values or not all(math.isfinite(v) and v > 0 for v in values):
    raise argparse.ArgumentTypeError(
        f"must be finite positive numbers, comma-separated; got {text!r}")
  return values


def _int_at_least(low: int) -> Callable[[str], int]:
  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < low:
      raise argparse.ArgumentTypeError(f"must be >= {low}, got {text!r}")
    return value

  return parse


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="isojax-analyze", description=__doc__.splitlines()[0])
  p.add_argument("runs_dir", help="directory holding run directories (searched recursively)")
  p.add_argument("--out", required=True, help="report directory to write")
  p.add_argument("--metric", default=None,
                 help="validation metric to optimise (default: val/avg@4, else avg@k); "
                 "a run's further validation set NAME logs val/NAME/avg@4 etc.")
  p.add_argument("--bin-width", type=float, default=0.005,
                 help="reward bin of the record-breaking extraction (per run)")
  p.add_argument("--tie-tol", type=float, default=0.0,
                 help="curves within this of the best count as tied and the smallest n "
                 "wins (default 0: the upper envelope, as the paper)")
  p.add_argument("--law-points", choices=sorted(law_points.METHODS),
                 default=law_points.DEFAULT_METHOD,
                 help="frontier points the n*(C) law is fitted to: the running average "
                 "of n* (Fig. 7, default) or the compute where the frontier enters each "
                 "higher reward bin (Fig. 15)")
  p.add_argument("--law-window", type=float, default=law_points.DEFAULT_WINDOW_DECADES,
                 help="running-average window in decades of compute")
  p.add_argument("--n-boot", type=_int_at_least(0), default=100,
                 help="bootstrap resamples of whole runs (0: no intervals)")
  p.add_argument("--seed", type=int, default=0, help="bootstrap seed")
  p.add_argument("--budgets", type=_budgets, default=None,
                 help="comma-separated rollout budgets to prescribe for")
  p.add_argument("--bp", type=_int_at_least(1), default=None,
                 help="Bp for prescriptions (default: the sweep's Bp)")
  r = p.add_argument_group(
      "recipe comparison (ScaleRL)",
      "--compare-recipes writes the recipe comparison instead of the frontier analysis: "
      "the frontier treats runs that share (difficulty, Bp, n) as seeds of one "
      "configuration, which runs of different recipes are not")
  r.add_argument("--compare-recipes", action="store_true",
                 help="fit one sigmoid per recipe: (A, B, C_mid) with intervals and the "
                 "extrapolation test, into report.md, fits.json and a figure")
  r.add_argument("--unit", choices=UNITS, default=None,
                 help="compute axis of the comparison (default rollouts; device_hours "
                 "needs runs that log it)")
  r.add_argument("--group-by", default=None,
                 help="dotted config field naming each run's recipe (default: "
                 f"{' or '.join(recipes.NAME_FIELDS)} when every run has it, else the "
                 "config fields that differ between runs)")
  r.add_argument("--fit-fraction", type=float, default=0.5,
                 help="the extrapolation test fits each recipe on this fraction of its "
                 "compute (0: no test)")
  r.add_argument("--tolerance", type=float, default=0.02,
                 help="the test passes when the final reward is predicted within this")
  args = p.parse_args(argv)
  given = [f"--{a.replace('_', '-')}" for a in (_RECIPE_ONLY if not args.compare_recipes
                                                 else _FRONTIER_ONLY)
           if getattr(args, a) != p.get_default(a)]
  if given:
    p.error(f"{', '.join(given)}: " + ("frontier options, not used with --compare-recipes"
                                       if args.compare_recipes else
                                       "only used with --compare-recipes"))
  return args


_RECIPE_ONLY = ("unit", "group_by", "fit_fraction", "tolerance")
_FRONTIER_ONLY = ("tie_tol", "law_points", "law_window", "budgets", "bp")


def _analyze(args, loaded) -> Callable[[str], dict]:
  """Analyses the runs as asked; returns the report's writer (out_dir -> files).

  Raises:
    ValueError: when nothing can be analysed or an option is out of range.
  """
  runs = list(loaded.runs)
  logged = set(eval_metrics(runs))
  if args.metric and args.metric not in logged:
    # A named validation set logs val/NAME/avg@k; list what the runs hold.
    raise ValueError(f"--metric {args.metric!r} is logged by none of the runs; they "
                     f"log {sorted(logged)}")
  if args.compare_recipes:
    comparison = recipes.compare_recipes(
        runs, metric=args.metric, unit=args.unit or "rollouts", group_by=args.group_by,
        fit_fraction=args.fit_fraction or None, tolerance=args.tolerance,
        bin_width=args.bin_width, n_boot=args.n_boot, seed=args.seed)
    return functools.partial(report.write_recipe_report, comparison,
                             root=args.runs_dir, load_problems=loaded.problems)
  analysis = pipeline.analyze(
      runs, root=args.runs_dir, metric=args.metric, bin_width=args.bin_width,
      tie_tol=args.tie_tol, law_points=args.law_points, law_window=args.law_window,
      n_boot=args.n_boot, seed=args.seed, budgets=args.budgets, bp=args.bp,
      load_problems=loaded.problems)
  return functools.partial(report.write_report, analysis)


def main(argv=None) -> int:
  """Console entry point; returns the exit status (0 ok; 1 nothing analysable, a bad
  option, or an --out that cannot hold the report)."""
  if "matplotlib.pyplot" not in sys.modules:  # never switch a notebook's backend
    matplotlib.use("Agg")  # figures are only written to files here
  args = parse_args(argv)
  if os.path.exists(args.out) and not os.path.isdir(args.out):
    print(f"isojax-analyze: --out {args.out!r} is an existing file, not a directory; "
          f"name a directory for the report", file=sys.stderr)
    return 1
  try:
    loaded = read_runs(args.runs_dir)
  except ValueError as e:
    print(f"isojax-analyze: {e}", file=sys.stderr)
    return 1
  for problem in loaded.problems:
    print(f"warning: {problem}", file=sys.stderr)
  try:
    write = _analyze(args, loaded)
  except ValueError as e:
    print(f"isojax-analyze: {e}", file=sys.stderr)
    return 1
  try:
    written = write(args.out)
  except OSError as e:  # e.g. a file where a parent directory of --out should be
    print(f"isojax-analyze: cannot write the report to {args.out!r}: {e}",
          file=sys.stderr)
    return 1
  print(f"wrote {args.out}/report.md, fits.json and {len(written['figures'])} figures "
        f"from {len(loaded.runs)} runs ({len(loaded.problems)} loading problems)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
