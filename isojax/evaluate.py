"""Validation metrics: avg@k, unbiased best@k (pass@k), worst@k, pass@1 histograms.

The metric functions are pure NumPy over per-problem correct counts c out of n
samples. `evaluate` draws the samples through a `Sampler` (isojax.rollout protocol)
and scores them; it imports nothing heavy at module import time.

Estimators, for one problem with c correct out of n samples and k <= n:
  best@k  = pass@k = 1 - C(n-c, k) / C(n, k)   (Chen et al. 2021, unbiased)
  worst@k = C(c, k) / C(n, k)                  (all k of a random k-subset correct)
  avg@k   = c / n                              (k-independent: unbiased mean pass rate)
Both ratios are evaluated as products of terms in [0, 1], so they never overflow.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Sequence

import numpy as np

from isojax.data import encode_prompts, exact_match

HISTOGRAM_BINS = 10  # fixed bins of width 0.1 over [0, 1]; the last one includes 1.0


def _is_int(x) -> bool:
  """A Python or NumPy integer, and not a bool (True would silently mean 1)."""
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _check_n_c(n, c) -> tuple[np.ndarray, np.ndarray]:
  """n and c as int64 arrays: whole numbers, n >= 1 and 0 <= c <= n."""
  n_arr = np.asarray(n)
  c_arr = np.asarray(c)
  if not (np.issubdtype(n_arr.dtype, np.integer) and np.issubdtype(c_arr.dtype, np.integer)):
    if not (np.all(np.mod(n_arr, 1) == 0) and np.all(np.mod(c_arr, 1) == 0)):
      raise ValueError(f"n and c must be integers, got n={n!r}, c={c!r}")
  n_arr = n_arr.astype(np.int64)
  c_arr = c_arr.astype(np.int64)
  if np.any(n_arr < 1):
    raise ValueError(f"n (samples per problem) must be >= 1, got {n!r}")
  if np.any(c_arr < 0) or np.any(c_arr > n_arr):
    raise ValueError(f"correct counts c must lie in [0, n]; got c={c!r}, n={n!r}")
  return n_arr, c_arr


def _check_counts(n, c, k):
  n_arr, c_arr = _check_n_c(n, c)
  if not _is_int(k):
    raise ValueError(f"k must be an int, got {k!r}")
  if k < 1 or np.any(k > n_arr):
    raise ValueError(f"k must satisfy 1 <= k <= n; got k={k}, n={n!r}")
  return n_arr, c_arr, int(k)


def pass_at_k(n, c, k: int):
  """Unbiased pass@k (best@k): P(at least one of k samples drawn from n is correct).

  Stable product form 1 - prod_{i=n-c+1}^{n} (1 - k/i), evaluated in log space.

  Args:
    n: samples drawn per problem (int or array broadcastable with c).
    c: correct samples per problem (int or array).
    k: subset size, 1 <= k <= n.

  Returns:
    float (scalar inputs) or float64 array shaped like broadcast(n, c).
  """
  n_arr, c_arr, k = _check_counts(n, c, k)
  n_b, c_b = np.broadcast_arrays(n_arr, c_arr)
  # Log terms log(1 - k/i) for i = 1..max n; only i > k are ever used, because the
  # product runs over i >= n-c+1 and we only take it when n - c >= k.
  n_max = int(n_b.max()) if n_b.size else 0
  i = np.arange(1, n_max + 1, dtype=np.float64)
  logs = np.log1p(-np.where(i > k, k / i, 0.0))
  cum = np.concatenate([[0.0], np.cumsum(logs)])  # cum[j] = sum_{i<=j} logs
  has_room = (n_b - c_b) >= k
  log_prod = cum[n_b] - cum[n_b - c_b]
  # 0.0 - x, not -x: an unsolved problem (log_prod = 0) scores 0.0, where -x gave a
  # -0.0 that per-problem dumps print as "-0.0".
  out = np.where(has_room, 0.0 - np.expm1(log_prod), 1.0)
  return float(out) if out.ndim == 0 else out


def worst_at_k(n, c, k: int):
  """worst@k: P(all k of a uniformly random k-subset of the n samples are correct).

  C(c, k) / C(n, k) = prod_{j=0}^{k-1} (c - j) / (n - j); zero when c < k.
  Same argument conventions as `pass_at_k`.
  """
  n_arr, c_arr, k = _check_counts(n, c, k)
  n_b, c_b = np.broadcast_arrays(n_arr, c_arr)
  out = np.ones(n_b.shape, dtype=np.float64)
  for j in range(k):
    out = out * np.clip((c_b - j) / (n_b - j), 0.0, 1.0)
  return float(out) if out.ndim == 0 else out


def metrics_from_counts(counts_P, n: int, ks: Sequence[int] | int = (4,),
                        prefix: str = "") -> dict[str, float]:
  """Mean avg@k, best@k and worst@k over problems, from per-problem correct counts.

  Args:
    counts_P: correct samples per problem (length P).
    n: samples drawn per problem.
    ks: the k values to report (each <= n).
    prefix: prepended to every key, e.g. "val/".

  Returns:
    {f"{prefix}avg@{k}", f"{prefix}best@{k}", f"{prefix}worst@{k}"} for each k.
  """
  counts_P = np.asarray(counts_P)
  if counts_P.ndim != 1 or counts_P.size == 0:
    raise ValueError(f"counts_P must be a non-empty 1-D array, got shape {counts_P.shape}")
  ks = [ks] if isinstance(ks, (int, np.integer)) else list(ks)
  out = {}
  for k in ks:
    out[f"{prefix}avg@{k}"] = float(np.mean(counts_P / n))
    out[f"{prefix}best@{k}"] = float(np.mean(pass_at_k(n, counts_P, k)))
    out[f"{prefix}worst@{k}"] = float(np.mean(worst_at_k(n, counts_P, k)))
  return out


def pass_rate_histogram(counts_P, n: int, bins: int = HISTOGRAM_BINS) -> dict:
  """Distribution of per-problem pass@1 (c/n) over fixed equal-width bins on [0, 1].

  The paper's interference diagnostic (§5.1, App. I): how training moves the
  per-problem pass rates, and the fraction of problems never solved.

  Returns:
    {"bin_edges": list (bins+1), "fractions": list (bins, sums to 1; the last bin
     includes 1.0), "zero_pass_fraction": share with c == 0,
     "full_pass_fraction": share with c == n}.
  """
  counts_P = np.asarray(counts_P)
  if counts_P.ndim != 1 or counts_P.size == 0:
    raise ValueError(f"counts_P must be a non-empty 1-D array, got shape {counts_P.shape}")
  if np.ndim(n) != 0:
    raise ValueError(f"n must be one number of samples per problem, got {n!r}")
  if not _is_int(bins) or bins < 1:
    raise ValueError(f"bins={bins!r}; expected an int >= 1")
  # Fractional counts would be binned by their floor without a word.
  n, counts_P = _check_n_c(n, counts_P)
  edges = np.linspace(0.0, 1.0, bins + 1)
  # The bin of c/n, floor(bins c / n), in integers (the last bin includes 1.0): on
  # float edges 3/10 fell below linspace's 0.30000000000000004, one bin too low.
  bin_P = np.minimum(counts_P * bins // n, bins - 1).astype(np.int64)
  hist = np.bincount(bin_P, minlength=bins)
  return {"bin_edges": edges.tolist(),
          "fractions": (hist / counts_P.size).tolist(),
          "zero_pass_fraction": float(np.mean(counts_P == 0)),
          "full_pass_fraction": float(np.mean(counts_P == n))}


def histogram_metrics(counts_P, n: int, prefix: str = "train/",
                      bins: int = HISTOGRAM_BINS) -> dict[str, float]:
  """`pass_rate_histogram` flattened to scalar metrics for metrics.jsonl/TensorBoard.

  Keys: f"{prefix}zero_pass_frac", f"{prefix}pass@1_hist/{lo}" per bin, lo its
  start with one decimal for tenths (0.1) and as many more as keep bins apart (0.05).
  """
  h = pass_rate_histogram(counts_P, n, bins)
  out = {f"{prefix}zero_pass_frac": h["zero_pass_fraction"]}
  for lo, frac in zip(_edge_labels(h["bin_edges"])[:-1], h["fractions"]):
    out[f"{prefix}pass@1_hist/{lo}"] = float(frac)
  return out


def _edge_labels(edges: Sequence[float]) -> list[str]:
  """The edges with the fewest decimals (at least one) that keep them distinct: at
  one decimal, twentieths 0.05 and 0.1 shared a key and one bin overwrote the other."""
  digits = 1
  while len({f"{e:.{digits}f}" for e in edges}) < len(edges):
    digits += 1
  return [f"{e:.{digits}f}" for e in edges]


def format_histogram(counts_P, n: int, bins: int = HISTOGRAM_BINS, width: int = 40) -> str:
  """A text bar chart of the pass@1 histogram (for scripts' stdout)."""
  h = pass_rate_histogram(counts_P, n, bins)
  lines = [f"per-problem pass rate over {len(counts_P)} problems, {n} samples each "
           f"(zero-pass {h['zero_pass_fraction']:.1%})"]
  edges = _edge_labels(h["bin_edges"])
  for i, frac in enumerate(h["fractions"]):
    close = "]" if i == len(h["fractions"]) - 1 else ")"
    lines.append(f"  [{edges[i]}, {edges[i + 1]}{close} {frac:6.1%} "
                 + "#" * int(round(frac * width)))
  return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class EvalResult:
  """Per-problem correct counts plus the aggregate metrics computed from them."""

  counts_P: np.ndarray
  n: int
  metrics: dict
  mean_response_tokens: float


def score_rollouts(rollouts, answers: Sequence[str], n: int, tokenizer,
                   reward_fn: Callable[[str, str], float]) -> np.ndarray:
  """Rewards (B,) for prompt-major rollouts of len(answers) problems x n samples.

  Completions are cut at their length and decoded without special tokens.

  Raises:
    ValueError: naming the rollout and its answer, when `reward_fn` returns
      something other than a finite number (NaN, inf, None).
  """
  tokens_BxT = np.asarray(rollouts.tokens_BxT)
  lengths_B = np.asarray(rollouts.lengths_B)
  if tokens_BxT.shape[0] != len(answers) * n:
    raise ValueError(f"rollouts.tokens_BxT has {tokens_BxT.shape[0]} rows; expected "
                     f"{len(answers)} problems x n={n} = {len(answers) * n}")
  special = {t for t in (getattr(tokenizer, "eos_token_id", None),
                         getattr(tokenizer, "pad_token_id", None),
                         getattr(tokenizer, "bos_token_id", None)) if t is not None}
  rewards_B = np.zeros(tokens_BxT.shape[0], dtype=np.float32)
  for b in range(tokens_BxT.shape[0]):
    ids = [int(t) for t in tokens_BxT[b, :lengths_B[b]] if int(t) not in special]
    reward = reward_fn(tokenizer.decode(ids), answers[b // n])
    # Stored as is, None becomes NaN, which an evaluation counts as a fail without
    # a word; checked here, where the rollout and its answer can still be named.
    if not isinstance(reward, (numbers.Real, np.bool_)) or not math.isfinite(reward):
      raise ValueError(f"reward_fn returned {reward!r} for rollout {b} (problem {b // n}, "
                       f"answer {answers[b // n]!r}); expected a finite number "
                       f"(1.0 correct, 0.0 wrong)")
    rewards_B[b] = reward
  return rewards_B


def _check_request(k, ks: list, batch_size) -> None:
  """`evaluate`'s sizes, checked before any sampling: a bad k' in `ks` found only
  when scoring would waste a whole validation pass."""
  if not _is_int(k) or k < 1:
    raise ValueError(f"evaluate: k={k!r} samples per problem; expected an int >= 1")
  if not ks:
    raise ValueError("evaluate: ks is empty; give the k' values to report (each <= k)")
  bad = [kk for kk in ks if not _is_int(kk) or not 1 <= kk <= k]
  if bad:
    raise ValueError(f"evaluate: ks={ks} has {bad}; each k' must be an int in "
                     f"[1, k={k}] (k' of the k samples drawn per problem)")
  if batch_size is not None and (not _is_int(batch_size) or batch_size < 0):
    raise ValueError(f"evaluate: batch_size={batch_size!r}; expected an int >= 1 problems "
                     f"per generate call (or None or 0: all at once)")


def evaluate(sampler, problems, tokenizer, *, k: int = 4, ks: Sequence[int] | None = None,
             temperature: float = 0.6, max_tokens: int = 32, reward_fn=None,
             seed: int = 0, top_p: float = 1.0, chat_template: bool = False,
             batch_size: int | None = None, prefix: str = "val/") -> EvalResult:
  """Sample k completions per problem and compute avg@k / best@k / worst@k.

  Args:
    sampler: an isojax.rollout Sampler (`generate(prompt_ids, n=..., ...)`).
    problems: Problems (id, prompt, answer).
    tokenizer: isojax.models.Tokenizer (encode/decode/apply_chat_template, eos id).
    k: samples per problem; metrics are reported for every k' in `ks` (default [k]).
    reward_fn: (response_text, answer) -> 0.0/1.0; default exact match.
    seed: sampling seed; the i-th generate call (batch) uses seed + i.
    batch_size: problems per generate call (None or 0: all).
    prefix: metric key prefix.
  """
  problems = list(problems)
  if not problems:
    raise ValueError("evaluate: `problems` is empty")
  reward_fn = reward_fn or exact_match
  ks = [k] if ks is None else list(ks)
  _check_request(k, ks, batch_size)
  prompt_ids = encode_prompts(tokenizer, problems, chat_template=chat_template)
  batch_size = batch_size or len(problems)
  eos = getattr(tokenizer, "eos_token_id", None)
  counts, tokens, rollouts_seen = [], 0, 0
  for i, start in enumerate(range(0, len(problems), batch_size)):
    chunk = problems[start:start + batch_size]
    r = sampler.generate(prompt_ids[start:start + batch_size], n=k,
                         max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                         stop_token_ids=() if eos is None else (eos,), seed=seed + i)
    rewards_B = score_rollouts(r, [p.answer for p in chunk], k, tokenizer, reward_fn)
    counts.append((rewards_B.reshape(len(chunk), k) > 0.5).sum(axis=1))
    tokens += int(r.num_generated_tokens)
    rollouts_seen += int(r.num_rollouts)
  counts_P = np.concatenate(counts).astype(np.int64)
  metrics = metrics_from_counts(counts_P, k, ks, prefix=prefix)
  return EvalResult(counts_P=counts_P, n=k, metrics=metrics,
                    mean_response_tokens=tokens / max(rollouts_seen, 1))
