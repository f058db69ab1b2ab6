"""Prescriptions: the joint law when the runs hold a joint study (App. C), the smallest
stable Bp, the law named everywhere, and no extrapolation from a law that does not pin
n* down."""

import dataclasses
import json
import os
import types

import numpy as np
import pytest

from isojax.analysis import (LawChoice, NStarFit, analyze, choose_law, fits_dict, prescribe,
                             read_runs, report_markdown)
from isojax.analysis import pipeline
from isojax.analysis.bootstrap import BootstrapResult, Interval
from isojax.analysis.frontier import Frontier
from isojax.analysis.prescriptions import (_unfitted_n, default_budgets, is_joint_study,
                                           n_grid_censored, n_star_interval, n_star_key)
from isojax.analysis.stability import collapsed
from isojax.budget import BudgetPoint

from . import fake_runs

GRID = [(bp, n) for bp in (4, 8, 16) for n in (4, 8, 16, 32, 64)]
METRIC = "val/avg@4"


def law(compute_range=(1e3, 1e6), **kw):
  p = dict(L=4.0, k=2.0, x0=4.5, b=2.0) | kw
  return NStarFit(rms=0.0, r2=1.0, n_points=50, compute_range=compute_range, **p)


def _write_grid(root, configs, unstable=(), collapse=()):
  """A sweep on `configs`; the runs of (bp, n) in `unstable` skip one update, those
  in `collapse` fall back to the base model's reward over their last third."""
  rng = np.random.default_rng(0)
  for bp, n in configs:
    m = 8 * 64 * 500 // (bp * n)
    curve = lambda c, bp=bp, n=n: fake_runs.true_reward(bp, n, c)  # noqa: E731
    rows = fake_runs.run_rows(bp, n, m, curve, rng=rng, n_evals=40, base_eval=True)
    if (bp, n) in unstable:
      rows[len(rows) // 2]["train/skipped"] = 1.0
    if (bp, n) in collapse:
      for row in rows[-len(rows) // 3:]:
        row["val/avg@4"] = rows[0]["val/avg@4"]
    for row in rows:
      row.setdefault("train/skipped", 0.0)
    fake_runs.write_run(os.path.join(root, f"bp{bp}_n{n}"),
                        {"bp": bp, "n": n, "m": m, "seed": 0}, rows)


def test_joint_study_prescribes_from_the_joint_law_at_the_smallest_stable_bp(tmp_path):
  _write_grid(tmp_path, GRID, unstable={(4, 16)})
  result = read_runs(tmp_path)
  analysis = analyze(list(result.runs), n_boot=0, budgets=[2e4, 2e5])
  g = analysis.groups[0]
  choice = g.law_choice
  assert choice.label == "joint" and choice.joint
  joint = next(s for s in g.sweeps if s.label == "joint")
  assert choice.law is joint.law
  assert choice.bp == 8  # Bp=4 had a run that skipped an update
  assert "App. C" in choice.reason and "Bp=8" in choice.reason and "[4]" in choice.reason
  for pr in g.prescriptions:
    assert pr.law == "joint" and pr.point.bp == 8
    assert pr.point.n == 2 ** round(float(np.log2(joint.law.predict(pr.budget))))
  # Said in fits.json and report.md too.
  fits = fits_dict(analysis)["groups"]["all"]
  assert (fits["prescription_law"]["label"], fits["prescription_law"]["bp"]) == ("joint", 8)
  assert all(p["law"] == "joint" for p in fits["prescriptions"])
  assert f"From {choice.reason}." in report_markdown(analysis)


def test_a_run_that_collapses_makes_its_bp_unstable(tmp_path):
  # No skipped update, no NaN: the run learned, then fell back to the base model
  # (§3's instability). Its records keep the peak, so only the run itself shows it.
  _write_grid(tmp_path, GRID, collapse={(4, 64)})
  runs = list(read_runs(tmp_path).runs)
  assert [r.name for r in runs if collapsed(r, "val/avg@4")] == ["bp4_n64"]
  g = analyze(runs, n_boot=0, budgets=[2e5]).groups[0]
  assert g.law_choice.bp == 8 and "[4]" in g.law_choice.reason


def test_what_counts_as_a_collapse():
  def run(rewards, base=0.30):
    return fake_runs.PointsRun([0] + list(range(1, len(rewards) + 1)), [base] + rewards)
  rise = [0.35, 0.45, 0.55, 0.55, 0.55]
  assert not collapsed(run(rise + [0.54, 0.55, 0.55]), METRIC)  # a plateau
  assert collapsed(run(rise + [0.40, 0.35, 0.30]), METRIC)  # lost 0.25 of 0.25
  # Lost less than half of the gain: stable; a gain under 0.05 is noise.
  assert not collapsed(run(rise + [0.43, 0.43, 0.43]), METRIC)
  assert collapsed(run(rise + [0.42, 0.42, 0.42]), METRIC)
  assert not collapsed(run([0.31, 0.34, 0.30, 0.30, 0.30]), METRIC)
  assert not collapsed(fake_runs.PointsRun(list(range(1, 9)), rise + [0.3] * 3), METRIC)  # no base
  # One noisy high evaluation is not a peak to fall from.
  assert not collapsed(run([0.32, 0.40, 0.33, 0.34, 0.33, 0.34]), METRIC)
  # Nor is a run still rising steeply at its end (log-spaced evaluations): its last
  # quarter averages below its last evaluation, but nothing came before to fall from.
  assert not collapsed(run([0.30] * 12 + [0.32, 0.36, 0.45, 0.60]), METRIC)


def test_a_collapse_is_seen_whatever_the_evaluation_schedule():
  # Learned 0.3 by 40 % of the compute, back at the base reward from 80 % on. With
  # evaluations spaced evenly in log compute most of them come early: the last
  # quarter of the evaluations would span nearly the whole run and hide the fall.
  point = BudgetPoint.from_budget(2e6, bp=32, n=8)
  for steps in (range(10, point.m + 1, 10), point.log_spaced_steps(8)):
    c = np.array(list(steps), float) * point.sampled_batch
    up, down = np.minimum(c / 8e5, 1), np.clip(1 - (c - 8e5) / 8e5, 0, 1)
    r = 0.3 + 0.3 * np.where(c <= 8e5, up, down)
    assert collapsed(fake_runs.PointsRun([0, *c], [0.3, *r]), METRIC)
    assert not collapsed(fake_runs.PointsRun([0, *c], [0.3, *(0.3 + 0.3 * up)]), METRIC)


def test_bp_asked_for_is_used_with_the_joint_law(tmp_path):
  _write_grid(tmp_path, GRID)
  g = analyze(list(read_runs(tmp_path).runs), n_boot=0, bp=16).groups[0]
  assert g.law_choice.label == "joint" and g.law_choice.bp == 16
  assert "Bp=16 as asked" in g.law_choice.reason


def test_fixed_bp_study_prescribes_at_its_own_bp_and_says_so_elsewhere(tmp_path):
  # One Bp with all n, plus single runs at other Bp: no joint study.
  configs = fake_runs.bp8_configs() + [(16, 8), (32, 4)]
  _write_grid(tmp_path, configs)
  runs = list(read_runs(tmp_path).runs)
  assert not is_joint_study(runs)
  g = analyze(runs, n_boot=0).groups[0]
  assert (g.law_choice.label, g.law_choice.bp, g.law_choice.joint) == ("bp=8", 8, False)
  assert all(pr.point.bp == 8 for pr in g.prescriptions if pr.point is not None)
  other = choose_law(g.sweeps, runs, primary=g.primary, primary_bp=8, bp=64)
  assert other.law is g.primary.law and other.bp == 64
  assert "measured at Bp=8" in other.reason and "App. B" in other.reason


def test_a_wide_interval_is_refused_with_the_reason_at_every_budget():
  choice = LawChoice("joint", law(), bp=32, joint=True, reason="test")
  inside, wide_inside, beyond, far = 1e5, 2e5, 5e6, 1e7
  out = prescribe(choice, [inside, wide_inside, beyond, far],
                  intervals={inside: (10.0, 60.0), wide_inside: (2.0, 40.0),
                             beyond: (20.0, 150.0), far: (10.0, 90.0)})
  # 60/10 = 6 and 150/20 = 7.5 are within a factor of 8; 40/2 = 20 and 90/10 = 9 not.
  assert [p.refused for p in out] == [False, True, False, True]
  assert [p.point is None for p in out] == [False, True, False, True]
  assert "[2, 40]" in out[1].note and "even inside its data" in out[1].note
  assert "[10, 90]" in out[3].note and "factor of 8" in out[3].note
  assert "beyond its data" in out[3].note
  assert all(p.law == "joint" for p in out)


def test_an_extrapolation_without_an_interval_is_refused():
  choice = LawChoice("bp=32", law(), bp=32, joint=False, reason="test")
  inside, beyond = prescribe(choice, [1e5, 1e7])
  assert inside.point is not None and not inside.refused
  assert beyond.refused and beyond.point is None
  assert "no bootstrap interval of n*" in beyond.note and "two seeds" in beyond.note
  (unbounded,) = prescribe(choice, [1e7], intervals={1e7: (4.0, float("inf"))})
  assert unbounded.refused


def test_one_configuration_prescribes_inside_its_data_only():
  steps = fake_runs.log_steps(16, 4, 2 ** 14)
  one = [fake_runs.memory_run(16, 4, 0, steps, lambda c: fake_runs.sigmoid(
      c, a=0.6, b=1.2, c_mid=3000, r0=0.3), base=0.3)]
  g = analyze(one, n_boot=20).groups[0]
  assert g.intervals is None
  *inside, beyond = g.prescriptions
  assert all(p.point is not None and p.point.n == 4 for p in inside)
  assert beyond.extrapolated and beyond.refused
  assert "largest n tried (4)" in beyond.note and "no bootstrap interval" in beyond.note


def test_a_prescription_the_frontier_disagrees_with_says_so():
  # The law: n* = 4 * 2**(4 / (1 + e**(-2 (log10 C - 4.5)))) = 21.0 at C = 5e4 (n = 16)
  # and 40.2 at 2e5 (n = 32); the frontier's n* is 8 from 3e4 to 1e5, 32 from 1e5 on.
  fr = types.SimpleNamespace(compute=np.array([1e3, 3e4, 1e5, 1e6]),
                             n_star=np.array([4, 8, 32, 32]),
                             defined=np.array([True] * 4),
                             censoring_at=lambda c: ())
  fr.index_at = lambda c: Frontier.index_at(fr, c)
  choice = LawChoice("bp=32", law(), bp=32, joint=False, reason="test", frontier=fr)
  at_5e4, at_2e5 = prescribe(choice, [5e4, 2e5])
  assert at_5e4.point.n == 16 and at_2e5.point.n == 32
  assert "the frontier's n* here is 8, not the law's 21 (n=16)" in at_5e4.note
  assert "frontier" not in at_2e5.note


def test_a_budget_below_the_data_is_an_extrapolation_too():
  choice = LawChoice("bp=32", law(compute_range=(1e5, 1e7)), bp=32, joint=False,
                     reason="test")
  below, inside = prescribe(choice, [1e3, 1e6], intervals={1e3: (2.0, 90.0)})
  assert below.extrapolated and below.refused and not inside.extrapolated


def test_resamples_without_a_law_leave_the_upper_end_unknown():
  def boot(n_ok, high=40.0):
    iv = Interval(estimate=20.0, low=10.0, high=high, n_ok=n_ok)
    return BootstrapResult(intervals={n_star_key(1e7): iv}, n_boot=100, n_failed=0,
                           level=0.9, stratified=False)
  # Up to the upper tail (5 of 100 at 90 %), missing resamples cannot move it.
  assert n_star_interval(boot(95), 1e7) == (10.0, 40.0)
  assert n_star_interval(boot(94), 1e7) == (10.0, float("inf"))
  assert n_star_interval(boot(0), 1e7) is None and n_star_interval(None, 1e7) is None
  assert n_star_interval(boot(100), 1e6) is None
  nan = Interval(estimate=20.0, low=float("nan"), high=float("nan"), n_ok=1)
  assert n_star_interval(BootstrapResult({n_star_key(1e7): nan}, 100, 0, 0.9, True),
                         1e7) == (0.0, float("inf"))
  choice = LawChoice("bp=32", law(), bp=32, joint=False, reason="test")
  (pr,) = prescribe(choice, [1e7], intervals={1e7: n_star_interval(boot(90), 1e7)})
  assert pr.refused and "[10, inf]" in pr.note


def test_a_larger_n_the_law_never_saw_is_named():
  # A configuration left out of the frontier (too few records) at an n above the
  # prescribed one: the law cannot have picked it, so the prescription says so.
  choice = LawChoice("bp=32", law(), bp=32, joint=False, reason="test",
                     unfitted_n=(2, 1024))
  small, large = prescribe(choice, [1e3, 1e6])
  assert small.point.n == 4 and "n=[1024] had too few record points" in small.note
  assert large.point.n == 64 and "n=[1024]" in large.note
  below = LawChoice("bp=32", law(), bp=32, joint=False, reason="test", unfitted_n=(2,))
  assert prescribe(below, [1e6])[0].note == ""
  # In a joint study an n skipped at one Bp but fitted at another was seen by the law.
  curves = types.SimpleNamespace(fits={(8, 64): None, (4, 4): None},
                                 skipped={(4, 64): "3 records", (4, 128): "2 records"})
  assert _unfitted_n(types.SimpleNamespace(curves=curves)) == (128,)


def test_an_infeasible_n_gives_way_to_the_nearest_that_fits_and_says_so():
  # n* at 1e6 is 2**(4 / (1 + e^-3) + 2) = 56.1 -> 64, but Bp=1024 x 64 exceeds b_max
  # = 4096: n = 4096 / 1024 = 4 is the largest that fits.
  choice = LawChoice("bp=32", law(), bp=1024, joint=False, reason="test")
  (pr,) = prescribe(choice, [1e6], b_max=4096)
  assert pr.point == BudgetPoint(bp=1024, n=4, m=int(1e6 // 4096))
  assert "b_max = 4096" in pr.note and "n=4, the nearest n that fits" in pr.note
  # With the study's n, the nearest of those that fits.
  tried = dataclasses.replace(choice, n_values=(3, 6, 12, 24))
  (pr,) = prescribe(tried, [1e6], b_max=4096)
  assert pr.point.n == 3 and "n=3, the nearest n tried that fits" in pr.note
  # Nothing fits: reported, not raised.
  (none,) = prescribe(choice, [1000.0], b_max=1024)
  assert none.point is None and not none.refused and "b_max = 1024" in none.note


def test_n_is_snapped_to_the_study_s_n_and_held_to_two():
  # n* = 2**(4 / (1 + e^(-2 (log10 C - 4.5))) + b): 12.19 at C = 2e4 with b = 2,
  # 0.57 at C = 1e3 with b = -1.
  choice = LawChoice("bp=32", law(), bp=32, joint=False, reason="test",
                     n_values=(3, 6, 12, 24))
  (at_2e4,) = prescribe(choice, [2e4])
  assert at_2e4.n_star == pytest.approx(12.19, abs=0.005)
  assert at_2e4.point.n == 12 and at_2e4.note == ""  # 16 was never tried
  # A law below n = 2 is held to the smallest n allowed.
  low = LawChoice("bp=32", law(b=-1.0), bp=32, joint=False, reason="test")
  (pr,) = prescribe(low, [1e3])
  assert pr.point.n == 2 and "below the smallest n a group-normalised" in pr.note
  (pr,) = prescribe(dataclasses.replace(low, n_values=(4, 8)), [1e3])
  assert pr.point.n == 4 and "below the smallest n tried (4)" in pr.note


def test_runs_with_non_finite_values_make_their_bp_unstable(tmp_path):
  _write_grid(tmp_path, GRID)
  path = tmp_path / "bp4_n8" / "metrics.jsonl"
  rows = [json.loads(line) for line in path.read_text().splitlines()]
  rows[3]["train/loss"] = float("nan")
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  result = read_runs(tmp_path)
  g = analyze(list(result.runs), n_boot=0, load_problems=result.problems).groups[0]
  assert g.law_choice.bp == 8


@pytest.mark.parametrize("configs, joint", [
    ([(8, 4), (8, 8), (16, 4), (16, 8)], True),
    ([(8, 4), (8, 8), (16, 4)], False),   # only Bp=8 has two n
    ([(64, 4), (32, 8), (16, 16)], False),  # a fixed-batch study
])
def test_what_counts_as_a_joint_study(tmp_path, configs, joint):
  _write_grid(tmp_path, configs)
  assert is_joint_study(read_runs(tmp_path).runs) == joint


def _memory_sweep(ns, curve, c_max=2 ** 17, seeds=(0, 1)):
  """Bp=16 runs at each n, on noise-free curves curve(j, c) (j: the n's index)."""
  return [fake_runs.memory_run(16, n, s, fake_runs.log_steps(16, n, c_max),
                               lambda c, j=j: curve(j, c), base=0.3)
          for j, n in enumerate(ns) for s in seeds]


def test_n_star_at_the_largest_n_tried_is_no_saturation():
  # Every larger n reaches higher, later: n* still rises where the grid stops at 32.
  runs = _memory_sweep([2, 4, 8, 16, 32], lambda j, c: fake_runs.sigmoid(
      c, a=0.45 + 0.08 * j, b=1.5, c_mid=60 * 3 ** j, r0=0.3))
  g = analyze(runs, n_boot=4, budgets=[1e5, 1e6]).groups[0]
  assert int(g.primary.frontier.n_star[-1]) == max(r.n for r in runs) == 32
  assert g.law_choice.grid_end_n == 32
  assert any("n* reaches n=32, the largest n tried" in p and "§4.1" in p
             for p in g.problems)
  inside, beyond = g.prescriptions
  assert not inside.extrapolated and inside.point is not None
  assert beyond.extrapolated and beyond.refused and beyond.point is None
  assert "largest n tried (32)" in beyond.note and "try larger n (e.g. 64)" in beyond.note


def test_a_configuration_that_ended_early_does_not_lose_n_star_beyond_its_end():
  # n=2 is best at every compute, but its runs stop at 4,096 rollouts while n=4..16
  # run to 65,536. Held at its last value, n=2 is overtaken by n=4 beyond its end only
  # because it stopped; its own curve carried on stays on top, so n* there is not
  # decided by the data, and no n is prescribed there.
  def run(j, n, seed):
    rng = np.random.default_rng(10 * j + seed)
    c_max = 2 ** 12 if n == 2 else 2 ** 16
    return fake_runs.memory_run(16, n, seed, fake_runs.log_steps(16, n, c_max),
                                lambda c: fake_runs.sigmoid(
                                    c, a=0.7 - 0.03 * j, b=1.2, c_mid=2000 * 1.5 ** j,
                                    r0=0.3) + rng.normal(0, 0.003), base=0.3)

  runs = [run(j, n, s) for j, n in enumerate([2, 4, 8, 16]) for s in (0, 1)]
  g = analyze(runs, n_boot=10, budgets=[2e3, 3e4, 6.5e4]).groups[0]
  fr = g.primary.frontier
  assert fr.n_star[-1] == 4 and set(fr.censoring()) == {2}
  assert g.primary.law.compute_range[1] < 2e4  # the law sees only decided n*
  inside, *beyond = g.prescriptions
  assert inside.point is not None and inside.point.n == 2
  for p in beyond:
    assert p.refused and p.point is None and "n=2's runs end at 4.1e+03" in p.note
  assert any("n=2's runs end at 4.1e+03 rollouts" in p and "run it to the full budget"
             in p for p in g.problems)


def test_a_saturation_that_larger_n_lost_to_is_not_flagged():
  # n = 8 has the highest ceiling; 16 and 32 were tried and lose everywhere.
  ceilings = [0.5, 0.6, 0.7, 0.62, 0.55]
  runs = _memory_sweep([2, 4, 8, 16, 32], lambda j, c: fake_runs.sigmoid(
      c, a=ceilings[j], b=1.5, c_mid=60 * 3 ** j, r0=0.3))
  g = analyze(runs, n_boot=0, budgets=[1e6]).groups[0]
  assert int(g.primary.frontier.n_star[-1]) == 8
  assert g.law_choice.grid_end_n is None
  assert not any("largest n tried" in p for p in g.problems)
  assert "largest n tried" not in g.prescriptions[0].note


def test_a_law_whose_asymptote_reaches_the_largest_n_is_censored_too():
  fr = types.SimpleNamespace(keys=(2, 4, 8), n_star_points=lambda: (
      np.array([1e3, 1e4, 1e5]), np.array([2.0, 4.0, 4.0])))
  # log2 n* -> L + b: 8 at the largest n tried (8), 5.7 below it.
  assert n_grid_censored(fr, law(L=2.0, b=1.0)) == 8
  assert n_grid_censored(fr, law(L=1.5, b=1.0)) is None
  ends_at_8 = types.SimpleNamespace(keys=fr.keys, n_star_points=lambda: (
      np.array([1e3, 1e5]), np.array([2.0, 8.0])))
  assert n_grid_censored(ends_at_8, law(L=1.0, b=1.0)) == 8
  # A resample's law may tend to an n* past any float: the caveat still reads.
  caveats = pipeline._law_caveats("bp=8", fr, law(L=5000.0, b=1.0),
                                  pipeline.FrontierOptions())
  assert any("the law's n* tends to 2^5001)" in c for c in caveats)


def test_budgets_that_differ_anywhere_get_their_own_n_star():
  assert n_star_key(1048576) != n_star_key(1048580)
  assert n_star_key(1048576) == n_star_key(1048576.0)
  a, b = 1048576, 1048580
  boot = BootstrapResult({n_star_key(a): Interval(40.0, 30.0, 50.0, 100),
                          n_star_key(b): Interval(40.0, 35.0, 45.0, 100)},
                         n_boot=100, n_failed=0, level=0.9, stratified=True)
  assert (n_star_interval(boot, a), n_star_interval(boot, b)) == ((30.0, 50.0), (35.0, 45.0))


def test_an_interval_spanning_exactly_max_spread_is_prescribed():
  # "Spans more than a factor of 8" refuses: exactly 8 does not.
  choice = LawChoice("joint", law(), bp=32, joint=True, reason="test")
  exact, over = prescribe(choice, [1e5, 2e5], intervals={1e5: (5.0, 40.0),
                                                         2e5: (5.0, 40.5)})
  assert not exact.refused and exact.point is not None
  assert over.refused and "factor of 8" in over.note


def test_the_smallest_n_is_noted_only_where_n_star_rounds_below_it():
  # n* = 2**(0.19 + b) at C = 1e3: with b = 0.49 it is 1.6, which rounds (in log2) to
  # 2, the smallest n allowed: nothing to note. With b = 0 it is 1.14, which rounds to 1.
  near = LawChoice("bp=32", law(b=0.49), bp=32, joint=False, reason="test")
  (pr,) = prescribe(near, [1e3])
  assert pr.n_star == pytest.approx(1.6, abs=0.01) and pr.point.n == 2 and pr.note == ""
  (pr,) = prescribe(dataclasses.replace(near, law=law(b=0.0)), [1e3])
  assert pr.point.n == 2 and "below the smallest n" in pr.note


def test_an_unfitted_n_equal_to_the_prescribed_one_is_not_named():
  choice = LawChoice("bp=32", law(), bp=32, joint=False, reason="test", unfitted_n=(64,))
  (pr,) = prescribe(choice, [1e6])
  assert pr.point.n == 64 and pr.note == ""


def test_default_budgets_two_inside_the_data_its_end_and_ten_times_beyond():
  # (2e3, 5e5): 2e3 * 250**(1/3) = 12,599 and 2e3 * 250**(2/3) = 79,370, each cut to
  # two significant digits downwards (never past the data).
  assert default_budgets(law(compute_range=(2e3, 5e5))) == [12_000.0, 79_000.0,
                                                            500_000.0, 5_000_000.0]
  # Over exact decades the inside budgets are decades too (the cube root of 1e3
  # is a hair under 10 in floats: they were cut to 9,000 and 90,000).
  assert default_budgets(law(compute_range=(1e3, 1e6))) == [1e4, 1e5, 1e6, 1e7]
  # The data's end stays the data's end, a hair under a round number or not.
  end = 2e6 * (1 - 1e-12)
  assert default_budgets(law(compute_range=(2e3, end)))[2] == end
