"""Advantage estimators against hand-computed vectors and NumPy formulas."""

import jax
import numpy as np
import pytest

from isojax.rl.advantages import compute_advantages, min_group_size, zero_variance_groups
from isojax.rl.losses import LossConfig

EPS = 1e-6


def adv(rewards, n, est, **kw):
  return np.asarray(compute_advantages(np.asarray(rewards, np.float32), group_size=n,
                                       estimator=est, **kw))


def test_grpo_closed_form_pair():
  # mean 0.5, std(ddof=1) = sqrt(0.5); (1 - 0.5) / sqrt(0.5) = sqrt(0.5)
  a = adv([1.0, 0.0], 2, "grpo")
  np.testing.assert_allclose(a, [np.sqrt(0.5), -np.sqrt(0.5)], rtol=1e-5)


def test_grpo_closed_form_two_groups():
  # group 1: [1, 0, 0, 0] mean .25, var(ddof=1) = (.5625 + 3*.0625)/3 = .25 -> std .5
  # group 2: [1, 1, 0, 0] mean .5, var = 4*.25/3 = 1/3
  a = adv([1, 0, 0, 0, 1, 1, 0, 0], 4, "grpo")
  s2 = np.sqrt(1 / 3)
  np.testing.assert_allclose(a, [1.5, -.5, -.5, -.5, .5 / s2, .5 / s2, -.5 / s2, -.5 / s2],
                             rtol=1e-5)


def test_drgrpo_closed_form():
  a = adv([1, 0, 0, 0, 1, 1, 1, 0], 4, "drgrpo")
  np.testing.assert_allclose(a, [.75, -.25, -.25, -.25, .25, .25, .25, -.75], atol=1e-7)


def test_rloo_closed_form():
  # r_i - mean of the other three
  a = adv([1, 0, 0, 0, 3, 1, 2, 2], 4, "rloo")
  np.testing.assert_allclose(a, [1, -1 / 3, -1 / 3, -1 / 3, 3 - 5 / 3, 1 - 7 / 3, 0, 0],
                             atol=1e-6)


def test_batch_closed_form():
  # centred: [.5, -.5, .5, -.5, 0, 0, 0, 0]... groups of 2
  r = [1, 0, 1, 0, 2, 2, 0, 0]
  centred = np.array([.5, -.5, .5, -.5, 0, 0, 0, 0])
  a = adv(r, 2, "batch")
  np.testing.assert_allclose(a, centred / (centred.std(ddof=1) + EPS), rtol=1e-5)


@pytest.mark.parametrize("est", ["grpo", "drgrpo", "batch", "rloo"])
def test_zero_variance_group_is_exactly_zero(est):
  # 0.1 * 3 / 3 != 0.1 in float: without the explicit zeroing, grpo would give
  # (rounding error) / 1e-6, far from 0.
  r = [0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 1.0, 0.0, 0.5]
  a = adv(r, 3, est)
  assert np.all(a[:6] == 0.0)
  assert np.any(a[6:] != 0.0)


def test_random_matches_numpy_formulas():
  rng = np.random.default_rng(0)
  r = rng.normal(size=(6, 5)).astype(np.float32)
  flat = r.reshape(-1)
  mean = r.mean(1, keepdims=True)
  std = r.std(1, ddof=1, keepdims=True)
  np.testing.assert_allclose(adv(flat, 5, "grpo"), ((r - mean) / (std + EPS)).ravel(),
                             rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(adv(flat, 5, "drgrpo"), (r - mean).ravel(), atol=1e-5)
  loo = np.stack([[r[g, i] - np.delete(r[g], i).mean() for i in range(5)] for g in range(6)])
  np.testing.assert_allclose(adv(flat, 5, "rloo"), loo.ravel(), atol=1e-5)
  c = r - mean
  np.testing.assert_allclose(adv(flat, 5, "batch"), (c / (c.std(ddof=1) + EPS)).ravel(),
                             rtol=1e-4, atol=1e-5)


def test_decoupled_baseline():
  # 2 prompts, n_train=2 trained rollouts, n_est=4 baseline rollouts each.
  base = np.array([1, 0, 0, 0, 1, 1, 1, 0], np.float32)
  train = np.array([1, 0, 1, 0], np.float32)  # a subset of each prompt's baseline set
  m = base.reshape(2, 4).mean(1)  # [.25, .75]
  s = base.reshape(2, 4).std(1, ddof=1)  # [.5, .5]
  exp_grpo = (train.reshape(2, 2) - m[:, None]) / (s[:, None] + EPS)
  np.testing.assert_allclose(adv(train, 2, "grpo", baseline_rewards_B=base),
                             exp_grpo.ravel(), rtol=1e-5)
  np.testing.assert_allclose(adv(train, 2, "drgrpo", baseline_rewards_B=base),
                             (train.reshape(2, 2) - m[:, None]).ravel(), atol=1e-6)
  # leave-one-out among the 4 baseline rollouts: (sum - r) / 3
  sums = base.reshape(2, 4).sum(1)
  exp_rloo = train.reshape(2, 2) - (sums[:, None] - train.reshape(2, 2)) / 3
  np.testing.assert_allclose(adv(train, 2, "rloo", baseline_rewards_B=base),
                             exp_rloo.ravel(), atol=1e-6)
  # n_est == n_train reproduces the coupled estimator
  np.testing.assert_allclose(adv(train, 2, "grpo", baseline_rewards_B=train),
                             adv(train, 2, "grpo"), rtol=1e-6)


def test_decoupled_zero_variance_follows_baseline():
  # trained subset all equal, baseline is not -> non-zero advantage (it has gradient)
  base = np.array([1, 1, 0, 0, 1, 1, 1, 1], np.float32)
  train = np.array([1, 1, 1, 1], np.float32)
  a = adv(train, 2, "grpo", baseline_rewards_B=base)
  assert np.all(a[:2] > 0) and np.all(a[2:] == 0)
  flags = np.asarray(zero_variance_groups(train, group_size=2, baseline_rewards_B=base))
  np.testing.assert_array_equal(flags, [False, True])


def np_batch_advantages(r_BpxN, base_BpxM, drop_flat):
  """NumPy reference of the "batch" estimator: centre each group on its baseline
  mean; divide by the ddof=1 std of the centred baseline rewards of the groups
  kept (all groups, or only those whose baseline rewards are not all equal)."""
  flat = base_BpxM.max(1) == base_BpxM.min(1)
  centred = base_BpxM - base_BpxM.mean(1, keepdims=True)
  kept = centred[~flat] if drop_flat else centred
  out = (r_BpxN - base_BpxM.mean(1, keepdims=True)) / (kept.std(ddof=1) + EPS)
  out[flat] = 0.0
  return out.ravel()


@pytest.mark.parametrize("decoupled", [False, True])
def test_batch_std_leaves_out_zero_variance_groups_when_they_are_dropped(decoupled):
  rng = np.random.default_rng(3)
  base = (rng.uniform(size=(8, 6)) < 0.4).astype(np.float32)
  base[[1, 4, 6]] = [[1] * 6, [0] * 6, [1] * 6]  # three zero-variance groups
  base[0] = [1, 0, 0, 0, 0, 0]
  train = base[:, :4] if decoupled else base
  kw = dict(baseline_rewards_B=base.ravel()) if decoupled else {}
  for drop in (False, True):
    got = adv(train.ravel(), train.shape[1], "batch", drop_zero_variance=drop, **kw)
    np.testing.assert_allclose(got, np_batch_advantages(train, base, drop), rtol=1e-5,
                               atol=1e-6)
  # Kept in the statistic, the flat groups' zeros inflate every advantage by exactly
  # sqrt((N - 1) / (K - 1)) for N baseline rollouts, K of them in varied groups.
  n_all, n_kept = base.size, base.size - 3 * base.shape[1]
  kept_in = adv(train.ravel(), train.shape[1], "batch", **kw)
  left_out = adv(train.ravel(), train.shape[1], "batch", drop_zero_variance=True, **kw)
  nz = left_out != 0
  np.testing.assert_allclose(kept_in[nz] / left_out[nz],
                             np.sqrt((n_all - 1) / (n_kept - 1)), rtol=1e-4)


@pytest.mark.parametrize("est", ["grpo", "drgrpo", "rloo"])
def test_drop_zero_variance_leaves_per_group_estimators_alone(est):
  r = np.array([1, 0, 0, 1, 1, 1, 0, 1, 0], np.float32)
  np.testing.assert_array_equal(adv(r, 3, est, drop_zero_variance=True), adv(r, 3, est))


def test_loss_config_says_when_zero_variance_groups_are_dropped():
  assert LossConfig(zero_var_filter="all").drops_zero_variance
  assert not LossConfig(zero_var_filter="regularizers").drops_zero_variance
  assert not LossConfig().drops_zero_variance


def test_zero_variance_rule_on_host_and_in_jit():
  """One rule: NumPy in -> NumPy out (the run's ledger), the same flags under jit."""
  base = np.array([1, 1, 0, 0, 1, 1, 1, 1, 0.5, 0.5, 0.5, 0.5], np.float32)
  train = np.array([1, 1, 1, 1, 0.5, 0.5], np.float32)
  host = zero_variance_groups(train, group_size=2, baseline_rewards_B=base)
  assert type(host) is np.ndarray and host.dtype == bool
  np.testing.assert_array_equal(host, [False, True, True])
  jitted = jax.jit(lambda r, b: zero_variance_groups(r, group_size=2, baseline_rewards_B=b))
  np.testing.assert_array_equal(np.asarray(jitted(train, base)), host)
  # Without a decoupled baseline the trained rewards decide.
  np.testing.assert_array_equal(zero_variance_groups(train, group_size=2), [True, True, True])
  np.testing.assert_array_equal(
      zero_variance_groups(np.array([0, 1, 2, 2], np.float32), group_size=2), [False, True])


def test_dropped_groups_follow_the_filter():
  r = np.array([1, 0, 1, 1, 0, 0], np.float32)
  kept = LossConfig(zero_var_filter="regularizers").dropped_groups(r, group_size=2)
  dropped = LossConfig(zero_var_filter="all").dropped_groups(r, group_size=2)
  assert type(dropped) is np.ndarray
  np.testing.assert_array_equal(kept, [False, False, False])
  np.testing.assert_array_equal(dropped, [False, True, True])


@pytest.mark.parametrize("kw, match", [
    (dict(group_size=3), "divide"),
    (dict(group_size=2, estimator="nope"), "unknown advantage estimator"),
    (dict(group_size=1, estimator="grpo"), "at least 2"),
    (dict(group_size=2, baseline_rewards_B=np.zeros(5, np.float32)), "baseline_rewards_B"),
    (dict(group_size=2, baseline_rewards_B=np.zeros(2, np.float32)), "n_est=1"),
])
def test_bad_input(kw, match):
  with pytest.raises(ValueError, match=match):
    compute_advantages(np.zeros(4, np.float32), **kw)


def test_an_unknown_estimator_lists_the_critics_among_the_choices():
  # min_group_size answers for "gae" too (1), so its error offers it.
  assert min_group_size("gae") == 1
  with pytest.raises(ValueError, match=r"choose from \['batch', 'drgrpo', 'gae', 'grpo', "
                     r"'rloo'\]"):
    min_group_size("nope")


def test_a_group_whose_rewards_differ_by_little_is_not_zero_variance():
  """Zero variance means all-equal rewards, not nearly equal: a partial-credit reward
  that separates two rollouts by 1e-4 still ranks them, and GRPO's std normalises
  that gap to the same +-sqrt(1/2) as a 0/1 pair (up to std_eps)."""
  r = np.array([0.5, 0.5001, 0.3, 0.3], np.float32)
  np.testing.assert_array_equal(zero_variance_groups(r, group_size=2), [False, True])
  a = adv(r, 2, "grpo")
  gap = float(r[1]) - float(r[0])
  want = (gap / 2) / (gap / np.sqrt(2) + EPS) * np.array([-1, 1])  # centred / std
  np.testing.assert_allclose(a[:2], want, rtol=1e-3)
  assert np.all(a[2:] == 0.0)
