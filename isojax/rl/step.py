"""The RL update: one pure, jitted, sharded step ``(state, batch) -> (state, metrics)``.

It is jitted by ``isojax.rl.jitted.jit_step``, the one place in ``isojax.rl``
that calls ``jax.jit`` (PPO's ``make_ppo_train_step`` builds through it too).

Inside the step:
  1. advantages from the batch's rewards (static group size), then the loss's
     aggregation weights for the *whole* batch (``losses.token_weights``), so
     every normaliser (token count, sequence count, prompt count, filtered
     groups) is a whole-batch total (``_train_rows``);
  2. gradient accumulation with ``lax.scan`` over micro-batches; each
     micro-batch's loss is a weighted sum with the whole-batch weights, so the
     summed gradient equals the full-batch gradient for any micro-batch size (up
     to float rounding) (``micro_batches``, ``accumulate``);
  3. old log-probs (``old_logp``, static): with "current" (the default: every
     batch gets exactly one update, on-policy) the policy that sampled the
     batch is, up to sampler/trainer numerics handled by TIS, the current
     parameters, so ``old_logp`` is ``stop_gradient`` of the same forward
     pass that gives ``logp``: identical model code and no second forward.
     Ratios are then exactly 1 in value, their gradients are the policy
     gradient, ``clip_low``, ``clip_high`` (CISPO's cap too) and ``clip_dual``
     cannot bind, and the ratio metrics (``losses.RATIO_METRICS``), identically
     0, are not reported (a run refuses clip settings other than the defaults
     then: ``LossConfig.check_on_policy``). With "sampler" (stale batches,
     several updates per sampling policy) the ratio is pi / mu against the
     behaviour log-probs the sampler returned, per token
     (``Batch.sampler_logp_BxT``: a sequence may mix policies); the sampler/trainer
     correction folds into that ratio, so TIS is not applied on top (see
     ``losses.weighted_policy_loss``), and the ratio metrics are reported.
     Reference log-probs (KL) come from the frozen ``ref_params``, which
     exist only when ``kl_coef > 0``;
  4. one optimiser update; if the loss, the gradient or the updated parameters
     are not finite the whole state (params, optimiser moments, step) is
     returned unchanged and ``metrics["skipped"] = 1`` (``_guarded_update``).

With one length bucket (short batches), micro-batch ``i`` takes rows ``i, i +
K, i + 2 K, ...``: with the batch axis split contiguously over the devices,
every micro-batch is then spread evenly over all of them without
communication. With several, rows are left-aligned and sorted by length first
and each micro-batch runs at its bucket's length (``isojax.rl.layout``).

PPO's step (``isojax.rl.ppo``) is built from the same pieces: ``check_step_args``,
``micro_batches``, ``micro_loss_fn``, ``accumulate``, ``batch_metrics``, ``jit_step``.

Shape letters: B rows of the batch, T its width; K micro-batches of R rows
each (B = K R); L the length a micro-batch runs at (a bucket, L <= T).
"""

from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from isojax import sharding as shd
from isojax.rl import layout
from isojax.rl.advantages import ESTIMATORS, compute_advantages, zero_variance_groups
from isojax.rl.batch import Batch
from isojax.rl.jitted import TrainStep, jit_step
from isojax.rl.logprobs import token_logp_entropy
from isojax.rl.losses import MAX_METRICS, RATIO_METRICS, LossConfig, TokenWeights
from isojax.rl.losses import token_weights, weighted_policy_loss
from isojax.rl.optim import OptimConfig, lr_schedule, make_optimizer
from isojax.rl.state import TrainState, default_mesh, train_state_shardings

__all__ = ["OLD_LOGP", "TrainRows", "make_train_step"]

# What the ratio pi / pi_old divides by (``make_train_step(old_logp=...)``).
OLD_LOGP = ("current", "sampler")


@flax.struct.dataclass
class TrainRows:
  """What the step feeds the loss, row by row, in one of three layouts.

  [B, T] for the whole batch, [K, R, T] as K micro-batches of R rows, [R, L]
  for one micro-batch at its bucket length; ``adv`` is [B] / [K, R] / [R] and
  ``weights`` holds [B, T]-like leaves that move with the rows.
  """

  input_ids: jax.Array
  attention_mask: jax.Array
  loss_mask: jax.Array  # float32
  sampler_logp: jax.Array  # float32
  adv: jax.Array
  weights: TokenWeights

  def trimmed(self, length: int) -> "TrainRows":
    """One micro-batch [R, T] cut to its first ``length`` columns ([R, L])."""
    return jax.tree.map(lambda x: x[:, :length] if x.ndim == 2 else x, self)


def check_step_args(*, batch_size, group_size, rows_per_micro, mesh, temperature,
                    length_buckets, old_logp) -> None:
  """The step's sizes, old_logp, temperature and length buckets, against each
  other; ValueError naming the input."""
  shards = shd.batch_shards(mesh)
  if group_size < 1 or batch_size % group_size:
    raise ValueError(f"group_size={group_size} does not divide batch_size={batch_size}")
  if rows_per_micro < 1 or batch_size % rows_per_micro:
    raise ValueError(f"micro_batch_size={rows_per_micro} does not divide "
                     f"batch_size={batch_size}")
  if rows_per_micro % shards:
    raise ValueError(f"micro_batch_size={rows_per_micro} is not divisible by the {shards} "
                     f"batch shards (data x fsdp) of the mesh {dict(mesh.shape)}")
  if old_logp not in OLD_LOGP:
    raise ValueError(f"old_logp={old_logp!r}; choose from {list(OLD_LOGP)}")
  if not temperature > 0:
    raise ValueError(f"temperature={temperature}: the trainer scores rollouts under "
                     "softmax(logits / temperature); greedy (0) rollouts cannot be trained on")
  layout.bucket_lengths(1, length_buckets)  # a bad value fails here, not at trace time


def _train_rows(batch: Batch, loss_cfg: LossConfig, group_size: int):
  """Advantages and whole-batch aggregation weights: ([B, T] rows, zero_var_Bp)."""
  zero_var_Bp = zero_variance_groups(batch.rewards_B, group_size=group_size,
                                     baseline_rewards_B=batch.baseline_rewards_B)
  adv_B = compute_advantages(batch.rewards_B, group_size=group_size,
                             estimator=loss_cfg.adv_estimator, std_eps=loss_cfg.adv_std_eps,
                             baseline_rewards_B=batch.baseline_rewards_B,
                             drop_zero_variance=loss_cfg.drops_zero_variance)
  mask_BxT = batch.loss_mask_BxT.astype(jnp.float32)
  weights = token_weights(mask_BxT, loss_cfg, group_size=group_size, zero_var_Bp=zero_var_Bp)
  rows = TrainRows(input_ids=batch.input_ids_BxT, attention_mask=batch.attention_mask_BxT,
                   loss_mask=mask_BxT, sampler_logp=batch.sampler_logp_BxT.astype(jnp.float32),
                   adv=adv_B, weights=weights)
  return rows, zero_var_Bp


def micro_batches(rows: TrainRows, lengths: Sequence[int], n_micro: int,
                  micro_sharding: NamedSharding):
  """[B, T] rows as [K, R, T] micro-batches, and each one's bucket index [K]."""
  rows_per_micro = rows.adv.shape[0] // n_micro
  if len(lengths) == 1:
    # [B, ...] -> [K, R, ...]; micro-batch i = rows i, i + K, ...
    micro = jax.tree.map(
        lambda x: jax.lax.with_sharding_constraint(
            x.reshape(rows_per_micro, n_micro, *x.shape[1:]).swapaxes(0, 1), micro_sharding),
        rows)
    return micro, jnp.zeros((n_micro,), jnp.int32)
  # Rows sorted by real length; micro-batch i = sorted rows [i R, (i+1) R).
  rows, length_B = layout.left_align(rows, rows.attention_mask)
  rows, length_B = layout.sort_by_length(rows, length_B)
  micro = jax.tree.map(
      lambda x: jax.lax.with_sharding_constraint(
          x.reshape(n_micro, rows_per_micro, *x.shape[1:]), micro_sharding), rows)
  longest_K = length_B.reshape(n_micro, rows_per_micro)[:, -1]
  return micro, jnp.searchsorted(jnp.asarray(lengths), longest_K)


def micro_loss_fn(graphdef, rest, loss_cfg: LossConfig, *, logits_chunk, temperature,
                  old_logp: str):
  """``(params, ref_params, rows [R, L]) -> (loss, metrics)`` of one micro-batch."""
  if logits_chunk is not None and logits_chunk < 1:
    raise ValueError(f"logits_chunk={logits_chunk}: expected lm-head positions per chunk "
                     f">= 1, or None (all positions at once)")
  old_is_current = old_logp == "current"
  with_ref = loss_cfg.kl_coef > 0
  need_entropy_grad = loss_cfg.entropy_coef > 0

  def forward(params, rows):
    model = nnx.merge(graphdef, params, rest)
    return token_logp_entropy(model, rows.input_ids, rows.attention_mask, rows.loss_mask,
                              chunk=logits_chunk, temperature=temperature)

  def micro_loss(params, ref_params, rows: TrainRows):
    logp, entropy = forward(params, rows)
    if not need_entropy_grad:
      entropy = jax.lax.stop_gradient(entropy)
    ref_logp = None
    if with_ref:
      ref_logp = jax.lax.stop_gradient(forward(ref_params, rows)[0])
    # None: the ratio is taken against the sampler's log-probs (stale batches).
    old = jax.lax.stop_gradient(logp) if old_is_current else None
    loss, metrics = weighted_policy_loss(
        logp, old, rows.adv, rows.loss_mask, rows.weights,
        loss_cfg, sampler_logp_BxT=rows.sampler_logp, ref_logp_BxT=ref_logp,
        entropy_BxT=entropy)
    if not old_is_current:
      return loss, metrics
    return loss, {k: v for k, v in metrics.items() if k not in RATIO_METRICS}

  return micro_loss


def _combine(acc, new):
  return {k: jnp.maximum(acc[k], v) if k in MAX_METRICS else acc[k] + v
          for k, v in new.items()}


def accumulate(micro_loss, state: TrainState, micro: TrainRows, bucket_K,
               lengths: Sequence[int], params_sharding):
  """Summed float32 gradients and combined metrics over the K micro-batches."""
  grad_fn = jax.value_and_grad(micro_loss, has_aux=True)
  zeros = jax.lax.with_sharding_constraint(
      jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params), params_sharding)
  metric_shapes = jax.eval_shape(
      lambda: micro_loss(state.params, state.ref_params, jax.tree.map(lambda x: x[0], micro))[1])
  metric0 = {k: jnp.zeros(s.shape, s.dtype) for k, s in metric_shapes.items()}

  def at_length(length):
    return lambda rows: grad_fn(state.params, state.ref_params, rows.trimmed(length))

  branches = [at_length(length) for length in lengths]

  def add_micro_batch(carry, xs):
    grads, metrics = carry
    rows, bucket = xs
    if len(branches) == 1:
      (_, m), g = branches[0](rows)
    else:
      (_, m), g = jax.lax.switch(bucket, branches, rows)
    grads = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), grads, g)
    return (grads, _combine(metrics, m)), None

  (grads, metrics), _ = jax.lax.scan(add_micro_batch, (zeros, metric0), (micro, bucket_K))
  return grads, metrics


def _guarded_update(tx: optax.GradientTransformation, state: TrainState, grads, loss):
  """The optimiser update, or ``state`` unchanged when anything is non-finite.

  Returns (new state, ok, grad_norm before clipping, update_norm (0 if skipped)).
  """
  # Back to the parameter dtype so the optimiser state keeps its dtypes
  # (a bf16 state must not silently turn float32 and force a retrace).
  grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
  grad_norm = optax.tree.norm(grads)

  def updated(s: TrainState) -> TrainState:
    updates, opt_state = tx.update(grads, s.opt_state, s.params)
    return s.replace(params=optax.apply_updates(s.params, updates), opt_state=opt_state,
                     step=s.step + 1)

  # A finite gradient can still carry the weights to inf (a huge learning rate):
  # that update is skipped too, so no non-finite weight reaches the sampler. The
  # verdict comes from reductions XLA fuses with the update's arithmetic (nothing
  # is stored), so the update itself then runs under lax.cond, in place in the
  # donated buffers: no second copy of the parameters and AdamW moments is alive.
  probe, _ = tx.update(grads, state.opt_state, state.params)
  update_norm = optax.tree.norm(probe)
  finite = jax.tree.map(lambda p, u: jnp.all(jnp.isfinite(p + u)), state.params, probe)
  weights_finite = jnp.all(jnp.stack(jax.tree.leaves(finite)))
  ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & weights_finite
  new_state = jax.lax.cond(ok, updated, lambda s: s, state)
  return new_state, ok, grad_norm, jnp.where(ok, update_norm, 0.0)


def batch_metrics(batch: Batch, rows: TrainRows, zero_var_Bp, positions):
  """What the batch was: zero-variance share, rewards, advantages, tokens, padding
  (``positions``: the ones the model ran on, buckets included)."""
  return dict(zero_var_frac=jnp.mean(zero_var_Bp.astype(jnp.float32)),
              reward_mean=jnp.mean(batch.rewards_B.astype(jnp.float32)),
              adv_abs_mean=jnp.mean(jnp.abs(rows.adv)),
              tokens=jnp.sum(rows.loss_mask),
              pad_fraction=1.0 - jnp.sum(batch.attention_mask_BxT > 0) / positions)


def make_train_step(model: nnx.Module, loss_cfg: LossConfig, optim_cfg: OptimConfig, *,
                    batch_size: int, group_size: int, micro_batch_size: int | None = None,
                    mesh: Mesh | None = None, rules=shd.DEFAULT_RULES,
                    logits_chunk: int | None = None, temperature: float = 1.0,
                    length_buckets: int | Sequence[int] = layout.DEFAULT_BUCKETS,
                    old_logp: str = "current", donate: bool = True) -> TrainStep:
  """Build the jitted, sharded update step.

  Args:
    model: the decoder (its graph and parameter shapes; values are not used).
    loss_cfg, optim_cfg: the objective and the optimiser.
    batch_size: B = Bp * n rollouts per update (fixes the learning rate).
    group_size: n, rollouts per prompt.
    micro_batch_size: rows per gradient-accumulation step (default B); must
      divide B and be divisible by the number of batch shards (data * fsdp).
    mesh: (data, fsdp, tensor) mesh; default one device.
    rules: logical -> mesh axis rules for the parameters.
    logits_chunk: lm-head positions per chunk (see ``isojax.rl.logprobs``).
    temperature: the sampler's temperature; logits are divided by it so the
      trainer's log-probs are those of the distribution the rollouts came from
      (exactly so without top-p and top-k, which renormalise the sampler's
      distribution over fewer tokens; a run refuses them for training).
    length_buckets: static lengths micro-batches are trimmed to (see
      ``isojax.rl.layout``): a count (lengths multiples of 128) or explicit
      lengths; with one bucket (T <= 128 for a count, or 1) the batch layout
      is used as given.
    old_logp: what the ratio pi / pi_old divides by (see the module
      docstring): "current" (stop_gradient of the current forward: one
      on-policy update per batch) or "sampler" (the behaviour log-probs in
      ``Batch.sampler_logp_BxT``: batches sampled by an older policy).
    donate: donate the state's buffers to the step.

  Returns:
    A ``TrainStep``: ``(state, batch) -> (state, metrics)`` with scalar
    metrics: the loss metrics of ``isojax.rl.losses`` but, with
    ``old_logp="current"``, the ratio metrics (``RATIO_METRICS``: identically
    0 on-policy, see the module docstring), plus
    zero_var_frac, reward_mean, adv_abs_mean, tokens, pad_fraction (of the
    positions the model ran on), grad_norm (before clipping), update_norm, lr
    and skipped.
  """
  if loss_cfg.adv_estimator not in ESTIMATORS:  # a critic's: PPO's own step
    raise ValueError(f"LossConfig.adv_estimator={loss_cfg.adv_estimator!r} takes values "
                     f"from a critic: build the step with isojax.rl.ppo.make_ppo_train_step")
  mesh = default_mesh(mesh)
  rows_per_micro = batch_size if micro_batch_size is None else micro_batch_size
  check_step_args(batch_size=batch_size, group_size=group_size,
                  rows_per_micro=rows_per_micro, mesh=mesh, temperature=temperature,
                  length_buckets=length_buckets, old_logp=old_logp)
  n_micro = batch_size // rows_per_micro
  tx = make_optimizer(optim_cfg, batch_size=batch_size)
  schedule = lr_schedule(optim_cfg, batch_size)
  graphdef, _, rest = nnx.split(model, nnx.Param, ...)
  micro_loss = micro_loss_fn(graphdef, rest, loss_cfg, logits_chunk=logits_chunk,
                             temperature=temperature, old_logp=old_logp)
  state_shapes, state_sh = train_state_shardings(model, tx, mesh, rules,
                                                 with_ref=loss_cfg.kl_coef > 0)
  micro_sh = NamedSharding(mesh, PartitionSpec(None, shd.BATCH_AXES))

  def step(state: TrainState, batch: Batch):
    # The mesh as context, so the model's activation constraints
    # (``sharding.constrain_batch``) resolve inside the trace.
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      rows, zero_var_Bp = _train_rows(batch, loss_cfg, group_size)
      lengths = layout.bucket_lengths(batch.input_ids_BxT.shape[1], length_buckets)
      micro, bucket_K = micro_batches(rows, lengths, n_micro, micro_sh)
      grads, metrics = accumulate(micro_loss, state, micro, bucket_K, lengths,
                                  state_sh.params)
      new_state, ok, grad_norm, update_norm = _guarded_update(tx, state, grads,
                                                              metrics["loss"])
      positions = rows_per_micro * jnp.sum(jnp.asarray(lengths)[bucket_K])
      metrics.update(batch_metrics(batch, rows, zero_var_Bp, positions),
                     grad_norm=grad_norm, update_norm=update_norm,
                     lr=jnp.asarray(schedule(state.step), jnp.float32),
                     skipped=1.0 - ok.astype(jnp.float32))
      return new_state, metrics

  return jit_step(step, state_shapes, state_sh, mesh, batch_size=batch_size,
                  group_size=group_size, micro_batch_size=rows_per_micro,
                  vocab_size=model.cfg.vocab_size, donate=donate)

