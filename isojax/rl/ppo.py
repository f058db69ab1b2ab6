"""PPO with a value model: one pure, jitted, sharded step for the policy and its critic.

    step = make_ppo_train_step(policy, critic, loss_cfg, value_cfg, optim_cfg, critic_optim,
                               batch_size=B, group_size=n, micro_batch_size=mb, mesh=mesh)
    state = init_ppo_train_state(policy, critic, loss_cfg, optim_cfg, critic_optim,
                                 batch_size=B, mesh=mesh)
    state, metrics = step(state, batch)      # same call shape as make_train_step's

``loss_cfg.adv_estimator`` names a value estimator (``isojax.rl.value``, "gae").
Inside the step (``isojax.rl.step``'s pieces where the logic is the same):
  1. the batch's aggregation weights (policy and value loss) in its prompt-major
     order (``_ppo_rows``), then the policy step's micro-batch layout
     (``step.micro_batches``: rows sorted by length, trimmed to a bucket);
  2. the critic's values of the whole batch, micro-batch by micro-batch without
     gradient (``_critic_values``): they are the baselines of GAE and the "old
     values" of the clipped value loss (every batch gets one update, so old =
     current critic);
  3. GAE advantages and returns over the whole batch (whitened if asked), with
     no host round trip. Rows are independent and whitening is a batch total,
     so this runs in the layout's row order (``_with_advantages``);
  4. gradient accumulation (``step.accumulate``) over micro-batches of policy
     loss (``step.micro_loss_fn``, per-token advantages) + value loss; the two
     parameter sets are disjoint, so each gets exactly its own loss's gradient;
  5. one AdamW update of each (``_guarded_joint_update``). While ``step <
     value_cfg.critic_warmup`` only the critic moves (policy parameters and
     moments untouched). If a loss, a gradient or an updated parameter of
     either is not finite, the whole state is returned unchanged and
     ``metrics["skipped"] = 1``.

The critic has its own optimiser config (``critic_optim``); the run derives it
from the policy's with the critic's own base learning rate, so the critic's
rate follows the same batch-size rule. The state (``PPOTrainState``, its
construction and abstract shapes) lives in ``isojax.rl.ppo_state``.
"""

from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from isojax import sharding as shd
from isojax.models.critic import Critic, critic_forward_flops, token_values
from isojax.rl import layout
from isojax.rl.advantages import zero_variance_groups
from isojax.rl.batch import Batch
from isojax.rl.losses import LossConfig, token_weights
from isojax.rl.optim import OptimConfig, lr_schedule
# The state's type and construction live beside the step; re-exported here.
from isojax.rl.ppo_state import (PPOTrainState, abstract_ppo_train_state,
                                 init_ppo_train_state, ppo_state_shardings)
from isojax.rl.state import TrainState, default_mesh
# PPO differs from the policy step in the values pass, per-token advantages, the
# joint update of two optimisers and critic warm-up; the rest is shared.
from isojax.rl.jitted import TrainStep, jit_step
from isojax.rl.step import (TrainRows, accumulate, batch_metrics, check_step_args,
                            micro_batches, micro_loss_fn)
from isojax.rl.value import (VALUE_ESTIMATORS, ValueConfig, ValueWeights, value_advantages,
                             value_metrics, value_weights, weighted_value_loss)

__all__ = ["PPOTrainState", "abstract_ppo_train_state", "critic_update_flops",
           "init_ppo_train_state", "make_ppo_train_step"]


def _check_ppo_args(loss_cfg: LossConfig, policy: nnx.Module, critic: Critic) -> None:
  """What PPO adds to ``make_train_step``'s checks: a value estimator, no group
  filter, a per-token policy loss, and a critic that embeds every token id the
  policy can emit."""
  # A Decoder has a cfg too, but its [B, T, V] logits are no values: without this
  # check the step would compile and fail in the values pass's padding.
  if not isinstance(critic, Critic):
    raise ValueError(f"critic is a {type(critic).__name__}, not an isojax.models.critic."
                     f"Critic; build one with init_critic_from(policy) or load_critic")
  v, pv = critic.cfg.vocab_size, policy.cfg.vocab_size
  if v < pv:  # the embedding lookup of a larger id gives NaN: every update skipped
    raise ValueError(f"the critic's vocab_size={v} is smaller than the policy's {pv}: a "
                     f"critic must read the policy's tokens (one tokenizer)")
  if loss_cfg.adv_estimator not in VALUE_ESTIMATORS:
    raise ValueError(f"LossConfig.adv_estimator={loss_cfg.adv_estimator!r} is not a value "
                     f"estimator; the PPO step takes one of {sorted(VALUE_ESTIMATORS)}")
  if loss_cfg.zero_var_filter != "off":
    raise ValueError(f"LossConfig.zero_var_filter={loss_cfg.zero_var_filter!r}: a critic's "
                     "advantages are not a group baseline's; use 'off' with PPO")
  if loss_cfg.kind == "gspo":  # its sequence ratio's gradient averages A_t over the tokens
    raise ValueError("LossConfig.kind='gspo' takes one advantage per sequence; a critic's "
                     "are per token and would be averaged over each sequence; use "
                     "'ppo_clip' or 'cispo' with PPO")


@flax.struct.dataclass
class PPORows(TrainRows):
  """``TrainRows`` plus the critic's side, in the same three layouts.

  PPO's advantages are per token and come from the critic's values, which need
  the micro-batch layout first: ``adv``, ``returns`` and ``old_values`` are
  [B, T]-like and zero until ``_with_advantages`` fills them.
  """

  rewards: jax.Array  # float32, one per row
  value_weights: ValueWeights
  returns: jax.Array
  old_values: jax.Array


def _ppo_rows(batch: Batch, loss_cfg: LossConfig, group_size: int) -> PPORows:
  """[B, T] rows with the whole-batch weights of both losses, in prompt-major order
  (prompt_mean reads it); zero_var_filter is "off", so no group is filtered."""
  mask_BxT = batch.loss_mask_BxT.astype(jnp.float32)
  zeros_BxT = jnp.zeros_like(mask_BxT)
  return PPORows(input_ids=batch.input_ids_BxT, attention_mask=batch.attention_mask_BxT,
                 loss_mask=mask_BxT, sampler_logp=batch.sampler_logp_BxT.astype(jnp.float32),
                 adv=zeros_BxT, weights=token_weights(mask_BxT, loss_cfg, group_size=group_size),
                 rewards=batch.rewards_B.astype(jnp.float32),
                 value_weights=value_weights(mask_BxT, loss_cfg.agg, group_size=group_size),
                 returns=zeros_BxT, old_values=zeros_BxT)


def _values_fn(graphdef, rest):
  """``(critic_params, rows [R, L]) -> values [R, L]`` of the critic."""
  def values(critic_params, rows: TrainRows):
    critic = nnx.merge(graphdef, critic_params, rest)
    return token_values(critic, rows.input_ids, rows.attention_mask)
  return values


def _flatten_micro(x):
  """[K, R, ...] -> [B, ...], rows in the layout's order."""
  return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _critic_values(values_fn, critic_params, micro: PPORows, bucket_K,
                   lengths: Sequence[int]):
  """The critic's values [B, T] of the laid-out batch, without gradient.

  Micro-batch by micro-batch (``lax.map``), each at its bucket's length and
  padded back to T, so the whole batch's values exist before any gradient.
  """
  width = lengths[-1]

  def at_length(length):
    return lambda rows: jnp.pad(values_fn(critic_params, rows.trimmed(length)),
                                ((0, 0), (0, width - length)))

  branches = [at_length(length) for length in lengths]

  def one(xs):
    rows, bucket = xs
    return branches[0](rows) if len(branches) == 1 else jax.lax.switch(bucket, branches, rows)

  return _flatten_micro(jax.lax.stop_gradient(jax.lax.map(one, (micro, bucket_K))))


def _with_advantages(micro: PPORows, values_BxT, loss_cfg: LossConfig,
                     value_cfg: ValueConfig, micro_sharding: NamedSharding) -> PPORows:
  """``micro`` with GAE's adv and returns of the whole batch, and ``values_BxT`` as old values.

  Rows are independent and whitening is a batch total, so the layout's row
  order serves; every batch gets one update, so the old values are the current
  critic's.
  """
  adv_BxT, returns_BxT = value_advantages(
      _flatten_micro(micro.rewards), values_BxT, _flatten_micro(micro.loss_mask), value_cfg,
      estimator=loss_cfg.adv_estimator, std_eps=loss_cfg.adv_std_eps)
  as_micro = jax.tree.map(
      lambda x: jax.lax.with_sharding_constraint(x.reshape(micro.loss_mask.shape),
                                                 micro_sharding),
      {"adv": adv_BxT, "returns": returns_BxT, "old_values": values_BxT})
  return micro.replace(**as_micro)


def _critic_batch_metrics(batch: Batch, rows: PPORows, micro: PPORows, positions,
                          group_size: int):
  """``step.batch_metrics`` of the batch, and the critic's values against the returns."""
  mask_BxT, adv_BxT = _flatten_micro(micro.loss_mask), _flatten_micro(micro.adv)
  zero_var_Bp = zero_variance_groups(rows.rewards, group_size=group_size)
  metrics = {**batch_metrics(batch, rows, zero_var_Bp, positions),
             # The advantages are per token, so their mean is over the trained tokens.
             "adv_abs_mean": jnp.sum(jnp.abs(adv_BxT)) / jnp.maximum(jnp.sum(mask_BxT), 1.0),
             **value_metrics(_flatten_micro(micro.old_values),
                             _flatten_micro(micro.returns), mask_BxT)}
  if group_size == 1:  # a group of one always "has equal rewards": no information
    del metrics["zero_var_frac"]
  return metrics


def _schedule_metrics(schedule, critic_schedule, warmup: int, step):
  """Both learning rates at ``step``; the policy's schedule starts after the warm-up."""
  return {"lr": jnp.asarray(schedule(jnp.maximum(step - warmup, 0)), jnp.float32),
          "critic_lr": jnp.asarray(critic_schedule(step), jnp.float32),
          "policy_frozen": (step < warmup).astype(jnp.float32)}


def _joint_micro_loss_fn(policy_loss, values_fn, value_cfg: ValueConfig):
  """``((params, critic_params), ref_params, rows [R, L]) -> (loss, metrics)``.

  The policy loss (``step.micro_loss_fn``, per-token advantages) plus the
  value loss. The two parameter sets are disjoint, so the gradient of the sum
  gives each exactly its own loss's gradient.
  """
  def micro_loss(params, ref_params, rows: PPORows):
    policy_params, critic_params = params
    pg, metrics = policy_loss(policy_params, ref_params, rows)
    vf, value_m = weighted_value_loss(values_fn(critic_params, rows), rows.old_values,
                                      rows.returns, rows.loss_mask, rows.value_weights,
                                      value_cfg)
    return pg + vf, {**metrics, **value_m}
  return micro_loss


def _probe_update(tx, grads, opt_state, params):
  """(norm of the update, whether params + update stay finite), nothing applied.

  ``step._guarded_update`` probes and applies one optimiser in one go; PPO needs
  the joint verdict of two before either applies. The verdict is a reduction
  XLA fuses with the update's arithmetic, so the real updates can then run
  under lax.cond in place in the donated buffers.
  """
  probe, _ = tx.update(grads, opt_state, params)
  finite = jax.tree.reduce(lambda a, x: a & jnp.all(jnp.isfinite(x)),
                           jax.tree.map(lambda p, u: p + u, params, probe), jnp.bool_(True))
  return optax.tree.norm(probe), finite


def _guarded_joint_update(tx, critic_tx, warmup: int, state: PPOTrainState, grads,
                          critic_grads, metrics):
  """Both AdamW updates, or ``state`` unchanged if a loss, a gradient or an updated
  parameter of either is not finite. While ``step < warmup`` only the critic moves,
  and only the critic's numbers must be finite (the frozen policy's are unused).

  Returns (new state, ok, norms: grad_norm, critic_grad_norm, update_norm,
  critic_update_norm; an update norm is 0 when that update did not apply).
  """
  grad_norm, critic_grad_norm = optax.tree.norm(grads), optax.tree.norm(critic_grads)
  update_norm, policy_finite = _probe_update(tx, grads, state.opt_state, state.params)
  critic_update_norm, critic_finite = _probe_update(
      critic_tx, critic_grads, state.critic_opt_state, state.critic_params)
  policy_on = state.step >= warmup
  policy_ok = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm) & policy_finite
  critic_ok = (jnp.isfinite(metrics["value_loss"]) & jnp.isfinite(critic_grad_norm)
               & critic_finite)
  ok = critic_ok & (policy_ok | ~policy_on)

  def update_policy(s: PPOTrainState) -> PPOTrainState:
    updates, opt_state = tx.update(grads, s.opt_state, s.params)
    return s.replace(params=optax.apply_updates(s.params, updates), opt_state=opt_state)

  def updated(s: PPOTrainState) -> PPOTrainState:
    updates, critic_opt = critic_tx.update(critic_grads, s.critic_opt_state, s.critic_params)
    s = s.replace(critic_params=optax.apply_updates(s.critic_params, updates),
                  critic_opt_state=critic_opt, step=s.step + 1)
    if warmup == 0:
      return update_policy(s)
    return jax.lax.cond(policy_on, update_policy, lambda x: x, s)

  norms = {"grad_norm": grad_norm, "critic_grad_norm": critic_grad_norm,
           "update_norm": jnp.where(ok & policy_on, update_norm, 0.0),
           "critic_update_norm": jnp.where(ok, critic_update_norm, 0.0)}
  return jax.lax.cond(ok, updated, lambda s: s, state), ok, norms


def _joint_gradients(micro_loss, state: PPOTrainState, micro: PPORows, bucket_K, lengths,
                     state_sharding):
  """Summed gradients of (policy, critic) in their parameter dtypes, and the metrics."""
  # ``step.accumulate`` differentiates ``params``: here the (policy, critic) pair.
  trainable = TrainState(params=(state.params, state.critic_params), opt_state=None,
                         step=state.step, ref_params=state.ref_params)
  (grads, critic_grads), metrics = accumulate(
      micro_loss, trainable, micro, bucket_K, lengths,
      (state_sharding.params, state_sharding.critic_params))
  # Back to the parameter dtypes so the optimiser states keep theirs.
  return (jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params),
          jax.tree.map(lambda g, p: g.astype(p.dtype), critic_grads, state.critic_params),
          metrics)


def make_ppo_train_step(policy: nnx.Module, critic: Critic, loss_cfg: LossConfig,
                        value_cfg: ValueConfig, optim_cfg: OptimConfig,
                        critic_optim: OptimConfig, *, batch_size: int, group_size: int,
                        micro_batch_size: int | None = None, mesh: Mesh | None = None,
                        rules=shd.DEFAULT_RULES, logits_chunk: int | None = None,
                        temperature: float = 1.0,
                        length_buckets: int | Sequence[int] = layout.DEFAULT_BUCKETS,
                        donate: bool = True) -> TrainStep:
  """Build the jitted, sharded joint PPO step (policy + critic).

  Args as ``isojax.rl.make_train_step``'s, plus ``critic`` (its graph and
  parameter shapes), ``value_cfg`` (GAE, whitening, the clipped value loss,
  critic warm-up) and ``critic_optim`` (the critic's AdamW). group_size may be 1.

  Returns:
    A ``TrainStep`` over ``PPOTrainState``. Metrics: the policy loss metrics of
    ``isojax.rl.losses`` but the ratio metrics (identically 0: one update per
    batch, as ``make_train_step``), value_loss / value_clip_frac / value_mean,
    value_explained_var / return_mean (of the values the advantages came from),
    zero_var_frac (groups whose rewards are all equal; n > 1 only), reward_mean,
    adv_abs_mean (token mean), tokens, pad_fraction, grad_norm and
    critic_grad_norm (before clipping), update_norm and critic_update_norm, lr
    and critic_lr, policy_frozen (1 during critic warm-up) and skipped.
  """
  mesh = default_mesh(mesh)
  rows_per_micro = batch_size if micro_batch_size is None else micro_batch_size
  _check_ppo_args(loss_cfg, policy, critic)
  # On-policy: the critic's step takes no stale batches.
  check_step_args(batch_size=batch_size, group_size=group_size,
                  rows_per_micro=rows_per_micro, mesh=mesh, temperature=temperature,
                  length_buckets=length_buckets, old_logp="current")
  n_micro = batch_size // rows_per_micro
  state_shapes, state_sh, (tx, critic_tx, _) = ppo_state_shardings(
      policy, critic, loss_cfg, optim_cfg, critic_optim, batch_size, mesh, rules)
  schedule = lr_schedule(optim_cfg, batch_size)
  critic_schedule = lr_schedule(critic_optim, batch_size)
  graphdef, _, rest = nnx.split(policy, nnx.Param, ...)
  critic_graphdef, _, critic_rest = nnx.split(critic, nnx.Param, ...)
  policy_loss = micro_loss_fn(graphdef, rest, loss_cfg, logits_chunk=logits_chunk,
                              temperature=temperature, old_logp="current")
  values_fn = _values_fn(critic_graphdef, critic_rest)
  micro_loss = _joint_micro_loss_fn(policy_loss, values_fn, value_cfg)
  warmup = value_cfg.critic_warmup
  micro_sh = NamedSharding(mesh, PartitionSpec(None, shd.BATCH_AXES))

  def step(state: PPOTrainState, batch: Batch):
    # The mesh as context, so the models' activation constraints resolve in the trace.
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      rows = _ppo_rows(batch, loss_cfg, group_size)
      lengths = layout.bucket_lengths(batch.input_ids_BxT.shape[1], length_buckets)
      micro, bucket_K = micro_batches(rows, lengths, n_micro, micro_sh)
      values_BxT = _critic_values(values_fn, state.critic_params, micro, bucket_K, lengths)
      micro = _with_advantages(micro, values_BxT, loss_cfg, value_cfg, micro_sh)
      grads, critic_grads, metrics = _joint_gradients(micro_loss, state, micro, bucket_K,
                                                      lengths, state_sh)
      new_state, ok, norms = _guarded_joint_update(tx, critic_tx, warmup, state, grads,
                                                   critic_grads, metrics)
      positions = rows_per_micro * jnp.sum(jnp.asarray(lengths)[bucket_K])
      metrics.update(_critic_batch_metrics(batch, rows, micro, positions, group_size),
                     **norms, **_schedule_metrics(schedule, critic_schedule, warmup,
                                                  state.step),
                     skipped=1.0 - ok.astype(jnp.float32))
      return new_state, metrics

  return jit_step(step, state_shapes, state_sh, mesh, batch_size=batch_size,
                  group_size=group_size, micro_batch_size=rows_per_micro,
                  vocab_size=policy.cfg.vocab_size, donate=donate)


def critic_update_flops(cfg, attention_mask_BxT) -> int:
  """The critic's FLOPs in one PPO update of a batch (host side, for the ledger).

  Four forwards' worth over the real tokens (``critic_forward_flops``): the
  values pass, the loss's forward and its backward (about two forwards).
  """
  return 4 * critic_forward_flops(cfg, attention_mask_BxT)
