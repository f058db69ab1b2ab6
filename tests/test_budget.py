"""Budget points, sweep grids and the compute ledger (isojax/budget.py)."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from isojax import budget
from isojax.budget import BudgetPoint, Ledger, estimate_tokens, format_table, sweep_grid


def test_point_arithmetic():
  p = BudgetPoint(bp=32, n=64, m=100)
  assert p.batch == 2048
  assert p.compute == 204_800
  assert p.to_dict() == {"bp": 32, "n": 64, "m": 100, "batch": 2048, "compute": 204_800}
  assert p.name == "bp32_n64_m100"


def test_from_budget_floors_m():
  # 2e6 rollouts at Bp=32, n=64: M = floor(2_000_000 / 2048) = 976 (976.5625).
  p = BudgetPoint.from_budget(2e6, bp=32, n=64)
  assert (p.bp, p.n, p.m) == (32, 64, 976)
  assert p.compute == 976 * 2048 <= 2_000_000
  # Exactly one batch fits.
  assert BudgetPoint.from_budget(96, bp=8, n=12).m == 1
  # A budget that is not an integer still floors correctly.
  assert BudgetPoint.from_budget(1000.5, bp=10, n=10).m == 10
  # Large integer budgets use exact integer division (no float rounding).
  big = 10**18 + 1
  assert BudgetPoint.from_budget(big, bp=3, n=1).m == big // 3


def test_from_budget_zero_updates_names_numbers():
  with pytest.raises(ValueError) as e:
    BudgetPoint.from_budget(2047, bp=32, n=64)
  msg = str(e.value)
  for num in ("2047", "32", "64", "2048"):
    assert num in msg


@pytest.mark.parametrize("kwargs", [dict(bp=0, n=1, m=1), dict(bp=1, n=-2, m=1),
                                    dict(bp=1, n=1, m=1.5), dict(bp="8", n=1, m=1),
                                    dict(bp=True, n=1, m=1)])
def test_point_rejects_bad_numbers(kwargs):
  with pytest.raises(ValueError):
    BudgetPoint(**kwargs)


def test_budget_rejects_non_positive():
  for c in (0, -5, float("nan"), float("inf")):
    with pytest.raises(ValueError, match="compute"):
      BudgetPoint.from_budget(c, bp=1, n=1)


def test_validate_b_max_names_numbers():
  p = BudgetPoint(bp=1024, n=128, m=1)
  assert p.validate(131_072) is p
  with pytest.raises(ValueError) as e:
    p.validate(65_536)
  for num in ("1024", "128", "131072", "65536"):
    assert num in str(e.value)


def test_validate_a_decoupled_point_bounds_the_sampled_batch():
  p = BudgetPoint(bp=4, n=8, m=1, n_est=64)
  assert p.validate(256) is p
  with pytest.raises(ValueError, match=r"Bp\*n_est = 4\*64 = 256 exceeds b_max = 255"):
    p.validate(255)


def test_feasible_checks_the_batch_before_the_budget():
  assert BudgetPoint.feasible(1000, bp=8, n=4, b_max=32) == BudgetPoint(bp=8, n=4, m=31)
  with pytest.raises(ValueError, match=r"Bp\*n = 8\*8 = 64 exceeds b_max = 32"):
    BudgetPoint.feasible(10, bp=8, n=8, b_max=32)  # M = 0 too: the batch is named
  with pytest.raises(ValueError, match=r"C=10 .* = 0 updates"):
    BudgetPoint.feasible(10, bp=8, n=4, b_max=32)


def test_paper_grid_feasible_counts():
  # Paper: Bp in 2^5..2^10, n in 2^3..2^11. With Bp*n <= 2^16 (easy) the exponent
  # pairs (a, b) need a + b <= 16: 9+8+7+6+5+4 = 39 pairs; with 2^14 (hard):
  # 7+6+5+4+3+2 = 27 pairs (counted by hand).
  assert budget.PAPER_BP_VALUES == (32, 64, 128, 256, 512, 1024)
  assert budget.PAPER_N_VALUES == (8, 16, 32, 64, 128, 256, 512, 1024, 2048)
  assert budget.PAPER_B_MAX == {"easy": 65_536, "hard": 16_384}  # §4's batch bounds
  huge = 2**40
  easy = sweep_grid(budget.PAPER_BP_VALUES, budget.PAPER_N_VALUES,
                    b_max=budget.PAPER_B_MAX_EASY, budget=huge)
  hard = sweep_grid(budget.PAPER_BP_VALUES, budget.PAPER_N_VALUES,
                    b_max=budget.PAPER_B_MAX_HARD, budget=huge)
  assert len(easy) == 39
  assert len(hard) == 27
  assert all(p.batch <= 65_536 for p in easy)
  assert max(p.batch for p in hard) == 16_384
  assert all(p.m == huge // p.batch for p in easy)
  # The extreme corners.
  assert BudgetPoint(bp=32, n=2048, m=huge // 65_536) in easy
  assert BudgetPoint(bp=1024, n=64, m=huge // 65_536) in easy
  assert not any(p.bp == 1024 and p.n == 128 for p in easy)


def test_grid_several_budgets_and_infeasible_m():
  pts = sweep_grid([8, 16], [2, 4, 8], b_max=64, budget=[64, 1000])
  # Bp*n <= 64 excludes (16, 8) -> 5 pairs per budget; M = floor(C / (Bp*n)).
  assert len(pts) == 10
  # Ordered by budget, then Bp, then n.
  assert [(p.bp, p.n, p.m) for p in pts[:5]] == [(8, 2, 4), (8, 4, 2), (8, 8, 1),
                                                 (16, 2, 2), (16, 4, 1)]
  assert [(p.bp, p.n, p.m) for p in pts[5:]] == [(8, 2, 62), (8, 4, 31), (8, 8, 15),
                                                 (16, 2, 31), (16, 4, 15)]
  # A budget smaller than a batch drops that pair instead of giving M = 0.
  pts = sweep_grid([8], [2, 16], b_max=1000, budget=100)
  assert [(p.n, p.m) for p in pts] == [(2, 6)]


def test_grid_takes_budgets_from_any_collection():
  # A NumPy array (np.logspace in a notebook) or a generator is several budgets.
  as_list = sweep_grid([8], [2], b_max=64, budget=[100, 1000])
  assert sweep_grid([8], [2], b_max=64, budget=np.array([100.0, 1000.0])) == as_list
  assert sweep_grid([8], [2], b_max=64, budget=(c for c in (1000, 100))) == as_list
  with pytest.raises(ValueError, match="budget must be a positive number"):
    sweep_grid([8], [2], b_max=64, budget="100")


def test_grid_all_infeasible_names_numbers():
  with pytest.raises(ValueError) as e:
    sweep_grid([64], [128], b_max=4096, budget=1e9)
  assert "4096" in str(e.value) and "64" in str(e.value) and "128" in str(e.value)


def test_grid_all_infeasible_says_why_with_a_decoupled_baseline():
  # Bp*n = 2048 fits b_max and C: what rules the pair out is n above n_est ...
  with pytest.raises(ValueError, match=r"n_est=16 .* must be >= n=64"):
    sweep_grid([32], [64], b_max=65_536, budget=1e6, n_est=16)
  # ... and here Bp*n_est, not Bp*n = 256, which is within b_max and C.
  with pytest.raises(ValueError, match=r"Bp\*n_est = 32\*64 = 2048 exceeds b_max"):
    sweep_grid([32], [8], b_max=512, budget=1e6, n_est=64)
  with pytest.raises(ValueError, match=r"C=1000 .* Bp\*n_est = 32\*64 = 2048"):
    sweep_grid([32], [8], b_max=65_536, budget=1e3, n_est=64)


@pytest.mark.parametrize("bp,n,n_est,m,k", [(32, 8, None, 7812, 8), (32, 2048, None, 30, 8),
                                            (8, 2, None, 128, 4), (4, 2, 8, 50, 3),
                                            (3, 5, None, 1, 8), (2, 2, None, 5000, 64),
                                            (32, 8, None, 7812, 10**9)])
def test_log_spaced_steps_are_the_first_to_reach_each_power(bp, n, n_est, m, k):
  # Step s spends (s-1)*r .. s*r rollouts (r = Bp * n_est): it is in the schedule iff a
  # threshold 2^(j/k) falls in that interval, counted here with logs instead.
  point = BudgetPoint(bp=bp, n=n, m=m, n_est=n_est)
  r = point.sampled_batch
  below = lambda x: 0 if x < 1 else math.floor(k * math.log2(x) + 1e-9) + 1
  expected = tuple(s for s in range(1, m + 1) if below(s * r) > below((s - 1) * r))
  steps = point.log_spaced_steps(k)
  assert steps == expected and steps[0] == 1 and steps[-1] <= m
  # Two points of one budget reach the same thresholds: their evaluations sit at the
  # same compute values up to one update of each.
  if m > 1:
    other = BudgetPoint.from_budget(point.compute, bp=bp * 2, n=n, n_est=n_est)
    reached = lambda p: {below(s * p.sampled_batch) for s in p.log_spaced_steps(k)}
    assert reached(other) <= reached(point)
  with pytest.raises(ValueError, match="per_doubling must be a positive integer, got 0"):
    point.log_spaced_steps(0)


def test_estimate_tokens_and_table():
  p = BudgetPoint(bp=8, n=4, m=10)
  assert estimate_tokens(p, 6.5) == 2080
  assert estimate_tokens(p, 6.5, mean_prompt_tokens=10) == 320 * 16.5
  table = format_table([p, BudgetPoint(bp=16, n=4, m=5)], mean_response_tokens=6.5)
  lines = table.splitlines()
  assert lines[0].split() == ["Bp", "n", "B", "M", "compute", "est_tokens"]
  assert lines[1].split() == ["8", "4", "32", "10", "320", "2080"]
  with pytest.raises(ValueError):
    estimate_tokens(p, -1)
  # Rounded to the nearest token, not truncated: 3 rollouts x 0.9 tokens = 2.7 -> 3.
  assert estimate_tokens(BudgetPoint(bp=1, n=3, m=1), 0.9) == 3


def test_ledger_counts_dropped_rollouts():
  led = Ledger()
  led = led.add(rollouts=32, tokens=200, dropped_rollouts=8, updates=1)
  led = led.add(rollouts=32, tokens=150, updates=1)
  assert (led.rollouts, led.tokens, led.dropped_rollouts, led.updates) == (64, 350, 8, 2)
  with pytest.raises(ValueError, match="dropped"):
    led.add(rollouts=4, tokens=1, dropped_rollouts=5)

  class FakeRollouts:
    num_rollouts = 16
    num_generated_tokens = 77

  led2 = led.add_rollouts(FakeRollouts(), dropped_rollouts=16)
  assert (led2.rollouts, led2.tokens, led2.dropped_rollouts, led2.updates) == (80, 427, 24, 3)
  assert led.rollouts == 64  # immutable


def test_ledger_device_seconds_add_up_to_device_hours():
  led = Ledger().add(rollouts=8, tokens=8, device_seconds=1800.0)
  led = led.add_rollouts(type("R", (), {"num_rollouts": 8, "num_generated_tokens": 9})(),
                         device_seconds=5400)
  assert (led.device_seconds, led.device_hours, led.updates) == (7200.0, 2.0, 1)
  for bad in (-1.0, float("nan"), float("inf"), True):
    with pytest.raises(ValueError, match="device_seconds"):
      Ledger(device_seconds=bad)
  # A checkpoint written before the field existed resumes with none spent.
  assert Ledger.from_state_dict({"rollouts": 8, "tokens": 8, "dropped_rollouts": 0,
                                 "updates": 1}).device_seconds == 0.0


def test_ledger_state_round_trip():
  led = Ledger(rollouts=1000, tokens=12345, dropped_rollouts=10, updates=7,
               critic_flops=3 * 10**18, device_seconds=12.5)
  state = led.state_dict()
  assert json.loads(json.dumps(state)) == state
  assert Ledger.from_state_dict(state) == led
  # As orbax restores them: NumPy scalars.
  assert Ledger.from_state_dict({k: np.asarray(v) for k, v in state.items()}) == led
  with pytest.raises(ValueError, match="unknown"):
    Ledger.from_state_dict(state | {"foo": 1})
  with pytest.raises(ValueError):
    Ledger(rollouts=-1)
  # A checkpoint of a run without a critic has no critic_flops: 0.
  old = {k: v for k, v in state.items() if k != "critic_flops"}
  assert Ledger.from_state_dict(old).critic_flops == 0


def test_ledger_state_refuses_missing_or_fractional_counts():
  state = Ledger(rollouts=1000, tokens=12345, dropped_rollouts=10, updates=7).state_dict()
  # A resumed run would otherwise carry on as if nothing had been spent.
  for key in ("rollouts", "tokens", "dropped_rollouts", "updates"):
    with pytest.raises(ValueError, match=rf"lacks \['{key}'\]"):
      Ledger.from_state_dict({k: v for k, v in state.items() if k != key})
  for bad in (1000.5, "1000", None):
    with pytest.raises(ValueError, match=r"rollouts=.* is not a whole count"):
      Ledger.from_state_dict(state | {"rollouts": bad})
  assert Ledger.from_state_dict(state | {"rollouts": 1000.0}).rollouts == 1000


def test_ledger_adds_critic_flops_beside_rollouts():
  class FakeRollouts:
    num_rollouts = 16
    num_generated_tokens = 77

  led = Ledger().add_rollouts(FakeRollouts(), critic_flops=10**15)
  led = led.add_rollouts(FakeRollouts(), critic_flops=2 * 10**15)
  assert (led.rollouts, led.updates, led.critic_flops) == (32, 2, 3 * 10**15)


def test_budget_does_not_import_jax():
  code = "import sys, isojax.budget; print('jax' in sys.modules)"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=True)
  assert out.stdout.strip() == "False"


def test_decoupled_point_charges_n_est():
  # App. G: Bp=128, n=64 trained of n_est=256 sampled; C counts sampled rollouts.
  p = BudgetPoint.from_budget(2e6, bp=128, n=64, n_est=256)
  assert p.m == 2_000_000 // (128 * 256) == 61
  assert p.batch == 128 * 64 and p.sampled_batch == 128 * 256
  assert p.compute == 128 * 256 * 61
  assert p.to_dict() == {"bp": 128, "n": 64, "m": 61, "batch": 8192,
                         "compute": 128 * 256 * 61, "n_est": 256}
  assert p.name == "bp128_n64e256_m61"
  # n_est = n is the ordinary point, with the same dict as before.
  same = BudgetPoint.from_budget(2e6, bp=128, n=64, n_est=64)
  assert same == BudgetPoint.from_budget(2e6, bp=128, n=64)
  assert "n_est" not in same.to_dict()
  with pytest.raises(ValueError, match="n_est=32 .* >= n=64"):
    BudgetPoint.from_budget(2e6, bp=128, n=64, n_est=32)
  with pytest.raises(ValueError, match=r"Bp\*n_est = 128\*256 = 32768"):
    BudgetPoint.from_budget(30_000, bp=128, n=64, n_est=256)


def test_study_max_tokens():
  assert budget.study_max_tokens(0, "") == budget.SYNTHETIC_MAX_TOKENS == 8
  assert budget.study_max_tokens(0, "/ckpt/Qwen2.5-7B-Instruct") == 8192
  assert budget.study_max_tokens(512, "/ckpt/Qwen2.5-7B-Instruct") == 512
  with pytest.raises(ValueError, match="max_tokens=-1"):
    budget.study_max_tokens(-1, "")


def test_a_ledger_never_holds_more_dropped_rollouts_than_rollouts():
  """Built directly or restored from a checkpoint: more dropped than generated is a
  corrupt count, and every fraction of compute wasted read from it would exceed 1."""
  assert Ledger(rollouts=5, dropped_rollouts=5).dropped_rollouts == 5
  with pytest.raises(ValueError, match="dropped_rollouts=6 exceeds rollouts=5"):
    Ledger(rollouts=5, dropped_rollouts=6)
  state = Ledger(rollouts=5, tokens=9, dropped_rollouts=1, updates=1).state_dict()
  with pytest.raises(ValueError, match="exceeds rollouts"):
    Ledger.from_state_dict(state | {"dropped_rollouts": 6})
