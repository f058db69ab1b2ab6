"""Per-token log-probabilities and entropies of a sequence under a decoder.

Alignment (as in ``isojax.rl.step.Batch``): ``logp_BxT[:, t]`` is the
log-probability of ``input_ids[:, t]`` given the tokens before it, i.e. it comes
from the logits at position ``t - 1``; column 0 has no prediction and is 0.

Logits are the one [tokens, V] array that dominates memory for real vocabularies
(Qwen: V = 152k). They are computed in float32 (``ModelConfig.lm_head_fp32``,
ScaleRL's precision fix) and reduced at once to the two numbers per token the
loss needs (log-prob of the target, entropy). With ``chunk`` set, the head runs
over ``chunk`` positions at a time with a hand-written backward pass
(``chunked_head_logp_entropy``): the forward keeps only the hidden states and
two float32 numbers per token, the backward recomputes one chunk's logits at a
time and accumulates the hidden-state and head-weight gradients, so no more
than one chunk of [tokens, V] logits is ever alive. Chunks in which no token is
trained (the left-padded prompt region) are skipped outright, both ways.
"""

import functools

import jax
import jax.numpy as jnp

__all__ = ["chunked_head_logp_entropy", "logits_logp_entropy", "token_logp_entropy"]


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


def _logits(h_NxD, w, vocab_axis, dtype, temperature):
  """float32 logits / temperature of h against the head weight (either layout)."""
  dims = (((1,), (1 - vocab_axis,)), ((), ()))
  logits_NxV = jax.lax.dot_general(h_NxD.astype(dtype), w.astype(dtype), dims)
  return logits_NxV.astype(jnp.float32) / temperature


def _chunk_forward(h_NxD, w, tgt_N, vocab_axis, dtype, temperature):
  z_NxV = _logits(h_NxD, w, vocab_axis, dtype, temperature)
  m_N = jnp.max(z_NxV, axis=-1)
  e_NxV = jnp.exp(z_NxV - m_N[:, None])
  sum_N = jnp.sum(e_NxV, axis=-1)
  lse_N = m_N + jnp.log(sum_N)
  ent_N = lse_N - jnp.sum(e_NxV * z_NxV, axis=-1) / sum_N
  tgt_N = jnp.take_along_axis(z_NxV, tgt_N[:, None], axis=-1)[:, 0]
  return tgt_N - lse_N, ent_N, lse_N


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def chunked_head_logp_entropy(h_CxNxD, w, tgt_CxN, need_C, vocab_axis, dtype, temperature):
  """(log p(target), entropy) [C, N] of C chunks of N hidden states each.

  Args:
    h_CxNxD: final hidden states, chunked.
    w: the head weight, [V, D] (vocab_axis=0, tied embedding) or [D, V] (1).
    tgt_CxN: int target ids.
    need_C: bool; chunks with False give 0 and get no gradient (not computed).
    vocab_axis, dtype, temperature: static; logits are float32 after a
      `dtype` matmul, divided by `temperature`.

  The gradients (custom VJP, see module docstring) are those of the plain
  computation: with z = logits / temperature, p = softmax(z), lse = logsumexp(z)
  and H = lse - sum(p z),  d logp_t / dz = onehot_t - p  and
  dH / dz = -p (z - lse + H).
  """
  out, _ = _head_fwd(h_CxNxD, w, tgt_CxN, need_C, vocab_axis, dtype, temperature)
  return out


def _head_fwd(h_CxNxD, w, tgt_CxN, need_C, vocab_axis, dtype, temperature):
  N = h_CxNxD.shape[1]

  def body(_, xs):
    h_NxD, tgt_N, need = xs
    zeros = (jnp.zeros((N,), jnp.float32),) * 3
    return None, jax.lax.cond(
        need, lambda: _chunk_forward(h_NxD, w, tgt_N, vocab_axis, dtype, temperature),
        lambda: zeros)

  _, (logp_CxN, ent_CxN, lse_CxN) = jax.lax.scan(body, None, (h_CxNxD, tgt_CxN, need_C))
  return (logp_CxN, ent_CxN), (h_CxNxD, w, tgt_CxN, need_C, lse_CxN, ent_CxN)


def _head_bwd(vocab_axis, dtype, temperature, res, cotangents):
  h_CxNxD, w, tgt_CxN, need_C, lse_CxN, ent_CxN = res
  g_logp_CxN, g_ent_CxN = cotangents
  contract_v = ((1,), (vocab_axis,))  # dlogits [N, V] x w -> [N, D]
  contract_n = ((0,), (0,))  # [N, V] x [N, D] -> [V, D]  or  [N, D] x [N, V] -> [D, V]

  def chunk_grads(h_NxD, tgt_N, lse_N, ent_N, g_lp_N, g_ent_N):
    z_NxV = _logits(h_NxD, w, vocab_axis, dtype, temperature)
    p_NxV = jnp.exp(z_NxV - lse_N[:, None])
    onehot_NxV = jax.nn.one_hot(tgt_N, z_NxV.shape[1], dtype=jnp.float32)
    dz_NxV = (g_lp_N[:, None] * (onehot_NxV - p_NxV)
              - g_ent_N[:, None] * p_NxV * (z_NxV - lse_N[:, None] + ent_N[:, None]))
    dlogits_NxV = (dz_NxV / temperature).astype(dtype)
    hd_NxD = h_NxD.astype(dtype)
    dh_NxD = jax.lax.dot_general(dlogits_NxV, w.astype(dtype), (contract_v, ((), ())),
                                 preferred_element_type=jnp.float32)
    if vocab_axis == 0:
      dw = jax.lax.dot_general(dlogits_NxV, hd_NxD, (contract_n, ((), ())),
                               preferred_element_type=jnp.float32)
    else:
      dw = jax.lax.dot_general(hd_NxD, dlogits_NxV, (contract_n, ((), ())),
                               preferred_element_type=jnp.float32)
    return dh_NxD, dw

  def body(dw_acc, xs):
    need = xs[-1]
    dh_NxD, dw = jax.lax.cond(
        need, lambda: chunk_grads(*xs[:-1]),
        lambda: (jnp.zeros(h_CxNxD.shape[1:], jnp.float32), jnp.zeros(w.shape, jnp.float32)))
    return dw_acc + dw, dh_NxD.astype(h_CxNxD.dtype)

  xs = (h_CxNxD, tgt_CxN, lse_CxN, ent_CxN, g_logp_CxN.astype(jnp.float32),
        g_ent_CxN.astype(jnp.float32), need_C)
  dw, dh_CxNxD = jax.lax.scan(body, jnp.zeros(w.shape, jnp.float32), xs)
  return dh_CxNxD, dw.astype(w.dtype), None, None


chunked_head_logp_entropy.defvjp(_head_fwd, _head_bwd)


def token_logp_entropy(model, input_ids_BxT, attention_mask_BxT, loss_mask_BxT, *,
                       chunk=None, temperature=1.0):
  """Log-probs and entropies [B, T] of ``input_ids`` under ``model``.

  Args:
    model: an ``isojax.models.Decoder`` (``hidden_states`` + ``lm_head``; the
      chunked path uses ``lm_head_weight``).
    input_ids_BxT, attention_mask_BxT: the sequences (left-padded prompt ++
      right-padded completion).
    loss_mask_BxT: where log-probs are needed; only used to skip chunks.
    chunk: positions per lm-head chunk (each chunk covers all B rows); None
      computes all logits at once.
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

  if chunk is None or chunk >= S:
    logits_NxV = model.lm_head(h_BxSxD.reshape(B * S, D)).astype(jnp.float32)
    if temperature != 1.0:
      logits_NxV = logits_NxV / temperature
    logp_N, ent_N = logits_logp_entropy(logits_NxV, tgt_BxS.reshape(-1))
    logp_BxS, ent_BxS = logp_N.reshape(B, S), ent_N.reshape(B, S)
  else:
    n_chunks = -(-S // chunk)
    pad = n_chunks * chunk - S

    def chunked(x_BxS, *rest):  # [B, S, ...] -> [C, B * chunk, ...]
      x = jnp.pad(x_BxS, ((0, 0), (0, pad)) + ((0, 0),) * len(rest))
      return x.reshape(B, n_chunks, chunk, *rest).swapaxes(0, 1).reshape(
          n_chunks, B * chunk, *rest)

    w, vocab_axis, dtype = model.lm_head_weight()
    need_C = chunked(need_BxS).any(axis=1)
    lp_CxN, ent_CxN = chunked_head_logp_entropy(
        chunked(h_BxSxD, D), w, chunked(tgt_BxS), need_C, vocab_axis, dtype,
        float(temperature))

    def unchunked(x_CxN):
      return x_CxN.reshape(n_chunks, B, chunk).swapaxes(0, 1).reshape(B, -1)[:, :S]

    logp_BxS, ent_BxS = unchunked(lp_CxN), unchunked(ent_CxN)

  zero_Bx1 = jnp.zeros((B, 1), jnp.float32)
  return (jnp.concatenate([zero_Bx1, logp_BxS], axis=1),
          jnp.concatenate([zero_Bx1, ent_BxS], axis=1))
