"""Per-token log-probabilities and entropies of a sequence under a decoder.

Alignment (as in ``isojax.rl.step.Batch``): ``logp_BxT[:, t]`` is the
log-probability of ``input_ids[:, t]`` given the tokens before it, i.e. it comes
from the logits at position ``t - 1``; column 0 has no prediction and is 0.

Logits are the one [tokens, V] array that dominates memory for real vocabularies
(Qwen: V = 152k). They are computed in float32 (``ModelConfig.lm_head_fp32``,
ScaleRL's precision fix) and reduced at once to the two numbers per token the
loss needs (log-prob of the target, entropy). With ``chunk`` set, the lm head
runs over ``chunk`` positions at a time under ``jax.checkpoint`` (the backward
pass recomputes a chunk's logits instead of storing all of them) and chunks in
which no token is trained (the left-padded prompt region) are skipped outright.
"""

import jax
import jax.numpy as jnp

__all__ = ["logits_logp_entropy", "token_logp_entropy"]


def logits_logp_entropy(logits_NxV, targets_N):
  """(log p(target), entropy) per row of float32 logits."""
  logits_NxV = logits_NxV.astype(jnp.float32)
  # One exp pass over [N, V] serves both the normaliser and the entropy. The
  # shift is a constant (stop_gradient): the results do not depend on it.
  shift_Nx1 = jax.lax.stop_gradient(jnp.max(logits_NxV, axis=-1, keepdims=True))
  z_NxV = logits_NxV - shift_Nx1
  e_NxV = jnp.exp(z_NxV)
  sum_N = jnp.sum(e_NxV, axis=-1)
  log_sum_N = jnp.log(sum_N)
  tgt_N = jnp.take_along_axis(z_NxV, targets_N[:, None], axis=-1)[:, 0]
  entropy_N = log_sum_N - jnp.sum(e_NxV * z_NxV, axis=-1) / sum_N
  return tgt_N - log_sum_N, entropy_N


def token_logp_entropy(model, input_ids_BxT, attention_mask_BxT, loss_mask_BxT, *,
                       chunk=None, temperature=1.0):
  """Log-probs and entropies [B, T] of ``input_ids`` under ``model``.

  Args:
    model: an ``isojax.models.Decoder`` (``hidden_states`` + ``lm_head``).
    input_ids_BxT, attention_mask_BxT: the sequences (left-padded prompt ++
      right-padded completion).
    loss_mask_BxT: where log-probs are needed; only used to skip chunks.
    chunk: positions per lm-head chunk; None computes all logits at once.
    temperature: the sampling temperature. The policy that produced the
      rollouts is softmax(logits / T), so the trainer scores tokens under the
      same distribution; otherwise the sampler/trainer ratio (TIS weights, the
      logprob-gap metric) is off even fully on-policy.

  Returns:
    (logp_BxT, entropy_BxT), float32, 0 in column 0.
  """
  h_BxTxD = model.hidden_states(input_ids_BxT, attention_mask=attention_mask_BxT)
  B, T, D = h_BxTxD.shape
  # Position t-1 predicts token t; shift so outputs line up with input_ids.
  h_BxSxD, tgt_BxS = h_BxTxD[:, :-1], input_ids_BxT[:, 1:]
  need_BxS = loss_mask_BxT[:, 1:] > 0
  S = T - 1

  def head(h_NxD, tgt_N):
    logits_NxV = model.lm_head(h_NxD).astype(jnp.float32)
    if temperature != 1.0:
      logits_NxV = logits_NxV / temperature
    return logits_logp_entropy(logits_NxV, tgt_N)

  if chunk is None or chunk >= S:
    logp_N, ent_N = head(h_BxSxD.reshape(B * S, D), tgt_BxS.reshape(-1))
    logp_BxS, ent_BxS = logp_N.reshape(B, S), ent_N.reshape(B, S)
  else:
    n_chunks = -(-S // chunk)
    pad = n_chunks * chunk - S
    h_CxBxKxD = jnp.pad(h_BxSxD, ((0, 0), (0, pad), (0, 0))).reshape(
        B, n_chunks, chunk, D).swapaxes(0, 1)
    tgt_CxBxK = jnp.pad(tgt_BxS, ((0, 0), (0, pad))).reshape(
        B, n_chunks, chunk).swapaxes(0, 1)
    need_C = jnp.pad(need_BxS, ((0, 0), (0, pad))).reshape(
        B, n_chunks, chunk).any(axis=(0, 2))

    @jax.checkpoint
    def one(h_BxKxD, tgt_BxK):
      lp, ent = head(h_BxKxD.reshape(B * chunk, D), tgt_BxK.reshape(-1))
      return lp.reshape(B, chunk), ent.reshape(B, chunk)

    def skip(h_BxKxD, tgt_BxK):
      z = jnp.zeros((B, chunk), jnp.float32)
      return z, z

    def body(_, xs):
      h_BxKxD, tgt_BxK, need = xs
      return None, jax.lax.cond(need, one, skip, h_BxKxD, tgt_BxK)

    _, (lp_CxBxK, ent_CxBxK) = jax.lax.scan(body, None, (h_CxBxKxD, tgt_CxBxK, need_C))
    logp_BxS = lp_CxBxK.swapaxes(0, 1).reshape(B, -1)[:, :S]
    ent_BxS = ent_CxBxK.swapaxes(0, 1).reshape(B, -1)[:, :S]

  zero_Bx1 = jnp.zeros((B, 1), jnp.float32)
  return (jnp.concatenate([zero_Bx1, logp_BxS], axis=1),
          jnp.concatenate([zero_Bx1, ent_BxS], axis=1))
