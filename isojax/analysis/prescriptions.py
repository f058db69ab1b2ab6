"""Prescriptions for new budgets: which n*(C) law, which Bp, and when to refuse.

The playbook's workflow (§4.3, Appendix C) prescribes from the joint (Bp, n, M) study:
(i) n from the fitted n*(C), (ii) the smallest Bp that trains stably, (iii) the rest of
the budget to M. Appendix B notes that where n* saturates depends on Bp, so a law
measured at one fixed Bp is only used at that Bp (or, asked for another Bp, with the
caveat said).

Which law (`choose_law`):
  * the runs hold a joint study (at least two Bp values, each run at two or more n):
    the joint frontier's law, with Bp the smallest of the study none of whose runs
    was unstable (skipped an update, logged a non-finite value, or collapsed: lost
    most of its gain by its end), or the Bp asked;
  * otherwise the law of the fixed-Bp sweep at the Bp asked (if the runs have one),
    else the primary sweep's law at its own Bp.

When to refuse (`prescribe`): where the bootstrap interval of n* spans more than
`max_spread` (8x) in n, the law does not pin n down and no point is prescribed (the
reason is the note). A budget beyond the law's data is an extrapolation, refused
too without an interval to check it, or where n* is at the largest n tried. A budget
where the law's frontier is censored (a configuration that ended early might attain
it: `frontier.Frontier.censors`; past the frontier's end, where its last point is) is
refused whatever the interval: the data do not decide n* there, so neither can a law
fitted to them. Inside the data a prescription whose n differs from the frontier's n*
there says so.
"""

from __future__ import annotations

import dataclasses
import math

from isojax.analysis import fits as fits_lib
from isojax.analysis.frontier import key_n
from isojax.analysis.plan import MIN_N, nearest_n, plan
from isojax.analysis.stability import smallest_stable_bp
from isojax.budget import BudgetPoint

MAX_SPREAD = 8.0  # refuse to prescribe where n*'s interval spans more than this


@dataclasses.dataclass(frozen=True)
class LawChoice:
  """The law prescriptions come from, and the Bp they use.

  Attributes:
    label: the sweep the law was fitted on ("joint" or "bp=32").
    law: the n*(C) law (compute in rollouts).
    bp: problems per batch of every prescription.
    joint: whether the law is the joint (Bp, n, M) study's (App. C).
    reason: one sentence: which law and why this Bp.
    unfitted_n: the n of configurations of the law's sweep left out of its
      frontier (too few record points, `frontier.CurveSet.skipped`).
    grid_end_n: the largest n of the law's sweep when n* is stuck there
      (`n_grid_censored`), else None.
    frontier: the law's sweep's `frontier.Frontier` (what the law was fitted to), or
      None.
    n_values: the n of the law's sweep's configurations (what `plan` snaps n to);
      empty: powers of two.
  """

  label: str
  law: fits_lib.NStarFit
  bp: int
  joint: bool
  reason: str
  unfitted_n: tuple[int, ...] = ()
  grid_end_n: int | None = None
  frontier: object = None
  n_values: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Prescription:
  """(Bp, n, M) for one budget, or why there is none.

  Attributes:
    budget: the rollout budget C.
    point: the isojax.budget.BudgetPoint, or None (infeasible or refused).
    n_star: the law's unrounded n* at `budget`.
    extrapolated: the budget lies outside the compute range the law was fitted on.
    note: why `point` is None, or a caveat.
    law: the label of the law used ("joint", "bp=32").
    interval: (low, high) bootstrap interval of n* at `budget`, when computed.
    refused: no point because the extrapolation is not supported by the law.
  """

  budget: float
  point: object
  n_star: float
  extrapolated: bool
  note: str = ""
  law: str = ""
  interval: tuple[float, float] | None = None
  refused: bool = False


def is_joint_study(runs) -> bool:
  """At least two Bp values were each run at two or more values of n."""
  ns: dict[int, set] = {}
  for r in runs:
    ns.setdefault(r.bp, set()).add(r.n)
  return sum(len(v) >= 2 for v in ns.values()) >= 2


def choose_law(sweeps, runs, *, primary, primary_bp: int | None, bp: int | None = None,
               unstable_runs=frozenset()) -> LawChoice | None:
  """The law and Bp of the prescriptions (see the module docstring); None without one.

  Args:
    sweeps: the group's sweeps (pipeline.FrontierFit), labelled "bp=<Bp>" and "joint".
    runs: the group's runs.
    primary: the primary (fixed-Bp, primary metric, rollouts) sweep, or None.
    primary_bp: the Bp of the primary sweep.
    bp: the Bp asked for, or None.
    unstable_runs: names of runs known to be unstable from loading.
  """
  if primary is None:
    return None
  by_label = {s.label: s for s in sweeps if s.metric == primary.metric
              and s.unit == "rollouts" and s.law is not None}
  joint = by_label.get("joint")
  caveat = ""
  if is_joint_study(runs):
    if joint is not None:
      if bp is None:
        bp, why = smallest_stable_bp(runs, unstable_runs, primary.metric)
      else:
        why = f"Bp={bp} as asked"
      return _choice(joint, bp, True,
                     f"the joint (Bp, n, M) study's n*(C) law (App. C); {why}")
    caveat = " (the joint study's law could not be fitted)"
  own = by_label.get(f"bp={bp}") if bp is not None else None
  if own is not None and own is not primary:
    return _choice(own, bp, False,
                   f"the fixed-Bp n*(C) law measured at Bp={bp}, as asked{caveat}")
  if primary.law is None:
    return None
  if bp is None or bp == primary_bp:
    return _choice(primary, primary_bp, False,
                   f"the fixed-Bp n*(C) law measured at Bp={primary_bp} (§4.1), at "
                   f"its own Bp{caveat}")
  return _choice(primary, bp, False,
                 f"the fixed-Bp n*(C) law measured at Bp={primary_bp}, used at Bp={bp} "
                 f"as asked: no runs measured it there, and where n* saturates "
                 f"depends on Bp (App. B){caveat}")


def _choice(sweep, bp: int, joint: bool, reason: str) -> LawChoice:
  return LawChoice(sweep.label, sweep.law, bp, joint, reason, _unfitted_n(sweep),
                   n_grid_censored(sweep.frontier, sweep.law), sweep.frontier,
                   tuple(sorted({key_n(k) for k in sweep.curves.n_runs})))


def _unfitted_n(sweep) -> tuple[int, ...]:
  """The n of the sweep's skipped curves that no fitted curve has (at another Bp)."""
  fitted = {key_n(k) for k in sweep.curves.fits}
  return tuple(sorted({key_n(k) for k in sweep.curves.skipped} - fitted))


def n_grid_censored(fr, law) -> int | None:
  """The largest n of the frontier's curves when n* may lie beyond it, else None.

  Saturation of n* is established only because larger n were tried and lost (§4.1).
  Where the frontier's n* at its largest compute is the largest n tried, or the law's
  asymptote (log2 n* -> L + b as C grows) is at or above it, the law flattens where
  the n grid stops, not where n* does.
  """
  if fr is None or law is None:
    return None
  _, n = fr.n_star_points()
  if n.size == 0:
    return None
  largest = max(key_n(k) for k in fr.keys)
  asymptote = law.L + law.b  # log2 n* as C -> inf (k > 0)
  if int(n[-1]) == largest or asymptote >= math.log2(largest) - 1e-9:
    return largest
  return None


def default_budgets(law: fits_lib.NStarFit) -> list[float]:
  """Four budgets: two inside the law's data, its last point, and 10x beyond."""
  lo, hi = law.compute_range

  def round_down(c):  # two significant digits, never past the data
    # A hair up first: over an exact span of decades, lo * (hi / lo) ** (1 / 3)
    # comes out 9999.999999999998, which would be cut to 9,000.
    up = c * (1 + 1e-9)
    scale = 10 ** (math.floor(math.log10(up)) - 1)
    return min(float(math.floor(up / scale) * scale), max(c, hi))

  return [round_down(c) for c in (lo * (hi / lo) ** (1 / 3), lo * (hi / lo) ** (2 / 3),
                                  hi, 10 * hi)]


def n_star_key(budget: float) -> str:
  """The bootstrap's name for n* at `budget` (`intervals.params` fills it).

  repr of a float is exact (shortest round trip), so distinct budgets never share a
  name, as 1048576 and 1048580 would at six significant digits."""
  return f"n_star@{float(budget)!r}"


def n_star_interval(boot, budget: float) -> tuple[float, float] | None:
  """The bootstrap interval of n* at `budget` (None without one), as judged here.

  A resample in which no law could be fitted could have put n* anywhere: once
  they outnumber the interval's upper tail, its upper end is unknown (inf), and an
  extrapolation from it is refused. Too few resamples for an interval (NaN) leave
  both ends unknown: (0, inf).
  """
  iv = boot.intervals.get(n_star_key(budget)) if boot is not None else None
  if iv is None or iv.n_ok == 0:
    return None
  unknown, tail = boot.n_boot - iv.n_ok, boot.n_boot * (1 - boot.level) / 2
  low = 0.0 if math.isnan(iv.low) else iv.low
  high = math.inf if unknown > tail + 1e-9 or math.isnan(iv.high) else iv.high
  return low, high


def _refusal(interval, max_spread: float, extrapolated: bool) -> str:
  """Why a prescription with this n* interval is refused ("" when it is not)."""
  low, high = interval
  if low > 0 and math.isfinite(high) and high / low <= max_spread:
    return ""
  where = "beyond its data" if extrapolated else "even inside its data"
  more = "run larger budgets, or more seeds" if extrapolated else "run more seeds"
  return (f"the law's interval of n* here, [{low:.3g}, {high:.3g}], spans more "
          f"than a factor of {max_spread:g}: {where} the law does not pin n down; "
          f"{more} per configuration (the interval narrows with them) first")


def _refusals(choice: LawChoice, budget: float, interval, extrapolated: bool, void: str,
              max_spread: float) -> list[str]:
  """Every reason to refuse a prescription (none: it is made)."""
  reasons = []
  fr = choice.frontier
  censoring = fr.censoring_at(budget) if fr is not None else ()
  if censoring:
    reasons.append("n* at this budget is censored: "
                   + "; ".join(fr.censoring_notes("rollouts", censoring)))
  if extrapolated and choice.grid_end_n is not None:
    reasons.append(f"n* is at the largest n tried ({choice.grid_end_n}) where the data "
                   f"end, so the law's saturation is where the n grid stops, not a "
                   f"measured one (§4.1); try larger n (e.g. {2 * choice.grid_end_n}) "
                   f"at the largest budget first")
  if void or interval is None:
    # Beyond the data nothing else checks the law; inside it the frontier does.
    if extrapolated:
      reasons.append(void or "no bootstrap interval of n* to check the extrapolation "
                     "(one run per configuration, or none drawn): run two seeds or "
                     "more per configuration first")
  elif why := _refusal(interval, max_spread, extrapolated):
    reasons.append(why)
  return reasons


def _frontier_note(fr, budget: float, n: int, n_law: float) -> str:
  """Where, inside the data, the frontier's n* is not the prescribed n, say so."""
  if fr is None or not fr.defined.any():
    return ""
  i = fr.index_at(budget)
  if not fr.defined[i] or int(fr.n_star[i]) == n:
    return ""
  return (f"the frontier's n* here is {int(fr.n_star[i])}, not the law's {n_law:.3g} "
          f"(n={n}): the law smooths n* along the frontier, the frontier is what the "
          f"runs measured")


def _unresampled_note(unresampled) -> str:
  """Why the n* intervals of a law whose resamples lacked some of its curves are void."""
  return (f"no interval of n*: the bootstrap's resamples lack {', '.join(unresampled)}, "
          f"which the estimate's frontier used (fitted only from its seeds' records "
          f"pooled), so their n* is not the estimate's; evaluate those runs more "
          f"often, or run more seeds")


def _plan(budget: float, n_pred: float, choice: LawChoice, b_max) -> tuple[object, str]:
  """`plan`'s point, at the nearest feasible n when its own is not; and a note where
  n was held to a bound rather than the nearest to n*."""
  n_values = choice.n_values or None
  try:
    point, why = plan(budget, choice.law, bp=choice.bp, b_max=b_max,
                      n_values=n_values), ""
  except ValueError as e:
    # A batch over b_max or a budget short of one update: the nearest n that fits.
    cap = min(int(budget // choice.bp), b_max // choice.bp if b_max else math.inf)
    try:
      n = nearest_n(n_pred, n_values, at_most=cap)
    except ValueError:
      raise e from None
    point = BudgetPoint.feasible(budget, bp=choice.bp, n=n, b_max=b_max)
    why = f"{e}; n={n}, the nearest n{' tried' if n_values else ''} that fits, instead"
  lowest = min(n_values) if n_values else MIN_N
  if n_pred < lowest / math.sqrt(2) and point.n == lowest:
    why = why or (f"n*={n_pred:.3g} is below the smallest n "
                  f"{'tried' if n_values else 'a group-normalised estimator needs'} "
                  f"({lowest}), which is prescribed")
  if n_values and n_pred > max(n_values) * math.sqrt(2) and point.n == max(n_values):
    why = why or (f"n*={n_pred:.3g} is above the largest n tried ({point.n}), which is "
                  f"prescribed")
  return point, why


def prescribe(choice: LawChoice, budgets, *, b_max=None, intervals=None,
              max_spread: float = MAX_SPREAD,
              unresampled=()) -> tuple[Prescription, ...]:
  """A Prescription per budget from `choice`.

  Args:
    choice: the law and Bp (`choose_law`).
    budgets: rollout budgets.
    b_max: the largest batch Bp * n the hardware takes, if known.
    intervals: budget -> (low, high) bootstrap interval of n* (`n_star_interval`),
      or None, when computed.
    max_spread: refuse a prescription whose n* interval spans more than this.
    unresampled: the law's curves that too many resamples lacked
      (`intervals.unresampled_curves`): the n* intervals are then void (None, and
      a note says why), and an extrapolation is refused.
  """
  intervals = intervals or {}
  out = []
  for c in budgets:
    n_pred = float(choice.law.predict(c))
    lo, hi = choice.law.compute_range
    extrapolated = not lo * (1 - 1e-9) <= c <= hi * (1 + 1e-9)
    interval = None if unresampled else intervals.get(c)
    common = dict(budget=c, n_star=n_pred, extrapolated=extrapolated, law=choice.label,
                  interval=interval)
    void = _unresampled_note(unresampled) if unresampled else ""
    reasons = _refusals(choice, c, interval, extrapolated, void, max_spread)
    if reasons:
      note = "refused: " + "; ".join(reasons)
      out.append(Prescription(point=None, note=note, refused=True, **common))
      continue
    notes = [void]
    try:
      point, clamped = _plan(c, n_pred, choice, b_max)
      notes.append(clamped)
      if not extrapolated:
        notes.append(_frontier_note(choice.frontier, c, point.n, n_pred))
      above = [n for n in choice.unfitted_n if n > point.n]
      if above:
        notes.append(f"n={above} had too few record points to be fitted, so the law "
                     f"never saw them: n* may be larger (evaluate those runs more often, "
                     f"or use a finer reward bin)")
      out.append(Prescription(point=point, note="; ".join(filter(None, notes)), **common))
    except ValueError as e:
      out.append(Prescription(point=None, note=str(e), **common))
  return tuple(out)
