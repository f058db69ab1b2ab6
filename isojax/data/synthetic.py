"""Built-in synthetic task families: digit arithmetic that runs without downloads.

Five families whose skills do not transfer to one another, so that they compete for a
small model's capacity (the paper's interference, §5.1 and App. I):

  add   "482+913="  -> "1395"    sum of two d-digit numbers
  sub   "913-482="  -> "431"     difference, first operand >= second (no sign)
  mul   "4821*7="   -> "33747"   a d-digit number times one digit 2..9
  rev   "R48213="   -> "31284"   the d digits reversed
  sort  "S48213="   -> "12348"   the d digits in ascending order

The difficulty knob is the digit count d. Answers are written most significant digit
first, as a model reads them. Prompts are plain text over a 20-token character
vocabulary (`VOCAB`); the tokenizer adds BOS and the model ends answers with EOS.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from isojax.data.sources import Problem

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
SYMBOLS = ("+", "-", "*", "=", "R", "S")
VOCAB = SPECIAL_TOKENS + tuple("0123456789") + SYMBOLS  # 20 tokens; ids = positions

FAMILIES = ("add", "sub", "mul", "rev", "sort")
DEFAULT_FAMILIES = FAMILIES
# Digit counts at which the committed base model is partly trained: the arithmetic
# families near pass@1 0.1-0.2, reversal/sorting higher (isojax/assets/base_model).
DEFAULT_DIGITS = {"add": 3, "sub": 3, "mul": 3, "rev": 6, "sort": 6}


def _number(rng: np.random.Generator, digits: int) -> int:
  """A uniform d-digit number (no leading zero; 0..9 when d = 1)."""
  lo = 0 if digits == 1 else 10 ** (digits - 1)
  return int(rng.integers(lo, 10**digits))


def _digit_string(rng: np.random.Generator, digits: int) -> str:
  """d digits, the first nonzero so the prompt reads as a number."""
  first = str(int(rng.integers(1, 10)))
  return first + "".join(str(int(d)) for d in rng.integers(0, 10, size=digits - 1))


def make_problem(family: str, digits: int, rng: np.random.Generator) -> tuple[str, str]:
  """(prompt, answer) for one problem of `family` with `digits` digits."""
  if family == "add":
    a, b = _number(rng, digits), _number(rng, digits)
    return f"{a}+{b}=", str(a + b)
  if family == "sub":
    a, b = sorted((_number(rng, digits), _number(rng, digits)), reverse=True)
    return f"{a}-{b}=", str(a - b)
  if family == "mul":
    a, d = _number(rng, digits), int(rng.integers(2, 10))
    return f"{a}*{d}=", str(a * d)
  if family == "rev":
    s = _digit_string(rng, digits)
    return f"R{s}=", s[::-1]
  if family == "sort":
    s = _digit_string(rng, digits)
    return f"S{s}=", "".join(sorted(s))
  raise ValueError(f"unknown synthetic family {family!r}; choose from {FAMILIES}")


def _digit_range(digits, family: str = "") -> tuple[int, int]:
  lo, hi = (digits, digits) if isinstance(digits, (int, np.integer)) else tuple(digits)
  if not (1 <= lo <= hi <= 12):
    where = f" for family {family!r}" if family else ""
    raise ValueError(f"digits{where} must be an int or (min, max) with "
                     f"1 <= min <= max <= 12, got {digits!r}")
  return int(lo), int(hi)


def digit_ranges(digits, families: Sequence[str]) -> dict[str, tuple[int, int]]:
  """family -> inclusive (min, max) digits, from an int, a pair or a per-family dict."""
  if isinstance(digits, Mapping):
    missing = [f for f in families if f not in digits]
    if missing:
      raise ValueError(f"digits mapping has no entry for families {missing}")
    return {f: _digit_range(digits[f], f) for f in families}
  return {f: _digit_range(digits) for f in families}


def _check_families(families: Sequence[str]) -> tuple[str, ...]:
  families = tuple(families)
  bad = [f for f in families if f not in FAMILIES]
  if not families or bad:
    raise ValueError(f"unknown synthetic families {bad or families}; choose from "
                     f"{FAMILIES}")
  return families


def _family_probs(weights, families) -> np.ndarray:
  if weights is None:
    return np.full(len(families), 1.0 / len(families))
  w = np.array([float(weights.get(f, 0.0)) for f in families])
  if np.any(w < 0) or w.sum() <= 0:
    raise ValueError(f"family weights must be >= 0 with a positive sum, got {weights}")
  return w / w.sum()


def synthetic_problems(num: int, *, seed: int, families: Sequence[str] = DEFAULT_FAMILIES,
                       digits=DEFAULT_DIGITS, weights: Mapping[str, float] | None = None,
                       unique: bool = True, exclude: Sequence[str] = (),
                       id_prefix: str = "syn") -> list[Problem]:
  """`num` problems drawn deterministically from `seed`.

  Each problem picks a family from `families` (uniformly, or by `weights`) and then
  a digit count uniformly from that family's range.

  Args:
    digits: an int, an inclusive (min, max) range, or a dict family -> either, e.g.
      {"add": (2, 3), "rev": (4, 7), ...} to make families comparably hard.
    weights: optional family -> sampling weight (default uniform).
    unique: no two problems share a prompt (redraws duplicates).
    exclude: prompts never to produce (e.g. another split's, for disjoint sets).
    id_prefix: ids are f"{id_prefix}-{seed}-{i}-{family}{digits}".

  Raises:
    ValueError: on unknown families, bad digit ranges, or when `unique` cannot be
      met because the task space is too small.
  """
  families = _check_families(families)
  ranges = digit_ranges(digits, families)
  probs = _family_probs(weights, families)
  if num < 0:
    raise ValueError(f"num must be >= 0, got {num}")
  rng = np.random.default_rng(seed)
  seen = set(exclude)
  problems = []
  attempts, max_attempts = 0, 50 * num + 1000
  while len(problems) < num:
    attempts += 1
    if attempts > max_attempts:
      raise ValueError(
          f"could only draw {len(problems)} of {num} unique synthetic problems "
          f"(families={families}, digits={digits}); the task space is too small")
    family = families[int(rng.choice(len(families), p=probs))]
    lo, hi = ranges[family]
    d = int(rng.integers(lo, hi + 1))
    prompt, answer = make_problem(family, d, rng)
    if unique and prompt in seen:
      continue
    seen.add(prompt)
    problems.append(Problem(id=f"{id_prefix}-{seed}-{len(problems)}-{family}{d}",
                            prompt=prompt, answer=answer))
  return problems


def synthetic_splits(num_train: int, num_val: int, *, seed: int,
                     families: Sequence[str] = DEFAULT_FAMILIES,
                     digits=DEFAULT_DIGITS, exclude: Sequence[str] = ()
                     ) -> tuple[list[Problem], list[Problem]]:
  """Disjoint (train, val) problem sets from one seed (no prompt appears in both).

  Args:
    exclude: prompts the training set must not hold (other validation sets'), drawn
      around so that it still has `num_train` problems.
  """
  train = synthetic_problems(num_train, seed=seed, families=families, digits=digits,
                             exclude=exclude, id_prefix="train")
  val = synthetic_problems(num_val, seed=seed + 1_000_003, families=families,
                           digits=digits, exclude=[p.prompt for p in train],
                           id_prefix="val")
  return train, val


def family_of(problem: Problem) -> str:
  """The family of a synthetic problem, read from its prompt."""
  prompt = problem.prompt
  if prompt.startswith("R"):
    return "rev"
  if prompt.startswith("S"):
    return "sort"
  for op, family in (("+", "add"), ("-", "sub"), ("*", "mul")):
    if op in prompt:
      return family
  raise ValueError(f"problem {problem.id!r}: prompt {prompt!r} is not a synthetic task")
