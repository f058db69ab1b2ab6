"""Epoch-wise shuffled batches over a fixed problem set, with an exact resume position.

The paper trains on a fixed problem set reused over epochs (saturation comes from the
finite set, §4.1, §5.2). Each epoch visits every problem once in a permutation drawn
from (seed, epoch) alone, so the position (epoch, index) is the whole loader state:
saving it and calling `next_batch` from it reproduces the uninterrupted stream exactly.
A batch that runs past the end of an epoch continues into the next epoch's order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np


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


def next_indices(num_items: int, position: LoaderPosition, batch_size: int, seed: int
                 ) -> tuple[np.ndarray, LoaderPosition]:
  """Indices of the next `batch_size` items and the position after them.

  Raises:
    ValueError: if the set is empty, the batch size is not positive, or the
      position does not fit the set (e.g. a checkpoint from another data set).
  """
  if num_items <= 0:
    raise ValueError(f"cannot draw batches from an empty set (num_items={num_items})")
  if batch_size <= 0:
    raise ValueError(f"batch_size must be > 0, got {batch_size}")
  if position.epoch < 0 or not 0 <= position.index < num_items:
    raise ValueError(f"loader position (epoch={position.epoch}, index="
                     f"{position.index}) does not fit a set of {num_items} items")
  out, count = [], 0
  epoch, index = position.epoch, position.index
  while count < batch_size:
    perm = epoch_permutation(num_items, seed, epoch)
    take = min(batch_size - count, num_items - index)
    out.append(perm[index:index + take])
    count += take
    index += take
    if index == num_items:
      epoch, index = epoch + 1, 0
  return np.concatenate(out), LoaderPosition(epoch, index)


class EpochLoader:
  """Stateful wrapper over `next_indices` for the run loop.

  Args:
    problems: the fixed training set.
    batch_size: problems per batch (Bp).
    seed: shuffling seed.
  """

  def __init__(self, problems: Sequence, batch_size: int, seed: int,
               position: LoaderPosition = LoaderPosition()):
    self.problems = list(problems)
    self.batch_size = int(batch_size)
    self.seed = int(seed)
    self.position = position
    next_indices(len(self.problems), position, self.batch_size, self.seed)  # validates

  def next_batch(self) -> list:
    """The next `batch_size` problems; advances the position."""
    idx, self.position = next_indices(len(self.problems), self.position,
                                      self.batch_size, self.seed)
    return [self.problems[i] for i in idx]

  def state_dict(self) -> dict:
    """Position plus a fingerprint of the set, checked on restore."""
    return self.position.state_dict() | {"num_items": len(self.problems),
                                         "seed": self.seed}

  def load_state_dict(self, state: dict) -> None:
    """Resume from `state_dict()`; the set and seed must match the saved ones."""
    for key, expect in (("num_items", len(self.problems)), ("seed", self.seed)):
      if key in state and int(state[key]) != expect:
        raise ValueError(f"loader state has {key}={int(state[key])} but this "
                         f"loader has {key}={expect}")
    position = LoaderPosition.from_state_dict(state)
    next_indices(len(self.problems), position, self.batch_size, self.seed)
    self.position = position
