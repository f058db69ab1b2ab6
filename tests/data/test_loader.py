"""Epoch-wise shuffling and exact resume (isojax/data/loader.py)."""

import json

import numpy as np
import pytest

from isojax.data import EpochLoader, LoaderPosition, next_indices


def test_each_epoch_is_a_permutation_with_a_new_order():
  n, bs = 10, 3
  pos, seen = LoaderPosition(), []
  for _ in range(10):  # 30 items = 3 epochs
    idx, pos = next_indices(n, pos, bs, seed=0)
    assert len(idx) == bs
    seen.extend(idx.tolist())
  assert pos == LoaderPosition(epoch=3, index=0)
  epochs = [seen[i * n:(i + 1) * n] for i in range(3)]
  for e in epochs:
    assert sorted(e) == list(range(n))
  assert epochs[0] != epochs[1] != epochs[2]
  # A batch spanning the epoch boundary: the tail of epoch 0 then the head of epoch 1.
  idx, pos = next_indices(n, LoaderPosition(0, 9), 3, seed=0)
  assert idx.tolist() == [epochs[0][9]] + epochs[1][:2]
  assert pos == LoaderPosition(1, 2)


def test_seed_changes_order():
  a, _ = next_indices(50, LoaderPosition(), 50, seed=0)
  b, _ = next_indices(50, LoaderPosition(), 50, seed=1)
  assert sorted(a) == sorted(b) and a.tolist() != b.tolist()


def test_batch_larger_than_the_set():
  idx, pos = next_indices(4, LoaderPosition(), 10, seed=0)
  assert len(idx) == 10 and pos == LoaderPosition(2, 2)
  assert sorted(idx[:4]) == [0, 1, 2, 3] and sorted(idx[4:8]) == [0, 1, 2, 3]


def test_exact_resume_from_saved_state():
  problems = [f"p{i}" for i in range(37)]
  full = EpochLoader(problems, batch_size=8, seed=42)
  stream = [full.next_batch() for _ in range(20)]

  first = EpochLoader(problems, batch_size=8, seed=42)
  for _ in range(7):
    first.next_batch()
  saved = json.loads(json.dumps(first.state_dict()))  # as a checkpoint would store it
  resumed = EpochLoader(problems, batch_size=8, seed=42)
  resumed.load_state_dict(saved)
  assert [resumed.next_batch() for _ in range(13)] == stream[7:]
  # NumPy scalars as restored by orbax.
  again = EpochLoader(problems, batch_size=8, seed=42)
  again.load_state_dict({k: np.asarray(v) for k, v in saved.items()})
  assert again.next_batch() == stream[7]


def test_resume_rejects_mismatched_state():
  loader = EpochLoader(list(range(10)), batch_size=2, seed=0)
  with pytest.raises(ValueError, match="num_items=12"):
    loader.load_state_dict({"epoch": 0, "index": 0, "num_items": 12, "seed": 0})
  with pytest.raises(ValueError, match="seed=1"):
    loader.load_state_dict({"epoch": 0, "index": 0, "num_items": 10, "seed": 1})
  with pytest.raises(ValueError, match="does not fit"):
    loader.load_state_dict({"epoch": 0, "index": 10})
  with pytest.raises(ValueError, match="lacks"):
    loader.load_state_dict({"epoch": 0})
  with pytest.raises(ValueError, match="empty"):
    EpochLoader([], batch_size=2, seed=0)
  with pytest.raises(ValueError, match="batch_size"):
    EpochLoader([1], batch_size=0, seed=0)
