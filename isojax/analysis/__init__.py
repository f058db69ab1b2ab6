"""Analysis of IsoCompute sweeps: from run directories to compute-optimal prescriptions.

Imports only NumPy, SciPy and Matplotlib (never JAX), so a notebook can analyse run
directories copied from a cluster:

    from isojax.analysis import load_runs, fit_curves, frontier, fit_n_star, plan
    runs = load_runs("runs/easy_bp32")
    curves = fit_curves(runs, metric="val/avg@4")           # sigmoid per n
    fr = frontier(curves.fits)                               # envelope and n*(C)
    law = fit_n_star(*fr.n_star_points())                    # log2 n* vs log10 C
    plan(2e6, law, bp=32)                                    # -> BudgetPoint(bp, n, m)
"""

from isojax.analysis.allocation import (FixedBatch, Sensitivity, batch_sizes, fixed_batch,
                                        sensitivity)
from isojax.analysis.bootstrap import BootstrapResult, Interval, bootstrap
from isojax.analysis.fits import NStarFit, SigmoidFit, fit_n_star, fit_sigmoid
from isojax.analysis.frontier import (CurveSet, ExtrapolationCheck, Frontier,
                                      extrapolation_check, fit_curves, frontier, log_grid,
                                      observed_frontier)
from isojax.analysis.pipeline import Analysis, GroupAnalysis, Sweep, analyze, analyze_sweep
from isojax.analysis.plan import plan, round_pow2
from isojax.analysis.records import pool_points, record_breaking_points, record_points
from isojax.analysis.report import fits_dict, report_markdown, write_report
from isojax.analysis.runs import (LoadProblem, LoadResult, Run, RunLoadWarning, eval_metrics,
                                  load_runs, read_runs)

__all__ = [
    "Analysis", "BootstrapResult", "CurveSet", "ExtrapolationCheck", "FixedBatch",
    "Frontier", "GroupAnalysis", "Interval", "LoadProblem", "LoadResult", "NStarFit",
    "Run", "RunLoadWarning", "Sensitivity", "SigmoidFit", "Sweep", "analyze",
    "analyze_sweep", "batch_sizes", "bootstrap", "eval_metrics", "extrapolation_check",
    "fit_curves", "fit_n_star", "fit_sigmoid", "fits_dict", "fixed_batch", "frontier",
    "load_runs", "log_grid", "observed_frontier", "plan", "pool_points", "read_runs",
    "record_breaking_points", "record_points", "report_markdown", "round_pow2",
    "sensitivity", "write_report",
]
