"""fit_sigmoid / fit_n_star against ground truth written from the formulas."""

import warnings

import numpy as np
import pytest

from isojax.analysis import fit_n_star, fit_sigmoid


def sigmoid(c, a, b, c_mid, r0):
  return r0 + (a - r0) / (1.0 + (c_mid / c) ** b)


def nstar_log2(c, L, k, x0, b):
  return L / (1.0 + np.exp(-k * (np.log10(c) - x0))) + b


C = np.geomspace(1e2, 1e7, 40)


@pytest.mark.parametrize("truth", [
    dict(a=0.7, b=1.3, c_mid=3e4, r0=0.15),
    dict(a=0.35, b=0.6, c_mid=2e3, r0=0.05),
    dict(a=0.9, b=4.0, c_mid=1e6, r0=0.4),
])
def test_sigmoid_zero_noise_is_near_exact(truth):
  fit = fit_sigmoid(C, sigmoid(C, **truth))
  for name, value in truth.items():
    assert getattr(fit, name) == pytest.approx(value, rel=1e-6, abs=1e-9), name
  assert fit.rms < 1e-9 and fit.r2 == pytest.approx(1.0)
  assert fit.flags == ()
  assert fit.compute_range == (C[0], C[-1])


def test_sigmoid_predict_matches_formula():
  fit = fit_sigmoid(C, sigmoid(C, 0.6, 1.1, 1e4, 0.2))
  grid = np.geomspace(10, 1e8, 7)
  np.testing.assert_allclose(fit.predict(grid), sigmoid(grid, 0.6, 1.1, 1e4, 0.2),
                             atol=1e-8)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # C = 0 is the limit R0, not a log(0) warning
    assert fit.predict(0.0) == pytest.approx(0.2, abs=1e-8)


def test_sigmoid_with_fixed_r0():
  fit = fit_sigmoid(C, sigmoid(C, 0.7, 1.3, 3e4, 0.15), r0=0.15)
  assert fit.r0_fixed and fit.r0 == 0.15
  assert fit.a == pytest.approx(0.7, rel=1e-6)
  assert fit.c_mid == pytest.approx(3e4, rel=1e-5)


@pytest.mark.parametrize("seed", range(5))
def test_sigmoid_recovers_parameters_under_noise(seed):
  rng = np.random.default_rng(seed)
  y = sigmoid(C, 0.7, 1.3, 3e4, 0.15) + rng.normal(0, 0.01, C.size)
  fit = fit_sigmoid(C, y)
  assert abs(fit.a - 0.7) < 0.02
  assert abs(fit.r0 - 0.15) < 0.02
  assert fit.b == pytest.approx(1.3, rel=0.15)
  assert fit.c_mid == pytest.approx(3e4, rel=0.2)
  assert 0.005 < fit.rms < 0.015


def test_sigmoid_weights_ignore_zero_weight_outliers():
  y = sigmoid(C, 0.7, 1.3, 3e4, 0.15)
  y_bad = y.copy()
  y_bad[[5, 20, 30]] = [0.9, 0.0, 1.0]
  w = np.ones_like(C)
  w[[5, 20, 30]] = 0
  fit = fit_sigmoid(C, y_bad, weights=w)
  assert fit.a == pytest.approx(0.7, rel=1e-6)
  assert fit_sigmoid(C, y_bad).rms > 0.05  # the outliers do matter unweighted


def test_asymptote_at_one_is_flagged():
  y = sigmoid(C, 1.0, 1.0, 1e4, 0.2)
  fit = fit_sigmoid(C, y)
  assert fit.a == pytest.approx(1.0) and fit.at_bound
  assert any("a=1" in f for f in fit.flags)


def test_asymptote_above_one_is_clipped_and_flagged():
  y = np.minimum(sigmoid(C, 1.3, 1.0, 1e5, 0.1), 1.0)
  fit = fit_sigmoid(C, y)
  assert fit.a <= 1.0 and any("a=1" in f for f in fit.flags)


def test_flat_data_is_flagged_not_fitted_to_noise():
  fit = fit_sigmoid(C, np.full(C.size, 0.3))
  assert fit.a == pytest.approx(0.3) and fit.r0 == pytest.approx(0.3)
  assert any("flat" in f for f in fit.flags)


def test_decreasing_data_gives_a_flat_monotone_fit_flagged():
  fit = fit_sigmoid(C, np.linspace(0.6, 0.2, C.size))
  assert fit.a >= fit.r0
  assert fit.at_bound


def test_early_data_only_flags_c_mid_or_a():
  # All points far below the midpoint: the asymptote is not identified.
  c = np.geomspace(1e1, 1e3, 20)
  fit = fit_sigmoid(c, sigmoid(c, 0.8, 1.0, 1e7, 0.0))
  assert fit.at_bound


def test_zero_r0_is_flagged_as_lower_bound():
  fit = fit_sigmoid(C, sigmoid(C, 0.5, 1.0, 1e4, 0.0))
  assert fit.r0 == pytest.approx(0.0, abs=1e-9)
  assert any("r0=0" in f for f in fit.flags)


def test_too_few_points_is_an_error():
  c = np.array([1e2, 1e3, 1e4, 1e5])
  with pytest.raises(ValueError, match="4 points .* need at least 5"):
    fit_sigmoid(c, sigmoid(c, 0.7, 1.0, 1e3, 0.1))
  with pytest.raises(ValueError, match="need at least 4"):
    fit_sigmoid(c[:3], sigmoid(c[:3], 0.7, 1.0, 1e3, 0.1), r0=0.1)
  fit = fit_sigmoid(c, sigmoid(c, 0.7, 1.0, 1e3, 0.1), r0=0.1)  # 4 points, 3 params
  assert fit.n_points == 4


def test_bad_inputs_are_errors():
  with pytest.raises(ValueError, match="NaN or inf"):
    fit_sigmoid(C, np.where(C > 1e4, np.nan, 0.5))
  with pytest.raises(ValueError, match="compute must be > 0"):
    fit_sigmoid(np.linspace(0, 10, 10), np.ones(10) * 0.2)
  with pytest.raises(ValueError, match="target has 3"):
    fit_sigmoid(C, [0.1, 0.2, 0.3])
  with pytest.raises(ValueError, match="r0 must be in"):
    fit_sigmoid(C, sigmoid(C, 0.7, 1.0, 1e3, 0.1), r0=1.5)
  for r0 in (np.array([0.1]), np.array([0.1, 0.2]), "0.1", True):
    with pytest.raises(ValueError, match=r"fit_sigmoid: r0 must be one number, got"):
      fit_sigmoid(C, sigmoid(C, 0.7, 1.0, 1e3, 0.1), r0=r0)
  assert fit_sigmoid(C, sigmoid(C, 0.7, 1.0, 1e3, 0.1), r0=np.float32(0.1)).r0 == \
      pytest.approx(0.1)


@pytest.mark.parametrize("scale, offset", [(2.0, -1.0), (100.0, 0.0)])
def test_a_reward_outside_zero_one_is_an_error_not_a_curve_at_the_bounds(scale, offset):
  # A reward in [-1, 1] or in percent would be fitted by a curve pinned at A, R0 in
  # [0, 1] (flagged only "r0=0" or "flat"), and a wrong n* read off it.
  y = scale * sigmoid(C, 0.7, 1.3, 3e4, 0.15) + offset
  with pytest.raises(ValueError, match=r"reward must be in \[0, 1\].*rescale"):
    fit_sigmoid(C, y)
  with pytest.raises(ValueError, match=r"reward must be in \[0, 1\]"):
    fit_sigmoid(C, y, r0=0.0)
  fit_sigmoid(C, np.clip(y, 0.0, 1.0))  # the bounds themselves are rewards


@pytest.mark.parametrize("truth", [dict(L=5, k=2, x0=4.5, b=2), dict(L=-3, k=1.2, x0=3, b=7)])
def test_n_star_zero_noise_is_near_exact(truth):
  fit = fit_n_star(C, np.exp2(nstar_log2(C, **truth)))
  for name, value in truth.items():
    assert getattr(fit, name) == pytest.approx(value, rel=1e-6, abs=1e-8), name
  np.testing.assert_allclose(fit.predict_log2(C), nstar_log2(C, **truth), atol=1e-8)
  np.testing.assert_allclose(fit.predict(C), np.exp2(nstar_log2(C, **truth)), rtol=1e-8)
  assert fit.flags == ()


@pytest.mark.parametrize("seed", range(4))
def test_n_star_under_noise(seed):
  rng = np.random.default_rng(seed)
  y = nstar_log2(C, 5, 2, 4.5, 2) + rng.normal(0, 0.2, C.size)
  fit = fit_n_star(C, np.exp2(y))
  assert abs(fit.L - 5) < 0.5 and abs(fit.b - 2) < 0.5
  assert abs(fit.x0 - 4.5) < 0.25 and fit.k == pytest.approx(2, rel=0.3)


def test_n_star_on_power_of_two_staircase_tracks_the_law():
  truth = nstar_log2(C, 5, 2, 4.5, 2)
  fit = fit_n_star(C, np.exp2(np.round(truth)))
  assert np.max(np.abs(fit.predict_log2(C) - truth)) < 0.6


def test_n_star_constant_is_flagged():
  fit = fit_n_star(C, np.full(C.size, 16.0))
  assert np.allclose(fit.predict(C), 16.0)
  assert any("constant" in f for f in fit.flags)


def test_n_star_step_is_flagged_at_k_edge():
  fit = fit_n_star(C, np.where(C < 1e4, 8.0, 64.0))
  assert any("k at upper" in f for f in fit.flags)


def test_n_star_errors():
  with pytest.raises(ValueError, match="need at least 5"):
    fit_n_star([1e2, 1e3, 1e4, 1e5], [4, 8, 16, 16])
  with pytest.raises(ValueError, match="n_star must be > 0"):
    fit_n_star(C, np.zeros(C.size))
  with pytest.raises(ValueError, match=r"unit='rollout'; choose from \['rollouts', "):
    fit_n_star(C, 2.0 ** np.minimum(np.arange(C.size) // 4, 8), unit="rollout")


def test_no_points_is_named_before_the_weights():
  with pytest.raises(ValueError, match="fit_sigmoid: no points to fit"):
    fit_sigmoid([], [])
  with pytest.raises(ValueError, match="fit_n_star: no points to fit"):
    fit_n_star([], [])


def test_repeated_compute_values_count_once():
  # Two seeds at the same three computes: 6 points, but only 3 places the curve is
  # checked, fewer than the 4 a fit with R0 given needs.
  c = np.array([1e3, 2e3, 4e3] * 2)
  r = np.array([0.35, 0.45, 0.52, 0.36, 0.44, 0.53])
  with pytest.raises(ValueError, match="6 points with positive weight at 3 distinct "
                     "compute values; need at least 4"):
    fit_sigmoid(c, r, r0=0.3)
  fit_sigmoid(np.append(c, 8e3), np.append(r, 0.56), r0=0.3)  # a fourth compute does


def test_fit_quality_is_rms_unweighted_and_r2_weighted():
  """rms is over every point as documented; r2 = 1 - sum w e^2 / sum w (y - ybar_w)^2."""
  rng = np.random.default_rng(7)
  w = rng.uniform(0.2, 3.0, C.size)
  y = sigmoid(C, 0.7, 1.3, 3e4, 0.15) + rng.normal(0, 0.03, C.size)
  y2 = nstar_log2(C, 5, 2, 4.5, 2) + rng.normal(0, 0.3, C.size)
  for fit, target, pred in ((fit_sigmoid(C, y, weights=w), y, None),
                            (fit_n_star(C, np.exp2(y2), weights=w), y2, "log2")):
    e = (fit.predict_log2(C) if pred else fit.predict(C)) - target
    ybar = np.sum(w * target) / np.sum(w)
    assert fit.rms == pytest.approx(np.sqrt(np.mean(e**2)), rel=1e-9)
    assert fit.r2 == pytest.approx(1 - np.sum(w * e**2) / np.sum(w * (target - ybar)**2),
                                   rel=1e-9)


def test_decreasing_data_is_fit_by_its_weighted_mean():
  # No rising sigmoid beats a constant on decreasing data; the best constant under
  # weights is the weighted mean.
  y, w = np.linspace(0.6, 0.2, C.size), np.linspace(1.0, 3.0, C.size)
  fit = fit_sigmoid(C, y, weights=w)
  assert fit.a == pytest.approx(np.sum(w * y) / np.sum(w), rel=1e-9)
  assert fit.r0 == pytest.approx(fit.a, rel=1e-9)


def test_a_given_r0_still_bounds_the_asymptote_from_below():
  # The curve is monotone: with R0 given, A >= R0 even when the data fall below it.
  fit = fit_sigmoid(C, np.linspace(0.6, 0.2, C.size), r0=0.5)
  assert fit.r0 == 0.5 and fit.a >= 0.5
  assert any("flat" in f for f in fit.flags)


def test_every_bound_and_search_edge_has_its_flag():
  zero = fit_sigmoid(C, np.zeros(C.size))
  assert "a=0 (lower bound)" in zero.flags
  shallow = fit_sigmoid(C, sigmoid(C, 0.8, 0.005, 1e4, 0.1))  # B below its range
  assert any(f.startswith("b at lower search edge") for f in shallow.flags)
  # A given R0 = 0 is a choice, not a fitted parameter stuck at its bound.
  assert fit_sigmoid(C, sigmoid(C, 0.5, 1.0, 1e4, 0.0), r0=0.0).flags == ()
  for x0 in (0.0, 9.0):  # the law's midpoint far below / beyond the data (1e2..1e7)
    fit = fit_n_star(C, np.exp2(nstar_log2(C, 5, 2, x0, 2)))
    assert any("x0 at a search edge" in f for f in fit.flags), x0


def test_n_star_midpoint_just_beyond_the_data_is_found():
  # x0 is searched NSTAR_X0_MARGIN_DECADES past the data: half a decade is in range.
  for x0 in (1.5, 7.5):
    fit = fit_n_star(C, np.exp2(nstar_log2(C, 5, 2, x0, 2)))
    assert fit.x0 == pytest.approx(x0, abs=1e-6) and fit.flags == ()
