"""Attention paths (einsum, blocked flash-style, fused with rotated rows) against a
NumPy masked softmax, on unpadded, left-padded and right-padded rows, plus gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from isojax.models import attention as attn_lib
from isojax.models import load_pretrained

B, T, N, K, H = 4, 13, 4, 2, 8


def np_attention(q, k, v, valid):
  """float64 softmax(q k^T / sqrt(H)) v over visible keys; [B, T, N, H]."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  G = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)
  s = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
  t, S = np.arange(q.shape[1]), k.shape[1]
  vis = (np.arange(S)[None, :] <= t[:, None])[None] & np.asarray(valid, bool)[:, None, :]
  s = np.where(vis[:, None], s, -np.inf)
  with np.errstate(invalid="ignore"):  # pad queries see nothing: NaN, never compared
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
  return np.einsum("bnts,bsnh->btnh", p, v)


def valid_rows(T_=T, pads=(5, 4, 3, 2)):
  """Row 0 unpadded, 1 left-padded, 2 right-padded, 3 both (prompt ++ completion);
  pads: row 1's left, row 2's right, row 3's left and right pad lengths."""
  valid = np.ones((B, T_), bool)
  valid[1, :pads[0]] = False
  valid[2, T_ - pads[1]:] = False
  valid[3, :pads[2]] = False
  valid[3, T_ - pads[3]:] = False
  return valid


def qkv(seed, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(rng.normal(size=s), dtype) for s in
               ((B, T, N, H), (B, T, K, H), (B, T, K, H)))


PATHS = {
    "einsum": lambda q, k, v, valid: attn_lib.attention(q, k, v, valid),
    "blocked_4": lambda q, k, v, valid: attn_lib.attention(q, k, v, valid, block=4),
    "blocked_q3_k5": lambda q, k, v, valid: attn_lib.blocked_attention(
        q, k, v, valid, scale=H ** -0.5, block_q=3, block_k=5),
    "fused_rotated": lambda q, k, v, valid: attn_lib._fused_attention(
        q, k, v, valid, H ** -0.5, "xla"),
}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_matches_numpy_on_padded_and_unpadded_rows(path):
  q, k, v = qkv(0)
  valid = valid_rows()
  out = np.asarray(jax.jit(PATHS[path])(q, k, v, jnp.asarray(valid)))
  ref = np_attention(q, k, v, valid)
  assert np.isfinite(out).all()  # pad queries too: NaN there would poison gradients
  for b in range(B):  # a query's output matters where the query is a real token
    np.testing.assert_allclose(out[b, valid[b]], ref[b, valid[b]], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("path", ["blocked_4", "blocked_q3_k5", "fused_rotated"])
def test_gradients_match_the_einsum_path(path):
  q, k, v = qkv(1)
  valid = jnp.asarray(valid_rows())
  w = jnp.asarray(np.random.default_rng(2).normal(size=(B, T, N, H)), jnp.float32)
  w = w * valid[:, :, None, None]  # the loss reads real query rows only

  def loss(fn, q, k, v):
    return jnp.sum(fn(q, k, v, valid) * w)

  g_ref = jax.jit(jax.grad(lambda *a: loss(PATHS["einsum"], *a), argnums=(0, 1, 2)))(q, k, v)
  g = jax.jit(jax.grad(lambda *a: loss(PATHS[path], *a), argnums=(0, 1, 2)))(q, k, v)
  for name, a, b in zip("qkv", g, g_ref):
    assert np.abs(np.asarray(b)).max() > 1e-2, name
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5,
                               err_msg=name)


@pytest.mark.parametrize("path", ["blocked_4", "blocked_q3_k5"])
def test_blocked_gradient_is_its_forward_s_on_queries_that_see_nothing(path):
  """A left-pad query sees no key. The blocked kernel's backward recomputed its
  probabilities from a logsumexp that rounds to the masked score, giving p = 1
  where its forward averaged with p = 1/l: a loss reading such a query got a v
  gradient l times too big (2.0 against a finite difference of 0.5). Now the
  kernel gives such a query zeros and no gradient; the reference is the einsum
  path with those queries zeroed, differentiated by jax."""
  q, k, v = qkv(3)
  valid = jnp.asarray(valid_rows())
  sees_BxT = jnp.cumsum(valid, axis=1) > 0  # causal: some key at or before t
  w = jnp.asarray(np.random.default_rng(5).normal(size=(B, T, N, H)), jnp.float32)

  def reference(q, k, v, valid):
    return jnp.where(sees_BxT[:, :, None, None], PATHS["einsum"](q, k, v, valid), 0.0)

  def grads(fn):  # the loss reads every query, pad ones too
    return jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a, valid) * w), argnums=(0, 1, 2)))(q, k, v)

  for name, a, b in zip("qkv", grads(PATHS[path]), grads(reference)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5,
                               err_msg=name)
  out = np.asarray(PATHS[path](q, k, v, valid))
  assert not np.asarray(sees_BxT).all() and (out[~np.asarray(sees_BxT)] == 0).all()


def test_bf16_blocked_is_close_to_einsum():
  q, k, v = qkv(4, dtype=jnp.bfloat16)
  valid = jnp.asarray(valid_rows())
  a = np.asarray(PATHS["einsum"](q, k, v, valid), np.float32)
  b = np.asarray(PATHS["blocked_4"](q, k, v, valid), np.float32)
  assert b.dtype == np.float32 and np.isfinite(b).all()
  on = np.asarray(valid)
  np.testing.assert_allclose(b[on], a[on], atol=3e-2)


def test_auto_picks_xla_off_gpu_and_bad_names_raise():
  assert attn_lib.resolve_implementation("auto", jnp.bfloat16) == (
      "cudnn" if jax.default_backend() == "gpu" else "xla")
  assert attn_lib.resolve_implementation("auto", jnp.float32) == "xla"
  q, k, v = qkv(0)
  with pytest.raises(ValueError, match="'flash'"):
    attn_lib.attention(q, k, v, jnp.ones((B, T), bool), implementation="flash")
  # float32 is never cuDNN's (and off a GPU nothing is): a named error, not a
  # failure deep inside jax.nn.dot_product_attention.
  with pytest.raises(ValueError, match="'cudnn' needs a GPU and 16-bit compute"):
    attn_lib.attention(q, k, v, jnp.ones((B, T), bool), implementation="cudnn")


def test_auto_takes_cudnn_only_for_head_sizes_it_runs(monkeypatch):
  """cuDNN's flash attention refuses a head size that is not a multiple of 8 (or
  over 256) with a NotImplementedError inside jax's lowering: on a GPU "auto"
  must pick "xla" there, and an explicit "cudnn" must say which head_dim."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  for head_dim, auto in ((64, "cudnn"), (128, "cudnn"), (12, "xla"), (20, "xla"),
                         (256, "xla"), (None, "cudnn")):
    assert attn_lib.resolve_implementation("auto", jnp.bfloat16, head_dim) == auto, head_dim
    assert attn_lib.check_implementation("auto", jnp.bfloat16, head_dim) == auto, head_dim
  assert attn_lib.check_implementation("cudnn", jnp.bfloat16, 256) == "cudnn"
  for head_dim in (12, 264):
    with pytest.raises(ValueError, match=f"head_dim .*got {head_dim}"):
      attn_lib.check_implementation("cudnn", jnp.bfloat16, head_dim)


def test_decoder_on_the_blocked_path_matches_transformers(hf_dir, torch_logits, monkeypatch):
  """Left-padded batch with blocks of 8 tokens, so the 30-token full forward runs the
  blocked kernel; a cached prefill + decode (the cache's own attention) beside it."""
  monkeypatch.setattr(attn_lib, "BLOCK", 8)
  torch_model, path = hf_dir("qwen3_tied")
  model, _ = load_pretrained(path)
  rng = np.random.RandomState(2)
  lengths, P = [30, 17, 5], 30
  seqs = [rng.randint(0, 128, n) for n in lengths]
  ids = np.zeros((3, P), np.int32)
  mask = np.zeros((3, P), np.int32)
  for b, s in enumerate(seqs):
    ids[b, P - len(s):], mask[b, P - len(s):] = s, 1
  new = rng.randint(0, 128, (3, 2))

  @jax.jit
  def run(model):
    full = model(ids, attention_mask=mask)
    cache = model.init_cache(3, P + 4)
    prefill, cache = model.prefill(ids, mask, cache)
    step0, cache = model.decode_step(jnp.asarray(new[:, 0]), cache)
    step1, _ = model.decode_step(jnp.asarray(new[:, 1]), cache)
    return full, prefill, jnp.stack([step0, step1], axis=1)

  full, prefill, steps = (np.asarray(x) for x in run(model))
  assert np.isfinite(full).all()
  for b, s in enumerate(seqs):
    ref = torch_logits(torch_model, np.concatenate([s, new[b]])[None])[0]
    np.testing.assert_allclose(full[b, P - len(s):], ref[:len(s)], atol=1e-4, rtol=0)
    np.testing.assert_allclose(prefill[b, P - len(s):], ref[:len(s)], atol=1e-4, rtol=0)
    np.testing.assert_allclose(steps[b], ref[len(s):], atol=1e-4, rtol=0)
