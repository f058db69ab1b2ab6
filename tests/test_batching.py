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
