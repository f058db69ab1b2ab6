"""The critic's side of PPO: advantages from values, the clipped value loss, metrics.

The group-baseline estimators (``isojax.rl.advantages.ESTIMATORS``) turn rewards
into one advantage per rollout. A value estimator (``VALUE_ESTIMATORS``, selected
by the same ``LossConfig.adv_estimator`` name) turns rewards and the critic's
per-token values into per-token advantages and the critic's regression targets:
``fn(token_rewards_BxT, values_BxT, mask_BxT, cfg) -> (adv_BxT, returns_BxT)``.

Everything here takes values, never models: the value loss is a function of the
critic's outputs only, so its gradient reaches the critic's parameters and
nothing else, and the policy loss (advantages carry no gradient) reaches the
policy's only.

Aggregation follows ``isojax.rl.aggregation``: weights for the whole batch are
computed once (``value_weights``) and sliced into micro-batches, so the
micro-batch value losses add up to the batch's. The critic uses the policy's
aggregation mode over *all* trained tokens: the zero-variance filter is a
group-baseline notion (those groups have zero advantage), while a critic still
learns the value of a prompt whose rollouts all scored the same.
"""

import dataclasses
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from isojax.rl.aggregation import AGGREGATIONS
from isojax.rl.gae import final_token_rewards, gae, whiten

__all__ = ["ValueConfig", "VALUE_ESTIMATORS", "ValueWeights", "value_advantages",
           "value_weights", "weighted_value_loss", "value_loss", "value_metrics"]


@dataclasses.dataclass(frozen=True)
class ValueConfig:
  """The critic's objective; defaults are verl's. Frozen.

  Attributes:
    gamma, lam: GAE discount and lambda, in [0, 1].
    whiten: whiten the advantages over the batch's trained tokens (verl always
      does); the returns are taken before whitening.
    cliprange_value: the second loss term clips the new value to
      old value +- this (PPO2 / verl); None: plain squared error. The clip
      binds only when the critic takes more than one update on a batch.
    value_coef: weight of the value loss in the critic's loss. The critic has
      its own parameters and optimiser, so under Adam this acts only through
      gradient-norm clipping and eps.
    critic_warmup: updates at the start of a run that train the critic only,
      the policy held fixed (verl's name; not the learning-rate warm-up).
  """

  gamma: float = 1.0
  lam: float = 1.0
  whiten: bool = True
  cliprange_value: float | None = 0.5
  value_coef: float = 1.0
  critic_warmup: int = 0

  def __post_init__(self):
    for field in ("gamma", "lam"):
      if not 0.0 <= getattr(self, field) <= 1.0:
        raise ValueError(f"ValueConfig.{field}={getattr(self, field)} must lie in [0, 1]")
    if self.cliprange_value is not None and not self.cliprange_value > 0:
      raise ValueError(f"ValueConfig.cliprange_value={self.cliprange_value} must be > 0 "
                       "or None")
    # inf scales every critic gradient to inf: each update would be skipped.
    if not 0 < self.value_coef < math.inf:
      raise ValueError(f"ValueConfig.value_coef={self.value_coef} must be finite and > 0")
    w = self.critic_warmup
    if isinstance(w, bool) or not isinstance(w, int) or w < 0:
      raise ValueError(f"ValueConfig.critic_warmup={w!r} must be an int >= 0")


def _gae(token_rewards_BxT, values_BxT, mask_BxT, cfg):
  return gae(token_rewards_BxT, values_BxT, mask_BxT, gamma=cfg.gamma, lam=cfg.lam)


# name -> fn(token_rewards_BxT, values_BxT, mask_BxT, ValueConfig) -> (adv_BxT, returns_BxT)
VALUE_ESTIMATORS: dict[str, Callable] = {"gae": _gae}


def value_advantages(rewards_B, values_BxT, mask_BxT, cfg: ValueConfig, *, estimator="gae",
                     std_eps=1e-6):
  """Per-token advantages and returns of a whole batch from outcome rewards.

  Args:
    rewards_B: one reward per rollout, placed on its last trained token.
    values_BxT: the critic's values before the update (``token_values``),
      aligned with the batch's log-probs.
    mask_BxT: 1 on trained tokens.
    cfg: ``ValueConfig``.
    estimator: a name in ``VALUE_ESTIMATORS``.
    std_eps: added to the std when whitening.

  Returns:
    (adv_BxT, returns_BxT), float32, 0 off the mask, without gradient (the
    estimators stop it at the values). Call on the whole batch: whitening takes
    batch-level statistics.
  """
  if estimator not in VALUE_ESTIMATORS:
    raise ValueError(f"unknown value estimator {estimator!r}; choose from "
                     f"{sorted(VALUE_ESTIMATORS)}")
  adv_BxT, ret_BxT = VALUE_ESTIMATORS[estimator](
      final_token_rewards(rewards_B, mask_BxT), values_BxT, mask_BxT, cfg)
  if cfg.whiten:
    adv_BxT = whiten(adv_BxT, mask_BxT, std_eps=std_eps)
  return adv_BxT, ret_BxT


class ValueWeights(NamedTuple):
  """Whole-batch weights of the value loss; slice rows for a micro-batch."""

  loss_BxT: jax.Array  # the loss, aggregated like the policy loss
  diag_BxT: jax.Array  # plain token mean over all trained tokens (metrics)


def value_weights(mask_BxT, agg: str, *, group_size=None) -> ValueWeights:
  """Aggregation weights for a whole batch (``agg`` as in ``LossConfig.agg``)."""
  if agg not in AGGREGATIONS:
    raise ValueError(f"unknown aggregation {agg!r}; choose from {sorted(AGGREGATIONS)}")
  mask_BxT = jnp.asarray(mask_BxT, jnp.float32)
  return ValueWeights(loss_BxT=AGGREGATIONS[agg](mask_BxT, group_size),
                      diag_BxT=AGGREGATIONS["token_mean"](mask_BxT, group_size))


def weighted_value_loss(values_BxT, old_values_BxT, returns_BxT, mask_BxT,
                        weights: ValueWeights, cfg: ValueConfig):
  """Clipped value loss and metrics with precomputed whole-batch weights.

  Per token: 0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2).
  Every returned number is a weighted sum over the given rows, so micro-batch
  results add up to the batch's.

  Returns:
    (loss = value_coef * value_loss, metrics): value_loss, value_clip_frac
    (trained tokens where the clipped term is the larger), value_mean.
  """
  on_BxT = jnp.asarray(mask_BxT) > 0

  def clean(x_BxT):
    # Padding positions may hold anything; zero them so no inf/nan reaches a sum.
    return jnp.where(on_BxT, jnp.asarray(x_BxT, jnp.float32), 0.0)

  v_BxT = clean(values_BxT)
  old_BxT = jax.lax.stop_gradient(clean(old_values_BxT))
  ret_BxT = jax.lax.stop_gradient(clean(returns_BxT))
  err_BxT = jnp.square(v_BxT - ret_BxT)
  if cfg.cliprange_value is None:
    tok_BxT, clipped_BxT = err_BxT, jnp.zeros_like(on_BxT)
  else:
    c = cfg.cliprange_value
    clip_err_BxT = jnp.square(jnp.clip(v_BxT, old_BxT - c, old_BxT + c) - ret_BxT)
    tok_BxT, clipped_BxT = jnp.maximum(err_BxT, clip_err_BxT), clip_err_BxT > err_BxT
  vf = 0.5 * jnp.sum(weights.loss_BxT * tok_BxT)
  sg = jax.lax.stop_gradient
  metrics = {"value_loss": vf,
             "value_clip_frac": jnp.sum(weights.diag_BxT * clipped_BxT),
             "value_mean": jnp.sum(weights.diag_BxT * v_BxT)}
  return cfg.value_coef * vf, {k: sg(v) for k, v in metrics.items()}


def value_loss(values_BxT, old_values_BxT, returns_BxT, mask_BxT, cfg: ValueConfig, *,
               agg="token_mean", group_size=None):
  """The value loss of a whole batch (``weighted_value_loss`` with its weights).

  Args:
    values_BxT: the critic's values (gradient flows into these).
    old_values_BxT: the values the batch's advantages were computed from.
    returns_BxT: the targets (``value_advantages``).
    mask_BxT: 1 on trained tokens.
    cfg: ``ValueConfig``.
    agg, group_size: aggregation as the policy loss's (``LossConfig.agg``).
  """
  shape = jnp.shape(values_BxT)
  if len(shape) != 2:
    raise ValueError(f"values_BxT must be 2-D [B, T], got shape {shape}")
  for name, x in (("old_values_BxT", old_values_BxT), ("returns_BxT", returns_BxT),
                  ("mask_BxT", mask_BxT)):
    if jnp.shape(x) != shape:
      raise ValueError(f"{name} has shape {jnp.shape(x)}, expected {shape} like values_BxT")
  weights = value_weights(mask_BxT, agg, group_size=group_size)
  return weighted_value_loss(values_BxT, old_values_BxT, returns_BxT, mask_BxT, weights, cfg)


def value_metrics(values_BxT, returns_BxT, mask_BxT):
  """Whole-batch critic metrics over the trained tokens.

  value_explained_var: 1 - Var(R - V) / Var(R) (1: perfect, 0: no better than
  the mean return; reported as 0 when the returns have no variance, e.g. every
  reward of the batch equal). return_mean: mean target.
  """
  on_BxT = jnp.asarray(mask_BxT) > 0
  w_BxT = on_BxT.astype(jnp.float32)
  w_BxT = w_BxT / jnp.maximum(w_BxT.sum(), 1.0)
  v_BxT = jnp.where(on_BxT, jnp.asarray(values_BxT, jnp.float32), 0.0)
  r_BxT = jnp.where(on_BxT, jnp.asarray(returns_BxT, jnp.float32), 0.0)

  def var(x_BxT):
    return jnp.sum(w_BxT * jnp.square(x_BxT - jnp.sum(w_BxT * x_BxT)))

  # Equal returns are detected exactly: their float32 mean need not equal them,
  # and a rounding-sized Var(R) would blow the ratio up.
  varies = (jnp.max(jnp.where(on_BxT, r_BxT, -jnp.inf))
            > jnp.min(jnp.where(on_BxT, r_BxT, jnp.inf)))
  var_r = var(r_BxT)
  varies = varies & (var_r > 0)
  explained = jnp.where(varies, 1.0 - var(r_BxT - v_BxT) / jnp.where(varies, var_r, 1.0), 0.0)
  return jax.lax.stop_gradient(
      {"value_explained_var": explained, "return_mean": jnp.sum(w_BxT * r_BxT)})
