"""The prescription: (Bp, n, M) for a new budget from a fitted n*(C) law.

The playbook's workflow (§4.3, Appendix C): take n from n*(C), rounded to a power of
two (or to the nearest n the study tried, whose curves the law was drawn from); keep
the smallest Bp that trains stably (the caller knows it; it is a stability knob, not
a performance one); spend the rest on updates, M = floor(C / (Bp * n)).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable

from isojax.analysis.fits import NStarFit
from isojax.budget import BudgetPoint

# GRPO-family estimators normalise rewards within a problem's group of n rollouts: a
# group of one has no baseline, so n = 1 learns nothing. A study that ran n = 1 (a
# critic's estimator) may still be prescribed it: its n values are taken as given.
MIN_N = 2


def is_n(v) -> bool:
  """Whether `v` can be an n (rollouts per problem): a whole number >= 1, Python's
  or NumPy's, 8.0 too, and not a bool (True would silently mean 1)."""
  return (isinstance(v, numbers.Real) and not isinstance(v, bool)
          and v >= 1 and float(v).is_integer())


def round_pow2(n: float) -> int:
  """The power of two nearest to n in log2 (so 2.9 -> 4 and 2.7 -> 2), at least 1."""
  if not (math.isfinite(n) and n > 0):
    raise ValueError(f"round_pow2: n must be a positive finite number, got {n!r}")
  return 2 ** max(0, math.floor(math.log2(n) + 0.5))


def nearest_n(n: float, n_values: Iterable[int] | None = None, *,
              at_most: int | None = None) -> int:
  """The n to run for an n* of `n`: the nearest in log2 among `n_values` (the n a
  study tried; ties go to the larger), or the nearest power of two >= MIN_N without
  them; with `at_most`, the nearest of those not above it.

  Raises:
    ValueError: on a non-positive or non-finite n, or when no candidate is left.
  """
  if not (math.isfinite(n) and n > 0):
    raise ValueError(f"nearest_n: n must be a positive finite number, got {n!r}")
  if n_values is None:
    top = max(MIN_N, round_pow2(n), at_most or 0)
    candidates = [2 ** i for i in range(MIN_N.bit_length() - 1, top.bit_length())]
  else:
    n_values = list(n_values)
    bad = [v for v in n_values if not is_n(v)]
    if bad:
      raise ValueError(f"nearest_n: n_values must be the n the study tried (positive "
                       f"integers), got {bad[0]!r} in {n_values!r}")
    candidates = sorted({int(v) for v in n_values})
    if not candidates:
      raise ValueError("nearest_n: n_values is empty; give the n the study tried, or "
                       "None for powers of two")
  if at_most is not None:
    candidates = [c for c in candidates if c <= at_most]
  if not candidates:
    among = (f"powers of two >= {MIN_N}" if n_values is None
             else f"{sorted({int(v) for v in n_values})}")
    raise ValueError(f"nearest_n: no n among {among} is at most {at_most} "
                     f"(n*={n:.4g})")
  return min(candidates, key=lambda c: (abs(math.log2(c / n)), -c))


def plan(budget, nstar_fit: NStarFit, *, bp: int, b_max: int | None = None,
         n_values: Iterable[int] | None = None) -> BudgetPoint:
  """The budget point for `budget` rollouts: n = `nearest_n`(n*(C)), M = floor(C/(Bp n)).

  The law's point estimate, wherever `budget` lies: beyond `nstar_fit.compute_range`
  it is an extrapolation, which `prescribe` checks against the law's bootstrap
  interval (and refuses when that is too wide) and this function does not.

  Args:
    budget: total rollouts C.
    nstar_fit: the n*(C) law, fitted with compute in rollouts.
    bp: problems per batch (the smallest Bp that trains stably).
    b_max: the largest batch Bp * n the hardware takes, if any.
    n_values: the n the study tried; n is then the nearest of them (in log2), else
      the nearest power of two, at least MIN_N.

  Raises:
    ValueError: naming budget, bp and n, when `BudgetPoint.feasible` refuses the point
      (the batch exceeds b_max, or the budget cannot pay for one update: M = 0); or
      when the law is not in rollouts.
  """
  if nstar_fit.unit != "rollouts":
    raise ValueError(f"plan: the n* law was fitted with compute in "
                     f"{nstar_fit.unit!r}; budgets are in rollouts")
  # NumPy scalars count (a budget or Bp read off an array), bools do not.
  if isinstance(bp, bool) or not isinstance(bp, numbers.Integral) or bp <= 0:
    raise ValueError(f"plan: bp must be a positive integer, got {bp!r}")
  if isinstance(budget, bool) or not (isinstance(budget, numbers.Real)
                                      and math.isfinite(budget) and budget > 0):
    raise ValueError(f"plan: budget must be a positive number of rollouts, got {budget!r}")
  bp, budget = int(bp), int(budget) if isinstance(budget, numbers.Integral) else float(budget)
  n_pred = float(nstar_fit.predict(budget))
  n = nearest_n(n_pred, n_values)
  try:
    return BudgetPoint.feasible(budget, bp=bp, n=n, b_max=b_max)
  except ValueError as e:
    raise ValueError(f"plan: budget={budget:g}, bp={bp}, n={n} (n*={n_pred:.4g}): {e}") from e
