"""The analysis' bootstrap: every fitted number of a group by a stable name, and how
each one's interval is formed (`isojax.analysis.bootstrap` gives the method).

Names: "<sweep>|curve[<key>].<param>" for a sigmoid, "<sweep>|law.<param>" for an
n*(C) law, where <sweep> is `sweep_name` (or "fixed[B=...]" for a fixed-batch study),
and `prescriptions.n_star_key(C)` for n* at a prescription's budget.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from isojax.analysis import fits as fits_lib
from isojax.analysis import prescriptions as rx
from isojax.analysis.bootstrap import BootstrapResult, bootstrap
from isojax.analysis.frontier import key_label

LAW_PARAMS = ("L", "k", "x0", "b")


def sweep_name(sweep) -> str:
  """The prefix of a sweep's (`pipeline.FrontierFit`) parameters in the intervals."""
  return f"{sweep.label}|{sweep.metric}|{sweep.unit}"


def _tables(sweeps, fixed):
  """(name, CurveSet, law) of every sweep and fixed-batch study."""
  return ([(sweep_name(s), s.curves, s.law) for s in sweeps]
          + [(f"fixed[B={fb.batch}]", fb.curves, fb.law) for fb in fixed])


def _curve_param(table: str, key, param: str) -> str:
  return f"{table}|curve[{key_label(key)}].{param}"


def params(sweeps, fixed, law_name: str, budgets) -> dict[str, float]:
  """Every fitted number by its name; n* at each budget from the law of the sweep
  named `law_name` (the one prescriptions come from)."""
  out = {}
  for name, curves, law in _tables(sweeps, fixed):
    for k, f in curves.fits.items():
      for p in fits_lib.SIGMOID_PARAMS:
        out[_curve_param(name, k, p)] = getattr(f, p)
    if law is not None:
      for p in LAW_PARAMS:
        out[f"{name}|law.{p}"] = getattr(law, p)
      if name == law_name:
        for c in budgets:
          out[rx.n_star_key(c)] = float(law.predict(c))
  return out


def _curve_dofs(sweeps, fixed) -> dict[str, int]:
  """A curve parameter's degrees of freedom: its configuration's runs - 1 (n* and
  the laws rest on every configuration: the bootstrap's default)."""
  return {_curve_param(name, k, p): max(count - 1, 1) for name, curves, _ in
          _tables(sweeps, fixed) for k, count in curves.n_runs.items()
          for p in fits_lib.SIGMOID_PARAMS}


def _log_scale(name: str) -> bool:
  """Whether a quantity's interval is formed on a log scale (n*, C_mid)."""
  return name.startswith("n_star@") or name.endswith(".c_mid")


def _support(name: str) -> tuple[float, float] | None:
  """The values a quantity can take: the fits' constraints."""
  where, _, param = name.rpartition(".")
  if where.endswith("]"):
    return fits_lib.SIGMOID_SUPPORT.get(param)
  return fits_lib.NSTAR_K_RANGE if where.endswith("|law") and param == "k" else None


def unresampled_curves(boot: BootstrapResult | None, sweep) -> tuple[str, ...]:
  """The curves on `sweep`'s frontier that more resamples lacked than the interval's tail.

  A configuration fitted only from its seeds' records pooled (too few evaluations
  in any k - 1 of them) is absent from such resamples, and each of their frontiers
  then picks n* from the other curves: the spread of n* they give is not the
  estimate's, and an interval built from it can exclude every resample. A curve that
  never attains the estimate's frontier changes no n* by its absence, so only those
  that do count. Each entry names the configuration and how many resamples fitted it.
  """
  if boot is None or sweep is None or sweep.frontier is None:
    return ()
  ran = boot.n_boot - boot.n_failed
  tail = boot.n_boot * (1 - boot.level) / 2
  fr = sweep.frontier
  out = []
  for k in sorted({fr.keys[w] for w in fr.winner if w >= 0}):
    name = _curve_param(sweep_name(sweep), k, fits_lib.SIGMOID_PARAMS[0])
    iv = boot.intervals.get(name)
    fitted = 0 if iv is None else iv.n_ok
    if ran - fitted > tail + 1e-9:
      out.append(f"{key_label(k)} (fitted in {fitted} of {ran} resamples)")
  return tuple(out)


def group_intervals(runs, refit: Callable, sweeps, fixed, *, law_name: str, budgets,
                    n_boot: int, seed: int) -> tuple[BootstrapResult | None, list[str]]:
  """The bootstrap of a group's fitted numbers over its runs, and the problems to report.

  Runs are resampled within their configuration (`Run.config_key`); `refit(sample)`
  gives the sample's (sweeps, fixed-batch studies). With one run per configuration
  there is nothing to resample: no intervals, and a problem says why.
  """
  per_config = collections.Counter(r.config_key for r in runs)
  single = sum(c == 1 for c in per_config.values())
  if single == len(per_config):
    # Resampling runs across configurations would vary which n were run, not
    # seeds: intervals three times too wide for n*, of zero width for curves.
    return None, ["bootstrap: every configuration has one run, so run-to-run variation "
                  "cannot be estimated and there are no intervals (run two seeds or more "
                  "per configuration)"]
  dofs = _curve_dofs(sweeps, fixed)
  boot = bootstrap(runs, lambda sample: params(*refit(sample), law_name, budgets),
                   n_boot=n_boot, seed=seed, strata=lambda r: r.config_key,
                   log_scale=_log_scale, dof=dofs.get, support=_support)
  if not single:
    return boot, []
  return boot, [f"bootstrap: {single} of {len(per_config)} configurations have one run, "
                f"which resampling within configurations cannot vary: the intervals leave "
                f"out their seed noise (run more seeds)"]
