"""Causal grouped-query attention over key slots, without a [B, T, S] mask array.

Every call has the same masking rule: query t of row b attends key s iff
`s <= t` and `kv_valid_BxS[b, s]`, kv_valid being the attention mask: causal
attention over left- and right-padded rows (RoPE positions come from the mask,
so padding shifts nothing). The mask is built from iotas inside each kernel,
never stored. Decoding with a KV cache does not come here: `KVCache.attend`
attends over the cache's filled blocks itself.

Implementations (`ModelConfig.attention`):
  * "xla": short query lengths (T <= block) compute all scores at once, as
    plain einsums; longer ones use `blocked_attention`, a flash-style kernel
    written here in JAX (below), so fp32 [B, heads, T, S] scores never exist.
  * "cudnn": `jax.nn.dot_product_attention(implementation="cudnn")`, cuDNN's
    fused flash attention on NVIDIA GPUs (bf16/fp16 only). It takes causal +
    sequence lengths, i.e. right padding only, so each row is first rotated
    left by its count of left-pad tokens (real tokens must be one contiguous
    span per row, as the samplers produce: left-padded prompt ++ right-padded
    completion) and rotated back after.
  * "auto": "cudnn" on a GPU backend for bf16/fp16 with a head size cuDNN
    takes (a multiple of 8, at most 128), "xla" otherwise.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

__all__ = ["attention", "blocked_attention", "check_implementation", "resolve_implementation",
           "BLOCK"]

# Masked scores. Finite so a row with nothing to attend to (a left-pad query)
# softmaxes to uniform instead of NaN, which would poison gradients (the blocked
# kernel gives such a row zeros instead: see _blocked_fwd).
_MASKED = float(jnp.finfo(jnp.float32).min)
# Query/key block of the blocked kernel; also the query length above which it is used.
BLOCK = 512


def _cudnn_head_dim_ok(head_dim, limit) -> bool:
  # cuDNN's flash attention takes head sizes that are multiples of 8, up to 128
  # (256 from Hopper on); jax raises NotImplementedError inside its lowering otherwise.
  return head_dim is None or (head_dim % 8 == 0 and head_dim <= limit)


def _cudnn_applies(dtype, head_dim=None) -> bool:
  """cuDNN's fused attention runs here: a GPU backend, 16-bit compute and a head
  size every GPU generation takes (128 at most, so "auto" never needs Hopper)."""
  return (jax.default_backend() == "gpu" and jnp.dtype(dtype).itemsize == 2
          and _cudnn_head_dim_ok(head_dim, 128))


def resolve_implementation(implementation: str, dtype, head_dim=None) -> str:
  """"auto" -> "cudnn" on GPU for 16-bit compute (and, given `head_dim`, a head
  size cuDNN takes), else "xla"; others unchanged."""
  if implementation != "auto":
    return implementation
  return "cudnn" if _cudnn_applies(dtype, head_dim) else "xla"


def check_implementation(implementation: str, dtype, head_dim=None) -> str:
  """The implementation `resolve_implementation` picks for `dtype` compute, or a
  ValueError naming it when it cannot run here ("cudnn" off GPU, in float32 or,
  given `head_dim`, for a head size cuDNN refuses, where
  jax.nn.dot_product_attention would fail deep in its lowering)."""
  impl = resolve_implementation(implementation, dtype, head_dim)
  if impl not in ("xla", "cudnn"):
    raise ValueError(f"attention implementation {implementation!r}: expected 'auto', "
                     "'xla' or 'cudnn'")
  if impl == "cudnn" and not _cudnn_applies(dtype):
    raise ValueError(f"attention implementation 'cudnn' needs a GPU and 16-bit compute; "
                     f"here the backend is {jax.default_backend()!r} and the compute dtype "
                     f"{jnp.dtype(dtype).name}: use 'auto' (cudnn where it applies) or 'xla'")
  if impl == "cudnn" and not _cudnn_head_dim_ok(head_dim, 256):
    raise ValueError(f"attention implementation 'cudnn' needs a head_dim that is a "
                     f"multiple of 8 and at most 256 (128 before Hopper); got {head_dim}: "
                     f"use 'auto' or 'xla'")
  return impl


def _visible(q_slot_T, s_slot_S, kv_valid_BxS):
  """[B, T, S] bool as a fusible expression of iotas (XLA does not keep it)."""
  return (s_slot_S[None, None, :] <= q_slot_T[None, :, None]) & kv_valid_BxS[:, None, :]


def _grouped(q_BxTxNxH, K):
  B, T, N, H = q_BxTxNxH.shape
  return q_BxTxNxH.reshape(B, T, K, N // K, H)


def _einsum_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, kv_valid_BxS, scale):
  """All scores at once: the reference, and the fastest for short T."""
  B, T, N, H = q_BxTxNxH.shape
  S, K = k_BxSxKxH.shape[1], k_BxSxKxH.shape[2]
  s = jnp.einsum("btkgh,bskh->bkgts", _grouped(q_BxTxNxH, K), k_BxSxKxH,
                 preferred_element_type=jnp.float32) * scale
  attend_BxTxS = _visible(jnp.arange(T), jnp.arange(S), kv_valid_BxS)
  s = jnp.where(attend_BxTxS[:, None, None], s, _MASKED)
  p = jax.nn.softmax(s, axis=-1).astype(v_BxSxKxH.dtype)
  o = jnp.einsum("bkgts,bskh->btkgh", p, v_BxSxKxH)
  return o.reshape(B, T, N, H)


# Blocked (flash) attention, after Rabe & Staats 2021, "Self-attention does not
# need O(n^2) memory", and Dao et al. 2022, "FlashAttention": queries are
# processed a block at a time; for each, key blocks are folded into a running max
# m, normaliser l and unnormalised output acc (online softmax), so only a
# [block, block] tile of scores exists. The forward keeps the output and the
# per-query logsumexp; the backward recomputes each tile's probabilities from
# that logsumexp (FlashAttention-2's backward:
# dV += P^T dO, dS = P * (dO V^T - rowsum(dO * O)), dQ += dS K, dK += dS^T Q).
# Key blocks entirely after a query block's last slot are never visited (causal),
# which halves the work; loops have traced bounds, so they are fori_loops inside
# a custom VJP rather than differentiated scans.


def _tile_mask(i, j, bq, bk, valid_BxS):
  q_slot = i * bq + jnp.arange(bq)
  s_slot = j * bk + jnp.arange(bk)
  valid_Bxbk = jax.lax.dynamic_slice_in_dim(valid_BxS, j * bk, bk, axis=1)
  return _visible(q_slot, s_slot, valid_Bxbk)[:, None, None]  # [B, 1, 1, bq, bk]


def _key_blocks_for(i, bq, bk, nk):
  """Number of key blocks query block i can see: up to its last slot."""
  return jnp.clip(((i + 1) * bq + bk - 1) // bk, 0, nk)


def _blocked_fwd(q_BxTxKxGxH, k_BxSxKxH, v_BxSxKxH, valid_BxS, scale, bq, bk):
  B, T, K, G, H = q_BxTxKxGxH.shape
  nq, nk = T // bq, k_BxSxKxH.shape[1] // bk

  def q_block(i):
    q = jax.lax.dynamic_slice_in_dim(q_BxTxKxGxH, i * bq, bq, axis=1)

    def key_block(j, carry):
      m, l, acc = carry
      k = jax.lax.dynamic_slice_in_dim(k_BxSxKxH, j * bk, bk, axis=1)
      v = jax.lax.dynamic_slice_in_dim(v_BxSxKxH, j * bk, bk, axis=1)
      s = jnp.einsum("bqkgh,bskh->bkgqs", q, k, preferred_element_type=jnp.float32) * scale
      s = jnp.where(_tile_mask(i, j, bq, bk, valid_BxS), s, _MASKED)
      m_new = jnp.maximum(m, s.max(-1))
      corr = jnp.exp(m - m_new)
      p = jnp.exp(s - m_new[..., None])
      l = l * corr + p.sum(-1)
      pv = jnp.einsum("bkgqs,bskh->bkgqh", p.astype(v.dtype), v,
                      preferred_element_type=jnp.float32)
      return m_new, l, acc * corr[..., None] + pv

    init = (jnp.full((B, K, G, bq), -jnp.inf, jnp.float32),
            jnp.zeros((B, K, G, bq), jnp.float32), jnp.zeros((B, K, G, bq, H), jnp.float32))
    # Every query block sees key block 0, and masked scores are finite: l > 0.
    m, l, acc = jax.lax.fori_loop(0, _key_blocks_for(i, bq, bk, nk), key_block, init)
    # A query that sees no key (m stayed _MASKED; real scores are above it) gets
    # zeros: its logsumexp, _MASKED + log(l), rounds to _MASKED, so the backward
    # could not recompute its uniform p = 1 / l (it got p = 1, l times too big).
    seen = m > _MASKED
    return jnp.where(seen[..., None], acc / l[..., None], 0.0), m + jnp.log(l)

  o_QxBxKxGxbqxH, lse_QxBxKxGxbq = jax.lax.map(q_block, jnp.arange(nq))
  o = o_QxBxKxGxbqxH.transpose(1, 0, 4, 2, 3, 5).reshape(B, T, K, G, H)
  lse = lse_QxBxKxGxbq.transpose(1, 2, 3, 0, 4).reshape(B, K, G, T)
  return o.astype(q_BxTxKxGxH.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _blocked(q, k, v, valid_BxS, scale, bq, bk):
  return _blocked_fwd(q, k, v, valid_BxS, scale, bq, bk)[0]


def _blocked_vjp_fwd(q, k, v, valid_BxS, scale, bq, bk):
  o, lse = _blocked_fwd(q, k, v, valid_BxS, scale, bq, bk)
  return o, (q, k, v, valid_BxS, o, lse)


def _blocked_vjp_bwd(scale, bq, bk, res, do_BxTxKxGxH):
  q_BxTxKxGxH, k_BxSxKxH, v_BxSxKxH, valid_BxS, o, lse_BxKxGxT = res
  B, T, K, G, H = q_BxTxKxGxH.shape
  nq, nk = T // bq, k_BxSxKxH.shape[1] // bk
  delta_BxKxGxT = jnp.einsum("btkgh,btkgh->bkgt", do_BxTxKxGxH.astype(jnp.float32),
                             o.astype(jnp.float32))

  def key_block(j, dq_acc):
    k = jax.lax.dynamic_slice_in_dim(k_BxSxKxH, j * bk, bk, axis=1)
    v = jax.lax.dynamic_slice_in_dim(v_BxSxKxH, j * bk, bk, axis=1)

    def q_block(i, carry):
      dq_acc, dk, dv = carry
      q = jax.lax.dynamic_slice_in_dim(q_BxTxKxGxH, i * bq, bq, axis=1)
      do = jax.lax.dynamic_slice_in_dim(do_BxTxKxGxH, i * bq, bq, axis=1)
      lse = jax.lax.dynamic_slice_in_dim(lse_BxKxGxT, i * bq, bq, axis=3)
      delta = jax.lax.dynamic_slice_in_dim(delta_BxKxGxT, i * bq, bq, axis=3)
      s = jnp.einsum("bqkgh,bskh->bkgqs", q, k, preferred_element_type=jnp.float32) * scale
      mask = _tile_mask(i, j, bq, bk, valid_BxS)
      # Masked p is 0 (a query that sees no key has a constant, zero, output).
      p = jnp.where(mask, jnp.exp(jnp.where(mask, s, _MASKED) - lse[..., None]), 0.0)
      dv = dv + jnp.einsum("bkgqs,bqkgh->bskh", p.astype(do.dtype), do,
                           preferred_element_type=jnp.float32)
      dp = jnp.einsum("bqkgh,bskh->bkgqs", do, v, preferred_element_type=jnp.float32)
      # Masked scores are constants (jnp.where): no gradient flows into them.
      ds = jnp.where(mask, p * (dp - delta[..., None]), 0.0) * scale
      ds = ds.astype(q.dtype)
      dq = jnp.einsum("bkgqs,bskh->bqkgh", ds, k, preferred_element_type=jnp.float32)
      dk = dk + jnp.einsum("bkgqs,bqkgh->bskh", ds, q, preferred_element_type=jnp.float32)
      dq_acc = jax.lax.dynamic_update_slice_in_dim(
          dq_acc, jax.lax.dynamic_slice_in_dim(dq_acc, i * bq, bq, axis=1) + dq, i * bq,
          axis=1)
      return dq_acc, dk, dv

    # The first query block that can see key block j (its last slot >= j's first).
    first = jnp.clip((j * bk) // bq, 0, nq)
    zeros = jnp.zeros((B, bk, K, H), jnp.float32)
    dq_acc, dk, dv = jax.lax.fori_loop(first, nq, q_block, (dq_acc, zeros, zeros))
    return dq_acc, (dk, dv)

  def scan_key_block(dq_acc, j):
    return key_block(j, dq_acc)

  dq, (dk_Q, dv_Q) = jax.lax.scan(scan_key_block, jnp.zeros(q_BxTxKxGxH.shape, jnp.float32),
                                  jnp.arange(nk))
  S = k_BxSxKxH.shape[1]
  dk = dk_Q.transpose(1, 0, 2, 3, 4).reshape(B, S, K, H)
  dv = dv_Q.transpose(1, 0, 2, 3, 4).reshape(B, S, K, H)
  return (dq.astype(q_BxTxKxGxH.dtype), dk.astype(k_BxSxKxH.dtype),
          dv.astype(v_BxSxKxH.dtype), None)


_blocked.defvjp(_blocked_vjp_fwd, _blocked_vjp_bwd)


def blocked_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, kv_valid_BxS, *, scale,
                      block_q=BLOCK, block_k=BLOCK):
  """Flash-style attention (see the comment above); same rule and result as the
  einsum path up to float rounding, for queries with at least one visible key
  (a query with none, a left-pad token, gets zeros and no gradient)."""
  B, T, N, H = q_BxTxNxH.shape
  S, K = k_BxSxKxH.shape[1], k_BxSxKxH.shape[2]
  bq, bk = min(block_q, T), min(block_k, S)
  pad_t, pad_s = -T % bq, -S % bk
  q = jnp.pad(_grouped(q_BxTxNxH, K), ((0, 0), (0, pad_t), (0, 0), (0, 0), (0, 0)))
  k = jnp.pad(k_BxSxKxH, ((0, 0), (0, pad_s), (0, 0), (0, 0)))
  v = jnp.pad(v_BxSxKxH, ((0, 0), (0, pad_s), (0, 0), (0, 0)))
  valid = jnp.pad(kv_valid_BxS.astype(bool), ((0, 0), (0, pad_s)))
  o = _blocked(q, k, v, valid, float(scale), bq, bk)
  return o[:, :T].reshape(B, T, N, H)


def _fused_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, valid_BxT, scale, implementation):
  """jax.nn.dot_product_attention with causal + lengths after left-aligning rows."""
  T = q_BxTxNxH.shape[1]
  valid_BxT = valid_BxT.astype(bool)
  start_B = jnp.argmax(valid_BxT, axis=1).astype(jnp.int32)  # left-pad count
  length_B = valid_BxT.sum(axis=1, dtype=jnp.int32)
  t_T = jnp.arange(T, dtype=jnp.int32)
  gather_BxT = (t_T[None] + start_B[:, None]) % T  # row b rotated left by start_B[b]
  scatter_BxT = (t_T[None] - start_B[:, None]) % T  # and back

  def rotate(x, index_BxT):
    return jnp.take_along_axis(x, index_BxT[:, :, None, None], axis=1)

  o = jax.nn.dot_product_attention(
      rotate(q_BxTxNxH, gather_BxT), rotate(k_BxTxKxH, gather_BxT),
      rotate(v_BxTxKxH, gather_BxT), scale=scale, is_causal=True,
      query_seq_lengths=length_B, key_value_seq_lengths=length_B,
      implementation=implementation)
  return rotate(o, scatter_BxT)


def attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, kv_valid_BxS, *, implementation="xla",
              block=None):
  """Causal grouped-query attention [B, T, N, H] (query head n uses kv head n // (N/K)).

  Args:
    q_BxTxNxH, k_BxSxKxH, v_BxSxKxH: queries and keys/values (RoPE applied).
    kv_valid_BxS: bool, key s of row b is a real token (the attention mask).
    implementation: "xla" | "cudnn" | "auto" (see the module docstring).
    block: query length above which "xla" runs blocked, and its block size
      (default `BLOCK`).
  """
  block = BLOCK if block is None else block
  scale = q_BxTxNxH.shape[-1] ** -0.5
  if check_implementation(implementation, q_BxTxNxH.dtype, q_BxTxNxH.shape[-1]) == "cudnn":
    return _fused_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, kv_valid_BxS, scale, "cudnn")
  if q_BxTxNxH.shape[1] > block:
    return blocked_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, kv_valid_BxS, scale=scale,
                             block_q=block, block_k=block)
  return _einsum_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, kv_valid_BxS.astype(bool), scale)
