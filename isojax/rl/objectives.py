"""The token terms of the GRPO-family objectives, each a small pure function in a
table keyed by name: ``PG_LOSSES`` (ppo_clip / cispo / cispo_two_sided / gspo,
see ``isojax.rl.losses.LossConfig.kind``) and ``KL_ESTIMATORS`` (k1 / k2 / k3).
``isojax.rl.losses`` aggregates them into the loss.

A PG loss takes (logp, old_logp, adv_BxT, mask, cfg), ``cfg`` any object with
the clip fields of ``LossConfig``; ``adv_BxT`` is [B, 1] (one advantage per
rollout) or [B, T] (per token: a critic's GAE), broadcast against the tokens. It
returns the per-token loss and its clip flags ({name: bool [B, T]}, named as
``losses.RATIO_FIELDS``).
"""

import functools
from typing import Callable

import jax
import jax.numpy as jnp

__all__ = ["KL_ESTIMATORS", "PG_LOSSES"]


def _clipped_surrogate(log_ratio_BxT, adv_BxT, cfg):
  """-min(r A, clip(r) A), optionally dual-clipped at -c A for A < 0.

  The branch is chosen with `where` on the clip flags, not with min/max: at a
  tie (r exactly on a bound, e.g. r = 1 on-policy with a zero clip) autodiff
  splits a min's gradient between its operands, while PPO's gradient there is
  the unclipped one. Where a bound binds (or A = 0) the token's loss is a
  constant, and the unclipped branch sees r = 1 there: exp of a stale token's
  log-ratio may overflow, and `where` would turn its zero cotangent into
  0 * inf = NaN, losing the whole update for a token that has no gradient.
  """
  lo, hi = 1.0 - cfg.clip_low, 1.0 + cfg.clip_high
  r_BxT = jax.lax.stop_gradient(jnp.exp(log_ratio_BxT))
  neg, pos = adv_BxT < 0, adv_BxT > 0
  flags = {"clip_low": neg & (r_BxT < lo), "clip_high": pos & (r_BxT > hi)}
  clipped_BxT = flags["clip_low"] | flags["clip_high"]
  bound_loss_BxT = -adv_BxT * jnp.where(pos, hi, lo)
  frozen_BxT = clipped_BxT | (adv_BxT == 0)
  if cfg.clip_dual is not None:
    cap_BxT = -adv_BxT * cfg.clip_dual
    flags["clip_dual"] = neg & (jnp.where(clipped_BxT, bound_loss_BxT, -adv_BxT * r_BxT)
                                > cap_BxT)
    frozen_BxT = frozen_BxT | flags["clip_dual"]
  ratio_BxT = jnp.exp(jnp.where(frozen_BxT, 0.0, log_ratio_BxT))
  loss_BxT = jnp.where(clipped_BxT, bound_loss_BxT, -adv_BxT * ratio_BxT)
  if cfg.clip_dual is not None:
    loss_BxT = jnp.where(flags["clip_dual"], cap_BxT, loss_BxT)
  return loss_BxT, flags


def _ppo_clip(logp_BxT, old_logp_BxT, adv_BxT, mask_BxT, cfg):
  return _clipped_surrogate(logp_BxT - old_logp_BxT, adv_BxT, cfg)


def _gspo(logp_BxT, old_logp_BxT, adv_BxT, mask_BxT, cfg):
  # s_i = exp(mean_t log(pi/pi_old)): one ratio per sequence, given to its tokens.
  len_Bx1 = jnp.maximum(mask_BxT.sum(axis=1, keepdims=True), 1.0)
  log_s_Bx1 = ((logp_BxT - old_logp_BxT) * mask_BxT).sum(axis=1, keepdims=True) / len_Bx1
  return _clipped_surrogate(jnp.broadcast_to(log_s_Bx1, logp_BxT.shape), adv_BxT, cfg)


def _cispo(logp_BxT, old_logp_BxT, adv_BxT, mask_BxT, cfg, *, two_sided=False):
  """-sg(w) A log pi with w = min(r, 1 + clip_high) (or clipped on both sides)."""
  del mask_BxT
  hi = 1.0 + cfg.clip_high
  ratio_BxT = jax.lax.stop_gradient(jnp.exp(logp_BxT - old_logp_BxT))
  weight_BxT = jnp.minimum(ratio_BxT, hi)
  flags = {"clip_high": ratio_BxT > hi}
  if two_sided:
    lo = 1.0 - cfg.clip_low
    weight_BxT = jnp.maximum(weight_BxT, lo)
    flags["clip_low"] = ratio_BxT < lo
  return -weight_BxT * adv_BxT * logp_BxT, flags


# name -> fn(logp, old_logp, adv_BxT, mask, cfg) -> (token loss_BxT, {flag: bool_BxT})
PG_LOSSES: dict[str, Callable] = {
    "ppo_clip": _ppo_clip,
    "cispo": _cispo,
    "cispo_two_sided": functools.partial(_cispo, two_sided=True),
    "gspo": _gspo,
}


def _k1(logp_BxT, ref_logp_BxT):
  return logp_BxT - ref_logp_BxT


def _k2(logp_BxT, ref_logp_BxT):
  return 0.5 * jnp.square(logp_BxT - ref_logp_BxT)


# k3's clamps, as veRL's "low_var_kl" (the framework the playbook trained with, App.
# A): the log-ratio to [-20, 20] and the estimate to at most 10. Unclamped, one
# token the policy has made e^-12 times less likely than the reference scores 1.6e5
# and carries nearly all of a batch's gradient; clamped, it carries none.
K3_LOG_RATIO_CLAMP = 20.0
K3_CLAMP = 10.0


def _k3(logp_BxT, ref_logp_BxT):
  d = jnp.clip(ref_logp_BxT - logp_BxT, -K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
  return jnp.minimum(jnp.exp(d) - d - 1.0, K3_CLAMP)


# Schulman's estimators of the value of KL(pi || pi_ref) from tokens sampled from
# pi. Differentiated as a loss term (samples held fixed) their expected gradients
# differ: k1's is zero (the score function's mean), k2's is that of
# KL(pi || pi_ref), k3's (GRPO's choice) that of KL(pi_ref || pi).
KL_ESTIMATORS: dict[str, Callable] = {"k1": _k1, "k2": _k2, "k3": _k3}
