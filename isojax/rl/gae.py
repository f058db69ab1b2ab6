"""Generalised advantage estimation (GAE) over the trained tokens of a batch.

Each completion is an episode whose actions are its trained tokens. Columns are
aligned as in ``isojax.rl.batch.Batch``: column ``t`` is the action of emitting
``input_ids[:, t]``, ``values_BxT[:, t]`` is the critic's value of the state
before that token (computed at position ``t - 1``, see
``isojax.models.critic.token_values``), and ``mask_BxT`` marks the trained
(completion) tokens. With ``t'`` the next trained token of the row after ``t``:

    delta_t = r_t + gamma * V_t' - V_t      (V_t' = 0 after the row's last trained token)
    A_t     = delta_t + gamma * lam * A_t'
    R_t     = A_t + V_t                     (the critic's regression target)

Untrained columns (the left-padded prompt, right padding, and any masked-out
tokens between trained ones) are skipped: they neither discount nor carry a
value, as verl treats observation tokens. A row with no trained token gets
zeros. Outcome rewards sit on the last trained token (``final_token_rewards``).

With ``lam = 1`` the advantage is the discounted return minus the value
(Monte Carlo); with ``lam = 0`` it is the one-step TD error.
"""

import jax
import jax.numpy as jnp

__all__ = ["final_token_rewards", "gae", "whiten"]


def _check_bxt(name, x, shape):
  if jnp.shape(x) != shape:
    raise ValueError(f"{name} has shape {jnp.shape(x)}, expected {shape} like mask_BxT")


def final_token_rewards(rewards_B, mask_BxT):
  """[B, T] float32: each row's reward on its last trained token, 0 elsewhere.

  A row with no trained token gets no reward (it has nowhere to put it).
  """
  if jnp.ndim(mask_BxT) != 2:
    raise ValueError(f"mask_BxT must be 2-D [B, T], got shape {jnp.shape(mask_BxT)}")
  B, T = jnp.shape(mask_BxT)
  if jnp.shape(rewards_B) != (B,):
    raise ValueError(f"rewards_B has shape {jnp.shape(rewards_B)}, expected ({B},)")
  on_BxT = jnp.asarray(mask_BxT) > 0
  last_B = T - 1 - jnp.argmax(on_BxT[:, ::-1], axis=1)
  is_last_BxT = (jnp.arange(T)[None, :] == last_B[:, None]) & on_BxT
  return jnp.where(is_last_BxT, jnp.asarray(rewards_B, jnp.float32)[:, None], 0.0)


def gae(token_rewards_BxT, values_BxT, mask_BxT, *, gamma=1.0, lam=1.0):
  """Advantages and returns [B, T] by a backward ``lax.scan`` over columns.

  Args:
    token_rewards_BxT: reward of each action (``final_token_rewards`` for
      outcome rewards); read on trained tokens only.
    values_BxT: V(state before token t); read on trained tokens only, so
      whatever the critic gives on padding cannot leak in.
    mask_BxT: 1 on trained tokens.
    gamma, lam: discount and GAE lambda, in [0, 1].

  Returns:
    (advantages_BxT, returns_BxT), float32, 0 off the mask, without gradient.
  """
  if jnp.ndim(mask_BxT) != 2:
    raise ValueError(f"mask_BxT must be 2-D [B, T], got shape {jnp.shape(mask_BxT)}")
  shape = jnp.shape(mask_BxT)
  _check_bxt("token_rewards_BxT", token_rewards_BxT, shape)
  _check_bxt("values_BxT", values_BxT, shape)
  for name, x in (("gamma", gamma), ("lam", lam)):
    if not 0.0 <= x <= 1.0:
      raise ValueError(f"GAE {name}={x} must lie in [0, 1]")
  on_BxT = jnp.asarray(mask_BxT) > 0
  r_BxT = jnp.asarray(token_rewards_BxT, jnp.float32)
  v_BxT = jax.lax.stop_gradient(jnp.asarray(values_BxT, jnp.float32))

  def back(carry, xs):
    # carry: value and advantage at the next trained token of each row (0 past the
    # end). An untrained column passes it on unchanged, so whatever it holds is unused.
    next_v_B, next_a_B = carry
    r_B, v_B, on_B = xs
    a_B = r_B + gamma * next_v_B - v_B + gamma * lam * next_a_B
    carry = (jnp.where(on_B, v_B, next_v_B), jnp.where(on_B, a_B, next_a_B))
    return carry, jnp.where(on_B, a_B, 0.0)

  zeros_B = jnp.zeros(shape[:1], jnp.float32)
  _, adv_TxB = jax.lax.scan(back, (zeros_B, zeros_B), (r_BxT.T, v_BxT.T, on_BxT.T),
                            reverse=True)
  adv_BxT = adv_TxB.T
  return adv_BxT, jnp.where(on_BxT, adv_BxT + v_BxT, 0.0)


def whiten(x_BxT, mask_BxT, *, std_eps=1e-6):
  """(x - mean) / (std + std_eps) over the trained tokens of the whole batch.

  std with ddof=1 (as the "batch" estimator and verl's masked whitening); 0 off
  the mask. Call it on a whole batch, before slicing micro-batches.
  """
  _check_bxt("x_BxT", x_BxT, jnp.shape(mask_BxT))
  w_BxT = (jnp.asarray(mask_BxT) > 0).astype(jnp.float32)
  x_BxT = jnp.where(w_BxT > 0, jnp.asarray(x_BxT, jnp.float32), 0.0)
  count = w_BxT.sum()
  mean = (w_BxT * x_BxT).sum() / jnp.maximum(count, 1.0)
  var = (w_BxT * jnp.square(x_BxT - mean)).sum() / jnp.maximum(count - 1.0, 1.0)
  return w_BxT * (x_BxT - mean) / (jnp.sqrt(var) + std_eps)
