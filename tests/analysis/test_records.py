"""record_breaking_points on hand-made sequences with known answers; record_points
takes them per run."""

import dataclasses

import numpy as np
import pytest

from isojax.analysis import pool_points, record_breaking_points, record_points
from isojax.analysis import analyze, read_runs
from isojax.analysis.records import coarse_bin_warning

from . import fake_runs


@dataclasses.dataclass(frozen=True)
class FakeRun:
  """Just what record_points reads: points(metric, unit) -> (compute, value)."""

  name: str
  compute: list
  reward: list

  def points(self, metric, unit):
    del metric, unit
    return np.asarray(self.compute, float), np.asarray(self.reward, float)


def test_increasing_distinct_bins_are_all_records():
  c = [1, 2, 3, 4]
  r = [0.10, 0.20, 0.30, 0.40]
  assert record_breaking_points(c, r, bin_width=0.005).tolist() == [0, 1, 2, 3]


def test_decreasing_tail_adds_nothing():
  r = [0.1, 0.3, 0.5, 0.45, 0.4, 0.2]
  assert record_breaking_points(np.arange(1, 7), r).tolist() == [0, 1, 2]


def test_noise_within_one_bin_is_not_a_record():
  # 0.500..0.5049 all sit in bin 100 of width 0.005; 0.505 enters bin 101.
  r = [0.500, 0.503, 0.501, 0.5049, 0.505, 0.5051]
  assert record_breaking_points(np.arange(6), r, bin_width=0.005).tolist() == [0, 4]


def test_equal_rewards_later_are_not_records():
  r = [0.2, 0.2, 0.2, 0.3, 0.3]
  assert record_breaking_points(np.arange(5), r).tolist() == [0, 3]


def test_ties_in_compute_keep_only_the_best():
  # Two runs evaluated at the same compute: only the higher one can be a record, and
  # which one is listed first must not matter.
  c = [10, 10, 20, 20]
  r = [0.30, 0.40, 0.35, 0.45]
  assert record_breaking_points(c, r, bin_width=0.01).tolist() == [1, 3]
  assert record_breaking_points(c[::-1], r[::-1], bin_width=0.01).tolist() == [2, 0]


def test_exact_tie_in_compute_and_reward_takes_the_first_index():
  assert record_breaking_points([5, 5], [0.3, 0.3]).tolist() == [0]


def test_unsorted_input_returns_indices_in_compute_order():
  c = [30, 10, 20]
  r = [0.5, 0.1, 0.3]
  assert record_breaking_points(c, r, bin_width=0.05).tolist() == [1, 2, 0]


def test_coarse_bins_merge_small_gains():
  r = [0.50, 0.55, 0.58, 0.61, 0.69]
  assert record_breaking_points(np.arange(5), r, bin_width=0.1).tolist() == [0, 3]


def test_nan_points_are_ignored():
  c = [1, 2, 3, np.nan]
  r = [0.1, np.nan, 0.2, 0.9]
  assert record_breaking_points(c, r).tolist() == [0, 2]


def test_pooling_order_does_not_change_records():
  rng = np.random.default_rng(0)
  c = np.repeat(np.arange(1, 41), 2).astype(float)
  r = np.tanh(c / 15) + rng.normal(0, 0.02, c.size)
  idx = record_breaking_points(c, r)
  perm = rng.permutation(c.size)
  idx_p = record_breaking_points(c[perm], r[perm])
  assert sorted(zip(c[idx], r[idx])) == sorted(zip(c[perm][idx_p], r[perm][idx_p]))


def test_empty_and_bad_inputs():
  assert record_breaking_points([], []).tolist() == []
  with pytest.raises(ValueError, match="compute has 2 points, reward has 3"):
    record_breaking_points([1, 2], [0.1, 0.2, 0.3])
  with pytest.raises(ValueError, match="bin_width"):
    record_breaking_points([1], [0.1], bin_width=0)


def test_record_points_are_taken_per_run_then_united():
  # Run a records 0.1, 0.3; run b records 0.2 (then stays below a's 0.3). Pooling
  # first would keep only the running maximum across both: 0.1 (a), 0.2 (b), 0.3 (a).
  runs = [FakeRun("a", [10, 20, 30], [0.1, 0.3, 0.25]),
          FakeRun("b", [15, 25, 35], [0.2, 0.15, 0.29])]
  c, r = record_points(runs, "val/avg@4")
  assert list(zip(c, r)) == [(10, 0.1), (15, 0.2), (20, 0.3), (35, 0.29)]
  # A run drawn twice (the bootstrap) contributes its records twice.
  c2, _ = record_points([runs[0], runs[0]], "val/avg@4")
  assert list(c2) == [10, 10, 20, 20]


def test_the_base_models_evaluation_counts_as_observed():
  # §4: a record beats "all previously observed values", the step-0 evaluation
  # (the base model, at compute 0) included: a checkpoint at or below its bin is
  # dominated by it.
  c, r = [1, 2, 3, 4], [0.10, 0.152, 0.14, 0.20]
  assert record_breaking_points(c, r).tolist() == [0, 1, 3]
  assert record_breaking_points(c, r, baseline=0.15).tolist() == [3]
  assert record_breaking_points(c, r, baseline=float("nan")).tolist() == [0, 1, 3]
  run = FakeRun("a", [0, 10, 20, 30, 40], [0.15, 0.10, 0.152, 0.14, 0.20])
  assert list(zip(*record_points([run], "val/avg@4"))) == [(40, 0.20)]
  # Without a step-0 evaluation nothing came before the first checkpoint.
  run = FakeRun("b", [10, 20, 30, 40], [0.10, 0.152, 0.14, 0.20])
  assert list(zip(*record_points([run], "val/avg@4"))) == [(10, 0.1), (20, 0.152),
                                                            (40, 0.2)]


def test_a_bin_near_the_runs_rise_is_named_with_a_finer_one():
  # Hard-set runs rising 0.02 over the base model: at most 4 records each at 0.005.
  runs = [FakeRun(f"r{i}", [0, 10, 20, 30], [0.045, 0.05, 0.058, 0.065]) for i in range(3)]
  (line,) = coarse_bin_warning(runs, "val/avg@4", 0.005)
  assert "median rise in val/avg@4 is 0.02 (4.0 bins)" in line
  assert "try --bin-width 0.001" in line
  assert coarse_bin_warning(runs, "val/avg@4", 0.001) == []  # 20 bins
  flat = [FakeRun("f", [0, 10, 20, 30], [0.05, 0.04, 0.045, 0.04])]  # nothing learned
  assert coarse_bin_warning(flat, "val/avg@4", 0.005) == []
  # Nor is noise around a flat line a rise (no finer bin would help).
  rng = np.random.default_rng(0)
  noisy = [FakeRun(f"n{i}", list(range(31)), 0.3 + rng.normal(0, 0.005, 31))
           for i in range(5)]
  assert coarse_bin_warning(noisy, "val/avg@4", 0.005) == []


def test_the_analysis_names_a_coarse_bin(tmp_path):
  def curve(bp, n, c):  # a hard set: the reward rises 0.02 over the whole budget
    return fake_runs.sigmoid(c, a=0.065, b=1.2, c_mid=2e3 * n, r0=0.045)
  fake_runs.make_sweep(tmp_path, configs=fake_runs.bp8_configs(), budget=8 * 64 * 500,
                       curve=curve, base_eval=True)
  (group,) = analyze(list(read_runs(tmp_path).runs), n_boot=0).groups
  assert any(p.startswith("reward bin 0.005 is coarse for these runs") for p in group.problems)


def test_a_reward_on_a_bin_edge_is_in_that_bin_despite_float_division():
  # 0.3 / 0.1 is 2.9999999999999996 in floats: 0.3 still enters bin 3, above 0.29's
  # bin 2, and a base model at 0.3 sits in bin 3, with 0.35.
  assert record_breaking_points([1, 2], [0.29, 0.3], bin_width=0.1).tolist() == [0, 1]
  assert record_breaking_points([1, 2], [0.35, 0.41], bin_width=0.1,
                                baseline=0.3).tolist() == [1]


def test_several_base_evaluations_all_count_as_observed():
  # Two evaluations at compute 0 (e.g. a resumed run evaluated again before training):
  # a checkpoint must beat the better of them.
  run = FakeRun("a", [0, 0, 0, 10, 20], [0.10, 0.15, 0.12, 0.152, 0.20])
  assert list(zip(*record_points([run], "val/avg@4"))) == [(20, 0.20)]


def test_max_compute_keeps_the_point_at_it_and_the_union_is_best_first():
  runs = [FakeRun("a", [10, 20, 30], [0.1, 0.2, 0.3]), FakeRun("b", [10, 20], [0.15, 0.18])]
  c, r = pool_points(runs, "val/avg@4", max_compute=20)
  assert list(zip(c, r)) == [(10, 0.15), (10, 0.1), (20, 0.2), (20, 0.18)]
  c, r = record_points(runs, "val/avg@4", max_compute=20)
  assert list(zip(c, r)) == [(10, 0.15), (10, 0.1), (20, 0.2), (20, 0.18)]


def test_one_lucky_last_evaluation_is_not_a_rise():
  # A flat, noisy run whose final evaluation jumps 0.03: the last third of its
  # evaluations decides whether it learned, not one point.
  rng = np.random.default_rng(1)
  runs = [FakeRun(f"n{i}", list(range(31)),
                  np.append(0.3 + rng.normal(0, 0.005, 30), 0.33)) for i in range(5)]
  assert coarse_bin_warning(runs, "val/avg@4", 0.005) == []


def test_a_rise_of_exactly_min_bins_is_fine_enough():
  # Rise 0.078125 = 10 bins of 2^-7 (exact in floats): fewer than 10 would be coarse.
  bw = 2.0**-7
  runs = [FakeRun("r", [0, 10, 20, 30, 40, 50], [0.25, 0.26, 0.29, 0.31, 0.32, 0.328125])]
  assert coarse_bin_warning(runs, "val/avg@4", bw) == []
  assert coarse_bin_warning(runs, "val/avg@4", bw * 1.01) != []
