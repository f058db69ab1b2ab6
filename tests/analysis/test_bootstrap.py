"""bootstrap(): k - 1 runs resampled per stratum, t intervals that cover at their level."""

import dataclasses
import math

import numpy as np
import pytest

from isojax.analysis import bootstrap


@dataclasses.dataclass(frozen=True)
class FakeRun:
  name: str
  values: tuple
  group: str = "g"


def mean_of_points(runs):
  return float(np.mean([v for r in runs for v in r.values]))


def test_resamples_k_minus_one_whole_runs():
  # Run a has 1 point of value 0, run b has 99 points of value 1. Each resample
  # draws k - 1 = 1 whole run: {a}: 0 or {b}: 1, never a pooled point mix.
  runs = [FakeRun("a", (0.0,)), FakeRun("b", (1.0,) * 99)]
  seen = set()

  def fn(rs):
    seen.add(tuple(sorted(r.name for r in rs)))
    return mean_of_points(rs)

  res = bootstrap(runs, fn, n_boot=200, seed=0, level=0.9)
  assert seen == {("a", "b"), ("a",), ("b",)}  # the estimate, then the resamples
  iv = res["value"]
  assert iv.estimate == pytest.approx(0.99) and iv.n_ok == 200
  # estimate -/+ t(0.95, 1 dof) x sd of a fair 0/1 draw
  assert iv.high - iv.estimate == pytest.approx(iv.estimate - iv.low)
  assert iv.high - iv.estimate == pytest.approx(6.314 * 0.5, rel=0.05)
  assert res.n_boot == 200 and res.n_failed == 0


def test_a_stratum_mean_gets_the_unbiased_standard_error_and_t_quantile():
  # Runs 0, 1, 2: s = 1, so the mean's standard error is 1 / sqrt(3); the plain
  # bootstrap would give sqrt(2/3) of it. The 90 % interval is t(0.95, 2) = 2.920 x that.
  runs = [FakeRun(f"r{i}", (float(i),)) for i in range(3)]
  iv = bootstrap(runs, mean_of_points, n_boot=4000, seed=0, level=0.9)["value"]
  assert (iv.high - iv.low) / 2 == pytest.approx(2.920 / np.sqrt(3), rel=0.03)


def test_intervals_from_three_runs_cover_at_their_level():
  # The property the module exists for: with 3 seeds per configuration a 90 %
  # interval of a configuration's mean covers the true mean ~90 % of the time
  # (the plain percentile bootstrap covered ~70 %).
  rng = np.random.default_rng(0)
  covered = []
  for trial in range(400):
    runs = [FakeRun(f"{g}{i}", (rng.normal(),), g) for g in "ab" for i in range(3)]
    res = bootstrap(runs, lambda rs: {g: mean_of_points([r for r in rs if r.group == g])
                                      for g in "ab"},
                    n_boot=100, seed=trial, strata=lambda r: r.group)
    covered += [res[g].low <= 0.0 <= res[g].high for g in "ab"]
  assert 0.86 <= np.mean(covered) <= 0.97


def test_deterministic_and_order_independent():
  rng = np.random.default_rng(0)
  runs = [FakeRun(f"r{i}", tuple(rng.normal(size=5))) for i in range(12)]
  a = bootstrap(runs, mean_of_points, n_boot=100, seed=3)
  b = bootstrap(runs[::-1], mean_of_points, n_boot=100, seed=3)
  c = bootstrap(runs, mean_of_points, n_boot=100, seed=4)
  assert a == b and a != c
  iv = a["value"]
  assert iv.low < iv.estimate < iv.high


def test_interval_covers_the_spread_of_run_means():
  # 40 runs with means ~ N(0.5, 0.1): a 90% interval of the mean has half-width
  # about 1.685 * 0.1 / sqrt(40) = 0.027.
  rng = np.random.default_rng(1)
  runs = [FakeRun(f"r{i}", (0.5 + rng.normal(0, 0.1),)) for i in range(40)]
  iv = bootstrap(runs, mean_of_points, n_boot=400, seed=0, level=0.9)["value"]
  assert 0.015 < (iv.high - iv.low) / 2 < 0.04


def test_log_scale_and_degrees_of_freedom_per_quantity():
  runs = [FakeRun(f"r{i}", (v,)) for i, v in enumerate([8.0, 16.0, 32.0, 64.0])]
  fn = lambda rs: {"n": mean_of_points(rs), "m": mean_of_points(rs)}
  res = bootstrap(runs, fn, n_boot=300, seed=0, log_scale=lambda name: name == "n",
                  dof=lambda name: 30 if name == "m" else 3)
  n, m = res["n"], res["m"]
  assert n.low > 0 and n.low * n.high == pytest.approx(n.estimate ** 2)  # symmetric in log
  assert m.high - m.estimate == pytest.approx(m.estimate - m.low)
  assert (m.high - m.low) < (n.high - n.low)  # 30 dof: a smaller t quantile than 3


def test_a_few_unbounded_resamples_widen_the_interval_never_narrow_it():
  # An n* that overflows in 1 resample of 64 is below the percentile tail: the
  # interval must still be at least the finite resamples' own.
  runs = [FakeRun(f"r{i}", (v,)) for i, v in enumerate([20.0, 40.0, 60.0, 100.0])]

  def n_star(rs, overflow):
    if overflow and [r.name for r in rs] == ["r3"] * 3:
      return math.inf
    return float(np.exp(np.mean([np.log(r.values[0]) for r in rs])))

  kw = dict(n_boot=400, seed=0, log_scale=lambda name: True)
  finite = bootstrap(runs, lambda rs: n_star(rs, False), **kw)["value"]
  some = bootstrap(runs, lambda rs: n_star(rs, True), **kw)["value"]
  assert some.n_ok == 400 and math.isfinite(some.high)
  # The percentile interval alone would span ~60 % of the t interval's ratio.
  assert some.high / some.low > 0.9 * finite.high / finite.low


def test_no_estimate_no_interval():
  runs = [FakeRun(f"r{i}", (float(i),)) for i in range(3)]
  res = bootstrap(runs, lambda rs: {"x": 1.0, "y": math.nan if len(rs) == 3 else 2.0},
                  n_boot=20, seed=0)
  assert math.isnan(res["y"].low) and res["y"].n_ok == 20


def test_intervals_are_cut_to_what_the_quantity_can_take():
  runs = [FakeRun(f"r{i}", (v,)) for i, v in enumerate([0.9, 1.0, 0.95])]
  free = bootstrap(runs, mean_of_points, n_boot=200, seed=0)["value"]
  cut = bootstrap(runs, mean_of_points, n_boot=200, seed=0,
                  support=lambda name: (0.0, 1.0))["value"]
  assert free.high > 1.0 and cut.high == 1.0 and cut.low == free.low


def test_strata_keep_every_group_and_failures_are_counted():
  runs = [FakeRun("a1", (0.0,), "a"), FakeRun("b1", (1.0,), "b"), FakeRun("b2", (3.0,), "b")]

  def fn(rs):
    groups = {r.group for r in rs}
    if groups != {"a", "b"}:
      raise ValueError("a group vanished")
    return {"a": mean_of_points([r for r in rs if r.group == "a"]),
            "b": mean_of_points([r for r in rs if r.group == "b"])}

  res = bootstrap(runs, fn, n_boot=50, seed=0, strata=lambda r: r.group)
  assert res.stratified and res.n_failed == 0
  assert res["a"].low == res["a"].high == 0.0  # one run: always itself
  assert res["b"].low < 1.0 and res["b"].high > 3.0  # 2 runs: t on 1 dof
  plain = bootstrap(runs, fn, n_boot=50, seed=0)
  assert plain.n_failed > 0 and plain["b"].n_ok == 50 - plain.n_failed


def test_errors():
  with pytest.raises(ValueError, match="no runs"):
    bootstrap([], mean_of_points)
  with pytest.raises(ValueError, match="n_boot"):
    bootstrap([FakeRun("a", (1.0,))], mean_of_points, n_boot=0)
  with pytest.raises(ValueError, match="level"):
    bootstrap([FakeRun("a", (1.0,))], mean_of_points, level=1.5)
  with pytest.raises(ValueError, match="every stratum has one run"):
    bootstrap([FakeRun("a", (1.0,), "x"), FakeRun("b", (2.0,), "y")], mean_of_points,
              strata=lambda r: r.group)


def test_infinite_values_make_an_unbounded_interval():
  # n* from a law can overflow to inf in some resamples: that is an unbounded
  # estimate, and dropping it would leave a finite interval.
  runs = [FakeRun(f"r{i}", (v,)) for i, v in enumerate([32.0, 64.0, 128.0] + [np.inf] * 3)]
  res = bootstrap(runs, lambda rs: max(r.values[0] for r in rs), n_boot=200, seed=0)
  assert res["value"].n_ok == 200 and res["value"].high == np.inf
  assert res["value"].low in (64.0, 128.0, np.inf)
  # NaN is still "no value" for that resample.
  nan = bootstrap(runs, lambda rs: np.nan if len({r.name for r in rs}) < 4 else 1.0,
                  n_boot=50, seed=0)
  assert 0 < nan["value"].n_ok < 50


@pytest.mark.parametrize("values", [[1.0, 2.0, 3.0, np.inf], [-np.inf, 1.0, 2.0, 3.0],
                                    [1.0, np.inf, np.inf, np.inf], [-np.inf, 2.0, 2.0, 5.0]])
def test_percentiles_with_infinite_values_are_numpys_limits(values):
  from isojax.analysis.bootstrap import _percentiles
  qs = [0, 5, 50, 95, 100]
  got = _percentiles(values, qs)
  big = 1e300  # NumPy's linear percentile on a stand-in finite value, then its limit
  finite = np.clip(values, -big, big)
  for q, g in zip(qs, got):
    want = np.percentile(finite, q)
    want = np.inf if want > 1e299 else -np.inf if want < -1e299 else want
    assert g == pytest.approx(want, rel=1e-12), (values, q)
  assert _percentiles([3.0, 1.0, 2.0], qs) == list(np.percentile([1.0, 2.0, 3.0], qs))


def test_partly_replicated_sweeps_say_which_configurations_add_no_seed_noise(tmp_path):
  from isojax.analysis import analyze, read_runs
  from . import fake_runs
  fake_runs.make_sweep(tmp_path, configs=[(8, 4), (8, 8), (8, 16)], budget=8 * 64 * 200,
                       n_evals=20)
  fake_runs.make_sweep(tmp_path, configs=[(8, 32)], seeds=(0, 1), budget=8 * 64 * 200,
                       n_evals=20, noise=0.01)
  g = analyze(list(read_runs(tmp_path).runs), n_boot=4).groups[0]
  assert g.intervals.stratified
  assert ("bootstrap: 3 of 4 configurations have one run, which resampling within "
          "configurations cannot vary") in " ".join(g.problems)


def test_one_run_per_configuration_gets_no_intervals_and_says_why(tmp_path):
  from isojax.analysis import analyze, read_runs
  from . import fake_runs
  fake_runs.make_sweep(tmp_path, configs=[(8, 4), (8, 8), (8, 16)], budget=8 * 64 * 200,
                       n_evals=20, noise=0.01)
  g = analyze(list(read_runs(tmp_path).runs), n_boot=4).groups[0]
  assert g.intervals is None and g.prescriptions
  assert all(p.interval is None for p in g.prescriptions)
  assert ("bootstrap: every configuration has one run, so run-to-run variation cannot "
          "be estimated") in " ".join(g.problems)


def test_a_curve_interval_uses_its_own_configuration_s_degrees_of_freedom(tmp_path):
  # n = 4 has 2 seeds, n = 8 has 5: n = 8's curve rests on 4 degrees of freedom,
  # not on the 1 of the smallest configuration (t 2.13 instead of 6.31).
  from isojax.analysis import analyze, read_runs
  from isojax.analysis.intervals import _curve_dofs
  from . import fake_runs
  fake_runs.make_sweep(tmp_path, configs=[(8, 4), (8, 16)], seeds=(0, 1),
                       budget=8 * 64 * 200, n_evals=20, noise=0.01, run_sigma=0.01)
  fake_runs.make_sweep(tmp_path, configs=[(8, 8)], seeds=tuple(range(5)),
                       budget=8 * 64 * 200, n_evals=20, noise=0.01, run_sigma=0.01)
  g = analyze(list(read_runs(tmp_path).runs), n_boot=4).groups[0]
  dofs = _curve_dofs(g.sweeps, g.fixed_batches)
  assert {d for name, d in dofs.items() if "curve[n=8]" in name} == {4}
  assert {d for name, d in dofs.items() if "curve[n=4]" in name} == {1}
