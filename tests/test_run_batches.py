"""PPO-off-policy-k (config.rl.off_policy_k) end to end on the tiny CPU config.

* k = 1 (with pipeline.max_lag = 0) is the on-policy loop: its metrics.jsonl
  equals a run whose config has neither field;
* k = 3 over M = 5 updates: groups of 3 and 2 (the last one shorter), the policy
  lag of the updates is 0, 1, 2, 0, 1, the ledger charges each group's rollouts
  when they are sampled, and the clips are live (ratios against the sampler);
* stopped mid-group and restarted, a k = 3 run resumes from the checkpoint at the
  group's start and writes the uninterrupted run's metrics;
* a malformed k fails before any work, naming the field.
"""

import numpy as np
import pytest

from isojax import run
from isojax.rl.losses import RATIO_METRICS
from isojax.rollout.jax_sampler import JaxSampler
from isojax.run_batches import lag_metrics
from tests import run_records
# compilation_cache: test_run's autouse persistent XLA cache, for this module's runs.
from tests.test_run import compilation_cache, tiny_config  # pylint: disable=unused-import

RATIO_COLUMNS = {f"train/{k}" for k in RATIO_METRICS}
POINT = "bp=4,n=4,budget=80"  # B = 16, M = 5
K3 = {"rl.off_policy_k": 3, "rl.clip_high": 0.28, "eval_every": 100,
      "checkpoint_every": 2, "eval.num_train": 0}


PUSHED_AT_STEP = []  # the k3 run's weight pushes to its sampler, by update count


@pytest.fixture(scope="module")
def k3_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("k3")
  push = JaxSampler.update_weights

  def counted(sampler, model, **kw):
    PUSHED_AT_STEP.append(len(run_records.records(workdir)))  # lines: step 0 .. s - 1
    return push(sampler, model, **kw)

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(JaxSampler, "update_weights", counted)
    return workdir, run.run(tiny_config(POINT, **K3), workdir)


def test_malformed_k_fails_before_any_work(tmp_path):
  for k in (0, -2):  # a ConfigDict refuses a non-int itself
    with pytest.raises(ValueError, match=rf"config\.rl\.off_policy_k={k!r} must be an "
                                         r"integer >= 1"):
      run.run(tiny_config(POINT, **{"rl.off_policy_k": k}), tmp_path / "run")
  with pytest.raises(ValueError, match=r"config\.rl\.off_policy_k=2 needs a critic-free"):
    run.run(tiny_config(POINT, **{"rl.off_policy_k": 2, "rl.adv_estimator": "gae"}),
            tmp_path / "run")
  assert not (tmp_path / "run").exists()


def test_clip_settings_are_refused_on_policy_only():
  with pytest.raises(ValueError, match=r"config\.rl\.clip_high=0\.28 .* cannot affect"):
    run.plan_run(tiny_config(POINT, **{"rl.clip_high": 0.28}))
  plan = run.plan_run(tiny_config(POINT, **{"rl.off_policy_k": 2, "rl.clip_high": 0.28}))
  assert (plan.off_policy_k, plan.loss.clip_high, plan.point.m) == (2, 0.28, 5)


def test_k1_and_lag0_are_the_on_policy_loop(tmp_path):
  """off_policy_k = 1 and pipeline.max_lag = 0 write what a config without either
  field writes (no lag columns)."""
  overrides = {"eval_every": 100, "eval.num_train": 0}
  run.run(tiny_config("bp=4,n=4,budget=32", **overrides,
                      **{"rl.off_policy_k": 1, "rl.pipeline.max_lag": 0}), tmp_path / "k1")
  absent = tiny_config("bp=4,n=4,budget=32", **overrides)
  del absent.rl["off_policy_k"]
  del absent.rl["pipeline"]
  run.run(absent, tmp_path / "absent")
  k1 = [run_records.without_timing(r) for r in run_records.records(tmp_path / "k1")]
  assert k1 == [run_records.without_timing(r)
                for r in run_records.records(tmp_path / "absent")]
  assert len(k1) == 3 and "train/policy_lag_max" not in k1[-1]
  assert "train/tis_weight_mean" in k1[-1] and not RATIO_COLUMNS & set(k1[-1])


def test_k3_groups_lag_and_ledger(k3_run):
  workdir, _ = k3_run
  records = run_records.records(workdir)[1:]  # step 0 is the base model's eval
  assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
  assert [r["train/policy_lag_mean"] for r in records] == [0, 1, 2, 0, 1]
  assert [r["train/policy_lag_max"] for r in records] == [0, 1, 2, 0, 1]
  # Charged as sampled: a group's 3 (then 2) batches of 16 at its first update.
  assert [r["rollouts"] for r in records] == [48, 48, 48, 80, 80]
  # Ratios against the sampler: reported, and away from 1 on the stale updates.
  assert all(RATIO_COLUMNS <= set(r) for r in records)
  assert all(r["train/skipped"] == 0 for r in records)
  assert records[1]["train/approx_kl_old"] > records[0]["train/approx_kl_old"]
  # Weights reach the sampler only before it generates again: after each group's
  # last update (3, then 5, the run's last, whose eval samples too).
  assert PUSHED_AT_STEP == [3, 5]


def test_lag_metrics_count_trained_tokens_only():
  version_BxT = np.array([[-1, 2, 2], [-1, 0, -1]], np.int32)
  assert lag_metrics(version_BxT, updates_done=3) == {
      "train/policy_lag_mean": pytest.approx(5 / 3), "train/policy_lag_max": 3.0}
  assert lag_metrics(np.full((2, 3), -1, np.int32), updates_done=3)[
      "train/policy_lag_max"] == 0.0


def test_k3_resumes_exactly_after_a_stop_mid_group(k3_run, tmp_path, monkeypatch):
  """Stopped before update 5 (group 4..5 sampled, update 4 written): the checkpoint
  due at step 2 was written at its group's end, step 3; the restart redoes 4 and 5."""
  reference, last = k3_run
  run_records.stop_before_update(monkeypatch, 5)
  with pytest.raises(KeyboardInterrupt):
    run.run(tiny_config(POINT, **K3), tmp_path)
  assert [r["step"] for r in run_records.records(tmp_path)] == [0, 1, 2, 3, 4]
  assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()
                if p.name.isdigit()) == [3]
  monkeypatch.undo()
  resumed = run.run(tiny_config(POINT, **K3), tmp_path)
  assert run_records.without_timing(resumed) == run_records.without_timing(last)
  assert [run_records.without_timing(r) for r in run_records.records(tmp_path)] == [
      run_records.without_timing(r) for r in run_records.records(reference)]
