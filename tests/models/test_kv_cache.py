"""KV-cache prefill + decode steps against the full (uncached) forward."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from isojax.models import KVCache, load_pretrained


def _left_pad(seqs, T):
  ids = np.zeros((len(seqs), T), np.int32)
  mask = np.zeros((len(seqs), T), np.int32)
  for b, s in enumerate(seqs):
    ids[b, T - len(s):] = s
    mask[b, T - len(s):] = 1
  return ids, mask


@functools.partial(jax.jit, static_argnums=5)
def _generate_with_cache(graphdef, state, prompt_BxP, mask_BxP, new_BxN, block):
  """Prefill, then feed the given tokens one at a time inside lax.while_loop (as a
  sampler does); returns prefill logits and the logits of every decode step."""
  model = nnx.merge(graphdef, state)
  B, P = prompt_BxP.shape
  N = new_BxN.shape[1]
  cfg = model.cfg
  # Spare slots: unwritten slots must not matter.
  cache = KVCache.zeros(cfg.num_layers, B, P + N + 3, cfg.num_kv_heads, cfg.head_dim,
                        cfg.dtype, block=block)
  prefill_BxPxV, cache = model.prefill(prompt_BxP, mask_BxP, cache)

  def body(carry):
    i, cache, out_NxBxV = carry
    logits_BxV, cache = nnx.merge(graphdef, state).decode_step(new_BxN[:, i], cache)
    return i + 1, cache, out_NxBxV.at[i].set(logits_BxV)

  out = jnp.zeros((N, B, model.cfg.vocab_size), jnp.float32)
  _, cache, out_NxBxV = jax.lax.while_loop(lambda c: c[0] < N, body, (0, cache, out))
  return prefill_BxPxV, out_NxBxV.transpose(1, 0, 2), cache


@pytest.mark.parametrize("family,block", [("llama3", 256), ("qwen3", 8)])
def test_prefill_and_decode_equal_full_forward(hf_dir, family, block):
  """block=8: the 21 slots span 3 blocks, so prefill and decode attention run the
  online softmax across block boundaries (and the last block partly filled)."""
  _, path = hf_dir(family)
  model, cfg = load_pretrained(path)
  rng = np.random.RandomState(0)
  P, N = 12, 6
  prompts = [rng.randint(0, 128, n) for n in (12, 7, 3)]
  prompt_BxP, mask_BxP = _left_pad(prompts, P)
  new_BxN = rng.randint(0, 128, (3, N)).astype(np.int32)

  graphdef, state = nnx.split(model)
  prefill, decode, cache = _generate_with_cache(graphdef, state, prompt_BxP, mask_BxP, new_BxN,
                                                block)

  full_ids = np.concatenate([prompt_BxP, new_BxN], 1)
  full_mask = np.concatenate([mask_BxP, np.ones_like(new_BxN)], 1)
  full = np.asarray(jax.jit(lambda m, i, a: m(i, attention_mask=a))(model, full_ids, full_mask))
  real = mask_BxP.astype(bool)
  np.testing.assert_allclose(np.asarray(prefill)[real], full[:, :P][real], atol=1e-5, rtol=0)
  np.testing.assert_allclose(np.asarray(decode), full[:, P:], atol=1e-5, rtol=0)
  # Bookkeeping: positions count real tokens only; slots past the end stay invalid.
  np.testing.assert_array_equal(np.asarray(cache.positions_B), [12 + N, 7 + N, 3 + N])
  np.testing.assert_array_equal(np.asarray(cache.lengths_B), P + N)
  assert cache.max_len == 24  # P + N + 3 rounded up to whole blocks of 8
  valid = np.asarray(cache.valid_BxS)
  np.testing.assert_array_equal(valid[:, :P], real)
  assert valid[:, P:P + N].all() and not valid[:, P + N:].any()


def test_rows_at_different_fill_levels(hf_dir):
  """Rows prefilled separately (unpadded, so each row's next slot differs) and then
  decoded together equal each sequence's full forward: writes and the causal mask
  follow each row's own fill level, as when a sampler refills a finished row."""
  _, path = hf_dir("qwen2")
  model, cfg = load_pretrained(path)
  rng = np.random.RandomState(2)
  prompts = [rng.randint(0, 128, n).astype(np.int32) for n in (11, 3, 6)]
  N = 5
  new_BxN = rng.randint(0, 128, (3, N)).astype(np.int32)
  zeros = lambda b: KVCache.zeros(cfg.num_layers, b, 24, cfg.num_kv_heads, cfg.head_dim,
                                  cfg.dtype, block=8)
  prefill = jax.jit(lambda m, i, c: m.prefill(i, jnp.ones_like(i), c))
  rows = [prefill(model, p[None], zeros(1))[1] for p in prompts]
  cache = jax.tree.map(lambda *x: jnp.concatenate(x, axis=1 if x[0].ndim == 5 else 0),
                       *rows)
  np.testing.assert_array_equal(np.asarray(cache.lengths_B), [11, 3, 6])
  step = jax.jit(lambda m, t, c: m.decode_step(t, c))
  got = []
  for i in range(N):
    logits_BxV, cache = step(model, new_BxN[:, i], cache)
    got.append(np.asarray(logits_BxV))
  # References: each sequence alone, right-padded to one width (one compilation;
  # causal attention makes trailing padding irrelevant).
  seqs = [np.concatenate([p, new_BxN[b]]) for b, p in enumerate(prompts)]
  ids = np.zeros((3, 16), np.int32)
  for b, seq in enumerate(seqs):
    ids[b, :len(seq)] = seq
  full = np.asarray(jax.jit(lambda m, i: m(i))(model, ids))
  for b, p in enumerate(prompts):
    np.testing.assert_allclose(np.stack(got)[:, b], full[b, len(p):len(p) + N], atol=1e-5,
                               rtol=0)


@pytest.mark.parametrize("block", [8, 256])
def test_shared_prefixes_equal_full_forward(hf_dir, block):
  """Two left-padded prompts prefilled once, each the shared prefix of 3 rows
  that decode different tokens in lockstep, equal every row's full forward.
  block=8: the rows' own 9 slots span 2 blocks (the online softmax loop starts
  from the prefix's state); 256: one static block."""
  _, path = hf_dir("qwen2")
  model, cfg = load_pretrained(path)
  rng = np.random.RandomState(3)
  P, N, n = 10, 6, 3
  prompts = [rng.randint(0, 128, k) for k in (10, 4)]
  prompt_QxP, mask_QxP = _left_pad(prompts, P)
  new_BxN = rng.randint(0, 128, (2 * n, N)).astype(np.int32)
  zeros = lambda b, slots: KVCache.zeros(cfg.num_layers, b, slots, cfg.num_kv_heads,
                                         cfg.head_dim, cfg.dtype, block=block)

  @jax.jit
  def decode(model, prompt, mask, new_BxN):
    _, pre = model.prefill(prompt, mask, zeros(2, P))
    cache = zeros(2 * n, N + 3).with_prefix(pre)
    logits = []
    for i in range(N):
      logits_BxV, cache = model.decode_step(new_BxN[:, i], cache)
      logits.append(logits_BxV)
    return jnp.stack(logits, 1), cache

  got, cache = decode(model, prompt_QxP, mask_QxP, new_BxN)
  # Prefix 0 (10 real slots) serves rows 0-2, prefix 1 (4) rows 3-5; all rows
  # wrote the same N own slots and continue their prompt's positions.
  np.testing.assert_array_equal(np.asarray(cache.lengths_B), N)
  np.testing.assert_array_equal(np.asarray(cache.positions_B), [10 + N] * n + [4 + N] * n)
  ids = np.concatenate([np.repeat(prompt_QxP, n, 0), new_BxN], 1)
  mask = np.concatenate([np.repeat(mask_QxP, n, 0), np.ones_like(new_BxN)], 1)
  full = np.asarray(jax.jit(lambda m, i, a: m(i, attention_mask=a))(model, ids, mask))
  np.testing.assert_allclose(np.asarray(got), full[:, P:], atol=1e-5, rtol=0)
  with pytest.raises(ValueError, match="3 prefixes for 4 rows"):
    zeros(4, 8).with_prefix(zeros(3, 8))


def test_prefill_last_only_and_chunked_prefill(hf_dir):
  """Prefill in two chunks == one prefill; last_only gives the last column."""
  _, path = hf_dir("qwen2")
  model, _ = load_pretrained(path)
  rng = np.random.RandomState(1)
  ids_BxP, mask_BxP = _left_pad([rng.randint(0, 128, n) for n in (10, 4)], 10)
  prefill = jax.jit(lambda m, i, a, c, last: m.prefill(i, a, c, last_only=last),
                    static_argnums=4)
  one, _ = prefill(model, ids_BxP, mask_BxP, model.init_cache(2, 16), False)
  last, _ = prefill(model, ids_BxP, mask_BxP, model.init_cache(2, 16), True)
  np.testing.assert_allclose(np.asarray(last), np.asarray(one)[:, -1], atol=1e-6)
  a, cache = prefill(model, ids_BxP[:, :7], mask_BxP[:, :7], model.init_cache(2, 16), False)
  b, _ = prefill(model, ids_BxP[:, 7:], mask_BxP[:, 7:], cache, False)
  np.testing.assert_allclose(np.asarray(b)[:, -1], np.asarray(one)[:, -1], atol=1e-5)


def test_init_cache_shapes(hf_dir):
  _, path = hf_dir("qwen3")
  model, cfg = load_pretrained(path, dtype=jnp.bfloat16)
  cache = model.init_cache(4, 32)
  assert isinstance(cache, KVCache) and cache.max_len == 32
  L, K, H = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
  # One array per layer, in the layouts attention's matmuls read.
  assert [k.shape for k in cache.k_BxKxHxS] == [(4, K, H, 32)] * L
  assert [v.shape for v in cache.v_BxKxSxH] == [(4, K, 32, H)] * L
  # bf16 keys/values are stored as their uint16 bits (in-place updates on XLA:CPU).
  assert cache.dtype == jnp.bfloat16
  assert all(x.dtype == jnp.uint16 for x in cache.k_BxKxHxS + cache.v_BxKxSxH)
  # A pytree (passes through jit / while_loop): 2 arrays per layer + bookkeeping.
  assert len(jax.tree.leaves(cache)) == 2 * L + 3


def test_insert_and_with_prefix_refuse_rows_stored_otherwise():
  """A float32 source row set into a bfloat16 cache (stored as uint16 bits) was
  cast to integers (1.5 -> bits 1, a denormal), and a source with fewer layers
  was zipped short (the other layers kept stale rows): both silently."""
  zeros = lambda layers=2, dtype=jnp.bfloat16, kv=2, b=2: KVCache.zeros(
      layers, b, 8, kv, 4, dtype, block=8)
  src = zeros()
  src = src.replace(k_BxKxHxS=tuple(
      jax.lax.bitcast_convert_type(jnp.full(k.shape, 1.5, jnp.bfloat16), jnp.uint16)
      for k in src.k_BxKxHxS))
  got = zeros().insert(jnp.array([0]), src, jnp.array([1]))  # alike: inserted as is
  k = jax.lax.bitcast_convert_type(got.k_BxKxHxS[1][0], jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(k, np.float32), 1.5)
  for other in (zeros(dtype=jnp.float32), zeros(layers=1), zeros(kv=1)):
    with pytest.raises(ValueError, match="KVCache.insert: source"):
      zeros().insert(jnp.array([0]), other, jnp.array([1]))
    with pytest.raises(ValueError, match="KVCache.with_prefix: source"):
      zeros(b=4).with_prefix(other)


def test_bf16_cached_attention_is_as_accurate_as_the_uncached_path():
  """The cache scaled q by 1/sqrt(head_dim) in bfloat16 (rounding q a second
  time) where the uncached path scales float32 scores: on the same bf16 inputs
  its error against float64 was 2x the uncached path's (max 4x), a gap between
  the sampler's and the trainer's log-probs. Now both scale float32 scores."""
  from tests.models.test_attention import np_attention
  from isojax.models.attention import attention
  rng = np.random.default_rng(0)
  B, T, N, K, H = 4, 64, 8, 2, 128
  q, k, v = (jnp.asarray(3 * rng.normal(size=s), jnp.bfloat16)
             for s in ((B, T, N, H), (B, T, K, H), (B, T, K, H)))
  valid = np.ones((B, T), bool)
  ref = np_attention(*(np.asarray(x, np.float32) for x in (q, k, v)), valid)
  uncached = np.asarray(attention(q, k, v, jnp.asarray(valid), implementation="xla"),
                        np.float32)
  cache, _, first_B = KVCache.zeros(1, B, T, K, H, jnp.bfloat16).start(jnp.asarray(valid))
  _, o = jax.jit(lambda c, *a: c.attend(0, *a, H ** -0.5))(cache, q, k, v, first_B)
  cached = np.asarray(o, np.float32).reshape(B, T, N, H)
  err_uncached, err_cached = np.abs(uncached - ref).mean(), np.abs(cached - ref).mean()
  assert err_cached < 1.25 * err_uncached, (err_cached, err_uncached)


def test_a_prefill_longer_than_the_cache_is_refused(hf_dir):
  """Its keys past max_len were dropped: the last positions' logits were wrong."""
  model, _ = load_pretrained(hf_dir("llama")[1])
  ids_BxT = jnp.arange(24, dtype=jnp.int32).reshape(2, 12)
  with pytest.raises(ValueError, match=r"KVCache: 12 tokens do not fit its 8 slots"):
    model.prefill(ids_BxT, jnp.ones_like(ids_BxT), model.init_cache(2, 8))
  logits, _ = model.prefill(ids_BxT, jnp.ones_like(ids_BxT), model.init_cache(2, 12))
  np.testing.assert_allclose(np.asarray(logits), np.asarray(model(ids_BxT)), atol=1e-5)
