"""Group-relative advantage estimators (GRPO family).

Rewards arrive flat, ``rewards_B`` with ``B = Bp * n``, grouped contiguously by
prompt (prompt-major: rows ``[g*n, (g+1)*n)`` are the ``n`` rollouts of prompt
``g``). Every estimator is a small pure function on the ``[Bp, n]`` view, chosen
by name from ``ESTIMATORS``: ``fn(r_BpxN, base_BpxE, std_eps, keep_Bpx1)``, where
``base_BpxE`` holds the E rollouts per prompt the baseline is taken over (E = n,
or n_est with a decoupled baseline) and ``keep_Bpx1`` marks the groups the loss
trains on (batch-level statistics are taken over those).

Decoupled baseline (IsoCompute playbook, App. G): the baseline statistics may
come from a larger set of ``n_est >= n_train`` rollouts per prompt than the
``n_train`` rollouts that enter the gradient. ``baseline_rewards_B`` then has
shape ``[Bp * n_est]``, grouped contiguously by prompt in the same prompt order
as ``rewards_B``; the training rollouts are assumed to be a subset of the
baseline rollouts of their prompt (the paper subsamples 64 of 256), which is
what makes the leave-one-out baseline of ``rloo`` well defined.

A group is zero-variance when its baseline rewards are all equal; that rule is
``zero_variance_groups``, the one definition the update step, the loss's filter
and the run's ledger all call (on NumPy arrays on the host or on traced arrays
inside jit). Such a group has advantages of exactly 0 (not ``0 / eps`` rounding
noise).

Zero-variance groups and the "batch" estimator: with ``drop_zero_variance``
(the loss's zero-variance filter drops those groups, ``zero_var_filter="all"``)
the batch-level std is taken over the remaining groups only, as if the filtered
prompts had never been in the batch (ScaleRL filters them before normalising).
Otherwise their centred rewards (all 0) stay in the statistic: they are part of
the batch the loss averages over, and with a fraction f of the rollouts in such
groups they shrink the std by about sqrt(1 - f), so every advantage is about
1 / sqrt(1 - f) larger than over the trained groups alone. The per-group
estimators are unaffected.
"""

from typing import Callable

import jax
import jax.numpy as jnp

from isojax.rl.value import VALUE_ESTIMATORS

__all__ = ["ESTIMATORS", "compute_advantages", "min_group_size", "zero_variance_groups"]


def _centred(r_BpxN, base_BpxE):
  return r_BpxN - base_BpxE.mean(axis=1, keepdims=True)


def _grpo(r_BpxN, base_BpxE, std_eps, keep_Bpx1):
  """(r - group mean) / (group std + eps), std with ddof=1 (verl, TRL, tunix)."""
  del keep_Bpx1
  std_Bpx1 = base_BpxE.std(axis=1, ddof=1, keepdims=True)
  return _centred(r_BpxN, base_BpxE) / (std_Bpx1 + std_eps)


def _drgrpo(r_BpxN, base_BpxE, std_eps, keep_Bpx1):
  """Dr. GRPO: r - group mean, no std normalisation."""
  del std_eps, keep_Bpx1
  return _centred(r_BpxN, base_BpxE)


def _batch(r_BpxN, base_BpxE, std_eps, keep_Bpx1):
  """ScaleRL batch-level normalisation: centre per group, then divide by the std
  (ddof=1) of the centred values over the batch's kept groups (of baseline
  rollouts, when a decoupled baseline is given)."""
  c_BpxE = _centred(base_BpxE, base_BpxE)
  w_BpxE = jnp.broadcast_to(keep_Bpx1, c_BpxE.shape).astype(c_BpxE.dtype)
  count = w_BpxE.sum()
  mean = (w_BpxE * c_BpxE).sum() / jnp.maximum(count, 1.0)
  var = (w_BpxE * jnp.square(c_BpxE - mean)).sum() / jnp.maximum(count - 1.0, 1.0)
  return _centred(r_BpxN, base_BpxE) / (jnp.sqrt(var) + std_eps)


def _rloo(r_BpxN, base_BpxE, std_eps, keep_Bpx1):
  """Leave-one-out: r_i - mean of the other rollouts of the same prompt.

  With a decoupled baseline the "others" are the other ``n_est - 1`` baseline
  rollouts (r_i itself is one of the baseline rollouts by convention)."""
  del std_eps, keep_Bpx1
  e = base_BpxE.shape[1]
  loo_mean_BpxN = (base_BpxE.sum(axis=1, keepdims=True) - r_BpxN) / (e - 1)
  return r_BpxN - loo_mean_BpxN


# name -> (function, minimum rollouts per group in the baseline set)
ESTIMATORS: dict[str, tuple[Callable, int]] = {
    "grpo": (_grpo, 2),
    "drgrpo": (_drgrpo, 2),
    "batch": (_batch, 2),
    "rloo": (_rloo, 2),
}


def min_group_size(estimator: str) -> int:
  """The fewest rollouts per prompt `estimator` is defined for (its baseline set).

  2 for the group baselines: with one rollout "grpo"'s std and "rloo"'s
  leave-one-out mean are undefined, and "drgrpo"'s and "batch"'s group mean is the
  reward itself, so every advantage would be 0 and only the regularisers would
  train. 1 for a critic's "gae", which needs no other rollout. Checked by the run
  and the sweep planner before any work, so such a point never reaches the
  jitted step."""
  if estimator in VALUE_ESTIMATORS:
    return 1
  if estimator not in ESTIMATORS:  # a critic's estimator is a valid choice here too
    raise ValueError(f"unknown advantage estimator {estimator!r}; "
                     f"choose from {sorted([*ESTIMATORS, *VALUE_ESTIMATORS])}")
  return ESTIMATORS[estimator][1]


def _grouped(rewards_B, group_size, baseline_rewards_B):
  """Checks shapes and returns ([Bp, n] rewards, [Bp, n_est] baseline rewards)."""
  if rewards_B.ndim != 1:
    raise ValueError(f"rewards_B must be 1-D [B], got shape {rewards_B.shape}")
  b = rewards_B.shape[0]
  if group_size < 1 or b % group_size:
    raise ValueError(f"group_size={group_size} must be >= 1 and divide "
                     f"B={b} (rewards_B shape {rewards_B.shape})")
  bp = b // group_size
  r_BpxN = rewards_B.reshape(bp, group_size)
  if baseline_rewards_B is None:
    return r_BpxN, r_BpxN
  if baseline_rewards_B.ndim != 1 or baseline_rewards_B.shape[0] % bp:
    raise ValueError(
        f"baseline_rewards_B must be 1-D [Bp*n_est] with Bp={bp} prompts; got "
        f"shape {baseline_rewards_B.shape}")
  n_est = baseline_rewards_B.shape[0] // bp
  if n_est < group_size:
    raise ValueError(f"baseline_rewards_B has n_est={n_est} rollouts per prompt, "
                     f"fewer than the n_train={group_size} trained on")
  return r_BpxN, baseline_rewards_B.reshape(bp, n_est)


def _all_equal_Bp(base_BpxE):
  # Array methods only, so NumPy arrays stay on the host and traced arrays in jit.
  return base_BpxE.max(axis=1) == base_BpxE.min(axis=1)


def zero_variance_groups(rewards_B, *, group_size, baseline_rewards_B=None):
  """Per-group flag [Bp]: all baseline rewards of the prompt are equal.

  The one definition of a zero-variance group. NumPy arrays in give a NumPy
  array out (no device work: the run's ledger calls it on the host); JAX
  arrays, traced or not, give a JAX array.

  Args:
    rewards_B: [Bp * group_size] rewards, grouped contiguously by prompt.
    group_size: n, rollouts per prompt in ``rewards_B``.
    baseline_rewards_B: optional [Bp * n_est] decoupled-baseline rewards; the
      flag then follows them, not the n trained rewards.
  """
  _, base_BpxE = _grouped(rewards_B, group_size, baseline_rewards_B)
  return _all_equal_Bp(base_BpxE)


def compute_advantages(rewards_B, *, group_size, estimator="grpo", std_eps=1e-6,
                       baseline_rewards_B=None, drop_zero_variance=False):
  """Per-rollout advantages from flat, prompt-grouped rewards.

  Args:
    rewards_B: [B] rewards, B = Bp * group_size, grouped contiguously by prompt.
    group_size: n, rollouts per prompt in ``rewards_B`` (static).
    estimator: "grpo" | "drgrpo" | "batch" | "rloo" (see ``ESTIMATORS``).
    std_eps: added to the std before dividing ("grpo", "batch").
    baseline_rewards_B: optional [Bp * n_est] rewards of n_est >= group_size
      rollouts per prompt (same prompt order, grouped contiguously) from which
      the baseline mean/std are computed instead of ``rewards_B``.
    drop_zero_variance: the loss drops zero-variance groups (its
      ``zero_var_filter="all"``); the "batch" std then leaves them out too
      (see the module docstring). No effect on the per-group estimators.

  Returns:
    [B] float32 advantages; exactly 0 for every rollout of a prompt whose
    baseline rewards are all equal.
  """
  if estimator not in ESTIMATORS:
    raise ValueError(f"unknown advantage estimator {estimator!r}; "
                     f"choose from {sorted(ESTIMATORS)}")
  fn, min_group = ESTIMATORS[estimator]
  rewards_B = jnp.asarray(rewards_B, jnp.float32)
  if baseline_rewards_B is not None:
    baseline_rewards_B = jnp.asarray(baseline_rewards_B, jnp.float32)
  r_BpxN, base_BpxE = _grouped(rewards_B, group_size, baseline_rewards_B)
  if base_BpxE.shape[1] < min_group:
    raise ValueError(f"estimator {estimator!r} needs at least {min_group} "
                     f"rollouts per prompt, got {base_BpxE.shape[1]}")
  flat_Bpx1 = _all_equal_Bp(base_BpxE)[:, None]
  keep_Bpx1 = ~flat_Bpx1 if drop_zero_variance else jnp.ones_like(flat_Bpx1)
  adv_BpxN = fn(r_BpxN, base_BpxE, std_eps, keep_Bpx1)
  # Exactly zero, not (r - fl(mean)) rounding noise amplified by 1/eps.
  adv_BpxN = jnp.where(flat_Bpx1, 0.0, adv_BpxN)
  return jax.lax.stop_gradient(adv_BpxN.reshape(-1))
