"""cuDNN fused attention (the "auto" choice on GPU) against a float64 NumPy
reference and against the XLA path, forward and backward, on padded rows.

Skipped without a GPU (CI has none). On a GPU machine:
    JAX_PLATFORMS=cuda python -m pytest tests/models/test_attention_gpu.py
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from isojax.models import Decoder, ModelConfig
from isojax.models import attention as attn_lib
from tests.models.test_attention import np_attention, valid_rows

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu",
                                reason="cuDNN attention needs an NVIDIA GPU")

B, T, N, K = 4, 384, 8, 2  # B as test_attention's: its valid_rows pads rows 1-3
PADS = (37, 101, 64, 5)  # long pads, mostly not multiples of a kernel tile


def qkv(seed, H):
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(rng.normal(size=s), jnp.bfloat16) for s in
               ((B, T, N, H), (B, T, K, H), (B, T, K, H)))


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("H", [64, 128])  # Qwen2.5-0.5B, Qwen2.5-1.5B / Qwen3
def test_cudnn_matches_numpy_on_padded_rows(H):
  q, k, v = qkv(0, H)
  valid = valid_rows(T, PADS)
  out = jax.jit(lambda *a: attn_lib.attention(*a, implementation="cudnn"))(
      q, k, v, jnp.asarray(valid))
  out = np.asarray(out, np.float32)
  assert np.isfinite(out).all()  # pad queries too: NaN there would poison gradients
  ref = np_attention(q, k, v, valid)
  for b in range(B):
    assert rel_err(out[b, valid[b]], ref[b, valid[b]]) < 1e-2, b


@pytest.mark.parametrize("H", [64, 128])
def test_cudnn_gradients_match_float32_xla(H):
  q, k, v = qkv(1, H)
  valid = jnp.asarray(valid_rows(T, PADS))
  w = jnp.asarray(np.random.default_rng(2).normal(size=(B, T, N, H)), jnp.float32)
  w = w * valid[:, :, None, None]  # the loss reads real query rows only

  def grads(impl, *qkv_):
    loss = lambda *a: jnp.sum(attn_lib.attention(*a, valid, implementation=impl)
                              .astype(jnp.float32) * w)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*qkv_)

  got = grads("cudnn", q, k, v)
  ref = grads("xla", *(x.astype(jnp.float32) for x in (q, k, v)))
  for name, a, b in zip("qkv", got, ref):
    assert np.isfinite(np.asarray(a, np.float32)).all(), name
    assert rel_err(a, b) < 2e-2, name


def test_decoder_logprob_gradients_cudnn_vs_xla():
  """A bf16 Qwen2-shaped decoder: log-probs of real tokens and their parameter
  gradients agree between attention="cudnn" and attention="xla" (blocked path)."""
  base = ModelConfig(architecture="Qwen2ForCausalLM", vocab_size=1024, hidden_size=256,
                     intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=64, tie_word_embeddings=True, attention_bias=True,
                     dtype=jnp.bfloat16, param_dtype=jnp.float32, remat="full",
                     max_position_embeddings=T)
  valid = jnp.asarray(valid_rows(T, PADS))
  ids = jnp.asarray(np.random.default_rng(3).integers(0, 1024, (B, T)), jnp.int32)
  target_on = valid[:, 1:] & valid[:, :-1]

  def run(impl):
    model = Decoder(base.replace(attention=impl), rngs=nnx.Rngs(0))

    def loss(model):
      logits = model(ids, valid).astype(jnp.float32)[:, :-1]
      logp = jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], -1)[..., 0]
      return jnp.sum(jnp.where(target_on, logp, 0.0)), logp

    (_, logp), g = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(model)
    return np.asarray(logp), jax.tree.leaves(nnx.state(g))

  logp_c, g_c = run("cudnn")
  logp_x, g_x = run("xla")
  on = np.asarray(target_on)
  assert np.isfinite(logp_c).all()
  np.testing.assert_allclose(logp_c[on], logp_x[on], atol=5e-2)
  for a, b in zip(g_c, g_x):
    assert np.isfinite(np.asarray(a)).all()
    assert rel_err(a, b) < 5e-2
