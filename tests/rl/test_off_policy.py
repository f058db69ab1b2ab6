"""Ratios against the behaviour policy (``old_logp_BxT=None``: a stale batch).

A hand-built batch of 4 rollouts (2 prompts, both signs of advantage) whose
tokens were sampled by a policy mu that is not the current one: the current
log-probs put the ratio pi / mu on both sides of each clip. The reference is
NumPy written from the formulas, token by token, with token_mean aggregation.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from isojax.rl.losses import RATIO_METRICS, LossConfig, policy_loss

N = 2  # rollouts per prompt
# Behaviour log-probs (what the sampler returned), per token: any mix of policies.
SAMPLER_BxT = np.array([[0.0, -1.0, -2.0, -0.5, -1.5],
                        [0.0, -0.7, -1.2, -3.0, 0.0],
                        [0.0, -2.0, -0.3, -1.0, -0.8],
                        [0.0, -1.1, -0.9, 0.0, 0.0]], np.float32)
# log(pi / mu) per token: ratios 0.5 ... 2.5, inside and outside [0.8, 1.28].
LOG_RATIO_BxT = np.log(np.array([[1.0, 0.5, 1.1, 2.5, 0.9],
                                 [1.0, 1.5, 0.7, 1.2, 1.0],
                                 [1.0, 0.6, 1.4, 1.05, 3.0],
                                 [1.0, 0.95, 1.3, 1.0, 1.0]], np.float32))
MASK_BxT = np.array([[0, 1, 1, 1, 1], [0, 1, 1, 1, 0], [0, 1, 1, 1, 1], [0, 1, 1, 0, 0]],
                    np.float32)
ADV_B = np.array([1.0, -1.0, -0.5, 2.0], np.float32)
LOGP_BxT = (SAMPLER_BxT + LOG_RATIO_BxT) * MASK_BxT
CFG = dict(clip_low=0.2, clip_high=0.28, agg="token_mean", tis_cap=2.0)


def np_token_terms(kind, cfg):
  """(token losses [B, T], d loss / d logp [B, T], clip_low flags, clip_high flags)."""
  lo, hi = 1 - cfg.clip_low, 1 + cfg.clip_high
  loss, grad = np.zeros_like(LOGP_BxT), np.zeros_like(LOGP_BxT)
  flag_lo, flag_hi = np.zeros_like(LOGP_BxT), np.zeros_like(LOGP_BxT)
  for b in range(LOGP_BxT.shape[0]):
    a = float(ADV_B[b])
    tokens = [t for t in range(LOGP_BxT.shape[1]) if MASK_BxT[b, t]]
    # GSPO: one ratio per sequence, the geometric mean of its token ratios.
    seq_r = np.exp(np.mean([LOGP_BxT[b, t] - SAMPLER_BxT[b, t] for t in tokens]))
    for t in tokens:
      r = seq_r if kind == "gspo" else np.exp(LOGP_BxT[b, t] - SAMPLER_BxT[b, t])
      if kind == "cispo":
        w = min(r, hi)
        loss[b, t], grad[b, t] = -w * a * LOGP_BxT[b, t], -w * a
        flag_hi[b, t] = r > hi
        continue
      unclipped, clipped = -a * r, -a * min(max(r, lo), hi)
      loss[b, t] = max(unclipped, clipped)
      flag_lo[b, t], flag_hi[b, t] = a < 0 and r < lo, a > 0 and r > hi
      if kind == "ppo_clip" and unclipped >= clipped:
        grad[b, t] = -a * r  # d(-a exp(logp - mu)) / d logp
  return loss, grad, flag_lo, flag_hi


def jax_loss(cfg, old_logp=None):
  def loss_fn(logp):
    return policy_loss(logp, old_logp, ADV_B, MASK_BxT, cfg,
                       sampler_logp_BxT=SAMPLER_BxT, group_size=N)
  (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(jnp.asarray(LOGP_BxT))
  return float(loss), {k: float(v) for k, v in metrics.items()}, np.asarray(grad)


@pytest.mark.parametrize("kind", ["ppo_clip", "cispo", "gspo"])
def test_stale_ratio_matches_numpy_reference(kind):
  cfg = LossConfig(kind=kind, **CFG)
  loss_BxT, grad_BxT, flag_lo, flag_hi = np_token_terms(kind, cfg)
  tokens = MASK_BxT.sum()
  loss, metrics, grad = jax_loss(cfg)
  # TIS is not applied on top: pi / mu is already the whole importance weight.
  np.testing.assert_allclose(loss, loss_BxT.sum() / tokens, rtol=1e-6)
  if kind != "gspo":
    np.testing.assert_allclose(grad, grad_BxT / tokens, rtol=1e-5, atol=1e-7)
  ratio_BxT = np.exp(LOGP_BxT - SAMPLER_BxT)
  on = MASK_BxT > 0
  want = {"clip_frac_low": flag_lo.sum() / tokens, "clip_frac_high": flag_hi.sum() / tokens,
          "approx_kl_old": np.sum(on * (ratio_BxT - 1 - np.log(ratio_BxT))) / tokens,
          "tis_weight_mean": np.sum(on * np.minimum(ratio_BxT, 2.0)) / tokens,
          "tis_weight_max": 2.0,
          "tis_frac_truncated": np.sum(on & (ratio_BxT > 2.0)) / tokens,
          "logp_gap_mean": np.sum(on * np.abs(np.log(ratio_BxT))) / tokens,
          "logp_gap_max": np.log(3.0)}
  for k, v in want.items():
    np.testing.assert_allclose(metrics[k], v, rtol=1e-5, atol=1e-7, err_msg=k)
  assert set(RATIO_METRICS) <= set(metrics)


def test_the_hand_built_batch_binds_every_clip():
  """The reference above is only as good as its cases: each clip binds somewhere,
  with both signs of advantage, and CISPO's cap binds."""
  cfg = LossConfig(**CFG)
  _, _, flag_lo, flag_hi = np_token_terms("ppo_clip", cfg)
  assert flag_lo.sum() >= 2 and flag_hi.sum() >= 2
  _, _, _, cispo_hi = np_token_terms("cispo", LossConfig(kind="cispo", **CFG))
  assert cispo_hi[ADV_B < 0].sum() >= 1 and cispo_hi[ADV_B > 0].sum() >= 1
  assert (ADV_B > 0).any() and (ADV_B < 0).any()


def test_sampler_ratio_differs_from_current_ratio():
  """With old = the current forward the same batch has ratio 1 and TIS weights
  (capped at 2) on the loss: a different number, so the option is live."""
  cfg = LossConfig(kind="ppo_clip", **CFG)
  stale, _, _ = jax_loss(cfg)
  current, metrics, _ = jax_loss(cfg, old_logp=jnp.asarray(LOGP_BxT))
  tis_BxT = np.minimum(np.exp(LOGP_BxT - SAMPLER_BxT), 2.0) * MASK_BxT
  want = np.sum(-ADV_B[:, None] * tis_BxT) / MASK_BxT.sum()
  np.testing.assert_allclose(current, want, rtol=1e-6)
  assert abs(stale - current) > 1e-3
  assert metrics["clip_frac_low"] == metrics["clip_frac_high"] == 0.0


def test_sampler_ratio_needs_sampler_logp():
  with pytest.raises(ValueError, match="old_logp_BxT is None .* sampler_logp_BxT is None"):
    policy_loss(jnp.asarray(LOGP_BxT), None, ADV_B, MASK_BxT, LossConfig())
