"""Analysis of IsoCompute sweeps: from run directories to compute-optimal prescriptions.

Imports only NumPy, SciPy and Matplotlib (never JAX), so a notebook can analyse run
directories copied from a cluster:

    from isojax.analysis import load_runs, fit_curves, frontier, fit_law, plan
    runs = load_runs("runs/easy_bp32")
    curves = fit_curves(runs, metric="val/avg@4")  # records per run, a sigmoid per n
    fr = frontier(curves.fits)                      # upper envelope and n*(C)
    points, law = fit_law(fr)                       # log2 n* vs log10 C (Fig. 7 points)
    plan(2e6, law, bp=32)                           # -> BudgetPoint(bp, n, m)

`compare_recipes(runs, unit="device_hours")` fits one sigmoid per recipe instead
(ScaleRL's (A, B, C_mid) table and extrapolation test). `analyze` runs every analysis
of the playbook; `python -m isojax.analysis` writes it out as figures, fits.json and
report.md (with `--compare-recipes`, the recipe table too).
"""

from isojax.analysis.allocation import (FixedBatch, Sensitivity, batch_sizes, fixed_batch,
                                        sensitivity)
from isojax.analysis.bootstrap import BootstrapResult, Interval, bootstrap
from isojax.analysis.extrapolation import (ExtrapolationCheck, extrapolation_check,
                                           observed_frontier)
from isojax.analysis.fits import NStarFit, SigmoidFit, fit_n_star, fit_sigmoid
from isojax.analysis.frontier import CurveSet, Frontier, fit_curves, frontier, log_grid
from isojax.analysis.law_points import (LawPoints, bin_points, fit_law,
                                        running_average_points)
from isojax.analysis.pipeline import (Analysis, FrontierFit, FrontierOptions, GroupAnalysis,
                                      analyze, fit_frontier)
from isojax.analysis.plan import plan, round_pow2
from isojax.analysis.prescriptions import LawChoice, Prescription, choose_law, prescribe
from isojax.analysis.recipes import (RecipeComparison, RecipeExtrapolation, RecipeFit,
                                     compare_recipes, group_recipes, recipe_labels)
from isojax.analysis.records import pool_points, record_breaking_points, record_points
from isojax.analysis.report import fits_dict, report_markdown, write_report
from isojax.analysis.runs import (LoadProblem, LoadResult, Run, RunLoadWarning, eval_metrics,
                                  load_runs, read_runs)

__all__ = [
    "Analysis", "BootstrapResult", "CurveSet", "ExtrapolationCheck", "FixedBatch",
    "Frontier", "FrontierFit", "FrontierOptions", "GroupAnalysis", "Interval", "LawChoice",
    "LawPoints", "LoadProblem", "LoadResult", "NStarFit", "Prescription",
    "RecipeComparison", "RecipeExtrapolation", "RecipeFit", "Run", "RunLoadWarning",
    "Sensitivity", "SigmoidFit", "analyze", "batch_sizes",
    "bin_points", "bootstrap", "choose_law", "compare_recipes", "eval_metrics",
    "extrapolation_check",
    "fit_curves", "fit_frontier", "fit_law", "fit_n_star", "fit_sigmoid", "fits_dict", "fixed_batch",
    "frontier", "group_recipes", "load_runs", "log_grid", "observed_frontier", "plan",
    "pool_points", "prescribe", "read_runs", "recipe_labels", "record_breaking_points",
    "record_points",
    "report_markdown", "round_pow2", "running_average_points", "sensitivity",
    "write_report",
]
