"""plan(): n from n*(C) rounded to a power of two, M = floor(C / (Bp n))."""

import warnings

import numpy as np
import pytest

from isojax.analysis import NStarFit, plan, round_pow2
from isojax.analysis.plan import nearest_n
from isojax.budget import BudgetPoint


def law(L=4.0, k=2.0, x0=5.0, b=2.0, unit="rollouts"):
  return NStarFit(L=L, k=k, x0=x0, b=b, rms=0.0, r2=1.0, n_points=10,
                  compute_range=(1e3, 1e7), unit=unit)


def test_round_pow2_is_nearest_in_log2():
  assert [round_pow2(x) for x in (1, 1.4, 1.5, 2.7, 2.9, 3.0, 45.2, 45.3, 0.3)] == \
      [1, 1, 2, 2, 4, 4, 32, 64, 1]  # 2*sqrt(2)=2.83 and 32*sqrt(2)=45.25 are the edges
  with pytest.raises(ValueError):
    round_pow2(float("nan"))


def test_law_past_float_range_predicts_inf_without_a_warning():
  # Bootstrap laws at a search edge reach this; the demo printed an overflow warning.
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert law(L=3000.0).predict(1e9) == np.inf
    assert law().predict(1e5) == pytest.approx(2 ** 4.0)


def test_plan_follows_the_law():
  f = law()
  for budget in (1e4, 1e5, 1e6, 1e7):
    n_star = 2 ** (4.0 / (1 + np.exp(-2.0 * (np.log10(budget) - 5.0))) + 2.0)
    n = 2 ** int(np.floor(np.log2(n_star) + 0.5))
    point = plan(budget, f, bp=32)
    assert isinstance(point, BudgetPoint)
    assert (point.bp, point.n, point.m) == (32, n, int(budget // (32 * n)))
    assert point.compute <= budget


def test_plan_errors_name_the_numbers():
  f = law()  # n* at C=1e3 is ~4.3 -> n=4
  with pytest.raises(ValueError, match=r"budget=100.*bp=32.*n=4.*M = .* = 0 updates"):
    plan(100, f, bp=32)
  with pytest.raises(ValueError, match=r"budget=1e\+07.*bp=1024.*n=64.*b_max = 16384"):
    plan(1e7, f, bp=1024, b_max=16384)
  assert plan(1e7, f, bp=256, b_max=16384).batch == 16384
  with pytest.raises(ValueError, match="tokens"):
    plan(1e7, law(unit="tokens"), bp=32)
  with pytest.raises(ValueError, match="bp must be"):
    plan(1e7, f, bp=0)
  with pytest.raises(ValueError, match="bp must be"):
    plan(1e7, f, bp=True)


def test_plan_takes_numpy_scalars():
  # A budget or Bp read off an array (a run's compute, a sweep's Bp values).
  f = law()
  want = plan(1e5, f, bp=32)
  for budget, bp in ((np.int64(100_000), 32), (np.float32(1e5), 32), (1e5, np.int64(32))):
    got = plan(budget, f, bp=bp)
    assert got == want and type(got.bp) is int and type(got.m) is int


def test_nearest_n_snaps_to_the_study_s_n_and_never_below_two():
  # log2 distance: 12 is nearer 11.9 than 16 is; 8.49 sits just past sqrt(6 x 12) = 8.485.
  assert nearest_n(11.9, [3, 6, 12, 24]) == 12
  assert nearest_n(8.48, [6, 12]) == 6 and nearest_n(8.49, [6, 12]) == 12
  assert [nearest_n(x) for x in (0.3, 1.0, 2.7, 2.9)] == [2, 2, 2, 4]
  assert nearest_n(1.0, [1, 2, 4]) == 1  # a study that ran n = 1 may get it
  assert nearest_n(100, [3, 6, 12, 24], at_most=10) == 6
  with pytest.raises(ValueError, match=r"no n among \[4, 8\] is at most 2"):
    nearest_n(5, [4, 8], at_most=2)
  with pytest.raises(ValueError, match="n_values is empty"):
    nearest_n(5, [])
  # Not an n a study runs: 0 failed inside math.log2, 8.5 was truncated to 8.
  for bad in (0, 8.5, True, "8"):
    with pytest.raises(ValueError, match=rf"n_values must be .* got {bad!r} in"):
      nearest_n(5, [4, bad])
  assert nearest_n(7, (np.int64(4), 8.0)) == 8


def test_plan_uses_the_study_s_n():
  f = law()  # n* at 1e5: 2**(4 / 2 + 2) = 16
  assert plan(1e5, f, bp=32).n == 16
  assert plan(1e5, f, bp=32, n_values=(3, 6, 12, 24)).n == 12
  assert plan(1e5, law(b=-4.0), bp=32).n == 2  # n* = 1: a group needs two
