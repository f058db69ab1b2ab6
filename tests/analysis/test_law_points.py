"""The points the n*(C) law is fitted to (Fig. 7 running average, Fig. 15 bins), and the
law they give on runs drawn from a known law."""

import dataclasses
import math

import numpy as np
import pytest
from scipy import optimize

from isojax.analysis import (Frontier, FrontierOptions, fit_frontier, bin_points, fit_law,
                             fit_n_star, law_points, read_runs, running_average_points)
from isojax.analysis.fits import NSTAR_K_RANGE

from . import fake_runs

METRIC = "val/avg@4"
# The known law: log2 n* = L / (1 + exp(-k (log10 C - x0))) + b, n* from 4 to 128.
LAW = dict(L=5.0, k=1.5, x0=4.5, b=2.0)
NS = (4, 8, 16, 32, 64, 128)


def log2_law(c):
  return LAW["L"] / (1 + np.exp(-LAW["k"] * (np.log10(c) - LAW["x0"]))) + LAW["b"]


def curves_from_law(r0=0.1, slope=1.0):
  """Per-n sigmoids whose upper envelope switches from n to 2n where the law crosses
  log2 n + 1/2, i.e. the frontier's n* is the law rounded to a power of two.

  Same R0 and B for all n, A rising with n; each C_mid is solved from the crossing
  R_n(C_x) = R_2n(C_x) in closed form."""
  params = {NS[0]: dict(a=0.5, b=slope, r0=r0, c_mid=1e3 / 3)}
  for small, large in zip(NS, NS[1:]):
    cx = 10 ** optimize.brentq(lambda x: log2_law(10**x) - math.log2(small) - 0.5, 0, 10)
    p = params[small]
    a = p["a"] + 0.05
    ratio = (a - r0) / (p["a"] - r0) * (1 + (p["c_mid"] / cx) ** slope) - 1
    params[large] = dict(a=a, b=slope, r0=r0, c_mid=cx * ratio ** (1 / slope))
  return params


def frontier_of(compute, n_star, reward=None):
  """A Frontier with the given n* staircase (every grid point defined)."""
  compute = np.asarray(compute, float)
  keys = tuple(sorted(set(int(n) for n in n_star)))
  winner = np.array([keys.index(int(n)) for n in n_star])
  reward = np.linspace(0.1, 0.6, compute.size) if reward is None else np.asarray(reward)
  return Frontier(compute=compute, reward=reward, n_star=np.asarray(n_star, np.int64),
                  winner=winner, extrapolated=np.zeros(compute.size, bool), keys=keys,
                  curves=np.tile(reward, (len(keys), 1)),
                  censors=np.zeros((len(keys), compute.size), bool),
                  ends=np.full(len(keys), compute[-1]))


def test_the_construction_has_the_rounded_law_as_its_frontier():
  params = curves_from_law()
  c = np.geomspace(1e2, 1e7, 500)
  rewards = np.array([fake_runs.sigmoid(c, **params[n]) for n in NS])
  n_star = np.array(NS)[rewards.argmax(0)]
  np.testing.assert_array_equal(np.log2(n_star), np.clip(np.round(log2_law(c)), 2, 7))


@pytest.mark.parametrize("method", ["running_average", "bins"])
def test_law_from_runs_with_seed_noise_recovers_the_known_law(tmp_path, method):
  params = curves_from_law()
  fake_runs.make_sweep(tmp_path, configs=[(8, n) for n in NS], budget=1e7,
                       curve=lambda bp, n, c: fake_runs.sigmoid(c, **params[n]),
                       seeds=(0, 1, 2), noise=0.005, run_sigma=0.0025, rho=0.5,
                       n_evals=60, rng_seed=0)
  sweep = fit_frontier(read_runs(tmp_path).runs, metric=METRIC, label="bp=8",
                        options=FrontierOptions(law_points=method))
  law = sweep.law
  assert sweep.law_points.method == method
  # Within +-15 % in n* over the two decades around the law's midpoint.
  c = np.geomspace(10 ** (LAW["x0"] - 1), 10 ** (LAW["x0"] + 1), 200)
  ratio = np.exp2(law.predict_log2(c) - log2_law(c))
  assert np.all((ratio > 0.85) & (ratio < 1.15)), (ratio.min(), ratio.max())
  assert NSTAR_K_RANGE[0] < law.k < NSTAR_K_RANGE[1] and not law.flags
  assert law.k == pytest.approx(LAW["k"], rel=0.3)


def test_running_average_turns_a_single_jump_into_a_ramp():
  c = np.geomspace(1e3, 1e5, 201)  # 100 grid points a decade
  n = np.where(c < 1e4, 4, 16)
  pts = running_average_points(frontier_of(c, n), window_decades=0.5)
  x, y = np.log10(c), np.log2(pts.n_star)
  # Away from the jump the window sees one n; within 0.25 decades it is a linear ramp
  # from log2 4 = 2 to log2 16 = 4 (the share of each side in the window), up to one
  # grid point of the 51 in a window (2/51 in log2).
  far = np.abs(x - 4) > 0.25 + 1e-9
  np.testing.assert_allclose(y[far], np.where(x[far] < 4, 2.0, 4.0))
  near = np.abs(x - 4) < 0.24
  np.testing.assert_allclose(y[near], 3.0 + 2.0 * (x[near] - 4) / 0.5, atol=2 / 51)
  # The law fitted to it has a finite steepness; to the raw staircase, it is a step.
  _, law = fit_law(frontier_of(c, n))
  assert not any("k at" in f for f in law.flags)
  assert any("k at upper" in f for f in fit_n_star(c, n.astype(float)).flags)


def test_running_average_window_shrinks_symmetrically_at_the_ends():
  c = np.geomspace(1e3, 1e5, 201)
  n = np.exp2(np.round(np.linspace(1, 6, c.size)))  # rising staircase
  pts = running_average_points(frontier_of(c, n), window_decades=1.0)
  # The end points average only themselves: no lean towards the interior.
  assert pts.n_star[0] == n[0] and pts.n_star[-1] == n[-1]
  # In the interior: the mean of log2 n over +-0.5 decades, computed here directly.
  x = np.log10(c)
  i = 100
  want = np.mean(np.log2(n)[np.abs(x - x[i]) <= 0.5 + 1e-12])
  assert np.log2(pts.n_star[i]) == pytest.approx(want)
  with pytest.raises(ValueError, match="window_decades"):
    running_average_points(frontier_of(c, n), window_decades=0)


def test_bin_points_are_where_the_frontier_enters_a_higher_bin():
  c = np.array([1e3, 2e3, 4e3, 8e3, 1.6e4, 3.2e4])
  reward = np.array([0.100, 0.103, 0.106, 0.104, 0.121, 0.122])
  n = np.array([4, 4, 8, 8, 16, 32])
  pts = bin_points(frontier_of(c, n, reward), bin_width=0.005)
  # Bins of 0.005: 0.100 (bin 20), 0.103 (same), 0.106 (21), 0.104 (lower),
  # 0.121 (24), 0.122 (same).
  np.testing.assert_array_equal(pts.compute, [1e3, 4e3, 1.6e4])
  np.testing.assert_array_equal(pts.n_star, [4, 8, 16])
  np.testing.assert_array_equal(pts.reward, [0.100, 0.106, 0.121])


def test_unknown_method_is_an_error():
  with pytest.raises(ValueError, match="unknown method 'grid'"):
    law_points.law_points(frontier_of([1, 2, 3, 4, 5], [2, 2, 4, 4, 8]), "grid")


def test_a_frontier_whose_n_star_is_no_sigmoid_is_said_so(tmp_path):
  # n=4 best early and late, n=16 in between: n* goes 4 -> 16 -> 4.
  def curve(bp, n, c):
    bump = 0.02 * np.exp(-np.log10(c / 3e4) ** 2 / 0.1) if n == 16 else 0.0
    return fake_runs.sigmoid(c, 0.6, 1.0, 1e4, 0.1) + bump

  fake_runs.make_sweep(tmp_path, configs=[(8, 4), (8, 16)], budget=8 * 16 * 20000,
                       curve=curve, n_evals=80)
  sweep = fit_frontier(read_runs(tmp_path).runs, metric=METRIC, label="bp=8")
  said = [p for p in sweep.problems if "not a sigmoid" in p]
  assert len(said) == 1 and "4 (from C=" in said[0] and "-> 16 (from C=" in said[0]
  assert sweep.law.r2 < 0.8
  assert any("fewer than 3 values" in p for p in sweep.problems)


@pytest.mark.parametrize("method", ["running_average", "bins"])
def test_censored_grid_points_give_no_law_points(method):
  # The last 6 of 21 grid points are censored (a configuration stopped early might
  # win there): their n* is where that run stopped, not the data's answer.
  c = np.geomspace(1e3, 1e5, 21)
  n = np.exp2(np.round(np.linspace(2, 6, c.size))).astype(int)
  fr = frontier_of(c, n)
  censors = fr.censors.copy()
  censors[0, 15:] = True
  fr = dataclasses.replace(fr, censors=censors)
  pts = law_points.law_points(fr, method, bin_width=0.005)
  assert pts.compute.size == pts.n_star.size == pts.reward.size > 0
  assert pts.compute.max() <= c[14]
  np.testing.assert_array_equal(pts.reward, fr.reward[np.isin(c, pts.compute)])
  if method == "running_average":  # the window never reaches past the decided points
    assert pts.n_star[-1] == n[14]
