"""PPO with a value model: one pure, jitted, sharded step for the policy and its critic.

    step = make_ppo_train_step(policy, critic, loss_cfg, value_cfg, optim_cfg, critic_optim,
                               batch_size=B, group_size=n, micro_batch_size=mb, mesh=mesh)
    state = init_ppo_train_state(policy, critic, loss_cfg, optim_cfg, critic_optim,
                                 batch_size=B, mesh=mesh)
    state, metrics = step(state, batch)      # same call shape as make_train_step's

``loss_cfg.adv_estimator`` names a value estimator (``isojax.rl.value``, "gae").
Inside the step:
  1. the batch's aggregation weights (policy and value loss) in its prompt-major
     order, then the micro-batch layout of ``isojax.rl.layout`` (rows
     left-aligned, sorted by length, trimmed to a bucket);
  2. the critic's values of the whole batch, micro-batch by micro-batch without
     gradient: they are the baselines of GAE and the "old values" of the clipped
     value loss (every batch gets one update, so old = current critic);
  3. GAE advantages and returns over the whole batch (whitened if asked), with
     no host round trip. Rows are independent and whitening is a batch total,
     so this runs in the layout's row order;
  4. gradient accumulation over micro-batches of policy loss (per-token
     advantages) + value loss; the two parameter sets are disjoint, so each
     gets exactly its own loss's gradient;
  5. one AdamW update of each. While ``step < value_cfg.critic_warmup`` only
     the critic moves (policy parameters and moments untouched). If a loss, a
     gradient or an updated parameter of either is not finite, the whole state
     is returned unchanged and ``metrics["skipped"] = 1``.

The critic has its own optimiser config (``critic_optim``); the run derives it
from the policy's with the critic's own base learning rate, so the critic's
rate follows the same batch-size rule.
"""

from typing import Any, Sequence

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
from isojax.rl.aggregation import TokenWeights
from isojax.rl.logprobs import token_logp_entropy
from isojax.rl.losses import MAX_METRICS, LossConfig, token_weights, weighted_policy_loss
from isojax.rl.optim import OptimConfig, lr_schedule, make_optimizer
from isojax.rl.step import Batch, TrainStep
from isojax.rl.value import (VALUE_ESTIMATORS, ValueConfig, ValueWeights, value_advantages,
                             value_metrics, value_weights, weighted_value_loss)

__all__ = ["PPOTrainState", "abstract_ppo_train_state", "critic_update_flops",
           "init_ppo_train_state", "make_ppo_train_step"]


@flax.struct.dataclass
class PPOTrainState:
  """Everything a PPO update changes. ``ref_params`` is None unless kl_coef > 0.

  ``step`` counts applied (not skipped) updates, critic warm-up included.
  """

  params: Any  # the policy's nnx.Param state
  opt_state: Any
  critic_params: Any  # the critic's nnx.Param state (trunk + value head)
  critic_opt_state: Any
  step: jax.Array  # int32
  ref_params: Any = None


def _fresh_state(params, critic_params, tx, critic_tx, with_ref):
  return PPOTrainState(params=params, opt_state=tx.init(params), critic_params=critic_params,
                       critic_opt_state=critic_tx.init(critic_params),
                       step=jnp.zeros((), jnp.int32),
                       ref_params=jax.tree.map(jnp.copy, params) if with_ref else None)


def _mesh_or_one_device(mesh):
  return mesh if mesh is not None else shd.make_mesh(devices=jax.devices()[:1])


def _shapes_and_shardings(policy, critic, loss_cfg, optim_cfg, critic_optim, batch_size,
                          mesh, rules):
  tx = make_optimizer(optim_cfg, batch_size=batch_size)
  critic_tx = make_optimizer(critic_optim, batch_size=batch_size)
  with_ref = loss_cfg.kl_coef > 0
  shapes = jax.eval_shape(lambda p, c: _fresh_state(p, c, tx, critic_tx, with_ref),
                          nnx.state(policy, nnx.Param), nnx.state(critic, nnx.Param))
  return shapes, shd.state_shardings(shapes, mesh, rules), (tx, critic_tx, with_ref)


def init_ppo_train_state(policy: nnx.Module, critic: Critic, loss_cfg: LossConfig,
                         optim_cfg: OptimConfig, critic_optim: OptimConfig, *,
                         batch_size: int, mesh: Mesh | None = None,
                         rules=shd.DEFAULT_RULES) -> PPOTrainState:
  """Fresh optimiser states around copies of both models' parameters, on ``mesh``.

  The models stay usable (the step donates the state's copies).
  """
  mesh = _mesh_or_one_device(mesh)
  _, shardings, (tx, critic_tx, with_ref) = _shapes_and_shardings(
      policy, critic, loss_cfg, optim_cfg, critic_optim, batch_size, mesh, rules)
  params = jax.device_put(nnx.state(policy, nnx.Param), shardings.params, may_alias=False)
  critic_params = jax.device_put(nnx.state(critic, nnx.Param), shardings.critic_params,
                                 may_alias=False)
  return jax.device_put(_fresh_state(params, critic_params, tx, critic_tx, with_ref),
                        shardings, may_alias=False)


def abstract_ppo_train_state(policy: nnx.Module, critic: Critic, loss_cfg: LossConfig,
                             optim_cfg: OptimConfig, critic_optim: OptimConfig, *,
                             batch_size: int, mesh: Mesh | None = None,
                             rules=shd.DEFAULT_RULES) -> PPOTrainState:
  """``init_ppo_train_state``'s result as sharded ``jax.ShapeDtypeStruct`` leaves.

  Both models may come from ``nnx.eval_shape``; the result feeds ``TrainStep.lower``.
  """
  shapes, shardings, _ = _shapes_and_shardings(
      policy, critic, loss_cfg, optim_cfg, critic_optim, batch_size,
      _mesh_or_one_device(mesh), rules)
  # Flat leaves: the shapes hold nnx Variables where the shardings hold NamedShardings.
  leaves, treedef = jax.tree.flatten(shapes)
  return jax.tree.unflatten(treedef, [
      jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
      for x, sh in zip(leaves, jax.tree.leaves(shardings), strict=True)])


def _check_sizes(loss_cfg, batch_size, group_size, mb, shards, mesh, temperature):
  if loss_cfg.adv_estimator not in VALUE_ESTIMATORS:
    raise ValueError(f"LossConfig.adv_estimator={loss_cfg.adv_estimator!r} is not a value "
                     f"estimator; the PPO step takes one of {sorted(VALUE_ESTIMATORS)}")
  if loss_cfg.zero_var_filter != "off":
    raise ValueError(f"LossConfig.zero_var_filter={loss_cfg.zero_var_filter!r}: a critic's "
                     "advantages are not a group baseline's; use 'off' with PPO")
  if batch_size % group_size:
    raise ValueError(f"group_size={group_size} does not divide batch_size={batch_size}")
  if mb < 1 or batch_size % mb:
    raise ValueError(f"micro_batch_size={mb} does not divide batch_size={batch_size}")
  if mb % shards:
    raise ValueError(f"micro_batch_size={mb} is not divisible by the {shards} batch "
                     f"shards (data x fsdp) of the mesh {dict(mesh.shape)}")
  if not temperature > 0:
    raise ValueError(f"temperature={temperature}: the trainer scores rollouts under "
                     "softmax(logits / temperature); greedy (0) rollouts cannot be trained on")


def _micro_layout(data, attn_BxT, lengths, mb, n_micro, micro_sh):
  """[B, ...] leaves -> [n_micro, mb, ...] micro-batches and each one's bucket index.

  One bucket: micro-batch i = rows i, i + n_micro, ... (spread over the devices
  without communication). Several: rows left-aligned and sorted by length,
  micro-batch i = sorted rows [i mb, (i+1) mb).
  """
  def place(x, shape):
    return jax.lax.with_sharding_constraint(x.reshape(shape), micro_sh)

  if len(lengths) == 1:
    micro = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(
        x.reshape(mb, n_micro, *x.shape[1:]).swapaxes(0, 1), micro_sh), data)
    return micro, jnp.zeros((n_micro,), jnp.int32)
  data, length_B = layout.left_align(data, attn_BxT)
  data, length_B = layout.sort_by_length(data, length_B)
  micro = jax.tree.map(lambda x: place(x, (n_micro, mb, *x.shape[1:])), data)
  longest_M = length_B.reshape(n_micro, mb)[:, -1]
  return micro, jnp.searchsorted(jnp.asarray(lengths), longest_M)


def _trim(mb_, length):
  return jax.tree.map(lambda x: x[:, :length] if x.ndim == 2 else x, mb_)


def _bucketed(fn, lengths):
  """``(args..., mb_, bucket) -> fn(length, args..., mb_ trimmed to length)``.

  The bucket index (traced) picks the length with ``lax.switch``; each length is
  compiled once.
  """
  def at(length):
    return lambda *args: fn(length, *args[:-1], _trim(args[-1], length))

  branches = [at(n) for n in lengths]

  def run(*args):
    *args, bucket = args
    if len(branches) == 1:
      return branches[0](*args)
    return jax.lax.switch(bucket, branches, *args)

  return run


def _flatten_micro(x):
  """[n_micro, mb, ...] -> [B, ...], rows in the layout's order."""
  return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _combine(acc, new):
  return {k: jnp.maximum(acc[k], v) if k in MAX_METRICS else acc[k] + v
          for k, v in new.items()}


def _probe_update(tx, grads, opt_state, params):
  """(norm of the update, whether params + update stay finite), nothing applied.

  The verdict is a reduction XLA fuses with the update's arithmetic, so the real
  update can then run under lax.cond in place in the donated buffers.
  """
  probe, _ = tx.update(grads, opt_state, params)
  finite = jax.tree.reduce(lambda a, x: a & jnp.all(jnp.isfinite(x)),
                           jax.tree.map(lambda p, u: p + u, params, probe), jnp.bool_(True))
  return optax.tree.norm(probe), finite


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
    ``isojax.rl.losses``, value_loss / value_clip_frac / value_mean,
    value_explained_var / return_mean (of the values the advantages came from),
    zero_var_frac (groups whose rewards are all equal), reward_mean,
    adv_abs_mean (token mean), tokens, pad_fraction, grad_norm and
    critic_grad_norm (before clipping), update_norm and critic_update_norm, lr
    and critic_lr, policy_frozen (1 during critic warm-up) and skipped.
  """
  mesh = _mesh_or_one_device(mesh)
  mb = batch_size if micro_batch_size is None else micro_batch_size
  shards = mesh.shape["data"] * mesh.shape["fsdp"]
  _check_sizes(loss_cfg, batch_size, group_size, mb, shards, mesh, temperature)
  layout.bucket_lengths(1, length_buckets)  # a bad value fails here, not at trace time
  n_micro = batch_size // mb
  _, state_sh, (tx, critic_tx, with_ref) = _shapes_and_shardings(
      policy, critic, loss_cfg, optim_cfg, critic_optim, batch_size, mesh, rules)
  schedule = lr_schedule(optim_cfg, batch_size)
  critic_schedule = lr_schedule(critic_optim, batch_size)
  graphdef, _, rest = nnx.split(policy, nnx.Param, ...)
  critic_graphdef, _, critic_rest = nnx.split(critic, nnx.Param, ...)
  warmup = value_cfg.critic_warmup
  batch_sh = shd.batch_sharding(mesh)
  micro_sh = NamedSharding(mesh, PartitionSpec(None, ("data", "fsdp")))
  replicated = NamedSharding(mesh, PartitionSpec())

  def values_of(critic_params, mb_):
    c = nnx.merge(critic_graphdef, critic_params, critic_rest)
    return token_values(c, mb_["ids"], mb_["attn"])

  def policy_logp(params, mb_):
    m = nnx.merge(graphdef, params, rest)
    return token_logp_entropy(m, mb_["ids"], mb_["attn"], mb_["mask"], chunk=logits_chunk,
                              temperature=temperature)

  def micro_loss(params, critic_params, ref_params, mb_):
    logp, entropy = policy_logp(params, mb_)
    if loss_cfg.entropy_coef == 0:
      entropy = jax.lax.stop_gradient(entropy)
    ref_logp = (jax.lax.stop_gradient(policy_logp(ref_params, mb_)[0]) if with_ref
                else None)
    pg, metrics = weighted_policy_loss(
        logp, jax.lax.stop_gradient(logp), mb_["adv"], mb_["mask"],
        TokenWeights(mb_["w_pg"], mb_["w_reg"], mb_["w_diag"]), loss_cfg,
        sampler_logp_BxT=mb_["sampler"], ref_logp_BxT=ref_logp, entropy_BxT=entropy)
    vf, value_m = weighted_value_loss(
        values_of(critic_params, mb_), mb_["old_values"], mb_["returns"], mb_["mask"],
        ValueWeights(mb_["wv_loss"], mb_["wv_diag"]), value_cfg)
    return pg + vf, {**metrics, **value_m}

  grad_fn = jax.value_and_grad(micro_loss, argnums=(0, 1), has_aux=True)

  def step(state: PPOTrainState, batch: Batch):
    # The mesh as context, so the models' activation constraints resolve in the trace.
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return sharded_step(state, batch)

  def sharded_step(state: PPOTrainState, batch: Batch):
    micro, bucket_M, lengths = layout_batch(batch)
    flat = _flatten_micro
    values_flat = flat(jax.lax.stop_gradient(jax.lax.map(
        lambda xs: _bucketed(values_at(lengths[-1]), lengths)(state.critic_params, *xs),
        (micro, bucket_M))))
    mask_flat = flat(micro["mask"])
    # Rows are independent and whitening is a batch total: the layout's row order serves.
    adv_flat, returns_flat = value_advantages(
        flat(micro["rewards"]), values_flat, mask_flat, value_cfg,
        estimator=loss_cfg.adv_estimator, std_eps=loss_cfg.adv_std_eps)
    micro.update(jax.tree.map(
        lambda x: jax.lax.with_sharding_constraint(x.reshape(micro["mask"].shape), micro_sh),
        {"adv": adv_flat, "returns": returns_flat, "old_values": values_flat}))
    grads, critic_grads, metrics = accumulate(state, micro, bucket_M, lengths)
    out, ok, norms = apply_updates(state, grads, critic_grads, metrics)
    rewards_B = batch.rewards_B.astype(jnp.float32)
    metrics.update(value_metrics(values_flat, returns_flat, mask_flat), **norms)
    metrics.update(
        zero_var_frac=jnp.mean(zero_variance_groups(rewards_B, group_size=group_size)
                               .astype(jnp.float32)),
        reward_mean=jnp.mean(rewards_B),
        adv_abs_mean=jnp.sum(jnp.abs(adv_flat)) / jnp.maximum(jnp.sum(mask_flat), 1.0),
        tokens=jnp.sum(mask_flat),
        pad_fraction=1.0 - jnp.sum(batch.attention_mask_BxT > 0)
        / (mb * jnp.sum(jnp.asarray(lengths)[bucket_M])),
        lr=jnp.asarray(schedule(jnp.maximum(state.step - warmup, 0)), jnp.float32),
        critic_lr=jnp.asarray(critic_schedule(state.step), jnp.float32),
        policy_frozen=(state.step < warmup).astype(jnp.float32),
        skipped=1.0 - ok.astype(jnp.float32))
    return out, metrics

  def layout_batch(batch: Batch):
    """The batch's rows, loss weights and rewards as micro-batches (``_micro_layout``)."""
    mask = batch.loss_mask_BxT.astype(jnp.float32)
    T = mask.shape[1]
    # Aggregation weights first: prompt_mean reads the prompt-major row order.
    pg_w = token_weights(mask, loss_cfg, group_size=group_size)  # zero_var_filter is "off"
    v_w = value_weights(mask, loss_cfg.agg, group_size=group_size)
    data = {"ids": batch.input_ids_BxT, "attn": batch.attention_mask_BxT, "mask": mask,
            "sampler": batch.sampler_logp_BxT.astype(jnp.float32),
            "rewards": batch.rewards_B.astype(jnp.float32), "w_pg": pg_w.pg_BxT,
            "w_reg": pg_w.reg_BxT, "w_diag": pg_w.diag_BxT, "wv_loss": v_w.loss_BxT,
            "wv_diag": v_w.diag_BxT}
    lengths = layout.bucket_lengths(T, length_buckets)
    micro, bucket_M = _micro_layout(data, batch.attention_mask_BxT, lengths, mb, n_micro,
                                    micro_sh)
    return micro, bucket_M, lengths

  def values_at(width):
    def at(length, critic_params, mb_):
      """The critic's values of a micro-batch trimmed to ``length``, padded to ``width``."""
      return jnp.pad(values_of(critic_params, mb_), ((0, 0), (0, width - length)))
    return at

  def grads_at(length, state, mb_):
    del length
    return grad_fn(state.params, state.critic_params, state.ref_params, mb_)

  def accumulate(state, micro, bucket_M, lengths):
    """Summed gradients of policy and critic and summed (max) metrics over micro-batches."""
    zeros = jax.lax.with_sharding_constraint(
        jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32),
                     (state.params, state.critic_params)),
        (state_sh.params, state_sh.critic_params))
    grad_of = _bucketed(grads_at, lengths)
    metric_shapes = jax.eval_shape(
        lambda: grad_of(state, jax.tree.map(lambda x: x[0], micro), bucket_M[0])[0][1])
    metric0 = {k: jnp.zeros(x.shape, x.dtype) for k, x in metric_shapes.items()}

    def add(carry, xs):
      grads, metrics = carry
      (_, m), g = grad_of(state, *xs)
      grads = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), grads, g)
      return (grads, _combine(metrics, m)), None

    ((grads, critic_grads), metrics), _ = jax.lax.scan(add, (zeros, metric0),
                                                        (micro, bucket_M))
    # Back to the parameter dtypes so the optimiser states keep theirs.
    return (jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params),
            jax.tree.map(lambda g, p: g.astype(p.dtype), critic_grads, state.critic_params),
            metrics)

  def apply_updates(state, grads, critic_grads, metrics):
    """(new state, whether it was applied, norms); unchanged state if anything is not finite."""
    grad_norm, critic_grad_norm = optax.tree.norm(grads), optax.tree.norm(critic_grads)
    update_norm, policy_finite = _probe_update(tx, grads, state.opt_state, state.params)
    critic_update_norm, critic_finite = _probe_update(
        critic_tx, critic_grads, state.critic_opt_state, state.critic_params)
    ok = (jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["value_loss"])
          & jnp.isfinite(grad_norm) & jnp.isfinite(critic_grad_norm) & policy_finite
          & critic_finite)
    policy_on = state.step >= warmup

    def update_policy(s: PPOTrainState) -> PPOTrainState:
      updates, opt_state = tx.update(grads, s.opt_state, s.params)
      return s.replace(params=optax.apply_updates(s.params, updates), opt_state=opt_state)

    def updated(s: PPOTrainState) -> PPOTrainState:
      updates, critic_opt = critic_tx.update(critic_grads, s.critic_opt_state,
                                             s.critic_params)
      s = s.replace(critic_params=optax.apply_updates(s.critic_params, updates),
                    critic_opt_state=critic_opt, step=s.step + 1)
      if warmup == 0:
        return update_policy(s)
      return jax.lax.cond(policy_on, update_policy, lambda x: x, s)

    norms = {"grad_norm": grad_norm, "critic_grad_norm": critic_grad_norm,
             "update_norm": jnp.where(ok & policy_on, update_norm, 0.0),
             "critic_update_norm": jnp.where(ok, critic_update_norm, 0.0)}
    return jax.lax.cond(ok, updated, lambda s: s, state), ok, norms

  jitted = jax.jit(step, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, replicated),
                   donate_argnums=(0,) if donate else ())
  return TrainStep(jitted=jitted, state_shardings=state_sh, batch_sharding=batch_sh,
                   batch_size=batch_size, group_size=group_size, micro_batch_size=mb,
                   batch_shards=shards)


def critic_update_flops(cfg, attention_mask_BxT) -> int:
  """The critic's FLOPs in one PPO update of a batch (host side, for the ledger).

  Four forwards' worth over the real tokens (``critic_forward_flops``): the
  values pass, the loss's forward and its backward (about two forwards).
  """
  return 4 * critic_forward_flops(cfg, attention_mask_BxT)
