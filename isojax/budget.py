"""Sampling-compute budgets: budget points (Bp, n, M), sweep grids and the ledger.

The paper's unit of compute is the rollout: C = Bp * n * M, with Bp problems per
batch, n rollouts per problem and M sequential updates. Everything here is plain
Python/NumPy (no JAX) so that the analysis package and the sweep launcher can use it
on a machine without the trainer installed.

Paper grid (IsoCompute playbook, §4): Bp in {2^5..2^10}, n in {2^3..2^11}, with the
batch B = Bp * n bounded by B_max = 65,536 (easy) or 16,384 (hard).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Iterable, Sequence

PAPER_BP_VALUES = tuple(2**e for e in range(5, 11))
PAPER_N_VALUES = tuple(2**e for e in range(3, 12))
PAPER_B_MAX_EASY = 65_536
PAPER_B_MAX_HARD = 16_384
PAPER_B_MAX = {"easy": PAPER_B_MAX_EASY, "hard": PAPER_B_MAX_HARD}  # by difficulty split


def _as_positive_int(value, name: str) -> int:
  """`value` as an int > 0, accepting integral floats such as 2e6 from a config."""
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise ValueError(f"{name} must be a positive integer, got {value!r}")
  if isinstance(value, numbers.Integral):
    out = int(value)
  else:
    if not math.isfinite(value) or value != int(value):
      raise ValueError(f"{name} must be a positive integer, got {value!r}")
    out = int(value)
  if out <= 0:
    raise ValueError(f"{name} must be a positive integer, got {value!r}")
  return out


def _as_compute(value, name: str = "compute C") -> float:
  """A positive, finite rollout budget (may be fractional, e.g. 1.5e5)."""
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise ValueError(f"{name} must be a positive number of rollouts, got {value!r}")
  if not math.isfinite(value) or value <= 0:
    raise ValueError(f"{name} must be a positive number of rollouts, got {value!r}")
  return value


@dataclasses.dataclass(frozen=True, order=True)
class BudgetPoint:
  """One allocation of a rollout budget: Bp problems x n rollouts x M updates.

  `n_est` (App. G's decoupled baseline): each problem gets n_est >= n rollouts, all
  of them estimate the baseline and n of them enter the gradient. C counts sampled
  rollouts, so such a point spends C = Bp * n_est * M; None means n_est = n.
  """

  bp: int
  n: int
  m: int
  n_est: int | None = None

  def __post_init__(self):
    for name in ("bp", "n", "m"):
      object.__setattr__(self, name, _as_positive_int(getattr(self, name), name))
    if self.n_est is not None:
      n_est = _as_positive_int(self.n_est, "n_est")
      if n_est < self.n:
        raise ValueError(f"n_est={n_est} rollouts per problem for the baseline must be "
                         f">= n={self.n}, the rollouts trained on")
      object.__setattr__(self, "n_est", None if n_est == self.n else n_est)

  @property
  def rollouts_per_problem(self) -> int:
    """Rollouts sampled per problem and update: n_est, or n when not decoupled."""
    return self.n_est or self.n

  @property
  def sampled_batch(self) -> int:
    """Rollouts sampled per update, Bp * n_est (= B unless decoupled)."""
    return self.bp * self.rollouts_per_problem

  @property
  def batch(self) -> int:
    """Rollouts trained on per update, B = Bp * n."""
    return self.bp * self.n

  @property
  def compute(self) -> int:
    """Total rollouts spent by the point, C = Bp * n * M (Bp * n_est * M if decoupled)."""
    return self.sampled_batch * self.m

  @classmethod
  def from_budget(cls, compute, *, bp, n, n_est=None) -> "BudgetPoint":
    """The point that spends at most `compute` rollouts: M = floor(C / (Bp * n)).

    With a decoupled baseline (n_est > n) every update samples Bp * n_est
    rollouts, so M = floor(C / (Bp * n_est)).

    Raises:
      ValueError: if C < Bp * n (Bp * n_est), i.e. not even one update fits
        (names C, Bp, n and n_est), or n_est < n.
    """
    compute = _as_compute(compute)
    bp = _as_positive_int(bp, "bp")
    n = _as_positive_int(n, "n")
    per = n if n_est is None else _as_positive_int(n_est, "n_est")
    if per < n:
      raise ValueError(f"n_est={per} rollouts per problem for the baseline must be "
                       f">= n={n}, the rollouts trained on")
    # Integer arithmetic when possible: floor(2e6 / 96) must not suffer float error.
    if float(compute).is_integer():
      m = int(compute) // (bp * per)
    else:
      m = math.floor(compute / (bp * per))
    if m == 0:
      what = "Bp*n" if per == n else "Bp*n_est"
      raise ValueError(
          f"budget C={_fmt(compute)} rollouts is smaller than one batch "
          f"{what} = {bp}*{per} = {bp * per}: M = floor(C/({what})) = 0 updates")
    return cls(bp=bp, n=n, m=m, n_est=n_est)

  def validate(self, b_max=None) -> "BudgetPoint":
    """The one batch-size feasibility rule: raises ValueError naming the numbers if
    the batch sampled per update, Bp * n (Bp * n_est for a decoupled baseline),
    exceeds `b_max`; else returns self. None means no bound."""
    if b_max is not None:
      b_max = _as_positive_int(b_max, "b_max")
      if self.sampled_batch > b_max:
        what = "Bp*n" if self.n_est is None else "Bp*n_est"
        raise ValueError(
            f"infeasible budget point: {what} = {self.bp}*{self.rollouts_per_problem} "
            f"= {self.sampled_batch} exceeds b_max = {b_max}")
    return self

  @classmethod
  def feasible(cls, compute, *, bp, n, n_est=None, b_max=None) -> "BudgetPoint":
    """The point `from_budget` gives, checked by `validate(b_max)`.

    The batch is checked first (on a one-update point: it does not depend on M), so
    a point that is both too wide and too expensive is reported for its batch.

    Raises:
      ValueError: naming the numbers, when Bp * n (Bp * n_est) exceeds b_max or the
        budget pays for no update (M = 0).
    """
    cls(bp=bp, n=n, m=1, n_est=n_est).validate(b_max)
    return cls.from_budget(compute, bp=bp, n=n, n_est=n_est)

  def log_spaced_steps(self, per_doubling: int) -> tuple[int, ...]:
    """The update steps at which this point's rollouts first reach 2^(j / per_doubling),
    j = 0, 1, ... (within its M): after step s it has spent s * Bp * n_est. Points of
    any (Bp, n, M) evaluated there are compared at the same compute values (each to
    within one of its updates), spaced evenly in log compute, as the frontier and
    n*(C) fits read them.
    """
    k = _as_positive_int(per_doubling, "per_doubling")
    steps, j, batch = [], 0, self.sampled_batch
    while (threshold := 2.0 ** (j / k)) <= self.compute:
      steps.append(math.ceil(threshold / batch))
      # Skip the thresholds that this step's rollouts also reach: the loop then
      # runs once per step evaluated, not once per threshold (with a large k
      # there are far more thresholds than steps). From a j a little below the
      # first threshold past the step (float log2), count up to it.
      end = steps[-1] * batch
      j = max(j + 1, math.floor(k * math.log2(end)) - 1)
      while 2.0 ** (j / k) <= end:
        j += 1
    return tuple(steps)

  def to_dict(self) -> dict:
    """Plain dict for config.json / metrics, including the derived numbers.

    "n_est" appears only for a decoupled point, so the dicts of other points
    (and the config.json files they go into) are as they always were.
    """
    out = {"bp": self.bp, "n": self.n, "m": self.m, "batch": self.batch,
           "compute": self.compute}
    if self.n_est is not None:
      out["n_est"] = self.n_est
    return out

  @property
  def name(self) -> str:
    """A stable, filesystem-safe name, e.g. 'bp32_n64_m100' ('bp32_n64e256_m100')."""
    est = "" if self.n_est is None else f"e{self.n_est}"
    return f"bp{self.bp}_n{self.n}{est}_m{self.m}"


def sweep_grid(bp_values: Iterable, n_values: Iterable, *, b_max,
               budget, n_est: int | None = None) -> list[BudgetPoint]:
  """Feasible budget points of a (Bp, n) grid at one or several budgets.

  A pair is feasible when `BudgetPoint.feasible` accepts it: Bp * n <= b_max and at
  least one update fits the budget (Bp * n <= C), with Bp * n_est in place of Bp * n
  and n <= n_est for a decoupled baseline. Points are returned sorted by (compute
  budget, Bp, n) and deduplicated.

  Args:
    bp_values: problems-per-batch values.
    n_values: rollouts-per-problem values.
    b_max: the largest batch Bp * n allowed (memory / throughput bound).
    budget: a rollout budget C, or several (a list, tuple, NumPy array ...).
    n_est: a decoupled baseline's rollouts per problem (App. G), for every point:
      M = floor(C / (Bp * n_est)); an n above it is left out.

  Raises:
    ValueError: if no point of the grid is feasible, with the reason of its smallest
      pair at each budget.
  """
  bp_values = [_as_positive_int(v, "bp") for v in bp_values]
  n_values = [_as_positive_int(v, "n") for v in n_values]
  b_max = _as_positive_int(b_max, "b_max")
  # Any collection of budgets, e.g. np.logspace(5, 7, 5), which is no Sequence. A
  # string or a 0-d array is one value, refused below by name, not iterated.
  several = (isinstance(budget, Iterable) and not isinstance(budget, (str, bytes))
             and getattr(budget, "ndim", 1) != 0)
  budgets = list(budget) if several else [budget]
  if not bp_values or not n_values or not budgets:
    raise ValueError(f"empty sweep grid: bp_values={bp_values}, "
                     f"n_values={n_values}, budget={budgets}")
  budgets = [_as_compute(c, "budget") for c in budgets]
  points, first_why = [], {}
  for compute in sorted(set(budgets)):
    for bp in sorted(set(bp_values)):
      for n in sorted(set(n_values)):
        try:
          points.append(BudgetPoint.feasible(compute, bp=bp, n=n, n_est=n_est,
                                             b_max=b_max))
        except ValueError as e:  # left out; an all-infeasible grid is reported below
          first_why.setdefault(compute, f"C={_fmt(compute)}, Bp={bp} n={n}: {e}")
  if not points:
    # Each budget's first pair is the grid's smallest batch: its own reason (b_max,
    # the budget, or an n above n_est) says why the rest fail too.
    est = "" if n_est is None else f", n_est={n_est}"
    raise ValueError(
        f"no feasible budget point in Bp={bp_values} x n={n_values} (b_max={b_max}"
        f"{est}); the smallest at " + "; at ".join(first_why.values()))
  return list(dict.fromkeys(points))


# Response-length cap of a study whose config says sampler.max_tokens = 0: the
# synthetic task's answer + EOS fit in 8 tokens; the paper's runs (App. A, §3)
# allow 8,192 for Qwen2.5-7B-Instruct and the other real models.
SYNTHETIC_MAX_TOKENS = 8
PAPER_MAX_TOKENS = 8192


def study_max_tokens(max_tokens: int, model_path: str) -> int:
  """sampler.max_tokens with 0 resolved: 8 on the committed tiny model (model.path
  empty, the synthetic task), the paper's 8,192 on a real model; any value > 0 is
  kept as given."""
  if max_tokens < 0 or isinstance(max_tokens, bool):
    raise ValueError(f"config.sampler.max_tokens={max_tokens!r} must be >= 0 (0: the "
                     f"study's length)")
  if max_tokens:
    return int(max_tokens)
  return PAPER_MAX_TOKENS if model_path else SYNTHETIC_MAX_TOKENS


def estimate_tokens(point: BudgetPoint, mean_response_tokens: float,
                    mean_prompt_tokens: float = 0.0) -> int:
  """Expected tokens a point will process: C * (response [+ prompt] length).

  With `mean_prompt_tokens` = 0 this is the generated-token count the ledger will
  report; pass the prompt length too for a prefill-inclusive estimate.
  """
  if mean_response_tokens < 0 or mean_prompt_tokens < 0:
    raise ValueError(f"token lengths must be >= 0, got response="
                     f"{mean_response_tokens}, prompt={mean_prompt_tokens}")
  return int(round(point.compute * (mean_response_tokens + mean_prompt_tokens)))


def format_table(points: Sequence[BudgetPoint], mean_response_tokens: float | None = None
                 ) -> str:
  """A plain-text table of points (Bp, n, B, M, compute[, est. tokens]) for dry runs."""
  header = ["Bp", "n", "B", "M", "compute"]
  if mean_response_tokens is not None:
    header.append("est_tokens")
  rows = []
  for p in points:
    row = [p.bp, p.n, p.batch, p.m, p.compute]
    if mean_response_tokens is not None:
      row.append(estimate_tokens(p, mean_response_tokens))
    rows.append([str(v) for v in row])
  widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
            for i, h in enumerate(header)]
  lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
  lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows]
  return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Ledger:
  """Compute spent so far. Immutable: `add` returns a new ledger.

  `rollouts` counts every rollout that was generated, including those a filter later
  dropped from the loss (they were paid for); `dropped_rollouts` says how many of
  them were dropped. `tokens` counts generated (completion) tokens, likewise including
  dropped ones. `updates` counts optimizer steps attempted. `critic_flops` counts a
  value model's forward and backward FLOPs (PPO), recorded beside the rollouts,
  which stay the compute unit. `device_seconds` is ScaleRL's compute axis:
  wall-clock seconds of sampling and updating times the devices that did it
  (evaluation and checkpoints not counted). Unlike the counts it is a
  measurement: a resumed run re-times the steps it redoes.
  """

  rollouts: int = 0
  tokens: int = 0
  dropped_rollouts: int = 0
  updates: int = 0
  critic_flops: int = 0
  device_seconds: float = 0.0

  def __post_init__(self):
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      if f.name == "device_seconds":
        if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or not 0 <= value < float("inf")):
          raise ValueError(f"Ledger.device_seconds must be a finite number >= 0, got "
                           f"{value!r}")
        object.__setattr__(self, f.name, float(value))
        continue
      if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"Ledger.{f.name} must be an int >= 0, got {value!r}")
      object.__setattr__(self, f.name, int(value))
    if self.dropped_rollouts > self.rollouts:
      raise ValueError(f"Ledger: dropped_rollouts={self.dropped_rollouts} exceeds "
                       f"rollouts={self.rollouts}")

  @property
  def device_hours(self) -> float:
    return self.device_seconds / 3600.0

  def add(self, *, rollouts: int, tokens: int, dropped_rollouts: int = 0,
          updates: int = 0, critic_flops: int = 0,
          device_seconds: float = 0.0) -> "Ledger":
    """A ledger with one more batch of spending recorded."""
    if dropped_rollouts > rollouts:
      raise ValueError(f"dropped_rollouts={dropped_rollouts} exceeds the batch's "
                       f"rollouts={rollouts}")
    return Ledger(rollouts=self.rollouts + rollouts, tokens=self.tokens + tokens,
                  dropped_rollouts=self.dropped_rollouts + dropped_rollouts,
                  updates=self.updates + updates,
                  critic_flops=self.critic_flops + critic_flops,
                  device_seconds=self.device_seconds + device_seconds)

  def add_rollouts(self, rollouts, *, dropped_rollouts: int = 0, updates: int = 1,
                   critic_flops: int = 0, device_seconds: float = 0.0) -> "Ledger":
    """Record a `Rollouts` object (uses .num_rollouts / .num_generated_tokens)."""
    return self.add(rollouts=int(rollouts.num_rollouts),
                    tokens=int(rollouts.num_generated_tokens),
                    dropped_rollouts=dropped_rollouts, updates=updates,
                    critic_flops=critic_flops, device_seconds=device_seconds)

  def state_dict(self) -> dict:
    """Plain numbers, safe for JSON and orbax checkpoints."""
    return dataclasses.asdict(self)

  @classmethod
  def from_state_dict(cls, state: dict) -> "Ledger":
    """Inverse of `state_dict`; accepts NumPy scalars (as orbax restores them).

    A state written before `critic_flops` or `device_seconds` existed resumes with 0.

    Raises:
      ValueError: naming the key, for an unknown key, a missing count or a count
        that is not a whole number (a resumed run would carry on from a compute
        spent that its ledger never recorded).
    """
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(state) - known
    if unknown:
      raise ValueError(f"Ledger state has unknown keys {sorted(unknown)}; "
                       f"expected {sorted(known)}")
    missing = sorted(known - set(state) - {"critic_flops", "device_seconds"})
    if missing:
      raise ValueError(f"Ledger state lacks {missing} (has {sorted(state)}): resuming "
                       f"from it would count that spending as 0")
    out = {}
    for k, v in state.items():
      if k == "device_seconds":
        out[k] = float(v)
        continue
      try:
        out[k] = int(v)
        whole = out[k] == v
      except (TypeError, ValueError):
        whole = False
      if not whole:  # int() would truncate 1.7 or parse "17" without a word
        raise ValueError(f"Ledger state {k}={v!r} is not a whole count")
    return cls(**out)


def _fmt(c) -> str:
  return str(int(c)) if float(c).is_integer() else repr(c)
