"""Padding follows real tokens: left-aligned, length-sorted, bucket-trimmed micro-batches
give the same loss, metrics and update as the batch in its given layout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from isojax import sharding as shd
from isojax.models import Decoder
from isojax.rl import Batch, init_train_state, make_train_step
from isojax.rl import layout
from tests.rl.test_step import LOSS, SGD_LIKE, assert_trees_close, tiny_config

B, T, N = 8, 32, 4
PROMPT = 8
# + T = 32. Every length is used by a test below (a bucket no micro-batch
# reaches is one more branch to compile and checks nothing).
BUCKETS = (8, 24)


def mixed_batch(seed=0):
  """Prompts of 2..8 tokens left-padded to 8, completions of 1..24 tokens."""
  rng = np.random.default_rng(seed)
  prompt_len = [8, 3, 5, 2, 6, 4, 7, 2]
  completion_len = [24, 2, 9, 1, 17, 3, 12, 5]
  ids = rng.integers(1, 64, (B, T)).astype(np.int32)
  attn = np.zeros((B, T), np.int32)
  loss_mask = np.zeros((B, T), np.float32)
  for b in range(B):
    attn[b, PROMPT - prompt_len[b]:PROMPT + completion_len[b]] = 1
    loss_mask[b, PROMPT:PROMPT + completion_len[b]] = 1
  sampler = (-rng.uniform(0.5, 4.0, (B, T)) * loss_mask).astype(np.float32)
  base = np.array([1, 0, 0, 1, 0, 0, 1, 1, 1, 1, 1, 1, 0, 1, 1, 0], np.float32)  # n_est = 8
  batch = Batch(input_ids_BxT=jnp.asarray(ids * attn), attention_mask_BxT=jnp.asarray(attn),
                loss_mask_BxT=jnp.asarray(loss_mask), sampler_logp_BxT=jnp.asarray(sampler),
                rewards_B=jnp.asarray([1, 0, 0, 1, 1, 1, 0, 1], jnp.float32),
                baseline_rewards_B=jnp.asarray(base))
  return batch, np.asarray(prompt_len) + np.asarray(completion_len)


@pytest.fixture(scope="module")
def model():
  return Decoder(tiny_config(), rngs=nnx.Rngs(0))


def one_step(model, *, micro, buckets, mesh=None, chunk=None):
  step = make_train_step(model, LOSS, SGD_LIKE, batch_size=B, group_size=N,
                         micro_batch_size=micro, mesh=mesh, length_buckets=buckets,
                         logits_chunk=chunk)
  state = init_train_state(model, LOSS, SGD_LIKE, batch_size=B, mesh=mesh)
  keys = iter(jax.random.split(jax.random.key(1), 64))
  state = state.replace(params=jax.tree.map(  # params != ref_params: KL is live
      lambda p: jax.device_put(p + 0.05 * jax.random.normal(next(keys), p.shape), p.sharding),
      state.params))
  before = jax.tree.map(np.asarray, state.params)
  new, metrics = step(state, mixed_batch()[0])
  delta = jax.tree.map(lambda a, b: np.asarray(a) - b, new.params, before)
  return delta, {k: float(v) for k, v in metrics.items()}


@pytest.fixture(scope="module")
def as_given(model):
  """Today's layout: one micro-batch of the padded rows, untrimmed."""
  return one_step(model, micro=8, buckets=1)


def expected_pad_fraction(micro):
  real_B = mixed_batch()[1]
  lengths = np.array(BUCKETS + (T,))
  longest_M = np.sort(real_B).reshape(-1, micro)[:, -1]
  positions = micro * lengths[np.searchsorted(lengths, longest_M)].sum()
  return 1.0 - real_B.sum() / positions


def check_same(got, ref):
  (delta, m), (delta0, m0) = got, ref
  scale = max(np.abs(d).max() for d in jax.tree.leaves(delta0))
  assert scale > 1e-3
  assert_trees_close(delta, delta0, atol=2e-5 * scale)
  for k in m0:
    if k != "pad_fraction":
      np.testing.assert_allclose(m[k], m0[k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("micro,chunk", [(2, None), (4, 8)])
def test_bucketed_micro_batches_match_the_given_layout(model, as_given, micro, chunk):
  got = one_step(model, micro=micro, buckets=BUCKETS, chunk=chunk)
  check_same(got, as_given)
  # micro 2: sorted lengths 3 5 | 7 7 | 14 19 | 23 32 -> buckets 8 8 24 32 (144 positions);
  # micro 4: 3 5 7 7 | 14 19 23 32 -> buckets 8 32
  np.testing.assert_allclose(got[1]["pad_fraction"], expected_pad_fraction(micro), rtol=1e-6)
  assert got[1]["pad_fraction"] < as_given[1]["pad_fraction"]
  np.testing.assert_allclose(as_given[1]["pad_fraction"],
                             1 - mixed_batch()[1].sum() / (B * T), rtol=1e-6)


def test_bucketed_and_sharded_matches_the_given_layout(model, as_given):
  mesh = shd.make_mesh(data=2, fsdp=2, tensor=2)
  got = one_step(model, micro=4, buckets=BUCKETS, mesh=mesh)
  check_same(got, as_given)
  np.testing.assert_allclose(got[1]["pad_fraction"], expected_pad_fraction(4), rtol=1e-6)


def test_left_align_keeps_every_row_and_sort_orders_lengths():
  batch, real_B = mixed_batch()
  rows = {"ids": batch.input_ids_BxT, "attn": batch.attention_mask_BxT, "r": batch.rewards_B}
  out, length_B = layout.left_align(rows, batch.attention_mask_BxT)
  np.testing.assert_array_equal(length_B, real_B)
  for b in range(B):
    keep = np.asarray(batch.attention_mask_BxT[b]) > 0
    np.testing.assert_array_equal(np.asarray(out["ids"][b, :real_B[b]]),
                                  np.asarray(batch.input_ids_BxT[b])[keep])
    assert np.asarray(out["attn"][b]).tolist() == [1] * real_B[b] + [0] * (T - real_B[b])
  np.testing.assert_array_equal(out["r"], batch.rewards_B)  # [B] leaves are untouched
  srt, sorted_B = layout.sort_by_length(out, length_B)
  order = np.argsort(real_B, kind="stable")
  np.testing.assert_array_equal(sorted_B, real_B[order])
  np.testing.assert_array_equal(srt["r"], np.asarray(batch.rewards_B)[order])


def test_bucket_lengths():
  assert layout.bucket_lengths(8192) == (2048, 4096, 6144, 8192)
  assert layout.bucket_lengths(8200) == (2176, 4224, 6272, 8200)  # multiples of 128, then T
  assert layout.bucket_lengths(24) == (24,)  # narrower than a multiple: untrimmed
  assert layout.bucket_lengths(32, (8, 16, 24, 64)) == (8, 16, 24, 32)
  assert layout.bucket_lengths(32, 1) == (32,)
  with pytest.raises(ValueError, match="length_buckets=0"):
    layout.bucket_lengths(32, 0)
