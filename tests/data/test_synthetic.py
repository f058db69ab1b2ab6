"""Synthetic task families (isojax/data/synthetic.py): determinism and correct answers."""

import re

import pytest

from isojax.data import synthetic_problems, synthetic_splits
from isojax.data.synthetic import FAMILIES, VOCAB, family_of


def _solve(prompt: str) -> str:
  """Independent reference: parse the prompt with a regex, compute with Python ints."""
  m = re.fullmatch(r"(\d+)([+\-*])(\d+)=", prompt)
  if m:
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return str({"+": a + b, "-": a - b, "*": a * b}[op])
  m = re.fullmatch(r"([RS])(\d+)=", prompt)
  assert m, prompt
  digits = m.group(2)
  return digits[::-1] if m.group(1) == "R" else "".join(sorted(digits, key=int))


def test_answers_are_correct_and_well_formed():
  probs = synthetic_problems(2000, seed=3, digits=(1, 6))
  seen_families = set()
  for p in probs:
    assert p.answer == _solve(p.prompt), p
    assert set(p.prompt + p.answer) <= set(VOCAB), p
    family = family_of(p)
    seen_families.add(family)
    assert p.id.endswith(family + re.search(r"\d+$", p.id).group(0))
    if family == "sub":
      assert not p.answer.startswith("-")
    if family == "mul":
      assert 2 <= int(p.prompt.split("*")[1][:-1]) <= 9
    # Answers are written most significant digit first, without leading zeros
    # (except the reversal, whose answer is a digit string).
    if family in ("add", "sub", "mul"):
      assert p.answer == str(int(p.answer))
  assert seen_families == set(FAMILIES)
  assert len({p.prompt for p in probs}) == len(probs)  # unique by default


def test_digit_counts_follow_the_knob():
  for p in synthetic_problems(300, seed=1, digits=5):
    nums = re.findall(r"\d+", p.prompt)
    if family_of(p) == "mul":
      assert len(nums[0]) == 5 and len(nums[1]) == 1
    else:
      assert all(len(n) == 5 for n in nums), p
  per_family = {"add": (2, 2), "sub": 3, "mul": 1, "rev": (6, 7), "sort": 4}
  for p in synthetic_problems(300, seed=2, digits=per_family):
    d = len(re.findall(r"\d+", p.prompt)[0])
    lo, hi = (per_family[family_of(p)],) * 2 if isinstance(
        per_family[family_of(p)], int) else per_family[family_of(p)]
    assert lo <= d <= hi, p


def test_deterministic_from_seed():
  a = synthetic_problems(500, seed=11)
  b = synthetic_problems(500, seed=11)
  c = synthetic_problems(500, seed=12)
  assert a == b
  assert [p.prompt for p in a] != [p.prompt for p in c]
  # Family restriction and weights.
  only = synthetic_problems(50, seed=0, families=("rev",), digits=4)
  assert all(family_of(p) == "rev" for p in only)
  weighted = synthetic_problems(200, seed=0, weights={"add": 1.0, "sort": 0.0, "sub": 0,
                                                      "mul": 0, "rev": 0})
  assert {family_of(p) for p in weighted} == {"add"}


def test_splits_are_disjoint():
  train, val = synthetic_splits(300, 100, seed=5)
  assert len(train) == 300 and len(val) == 100
  assert not {p.prompt for p in train} & {p.prompt for p in val}
  assert len({p.id for p in train + val}) == 400
  assert synthetic_splits(300, 100, seed=5) == (train, val)


def test_bad_arguments():
  with pytest.raises(ValueError, match="families"):
    synthetic_problems(3, seed=0, families=("add", "div"))
  with pytest.raises(ValueError, match="digits"):
    synthetic_problems(3, seed=0, digits=(3, 2))
  with pytest.raises(ValueError, match="no entry"):
    synthetic_problems(3, seed=0, families=("add", "sub"), digits={"add": 2})
  # Only 9 one-digit reversal prompts exist ("R1=".."R9=").
  with pytest.raises(ValueError, match="too small"):
    synthetic_problems(20, seed=0, families=("rev",), digits=1)
