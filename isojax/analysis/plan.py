"""The prescription: (Bp, n, M) for a new budget from a fitted n*(C) law.

The playbook's workflow (§4.3, Appendix C): take n from n*(C), rounded to a power of
two; keep the smallest Bp that trains stably (the caller knows it; it is a stability
knob, not a performance one); spend the rest on updates, M = floor(C / (Bp * n)).
"""

from __future__ import annotations

import math

from isojax.analysis.fits import NStarFit
from isojax.budget import BudgetPoint


def round_pow2(n: float) -> int:
  """The power of two nearest to n in log2 (so 2.9 -> 4 and 2.7 -> 2), at least 1."""
  if not (math.isfinite(n) and n > 0):
    raise ValueError(f"round_pow2: n must be a positive finite number, got {n!r}")
  return 2 ** max(0, math.floor(math.log2(n) + 0.5))


def plan(budget, nstar_fit: NStarFit, *, bp: int, b_max: int | None = None) -> BudgetPoint:
  """The budget point for `budget` rollouts: n = n*(C) rounded in log2, M = floor(C/(Bp n)).

  Args:
    budget: total rollouts C.
    nstar_fit: the n*(C) law, fitted with compute in rollouts.
    bp: problems per batch (the smallest Bp that trains stably).
    b_max: the largest batch Bp * n the hardware takes, if any.

  Raises:
    ValueError: naming budget, bp and n, when `BudgetPoint.feasible` refuses the point
      (the batch exceeds b_max, or the budget cannot pay for one update: M = 0); or
      when the law is not in rollouts.
  """
  if nstar_fit.unit != "rollouts":
    raise ValueError(f"plan: the n* law was fitted with compute in "
                     f"{nstar_fit.unit!r}; budgets are in rollouts")
  if isinstance(bp, bool) or not isinstance(bp, int) or bp <= 0:
    raise ValueError(f"plan: bp must be a positive integer, got {bp!r}")
  if isinstance(budget, bool) or not (isinstance(budget, (int, float))
                                      and math.isfinite(budget) and budget > 0):
    raise ValueError(f"plan: budget must be a positive number of rollouts, got {budget!r}")
  n_pred = float(nstar_fit.predict(budget))
  n = round_pow2(n_pred)
  try:
    return BudgetPoint.feasible(budget, bp=bp, n=n, b_max=b_max)
  except ValueError as e:
    raise ValueError(f"plan: budget={budget:g}, bp={bp}, n={n} (n*={n_pred:.4g}): {e}") from e
