"""Per-token log-probabilities and entropies of a sequence under a decoder.

Alignment (as in ``isojax.rl.batch.Batch``): ``logp_BxT[:, t]`` is the
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
trained (the left-padded prompt region) give zeros and no gradient; off a GPU
they are skipped outright, both ways. On a GPU they are computed and masked:
XLA:GPU reads a branch's predicate on the host, waiting for the device each
time (two branches per chunk and micro-batch, 64 waits in a 1.5B-model step at
32 x 4096, whose device sat idle 5 % of the step on an H200), which costs more
than the few all-prompt chunks do.

Shape letters: B rows, T tokens, S = T - 1 predicted positions, D hidden, V
vocabulary; P positions fed to the head at once (all B * S, or one chunk's B *
chunk) and Ch chunks.
"""

import functools

import jax
import jax.numpy as jnp

__all__ = ["chunked_head_logp_entropy", "logits_logp_entropy", "token_logp_entropy"]


def logits_logp_entropy(logits_PxV, targets_P):
  """(log p(target), entropy) per row of float32 logits."""
  logits_PxV = logits_PxV.astype(jnp.float32)
  # One exp pass over [P, V] serves both the normaliser and the entropy. The
  # shift is a constant (stop_gradient): the results do not depend on it.
  shift_Px1 = jax.lax.stop_gradient(jnp.max(logits_PxV, axis=-1, keepdims=True))
  z_PxV = logits_PxV - shift_Px1
  e_PxV = jnp.exp(z_PxV)
  sum_P = jnp.sum(e_PxV, axis=-1)
  log_sum_P = jnp.log(sum_P)
  tgt_P = jnp.take_along_axis(z_PxV, targets_P[:, None], axis=-1)[:, 0]
  entropy_P = log_sum_P - jnp.sum(e_PxV * z_PxV, axis=-1) / sum_P
  return tgt_P - log_sum_P, entropy_P


def _logits(h_PxD, w, vocab_axis, dtype, temperature):
  """float32 logits / temperature of h against the head weight (either layout)."""
  dims = (((1,), (1 - vocab_axis,)), ((), ()))
  logits_PxV = jax.lax.dot_general(h_PxD.astype(dtype), w.astype(dtype), dims)
  return logits_PxV.astype(jnp.float32) / temperature


def _chunk_forward(h_PxD, w, tgt_P, vocab_axis, dtype, temperature):
  z_PxV = _logits(h_PxD, w, vocab_axis, dtype, temperature)
  m_P = jnp.max(z_PxV, axis=-1)
  e_PxV = jnp.exp(z_PxV - m_P[:, None])
  sum_P = jnp.sum(e_PxV, axis=-1)
  lse_P = m_P + jnp.log(sum_P)
  ent_P = lse_P - jnp.sum(e_PxV * z_PxV, axis=-1) / sum_P
  tgt_P = jnp.take_along_axis(z_PxV, tgt_P[:, None], axis=-1)[:, 0]
  return tgt_P - lse_P, ent_P, lse_P


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def chunked_head_logp_entropy(h_ChxPxD, w, tgt_ChxP, need_Ch, vocab_axis, dtype, temperature,
                              skip=True):
  """(log p(target), entropy) [Ch, P] of Ch chunks of P positions each.

  Args:
    h_ChxPxD: final hidden states, chunked.
    w: the head weight, [V, D] (vocab_axis=0, tied embedding) or [D, V] (1).
    tgt_ChxP: int target ids.
    need_Ch: bool; chunks with False give 0 and get no gradient.
    vocab_axis, dtype, temperature: static; logits are float32 after a
      `dtype` matmul, divided by `temperature`.
    skip: static; whether chunks with need_Ch False are skipped (a branch per
      chunk) or computed and masked.

  The gradients (custom VJP, see module docstring) are those of the plain
  computation: with z = logits / temperature, p = softmax(z), lse = logsumexp(z)
  and H = lse - sum(p z),  d logp_t / dz = onehot_t - p  and
  dH / dz = -p (z - lse + H).
  """
  out, _ = _head_fwd(h_ChxPxD, w, tgt_ChxP, need_Ch, vocab_axis, dtype, temperature, skip)
  return out


def _head_fwd(h_ChxPxD, w, tgt_ChxP, need_Ch, vocab_axis, dtype, temperature, skip):
  P = h_ChxPxD.shape[1]

  def body(_, xs):
    h_PxD, tgt_P, need = xs
    forward = lambda: _chunk_forward(h_PxD, w, tgt_P, vocab_axis, dtype, temperature)
    if skip:
      return None, jax.lax.cond(need, forward, lambda: (jnp.zeros((P,), jnp.float32),) * 3)
    return None, forward()

  _, (logp_ChxP, ent_ChxP, lse_ChxP) = jax.lax.scan(body, None, (h_ChxPxD, tgt_ChxP, need_Ch))
  res = (h_ChxPxD, w, tgt_ChxP, need_Ch, lse_ChxP, ent_ChxP)
  if not skip:  # computed everywhere; the backward keeps the finite lse of every chunk
    logp_ChxP, ent_ChxP = (jnp.where(need_Ch[:, None], x, 0.0) for x in (logp_ChxP, ent_ChxP))
  return (logp_ChxP, ent_ChxP), res


def _head_bwd(vocab_axis, dtype, temperature, skip, res, cotangents):
  h_ChxPxD, w, tgt_ChxP, need_Ch, lse_ChxP, ent_ChxP = res
  g_logp_ChxP, g_ent_ChxP = cotangents
  contract_v = ((1,), (vocab_axis,))  # dlogits [P, V] x w -> [P, D]
  contract_n = ((0,), (0,))  # [P, V] x [P, D] -> [V, D]  or  [P, D] x [P, V] -> [D, V]

  def chunk_grads(h_PxD, tgt_P, lse_P, ent_P, g_lp_P, g_ent_P):
    z_PxV = _logits(h_PxD, w, vocab_axis, dtype, temperature)
    p_PxV = jnp.exp(z_PxV - lse_P[:, None])
    onehot_PxV = jax.nn.one_hot(tgt_P, z_PxV.shape[1], dtype=jnp.float32)
    dz_PxV = (g_lp_P[:, None] * (onehot_PxV - p_PxV)
              - g_ent_P[:, None] * p_PxV * (z_PxV - lse_P[:, None] + ent_P[:, None]))
    dlogits_PxV = (dz_PxV / temperature).astype(dtype)
    hd_PxD = h_PxD.astype(dtype)
    dh_PxD = jax.lax.dot_general(dlogits_PxV, w.astype(dtype), (contract_v, ((), ())),
                                 preferred_element_type=jnp.float32)
    if vocab_axis == 0:
      dw = jax.lax.dot_general(dlogits_PxV, hd_PxD, (contract_n, ((), ())),
                               preferred_element_type=jnp.float32)
    else:
      dw = jax.lax.dot_general(hd_PxD, dlogits_PxV, (contract_n, ((), ())),
                               preferred_element_type=jnp.float32)
    return dh_PxD, dw

  def body(dw_acc, xs):
    need = xs[-1]
    if skip:
      dh_PxD, dw = jax.lax.cond(
          need, lambda: chunk_grads(*xs[:-1]),
          lambda: (jnp.zeros(h_ChxPxD.shape[1:], jnp.float32), jnp.zeros(w.shape, jnp.float32)))
    else:  # a chunk outside need_Ch gets no gradient: its cotangents are zeroed
      *args, g_lp_P, g_ent_P = xs[:-1]
      dh_PxD, dw = chunk_grads(*args, jnp.where(need, g_lp_P, 0.0), jnp.where(need, g_ent_P, 0.0))
    return dw_acc + dw, dh_PxD.astype(h_ChxPxD.dtype)

  xs = (h_ChxPxD, tgt_ChxP, lse_ChxP, ent_ChxP, g_logp_ChxP.astype(jnp.float32),
        g_ent_ChxP.astype(jnp.float32), need_Ch)
  dw, dh_ChxPxD = jax.lax.scan(body, jnp.zeros(w.shape, jnp.float32), xs)
  return dh_ChxPxD, dw.astype(w.dtype), None, None


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
      rollouts is softmax(logits / T) (with top-p and top-k off, as a run
      requires for training), so the trainer scores tokens under the same
      distribution; otherwise the sampler/trainer ratio (TIS weights, the
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
    logits_PxV = model.lm_head(h_BxSxD.reshape(B * S, D)).astype(jnp.float32)
    if temperature != 1.0:
      logits_PxV = logits_PxV / temperature
    logp_P, ent_P = logits_logp_entropy(logits_PxV, tgt_BxS.reshape(-1))
    logp_BxS, ent_BxS = logp_P.reshape(B, S), ent_P.reshape(B, S)
  else:
    n_chunks = -(-S // chunk)
    pad = n_chunks * chunk - S

    def chunked(x_BxS, *rest):  # [B, S, ...] -> [Ch, B * chunk, ...]
      x = jnp.pad(x_BxS, ((0, 0), (0, pad)) + ((0, 0),) * len(rest))
      return x.reshape(B, n_chunks, chunk, *rest).swapaxes(0, 1).reshape(
          n_chunks, B * chunk, *rest)

    w, vocab_axis, dtype = model.lm_head_weight()
    need_Ch = chunked(need_BxS).any(axis=1)
    skip = jax.default_backend() != "gpu"  # a branch waits for the device on a GPU only
    lp_ChxP, ent_ChxP = chunked_head_logp_entropy(
        chunked(h_BxSxD, D), w, chunked(tgt_BxS), need_Ch, vocab_axis, dtype,
        float(temperature), skip)

    def unchunked(x_ChxP):
      return x_ChxP.reshape(n_chunks, B, chunk).swapaxes(0, 1).reshape(B, -1)[:, :S]

    logp_BxS, ent_BxS = unchunked(lp_ChxP), unchunked(ent_ChxP)

  zero_Bx1 = jnp.zeros((B, 1), jnp.float32)
  return (jnp.concatenate([zero_Bx1, logp_BxS], axis=1),
          jnp.concatenate([zero_Bx1, ent_BxS], axis=1))
