"""Which Bp trained stably: the prescriptions' Bp is the smallest whose runs did
(the playbook's workflow, §4.3 and App. C: Bp is a stability knob, not a performance
one).

A run is unstable when it skipped an update, logged a non-finite value (found at
loading) or collapsed: learned, then lost most of it by its end.
"""

from __future__ import annotations

import numpy as np

from isojax.analysis.records import base_reward

# A run collapsed when its last evaluations (the mean of those in the last quarter of
# its compute, at least 3) lost more than this fraction of its gain over the base
# model before them (the best mean of 3 consecutive earlier evaluations: a single
# noisy high is no peak)...
COLLAPSE_FRACTION = 0.5
# ...and that gain was at least this much reward (a smaller one is not told apart
# from evaluation noise). Healthy runs (a sigmoid rise, noise of sd 0.02 on each
# evaluation) are called collapsed in about 6% of draws at a rise of 0.05 with 8
# evaluations per doubling of compute (1-2% at one every 10 updates, whose tails
# hold more), under 0.5% from a rise of 0.1; a run still rising at its end never is.
COLLAPSE_MIN_GAIN = 0.05
# A collapse late in the run, inside that last quarter, leaves the quarter's mean
# above the line while the run ends at its base reward (with one evaluation every 10
# updates the quarter holds 10 of them). So a run has also collapsed when its last 3
# evaluations lost this larger fraction of the gain: the mean of 3 is noisier than
# the quarter's, and at this fraction it adds under 0.5% to the rates above.
LATE_COLLAPSE_FRACTION = 0.75
LATE_WINDOW = 3


def collapsed(run, metric: str) -> bool:
  """Whether `run` learned and then lost most of it (the playbook's instability:
  entropy or length explosion, a reward that falls back, §3 and App. A). Its
  record points keep the peak, so its fitted curve would not show it."""
  base = base_reward(run, metric)
  c, r = run.points(metric, "rollouts")
  c, after = c[c > 0], r[c > 0]
  # The last quarter of the compute, not of the evaluations: spaced evenly in log
  # compute, the last quarter of those spans most of the run.
  tail = max(3, int(np.sum(c >= 0.75 * c.max()))) if c.size else 0
  if base is None or after.size < tail + 3:
    return False
  before = np.convolve(after[:-tail], np.ones(3) / 3, mode="valid")
  gain = float(before.max()) - base
  end = float(after[-tail:].mean())
  last = float(after[-LATE_WINDOW:].mean())
  return bool(gain >= COLLAPSE_MIN_GAIN
              and (end < base + (1 - COLLAPSE_FRACTION) * gain
                   or last < base + (1 - LATE_COLLAPSE_FRACTION) * gain))


def unstable_bps(runs, unstable_runs, metric: str) -> dict[int, list[str]]:
  """Bp -> names of its runs that skipped an update ("train/skipped" > 0), are named
  in `unstable_runs` (e.g. runs whose non-finite values were dropped at loading) or
  `collapsed` on `metric`."""
  out: dict[int, list[str]] = {}
  for r in runs:
    skipped = any(isinstance(v := row.get("train/skipped"), (int, float)) and v > 0
                  for row in r.rows)
    if skipped or r.name in unstable_runs or collapsed(r, metric):
      out.setdefault(r.bp, []).append(r.name)
  return out


def smallest_stable_bp(runs, unstable_runs, metric: str) -> tuple[int, str]:
  """The smallest Bp none of whose runs is unstable (`unstable_bps`), and one sentence
  saying why; the smallest Bp tried, and that Bp wants choosing by hand, when every
  Bp had an unstable run.

  Raises:
    ValueError: if `runs` is empty (there is no Bp to choose from).
  """
  bps = sorted({r.bp for r in runs})
  if not bps:
    raise ValueError(f"smallest_stable_bp: no runs to choose a Bp from (metric "
                     f"{metric!r})")
  bad = unstable_bps(runs, unstable_runs, metric)
  stable = [b for b in bps if b not in bad]
  if stable:
    skipped = f" (unstable runs at Bp={sorted(b for b in bad if b < stable[0])})" if any(
        b < stable[0] for b in bad) else ""
    return stable[0], (f"Bp={stable[0]}: the smallest Bp of the study with no unstable "
                       f"run{skipped}")
  return bps[0], (f"Bp={bps[0]}: the smallest Bp tried; every Bp of the study had an "
                  f"unstable run ({', '.join(n for b in bps for n in bad[b])}), so "
                  f"choose Bp by hand (--bp)")
