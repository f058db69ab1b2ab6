"""GAE against a NumPy reference written from the formula, per row and per token."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from isojax import sharding as shd
from isojax.rl.gae import final_token_rewards, gae, whiten


def np_gae(rewards, values, mask, gamma, lam):
  """Row by row over the trained positions only: the episode is the list of
  trained tokens, the reward comes on the last one, V after the end is 0."""
  B, T = mask.shape
  adv, ret = np.zeros((B, T)), np.zeros((B, T))
  for b in range(B):
    steps = [t for t in range(T) if mask[b, t]]
    a_next = 0.0
    for i in reversed(range(len(steps))):
      t = steps[i]
      last = i == len(steps) - 1
      r = rewards[b] if last else 0.0
      v_next = 0.0 if last else values[b, steps[i + 1]]
      delta = r + gamma * v_next - values[b, t]
      a_next = delta + gamma * lam * a_next
      adv[b, t] = a_next
      ret[b, t] = a_next + values[b, t]
  return adv, ret


def make_rows(seed, lengths, prompt_lengths, T, holes=False):
  """Left-padded prompts ++ right-padded completions of ragged lengths.

  Padding positions carry garbage values (large and NaN) that must not leak.
  ``holes`` masks out a few tokens inside completions (observation tokens).
  """
  rng = np.random.default_rng(seed)
  B = len(lengths)
  P = max(prompt_lengths)
  mask = np.zeros((B, T), np.float32)
  attn = np.zeros((B, T), np.float32)
  for b, (n, p) in enumerate(zip(lengths, prompt_lengths)):
    attn[b, P - p:P + n] = 1
    mask[b, P:P + n] = 1
    if holes and n > 3:
      mask[b, P + 1] = 0
  values = rng.normal(size=(B, T)).astype(np.float32)
  values = np.where(attn > 0, values, 1e6).astype(np.float32)
  values[:, -1] = np.where(mask[:, -1] > 0, values[:, -1], np.nan)
  rewards = rng.normal(size=B).astype(np.float32)
  return rewards, values, mask


ROWS = dict(lengths=[5, 1, 0, 7, 3], prompt_lengths=[2, 4, 3, 1, 4], T=12)


@pytest.mark.parametrize("gamma, lam, holes", list(itertools.product(
    (1.0, 0.0, 0.9), (1.0, 0.0, 0.95), (False, True))))
def test_gae_matches_numpy_reference(gamma, lam, holes):
  rewards, values, mask = make_rows(0, **ROWS, holes=holes)
  adv, ret = gae(final_token_rewards(rewards, mask), values, mask, gamma=gamma, lam=lam)
  ref_adv, ref_ret = np_gae(rewards.astype(np.float64), values.astype(np.float64), mask,
                            gamma, lam)
  np.testing.assert_allclose(np.asarray(adv), ref_adv, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(ret), ref_ret, rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(adv)[mask == 0] == 0) and np.all(np.asarray(ret)[mask == 0] == 0)


def test_lambda_one_gamma_one_zero_critic_is_reward_to_go():
  rewards, _, mask = make_rows(1, **ROWS)
  adv, ret = gae(final_token_rewards(rewards, mask), np.zeros_like(mask), mask)
  expected = np.where(mask > 0, rewards[:, None], 0.0)
  np.testing.assert_allclose(np.asarray(adv), expected, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(ret), expected, rtol=1e-6)


def test_lambda_one_is_monte_carlo_minus_value():
  # lam = 1: A_t = gamma^(steps to the end) * R - V_t for any critic.
  rewards, values, mask = make_rows(2, **ROWS)
  gamma = 0.8
  adv, ret = gae(final_token_rewards(rewards, mask), values, mask, gamma=gamma, lam=1.0)
  to_end = np.cumsum(mask[:, ::-1], axis=1)[:, ::-1] - 1
  mc = np.where(mask > 0, rewards[:, None] * gamma ** to_end, 0.0)
  np.testing.assert_allclose(np.asarray(ret), mc, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(adv), np.where(mask > 0, mc - values, 0.0),
                             rtol=1e-5, atol=1e-5)


def test_lambda_zero_is_td_error():
  rewards, values, mask = make_rows(3, lengths=[4, 2], prompt_lengths=[2, 1], T=8)
  adv, _ = gae(final_token_rewards(rewards, mask), values, mask, gamma=0.9, lam=0.0)
  # row 0: trained columns 2..5; row 1: 2..3
  v = values.astype(np.float64)
  np.testing.assert_allclose(float(adv[0, 3]), 0.9 * v[0, 4] - v[0, 3], rtol=1e-5)
  np.testing.assert_allclose(float(adv[0, 5]), rewards[0] - v[0, 5], rtol=1e-5)
  np.testing.assert_allclose(float(adv[1, 3]), rewards[1] - v[1, 3], rtol=1e-5)


def test_final_token_rewards_placement():
  mask = np.array([[0, 1, 1, 1, 0], [0, 0, 0, 0, 0], [1, 0, 1, 0, 0], [0, 0, 0, 0, 1]])
  r = final_token_rewards(np.array([2.0, 3.0, 4.0, 5.0]), mask)
  np.testing.assert_array_equal(np.asarray(r), [[0, 0, 0, 2, 0], [0] * 5, [0, 0, 4, 0, 0],
                                                [0, 0, 0, 0, 5]])


def test_jit_and_no_gradient_into_values():
  rewards, values, mask = make_rows(4, **ROWS)
  values = np.nan_to_num(values, nan=0.0)
  f = jax.jit(lambda v: gae(final_token_rewards(rewards, mask), v, mask, gamma=0.9, lam=0.9))
  np.testing.assert_array_equal(np.asarray(f(values)[0]),
                                np.asarray(gae(final_token_rewards(rewards, mask), values, mask,
                                               gamma=0.9, lam=0.9)[0]))
  g = jax.grad(lambda v: jnp.sum(f(v)[1]))(jnp.asarray(values))
  assert np.all(np.asarray(g) == 0)


def test_sharded_batch_on_8_devices_equals_one_device():
  rewards, values, mask = make_rows(7, lengths=[5, 1, 0, 7, 3, 2, 6, 4],
                                    prompt_lengths=[2, 4, 3, 1, 4, 2, 2, 3], T=12)

  def f(r, v, m):
    adv, ret = gae(final_token_rewards(r, m), v, m, gamma=0.95, lam=0.9)
    return whiten(adv, m), ret

  ref = f(rewards, values, mask)
  rows = shd.batch_sharding(shd.make_mesh(data=2, fsdp=4))
  out = jax.jit(f)(*(jax.device_put(x, rows) for x in (rewards, values, mask)))
  for a, b in zip(out, ref):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_whiten_over_trained_tokens_of_the_batch():
  rng = np.random.default_rng(5)
  _, _, mask = make_rows(5, **ROWS)
  x = np.where(mask > 0, rng.normal(3.0, 2.0, mask.shape), 1e9).astype(np.float32)
  out = np.asarray(whiten(x, mask, std_eps=0.0))
  on = x[mask > 0].astype(np.float64)
  np.testing.assert_allclose(out[mask > 0], (on - on.mean()) / on.std(ddof=1), rtol=1e-5,
                             atol=1e-6)
  assert np.all(out[mask == 0] == 0)
  np.testing.assert_allclose(out[mask > 0].mean(), 0.0, atol=1e-6)


@pytest.mark.parametrize("bad, match", [
    (dict(values=np.zeros((5, 11))), "values_BxT has shape"),
    (dict(rewards=np.zeros(4)), "rewards_B has shape"),
    (dict(gamma=1.5), "gamma=1.5"),
    (dict(lam=-0.1), "lam=-0.1"),
])
def test_bad_inputs_are_named(bad, match):
  rewards, values, mask = make_rows(6, **ROWS)
  kw = dict(rewards=rewards, values=values, gamma=1.0, lam=1.0) | bad
  with pytest.raises(ValueError, match=match):
    gae(final_token_rewards(kw["rewards"], mask), kw["values"], mask, gamma=kw["gamma"],
        lam=kw["lam"])
