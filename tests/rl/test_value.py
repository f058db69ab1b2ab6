"""The clipped value loss, advantages from values and critic metrics against NumPy."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from isojax.rl.gae import final_token_rewards, gae, whiten
from isojax.rl.value import ValueConfig, value_advantages, value_loss, value_metrics
from isojax.rl.value import value_weights, weighted_value_loss

AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "prompt_mean")


def make_inputs(seed, B=8, T=7):
  rng = np.random.default_rng(seed)
  mask = (rng.uniform(size=(B, T)) < 0.7).astype(np.float32)
  mask[3] = 0.0  # an empty sequence
  mask[:, 0] = 0.0
  old = rng.normal(size=(B, T))
  # half the tokens move beyond a 0.5 clip range
  values = old + rng.choice([0.1, -0.2, 0.9, -1.3], size=(B, T))
  returns = rng.normal(size=(B, T))
  garbage = lambda x: np.where(mask > 0, x, np.nan).astype(np.float32)  # noqa: E731
  return garbage(values), garbage(old), garbage(returns), mask


def np_value_loss(values, old, returns, mask, clip, agg, n):
  """Token terms from the formula, then the aggregation written out per mode."""
  B, T = mask.shape
  tok = np.zeros((B, T))
  grad = np.zeros((B, T))
  clipped = []
  for b, t in itertools.product(range(B), range(T)):
    if not mask[b, t]:
      continue
    v, o, r = values[b, t], old[b, t], returns[b, t]
    e1 = (v - r) ** 2
    vc = v if clip is None else min(max(v, o - clip), o + clip)
    e2 = (vc - r) ** 2
    tok[b, t] = max(e1, e2)
    clipped.append(e2 > e1)
    # the larger term's derivative; a clipped V (outside the range) has none
    grad[b, t] = 2 * (v - r) if e1 >= e2 else (2 * (vc - r) if vc == v else 0.0)
  w = np.zeros((B, T))
  for b, t in itertools.product(range(B), range(T)):
    if not mask[b, t]:
      continue
    row = mask[b].sum()
    if agg == "token_mean":
      w[b, t] = 1 / mask.sum()
    elif agg == "seq_mean_token_mean":
      w[b, t] = 1 / row / (mask.sum(1) > 0).sum()
    elif agg == "seq_mean_token_sum":
      w[b, t] = 1 / (mask.sum(1) > 0).sum()
    else:
      group = mask[b // n * n:(b // n + 1) * n].sum()
      groups = (mask.reshape(B // n, -1).sum(1) > 0).sum()
      w[b, t] = 1 / group / groups
  on = mask > 0
  metrics = {"value_loss": 0.5 * (w * tok).sum(), "value_clip_frac": np.mean(clipped),
             "value_mean": values[on].mean()}
  return metrics, 0.5 * w * grad


@pytest.mark.parametrize("agg, clip", list(itertools.product(AGGS, (0.5, None))))
def test_value_loss_and_gradient_match_reference(agg, clip):
  values, old, returns, mask = make_inputs(0)
  cfg = ValueConfig(cliprange_value=clip, value_coef=0.7)
  (loss, m), g = jax.value_and_grad(
      lambda v: value_loss(v, old, returns, mask, cfg, agg=agg, group_size=2),
      has_aux=True)(jnp.asarray(values))
  f64 = lambda x: np.nan_to_num(x.astype(np.float64))  # noqa: E731
  ref, ref_grad = np_value_loss(f64(values), f64(old), f64(returns), mask, clip, agg, 2)
  assert set(m) == set(ref)
  for k in ref:
    np.testing.assert_allclose(float(m[k]), ref[k], rtol=1e-5, atol=1e-7, err_msg=k)
  np.testing.assert_allclose(float(loss), 0.7 * ref["value_loss"], rtol=1e-5)
  np.testing.assert_allclose(np.asarray(g), 0.7 * ref_grad, rtol=1e-5, atol=1e-7)
  if clip is not None:  # the case is not vacuous: the clip binds on some tokens
    assert 0 < ref["value_clip_frac"] < 1


def test_micro_batches_add_up_to_the_batch():
  values, old, returns, mask = make_inputs(1, B=12)
  cfg = ValueConfig()
  weights = value_weights(mask, "prompt_mean", group_size=3)
  whole = weighted_value_loss(values, old, returns, mask, weights, cfg)[1]
  parts = [weighted_value_loss(values[i::4], old[i::4], returns[i::4], mask[i::4],
                               jax.tree.map(lambda w: w[i::4], weights), cfg)[1]
           for i in range(4)]
  for k, v in whole.items():
    np.testing.assert_allclose(sum(float(p[k]) for p in parts), float(v), rtol=1e-5,
                               err_msg=k)


def test_loss_gives_no_gradient_to_old_values_or_returns():
  values, old, returns, mask = make_inputs(2)
  values, old, returns = (np.nan_to_num(x) for x in (values, old, returns))
  g_old, g_ret = jax.grad(lambda o, r: value_loss(values, o, r, mask, ValueConfig())[0],
                          argnums=(0, 1))(jnp.asarray(old), jnp.asarray(returns))
  assert np.all(np.asarray(g_old) == 0) and np.all(np.asarray(g_ret) == 0)


@pytest.mark.parametrize("whiten_adv", [False, True])
def test_value_advantages_compose_rewards_estimator_and_whitening(whiten_adv):
  rng = np.random.default_rng(3)
  _, _, _, mask = make_inputs(3)
  values = rng.normal(size=mask.shape).astype(np.float32)
  rewards = rng.normal(size=mask.shape[0]).astype(np.float32)
  cfg = ValueConfig(gamma=0.9, lam=0.8, whiten=whiten_adv)
  adv, ret = value_advantages(rewards, values, mask, cfg, std_eps=1e-6)
  raw_adv, raw_ret = gae(final_token_rewards(rewards, mask), values, mask, gamma=0.9, lam=0.8)
  np.testing.assert_allclose(np.asarray(ret), np.asarray(raw_ret), rtol=1e-6)
  expected = whiten(raw_adv, mask, std_eps=1e-6) if whiten_adv else raw_adv
  np.testing.assert_allclose(np.asarray(adv), np.asarray(expected), rtol=1e-6)
  if whiten_adv:
    on = np.asarray(adv)[mask > 0]
    np.testing.assert_allclose([on.mean(), on.std(ddof=1)], [0.0, 1.0], atol=1e-5)


def test_advantages_and_returns_carry_no_gradient_into_values():
  # The policy loss reads the advantages and the value loss the returns: neither
  # may send gradient back into the critic through them.
  _, _, _, mask = make_inputs(6)
  rewards = np.linspace(-1, 1, mask.shape[0]).astype(np.float32)

  def both(v):
    adv, ret = value_advantages(rewards, v, mask, ValueConfig(gamma=0.9, lam=0.7))
    return jnp.sum(adv * 1.7 + ret * 0.3)

  g = jax.grad(both)(jnp.ones(mask.shape, jnp.float32))
  assert np.all(np.asarray(g) == 0)


def test_value_metrics_explained_variance():
  values, _, returns, mask = make_inputs(4)
  m = value_metrics(values, returns, mask)
  on = mask > 0
  v, r = values[on].astype(np.float64), returns[on].astype(np.float64)
  np.testing.assert_allclose(float(m["value_explained_var"]), 1 - np.var(r - v) / np.var(r),
                             rtol=1e-5)
  np.testing.assert_allclose(float(m["return_mean"]), r.mean(), rtol=1e-5)
  perfect = value_metrics(returns, returns, mask)["value_explained_var"]
  np.testing.assert_allclose(float(perfect), 1.0)
  flat = np.where(on, 1.0, 0.0)
  assert float(value_metrics(values, flat, mask)["value_explained_var"]) == 0.0


@pytest.mark.parametrize("field, value", [("gamma", 1.1), ("lam", -0.5),
                                          ("cliprange_value", 0.0), ("value_coef", 0.0),
                                          ("value_coef", float("inf")),
                                          ("critic_warmup", -1), ("critic_warmup", 1.5)])
def test_bad_config_names_the_field(field, value):
  with pytest.raises(ValueError, match=f"ValueConfig.{field}"):
    ValueConfig(**{field: value})


def test_bad_shapes_and_names():
  values, old, returns, mask = make_inputs(5)
  with pytest.raises(ValueError, match="returns_BxT has shape"):
    value_loss(values, old, returns[:, :-1], mask, ValueConfig())
  with pytest.raises(ValueError, match="unknown value estimator 'vtrace'"):
    value_advantages(np.zeros(8), values, mask, ValueConfig(), estimator="vtrace")
  with pytest.raises(ValueError, match="unknown aggregation 'mean'"):
    value_weights(mask, "mean")
