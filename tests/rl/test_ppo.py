"""The joint PPO step: micro-batch and mesh invariance, gradients kept apart, critic
warm-up, the zero-critic case against reward-to-go policy gradients, a learned critic
against GAE from its definition, skipping, and a stored one-step regression.

Parameter deltas expose gradients: with SGD_LIKE (Adam's first step with lr = eps =
1e5) an update is -gradient to ~1e-5 relative, for the policy and the critic alike.
Every step here is compiled once per module (compiles are the cost).
"""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from isojax import sharding as shd
from isojax.models import Decoder
from isojax.models.critic import Critic, critic_forward_flops, init_critic_from
from isojax.rl import LossConfig, OptimConfig
from isojax.rl.logprobs import token_logp_entropy
from isojax.rl.losses import RATIO_METRICS, policy_loss
from isojax.rl.ppo import abstract_ppo_train_state, critic_update_flops, init_ppo_train_state
from isojax.rl.ppo import make_ppo_train_step
from isojax.rl.value import ValueConfig
from tests.rl.test_step import B, N, SGD_LIKE, assert_trees_close, make_batch, tiny_config

LOSS = LossConfig(kind="ppo_clip", agg="token_mean", adv_estimator="gae", kl_coef=0.0,
                  entropy_coef=0.0, tis_cap=None)
# Zero critic, gamma = lam = 1, no whitening: every token's advantage is its row's reward.
VALUE = ValueConfig(gamma=1.0, lam=1.0, whiten=False, cliprange_value=0.5)
# Rewards with a nonzero mean, so a zero critic's value loss has a gradient.
REWARDS = (1, 0, 0, 1, 1, 1, 0, 1)


@pytest.fixture(scope="module")
def models():
  policy = Decoder(tiny_config(), rngs=nnx.Rngs(0))
  return policy, init_critic_from(policy, rngs=nnx.Rngs(1))


def build(models, *, loss=LOSS, value=VALUE, micro=B, mesh=None, buckets=1):
  policy, critic = models
  return make_ppo_train_step(policy, critic, loss, value, SGD_LIKE, SGD_LIKE, batch_size=B,
                             group_size=N, micro_batch_size=micro, mesh=mesh,
                             length_buckets=buckets)


def run(models, step, *, loss=LOSS, mesh=None, rewards=REWARDS):
  """One update from a fresh state: (policy delta, critic delta, metrics, new state)."""
  policy, critic = models
  state = init_ppo_train_state(policy, critic, loss, SGD_LIKE, SGD_LIKE, batch_size=B,
                               mesh=mesh)
  before = jax.tree.map(np.asarray, (state.params, state.critic_params))
  new, metrics = step(state, make_batch(rewards=rewards))
  after = jax.tree.map(np.asarray, (new.params, new.critic_params))
  delta = jax.tree.map(lambda a, b: a - b, after, before)
  return delta[0], delta[1], {k: float(v) for k, v in metrics.items()}, new


@pytest.fixture(scope="module")
def base_step(models):
  return build(models)


@pytest.fixture(scope="module")
def base_run(models, base_step):
  return run(models, base_step)


def scale_of(tree):
  return max(np.abs(x).max() for x in jax.tree.leaves(tree))


def test_zero_critic_policy_gradient_is_the_reward_to_go_one(models, base_run):
  policy, _ = models
  d_policy, d_critic, metrics, new = base_run
  batch = make_batch(rewards=REWARDS)
  graphdef, params = nnx.split(policy, nnx.Param)

  def loss_fn(p):
    lp, _ = token_logp_entropy(nnx.merge(graphdef, p), batch.input_ids_BxT,
                               batch.attention_mask_BxT, batch.loss_mask_BxT)
    # Outcome reward, gamma = 1: every token's reward-to-go is its row's reward.
    return policy_loss(lp, jax.lax.stop_gradient(lp), batch.rewards_B, batch.loss_mask_BxT,
                       LOSS)[0]

  grads = jax.tree.map(np.asarray, jax.jit(jax.grad(loss_fn))(params))
  scale = scale_of(grads)
  assert scale > 1e-3
  assert_trees_close(jax.tree.map(lambda d: -d, d_policy), grads, atol=2e-5 * scale, rtol=1e-3)
  assert scale_of(d_critic) > 1e-3  # the critic learned too
  assert metrics["value_mean"] == 0 and metrics["skipped"] == 0
  assert metrics["return_mean"] == pytest.approx(24 / 35)  # token mean of the rewards
  assert metrics["value_explained_var"] == 0 and metrics["policy_frozen"] == 0
  assert int(new.step) == 1
  # One update per batch: the ratio metrics are identically 0 and not reported.
  assert not set(RATIO_METRICS) & set(metrics)


def test_length_sorted_micro_batches_of_two_equal_the_full_batch(models, base_run):
  # Row lengths 4..12: the micro-batches of 2 run at lengths 6, 9, 12 and 12, the
  # critic's values of the batch too.
  d_policy, d_critic, metrics, _ = base_run
  p2, c2, m2, _ = run(models, build(models, micro=2, buckets=(6, 9)))
  assert_trees_close(p2, d_policy, atol=2e-5 * scale_of(d_policy), rtol=1e-3)
  assert_trees_close(c2, d_critic, atol=2e-5 * scale_of(d_critic), rtol=1e-3)
  for k in ("loss", "value_loss", "tokens", "value_explained_var"):
    np.testing.assert_allclose(m2[k], metrics[k], rtol=1e-5, atol=1e-7, err_msg=k)
  assert m2["pad_fraction"] < metrics["pad_fraction"]  # trimmed to the buckets


def test_value_loss_reaches_only_the_critic(models, base_run):
  # Tripling the value-loss coefficient triples the critic's gradient and leaves
  # the policy's untouched.
  d_policy, d_critic, _, _ = base_run
  p3, c3, _, _ = run(models, build(models, value=dataclasses.replace(VALUE, value_coef=3.0)))
  assert_trees_close(p3, d_policy, atol=1e-6 * scale_of(d_policy), rtol=1e-5)
  assert_trees_close(c3, jax.tree.map(lambda d: 3 * d, d_critic),
                     atol=2e-5 * scale_of(c3), rtol=1e-3)


# Critic warm-up with a different policy loss (an entropy bonus), one compile for
# both warm-up tests.
WARMUP_LOSS = dataclasses.replace(LOSS, entropy_coef=0.5)


@pytest.fixture(scope="module")
def warmup_step(models):
  return build(models, loss=WARMUP_LOSS, value=dataclasses.replace(VALUE, critic_warmup=1))


def test_warmup_freezes_the_policy_and_policy_loss_stays_out_of_the_critic(models, base_run,
                                                                           warmup_step):
  # A different policy loss (entropy bonus) during critic warm-up: the policy and
  # its optimiser do not move, the critic moves exactly as without either change.
  _, d_critic, _, _ = base_run
  p, c, metrics, new = run(models, warmup_step, loss=WARMUP_LOSS)
  assert all(np.all(x == 0) for x in jax.tree.leaves(p))
  assert int(jax.tree.leaves(new.opt_state)[0]) == 0  # the policy's Adam count
  assert_trees_close(c, d_critic, atol=1e-6 * scale_of(d_critic), rtol=1e-5)
  assert metrics["policy_frozen"] == 1 and metrics["update_norm"] == 0
  assert int(new.step) == 1


def test_warmup_updates_the_critic_whatever_the_frozen_policy_computes(models, base_run,
                                                                      warmup_step):
  # A NaN weight makes the policy's loss and gradient NaN; the critic's are finite.
  # During warm-up the policy's numbers are unused: the critic moves as without it.
  _, d_critic, _, _ = base_run
  policy, critic = models
  state = init_ppo_train_state(policy, critic, WARMUP_LOSS, SGD_LIKE, SGD_LIKE, batch_size=B)
  first_down = lambda path: jax.tree_util.keystr(path).startswith(
      "['layers'][0]['mlp']['down_kernel']")
  state = state.replace(params=jax.tree_util.tree_map_with_path(
      lambda path, x: x.at[0, 0].set(np.nan) if first_down(path) else x, state.params))
  before = jax.tree.map(np.asarray, (state.params, state.critic_params))
  new, metrics = warmup_step(state, make_batch(rewards=REWARDS))
  assert np.isnan(float(metrics["loss"])) and metrics["skipped"] == 0
  assert metrics["policy_frozen"] == 1 and int(new.step) == 1
  assert_trees_close(jax.tree.map(lambda a, b: np.asarray(a) - b, new.critic_params, before[1]),
                     d_critic, atol=1e-6 * scale_of(d_critic), rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), new.params,
               before[0])  # NaN included


def test_non_finite_update_is_skipped(models, base_step):
  # Finite rewards whose squared error overflows float32: the value loss is inf.
  p, c, metrics, new = run(models, base_step, rewards=(3e38,) * 4 + (0,) * 4)
  assert metrics["skipped"] == 1 and int(new.step) == 0
  assert all(np.all(x == 0) for x in jax.tree.leaves((p, c)))


def test_8_device_mesh_equals_one_device(models, base_run):
  d_policy, d_critic, metrics, _ = base_run
  mesh = shd.make_mesh(data=2, fsdp=4, tensor=1)
  p8, c8, m8, new = run(models, build(models, mesh=mesh), mesh=mesh)
  assert_trees_close(p8, d_policy, atol=2e-5 * scale_of(d_policy), rtol=1e-3)
  assert_trees_close(c8, d_critic, atol=2e-5 * scale_of(d_critic), rtol=1e-3)
  np.testing.assert_allclose(m8["value_loss"], metrics["value_loss"], rtol=1e-5)
  embed = new.critic_params["trunk"]["embed"]
  assert len(embed.sharding.device_set) == 8  # sharded like the policy


def test_bad_configs_are_named(models):
  with pytest.raises(ValueError, match="adv_estimator='grpo' is not a value estimator"):
    build(models, loss=dataclasses.replace(LOSS, adv_estimator="grpo"))
  with pytest.raises(ValueError, match="zero_var_filter='all'"):
    build(models, loss=dataclasses.replace(LOSS, zero_var_filter="all"))
  with pytest.raises(ValueError, match="kind='gspo' takes one advantage per sequence"):
    build(models, loss=dataclasses.replace(LOSS, kind="gspo"))
  policy, _ = models
  # A critic checkpoint of another tokenizer: ids past its embedding read as NaN.
  small, large = (nnx.eval_shape(lambda v=v: Critic(tiny_config(vocab_size=v), rngs=nnx.Rngs(1)))
                  for v in (32, 96))
  with pytest.raises(ValueError, match="critic's vocab_size=32 is smaller than the policy's 64"):
    build((policy, small))
  # The policy (or any Decoder) passed as the critic: its logits are no values.
  with pytest.raises(ValueError, match="critic is a Decoder, not an isojax.models.critic.Critic"):
    build((policy, policy))
  step = build((policy, large))  # a larger (padded) embedding reads every id
  assert step.vocab_size == 64  # but batches are checked against the policy's


def test_abstract_state_has_the_real_states_shapes_and_shardings(models):
  policy, critic = models
  mesh = shd.make_mesh(data=1, fsdp=8, tensor=1)
  kl = dataclasses.replace(LOSS, kl_coef=0.1)  # with reference parameters
  real = init_ppo_train_state(policy, critic, kl, SGD_LIKE, SGD_LIKE, batch_size=B, mesh=mesh)
  shapes = abstract_ppo_train_state(nnx.eval_shape(lambda: policy), nnx.eval_shape(
      lambda: critic), kl, SGD_LIKE, SGD_LIKE, batch_size=B, mesh=mesh)
  pairs = list(zip(jax.tree.leaves(real), jax.tree.leaves(shapes), strict=True))
  assert real.ref_params is not None and len(pairs) > 40
  for x, s in pairs:
    assert (x.shape, x.dtype, x.sharding) == (s.shape, s.dtype, s.sharding)


def test_critic_update_costs_four_forwards(models):
  _, critic = models
  mask = make_batch().attention_mask_BxT
  assert critic_update_flops(critic.cfg, mask) == 4 * critic_forward_flops(critic.cfg, mask)


# One PPO step on a fixed policy (nnx.Rngs(0)), critic (nnx.Rngs(1)) and batch, with
# KL, entropy, whitening, value clipping and two length-sorted micro-batches; both
# models perturbed, so the critic's values and the KL to the reference are not 0. Recorded
# once on jax 0.10.2 / flax 0.12.8, CPU; update these only for an intended change.
PPO_REGRESSION = {
    "loss": 0.009727167896926403, "value_loss": 0.19386808574199677,
    "grad_norm": 0.28884994983673096, "critic_grad_norm": 2.289799213409424,
    "update_norm": 0.0012734958436340094, "critic_update_norm": 0.0037345816381275654,
    "entropy": 4.103166580200195, "kl_ref": 0.0546131506562233,
    "value_explained_var": -0.922167181968689, "adv_abs_mean": 0.9122685194015503,
    "pad_fraction": 0.238095223903656}


def perturbed(params, seed):
  """``params`` plus 0.05-scale Gaussian noise, on the same devices."""
  keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(params))))
  noisy = jax.tree.map(lambda p: p + 0.05 * jax.random.normal(next(keys), p.shape), params)
  return jax.device_put(noisy, jax.tree.map(lambda p: p.sharding, params))


def test_one_step_regression(models):
  policy, critic = models
  loss_cfg = dataclasses.replace(LOSS, clip_high=0.28, kl_coef=1e-3, entropy_coef=1e-3,
                                 tis_cap=2.0)
  value_cfg = ValueConfig(gamma=1.0, lam=0.95, whiten=True, cliprange_value=0.2)
  optim_cfg = OptimConfig(lr_base=1e-3, batch_base=1024)
  critic_optim = OptimConfig(lr_base=3e-3, batch_base=1024)
  step = make_ppo_train_step(policy, critic, loss_cfg, value_cfg, optim_cfg, critic_optim,
                             batch_size=B, group_size=N, micro_batch_size=4,
                             length_buckets=(9,))  # rows 4 6 6 7 | 7 11 11 12: at 9 and 12
  state = init_ppo_train_state(policy, critic, loss_cfg, optim_cfg, critic_optim,
                               batch_size=B)
  state = state.replace(params=perturbed(state.params, 1),
                        critic_params=perturbed(state.critic_params, 2))
  new, metrics = step(state, make_batch(seed=3, rewards=(1, 0, 1, 0, 0, 0, 1, 0)))
  got = {k: float(metrics[k]) for k in (
      "loss", "value_loss", "grad_norm", "critic_grad_norm", "update_norm",
      "critic_update_norm", "entropy", "kl_ref", "value_explained_var", "adv_abs_mean",
      "pad_fraction")}
  print("regression numbers:", repr(got))
  assert int(new.step) == 1 and metrics["skipped"] == 0
  assert set(got) == set(PPO_REGRESSION)
  # The numbers were pinned on one CPU; XLA's kernels sum in another order on
  # another (a few float32 ulps, which the loss, a difference of terms, turns
  # into ~2e-6). A change to the step's arithmetic moves them far more than 1e-5.
  for k, v in PPO_REGRESSION.items():
    np.testing.assert_allclose(got[k], v, rtol=1e-5, err_msg=k)


def numpy_gae(rewards_B, values_BxT, mask_BxT, gamma, lam):
  """A_t = sum_l (gamma lam)^l delta_{t+l} over each row's trained tokens, from the
  definition; the reward on the last one, V = 0 after it. (advantages, returns)."""
  adv, ret = np.zeros(mask_BxT.shape), np.zeros(mask_BxT.shape)
  for b in range(mask_BxT.shape[0]):
    cols = np.flatnonzero(mask_BxT[b])
    r = np.zeros(len(cols))
    r[-1:] = rewards_B[b]
    v = values_BxT[b, cols]
    delta = r + gamma * np.append(v[1:], 0.0) - v
    a = [sum((gamma * lam) ** l * delta[i + l] for l in range(len(cols) - i))
         for i in range(len(cols))]
    adv[b, cols], ret[b, cols] = a, np.asarray(a) + v
  return adv, ret


def test_learned_critic_step_matches_gae_from_the_definition(models):
  # A critic with a nonzero head, gamma and lam < 1, whitening, length-sorted
  # micro-batches of two: the update against one computed on the batch as given,
  # the value of token t read at position t - 1 of the critic's full forward.
  policy, _ = models
  critic = init_critic_from(policy, rngs=nnx.Rngs(1), head_std=1.0)
  value_cfg = ValueConfig(gamma=0.9, lam=0.8, whiten=True, cliprange_value=0.5)
  rewards = (1.0, -0.5, 0.3, 2.0, 0.0, 1.5, -1.0, 0.7)
  batch = make_batch(rewards=rewards)
  mask = np.asarray(batch.loss_mask_BxT)
  v_full = np.asarray(critic(batch.input_ids_BxT, attention_mask=batch.attention_mask_BxT))
  values = np.concatenate([np.zeros((B, 1)), v_full[:, :-1]], axis=1)
  adv, ret = numpy_gae(np.asarray(rewards), values, mask, 0.9, 0.8)
  on = adv[mask > 0]
  adv = np.where(mask > 0, (adv - on.mean()) / (on.std(ddof=1) + LOSS.adv_std_eps), 0.0)
  graphdef, params = nnx.split(policy, nnx.Param)
  critic_graphdef, critic_params = nnx.split(critic, nnx.Param)

  def policy_loss_fn(p):  # on-policy ppo_clip, token mean: -sum(A logp) / tokens
    lp, _ = token_logp_entropy(nnx.merge(graphdef, p), batch.input_ids_BxT,
                               batch.attention_mask_BxT, batch.loss_mask_BxT)
    return -np.float32(1 / mask.sum()) * jax.numpy.sum(mask * adv * lp)

  def value_loss_fn(p):  # the clip cannot bind: old values are the current ones
    v = nnx.merge(critic_graphdef, p)(batch.input_ids_BxT,
                                      attention_mask=batch.attention_mask_BxT)
    v = jax.numpy.concatenate([jax.numpy.zeros_like(v[:, :1]), v[:, :-1]], axis=1)
    return 0.5 * jax.numpy.sum(mask * (v - ret) ** 2) / mask.sum()

  step = make_ppo_train_step(policy, critic, LOSS, value_cfg, SGD_LIKE, SGD_LIKE,
                             batch_size=B, group_size=N, micro_batch_size=2,
                             length_buckets=(6, 9))
  state = init_ppo_train_state(policy, critic, LOSS, SGD_LIKE, SGD_LIKE, batch_size=B)
  before = jax.tree.map(np.asarray, (state.params, state.critic_params))
  new, metrics = step(state, batch)
  for fn, p, got, was in ((policy_loss_fn, params, new.params, before[0]),
                          (value_loss_fn, critic_params, new.critic_params, before[1])):
    grads = jax.tree.map(np.asarray, jax.jit(jax.grad(fn))(p))
    # Adam's first step exactly: -lr * g / (|g| + eps), lr = eps = 1e5.
    want = jax.tree.map(lambda g: -1e5 * g / (np.abs(g) + 1e5), grads)
    assert_trees_close(jax.tree.map(lambda a, b: np.asarray(a) - b, got, was), want,
                       atol=2e-5 * scale_of(want), rtol=1e-3)
  np.testing.assert_allclose(float(metrics["value_loss"]), float(value_loss_fn(critic_params)),
                             rtol=1e-5)
