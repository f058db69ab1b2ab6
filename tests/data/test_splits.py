"""Difficulty splits and mixtures (isojax/data/splits.py) on synthetic counts, and the
launcher that samples them (launch/difficulty_splits.py)."""

import json
import os
import sys

import numpy as np
import pytest

from isojax.data import Problem, indices_in_range, mixture_indices, split_indices
from isojax.data.splits import write_splits

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from launch.difficulty_splits import estimate_counts, main  # noqa: E402


def test_paper_ranges_on_counts_of_16():
  counts = np.arange(17)  # one problem per possible count out of 16
  s = split_indices(counts, 16)
  # hard: avg@16 in [0, 0.0625] -> c in {0, 1} (1/16 = 0.0625 is inside).
  assert s["hard"].tolist() == [0, 1]
  # easy: [0.3, 0.6] -> c/16 in {5/16=.3125, ..., 9/16=.5625}.
  assert s["easy"].tolist() == [5, 6, 7, 8, 9]
  # very easy and extremely hard are chosen on 128 samples (Fig. 14), not on 16.
  assert "very_easy" not in s and "extremely_hard" not in s


def test_extremely_hard_and_very_easy_need_128_samples():
  counts16 = np.array([0, 0, 0, 3, 12, 11, 15])
  # Rates over 128: 0, 2/128, 0, 30/128, 0.59.., 0.6, 0.9 .
  counts128 = np.array([0, 2, 0, 30, 76, 77, 116])
  s = split_indices(counts16, 16, extreme_counts_P=counts128, extreme_n=128)
  assert s["extremely_hard"].tolist() == [0, 2]
  # pass@128 in [0.6, 0.9]: problem 4 (avg@16 = 0.75, but 76/128 < 0.6) is out,
  # 5 (11/16 = 0.69, 77/128 = 0.602) and 6 (15/16 > 0.9, 116/128 = 0.906) are in
  # and out on the 128-sample rate alone.
  assert s["very_easy"].tolist() == [5]
  # Fig. 14's Easy, pass@128 in [0.3, 0.6]: 76/128 = 0.594 only.
  assert s["easy_pass128"].tolist() == [4]
  with pytest.raises(ValueError, match="128"):
    split_indices(counts16, 16, extreme_counts_P=counts16, extreme_n=16)


def test_range_edges_and_errors():
  assert indices_in_range([3, 6], 10, 0.3, 0.6).tolist() == [0, 1]  # closed range
  with pytest.raises(ValueError):
    indices_in_range([17], 16, 0, 1)
  with pytest.raises(ValueError):
    indices_in_range([1], 16, 0.6, 0.3)


def test_mixture_half_hard_half_easy():
  splits = {"hard": np.arange(0, 100), "easy": np.arange(100, 150)}
  mix = mixture_indices(splits, {"hard": 0.5, "easy": 0.5}, total=80, seed=0)
  assert len(mix) == 80 and len(set(mix.tolist())) == 80
  assert np.sum(mix < 100) == 40 and np.sum(mix >= 100) == 40
  again = mixture_indices(splits, {"hard": 0.5, "easy": 0.5}, total=80, seed=0)
  assert mix.tolist() == again.tolist()
  # Shuffled, not two blocks.
  assert not (np.all(mix[:40] < 100) or np.all(mix[:40] >= 100))
  with pytest.raises(ValueError, match="'easy'.*has 50"):
    mixture_indices(splits, {"hard": 0.5, "easy": 0.5}, total=120, seed=0)
  with pytest.raises(ValueError, match="sum to 1"):
    mixture_indices(splits, {"hard": 0.5, "easy": 0.6}, total=10, seed=0)
  with pytest.raises(ValueError, match="unknown"):
    mixture_indices(splits, {"medium": 1.0}, total=10, seed=0)


def test_mixture_whose_shares_round_up_past_the_total_keeps_it():
  # 1.5 -> 2 from each of a, b, c and 0.5 -> 0 from d: 6 of 5, one too many.
  splits = {k: np.arange(10 * i, 10 * i + 10) for i, k in enumerate("abcd")}
  weights = {"a": 0.3, "b": 0.3, "c": 0.3, "d": 0.1}
  mix = mixture_indices(splits, weights, total=5, seed=0)
  assert len(mix) == 5 and len(set(mix.tolist())) == 5
  assert sorted(np.bincount(mix // 10, minlength=4).tolist()) == [0, 1, 2, 2]


class _FixedRateSampler:
  """Answers problem i correctly in the first `correct[i]` of its n samples."""

  def __init__(self, correct):
    self.correct = correct

  def generate(self, prompt_ids, *, n, max_tokens, temperature, top_p=1.0, top_k=None,
               stop_token_ids=(), seed=0):
    from isojax.rollout.base import Rollouts

    seqs = []
    for ids in prompt_ids:
      i = ids[0]
      seqs += [[ord("y") if j < self.correct[i] else ord("n"), 1] for j in range(n)]
    return Rollouts.from_sequences(seqs, [[0.0, 0.0]] * len(seqs), ["stop"] * len(seqs))


class _IdTok:
  eos_token_id, pad_token_id, bos_token_id = 1, 0, None

  def encode(self, text, add_special_tokens=False):
    return [int(text)]

  def decode(self, ids):
    return "".join(chr(i) for i in ids)


def test_estimate_and_write_splits(tmp_path):
  correct = [0, 1, 5, 9, 12, 16, 7, 0]
  problems = [Problem(f"p{i}", str(i), "y") for i in range(len(correct))]
  counts = estimate_counts(_FixedRateSampler(correct), problems, _IdTok(), n=16,
                           batch_size=3)
  assert counts.tolist() == correct
  splits = split_indices(counts, 16)
  summary = write_splits(str(tmp_path), problems, counts, 16, splits)
  assert summary["splits"] == {"easy": 3, "hard": 3}
  rows = [json.loads(l) for l in (tmp_path / "easy.jsonl").read_text().splitlines()]
  assert [r["id"] for r in rows] == ["p2", "p3", "p6"]
  assert rows[0]["avg@16"] == pytest.approx(5 / 16)
  assert json.loads((tmp_path / "summary.json").read_text()) == summary


def test_mix_spec_and_size():
  from isojax.data.splits import mixture_size, parse_mix

  assert parse_mix("hard_easy=hard:0.5,easy:0.5") == ("hard_easy", {"hard": 0.5,
                                                                     "easy": 0.5})
  with pytest.raises(ValueError, match="NAME=SPLIT"):
    parse_mix("hard:0.5")
  splits = {"hard": np.arange(30), "easy": np.arange(30, 130)}
  # 50/50: limited by the 30 hard problems -> 60 in all.
  assert mixture_size(splits, {"hard": 0.5, "easy": 0.5}) == 60
  assert mixture_size(splits, {"hard": 0.25, "easy": 0.75}) == 120


def test_driver_refuses_too_few_extreme_samples_before_sampling(tmp_path, capsys):
  with pytest.raises(SystemExit):
    main(["--num", "12", "--samples", "4", "--extreme_samples", "8",
          "--model", str(tmp_path / "never-loaded"), "--out", str(tmp_path / "out")])
  assert "--extreme_samples=8 must be 0 (off) or >= 128" in capsys.readouterr().err
  assert not (tmp_path / "out").exists()


def test_driver_on_the_base_model(tmp_path):
  """The CLI end to end: JaxSampler on the committed base model, a tiny pool."""
  main(["--num", "12", "--seed", "5", "--samples", "16", "--extreme_samples", "128",
        "--max_tokens", "8", "--mix", "hard_easy=hard:0.5,easy:0.5",
        "--out", str(tmp_path)])
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["num_problems"] == 12 and summary["samples"] == 16
  assert "--extreme_samples 128" in summary["command"]
  rows = {}
  for name in ("easy", "hard", "very_easy", "extremely_hard", "hard_easy"):
    rows[name] = [json.loads(l) for l in (tmp_path / f"{name}.jsonl").read_text()
                  .splitlines()]
    assert len(rows[name]) == summary["splits"][name]
  for r in rows["easy"]:
    assert 0.3 <= r["avg@16"] <= 0.6
  for r in rows["hard"]:
    assert r["avg@16"] <= 0.0625
  for r in rows["extremely_hard"]:
    assert r["avg@16"] == 0 and r["pass@128"] == 0.0 and r["avg@128"] == 0.0
  for r in rows["very_easy"]:
    assert 0.6 <= r["avg@128"] <= 0.9
  assert len(rows["very_easy"]) == summary["splits"]["very_easy"]
  # Every problem has its 128-sample rate, at least its 16-sample successes.
  for r in rows["easy"] + rows["hard"]:
    assert r["avg@128"] * 128 >= r["avg@16"] * 16
  assert len(rows["hard_easy"]) == 2 * min(len(rows["hard"]), len(rows["easy"]))


def test_a_rate_of_exactly_0_6_is_easy_not_very_easy():
  # 96 of 160 samples is a rate of exactly 0.6, the edge Fig. 14's Easy and Very Easy
  # share; it must land in one split only, or a mixture of both could repeat it.
  counts160 = np.array([96, 97, 48, 144, 145])
  s = split_indices(np.zeros(5, int), 16, extreme_counts_P=counts160, extreme_n=160)
  assert s["easy_pass128"].tolist() == [0, 2]
  assert s["very_easy"].tolist() == [1, 3]  # 97/160 > 0.6; 144/160 = 0.9 is inside
  assert indices_in_range([6, 7], 10, 0.6, 0.9, exclude_lo=True).tolist() == [1]


@pytest.mark.parametrize("weights, match", [
    ({"hard": -0.5, "easy": 1.5}, "finite and >= 0"),
    ({"hard": float("nan"), "easy": 1.0}, "finite and >= 0"),
    ({"hard": 0.0, "easy": 0.0}, "positive weight"),
    ({"hard": 0.5, "none": 0.5}, "unknown"),
    ({"hard": 0.5, "empty": 0.5}, "empty split"),
])
def test_bad_mixture_weights_name_themselves(weights, match):
  from isojax.data.splits import mixture_size

  splits = {"hard": np.arange(30), "easy": np.arange(30, 130), "empty": np.zeros(0, int)}
  with pytest.raises(ValueError, match=match):
    mixture_size(splits, weights)
  if match == "finite and >= 0":
    with pytest.raises(ValueError, match=match):
      mixture_indices(splits, weights, total=10, seed=0)
