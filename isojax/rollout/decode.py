"""The jitted pieces of the in-process sampler: sampling one token, admitting
prompts into free cache rows, and decoding until enough rows are free.

A fixed set of R cache rows decodes (prompt, sample) pairs, indexed
prompt-major (pair p is sample p % n of prompt p // n). Admission prefills each
distinct prompt once, copies its cache row to every row that decodes one of its
samples, and samples their first tokens; decoding then runs all R rows in a
lax.while_loop (one or `steps_per_sync` steps per iteration) until every row is
done or, when more pairs wait, until `min_free` rows are done (the host refills
them and calls again), or after `max_steps` steps (the host calls again, then
with the weights current by then).
Each pair's outputs go to its own row of the output arrays, wherever it was
decoded.

Admission and decoding are compiled apart: decoding is specialised on the
cache's read extent, admission on the number of distinct prompts, so a long
request compiles each extent's decode loop once and each prompt count's prefill
once (one program for both would compile once per (extent, prompt count) pair
met).

Randomness is keyed by pair, not by row: pair p draws its uniforms from
fold_in(key, p), one per token, so a rollout is the same whatever row, chunk or
batch size decoded it (and the decode loop runs no random-number generator).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from isojax.models.kv_cache import DEFAULT_BLOCK, KVCache


@dataclasses.dataclass(frozen=True)
class Static:
  """Everything the compiled functions are specialised on besides array shapes."""
  max_tokens: int  # power-of-two bucket; the request's own limit is an argument
  greedy: bool
  top_k: int  # 0 = no top-k filtering
  use_top_p: bool
  cache_block: int = DEFAULT_BLOCK  # slots per attention block of the cache
  steps_per_sync: int = 1  # decode steps per loop condition (see decode_steps)
  # With a mesh: the sharding of rollout rows (R, P) and of their KV cache.
  rows: Any = None
  cache_rows: Any = None


class Rows(NamedTuple):
  """The decode state of the R cache rows. A done row (finished, or never
  filled) is free: it is refilled by the next admission."""
  cache: KVCache
  prev_R: jax.Array  # int32, the token the row feeds next
  pair_R: jax.Array  # int32, the pair the row decodes
  step_R: jax.Array  # int32, tokens the row has emitted
  done_R: jax.Array  # bool
  u_RxT: jax.Array  # float32 in (0, 1], the row's pair's uniform per token


class Out(NamedTuple):
  """Per pair (P of them): what was sampled."""
  tokens_PxT: jax.Array
  logp_PxT: jax.Array
  lengths_P: jax.Array
  stopped_P: jax.Array  # a stop / EOS token ended the pair


# Most vocabulary entries per block of the two-level inverse CDF (`_inverse_cdf`).
CDF_BLOCK = 256


def _cdf_block(K: int) -> int | None:
  """The largest divisor of K in [CDF_BLOCK / 4, CDF_BLOCK] (128 for Qwen's
  151,936 entries, 256 for Llama 3's 128,256), or None: blocks that tile the
  row exactly are a reshape, not a padded copy of it."""
  return next((c for c in range(CDF_BLOCK, CDF_BLOCK // 4 - 1, -1) if K % c == 0), None)


def _first_eligible(cdf_BxK, x_B, prob_BxK):
  """Per row, the first index whose cdf reaches x among the positive-probability
  ones, else the last positive one (x past the cdf's end by rounding). A
  zero-probability index is never returned: a float32 cumsum need not repeat
  its value exactly across one, so `cdf < x` alone could land on it."""
  K = cdf_BxK.shape[-1]
  positive_BxK = prob_BxK > 0
  hit_BxK = (cdf_BxK >= x_B[:, None]) & positive_BxK
  last_B = K - 1 - jnp.argmax(positive_BxK[:, ::-1], axis=-1)
  return jnp.where(jnp.any(hit_BxK, axis=-1), jnp.argmax(hit_BxK, axis=-1), last_B)


def _inverse_cdf(cand_BxK, u_B):
  """The index where u_B in (0, 1] meets each row's CDF of softmax(cand_BxK),
  and the rows' logsumexp; returns (idx_B, lse_B).

  Above CDF_BLOCK entries, two levels, so only two passes read the whole row
  (its max; exp summed per block of `_cdf_block(K)` entries): a cumsum over the
  block sums picks the block, a cumsum over that block's entries picks the
  index. A flat cumsum over all K entries (152k for Qwen) writes and reads a
  second [B, K] array and, on XLA:CPU, runs 14x slower at 512 rows; this is the
  same draw up to float32 rounding at a boundary between two tokens.
  """
  B, K = cand_BxK.shape
  c = _cdf_block(K)
  if K <= CDF_BLOCK or c is None:  # one block, or no block tiles the row: flat
    lse_B = jax.nn.logsumexp(cand_BxK, axis=-1)
    probs_BxK = jnp.exp(cand_BxK - lse_B[:, None])
    cdf_BxK = jnp.cumsum(probs_BxK, axis=-1)
    return _first_eligible(cdf_BxK, u_B * cdf_BxK[:, -1], probs_BxK), lse_B
  m_B = jnp.max(cand_BxK, axis=-1)
  mass_BxJ = jnp.sum(jnp.exp(cand_BxK.reshape(B, -1, c) - m_B[:, None, None]), axis=-1)
  upto_BxJ = jnp.cumsum(mass_BxJ, axis=-1)
  total_B = upto_BxJ[:, -1]
  x_B = u_B * total_B
  j_B = _first_eligible(upto_BxJ, x_B, mass_BxJ)
  take = lambda a, i: jnp.take_along_axis(a, i[:, None], axis=1)[:, 0]
  # The chosen block's exps are recomputed from its logits: no [B, K] array of
  # exps with two readers, which XLA would write out.
  e_BxC = jnp.exp(jnp.take_along_axis(cand_BxK, j_B[:, None] * c + jnp.arange(c), axis=1)
                  - m_B[:, None])
  rest_B = x_B - (take(upto_BxJ, j_B) - take(mass_BxJ, j_B))
  k_B = _first_eligible(jnp.cumsum(e_BxC, axis=-1), rest_B, e_BxC)
  return j_B * c + k_B, m_B + jnp.log(total_B)


def _order_keys(x_BxV):
  """uint32 keys ordered as the float32 values are (-0.0 and 0.0 equal)."""
  bits = jax.lax.bitcast_convert_type(jnp.where(x_BxV == 0, 0.0, x_BxV), jnp.uint32)
  # Negative values: every bit flipped (a larger magnitude, a smaller key); the
  # others above all of them, by their sign bit.
  return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _nucleus(scaled_BxV, top_p):
  """Per row, where the top-p nucleus of softmax(scaled_BxV) is, without a sort.

  The nucleus is the shortest prefix of the tokens in descending order (ties by
  index) whose mass reaches top_p: the tokens above a value z*, then those at
  z* by index while the mass before each is below top_p. z* is the smallest
  value whose mass above it is below top_p, found one bit of its order key at
  a time: 32 masked sums over the row in place of a sort of it, 9x faster on
  XLA:CPU at 512 x 151,936 (`bench/sample_token.py`).
  """
  lse_Bx1 = jax.nn.logsumexp(scaled_BxV, axis=-1, keepdims=True)
  key_BxV = _order_keys(scaled_BxV)

  def mass_above(t_B):
    above_BxV = key_BxV > t_B[:, None]
    return jnp.sum(jnp.where(above_BxV, jnp.exp(scaled_BxV - lse_Bx1), 0.0), axis=-1)

  # The largest key whose mass above reaches top_p (a sum of more terms is never
  # smaller, even rounded); 0 if none does (a row whose mass rounds below top_p
  # keeps every token).
  below_B = jnp.zeros(scaled_BxV.shape[:1], jnp.uint32)
  for bit in reversed(range(32)):
    trial_B = below_B | jnp.uint32(1 << bit)
    below_B = jnp.where(mass_above(trial_B) >= top_p, trial_B, below_B)
  z_B = below_B + 1
  at_BxV = key_BxV == z_B[:, None]
  count_B = jnp.sum(at_BxV, axis=-1, dtype=jnp.int32)
  p_at_B = jnp.exp(jnp.max(jnp.where(at_BxV, scaled_BxV, -jnp.inf), axis=-1) - lse_Bx1[:, 0])
  # Tokens at z* all have p_at: the first `take` are kept, while above + r p_at < top_p.
  take_B = jnp.clip(jnp.ceil((top_p - mass_above(z_B)) / p_at_B), 1, count_B)

  def first_ties():
    return at_BxV & (jnp.cumsum(at_BxV, axis=-1, dtype=jnp.int32) <= take_B[:, None])

  if jax.default_backend() == "gpu":
    # XLA:GPU reads a branch's predicate on the host (a wait for the device, per
    # decode step); the cumsum over the row costs less there.
    ties_BxV = first_ties()
  else:  # ties past `take` are rare: skip the cumsum over the row
    ties_BxV = jax.lax.cond(jnp.any(count_B > take_B), first_ties, lambda: at_BxV)
  return (key_BxV > z_B[:, None]) | ties_BxV


def sample_token(logits_BxV, u_B, temperature, top_p, s: Static):
  """Draws one token per row; returns (token_B int32, logprob_B float32).

  Sampling is by inverse CDF with one uniform u_B in (0, 1] per row, which
  costs far less per step than a full-vocabulary Gumbel draw.
  """
  logits_BxV = logits_BxV.astype(jnp.float32)
  if s.greedy:
    tok_B = jnp.argmax(logits_BxV, axis=-1)
    logp_B = (jnp.take_along_axis(logits_BxV, tok_B[:, None], axis=-1)[:, 0]
              - jax.nn.logsumexp(logits_BxV, axis=-1))
    return tok_B.astype(jnp.int32), logp_B

  scaled_BxV = logits_BxV / temperature
  if s.top_k:
    # The top-k space is sorted (descending): top-p keeps a prefix of it, the
    # shortest whose mass reaches top_p (the first token always).
    cand_BxK, ids_BxK = jax.lax.top_k(scaled_BxV, s.top_k)
    if s.use_top_p:
      probs_BxK = jax.nn.softmax(cand_BxK, axis=-1)
      mass_before_BxK = jnp.cumsum(probs_BxK, axis=-1) - probs_BxK
      cand_BxK = jnp.where(mass_before_BxK < top_p, cand_BxK, -jnp.inf)
  elif s.use_top_p:
    cand_BxK, ids_BxK = jnp.where(_nucleus(scaled_BxV, top_p), scaled_BxV, -jnp.inf), None
  else:
    cand_BxK, ids_BxK = scaled_BxV, None

  idx_B, lse_B = _inverse_cdf(cand_BxK, u_B)
  logp_B = jnp.take_along_axis(cand_BxK, idx_B[:, None], axis=-1)[:, 0] - lse_B
  tok_B = idx_B if ids_BxK is None else jnp.take_along_axis(ids_BxK, idx_B[:, None], axis=-1)[:, 0]
  return tok_B.astype(jnp.int32), logp_B


def _constrain(s: Static, rows: Rows, out: Out) -> tuple[Rows, Out]:
  """Rollout rows are split over the mesh, never replicated; so are shared
  prompts when their count divides evenly (else each device holds them all)."""
  if s.rows is None:
    return rows, out
  c = jax.lax.with_sharding_constraint
  cache = rows.cache
  cache = cache.replace(
      k_BxKxHxS=tuple(c(k, s.cache_rows) for k in cache.k_BxKxHxS),
      v_BxKxSxH=tuple(c(v, s.cache_rows) for v in cache.v_BxKxSxH),
      positions_B=c(cache.positions_B, s.rows), valid_BxS=c(cache.valid_BxS, s.rows),
      lengths_B=c(cache.lengths_B, s.rows))
  if cache.shared_prefix and cache.prefix_valid_QxL.shape[0] % _row_splits(s) == 0:
    cache = cache.replace(
        prefix_k_QxKxHxL=tuple(c(k, s.cache_rows) for k in cache.prefix_k_QxKxHxL),
        prefix_v_QxKxLxH=tuple(c(v, s.cache_rows) for v in cache.prefix_v_QxKxLxH),
        prefix_valid_QxL=c(cache.prefix_valid_QxL, s.rows))
  rows = Rows(cache, *(c(x, s.rows) for x in rows[1:]))
  return rows, Out(*(c(x, s.rows) for x in out))


def _row_splits(s: Static) -> int:
  """The parts rollout rows are split into: the devices of the rows' mesh axes."""
  axes = s.rows.spec[0] if len(s.rows.spec) else None
  axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
  return math.prod(s.rows.mesh.shape[a] for a in axes)


def empty(cfg, s: Static, num_rows: int, max_len: int, num_pairs: int,
          num_prompts: int = 0, prompt_len: int = 0) -> tuple[Rows, Out]:
  """R free rows with a cache of `max_len` slots each, and empty outputs for P pairs.

  With `num_prompts`, the rows decode in lockstep after shared prompts of
  `prompt_len` slots (`KVCache.with_prefix`): row r is pair r, a sample of
  prompt r // (R / num_prompts), and `max_len` counts its completion only.
  """
  r, t = num_rows, s.max_tokens
  cache = KVCache.zeros(cfg.num_layers, r, max_len, cfg.num_kv_heads, cfg.head_dim, cfg.dtype,
                        block=s.cache_block, num_prefixes=num_prompts, prefix_len=prompt_len)
  rows = Rows(cache=cache, prev_R=jnp.zeros((r,), jnp.int32),
              pair_R=jnp.full((r,), num_pairs, jnp.int32),
              step_R=jnp.zeros((r,), jnp.int32), done_R=jnp.ones((r,), bool),
              u_RxT=jnp.ones((r, t), jnp.float32))
  out = Out(tokens_PxT=jnp.zeros((num_pairs, t), jnp.int32),
            logp_PxT=jnp.zeros((num_pairs, t), jnp.float32),
            lengths_P=jnp.zeros((num_pairs,), jnp.int32),
            stopped_P=jnp.zeros((num_pairs,), bool))
  return _constrain(s, rows, out)


def _emit(out: Out, live_R, pair_R, step_R, tok_R, logp_R, hit_R) -> Out:
  """Records token `step_R` of every live row under its pair (others dropped)."""
  at_R = jnp.where(live_R, pair_R, out.lengths_P.shape[0])  # out of range: dropped
  return Out(tokens_PxT=out.tokens_PxT.at[at_R, step_R].set(tok_R, mode="drop"),
             logp_PxT=out.logp_PxT.at[at_R, step_R].set(logp_R, mode="drop"),
             lengths_P=out.lengths_P.at[at_R].set(step_R + 1, mode="drop"),
             stopped_P=out.stopped_P.at[at_R].set(hit_R, mode="drop"))


# Decode steps per check of the decode loop's condition on a GPU, where each
# check waits for the device (a traced 0.5B request at one step per check kept
# an H200 busy 7 % of the time); at most 7 steps of a decode call idle.
GPU_STEPS_PER_SYNC = 8


def default_steps_per_sync() -> int:
  """`Static.steps_per_sync` for this process's backend."""
  return GPU_STEPS_PER_SYNC if jax.default_backend() == "gpu" else 1


def next_pow2(x: int) -> int:
  """The smallest power of two >= x (1 for x <= 1): the buckets shapes are
  rounded to, so nearby sizes share a compilation."""
  return 1 << max(0, int(x) - 1).bit_length()


def admission_size(num_rows: int) -> int:
  """Entries of every admission into `num_rows` rows: the rows, to a power of two
  (padding entries admit nothing), so a request compiles one admission shape."""
  return next_pow2(num_rows)


def admit(graphdef, s: Static, state, rows: Rows, out: Out, prompt_QxL, mask_QxL, src_A,
          dest_A, pair_A, active_A, stop_V, key, temperature, top_p, max_tokens
          ) -> tuple[Rows, Out]:
  """Admits A pairs into free rows: one prefill per distinct prompt, copied to its
  pairs' rows (or made their shared prefix), and each pair's first token.

  Args:
    prompt_QxL, mask_QxL: the distinct prompts of the admitted pairs, left-padded.
    src_A: the prompt (row of prompt_QxL) of each admitted pair.
    dest_A: the free cache row each pair goes to.
    pair_A: the pair's index (selects its outputs and its random stream).
    active_A: False for padding entries (ignored).

  Admission writes the rows' cache but never attends over it, so the cache's
  read extent is not compiled in: the caller passes it with `read_len` None, and
  a wider extent recompiles `decode_steps` only.
  """
  model = nnx.merge(graphdef, state)
  num_rows = rows.prev_R.shape[0]
  t_max = s.max_tokens
  dest_A = jnp.where(active_A, dest_A, num_rows)  # padding entries write nothing
  q, l = prompt_QxL.shape
  cfg = model.cfg
  pre = KVCache.zeros(cfg.num_layers, q, l, cfg.num_kv_heads, cfg.head_dim, cfg.dtype,
                      block=s.cache_block)
  logits_QxV, pre = model.prefill(prompt_QxL, mask_QxL, pre, last_only=True)
  if rows.cache.shared_prefix:  # prompt q is the prefix of rows [q n, (q + 1) n)
    c = rows.cache.with_prefix(pre)
  else:  # pre's slots fit: l <= l + max_tokens
    c = rows.cache.insert(dest_A, pre, src_A)
  u_AxT = 1.0 - jax.vmap(
      lambda p: jax.random.uniform(jax.random.fold_in(key, p), (t_max,)))(pair_A)
  tok_A, logp_A = sample_token(logits_QxV[src_A], u_AxT[:, 0], temperature, top_p, s)
  hit_A = stop_V[tok_A]
  zero_A = jnp.zeros_like(pair_A)
  out = _emit(out, active_A, pair_A, zero_A, tok_A, logp_A, hit_A)
  put = lambda x_R, x_A: x_R.at[dest_A].set(x_A, mode="drop")
  rows = Rows(cache=c, prev_R=put(rows.prev_R, tok_A), pair_R=put(rows.pair_R, pair_A),
              step_R=put(rows.step_R, zero_A + 1),
              done_R=put(rows.done_R, hit_A | (max_tokens <= 1)),
              u_RxT=put(rows.u_RxT, u_AxT))
  return _constrain(s, rows, out)


def decode_steps(graphdef, s: Static, state, rows: Rows, out: Out, stop_V, temperature,
                 top_p, max_tokens, min_free, max_steps) -> tuple[Rows, Out]:
  """Decodes every live row until all are done, or until enough are free.

  Args:
    min_free: decoding stops once this many rows are done (R + 1: run until all
      are). It also stops before a live row would write past the cache's read
      extent (the host widens it and calls again).
    max_steps: decoding stops after this many steps (a bound on the tokens a row
      emits before the host may swap weights); a dynamic int32, so changing it
      does not recompile.

  With `s.steps_per_sync` = k > 1, the loop first runs k steps per iteration
  (a fixed-count inner loop) while k more steps stay inside the read extent
  and `max_steps`, then single steps up to where the one-step loop would stop.
  XLA:GPU evaluates a while loop's condition on the host, waiting for the
  device at every iteration; a fixed-count loop runs without. Rows that finish
  inside a group idle (a done row emits nothing) until its end, so up to k - 1
  steps pass after all rows are done or `min_free` are: the same tokens, at
  the cost of those steps.
  """
  model = nnx.merge(graphdef, state)
  t_max = s.max_tokens
  k = s.steps_per_sync
  read_len = rows.cache.read_len or rows.cache.max_len

  def go_on(carry, ahead):
    """Whether `ahead` more steps may run: rows wait, and the steps' writes stay
    inside the read extent and within max_steps."""
    rows, _, steps = carry
    # A step writes slot lengths_R of every live row and attends up to it: it
    # must be inside the read extent.
    fill = jnp.max(jnp.where(rows.done_R, 0, rows.cache.lengths_B))
    return (~jnp.all(rows.done_R) & (jnp.sum(rows.done_R, dtype=jnp.int32) < min_free)
            & (fill + ahead <= read_len) & (steps <= max_steps - ahead))

  def step(carry):
    rows, out, steps = carry
    before = rows.cache
    logits_RxV, cache = model.decode_step(rows.prev_R, before)
    if not cache.shared_prefix:
      # Done rows do not advance: they rewrite one spare slot until refilled, so
      # the filled length (what attention reads) never grows past the live rows'.
      # (In lockstep every row advances: they write one slot together.)
      cache = cache.replace(
          lengths_B=jnp.where(rows.done_R, before.lengths_B, cache.lengths_B),
          positions_B=jnp.where(rows.done_R, before.positions_B, cache.positions_B))
    step_R = jnp.minimum(rows.step_R, t_max - 1)
    u_R = jnp.take_along_axis(rows.u_RxT, step_R[:, None], axis=1)[:, 0]
    tok_R, logp_R = sample_token(logits_RxV, u_R, temperature, top_p, s)
    live_R = ~rows.done_R
    hit_R = live_R & stop_V[tok_R]
    out = _emit(out, live_R, rows.pair_R, step_R, tok_R, logp_R, hit_R)
    step_R = rows.step_R + live_R.astype(jnp.int32)
    rows = rows._replace(cache=cache, prev_R=tok_R, step_R=step_R,
                         done_R=rows.done_R | hit_R | (step_R >= max_tokens))
    return rows, out, steps + 1

  carry = (rows, out, jnp.zeros((), jnp.int32))
  if k > 1:
    carry = jax.lax.while_loop(
        lambda c: go_on(c, k), lambda c: jax.lax.fori_loop(0, k, lambda _, c: step(c), c), carry)
  rows, out, _ = jax.lax.while_loop(lambda c: go_on(c, 1), step, carry)
  return rows, out
