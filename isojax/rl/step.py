"""The RL update: one pure, jitted, sharded step ``(state, batch) -> (state, metrics)``.

``make_train_step`` is the one place in ``isojax.rl`` that calls ``jax.jit``: with
``in_shardings``/``out_shardings`` over an explicit mesh and the state donated.

Inside the step:
  1. advantages from the batch's rewards (static group size), then the loss's
     aggregation weights for the *whole* batch (``losses.token_weights``), so
     every normaliser (token count, sequence count, prompt count, filtered
     groups) is a whole-batch total;
  2. gradient accumulation with ``lax.scan`` over micro-batches; each
     micro-batch's loss is a weighted sum with the whole-batch weights, so the
     summed gradient equals the full-batch gradient for any micro-batch size (up
     to float rounding);
  3. old log-probs: every batch gets exactly one update (on-policy), so the
     policy that sampled it (up to sampler/trainer numerics, handled by TIS) is
     the current parameters. ``old_logp`` is therefore ``stop_gradient`` of the
     same forward pass that gives ``logp``: identical model code and no second
     forward. Ratios are exactly 1 in value, their gradients are the policy
     gradient. So ``clip_low``, ``clip_high`` (CISPO's cap too) and
     ``clip_dual`` cannot bind and the ratio metrics (``losses.RATIO_METRICS``)
     are identically 0: the step does not report them, and a run refuses clip
     settings other than the defaults (``LossConfig.check_on_policy``) until
     updates reuse stale batches. Reference log-probs (KL) come from the
     frozen ``ref_params``, which exist only when ``kl_coef > 0``;
  4. one optimiser update; if the loss, the gradient or the updated parameters
     are not finite the whole state (params, optimiser moments, step) is
     returned unchanged and ``metrics["skipped"] = 1``.

With one length bucket (short batches), micro-batch ``i`` takes rows ``i, i +
nm, i + 2 nm, ...`` (nm = number of micro-batches): with the batch axis split
contiguously over the devices, every micro-batch is then spread evenly over all
of them without communication. With several, rows are left-aligned and sorted
by length first and each micro-batch runs at its bucket's length
(``isojax.rl.layout``).
"""

import dataclasses
from typing import Any, Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from isojax import sharding as shd
from isojax.rl import layout
from isojax.rl.advantages import compute_advantages, zero_variance_groups
from isojax.rl.logprobs import token_logp_entropy
from isojax.rl.losses import MAX_METRICS, RATIO_METRICS, LossConfig, token_weights
from isojax.rl.losses import weighted_policy_loss
from isojax.rl.optim import OptimConfig, lr_schedule, make_optimizer

__all__ = ["Batch", "TrainState", "TrainStep", "abstract_batch", "abstract_train_state",
           "init_train_state", "make_train_step", "validate_batch"]


@flax.struct.dataclass
class Batch:
  """One update's rollouts; B = Bp * n rows, prompt-major groups of n.

  Attributes:
    input_ids_BxT: int32, left-padded prompt ++ right-padded completion.
    attention_mask_BxT: 1 on real (non-pad) tokens.
    loss_mask_BxT: 1 where input_ids[t] is a completion token trained on
      (never column 0, which has no prediction).
    sampler_logp_BxT: the sampler's log-prob of input_ids[t], aligned like
      loss_mask; 0 elsewhere.
    rewards_B: float32 rewards.
    baseline_rewards_B: optional [Bp * n_est] rewards for a decoupled baseline
      (see ``isojax.rl.advantages``); None: baseline from ``rewards_B``.
  """

  input_ids_BxT: jax.Array
  attention_mask_BxT: jax.Array
  loss_mask_BxT: jax.Array
  sampler_logp_BxT: jax.Array
  rewards_B: jax.Array
  baseline_rewards_B: jax.Array | None = None


@flax.struct.dataclass
class TrainState:
  """Everything an update changes. ``ref_params`` is None unless kl_coef > 0."""

  params: Any  # nnx.State of the model's nnx.Param variables
  opt_state: Any
  step: jax.Array  # int32, number of applied (not skipped) updates
  ref_params: Any = None


_BxT_FIELDS = ("input_ids_BxT", "attention_mask_BxT", "loss_mask_BxT", "sampler_logp_BxT")


def validate_batch(batch: Batch, *, group_size: int, batch_size: int | None = None,
                   micro_batch_size: int | None = None, batch_shards: int = 1) -> None:
  """Host-side checks before an update; raises ValueError naming the input.

  Checks shapes against each other and the static sizes, that group_size
  divides B, that the masks are 0/1 with the loss mask inside the attention
  mask and off column 0, and that rewards and sampler log-probs are finite.
  """
  if not isinstance(batch, Batch):
    raise ValueError(f"batch must be an isojax.rl.step.Batch, got {type(batch).__name__}")
  shape = np.shape(batch.input_ids_BxT)
  if len(shape) != 2:
    raise ValueError(f"Batch.input_ids_BxT must be 2-D [B, T], got shape {shape}")
  for name in _BxT_FIELDS[1:]:
    if np.shape(getattr(batch, name)) != shape:
      raise ValueError(f"Batch.{name} has shape {np.shape(getattr(batch, name))}, "
                       f"expected {shape} like input_ids_BxT")
  b = shape[0]
  if np.shape(batch.rewards_B) != (b,):
    raise ValueError(f"Batch.rewards_B has shape {np.shape(batch.rewards_B)}, expected ({b},)")
  if batch_size is not None and b != batch_size:
    raise ValueError(f"batch has B={b} rows but the step was built for batch_size="
                     f"{batch_size} (the learning rate depends on it)")
  if b % group_size:
    raise ValueError(f"group_size={group_size} does not divide B={b}")
  if micro_batch_size is not None and b % micro_batch_size:
    raise ValueError(f"micro_batch_size={micro_batch_size} does not divide B={b}")
  if not np.issubdtype(np.asarray(batch.input_ids_BxT[:1, :1]).dtype, np.integer):
    raise ValueError("Batch.input_ids_BxT must be an integer array")
  attn = np.asarray(batch.attention_mask_BxT)
  loss_mask = np.asarray(batch.loss_mask_BxT)
  for name, m in (("attention_mask_BxT", attn), ("loss_mask_BxT", loss_mask)):
    if not np.all((m == 0) | (m == 1)):
      raise ValueError(f"Batch.{name} must hold only 0/1")
  if np.any((loss_mask > 0) & (attn == 0)):
    raise ValueError("Batch.loss_mask_BxT is 1 where attention_mask_BxT is 0")
  if np.any(loss_mask[:, 0] > 0):
    raise ValueError("Batch.loss_mask_BxT[:, 0] must be 0 (the first token has no "
                     "prediction)")
  checks = [("rewards_B", batch.rewards_B), ("sampler_logp_BxT", batch.sampler_logp_BxT)]
  if batch.baseline_rewards_B is not None:
    checks.append(("baseline_rewards_B", batch.baseline_rewards_B))
    nb = np.shape(batch.baseline_rewards_B)
    bp = b // group_size
    if len(nb) != 1 or nb[0] % bp or nb[0] // bp < group_size or nb[0] % batch_shards:
      raise ValueError(f"Batch.baseline_rewards_B has shape {nb}; expected [Bp*n_est] "
                       f"with Bp={bp}, n_est >= {group_size}, divisible by "
                       f"{batch_shards} batch shards")
  for name, x in checks:
    bad = ~np.isfinite(np.asarray(x, np.float64))
    if bad.any():
      first = tuple(int(i) for i in np.argwhere(bad)[0])
      raise ValueError(f"Batch.{name} has {int(bad.sum())} non-finite values "
                       f"(first at index {first})")


def _opt_and_ref(params, tx, with_ref):
  ref = jax.tree.map(jnp.copy, params) if with_ref else None
  return TrainState(params=params, opt_state=tx.init(params),
                    step=jnp.zeros((), jnp.int32), ref_params=ref)


def _state_shardings(model, tx, with_ref, mesh, rules):
  params = nnx.state(model, nnx.Param)
  abstract = jax.eval_shape(lambda p: _opt_and_ref(p, tx, with_ref), params)
  return shd.state_shardings(abstract, mesh, rules)


def _default_mesh(mesh):
  return mesh if mesh is not None else shd.make_mesh(devices=jax.devices()[:1])


def init_train_state(model: nnx.Module, loss_cfg: LossConfig, optim_cfg: OptimConfig, *,
                     batch_size: int, mesh: Mesh | None = None,
                     rules=shd.DEFAULT_RULES) -> TrainState:
  """Fresh optimiser state around ``model``'s parameters, placed on ``mesh``.

  The state gets its own copies of the parameters (the step donates them), so
  ``model`` stays usable. ``ref_params`` (a frozen copy) only if kl_coef > 0.
  """
  mesh = _default_mesh(mesh)
  tx = make_optimizer(optim_cfg, batch_size=batch_size)
  with_ref = loss_cfg.kl_coef > 0
  shardings = _state_shardings(model, tx, with_ref, mesh, rules)
  params = jax.device_put(nnx.state(model, nnx.Param), shardings.params, may_alias=False)
  return jax.device_put(_opt_and_ref(params, tx, with_ref), shardings, may_alias=False)


def abstract_train_state(model: nnx.Module, loss_cfg: LossConfig, optim_cfg: OptimConfig, *,
                         batch_size: int, mesh: Mesh | None = None,
                         rules=shd.DEFAULT_RULES) -> TrainState:
  """``init_train_state``'s result as ``jax.ShapeDtypeStruct`` leaves with shardings.

  No array is created, so ``model`` may come from ``nnx.eval_shape`` (a 7B
  model costs nothing); the result feeds ``TrainStep.lower``.
  """
  mesh = _default_mesh(mesh)
  tx = make_optimizer(optim_cfg, batch_size=batch_size)
  with_ref = loss_cfg.kl_coef > 0
  shardings = _state_shardings(model, tx, with_ref, mesh, rules)
  shapes = jax.eval_shape(lambda p: _opt_and_ref(p, tx, with_ref),
                          nnx.state(model, nnx.Param))
  leaves, treedef = jax.tree.flatten(shapes)
  sh_leaves = jax.tree.leaves(shardings)
  if len(sh_leaves) != len(leaves):  # the two trees come from the same state
    raise AssertionError(f"{len(sh_leaves)} shardings for {len(leaves)} state leaves")
  return jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
                                      for x, sh in zip(leaves, sh_leaves)])


def abstract_batch(batch_size: int, seq_len: int, *, mesh: Mesh | None = None,
                   baseline_size: int | None = None) -> Batch:
  """A ``Batch`` of ``jax.ShapeDtypeStruct`` [batch_size, seq_len] placed like the step's.

  ``baseline_size``: length of ``baseline_rewards_B`` (Bp * n_est), if any.
  """
  sh = shd.batch_sharding(_default_mesh(mesh))

  def spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sh)

  bxt = (batch_size, seq_len)
  return Batch(input_ids_BxT=spec(bxt, jnp.int32), attention_mask_BxT=spec(bxt, jnp.int32),
               loss_mask_BxT=spec(bxt, jnp.float32), sampler_logp_BxT=spec(bxt, jnp.float32),
               rewards_B=spec((batch_size,), jnp.float32),
               baseline_rewards_B=None if baseline_size is None
               else spec((baseline_size,), jnp.float32))


@dataclasses.dataclass(frozen=True)
class TrainStep:
  """The built step. Call it as ``state, metrics = train_step(state, batch)``.

  ``__call__`` runs ``validate_batch`` on the host, then ``jitted`` (the
  ``jax.jit`` object). ``lower`` compiles ahead of time from shapes alone
  (``abstract_train_state`` / ``abstract_batch``): ``lower(...).compile()
  .memory_analysis()`` gives the step's memory before any array exists. The
  state argument is donated: its arrays are invalid afterwards.
  """

  jitted: Callable
  state_shardings: Any
  batch_sharding: NamedSharding
  batch_size: int
  group_size: int
  micro_batch_size: int
  batch_shards: int

  def __call__(self, state: TrainState, batch: Batch):
    validate_batch(batch, group_size=self.group_size, batch_size=self.batch_size,
                   micro_batch_size=self.micro_batch_size, batch_shards=self.batch_shards)
    return self.jitted(state, batch)

  def lower(self, state: TrainState, batch: Batch):
    """``jax.jit(...).lower`` of the step; arrays or ``jax.ShapeDtypeStruct`` leaves."""
    return self.jitted.lower(state, batch)


def _combine(acc, new):
  return {k: jnp.maximum(acc[k], v) if k in MAX_METRICS else acc[k] + v
          for k, v in new.items()}


def make_train_step(model: nnx.Module, loss_cfg: LossConfig, optim_cfg: OptimConfig, *,
                    batch_size: int, group_size: int, micro_batch_size: int | None = None,
                    mesh: Mesh | None = None, rules=shd.DEFAULT_RULES,
                    logits_chunk: int | None = None, temperature: float = 1.0,
                    length_buckets: int | Sequence[int] = layout.DEFAULT_BUCKETS,
                    donate: bool = True) -> TrainStep:
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
      trainer's log-probs are those of the distribution the rollouts came from.
    length_buckets: static lengths micro-batches are trimmed to (see
      ``isojax.rl.layout``): a count (lengths multiples of 128) or explicit
      lengths; with one bucket (T <= 128 for a count, or 1) the batch layout
      is used as given.
    donate: donate the state's buffers to the step.

  Returns:
    A ``TrainStep``: ``(state, batch) -> (state, metrics)`` with scalar
    metrics: the loss metrics of ``isojax.rl.losses`` but the ratio metrics
    (``RATIO_METRICS``: identically 0 on-policy, see the module docstring), plus
    zero_var_frac, reward_mean, adv_abs_mean, tokens, pad_fraction (of the
    positions the model ran on), grad_norm (before clipping), update_norm, lr
    and skipped.
  """
  mesh = _default_mesh(mesh)
  mb = batch_size if micro_batch_size is None else micro_batch_size
  shards = mesh.shape["data"] * mesh.shape["fsdp"]
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
  layout.bucket_lengths(1, length_buckets)  # a bad value fails here, not at trace time
  n_micro = batch_size // mb
  tx = make_optimizer(optim_cfg, batch_size=batch_size)
  schedule = lr_schedule(optim_cfg, batch_size)
  graphdef, _, rest = nnx.split(model, nnx.Param, ...)
  with_ref = loss_cfg.kl_coef > 0
  need_entropy_grad = loss_cfg.entropy_coef > 0
  state_sh = _state_shardings(model, tx, with_ref, mesh, rules)
  batch_sh = shd.batch_sharding(mesh)
  micro_sh = NamedSharding(mesh, PartitionSpec(None, ("data", "fsdp")))
  replicated = NamedSharding(mesh, PartitionSpec())

  def forward(params, mb_):
    m = nnx.merge(graphdef, params, rest)
    return token_logp_entropy(m, mb_["ids"], mb_["attn"], mb_["mask"], chunk=logits_chunk,
                              temperature=temperature)

  def micro_loss(params, ref_params, mb_):
    logp, entropy = forward(params, mb_)
    if not need_entropy_grad:
      entropy = jax.lax.stop_gradient(entropy)
    ref_logp = None
    if with_ref:
      ref_logp = jax.lax.stop_gradient(forward(ref_params, mb_)[0])
    loss, metrics = weighted_policy_loss(
        logp, jax.lax.stop_gradient(logp), mb_["adv"], mb_["mask"], mb_["weights"],
        loss_cfg, sampler_logp_BxT=mb_["sampler"], ref_logp_BxT=ref_logp,
        entropy_BxT=entropy)
    return loss, {k: v for k, v in metrics.items() if k not in RATIO_METRICS}

  grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

  def step(state: TrainState, batch: Batch):
    # The mesh as context, so the model's activation constraints
    # (``sharding.constrain_batch``) resolve inside the trace.
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return sharded_step(state, batch)

  def sharded_step(state: TrainState, batch: Batch):
    adv_B = compute_advantages(batch.rewards_B, group_size=group_size,
                               estimator=loss_cfg.adv_estimator,
                               std_eps=loss_cfg.adv_std_eps,
                               baseline_rewards_B=batch.baseline_rewards_B,
                               drop_zero_variance=loss_cfg.drops_zero_variance)
    zero_var_Bp = zero_variance_groups(batch.rewards_B, group_size=group_size,
                                       baseline_rewards_B=batch.baseline_rewards_B)
    mask = batch.loss_mask_BxT.astype(jnp.float32)
    data = {"ids": batch.input_ids_BxT, "attn": batch.attention_mask_BxT, "mask": mask,
            "sampler": batch.sampler_logp_BxT.astype(jnp.float32), "adv": adv_B,
            "weights": token_weights(mask, loss_cfg, group_size=group_size,
                                     zero_var_Bp=zero_var_Bp)}
    T = batch.input_ids_BxT.shape[1]
    lengths = layout.bucket_lengths(T, length_buckets)
    if len(lengths) == 1:
      # [B, ...] -> [n_micro, mb, ...]; micro-batch i = rows i, i + n_micro, ...
      micro = jax.tree.map(
          lambda x: jax.lax.with_sharding_constraint(
              x.reshape(mb, n_micro, *x.shape[1:]).swapaxes(0, 1), micro_sh), data)
      bucket_M = jnp.zeros((n_micro,), jnp.int32)
    else:
      # Rows sorted by real length; micro-batch i = sorted rows [i mb, (i+1) mb).
      data, length_B = layout.left_align(data, batch.attention_mask_BxT)
      data, length_B = layout.sort_by_length(data, length_B)
      micro = jax.tree.map(
          lambda x: jax.lax.with_sharding_constraint(
              x.reshape(n_micro, mb, *x.shape[1:]), micro_sh), data)
      bucket_M = jnp.searchsorted(jnp.asarray(lengths), length_B.reshape(n_micro, mb)[:, -1])
    positions = mb * jnp.sum(jnp.asarray(lengths)[bucket_M])

    zeros = jax.lax.with_sharding_constraint(
        jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params),
        state_sh.params)
    metric_shapes = jax.eval_shape(
        lambda: micro_loss(state.params, state.ref_params,
                           jax.tree.map(lambda x: x[0], micro))[1])
    metric0 = {k: jnp.zeros(s.shape, s.dtype) for k, s in metric_shapes.items()}

    def trimmed(length):
      def grad_at(mb_):
        mb_ = jax.tree.map(lambda x: x[:, :length] if x.ndim == 2 else x, mb_)
        return grad_fn(state.params, state.ref_params, mb_)
      return grad_at

    branches = [trimmed(n) for n in lengths]

    def accumulate(carry, xs):
      grads, metrics = carry
      mb_, bucket = xs
      if len(branches) == 1:
        (_, m), g = branches[0](mb_)
      else:
        (_, m), g = jax.lax.switch(bucket, branches, mb_)
      grads = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), grads, g)
      return (grads, _combine(metrics, m)), None

    (grads, metrics), _ = jax.lax.scan(accumulate, (zeros, metric0), (micro, bucket_M))
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
    weights_finite = jax.tree.reduce(
        lambda a, pu: a & jnp.all(jnp.isfinite(pu[0] + pu[1])),
        jax.tree.map(lambda p, u: (p, u), state.params, probe), jnp.bool_(True),
        is_leaf=lambda x: isinstance(x, tuple))
    ok = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm) & weights_finite
    out = jax.lax.cond(ok, updated, lambda s: s, state)

    metrics.update(
        zero_var_frac=jnp.mean(zero_var_Bp.astype(jnp.float32)),
        reward_mean=jnp.mean(batch.rewards_B.astype(jnp.float32)),
        adv_abs_mean=jnp.mean(jnp.abs(adv_B)),
        tokens=jnp.sum(mask),
        pad_fraction=1.0 - jnp.sum(batch.attention_mask_BxT > 0) / positions,
        grad_norm=grad_norm,
        update_norm=jnp.where(ok, update_norm, 0.0),
        lr=jnp.asarray(schedule(state.step), jnp.float32),
        skipped=1.0 - ok.astype(jnp.float32))
    return out, metrics

  jitted = jax.jit(step, in_shardings=(state_sh, batch_sh),
                   out_shardings=(state_sh, replicated),
                   donate_argnums=(0,) if donate else ())
  return TrainStep(jitted=jitted, state_shardings=state_sh, batch_sharding=batch_sh,
                   batch_size=batch_size, group_size=group_size, micro_batch_size=mb,
                   batch_shards=shards)
