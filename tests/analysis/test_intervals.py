"""The analysis' bootstrap of n*: void where its resamples lack a curve the estimate used."""

import numpy as np

from isojax.analysis import analyze, fit_frontier
from isojax.analysis.bootstrap import BootstrapResult, Interval
from isojax.analysis.intervals import unresampled_curves

from . import fake_runs

METRIC = "val/avg@4"
BP = 16


def _run(n, seed, steps, c_mid, a):
  """A Bp=16 run on a noise-free sigmoid, with a step-0 base evaluation."""
  return fake_runs.memory_run(
      BP, n, seed, steps, lambda c: fake_runs.sigmoid(c, a=a, b=1.5, c_mid=c_mid, r0=0.3),
      base=0.3)


def _runs_with_a_pooled_only_curve():
  """n = 2..16 evaluated often; n = 32, which wins at large compute, three times per
  seed at staggered steps: six distinct compute values pooled, three in any one seed
  (too few to fit), so every k - 1 = 1 resample lacks it."""
  runs = []
  for j, n in enumerate([2, 4, 8, 16]):
    runs += [_run(n, s, fake_runs.log_steps(BP, n, 2 ** 13), 150 * 2 ** j, 0.5 + 0.04 * j)
             for s in (0, 1)]
  runs += [_run(32, 0, [4, 8, 16], 150 * 2 ** 4, 0.66),
           _run(32, 1, [5, 10, 20], 150 * 2 ** 4, 0.66)]
  return runs


def test_n_star_intervals_are_void_where_resamples_lack_a_curve_the_estimate_used():
  runs = _runs_with_a_pooled_only_curve()
  inside, beyond = 8000.0, 1e5
  g = analyze(runs, n_boot=10, budgets=[inside, beyond]).groups[0]
  assert 32 in g.primary.curves.fits
  # Independently: the frontier of either seed alone (what each resample sees) has no
  # n = 32, and its n* at the budget is well below the estimate's.
  alone = [fit_frontier([r for r in runs if r.seed == s], metric=METRIC) for s in (0, 1)]
  assert all(32 not in f.curves.fits for f in alone)
  resampled = [float(f.law.predict(inside)) for f in alone]
  estimate = g.prescriptions[0].n_star
  assert max(resampled) < estimate / 1.2
  for pr in g.prescriptions:
    assert pr.interval is None and "n=32 (fitted in 0 of 10 resamples)" in pr.note
  assert g.prescriptions[0].point is not None and not g.prescriptions[0].refused
  assert g.prescriptions[1].refused and g.prescriptions[1].point is None
  assert "n=32" in g.prescriptions[1].note
  assert any("lack n=32" in p for p in g.problems)


def test_a_curve_is_unresampled_once_more_resamples_lack_it_than_the_tail():
  class Sweep:  # what unresampled_curves reads of a pipeline.FrontierFit
    label, metric, unit = "bp=16", METRIC, "rollouts"

    class frontier:  # noqa: N801
      keys, winner = (2, 4, 8), np.array([-1, 1, 1, 2])  # n=2 never attains it

  def boot(n_ok_8, n_failed=0):
    name = "bp=16|val/avg@4|rollouts|curve[n={}].a"
    ivs = {name.format(2): Interval(0.5, 0.4, 0.6, 0),
           name.format(4): Interval(0.5, 0.4, 0.6, 100 - n_failed),
           name.format(8): Interval(0.5, 0.4, 0.6, n_ok_8)}
    return BootstrapResult(ivs, n_boot=100, n_failed=n_failed, level=0.9, stratified=True)

  # The upper tail of a 90 % interval from 100 resamples is 5 of them.
  assert unresampled_curves(boot(95), Sweep) == ()
  assert unresampled_curves(boot(94), Sweep) == ("n=8 (fitted in 94 of 100 resamples)",)
  # n=2 is missing from every resample, but n* never rested on it.
  # Failed resamples lack every curve; their count is judged apart (n_star_interval).
  assert unresampled_curves(boot(85, n_failed=10), Sweep) == ()
  assert unresampled_curves(None, Sweep) == ()
