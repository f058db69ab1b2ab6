"""Epoch-wise shuffled batches over a fixed problem set, with an exact resume position.

The paper trains on a fixed problem set reused over epochs (saturation comes from the
finite set, §4.1, §5.2). Each epoch visits every active problem once in a permutation
drawn from (seed, epoch, active set) alone, so the position (epoch, index) plus the
retired problems is the whole loader state: saving it and calling `next_batch` from
it reproduces the uninterrupted stream exactly. A batch that runs past the end of an
epoch continues into the next epoch's order.

ScaleRL's no-positive-resampling retires solved problems: `record_pass_rates` marks a
problem whose pass rate reaches a threshold, and it leaves every epoch whose order is
not drawn yet (the rest of the current epoch still visits it). A problem's pass rate
is the fraction of its most recent group of rollouts that passed (reward > 0.5, the
correct answer of the 0/1 rewards, as `isojax.evaluate` counts passes): the current
policy's success on it, which a cumulative rate would understate for as long as the
early failures weigh in. A retired problem never comes back. Once fewer problems are
active than a batch holds, a batch would hold one problem several times (the reason
a run refuses Bp above the set's size): the loader stops there instead.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping, Sequence

import numpy as np

from isojax.errors import IsojaxError

# A rollout passes when its reward exceeds this: 1.0 (correct) of the 0/1 rewards.
PASS_ABOVE = 0.5


class AllRetiredError(IsojaxError):
  """Raised when every problem is retired and an epoch has nothing left to draw."""


class TooFewActiveError(IsojaxError):
  """Raised when retirements leave an epoch fewer active problems than a batch."""


@dataclasses.dataclass(frozen=True)
class LoaderPosition:
  """Where the next batch starts: `index` into the permutation of `epoch`."""

  epoch: int = 0
  index: int = 0

  def state_dict(self) -> dict:
    return {"epoch": int(self.epoch), "index": int(self.index)}

  @classmethod
  def from_state_dict(cls, state: dict) -> "LoaderPosition":
    missing = {"epoch", "index"} - set(state)
    if missing:
      raise ValueError(f"loader state lacks {sorted(missing)}; got {sorted(state)}")
    return cls(epoch=int(state["epoch"]), index=int(state["index"]))


def epoch_permutation(num_items: int, seed: int, epoch: int) -> np.ndarray:
  """The visiting order of one epoch: a permutation of range(num_items)."""
  rng = np.random.default_rng([int(seed), int(epoch)])
  return rng.permutation(num_items)


def active_items(num_items: int, epoch: int, retired_from: Mapping[int, int]
                 ) -> np.ndarray:
  """The items `epoch` visits, ascending: those not retired from `epoch` or earlier.

  Args:
    retired_from: item index -> the first epoch it is left out of.
  """
  keep = np.ones(num_items, dtype=bool)
  for item, first_epoch in retired_from.items():
    if first_epoch <= epoch:
      keep[item] = False
  return np.flatnonzero(keep)


def _retiring(retire_at: float | None) -> str:
  """The config field that retires problems, with its value where known."""
  return ("data.drop_solved_above" if retire_at is None
          else f"data.drop_solved_above={retire_at}")


def epoch_order(num_items: int, seed: int, epoch: int,
                retired_from: Mapping[int, int], *, retire_at: float | None = None
                ) -> np.ndarray:
  """The visiting order of `epoch`: its active items in a permutation drawn from
  (seed, epoch, active set). With nothing retired it is `epoch_permutation`.
  `retire_at`, the retiring pass rate, only names the threshold in errors."""
  active = active_items(num_items, epoch, retired_from)
  if not len(active):
    raise AllRetiredError(
        f"all {num_items} problems are retired as solved ({_retiring(retire_at)}): "
        f"epoch {epoch} has none left to draw")
  return active[epoch_permutation(len(active), seed, epoch)]


def check_position(num_items: int, position: LoaderPosition,
                   retired_from: Mapping[int, int]) -> None:
  """Raises ValueError if `position` does not fit the set with these retirements
  (e.g. a checkpoint from another data set)."""
  if num_items <= 0:
    raise ValueError(f"cannot draw batches from an empty set (num_items={num_items})")
  bad = [i for i in retired_from if not 0 <= i < num_items]
  if bad:
    raise ValueError(f"retired items {bad[:5]} do not fit a set of {num_items} items")
  # Index 0 needs no active item: the epoch's order is drawn only when used.
  epoch_size = (len(active_items(num_items, position.epoch, retired_from))
                if position.index else num_items)
  if position.epoch < 0 or not 0 <= position.index < epoch_size:
    raise ValueError(f"loader position (epoch={position.epoch}, index="
                     f"{position.index}) does not fit a set of {num_items} items")


def next_indices(num_items: int, position: LoaderPosition, batch_size: int, seed: int,
                 retired_from: Mapping[int, int] | None = None, *,
                 retire_at: float | None = None) -> tuple[np.ndarray, LoaderPosition]:
  """Indices of the next `batch_size` items and the position after them.

  Args:
    retired_from: item index -> the first epoch it is left out of (none when None).
    retire_at: the pass rate that retired them, named in errors (optional).

  Raises:
    ValueError: if the set is empty, the batch size is not positive, or the
      position does not fit the set (e.g. a checkpoint from another data set).
    AllRetiredError: if an epoch the batch reaches has no active item left.
    TooFewActiveError: if retirements left an epoch the batch reaches fewer active
      items than `batch_size`.
  """
  retired_from = retired_from or {}
  check_position(num_items, position, retired_from)
  if batch_size <= 0:
    raise ValueError(f"batch_size must be > 0, got {batch_size}")
  out, count = [], 0
  epoch, index = position.epoch, position.index
  while count < batch_size:
    order = epoch_order(num_items, seed, epoch, retired_from, retire_at=retire_at)
    if len(order) < min(batch_size, num_items):
      raise TooFewActiveError(
          f"{num_items - len(order)} of {num_items} problems are retired as solved "
          f"({_retiring(retire_at)}): epoch {epoch} has {len(order)} left, fewer than "
          f"a batch of {batch_size} (Bp), which would hold a problem more than once")
    take = min(batch_size - count, len(order) - index)
    out.append(order[index:index + take])
    count += take
    index += take
    if index == len(order):
      epoch, index = epoch + 1, 0
  return np.concatenate(out), LoaderPosition(epoch, index)


def group_pass_rates(rewards_B: np.ndarray, group_size: int) -> np.ndarray:
  """Per problem, the fraction of its `group_size` rollouts (contiguous in
  `rewards_B`) whose reward exceeds PASS_ABOVE: pass_rate_Bp."""
  rewards_B = np.asarray(rewards_B)
  if group_size < 1 or rewards_B.ndim != 1 or rewards_B.size % group_size:
    raise ValueError(f"rewards of shape {rewards_B.shape} do not split into groups of "
                     f"group_size={group_size}")
  return np.mean(rewards_B.reshape(-1, group_size) > PASS_ABOVE, axis=1)


def check_retire_threshold(threshold: float, name: str = "retire_at") -> None:
  """Raises ValueError naming `name` unless 0 < threshold <= 1 (a pass rate)."""
  if not 0 < threshold <= 1:  # also rejects NaN
    raise ValueError(f"{name}={threshold!r} must be a pass rate in (0, 1]; 0 turns "
                     f"the retiring of solved problems off")


def _identity(problem):
  """What makes two problems equal for retiring: (prompt, answer) of a Problem, whose
  ids differ between duplicates in a file; any other item as itself."""
  prompt, answer = getattr(problem, "prompt", None), getattr(problem, "answer", None)
  return problem if prompt is None or answer is None else (prompt, answer)


class EpochLoader:
  """Stateful wrapper over `next_indices` for the run loop.

  Args:
    problems: the fixed training set.
    batch_size: problems per batch (Bp).
    seed: shuffling seed.
    retire_at: the run's retiring pass rate, if any, for error messages (a resumed
      loader's retirements predate its first `record_pass_rates`).
  """

  def __init__(self, problems: Sequence, batch_size: int, seed: int,
               position: LoaderPosition = LoaderPosition(), *,
               retire_at: float | None = None):
    self.problems = list(problems)
    # int() would make a batch of 2.5 one of 2 and True one of 1, and a negative
    # seed would reach NumPy's generator, whose error names neither.
    for name, value, least in (("batch_size", batch_size, 1), ("seed", seed, 0)):
      if (isinstance(value, bool) or not isinstance(value, numbers.Integral)
          or value < least):
        raise ValueError(f"EpochLoader {name}={value!r} must be an integer >= {least}")
    self.batch_size = int(batch_size)
    self.seed = int(seed)
    self.retire_at = retire_at
    self.position = position
    self.retired_from: dict[int, int] = {}
    self._indices_of: dict | None = None  # problem -> its indices, built when needed
    next_indices(len(self.problems), position, self.batch_size, self.seed)  # validates

  @property
  def num_retired(self) -> int:
    """Problems retired so far (also those whose retirement starts next epoch)."""
    return len(self.retired_from)

  def next_batch(self) -> list:
    """The next `batch_size` problems; advances the position."""
    idx, self.position = next_indices(len(self.problems), self.position,
                                      self.batch_size, self.seed, self.retired_from,
                                      retire_at=self.retire_at)
    return [self.problems[i] for i in idx]

  def record_pass_rates(self, problems: Sequence, pass_rate_Bp: Sequence[float],
                        retire_at: float) -> int:
    """Retires each of `problems` whose pass rate is >= `retire_at`.

    It leaves the epochs whose order is not drawn yet: the next one, or the
    current one when the position is at its start. Equal problems (duplicates
    in the set: the same prompt and answer, whatever their ids) retire together.

    Args:
      problems: problems of the set, e.g. a batch `next_batch` returned.
      pass_rate_Bp: their pass rates (`group_pass_rates`), in the same order.
      retire_at: the pass rate that retires a problem, in (0, 1].

    Returns:
      how many problems this call retired.
    """
    check_retire_threshold(retire_at)
    self.retire_at = retire_at
    if len(problems) != len(pass_rate_Bp):
      raise ValueError(f"{len(problems)} problems but {len(pass_rate_Bp)} pass rates")
    if self._indices_of is None:
      self._indices_of = {}
      for i, p in enumerate(self.problems):
        self._indices_of.setdefault(_identity(p), []).append(i)
    first_epoch = self.position.epoch + (self.position.index > 0)
    before = self.num_retired
    for problem, rate in zip(problems, pass_rate_Bp):
      if rate >= retire_at:
        if _identity(problem) not in self._indices_of:
          raise ValueError(f"problem {problem!r} is not in this loader's set")
        for i in self._indices_of[_identity(problem)]:
          self.retired_from.setdefault(i, first_epoch)
    return self.num_retired - before

  def state_dict(self) -> dict:
    """Position plus a fingerprint of the set, checked on restore; with retired
    problems also "retired": [[index, first epoch left out of], ...] (JSON-safe)."""
    state = self.position.state_dict() | {"num_items": len(self.problems),
                                          "seed": self.seed}
    if self.retired_from:
      state["retired"] = [[int(i), int(e)] for i, e in sorted(self.retired_from.items())]
    return state

  def load_state_dict(self, state: dict) -> None:
    """Resume from `state_dict()`; the set and seed must match the saved ones. A
    state without "retired" (none retired, or saved before retiring existed)
    resumes with no problem retired."""
    for key, expect in (("num_items", len(self.problems)), ("seed", self.seed)):
      if key in state and int(state[key]) != expect:
        raise ValueError(f"loader state has {key}={int(state[key])} but this "
                         f"loader has {key}={expect}")
    position = LoaderPosition.from_state_dict(state)
    retired_from = {int(i): int(e) for i, e in state.get("retired", [])}
    check_position(len(self.problems), position, retired_from)
    self.position, self.retired_from = position, retired_from
