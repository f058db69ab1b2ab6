"""Validation metrics (isojax/evaluate.py) against exhaustive enumeration."""

import itertools
import math
import subprocess
import sys

import numpy as np
import pytest

from isojax.data import Problem
from isojax.evaluate import (evaluate, format_histogram, histogram_metrics,
                             metrics_from_counts, pass_at_k, pass_rate_histogram,
                             worst_at_k)


def _enumerate(n, c, k):
  """(best, worst) over all k-subsets of n samples of which the first c are correct."""
  correct = [i < c for i in range(n)]
  subsets = list(itertools.combinations(range(n), k))
  best = sum(any(correct[i] for i in s) for s in subsets) / len(subsets)
  worst = sum(all(correct[i] for i in s) for s in subsets) / len(subsets)
  return best, worst


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 10])
def test_against_enumeration(n):
  for c in range(n + 1):
    for k in range(1, n + 1):
      best, worst = _enumerate(n, c, k)
      assert pass_at_k(n, c, k) == pytest.approx(best, abs=1e-12), (n, c, k)
      assert worst_at_k(n, c, k) == pytest.approx(worst, abs=1e-12), (n, c, k)


def test_vectorised_matches_scalar():
  n, k = 16, 4
  c = np.arange(n + 1)
  best, worst = pass_at_k(n, c, k), worst_at_k(n, c, k)
  assert best.shape == worst.shape == (n + 1,)
  for ci in c:
    assert best[ci] == pytest.approx(pass_at_k(n, int(ci), k), abs=1e-15)
    assert worst[ci] == pytest.approx(worst_at_k(n, int(ci), k), abs=1e-15)
  # Per-problem n too (broadcasting).
  ns = np.array([4, 8, 16])
  cs = np.array([1, 2, 3])
  got = pass_at_k(ns, cs, 2)
  want = [1 - math.comb(n_ - c_, 2) / math.comb(n_, 2) for n_, c_ in zip(ns, cs)]
  np.testing.assert_allclose(got, want, atol=1e-14)


def test_large_n_is_stable():
  # math.comb with exact integers as the reference, at sizes where a naive
  # float ratio of binomials overflows (C(2048, 1024) ~ 1e615).
  n = 2048
  for c, k in [(1, 1024), (3, 1000), (1000, 1024), (2000, 64), (1024, 1024)]:
    want_best = 1 - math.comb(n - c, k) / math.comb(n, k) if n - c >= k else 1.0
    want_worst = math.comb(c, k) / math.comb(n, k)
    assert pass_at_k(n, c, k) == pytest.approx(want_best, rel=1e-9, abs=1e-300)
    assert worst_at_k(n, c, k) == pytest.approx(want_worst, rel=1e-9, abs=1e-300)
    assert np.isfinite(pass_at_k(n, c, k)) and np.isfinite(worst_at_k(n, c, k))


@pytest.mark.parametrize("args", [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5), (0, 0, 1),
                                  (4, 1.5, 1)])
def test_bad_inputs(args):
  with pytest.raises(ValueError):
    pass_at_k(*args)
  with pytest.raises(ValueError):
    worst_at_k(*args)


def test_metrics_from_counts():
  counts = np.array([0, 1, 4, 2])
  m = metrics_from_counts(counts, 4, ks=(1, 4), prefix="val/")
  assert m["val/avg@4"] == pytest.approx(7 / 16)
  assert m["val/avg@1"] == pytest.approx(7 / 16)
  # k = n: best = any correct, worst = all correct.
  assert m["val/best@4"] == pytest.approx(3 / 4)
  assert m["val/worst@4"] == pytest.approx(1 / 4)
  # k = 1: both equal the mean pass rate.
  assert m["val/best@1"] == pytest.approx(7 / 16)
  assert m["val/worst@1"] == pytest.approx(7 / 16)
  assert set(m) == {f"val/{a}@{k}" for a in ("avg", "best", "worst") for k in (1, 4)}


def test_histogram():
  counts = np.array([0, 0, 1, 8, 15, 16, 16, 5])  # n = 16
  h = pass_rate_histogram(counts, 16)
  assert len(h["bin_edges"]) == 11 and len(h["fractions"]) == 10
  assert sum(h["fractions"]) == pytest.approx(1.0)
  f = h["fractions"]
  # rates: 0, 0, .0625, .5, .9375, 1, 1, .3125
  assert f[0] == pytest.approx(3 / 8)
  assert f[3] == pytest.approx(1 / 8)
  assert f[5] == pytest.approx(1 / 8)
  assert f[9] == pytest.approx(3 / 8)  # last bin includes 1.0
  assert h["zero_pass_fraction"] == pytest.approx(2 / 8)
  assert h["full_pass_fraction"] == pytest.approx(2 / 8)
  flat = histogram_metrics(counts, 16, prefix="train/")
  assert flat["train/zero_pass_frac"] == pytest.approx(0.25)
  assert flat["train/pass@1_hist/0.9"] == pytest.approx(3 / 8)
  assert "zero-pass 25.0%" in format_histogram(counts, 16)
  with pytest.raises(ValueError):
    pass_rate_histogram([17], 16)


@pytest.mark.parametrize("n", [5, 10, 20, 128])
def test_histogram_bins_rates_on_an_edge_exactly(n):
  # c/n on a bin edge (3/10, 6/10, 7/10, ...) belongs to the bin it starts: float
  # edges from linspace (0.30000000000000004) once put it one bin too low.
  counts = np.arange(n + 1)
  f = pass_rate_histogram(counts, n)["fractions"]
  want = np.bincount([min(10 * c // n, 9) for c in counts], minlength=10) / (n + 1)
  np.testing.assert_allclose(f, want, atol=1e-15)
  assert pass_rate_histogram([3], 10)["fractions"][3] == 1.0


class _CharTokenizer:
  """Char-level stand-in: id = ord(char); 1 = EOS."""

  eos_token_id, pad_token_id, bos_token_id = 1, 0, 2

  def encode(self, text, add_special_tokens=False):
    return ([2] if add_special_tokens else []) + [ord(ch) for ch in text]

  def decode(self, ids):
    return "".join(chr(i) for i in ids)


class _ScriptedSampler:
  """Returns, for prompt i, `correct[i]` right answers then wrong ones."""

  def __init__(self, answers, correct):
    self.answers, self.correct, self.calls = answers, correct, []

  def generate(self, prompt_ids, *, n, max_tokens, temperature, top_p=1.0, top_k=None,
               stop_token_ids=(), seed=0):
    from isojax.rollout.base import Rollouts

    self.calls.append(dict(num=len(prompt_ids), n=n, seed=seed,
                           stop=tuple(stop_token_ids), temperature=temperature))
    seqs, reasons = [], []
    for ids in prompt_ids:
      text = "".join(chr(i) for i in ids[1:])  # drop BOS
      i = next(j for j, (p, _) in enumerate(self.answers) if p == text)
      for j in range(n):
        ans = self.answers[i][1] if j < self.correct[i] else "x" + self.answers[i][1]
        seqs.append([ord(ch) for ch in ans] + [1])
        reasons.append("stop")
    return Rollouts.from_sequences(seqs, [[0.0] * len(s) for s in seqs], reasons)

  def update_weights(self, model):
    pass


def test_evaluate_with_scripted_sampler():
  problems = [Problem(str(i), f"{i}+{i}=", str(2 * i)) for i in range(6)]
  correct = [0, 1, 2, 3, 4, 2]
  sampler = _ScriptedSampler([(p.prompt, p.answer) for p in problems], correct)
  res = evaluate(sampler, problems, _CharTokenizer(), k=4, temperature=0.6, max_tokens=8,
                 seed=3, batch_size=4)
  np.testing.assert_array_equal(res.counts_P, correct)
  assert res.metrics["val/avg@4"] == pytest.approx(12 / 24)
  assert res.metrics["val/best@4"] == pytest.approx(5 / 6)
  assert res.metrics["val/worst@4"] == pytest.approx(1 / 6)
  # Two batches (4 + 2 problems), distinct seeds, EOS as the stop token.
  assert [c["num"] for c in sampler.calls] == [4, 2]
  assert [c["seed"] for c in sampler.calls] == [3, 4]
  assert all(c["stop"] == (1,) and c["n"] == 4 for c in sampler.calls)
  # Mean length: answers of 1-2 chars, wrong ones one longer, plus EOS.
  assert res.mean_response_tokens > 1


def test_evaluate_module_does_not_import_jax():
  code = "import sys, isojax.evaluate; print('jax' in sys.modules)"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=True)
  assert out.stdout.strip() == "False"


@pytest.mark.parametrize("kwargs, match", [
    (dict(ks=[8]), r"ks=\[8\] has \[8\]; each k' must be an int in \[1, k=4\]"),
    (dict(ks=[]), r"ks is empty"),
    (dict(k=0), r"k=0 samples per problem"),
    (dict(batch_size=-1), r"batch_size=-1"),
])
def test_evaluate_refuses_bad_sizes_before_sampling(kwargs, match):
  problems = [Problem(str(i), f"{i}+{i}=", str(2 * i)) for i in range(3)]
  sampler = _ScriptedSampler([(p.prompt, p.answer) for p in problems], [0, 1, 2])
  with pytest.raises(ValueError, match=match):
    evaluate(sampler, problems, _CharTokenizer(), max_tokens=8, **{"k": 4, **kwargs})
  assert not sampler.calls  # no validation pass spent on a request that cannot score


@pytest.mark.parametrize("reward", [float("nan"), float("inf"), None, "1"])
def test_a_reward_that_is_not_a_finite_number_is_refused(reward):
  problems = [Problem(str(i), f"{i}+{i}=", str(2 * i)) for i in range(2)]
  sampler = _ScriptedSampler([(p.prompt, p.answer) for p in problems], [1, 2])
  with pytest.raises(ValueError, match=r"reward_fn returned .* for rollout 0 \(problem 0, "
                                       r"answer '0'\); expected a finite number"):
    evaluate(sampler, problems, _CharTokenizer(), k=2, max_tokens=8,
             reward_fn=lambda response, answer: reward)
  # Booleans and NumPy scalars are numbers: a verifier may return them.
  res = evaluate(sampler, problems, _CharTokenizer(), k=2, max_tokens=8,
                 reward_fn=lambda response, answer: np.float32(response == answer))
  np.testing.assert_array_equal(res.counts_P, [1, 2])
  res = evaluate(sampler, problems, _CharTokenizer(), k=2, max_tokens=8,
                 reward_fn=lambda response, answer: np.bool_(response == answer))
  np.testing.assert_array_equal(res.counts_P, [1, 2])


@pytest.mark.parametrize("bins", [3, 10, 20, 40, 100])
def test_flat_histogram_has_a_key_per_bin(bins):
  counts = np.arange(41)  # n = 40: every bin of every layout here gets a rate
  h = pass_rate_histogram(counts, 40, bins)
  flat = histogram_metrics(counts, 40, prefix="train/", bins=bins)
  hist = {k: v for k, v in flat.items() if "pass@1_hist/" in k}
  assert list(hist.values()) == h["fractions"]  # one key per bin, none overwritten
  starts = [float(k.rsplit("/", 1)[1]) for k in hist]
  np.testing.assert_allclose(starts, h["bin_edges"][:-1], atol=0.5 / bins)
  if bins == 10:  # tenths keep their one-decimal names
    assert list(hist) == [f"train/pass@1_hist/{i / 10:.1f}" for i in range(10)]
  if bins == 20:
    assert "train/pass@1_hist/0.05" in hist
    assert "[0.95, 1.00] " in format_histogram(counts, 40, bins=bins)


@pytest.mark.parametrize("args, match", [
    (([1.5, 2], 4), "must be integers"),
    (([np.nan, 2], 4), "must be integers"),
    (([1, 2], 0), r"n \(samples per problem\) must be >= 1"),
    (([1, 2], [4, 4]), "n must be one number"),
    (([1, 5], 4), r"must lie in \[0, n\]"),
])
def test_histogram_refuses_bad_counts(args, match):
  with pytest.raises(ValueError, match=match):
    pass_rate_histogram(*args)
  with pytest.raises(ValueError, match=r"bins=0; expected an int >= 1"):
    pass_rate_histogram([1, 2], 4, bins=0)


def test_unsolved_problems_score_plus_zero():
  assert math.copysign(1.0, pass_at_k(4, 0, 2)) == 1.0
  assert not np.signbit(pass_at_k(4, np.array([0, 0]), 2)).any()
  assert str(pass_at_k(4, 0, 2)) == "0.0"
