"""Token log-probs / entropies against NumPy, and the chunked lm head against the
unchunked one (with a stand-in model: an embedding table and a projection)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from isojax.rl.logprobs import (chunked_head_logp_entropy, logits_logp_entropy,
                                 token_logp_entropy)


def np_logp_entropy(logits, targets):
  z = logits.astype(np.float64)
  lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
  logp = z - lse[:, None]
  return logp[np.arange(len(targets)), targets], -(np.exp(logp) * logp).sum(-1)


def test_logp_entropy_matches_numpy_including_extreme_logits():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(6, 11)).astype(np.float32) * 3
  logits[1] += 500.0  # overflow without the shift
  logits[2, 4] = 80.0  # nearly one-hot
  targets = rng.integers(0, 11, 6)
  lp, ent = logits_logp_entropy(jnp.asarray(logits), jnp.asarray(targets))
  rlp, rent = np_logp_entropy(logits, targets)
  np.testing.assert_allclose(np.asarray(lp), rlp, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(ent), rent, rtol=1e-4, atol=1e-5)


def test_gradients_are_softmax_formulas():
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(4, 7)).astype(np.float32)
  targets = np.array([0, 3, 6, 2])
  p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  g_lp = jax.grad(lambda x: logits_logp_entropy(x, jnp.asarray(targets))[0].sum())(
      jnp.asarray(logits))
  np.testing.assert_allclose(np.asarray(g_lp), np.eye(7)[targets] - p, atol=1e-6)
  # dH/dl_j = -p_j (log p_j + H)
  logp = np.log(p)
  h = -(p * logp).sum(-1, keepdims=True)
  g_h = jax.grad(lambda x: logits_logp_entropy(x, jnp.asarray(targets))[1].sum())(
      jnp.asarray(logits))
  np.testing.assert_allclose(np.asarray(g_h), -p * (logp + h), atol=1e-6)


class StandIn:
  """hidden_states = embedding lookup; lm_head = projection (fp32) by a weight stored
  [D, V] (vocab_axis 1, an unembedding) or [V, D] (vocab_axis 0, tied)."""

  def __init__(self, emb, proj, vocab_axis=1):
    self.emb, self.proj, self.vocab_axis = emb, proj, vocab_axis

  def hidden_states(self, ids, attention_mask=None):
    return self.emb[ids] * attention_mask[..., None]

  def lm_head(self, h):
    return h @ (self.proj if self.vocab_axis == 1 else self.proj.T)

  def lm_head_weight(self):
    return self.proj, self.vocab_axis, jnp.float32


@pytest.mark.parametrize("chunk, vocab_axis, temperature", [
    (1, 1, 1.0), (3, 0, 1.0), (4, 1, 0.7), (16, 0, 1.3), (2, 0, 0.7)])
def test_chunked_equals_unchunked_values_and_gradients(chunk, vocab_axis, temperature):
  rng = np.random.default_rng(2)
  B, T, D, V = 3, 9, 5, 13
  ids = jnp.asarray(rng.integers(0, V, (B, T)))
  attn = jnp.ones((B, T), jnp.int32).at[0, :2].set(0)
  mask = np.zeros((B, T), np.float32)
  mask[:, 6:] = 1  # chunks over the prompt region are skipped
  mask[2, 8:] = 0
  emb = jnp.asarray(rng.normal(size=(V, D)), jnp.float32)
  proj = jnp.asarray(rng.normal(size=(D, V) if vocab_axis else (V, D)), jnp.float32)
  # Distinct per-token weights on both outputs: the entropy's gradient matters
  # (entropy_coef > 0) and a mix-up of tokens or of the two outputs shows.
  w_lp = jnp.asarray(rng.uniform(0.5, 1.5, (B, T)) * mask, jnp.float32)
  w_ent = jnp.asarray(rng.uniform(-1.0, 1.0, (B, T)) * mask, jnp.float32)

  def loss(emb, proj, chunk):
    lp, ent = token_logp_entropy(StandIn(emb, proj, vocab_axis), ids, attn,
                                 jnp.asarray(mask), chunk=chunk, temperature=temperature)
    return jnp.sum(lp * w_lp + ent * w_ent), (lp, ent)

  grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True),
                 static_argnums=2)
  (v0, (lp0, ent0)), g0 = grad(emb, proj, None)
  (v1, (lp1, ent1)), g1 = grad(emb, proj, chunk)
  np.testing.assert_allclose(float(v1), float(v0), rtol=1e-6)
  on = mask > 0
  np.testing.assert_allclose(np.asarray(lp1)[on], np.asarray(lp0)[on], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(ent1)[on], np.asarray(ent0)[on], rtol=1e-6,
                             atol=1e-6)
  for a, b in zip(g1, g0):  # w.r.t. the hidden states (via emb) and the head weight
    assert np.abs(np.asarray(b)).max() > 1e-2
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
  # column 0 has no prediction; position t's log-prob comes from logits at t - 1
  assert np.all(np.asarray(lp0)[:, 0] == 0)
  head = np.asarray(proj) if vocab_axis else np.asarray(proj).T
  rlp, _ = np_logp_entropy(np.asarray(emb[ids[:, 6]]) @ head / temperature,
                           np.asarray(ids[:, 7]))
  np.testing.assert_allclose(np.asarray(lp1)[:, 7], rlp, rtol=1e-5)


@pytest.mark.parametrize("vocab_axis", [0, 1])
def test_masked_chunks_equal_skipped_chunks(vocab_axis):
  """On a GPU chunks with no trained token are computed and masked, not skipped
  by a branch: the same zeros, values and gradients, with every output weighted
  (those of the masked chunks too) so that a gradient leaking out of them shows."""
  rng = np.random.default_rng(5)
  Ch, P, D, V = 4, 6, 5, 11
  h = jnp.asarray(rng.normal(size=(Ch, P, D)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(V, D) if vocab_axis == 0 else (D, V)) * 3, jnp.float32)
  tgt = jnp.asarray(rng.integers(0, V, (Ch, P)))
  need = jnp.asarray([False, True, False, True])
  w_lp, w_ent = (jnp.asarray(rng.uniform(-1, 1, (Ch, P)), jnp.float32) for _ in range(2))

  def loss(h, w, skip):
    lp, ent = chunked_head_logp_entropy(h, w, tgt, need, vocab_axis, jnp.float32, 0.1, skip)
    return jnp.sum(lp * w_lp + ent * w_ent), (lp, ent)

  grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True), static_argnums=2)
  (v_skip, (lp_skip, ent_skip)), g_skip = grad(h, w, True)
  (v_mask, (lp_mask, ent_mask)), g_mask = grad(h, w, False)
  assert np.all(np.asarray(lp_mask)[~np.asarray(need)] == 0)
  assert np.all(np.asarray(ent_mask)[~np.asarray(need)] == 0)
  assert np.all(np.asarray(g_mask[0])[~np.asarray(need)] == 0)
  np.testing.assert_allclose(float(v_mask), float(v_skip), rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(lp_mask), np.asarray(lp_skip))
  np.testing.assert_array_equal(np.asarray(ent_mask), np.asarray(ent_skip))
  for a, b in zip(g_mask, g_skip):
    assert np.all(np.isfinite(np.asarray(a)))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_chunked_head_skips_chunks_off_a_gpu_only(monkeypatch):
  """token_logp_entropy branches over chunks off a GPU, and not on one."""
  B, T, D, V = 2, 9, 5, 13
  ids, ones = jnp.zeros((B, T), jnp.int32), jnp.ones((B, T), jnp.int32)

  def loss(emb, proj):
    return jnp.sum(token_logp_entropy(StandIn(emb, proj), ids, ones, ones, chunk=4)[0])

  def branches():  # one in the forward scan over chunks, one in the backward's
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(jnp.ones((V, D)), jnp.ones((D, V)))
    return str(jaxpr).count("cond[")

  assert branches() == 2
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert branches() == 0


def test_chunked_head_lowers_compiled_temporaries():
  """The custom backward keeps one chunk of [tokens, V] logits alive, not all."""
  B, T, D, V = 2, 1024, 64, 8192
  ids = jnp.zeros((B, T), jnp.int32)
  ones = jnp.ones((B, T), jnp.float32)
  emb = jax.ShapeDtypeStruct((V, D), jnp.float32)
  proj = jax.ShapeDtypeStruct((D, V), jnp.float32)

  def temp_bytes(chunk):
    def loss(emb, proj):
      lp, ent = token_logp_entropy(StandIn(emb, proj), ids, ones.astype(jnp.int32), ones,
                                   chunk=chunk)
      return jnp.sum(lp) + 0.01 * jnp.sum(ent)
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(emb, proj).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  full, chunked = temp_bytes(None), temp_bytes(128)
  assert full > B * T * V * 4  # at least the [tokens, V] float32 logits
  assert chunked < 0.5 * full, (chunked, full)


@pytest.mark.parametrize("temperature", [0.6, 1.3])
def test_temperature_scores_the_sampled_distribution(temperature):
  """logp must be log softmax(logits / T): the distribution the sampler drew from."""
  rng = np.random.default_rng(3)
  B, T, D, V = 2, 6, 4, 9
  ids = rng.integers(0, V, (B, T))
  emb, proj = rng.normal(size=(V, D)), rng.normal(size=(D, V))
  attn = jnp.ones((B, T), jnp.int32)
  lp, ent = token_logp_entropy(
      StandIn(jnp.asarray(emb, jnp.float32), jnp.asarray(proj, jnp.float32)),
      jnp.asarray(ids), attn, jnp.ones((B, T), jnp.float32), temperature=temperature)
  logits = (emb[ids[:, :-1]] @ proj).reshape(-1, V) / temperature
  rlp, rent = np_logp_entropy(logits, ids[:, 1:].reshape(-1))
  np.testing.assert_allclose(np.asarray(lp)[:, 1:].reshape(-1), rlp, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(ent)[:, 1:].reshape(-1), rent, rtol=1e-4, atol=1e-5)
