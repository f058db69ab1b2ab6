"""Epoch-wise shuffling, retiring solved problems and exact resume
(isojax/data/loader.py)."""

import json

import numpy as np
import pytest

from isojax.data import (AllRetiredError, EpochLoader, LoaderPosition, TooFewActiveError,
                         Problem, epoch_permutation, group_pass_rates, next_indices)


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


def test_loader_refuses_a_fractional_batch_or_a_negative_seed_by_name():
  # Neither is cut to an int (a batch of 2.5 drawing 2) nor left to NumPy's error.
  for kwargs, name in ((dict(batch_size=2.5, seed=0), "batch_size=2.5"),
                       (dict(batch_size=True, seed=0), "batch_size=True"),
                       (dict(batch_size=2, seed=-1), "seed=-1"),
                       (dict(batch_size=2, seed=0.5), "seed=0.5")):
    with pytest.raises(ValueError, match=f"EpochLoader {name} must be an integer"):
      EpochLoader(_names(4), **kwargs)
  assert EpochLoader(_names(4), batch_size=np.int64(2), seed=np.uint32(7)).seed == 7


# No-positive-resampling: solved problems retire from the epochs not yet drawn.

def _names(n):
  return [f"p{i}" for i in range(n)]


def test_retired_problems_leave_from_the_next_epoch():
  # Seed 0: epoch 0 visits [3 2 5 4 0 1]; epoch 1's order of 4 is [3 0 2 1], epoch
  # 2's [2 1 0 3] (epoch_permutation(4, 0, e)), taken over the active [0 1 2 4].
  loader = EpochLoader(_names(6), batch_size=3, seed=0)
  first = loader.next_batch()
  assert first == ["p3", "p2", "p5"]
  assert loader.record_pass_rates(first, [1.0, 0.5, 0.9], retire_at=0.9) == 2
  assert loader.num_retired == 2
  assert loader.next_batch() == ["p4", "p0", "p1"]  # epoch 0 was drawn already
  assert loader.next_batch() == ["p4", "p0", "p2"]  # epoch 1: [0 1 2 4][[3 0 2 1]]
  assert loader.next_batch() == ["p1", "p2", "p1"]  # its tail, then epoch 2's head
  assert loader.state_dict() == {"epoch": 2, "index": 2, "num_items": 6, "seed": 0,
                                 "retired": [[3, 1], [5, 1]]}


def test_retiring_at_an_epoch_start_applies_to_that_epoch():
  loader = EpochLoader(_names(6), batch_size=3, seed=0)
  loader.next_batch()
  second = loader.next_batch()  # ["p4", "p0", "p1"]: epoch 0 done, epoch 1 not drawn
  assert loader.position == LoaderPosition(1, 0)
  loader.record_pass_rates(second, [0.95, 0.0, 0.0], retire_at=0.9)
  loader.record_pass_rates(["p5"], [1.0], retire_at=0.9)  # not in this batch: any
  # Epoch 1 over the active [0 1 2 3]: [3 0 2 1].
  assert loader.retired_from == {4: 1, 5: 1}
  assert loader.next_batch() == ["p3", "p0", "p2"]


def test_duplicates_retire_together_and_unknown_problems_are_named():
  loader = EpochLoader(["a", "b", "a", "c"], batch_size=2, seed=0)
  loader.record_pass_rates(["a"], [1.0], retire_at=1.0)
  assert loader.retired_from == {0: 0, 2: 0}
  with pytest.raises(ValueError, match="problem 'z' is not in"):
    loader.record_pass_rates(["z"], [1.0], retire_at=1.0)
  with pytest.raises(ValueError, match="2 problems but 1 pass rates"):
    loader.record_pass_rates(["a", "b"], [1.0], retire_at=1.0)
  for bad in (0.0, 1.5, float("nan")):
    with pytest.raises(ValueError, match=r"retire_at=.* must be a pass rate in \(0, 1\]"):
      loader.record_pass_rates(["a"], [1.0], retire_at=bad)


def _run_with_retiring(loader, batches, step0=0):
  """Draws `batches` batches, retiring by pass rates drawn from the step alone."""
  out = []
  for step in range(step0, step0 + batches):
    batch = loader.next_batch()
    rates = np.random.default_rng(step).random(len(batch))
    loader.record_pass_rates(batch, rates, retire_at=0.85)
    out.append(batch)
  return out


def test_exact_resume_with_retired_problems():
  problems = _names(37)
  full = EpochLoader(problems, batch_size=5, seed=3)
  stream = _run_with_retiring(full, 20)
  assert 5 < full.num_retired < 37 and full.position.epoch >= 3
  mid_epoch_with_retired = 0
  for cut in range(1, 20):
    first = EpochLoader(problems, batch_size=5, seed=3)
    _run_with_retiring(first, cut)
    saved = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
    mid_epoch_with_retired += saved["index"] > 0 and "retired" in saved
    resumed = EpochLoader(problems, batch_size=5, seed=3)
    resumed.load_state_dict(saved)
    assert _run_with_retiring(resumed, 20 - cut, step0=cut) == stream[cut:], cut
    assert resumed.state_dict() == full.state_dict()
  assert mid_epoch_with_retired >= 5
  # NumPy values as restored by orbax.
  again = EpochLoader(problems, batch_size=5, seed=3)
  again.load_state_dict({k: np.asarray(v) for k, v in saved.items()})
  assert again.state_dict() == saved


def test_all_retired_fails_naming_the_count():
  loader = EpochLoader(_names(4), batch_size=2, seed=0)
  for _ in range(2):
    batch = loader.next_batch()
    loader.record_pass_rates(batch, [1.0, 1.0], retire_at=0.9)
  assert loader.num_retired == 4
  saved = loader.state_dict()
  with pytest.raises(AllRetiredError, match="all 4 problems are retired .* epoch 1"):
    loader.next_batch()
  # A run that retired everything at its last step still resumes (and stops there).
  EpochLoader(_names(4), batch_size=2, seed=0).load_state_dict(saved)
  with pytest.raises(ValueError, match=r"retired items \[9\] do not fit"):
    loader.load_state_dict(saved | {"retired": [[9, 1]]})
  with pytest.raises(ValueError, match="does not fit"):  # epoch 1 has 1 active item
    loader.load_state_dict(saved | {"index": 1, "retired": [[0, 1], [1, 1], [2, 1]]})


@pytest.mark.parametrize("seed", [0, 1, 7, 123])
def test_without_retiring_the_stream_and_state_are_unchanged(seed):
  loader = EpochLoader(_names(11), batch_size=4, seed=seed)
  drawn = [i for _ in range(9) for i in loader.next_batch()]  # 36 = 3 epochs + 3
  today = np.concatenate([epoch_permutation(11, seed, e) for e in range(4)])
  assert drawn == [f"p{i}" for i in today[:36]]
  loader.record_pass_rates(["p0", "p1"], [0.5, 0.89], retire_at=0.9)  # none solved
  assert loader.state_dict() == {"epoch": 3, "index": 3, "num_items": 11, "seed": seed}
  # A state saved before retiring existed (no "retired") resumes with none retired.
  loader.record_pass_rates(["p0"], [1.0], retire_at=0.9)
  loader.load_state_dict({"epoch": 3, "index": 3, "num_items": 11, "seed": seed})
  assert loader.num_retired == 0
  assert loader.next_batch() == [f"p{i}" for i in epoch_permutation(11, seed, 3)[3:7]]


def test_group_pass_rates():
  rewards_B = np.array([1, 0, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1], dtype=np.float32)
  np.testing.assert_array_equal(group_pass_rates(rewards_B, 4), [0.75, 0.0, 1.0])
  nine_of_ten = np.array([1.0] * 9 + [0.0])
  assert group_pass_rates(nine_of_ten, 10)[0] >= 0.9  # 9/10 reaches ScaleRL's 0.9
  with pytest.raises(ValueError, match="group_size=3"):
    group_pass_rates(rewards_B[:8], 3)


def test_fewer_active_problems_than_a_batch_fails_naming_counts_and_threshold():
  # 10 problems, batches of 8: retiring 6 leaves 4, and a batch of 8 from 4 would
  # hold each problem twice (the reason a run refuses Bp above the set's size).
  loader = EpochLoader(_names(10), batch_size=8, seed=0)
  batch = loader.next_batch()
  loader.record_pass_rates(batch, [1.0] * 6 + [0.0] * 2, retire_at=0.9)
  with pytest.raises(TooFewActiveError,
                     match=r"6 of 10 problems are retired as solved \(data\."
                           r"drop_solved_above=0.9\): epoch 1 has 4 left, fewer than "
                           r"a batch of 8"):
    loader.next_batch()  # the rest of epoch 0 (2), then epoch 1's 4 do not fill it
  # A resumed loader names the threshold it was given before it records any rate.
  resumed = EpochLoader(_names(10), batch_size=8, seed=0, retire_at=0.5)
  resumed.load_state_dict(loader.state_dict())
  with pytest.raises(TooFewActiveError, match=r"drop_solved_above=0.5\)"):
    resumed.next_batch()
  # Exactly a batch's worth left still draws each once per epoch.
  loader = EpochLoader(_names(10), batch_size=4, seed=0)
  loader.record_pass_rates(_names(10)[:6], [1.0] * 6, retire_at=1.0)
  for _ in range(3):
    assert sorted(loader.next_batch()) == _names(10)[6:]


def test_problems_equal_but_for_their_ids_retire_together():
  # A file's duplicate rows get distinct ids (their row numbers); the same question
  # with the same answer is one problem to retire.
  problems = [Problem("0", "What is 2+2?", "4"), Problem("1", "What is 2+2?", "4"),
              Problem("2", "q", "1"), Problem("3", "q", "2")]
  loader = EpochLoader(problems, batch_size=2, seed=0)
  assert loader.record_pass_rates([problems[0]], [1.0], retire_at=0.9) == 2
  assert loader.retired_from == {0: 0, 1: 0}
  assert loader.record_pass_rates([problems[2]], [1.0], retire_at=0.9) == 1  # not "3"
