"""Difficulty splits like the paper's, from per-problem pass counts under a base model.

Difficulty is relative to the base model (playbook §3, Factor 1): avg@16, the mean
accuracy over 16 samples, decides the main experiments' splits
  easy       avg@16 in [0.3, 0.6]
  hard       avg@16 in [0, 0.0625]
and the 128-sample estimates of §5.3 (Fig. 14) decide its three levels
  extremely_hard  pass@128 = 0            (Fig. 14's "Hard")
  easy_pass128    pass@128 in [0.3, 0.6]  (Fig. 14's "Easy")
  very_easy       pass@128 in (0.6, 0.9]  (Fig. 14's "Very Easy")
where, as in Fig. 14's caption, pass@128 of a set is read per problem as the share of
its 128 samples that are correct (a range such as [0.6, 0.9] only makes sense for a
rate; "= 0" means no success). Fig. 14 writes both Easy and Very Easy as closed at
0.6; a rate of exactly 0.6 (possible with 5 | extreme_n, e.g. 96 of 160) goes to Easy
alone, so that the two stay disjoint and a mixture of them never holds a problem twice.
Both need `extreme_counts_P`: counts out of >= 128
samples for every problem. Mixtures (e.g. 50 % hard + 50 % easy, §5.3) draw from the
splits without replacement.

The split logic here is pure functions over counts; launch/difficulty_splits.py draws
the samples through a `Sampler` and writes the split files with `write_splits`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence

import numpy as np

from isojax.data.sources import Problem, write_jsonl

SPLIT_RANGES = {"easy": (0.3, 0.6), "hard": (0.0, 0.0625)}
# Selected on the >= 128-sample rate (Fig. 14), not on avg@16. very_easy leaves out
# its lower edge (see the module docstring), so the two are disjoint at any sample
# count (easy and very_easy, on different sample counts, are not).
EXTREME_RANGES = {"easy_pass128": (0.3, 0.6), "very_easy": (0.6, 0.9)}
EXCLUDES_LOWER_EDGE = frozenset({"very_easy"})
EXTREME_SAMPLES = 128


def indices_in_range(counts_P, n: int, lo: float, hi: float, *,
                     exclude_lo: bool = False) -> np.ndarray:
  """Indices of problems whose pass rate c/n lies in the closed range [lo, hi], or in
  (lo, hi] with `exclude_lo`."""
  counts_P = np.asarray(counts_P)
  if counts_P.ndim != 1:
    raise ValueError(f"counts_P must be 1-D, got shape {counts_P.shape}")
  if n < 1 or np.any(counts_P < 0) or np.any(counts_P > n):
    raise ValueError(f"counts must lie in [0, n] with n >= 1; got n={n}, range "
                     f"[{counts_P.min(initial=0)}, {counts_P.max(initial=0)}]")
  if not 0.0 <= lo <= hi <= 1.0:
    raise ValueError(f"range must satisfy 0 <= lo <= hi <= 1, got [{lo}, {hi}]")
  rate = counts_P / n
  # A tolerance so that 1/16 = 0.0625 sits inside [0, 0.0625] despite rounding.
  eps = 1e-9
  above_lo = rate > lo + eps if exclude_lo else rate >= lo - eps
  return np.flatnonzero(above_lo & (rate <= hi + eps))


def split_indices(counts_P, n: int, ranges: Mapping[str, tuple[float, float]] = SPLIT_RANGES,
                  extreme_counts_P=None, extreme_n: int | None = None) -> dict[str, np.ndarray]:
  """Indices per named split.

  Args:
    counts_P, n: correct counts out of n samples per problem (n = 16 in the paper).
    ranges: name -> closed avg@n range.
    extreme_counts_P, extreme_n: counts out of extreme_n >= 128 samples for every
      problem; when given, adds "easy_pass128" and "very_easy" (rates in
      EXTREME_RANGES, very_easy without its lower edge) and "extremely_hard" (no
      success among them).
  """
  out = {name: indices_in_range(counts_P, n, lo, hi) for name, (lo, hi) in ranges.items()}
  if extreme_counts_P is not None:
    if extreme_n is None or extreme_n < EXTREME_SAMPLES:
      raise ValueError(f"extremely hard means pass@{EXTREME_SAMPLES} = 0: need "
                       f"extreme_n >= {EXTREME_SAMPLES}, got {extreme_n}")
    extreme = np.asarray(extreme_counts_P)
    if extreme.shape != np.shape(counts_P):
      raise ValueError(f"extreme_counts_P shape {extreme.shape} != counts_P shape "
                       f"{np.shape(counts_P)}")
    for name, (lo, hi) in EXTREME_RANGES.items():
      out[name] = indices_in_range(extreme, extreme_n, lo, hi,
                                   exclude_lo=name in EXCLUDES_LOWER_EDGE)
    out["extremely_hard"] = np.flatnonzero(extreme == 0)
  return out


def _check_weights(weights: Mapping[str, float]) -> None:
  # A negative or NaN weight would reach NumPy as a negative or NaN draw size and
  # stop there with a message that names neither the split nor the weight.
  bad = {k: w for k, w in weights.items() if not (np.isfinite(w) and w >= 0)}
  if bad:
    raise ValueError(f"mixture weights must be finite and >= 0, got {bad} in "
                     f"{dict(weights)}")


def mixture_indices(splits: Mapping[str, np.ndarray], weights: Mapping[str, float],
                    total: int, seed: int) -> np.ndarray:
  """Indices of a mixture: round(w * total) problems from each split, shuffled.

  Draws without replacement inside each split; a problem in two splits (impossible
  for the paper's disjoint ranges) may appear once per split.

  Raises:
    ValueError: if weights do not sum to 1, name an unknown split, or ask for more
      problems than a split holds (names split, wanted and available).
  """
  _check_weights(weights)
  if not weights or abs(sum(weights.values()) - 1.0) > 1e-6:
    raise ValueError(f"mixture weights must sum to 1, got {dict(weights)}")
  unknown = set(weights) - set(splits)
  if unknown:
    raise ValueError(f"mixture names unknown splits {sorted(unknown)}; have "
                     f"{sorted(splits)}")
  names = sorted(weights)
  wanted = {k: int(round(weights[k] * total)) for k in names}
  wanted[names[-1]] += total - sum(wanted.values())  # rounding remainder
  short = -wanted[names[-1]]
  if short > 0:  # the others rounded up past the last split's share: they give it back
    wanted[names[-1]] = 0
    for k in sorted(names[:-1], key=lambda k: weights[k] * total - wanted[k])[:short]:
      wanted[k] -= 1
  rng = np.random.default_rng(seed)
  parts = []
  for name in names:
    pool = np.asarray(splits[name])
    if wanted[name] > len(pool):
      raise ValueError(f"mixture wants {wanted[name]} problems from split {name!r} "
                       f"(weight {weights[name]} of {total}) but it has {len(pool)}")
    parts.append(rng.choice(pool, size=wanted[name], replace=False))
  out = np.concatenate(parts) if parts else np.zeros(0, np.int64)
  return rng.permutation(out)


def write_splits(out_dir: str, problems: Sequence[Problem], counts_P, n: int,
                 splits: Mapping[str, np.ndarray], extreme_counts_P=None,
                 extreme_n: int | None = None, command: str | None = None) -> dict:
  """Write `<name>.jsonl` per split (with each problem's avg@n) and `summary.json`."""
  os.makedirs(out_dir, exist_ok=True)
  counts_P = np.asarray(counts_P)
  summary = {"num_problems": len(problems), "samples": n, "splits": {}}
  if command:
    summary["command"] = command
  for name, idx in splits.items():
    extra = []
    for i in idx:
      row = {f"avg@{n}": float(counts_P[i] / n)}
      if extreme_counts_P is not None:
        row[f"pass@{extreme_n}"] = float(extreme_counts_P[i] > 0)
        row[f"avg@{extreme_n}"] = float(extreme_counts_P[i] / extreme_n)
      extra.append(row)
    write_jsonl([problems[i] for i in idx], os.path.join(out_dir, f"{name}.jsonl"),
                extra=extra)
    summary["splits"][name] = int(len(idx))
  tmp = os.path.join(out_dir, "summary.json.tmp")
  with open(tmp, "w") as f:
    json.dump(summary, f, indent=1)
  os.replace(tmp, os.path.join(out_dir, "summary.json"))
  return summary


def parse_mix(spec: str) -> tuple[str, dict[str, float]]:
  """'hard_easy=hard:0.5,easy:0.5' -> ('hard_easy', {'hard': 0.5, 'easy': 0.5})."""
  try:
    name, parts = spec.split("=", 1)
    weights = {k: float(v) for k, v in (p.split(":") for p in parts.split(","))}
  except ValueError:
    raise ValueError(f"bad mixture {spec!r}; expected NAME=SPLIT:W,SPLIT:W") from None
  return name, weights


def mixture_size(splits: Mapping[str, np.ndarray], weights: Mapping[str, float]) -> int:
  """The largest total whose parts each fit in their split.

  Raises:
    ValueError: on a bad weight, no positive weight, an unknown split, or a split
      with positive weight that holds no problem (the mixture would be empty).
  """
  _check_weights(weights)
  unknown = set(weights) - set(splits)
  if unknown:
    raise ValueError(f"mixture names unknown splits {sorted(unknown)}")
  used = {k: w for k, w in weights.items() if w > 0}
  if not used:
    raise ValueError(f"mixture needs a positive weight, got {dict(weights)}")
  empty = sorted(k for k in used if len(splits[k]) == 0)
  if empty:
    raise ValueError(f"mixture {dict(weights)} draws from empty split(s) {empty}")
  return int(min(len(splits[k]) / w for k, w in used.items()))

