"""Fixed-batch n*(M), Bp*(M) (paper §4.2, Fig. 9) and sensitivity (Fig. 10)."""

import math

import numpy as np
import pytest

from isojax.analysis import batch_sizes, fixed_batch, read_runs, sensitivity

from . import fake_runs

B = 256
CONFIGS = [(B // n, n) for n in (4, 8, 16, 32, 64)]


@pytest.fixture(scope="module")
def fixed_runs(tmp_path_factory):
  root = tmp_path_factory.mktemp("fixed")
  fake_runs.make_sweep(root, configs=CONFIGS, budget=B * 4000, n_evals=60)
  return read_runs(root).runs


def test_fixed_batch_recovers_curves_in_steps(fixed_runs):
  fb = fixed_batch(fixed_runs, batch=B, metric="val/avg@4")
  for bp, n in CONFIGS:
    truth = fake_runs.TRUE_PARAMS[n]
    shift = 0.002 * math.log2(bp / 8)  # the small Bp effect of the fake truth
    f = fb.curves.fits[n]
    assert f.c_mid == pytest.approx(truth["c_mid"] / B, rel=1e-5)  # C = B * M
    assert f.a == pytest.approx(truth["a"] - shift, abs=1e-6)
    assert f.b == pytest.approx(truth["b"], rel=1e-5)


def test_fixed_batch_n_star_and_bp_star(fixed_runs):
  fb = fixed_batch(fixed_runs, batch=B, metric="val/avg@4")
  m = fb.frontier.compute
  true = np.array([[fake_runs.true_reward(bp, n, B * mm) for mm in m] for bp, n in CONFIGS])
  ranked = np.sort(true, axis=0)
  clear = ranked[-1] - ranked[-2] > 0.006
  expected_n = np.array([n for _, n in CONFIGS])[np.argmax(true, axis=0)]
  assert np.array_equal(fb.frontier.n_star[clear], expected_n[clear])
  np.testing.assert_array_equal(fb.bp_star * fb.frontier.n_star, B)
  # More updates favour larger n and fewer problems per batch (paper Fig. 9).
  assert fb.frontier.n_star[0] == 4 and fb.frontier.n_star[-1] >= 32
  assert fb.law is not None and fb.law.L > 0 and fb.law.unit == "steps"
  np.testing.assert_allclose(fb.predict_bp_log2(m), math.log2(B) - fb.law.predict_log2(m))


def test_batch_sizes_and_errors(fixed_runs):
  assert batch_sizes(fixed_runs) == [B]
  with pytest.raises(ValueError, match="B=512 has 0 fittable n"):
    fixed_batch(fixed_runs, batch=512, metric="val/avg@4")


def _flat_run(root, bp, n, reward, *, steps=10, seed=0):
  rows = [{"step": s, "rollouts": s * bp * n, "val/avg@4": reward} for s in range(1, steps + 1)]
  return fake_runs.write_run(root / f"bp{bp}_n{n}_s{seed}", {"bp": bp, "n": n, "seed": seed},
                             rows)


def test_sensitivity_spreads_by_hand(tmp_path):
  table = {(8, 4): 0.50, (16, 4): 0.52, (32, 4): 0.51,  # across Bp at n=4: 2 points
           (8, 16): 0.60, (16, 16): 0.60,                # across Bp at n=16: 0 points
           (8, 64): 0.70}                                # across n at Bp=8: 20 points
  for (bp, n), r in table.items():
    _flat_run(tmp_path, bp, n, r, steps=int(4096 // (bp * n)) or 1)
  _flat_run(tmp_path, 16, 16, 0.64, steps=int(4096 // 256), seed=1)  # a second seed
  s = sensitivity(read_runs(tmp_path).runs, metric="val/avg@4")
  assert s.spread_bp == pytest.approx({4: 0.02, 16: 0.02})  # (0.60+0.64)/2 - 0.60
  assert s.spread_n == pytest.approx({8: 0.20, 16: 0.10})
  assert s.mean_spread_bp == pytest.approx(0.02)
  assert s.mean_spread_n == pytest.approx(0.15)
  assert s.across_n[8] == pytest.approx({4: 0.50, 16: 0.60, 64: 0.70})


def test_sensitivity_matches_compute_and_ignores_crashed_seeds(tmp_path):
  # n=4 improves with compute; n=8 stopped early. Compare at the compute both reached.
  rows4 = [{"step": s, "rollouts": s * 32, "val/avg@4": 0.1 * s} for s in range(1, 9)]
  rows8 = [{"step": s, "rollouts": s * 64, "val/avg@4": 0.3} for s in range(1, 3)]
  crashed = [{"step": 1, "rollouts": 32, "val/avg@4": 0.0}]
  fake_runs.write_run(tmp_path / "a", {"bp": 8, "n": 4}, rows4)
  fake_runs.write_run(tmp_path / "b", {"bp": 8, "n": 8}, rows8)
  fake_runs.write_run(tmp_path / "c", {"bp": 8, "n": 4, "seed": 9}, crashed)
  s = sensitivity(read_runs(tmp_path).runs, metric="val/avg@4")
  assert s.compute_n[8] == 128
  assert s.across_n[8] == pytest.approx({4: 0.4, 8: 0.3})


def test_a_configuration_not_yet_evaluated_leaves_the_others_compared(tmp_path):
  base = {"step": 0, "rollouts": 0, "val/avg@4": 0.1}
  for bp, r in ((4, 0.50), (8, 0.52)):
    rows = [base] + [{"step": s, "rollouts": s * bp * 16, "val/avg@4": r}
                     for s in range(1, 9)]
    fake_runs.write_run(tmp_path / f"bp{bp}", {"bp": bp, "n": 16}, rows)
  fake_runs.write_run(tmp_path / "bp16", {"bp": 16, "n": 16}, [base])  # only step 0
  s = sensitivity(read_runs(tmp_path).runs, metric="val/avg@4")
  assert s.across_bp == {16: pytest.approx({4: 0.50, 8: 0.52})}
  assert s.compute_bp == {16: 512}
