"""extrapolation_check's summary numbers from their definitions, and the model-free
observed frontier on hand-made points."""

import types

import numpy as np

from isojax.analysis import extrapolation_check, fit_curves, read_runs
from isojax.analysis.extrapolation import observed_frontier

METRIC = "val/avg@4"


def test_observed_frontier_is_the_best_reward_seen_at_or_below_each_compute():
  curves = types.SimpleNamespace(points={4: (np.array([30.0, 10.0, 20.0]),
                                             np.array([0.2, 0.1, 0.3])),
                                         8: (np.array([15.0]), np.array([0.25]))})
  got = observed_frontier(curves, [5, 10, 15, 20, 30, 40])
  np.testing.assert_array_equal(got, [np.nan, 0.1, 0.25, 0.3, 0.3, 0.3])


def test_check_summaries_follow_their_definitions(noisy_sweep):
  runs = read_runs(noisy_sweep).runs
  full = fit_curves(runs, metric=METRIC)
  # A cut on a record point: the cut fits saw it, so it is not held out.
  recs = full.records[16][0]
  c_cut = float(recs[np.argmin(np.abs(np.log(recs / 3e4)))])
  check = extrapolation_check(runs, c_cut=c_cut, metric=METRIC, num=40)
  cut = fit_curves(runs, metric=METRIC, max_compute=c_cut)
  # The grid lies strictly beyond the cut, up to the last data point.
  c_max = max(f.compute_range[1] for f in full.fits.values())
  assert check.compute.size == 40 and check.compute[0] > c_cut
  np.testing.assert_allclose(check.compute[-1], c_max)
  both = np.isfinite(check.predicted) & np.isfinite(check.reference)
  err = (check.predicted - check.reference)[both]
  assert err.size > 0
  np.testing.assert_allclose(check.frontier_rmse, np.sqrt(np.mean(err**2)))
  np.testing.assert_allclose(check.frontier_max_error, np.abs(err).max())
  # Held out: the full data's records beyond the cut, of curves the cut could fit.
  held = np.concatenate([cut.fits[k].predict(c[c > c_cut]) - r[c > c_cut]
                         for k, (c, r) in full.records.items() if k in cut.fits])
  assert check.n_heldout == held.size > 0
  np.testing.assert_allclose(check.heldout_rmse, np.sqrt(np.mean(held**2)))
