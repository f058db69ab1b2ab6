"""Per-n fits, the frontier and n*(C) against synthetic ground truth."""

import dataclasses
import math
import random

import numpy as np
import pytest

from isojax.analysis import (fit_frontier, extrapolation_check, fit_curves, fit_law,
                             fit_n_star, fit_sigmoid, frontier, log_grid, pool_points,
                             read_runs, record_breaking_points)
from isojax.analysis.frontier import END_TOLERANCE

from . import fake_runs

METRIC = "val/avg@4"


def true_envelope(fits, grid):
  """The envelope of the TRUE curves, each from its fit's first data point on and
  held at its value at the last one (the best reward reached with compute <= C)."""
  curves = np.full((len(fits), grid.size), -np.inf)
  keys = sorted(fits)
  for i, n in enumerate(keys):
    lo, hi = fits[n].compute_range
    ok = grid >= lo * (1 - 1e-9)
    curves[i, ok] = fake_runs.sigmoid(np.minimum(grid[ok], hi), **fake_runs.TRUE_PARAMS[n])
  order = np.sort(curves, axis=0)
  return order[-1], order[-2], np.array(keys)[np.argmax(curves, axis=0)]


def test_zero_noise_recovers_every_curve_exactly(clean_sweep):
  curves = fit_curves(read_runs(clean_sweep).runs, metric=METRIC)
  assert sorted(curves.fits) == sorted(fake_runs.TRUE_PARAMS)
  for n, truth in fake_runs.TRUE_PARAMS.items():
    for name, value in truth.items():
      assert getattr(curves.fits[n], name) == pytest.approx(value, rel=1e-6), (n, name)


def test_zero_noise_frontier_and_n_star_are_exact(clean_sweep):
  curves = fit_curves(read_runs(clean_sweep).runs, metric=METRIC)
  fr = frontier(curves.fits)
  best, second, argbest = true_envelope(curves.fits, fr.compute)
  np.testing.assert_allclose(fr.reward, best, atol=1e-8)
  clear = best - second > 1e-6  # exact crossings aside
  assert np.array_equal(fr.n_star[clear], argbest[clear])
  # The frontier moves to larger n as compute grows (paper Fig. 6).
  assert fr.n_star[0] == 4 and fr.n_star[-1] == 64
  assert set(fr.n_star) == {4, 8, 16, 32, 64}


def test_noisy_runs_recover_parameters_frontier_and_law(noisy_sweep, clean_sweep):
  runs = read_runs(noisy_sweep).runs
  curves = fit_curves(runs, metric=METRIC)
  for n, truth in fake_runs.TRUE_PARAMS.items():
    f = curves.fits[n]
    assert abs(f.a - truth["a"]) < 0.03, n
    assert f.c_mid == pytest.approx(truth["c_mid"], rel=0.3), n
    assert f.b == pytest.approx(truth["b"], rel=0.3), n
    assert abs(f.r0 - truth["r0"]) < 0.03, n
  fr = frontier(curves.fits, tie_tol=0.005)
  best, second, argbest = true_envelope(curves.fits, fr.compute)
  assert np.max(np.abs(fr.reward - best)) < 0.03
  clear = best - second > 0.03
  assert clear.sum() > 20 and np.array_equal(fr.n_star[clear], argbest[clear])
  # n*(C) law: compare with the law fitted to the true n*(C) on the same grid.
  law = fit_n_star(*fr.n_star_points())
  true_law = fit_n_star(fr.compute, argbest.astype(float))
  mid = (fr.compute > 1e3) & (fr.compute < 5e5)
  err = np.abs(law.predict_log2(fr.compute) - true_law.predict_log2(fr.compute))
  assert np.max(err[mid]) < 0.75  # within a factor 1.7 of the true law's n*


def test_frontier_does_not_depend_on_mapping_or_run_order(noisy_sweep):
  runs = list(read_runs(noisy_sweep).runs)
  a = fit_curves(runs, metric=METRIC)
  random.Random(0).shuffle(runs)
  b = fit_curves(runs, metric=METRIC)
  for n in a.fits:
    assert a.fits[n] == b.fits[n]
  items = list(a.fits.items())
  random.Random(1).shuffle(items)
  f1, f2 = frontier(a.fits), frontier(dict(items))
  np.testing.assert_array_equal(f1.reward, f2.reward)
  np.testing.assert_array_equal(f1.n_star, f2.n_star)


def test_a_curve_is_held_at_its_last_value_beyond_its_data():
  # n=4 rises fast but its runs stop at C=1e3; n=64 overtakes what n=4 reached only
  # at C ~ 5.9e4. A reward reached at 1e3 is achievable within any larger budget
  # (§4), so n=4 stays n* until then and the frontier never drops.
  c1, c2 = np.geomspace(10, 1e3, 12), np.geomspace(100, 1e5, 12)
  fits = {4: fit_sigmoid(c1, fake_runs.sigmoid(c1, 0.9, 1, 100, 0.1)),
          64: fit_sigmoid(c2, fake_runs.sigmoid(c2, 0.95, 1, 1e4, 0.1))}
  grid = np.geomspace(10, 1e5, 50)
  fr = frontier(fits, grid)
  held4 = np.where(grid >= 10, fake_runs.sigmoid(np.minimum(grid, 1e3), 0.9, 1, 100, 0.1),
                   np.nan)
  only64 = np.where(grid >= 100, fake_runs.sigmoid(grid, 0.95, 1, 1e4, 0.1), -np.inf)
  np.testing.assert_allclose(fr.reward, np.maximum(held4, only64), atol=1e-9)
  assert np.array_equal(fr.n_star, np.where(only64 > held4, 64, 4))
  assert fr.n_star[grid < 5e4].tolist() == [4] * int((grid < 5e4).sum())
  assert set(fr.n_star[grid > 7e4]) == {64}
  assert np.all(np.diff(fr.reward) >= 0) and not fr.extrapolated.any()
  # But n=4's own curve, carried on past its end, stays above n=64's: where n=64
  # wins it does so only because n=4 stopped, so n* is censored there.
  carried4 = fake_runs.sigmoid(grid, 0.9, 1, 100, 0.1)
  want = (fr.n_star == 64) & (carried4 >= only64)
  assert want.sum() >= 3 and np.array_equal(fr.censored, want)
  assert set(fr.censoring()) == {4} and fr.censoring()[4][1] == grid[want][0]
  np.testing.assert_array_equal(fr.n_star_points()[0], grid[~want])
  # Extrapolated, n=4 keeps rising past its data and wins everywhere, marked.
  fx = frontier(fits, grid, extrapolate=math.inf)
  assert np.all(fx.n_star == 4)
  assert np.array_equal(fx.extrapolated, grid > 1e3 * (1 + 1e-9))
  # Allowed up to 10x its data, it is held from there on: still marked.
  f10 = frontier(fits, grid, extrapolate=10.0)
  np.testing.assert_allclose(
      f10.curves[0][grid > 1e4], fake_runs.sigmoid(1e4, 0.9, 1, 100, 0.1), rtol=1e-9)
  assert np.array_equal(f10.extrapolated, (grid > 1e3 * (1 + 1e-9)) & (f10.n_star == 4))
  # Nothing fitted below C=10: undefined there, not invented.
  fu = frontier(fits, [1.0, 50.0])
  assert fu.winner[0] == -1 and math.isnan(fu.reward[0]) and fu.n_star[1] == 4


def test_runs_ending_a_few_rollouts_apart_do_not_decide_the_last_n_star(tmp_path):
  # A budget of 1e6 rollouts at Bp = 8: M = floor(1e6 / (8 n)) ends the runs of
  # n = 4 and 8 at exactly 1e6, those of n = 16..64 at 999,936. The last grid point
  # lies past the larger n's last evaluations: only the held curves let n = 64, the
  # best there by 0.11, take it.
  fake_runs.make_sweep(tmp_path, configs=fake_runs.bp8_configs(), budget=1_000_000,
                       n_evals=60)
  curves = fit_curves(read_runs(tmp_path).runs, metric=METRIC)
  assert len({f.compute_range[1] for f in curves.fits.values()}) > 1
  fr = frontier(curves.fits)
  best, _, argbest = true_envelope(curves.fits, fr.compute)
  np.testing.assert_allclose(fr.reward, best, atol=1e-6)
  assert fr.n_star[-1] == argbest[-1] == 64 and np.all(np.diff(fr.reward) >= -1e-12)
  # Runs of one budget that end a little apart censor nothing.
  assert not fr.censored.any() and fr.n_star_points()[0].size == fr.compute.size


def test_a_curve_that_ended_early_below_the_winner_censors_nothing():
  # n=4 stops at C=1e3, nearly at its plateau of 0.5; n=64, run to 1e5, passes 0.5
  # before 1e3. Carried on, n=4 never reaches n=64 past its end: n* = 64 is decided.
  c1, c2 = np.geomspace(10, 1e3, 12), np.geomspace(100, 1e5, 12)
  fits = {4: fit_sigmoid(c1, fake_runs.sigmoid(c1, 0.5, 1, 10, 0.1)),
          64: fit_sigmoid(c2, fake_runs.sigmoid(c2, 0.95, 1, 1e3, 0.1))}
  fr = frontier(fits, np.geomspace(10, 1e5, 50))
  assert fr.n_star[0] == 4 and set(fr.n_star[fr.compute > 1e3]) == {64}
  assert not fr.censored.any() and fr.censoring() == {}
  # The same n=4 with a ceiling above n=64's would censor the end.
  fits[4] = fit_sigmoid(c1, fake_runs.sigmoid(c1, 0.99, 1, 1e3, 0.1))
  late = frontier(fits, np.geomspace(10, 1e5, 50))
  assert late.n_star[-1] == 64 and late.censored[-1] and set(late.censoring()) == {4}


def test_a_lead_of_0_004_makes_n_star_by_default(tmp_path):
  # n=512 leads n=256 by 0.004 everywhere (less than one 0.005 reward bin). The
  # frontier is the upper envelope: n=512 is n* wherever both are defined.
  def curve(bp, n, c):
    return fake_runs.sigmoid(c, 0.6 + 0.004 * (n == 512), 1.0, 1e4, 0.1)

  fake_runs.make_sweep(tmp_path, configs=[(8, 256), (8, 512)], budget=8 * 512 * 400,
                       curve=curve, n_evals=60)
  sweep = fit_frontier(read_runs(tmp_path).runs, metric=METRIC, label="bp=8")
  both = np.all(np.isfinite(sweep.frontier.curves), axis=0)
  assert both.sum() > 100 and np.all(sweep.frontier.n_star[both] == 512)


def test_tie_tolerance_is_an_explicit_option():
  c = np.geomspace(10, 1e4, 12)
  fits = {8: fit_sigmoid(c, fake_runs.sigmoid(c, 0.600, 1, 100, 0.1)),
          4: fit_sigmoid(c, fake_runs.sigmoid(c, 0.597, 1, 100, 0.1))}
  grid = np.geomspace(1e3, 1e4, 5)
  assert np.all(frontier(fits, grid).n_star == 8)
  tied = frontier(fits, grid, tie_tol=0.005)
  assert np.all(tied.n_star == 4)
  np.testing.assert_allclose(tied.reward, fits[8].predict(grid))  # value stays the max


def test_per_configuration_fit_uses_each_runs_records_not_a_max_over_seeds(tmp_path):
  """Six seeds, each the true curve plus its own offset and a little noise along the
  run. Fitted to each run's records united, the curve follows the seeds' mean;
  records of the seeds pooled into one best-so-far curve follow their maximum."""
  truth = dict(a=0.6, b=1.2, c_mid=1e4, r0=0.1)
  budget = 8 * 16 * 4000
  fake_runs.make_sweep(tmp_path, configs=[(8, 16)], budget=budget,
                       curve=lambda bp, n, c: fake_runs.sigmoid(c, **truth),
                       seeds=tuple(range(6)), noise=0.002, run_sigma=0.01, n_evals=50,
                       rng_seed=1)
  runs = read_runs(tmp_path).runs
  offsets = [np.mean(r - fake_runs.sigmoid(c, **truth))
             for c, r in (run.points(METRIC) for run in runs)]
  late = np.geomspace(budget / 10, budget, 20)
  seeds_mean = fake_runs.sigmoid(late, **truth) + np.mean(offsets)
  per_run = fit_curves(runs, metric=METRIC).fits[16]
  assert np.max(np.abs(per_run.predict(late) - seeds_mean)) < 0.004
  pooled = fit_sigmoid(*record_points_of_pooled(runs))
  assert np.min(pooled.predict(late) - seeds_mean) > 0.008  # what the test guards


def record_points_of_pooled(runs):
  """The procedure the analysis must not use: records of all seeds pooled."""
  c, r = pool_points(runs, METRIC)
  idx = record_breaking_points(c, r)
  return c[idx], r[idx]


def test_tokens_law_is_the_rollout_law_shifted(clean_sweep):
  # Appendix E: with a constant response length the token law is the rollout law with
  # x0 shifted by log10(tokens per rollout) and the same k.
  runs = read_runs(clean_sweep).runs
  laws = {}
  for unit in ("rollouts", "tokens"):
    curves = fit_curves(runs, metric=METRIC, unit=unit)
    fr = frontier(curves.fits, log_grid(curves.fits, 200))
    laws[unit] = fit_n_star(*fr.n_star_points(), unit=unit)
  shift = math.log10(fake_runs.TOKENS_PER_ROLLOUT)
  assert laws["tokens"].x0 == pytest.approx(laws["rollouts"].x0 + shift, abs=1e-3)
  assert laws["tokens"].k == pytest.approx(laws["rollouts"].k, rel=1e-3)
  assert laws["tokens"].unit == "tokens"


def test_best_and_worst_metrics_have_frontiers(clean_sweep):
  runs = read_runs(clean_sweep).runs
  for metric in ("val/best@4", "val/worst@4"):
    curves = fit_curves(runs, metric=metric)
    assert len(curves.fits) == 5
    assert frontier(curves.fits).defined.all()


def test_extrapolation_check_zero_noise_is_accurate(clean_sweep):
  runs = read_runs(clean_sweep).runs
  check = extrapolation_check(runs, c_cut=3e5, metric=METRIC)
  assert check.frontier_max_error < 1e-3
  assert check.heldout_rmse < 1e-3 and check.n_heldout > 0
  assert check.n_star_agreement > 0.95
  assert check.lost == ()


def test_extrapolation_check_reports_what_it_cannot_predict(noisy_sweep):
  runs = read_runs(noisy_sweep).runs
  # n=64 has only a few points below 1e3: it cannot be fitted there.
  check = extrapolation_check(runs, c_cut=1e3, metric=METRIC)
  assert 64 in check.lost
  assert check.frontier_max_error > 0.05  # predicting far out from 1e3 is poor
  with pytest.raises(ValueError, match="leaves no data beyond"):
    extrapolation_check(runs, c_cut=1e9, metric=METRIC)


def test_too_few_records_are_skipped_with_a_reason(tmp_path):
  fake_runs.make_sweep(tmp_path, configs=[(8, 4), (8, 8)], budget=8 * 8 * 500, n_evals=4)
  curves = fit_curves(read_runs(tmp_path).runs, metric=METRIC)
  assert curves.fits == {}
  assert "need at least 5" in curves.skipped[4]
  with pytest.raises(ValueError, match="no fitted curves"):
    frontier(curves.fits)


def test_four_records_fit_with_r0_at_the_base_models_reward(tmp_path):
  # Five evaluations after training, the first still in the base model's bin: four
  # records (the largest n of a sweep has the fewest evaluations). Too few to fit R0
  # as well, so R0 is the step-0 evaluation's reward, and the other three parameters
  # come from the records. Before, the configuration was left out.
  fake_runs.make_sweep(tmp_path, configs=[(8, 16), (8, 64)], budget=8 * 64 * 400,
                       n_evals=5, base_eval=True)
  curves = fit_curves(read_runs(tmp_path).runs, metric=METRIC)
  assert curves.skipped == {}
  for n, fit in curves.fits.items():
    truth = fake_runs.TRUE_PARAMS[n]
    assert fit.n_points == 4 and fit.r0_fixed
    assert fit.r0 == pytest.approx(truth["r0"], abs=1e-9)
    assert [fit.a, fit.b, fit.c_mid] == pytest.approx(
        [truth["a"], truth["b"], truth["c_mid"]], rel=1e-3)
    assert any("r0 = the base model's reward: records at 4 compute values" in f
               for f in fit.flags)
  # An extrapolation check does not call a cut curve with R0 fixed "at a bound".
  fake_runs.make_sweep(tmp_path / "cut", configs=[(8, 16), (8, 64)], budget=8 * 64 * 400,
                       n_evals=6, base_eval=True)
  runs = read_runs(tmp_path / "cut").runs
  cut = fit_curves(runs, metric=METRIC, max_compute=2e5)
  assert cut.fits and all(f.r0_fixed for f in cut.fits.values())
  assert extrapolation_check(runs, c_cut=2e5, metric=METRIC).flagged == ()
  # Two seeds with records at the same compute: four distinct compute values are
  # still too few to fit R0 as well.
  fake_runs.make_sweep(tmp_path / "seeds", configs=[(8, 16)], budget=8 * 64 * 400,
                       n_evals=5, base_eval=True, seeds=(0, 1))
  (fit,) = fit_curves(read_runs(tmp_path / "seeds").runs, metric=METRIC).fits.values()
  assert fit.n_points == 8 and fit.r0_fixed
  # With enough records R0 is fitted, as before.
  fake_runs.make_sweep(tmp_path / "many", configs=[(8, 16)], budget=8 * 64 * 400,
                       n_evals=8, base_eval=True)
  (fit,) = fit_curves(read_runs(tmp_path / "many").runs, metric=METRIC).fits.values()
  assert not fit.r0_fixed and fit.flags == ()


def test_a_configuration_that_never_beats_its_base_bin_says_to_try_a_finer_bin():
  # n = 8 rises from 0.3012 to 0.3049: inside the base model's bin [0.300, 0.305).
  rise = [fake_runs.memory_run(8, 8, s, [1, 2, 4, 8, 16, 32], lambda c: 0.3012 + 0.0037 * (
      1 - 1 / (1 + c / 500)), base=0.3012) for s in (0, 1)]
  grows = [fake_runs.memory_run(8, 4, 0, fake_runs.log_steps(8, 4, 2 ** 12), lambda c:
                                fake_runs.sigmoid(c, a=0.6, b=1.2, c_mid=500, r0=0.3),
                                base=0.3)]
  curves = fit_curves(rise + grows, metric=METRIC)
  assert 4 in curves.fits and 8 not in curves.fits
  assert curves.skipped[8] == ("no evaluation beat the base model's reward bin 0.3 (base "
                               "0.3012, bin width 0.005); try a finer --bin-width")
  finer = fit_curves(rise + grows, metric=METRIC, bin_width=0.0005)
  assert "base model's reward bin" not in finer.skipped.get(8, "")


def test_seeds_evaluated_at_the_same_computes_are_not_extra_points():
  # n = 16's two seeds are evaluated at the same 3 steps (records at 3 distinct
  # computes, 6 points): too few to check a curve even with R0 from the base model.
  curve = lambda c: fake_runs.sigmoid(c, a=0.7, b=1.2, c_mid=2000, r0=0.3)  # noqa: E731
  same = [fake_runs.memory_run(8, 16, s, [4, 16, 64], lambda c, s=s: curve(c) + 0.01 * s,
                               base=0.3) for s in (0, 1)]
  curves = fit_curves(same, metric=METRIC)
  assert curves.records[16][0].size == 6 and np.unique(curves.records[16][0]).size == 3
  assert 16 not in curves.fits
  assert "at 3 distinct compute values; need at least 4" in curves.skipped[16]


def test_runs_of_another_bp_or_difficulty_are_not_pooled_as_seeds():
  curve = lambda c: fake_runs.sigmoid(c, a=0.7, b=1.2, c_mid=2000, r0=0.3)  # noqa: E731
  at8 = fake_runs.memory_run(8, 8, 0, fake_runs.log_steps(8, 8, 2 ** 14), curve)
  at16 = fake_runs.memory_run(16, 8, 0, fake_runs.log_steps(16, 8, 2 ** 14), curve)
  with pytest.raises(ValueError, match=r"runs of n=8 differ in \(difficulty, Bp\).*"
                     r"Bp=8: bp8_n8_s0; difficulty='', Bp=16: bp16_n8_s0"):
    fit_curves([at8, at16], metric=METRIC)
  assert set(fit_curves([at8, at16], metric=METRIC, key="bp_n").fits) == {(8, 8), (16, 8)}
  hard = dataclasses.replace(at8, name="hard_n8", difficulty="hard")
  with pytest.raises(ValueError, match="difficulty='hard', Bp=8: hard_n8"):
    fit_curves([at8, hard], metric=METRIC, key="bp_n")
  # A key function of the caller's pools what it names (recipes pool a recipe's runs).
  assert list(fit_curves([at8, at16], metric=METRIC, key=lambda r: "all").fits) == ["all"]


def test_r0_from_the_base_model_is_the_seeds_mean_below_five_records():
  curve = lambda c: fake_runs.sigmoid(c, a=0.7, b=1.2, c_mid=2000, r0=0.3)  # noqa: E731
  seeds = [fake_runs.memory_run(8, 16, s, [4, 16, 64, 256], curve, base=base)
           for s, base in ((0, 0.30), (1, 0.32))]
  (fit,) = fit_curves(seeds, metric=METRIC).fits.values()
  assert fit.r0_fixed and fit.r0 == pytest.approx(0.31)
  # Records at five distinct compute values are enough to fit R0.
  five = fake_runs.memory_run(8, 16, 0, [4, 16, 64, 256, 1024], curve, base=0.3)
  (fit,) = fit_curves([five], metric=METRIC).fits.values()
  assert not fit.r0_fixed and not any("base model" in f for f in fit.flags)


def test_a_curve_is_supported_up_to_its_last_evaluation_not_its_last_record():
  # The reward stops rising at 8192 rollouts; the run is evaluated on to 65536. The
  # evaluations after the last record show the plateau, so the curve is not held
  # (nor censoring) from 8192 on.
  curve = lambda c: fake_runs.sigmoid(min(c, 8192), a=0.7, b=1.2, c_mid=2000, r0=0.3)  # noqa: E731
  run = fake_runs.memory_run(8, 16, 0, [2 ** e for e in range(10)], curve)
  curves = fit_curves([run], metric=METRIC)
  assert curves.records[16][0].max() <= 8192
  assert curves.fits[16].compute_range == (128.0, 65536.0)


def _exact_fit(c_lo, c_hi, **params):
  c = np.geomspace(c_lo, c_hi, 12)
  return fit_sigmoid(c, fake_runs.sigmoid(c, **params))


def test_a_curve_ending_within_the_end_tolerance_censors_nothing():
  # n=4 ends at 9e3, 10 % before n=64's 2e4 (the spread of one budget's runs);
  # carried on, it stays above n=64, which overtakes its held value near 9.5e3.
  fits = {4: _exact_fit(10, 9e3, a=0.9, b=1, c_mid=1e4, r0=0.1),
          64: _exact_fit(10, 2e4, a=0.9, b=1, c_mid=1.02e4, r0=0.1)}
  grid = np.geomspace(1e3, 2e4, 60)
  fr = frontier(fits, grid)
  assert np.any((fr.n_star == 64) & (grid <= 9e3 * END_TOLERANCE))
  assert not fr.censored[grid <= 9e3 * END_TOLERANCE].any()
  assert END_TOLERANCE >= 1.1 and not fr.censored[grid <= 9.9e3].any()
  # Beyond END_TOLERANCE x its end, the data no longer decide n*.
  assert fr.censored[grid > 9e3 * END_TOLERANCE].all()


def test_a_curve_ended_early_that_would_tie_the_winner_censors():
  # n=64's curve is n=4's, but its runs stopped at 1e3: carried on it ties n=4 (which
  # wins ties, the smaller n), so it might have won: censored past END_TOLERANCE.
  fits = {4: _exact_fit(10, 1e5, a=0.9, b=1, c_mid=1e3, r0=0.1)}
  fits[64] = dataclasses.replace(fits[4], compute_range=(10.0, 1e3))
  grid = np.geomspace(100, 1e5, 30)
  fr = frontier(fits, grid)
  assert np.all(fr.n_star == 4)
  np.testing.assert_array_equal(fr.censored, grid > 1e3 * END_TOLERANCE)
  # A curve that ended early 0.003 below the winner censors only within tie_tol.
  low = dataclasses.replace(fits[4], a=fits[4].a - 0.003, compute_range=(10.0, 1e3))
  assert not frontier({4: fits[4], 64: low}, grid).censored.any()
  tied = frontier({4: fits[4], 64: low}, grid, tie_tol=0.005)
  assert tied.censored[grid > 1e4].all()
  # A configuration stopped at half the budget (the next rung of a budget ladder)
  # ends outside the tolerance: it censors the budget's end.
  half = dataclasses.replace(fits[4], compute_range=(10.0, grid[-1] / 2))
  assert frontier({4: fits[4], 64: half}, grid).censored[-1]


def test_grid_lookups_at_and_just_below_the_data():
  fits = {4: _exact_fit(10, 1e5, a=0.9, b=1, c_mid=1e3, r0=0.1)}
  grid = np.geomspace(10, 1e5, 9)
  fr = frontier(fits, grid)
  assert [fr.index_at(c) for c in (grid[3], grid[3] * 0.999, grid[3] * 1.001)] == [3, 2, 3]
  # A grid computed to within float error of the first data point (1 ulp low) is on it.
  below = frontier(fits, [np.nextafter(10.0, 0.0)])
  assert below.defined[0] and below.n_star[0] == 4


def test_a_grid_given_in_any_order_is_sorted_and_deduplicated():
  # A researcher's own budgets, unsorted and repeated: index_at and the law's running
  # average read the grid as increasing (unsorted, fit_law failed on NaN law points).
  fits = {4: _exact_fit(10, 1e5, a=0.6, b=1, c_mid=1e2, r0=0.1),
          64: _exact_fit(10, 1e5, a=0.9, b=1, c_mid=1e4, r0=0.1)}
  grid = np.geomspace(10, 1e5, 50)
  shuffled = np.concatenate([grid, grid[:10]])[np.random.default_rng(0).permutation(60)]
  fr, ref = frontier(fits, shuffled), frontier(fits, grid)
  np.testing.assert_array_equal(fr.compute, ref.compute)
  np.testing.assert_array_equal(fr.n_star, ref.n_star)
  assert fr.index_at(1e3) == ref.index_at(1e3)
  assert fit_law(fr)[1] == fit_law(ref)[1]


def test_a_curve_key_that_names_no_n_is_an_error_naming_it():
  # n* is read off the keys: a label such as "n=16" failed inside int(), 2.5 gave
  # n* = 2 and 0 gave n* = 0 without a word, mixed keys failed inside sorted().
  fit = _exact_fit(10, 1e5, a=0.6, b=1, c_mid=1e2, r0=0.1)
  for bad in ("n=16", 2.5, 0, True):
    with pytest.raises(ValueError, match=f"curve key {bad!r} names no n"):
      frontier({bad: fit, 8: fit})
  with pytest.raises(ValueError, match="keys mix n and"):
    frontier({4: fit, (8, 8): fit})
  assert frontier({np.int64(4): fit, 8.0: fit}).n_star[0] == 4
  assert frontier({(8, 4): fit, (16, 4): fit}).n_star[0] == 4
