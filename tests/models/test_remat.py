"""Per-layer rematerialisation: the config's policies, and one jitted, micro-batch
scanned update per policy giving the same loss and updated parameters."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend import core as jex_core

from isojax.models import Decoder, ModelConfig
from isojax.rl import Batch, LossConfig, OptimConfig, init_train_state, make_train_step

B, T, N = 4, 10, 2


def config(**kw):
  base = dict(architecture="Qwen3ForCausalLM", vocab_size=48, hidden_size=32,
              intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
              qk_norm=True)
  return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize("given, expected", [
    (True, "full"), (False, "none"), ("true", "full"), ("False", "none"), ("none", "none"),
    ("full", "full"), ("dots", "dots"), ("DOTS", "dots"), ("attention", "attention")])
def test_remat_values_normalise(given, expected):
  assert config(remat=given).remat == expected
  hf = config().to_hf_dict()
  assert ModelConfig.from_hf_dict(hf, remat=given).remat == expected


@pytest.mark.parametrize("field, value", [("remat", "sometimes"), ("remat", 1.5),
                                          ("attention", "flash")])
def test_bad_policy_names_the_field(field, value):
  with pytest.raises(ValueError, match=f"ModelConfig.{field}="):
    config(**{field: value})


def batch():
  rng = np.random.default_rng(0)
  ids = rng.integers(1, 48, (B, T)).astype(np.int32)
  attn = np.ones((B, T), np.int32)
  attn[0, :3] = 0  # left-padded prompt
  attn[1, 8:] = 0  # right-padded completion
  loss_mask = np.zeros((B, T), np.float32)
  loss_mask[:, 4:] = attn[:, 4:]
  return Batch(input_ids_BxT=jnp.asarray(ids * attn), attention_mask_BxT=jnp.asarray(attn),
               loss_mask_BxT=jnp.asarray(loss_mask),
               sampler_logp_BxT=jnp.asarray(-0.5 * loss_mask),
               rewards_B=jnp.asarray([1.0, 0.0, 0.0, 1.0]))


def one_update(remat):
  """(loss, updated params) after one update; 2 micro-batches so the step scans."""
  model = Decoder(config(remat=remat), rngs=nnx.Rngs(0))
  loss_cfg = LossConfig(entropy_coef=0.01)
  # Adam's first step with lr = eps = 1e5 is -g to ~1e-5 relative: the parameter
  # change is the gradient itself (a sign-like Adam step would hide its size).
  optim = OptimConfig(lr_base=1e5, lr_rule="constant", warmup_steps=0, weight_decay=0.0,
                      eps=1e5, max_grad_norm=None)
  step = make_train_step(model, loss_cfg, optim, batch_size=B, group_size=N,
                         micro_batch_size=2)
  state = init_train_state(model, loss_cfg, optim, batch_size=B)
  before = jax.tree.map(np.asarray, state.params)
  new, metrics = step(state, batch())
  assert float(metrics["skipped"]) == 0
  delta = [np.asarray(a) - b for a, b in zip(jax.tree.leaves(new.params),
                                             jax.tree.leaves(before))]
  return float(metrics["loss"]), delta


def test_policies_give_the_same_update():
  loss0, delta0 = one_update("none")
  scale = max(np.abs(d).max() for d in delta0)
  assert scale > 1e-3  # the update is not a no-op, so equality below means something
  for remat in ("full", "dots", "attention"):
    loss, delta = one_update(remat)
    np.testing.assert_allclose(loss, loss0, rtol=1e-6)
    for a, b in zip(delta, delta0):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * scale)


def batched_dots(jaxpr) -> int:
  """dot_generals with batch dimensions in a jaxpr and its sub-jaxprs: attention's
  (the dense projections and the lm head have none)."""
  count = 0
  for eqn in jaxpr.eqns:
    count += eqn.primitive.name == "dot_general" and bool(eqn.params["dimension_numbers"][1][0])
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(sub, jex_core.ClosedJaxpr):
          count += batched_dots(sub.jaxpr)
        elif isinstance(sub, jex_core.Jaxpr):
          count += batched_dots(sub)
  return count


@pytest.mark.parametrize("length", [10, 1024])  # the einsum and the blocked path
def test_attention_policy_never_reruns_the_attention_forward(length):
  """The gradient's attention matmuls: "full" reruns each layer's attention
  forward in the backward pass (two more than without remat, per layer);
  "attention" runs exactly the un-rematerialised layer's."""
  ids = jnp.ones((2, length), jnp.int32)

  def count(remat):
    graphdef, state = nnx.split(Decoder(config(remat=remat, num_layers=2,
                                               max_position_embeddings=length),
                                        rngs=nnx.Rngs(0)))
    loss = lambda state: nnx.merge(graphdef, state)(ids).sum()
    return batched_dots(jax.make_jaxpr(jax.grad(loss))(state).jaxpr)

  per_layer = count("none") // 2  # an unrolled loop of 2 layers; remat scans one body
  assert count("attention") == per_layer
  assert count("full") == per_layer + 2  # scores and output, recomputed


def test_bf16_compute_scanned_layers_are_as_accurate_as_the_loop():
  """remat runs the layers under a scan over states cast to the compute dtype.
  With bf16 compute and fp32 parameters its loss and gradients must be as close
  to float32 compute as the loop's are (both carry bf16 rounding noise)."""
  b = batch()

  def loss_and_grads(remat, dtype):
    model = Decoder(config(remat=remat, dtype=dtype, num_layers=3), rngs=nnx.Rngs(1))

    def loss(model):
      lp = jax.nn.log_softmax(model(b.input_ids_BxT, attention_mask=b.attention_mask_BxT))
      tok = jnp.take_along_axis(lp[:, :-1], b.input_ids_BxT[:, 1:, None], -1)[..., 0]
      return jnp.sum(tok * b.loss_mask_BxT[:, 1:])

    value, grads = jax.jit(nnx.value_and_grad(loss))(model)
    return float(value), [np.asarray(g) for g in jax.tree.leaves(grads)]

  v32, g32 = loss_and_grads("none", "float32")
  v_loop, g_loop = loss_and_grads("none", "bfloat16")
  v_scan, g_scan = loss_and_grads("full", "bfloat16")
  assert abs(v_scan - v32) <= 2 * abs(v_loop - v32) + 1e-3 * abs(v32)
  assert len(g_scan) == len(g_loop) == len(g32)
  err_scan, err_loop = [], []
  for s_, l_, r in zip(g_scan, g_loop, g32):
    assert s_.dtype == np.float32 and s_.shape == r.shape
    err_scan.append(np.linalg.norm(s_ - r) / np.linalg.norm(r))
    err_loop.append(np.linalg.norm(l_ - r) / np.linalg.norm(r))
  # Per tensor the two differ by bf16 noise (either may be the closer one);
  # on average over all parameters the scan must not be less accurate.
  assert np.mean(err_scan) <= 1.25 * np.mean(err_loop), (err_scan, err_loop)
  assert max(err_scan) < 0.05, err_scan
