"""Rewards (isojax/data/rewards.py): exact match, math-verify, the per-answer time limit."""

import threading
import time

import pytest

from isojax.data import MathVerifier, exact_match, get_reward_fn


def test_exact_match():
  assert exact_match("1395", "1395") == 1.0
  assert exact_match(" 1 3 9 5\n", "1395") == 1.0
  assert exact_match("13950", "1395") == 0.0
  assert exact_match("", "0") == 0.0
  # An empty answer is no answer: saying nothing must not earn the reward.
  assert exact_match("", "") == 0.0 and exact_match(" \n", " ") == 0.0
  assert get_reward_fn("exact_match") is exact_match
  with pytest.raises(ValueError, match="unknown reward"):
    get_reward_fn("bleu")


@pytest.fixture(scope="module")
def verifier():
  v = MathVerifier(timeout_s=3.0)
  yield v
  v.close()


@pytest.mark.parametrize("response,answer,want", [
    ("0.5", "\\frac{1}{2}", 1.0),
    ("The answer is $\\frac12$.", "0.5", 1.0),
    ("so the result is \\boxed{\\frac{1}{2}}", "1/2", 1.0),
    ("\\boxed{3}", "3", 1.0),
    ("First 2, then \\boxed{4}.", "3", 0.0),
    ("\\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
    ("no number here", "7", 0.0),
    ("\\boxed{\\sqrt{2}}", "\\sqrt{2}", 1.0),
    # The exact-match shortcut ignores only the ends' whitespace.
    (" 23\n", "23", 1.0),
    ("2 3", "23", 0.0),
    ("x = 1 0", "x=10", 0.0),
    # An escaped dollar is a money sign, not a math delimiter (MATH's answers).
    ("\\boxed{\\$1.17}", "\\$1.17", 1.0),
    ("\\boxed{1.17}", "\\$1.17", 1.0),
    ("\\boxed{1.18}", "\\$1.17", 0.0),
    ("\\boxed{32000}", "\\$32,\\!000", 1.0),
    ("\\boxed{32000}", "$\\$32,\\!000$", 1.0),
    ("\\boxed{32001}", "\\$32,\\!000", 0.0),
    # \[ ... \] and \( ... \) delimit math as $ does: the answer is not wrapped in $.
    ("\\boxed{2}", "\\[2\\]", 1.0),
    ("\\boxed{0.5}", "\\[\\frac{1}{2}\\]", 1.0),
    ("\\boxed{3}", "\\[2\\]", 0.0),
    ("\\boxed{0.5}", "\\(\\frac{1}{2}\\)", 1.0),
    # A LaTeX space between thousands is no product: 5\,000 is 5000, not 5 * 000 = 0.
    ("\\boxed{5000}", "5\\,000", 1.0),
    ("\\boxed{0}", "5\\,000", 0.0),
    ("\\boxed{5\\,000}", "5000", 1.0),
    ("\\boxed{5\\,000}", "0", 0.0),
    ("\\boxed{1\\;234\\ 567}", "1234567", 1.0),
    ("\\boxed{10~100}", "10100", 0.0),
    ("\\boxed{3\\,\\text{cm}}", "3", 1.0),
    # An empty answer is no answer: saying nothing must not earn the reward.
    ("", "", 0.0),
    ("  \n", " ", 0.0),
    ("\\boxed{42}", "", 0.0),
])
def test_math_verify_cases(verifier, response, answer, want):
  assert verifier(response, answer) == want


def test_pathological_answer_times_out_in_a_thread(verifier):
  # sympy tries to evaluate 9^(9^9) (a 370-million-digit integer) and never returns
  # within any reasonable limit; math-verify's own signal timeout cannot work off
  # the main thread, so our wall-clock limit must end it.
  out = {}

  def work():
    t = time.monotonic()
    out["score"] = verifier("\\boxed{9^{9^{9}}}", "1")
    out["seconds"] = time.monotonic() - t

  th = threading.Thread(target=work)
  th.start()
  th.join(timeout=60)
  assert not th.is_alive(), "verification hung"
  assert out["score"] == 0.0
  assert out["seconds"] < verifier.timeout_s + 5.0  # kill + reap, not a hang
  assert verifier.num_timeouts >= 1
  # The verifier recovers with a fresh worker, also from a thread.
  res = []
  th = threading.Thread(target=lambda: res.append(verifier("\\boxed{0.25}", "1/4")))
  th.start()
  th.join(timeout=120)
  assert res == [1.0]


def test_score_batch_and_factory(verifier):
  assert verifier.score_batch(["\\boxed{2}", "\\boxed{5}"], ["2", "3"]) == [1.0, 0.0]
  with pytest.raises(ValueError):
    verifier.score_batch(["1"], [])
  v = get_reward_fn("math_verify", timeout_s=1.0)
  assert isinstance(v, MathVerifier) and v.timeout_s == 1.0
  v.close()
  with pytest.raises(ValueError):
    MathVerifier(timeout_s=0)


def test_pool_scores_in_parallel_and_survives_a_timeout():
  from isojax.data.rewards import MathVerifierPool

  pool = get_reward_fn("math_verify", num_workers=2, timeout_s=2.0)
  assert isinstance(pool, MathVerifierPool)
  try:
    responses = ["\\boxed{0.5}", "\\boxed{9^{9^{9}}}", "\\boxed{3}", "x = 2"]
    answers = ["1/2", "1", "4", "2"]
    assert pool.score_batch(responses, answers) == [1.0, 0.0, 0.0, 1.0]
    assert pool.num_timeouts == 1
  finally:
    pool.close()
