"""build_batch: fixed shapes, left-padded prompts, right-padded completions."""

import numpy as np
import pytest

from isojax import batching
from isojax.rollout import Rollouts


def _rollouts():
  # 2 prompts x n=2; completion lengths 3, 1, 2, 0 (an empty completion is legal).
  return Rollouts.from_sequences(
      tokens=[[7, 8, 9], [5], [6, 6], []],
      logprobs=[[-0.1, -0.2, -0.3], [-0.5], [-0.6, -0.7], []],
      finish_reasons=["stop", "stop", "length", "length"])


def test_layout_by_hand():
  batch = batching.build_batch([[1, 2], [3, 4, 5]], _rollouts(),
                               np.array([1, 0, 0, 1], np.float32),
                               n=2, prompt_width=4, max_tokens=3, pad_id=0)
  ids = np.array([[0, 0, 1, 2, 7, 8, 9],
                  [0, 0, 1, 2, 5, 0, 0],
                  [0, 3, 4, 5, 6, 6, 0],
                  [0, 3, 4, 5, 0, 0, 0]])
  attn = np.array([[0, 0, 1, 1, 1, 1, 1],
                   [0, 0, 1, 1, 1, 0, 0],
                   [0, 1, 1, 1, 1, 1, 0],
                   [0, 1, 1, 1, 0, 0, 0]])
  loss = np.array([[0, 0, 0, 0, 1, 1, 1],
                   [0, 0, 0, 0, 1, 0, 0],
                   [0, 0, 0, 0, 1, 1, 0],
                   [0, 0, 0, 0, 0, 0, 0]])
  np.testing.assert_array_equal(batch.input_ids_BxT, ids)
  np.testing.assert_array_equal(batch.attention_mask_BxT, attn)
  np.testing.assert_array_equal(batch.loss_mask_BxT, loss)
  np.testing.assert_allclose(batch.sampler_logp_BxT[0, 4:], [-0.1, -0.2, -0.3])
  np.testing.assert_allclose(batch.sampler_logp_BxT[2], [0, 0, 0, 0, -0.6, -0.7, 0])
  assert batch.sampler_logp_BxT[:, :4].sum() == 0
  np.testing.assert_array_equal(batch.rewards_B, [1, 0, 0, 1])


def test_shape_is_fixed_whatever_the_lengths():
  short = Rollouts.from_sequences([[1]] * 4, [[-1.0]] * 4, ["stop"] * 4)
  a = batching.build_batch([[1], [2]], short, np.zeros(4), n=2, prompt_width=16,
                           max_tokens=8, pad_id=0)
  b = batching.build_batch([[1, 2], [3, 4, 5]], _rollouts(), np.zeros(4), n=2,
                           prompt_width=16, max_tokens=8, pad_id=0)
  assert a.input_ids_BxT.shape == b.input_ids_BxT.shape == (4, 24)


def test_bad_inputs_are_named():
  with pytest.raises(ValueError, match="prompt 1 has 3 tokens; the run's prompt width is 2"):
    batching.build_batch([[1, 2], [3, 4, 5]], _rollouts(), np.zeros(4), n=2,
                         prompt_width=2, max_tokens=3, pad_id=0)
  with pytest.raises(ValueError, match="3 tokens > max_tokens=2"):
    batching.build_batch([[1], [3]], _rollouts(), np.zeros(4), n=2, prompt_width=4,
                         max_tokens=2, pad_id=0)
  with pytest.raises(ValueError, match=r"expected 3 prompts x n=2 = 6"):
    batching.build_batch([[1], [2], [3]], _rollouts(), np.zeros(6), n=2, prompt_width=4,
                         max_tokens=3, pad_id=0)


def test_prompt_bucket():
  assert [batching.prompt_bucket(x) for x in (1, 16, 17, 100)] == [16, 16, 32, 128]


def test_train_rows_pick_n_of_each_prompts_n_est():
  rows = batching.train_rows(bp=3, n_est=8, n=3, seed=5)
  assert rows.shape == (9,)
  groups = rows.reshape(3, 3)
  for i, g in enumerate(groups):
    # Inside prompt i's block, distinct, increasing: prompt-major groups of n.
    assert np.all((g >= i * 8) & (g < (i + 1) * 8)) and np.all(np.diff(g) > 0)
  assert batching.train_rows(3, 8, 3, seed=5).tolist() == rows.tolist()
  assert batching.train_rows(3, 8, 3, seed=6).tolist() != rows.tolist()
  assert batching.train_rows(2, 4, 4, seed=0).tolist() == list(range(8))
  with pytest.raises(ValueError, match="n=5, n_est=4"):
    batching.train_rows(2, 4, 5, seed=0)


def test_decoupled_batch_keeps_the_trained_rows_and_all_baseline_rewards():
  seqs = [[10 + i, 2] if i % 2 else [10 + i] for i in range(8)]  # 2 prompts x n_est 4
  r = Rollouts.from_sequences(seqs, [[-0.5] * len(s) for s in seqs], ["stop"] * 8)
  rewards_B = np.arange(8, dtype=np.float32)
  rows = np.array([1, 3, 4, 6])
  sub = batching.take_rollouts(r, rows)
  assert sub.num_rollouts == 4 and sub.num_generated_tokens == 2 + 2 + 1 + 1
  assert sub.tokens_BxT[:, 0].tolist() == [11, 13, 14, 16]
  b = batching.build_batch([[1, 2], [3]], sub, rewards_B[rows], n=2, prompt_width=4,
                           max_tokens=3, pad_id=0, baseline_rewards_B=rewards_B)
  assert b.rewards_B.tolist() == [1, 3, 4, 6]
  assert b.baseline_rewards_B.tolist() == list(range(8))
  assert b.input_ids_BxT[0].tolist() == [0, 0, 1, 2, 11, 2, 0]
  with pytest.raises(ValueError, match=r"baseline_rewards_B has shape \(3,\)"):
    batching.build_batch([[1, 2], [3]], sub, rewards_B[rows], n=2, prompt_width=4,
                         max_tokens=3, pad_id=0, baseline_rewards_B=rewards_B[:3])


def test_forced_tokens_are_attended_not_trained_on():
  # Row 0: think [7, 8], forced phrase [4, 5], answer [9]; row 1 sampled only.
  r = Rollouts.from_sequences([[7, 8, 4, 5, 9], [6]],
                              [[-0.1, -0.2, 0.0, 0.0, -0.3], [-0.5]], ["stop", "stop"],
                              forced=[[0, 0, 1, 1, 0], [0]])
  batch = batching.build_batch([[1, 2]], r, np.zeros(2), n=2, prompt_width=2,
                               max_tokens=6, pad_id=0)
  np.testing.assert_array_equal(batch.input_ids_BxT,
                                [[1, 2, 7, 8, 4, 5, 9, 0], [1, 2, 6, 0, 0, 0, 0, 0]])
  np.testing.assert_array_equal(batch.attention_mask_BxT,
                                [[1, 1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0, 0, 0]])
  np.testing.assert_array_equal(batch.loss_mask_BxT,
                                [[0, 0, 1, 1, 0, 0, 1, 0], [0, 0, 1, 0, 0, 0, 0, 0]])
  np.testing.assert_allclose(batch.sampler_logp_BxT[0], [0, 0, -0.1, -0.2, 0, 0, -0.3, 0])


def test_take_rollouts_keeps_forced_tokens_out_of_the_count():
  r = Rollouts.from_sequences([[7, 4, 9], [6, 6], [5]], [[-0.1, 0.0, -0.3], [-1, -1], [-1]],
                              ["length", "stop", "stop"], forced=[[0, 1, 0], [0, 0], [0]])
  sub = batching.take_rollouts(r, np.array([2, 0]))
  assert sub.forced_BxT.tolist() == [[0, 0, 0], [0, 1, 0]]
  assert sub.interrupted_B.tolist() == [False, True]
  assert sub.num_generated_tokens == 1 + 2


def test_take_rollouts_keeps_version_labels():
  r = Rollouts.from_sequences([[7, 4, 9], [6, 6], [5]], [[-0.1, 0.0, -0.3], [-1, -1], [-1]],
                              ["length", "stop", "stop"], forced=[[0, 1, 0], [0, 0], [0]],
                              versions=[[0, -1, 1], [2, 3], [4]])
  sub = batching.take_rollouts(r, np.array([2, 0]))
  assert sub.version_BxT.tolist() == [[4, -1, -1], [0, -1, 1]]
  plain = Rollouts.from_sequences([[7], [6]], [[-0.1], [-1]], ["stop", "stop"])
  assert batching.take_rollouts(plain, np.array([1])).version_BxT is None
