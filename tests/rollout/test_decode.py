"""sample_token's inverse CDF against a float64 NumPy reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from isojax.rollout import decode

SAMPLED = decode.Static(max_tokens=8, greedy=False, top_k=0, use_top_p=False)


def reference_draw(logits_BxV, u_B):
  """Inverse CDF in float64: the first token whose cumulative probability reaches u."""
  z = logits_BxV.astype(np.float64)
  p = np.exp(z - z.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  cdf = np.cumsum(p, -1)
  tok = np.minimum((cdf < u_B[:, None]).sum(-1), z.shape[-1] - 1)
  return tok, cdf


# Flat CDF: one block (7, 256), no block tiles the row (4099 is prime). Two
# levels: blocks of 250 (1000) and of 128 (Qwen's 151,936).
@pytest.mark.parametrize("vocab,rows", [(7, 512), (256, 512), (4099, 512), (1000, 512),
                                        (151936, 32)])
def test_draws_equal_the_float64_inverse_cdf(vocab, rows):
  rng = np.random.default_rng(vocab)
  logits = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
  u = (1.0 - rng.random(rows)).astype(np.float32)
  tok, logp = decode.sample_token(jnp.asarray(logits), jnp.asarray(u), 1.0, 1.0, SAMPLED)
  ref, cdf = reference_draw(logits, u.astype(np.float64))
  tok, r = np.asarray(tok), np.arange(rows)
  # float32 sums may put u on the other side of a boundary it nearly touches.
  off = tok != ref
  gap = np.abs(cdf[r, np.minimum(tok, ref)] - u)
  assert off.sum() <= 2 and np.all(gap[off] < 1e-5), (off.sum(), gap[off])
  z = logits.astype(np.float64)
  lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
  np.testing.assert_allclose(np.asarray(logp), z[r, tok] - lse, atol=1e-5)


def test_the_search_skips_zero_probability_entries_and_never_runs_off_the_end():
  prob = jnp.asarray([[0.1, 0.2, 0.0, 0.3, 0.0]] * 3, jnp.float32)
  # A float32 cumsum may rise across a zero entry (index 2) by rounding.
  cdf = jnp.asarray([[0.1, 0.3, 0.3001, 0.6, 0.6]] * 3, jnp.float32)
  x = jnp.asarray([0.3, 0.30005, 0.7], jnp.float32)  # reached at 1; at 2 (p = 0); never
  np.testing.assert_array_equal(np.asarray(decode._first_eligible(cdf, x, prob)), [1, 3, 3])


@pytest.mark.parametrize("vocab", [100, 1000])  # one block; four of 250
def test_filtered_tokens_are_never_drawn_even_at_the_ends_of_u(vocab):
  rng = np.random.default_rng(0)
  logits = rng.standard_normal((6, vocab)).astype(np.float32)
  allowed = np.zeros((6, vocab), bool)
  allowed[0, [3, vocab * 7 // 10]] = True  # two tokens, in different blocks
  allowed[1, vocab - 1] = True  # only the last token
  allowed[2, 0] = True  # only the first
  allowed[3, vocab // 4 - 5:vocab // 4 + 5] = True  # across a block boundary (1000)
  allowed[4] = rng.random(vocab) < 0.5
  allowed[5, ::37] = True
  masked = jnp.asarray(np.where(allowed, logits, -np.inf))
  for u in (1e-30, 1e-7, 0.5, 1.0 - 1e-7, 1.0):
    tok, logp = decode.sample_token(masked, jnp.full((6,), u, jnp.float32), 1.0, 1.0, SAMPLED)
    tok = np.asarray(tok)
    assert allowed[np.arange(6), tok].all(), (u, tok)
    assert np.isfinite(np.asarray(logp)).all()
  # u = 1 reaches the end of the CDF: the last allowed token.
  tok, _ = decode.sample_token(masked, jnp.ones((6,), jnp.float32), 1.0, 1.0, SAMPLED)
  last = vocab - 1 - np.argmax(allowed[:, ::-1], axis=-1)
  np.testing.assert_array_equal(np.asarray(tok), last)


def test_empirical_distribution_matches_softmax_over_blocks():
  vocab = 600  # three blocks of 200
  logits = jnp.asarray(np.random.default_rng(1).standard_normal(vocab) * 2, jnp.float32)
  u = 1.0 - jax.random.uniform(jax.random.key(0), (20000,))
  tok, _ = jax.jit(lambda u: decode.sample_token(
      jnp.broadcast_to(logits, (u.shape[0], vocab)), u, 0.7, 1.0, SAMPLED))(u)
  counts = np.bincount(np.asarray(tok), minlength=vocab)
  p = np.asarray(jax.nn.softmax(logits / 0.7))
  # Mass per block and for the 20 likeliest tokens, within 5 standard errors.
  groups = [slice(b, b + 200) for b in range(0, vocab, 200)]
  groups += [slice(int(i), int(i) + 1) for i in np.argsort(-p)[:20]]
  for g in groups:
    q = p[g].sum()
    se = np.sqrt(q * (1 - q) / u.shape[0])
    assert abs(counts[g].sum() / u.shape[0] - q) < 5 * se + 1e-4, (g, counts[g].sum(), q)


def test_top_p_over_blocks_draws_the_nucleus_with_its_logprobs():
  vocab, top_p, num = 1000, 0.95, 8192  # a nucleus over two of the 250-blocks
  z = np.random.default_rng(2).standard_normal(vocab).astype(np.float32) * 2
  order = np.argsort(-z, kind="stable")
  p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
  nucleus = order[(np.cumsum(p[order]) - p[order]) < top_p]
  q = np.zeros(vocab)
  q[nucleus] = p[nucleus] / p[nucleus].sum()
  s = decode.Static(max_tokens=8, greedy=False, top_k=0, use_top_p=True)
  u = 1.0 - jax.random.uniform(jax.random.key(1), (num,))
  tok, logp = jax.jit(lambda u: decode.sample_token(
      jnp.broadcast_to(jnp.asarray(z), (num, vocab)), u, 1.0, top_p, s))(u)
  tok = np.asarray(tok)
  assert q[tok].min() > 0, "drew a token outside the nucleus"
  np.testing.assert_allclose(np.asarray(logp), np.log(q[tok]), atol=1e-4)
  counts = np.bincount(tok, minlength=vocab)
  for i in nucleus[:10]:
    se = np.sqrt(q[i] * (1 - q[i]) / num)
    assert abs(counts[i] / num - q[i]) < 5 * se, (i, counts[i], q[i])


def reference_nucleus(z_BxV, top_p):
  """Sort-based top-p in float64: descending, ties by index; keep while the mass
  before a token is below top_p."""
  keep = np.zeros(z_BxV.shape, bool)
  for b, z in enumerate(z_BxV.astype(np.float64)):
    order = np.argsort(-z, kind="stable")
    p = np.exp(z - z.max())
    p /= p.sum()
    mass_before = np.cumsum(p[order]) - p[order]
    keep[b, order[mass_before < top_p]] = True
  return keep


def test_order_keys_sort_as_the_floats_do():
  x = np.array([np.inf, 3.5, 1.0, 1e-30, 0.0, -0.0, -1e-30, -1.0, -3.5, -1e30, -np.inf],
               np.float32)
  keys = np.asarray(decode._order_keys(jnp.asarray(x[None])))[0]
  assert np.all(np.diff(keys[:5].astype(np.int64)) < 0)  # descending as x is
  assert keys[4] == keys[5]  # 0.0 and -0.0 are one value
  assert np.all(np.diff(keys[5:].astype(np.int64)) < 0)


@pytest.mark.parametrize("vocab,top_p", [(1000, 0.95), (1000, 0.5), (151936, 0.9),
                                         (64, 0.999999)])
def test_nucleus_is_the_sorted_prefix(vocab, top_p):
  rng = np.random.default_rng(vocab)
  z = (rng.standard_normal((16, vocab)) * rng.uniform(0.5, 6, (16, 1))).astype(np.float32)
  z[0] = -20.0
  z[0, 7] = 5.0  # one token holds almost all the mass: the nucleus is it alone
  got = np.asarray(decode._nucleus(jnp.asarray(z), jnp.float32(top_p)))
  want = reference_nucleus(z, top_p)
  assert got[0].sum() == 1 and got[0, 7]
  # float32 sums may move the cut by one token whose mass before nearly equals top_p.
  for b in np.nonzero((got != want).any(-1))[0]:
    zb = z[b].astype(np.float64)
    p = np.exp(zb - zb.max()) / np.exp(zb - zb.max()).sum()
    order = np.argsort(-zb, kind="stable")
    before = dict(zip(order, np.cumsum(p[order]) - p[order]))
    for i in np.nonzero(got[b] != want[b])[0]:
      assert abs(before[i] - top_p) < 1e-5, (b, i, before[i])


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_nucleus_cuts_ties_by_index(backend, monkeypatch):
  # On a GPU the ties are cut without a branch (its predicate would wait for the
  # device); the same tokens either way.
  monkeypatch.setattr(jax, "default_backend", lambda: backend)
  # 12 tokens tied at the top (p = 1/16 each) then 8 tied below (1/32 each): top-p
  # 0.3 keeps the first 5 of the top tie (the mass before the 5th is 0.25, before
  # the 6th 0.3125); 0.8 all 12 (0.75) and the first 2 of the lower tie.
  z = np.full((3, 20), np.log(0.5), np.float32)
  z[:, :12] = 0.0
  z[1] = z[1, ::-1]  # the same values, so the ties' index order is reversed
  got = np.asarray(decode._nucleus(jnp.asarray(z), jnp.float32(0.3)))
  np.testing.assert_array_equal(got, reference_nucleus(z, 0.3))
  assert list(np.nonzero(got[0])[0]) == [0, 1, 2, 3, 4]
  assert list(np.nonzero(got[1])[0]) == [8, 9, 10, 11, 12]
  got = np.asarray(decode._nucleus(jnp.asarray(z), jnp.float32(0.8)))
  np.testing.assert_array_equal(got, reference_nucleus(z, 0.8))
  assert list(np.nonzero(got[0])[0]) == list(range(14))
