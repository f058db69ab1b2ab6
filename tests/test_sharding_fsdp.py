"""FSDP: parameters, gradients and AdamW moments sharded over `fsdp`, activations
split over the batch, and the step equal to the unsharded one (8 fake CPU devices)."""

import jax
import numpy as np
import pytest
from flax import nnx

from isojax import memory
from isojax import sharding as shd
from isojax.models import Decoder
from isojax.rl import LossConfig, OptimConfig, abstract_batch, abstract_train_state
from isojax.rl import make_train_step
from tests.rl.test_step import N, assert_trees_close, run, tiny_config


@pytest.fixture(scope="module")
def model():
  return Decoder(tiny_config(), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def unsharded(model):
  return run(model, micro=8)


@pytest.mark.parametrize("data,fsdp,micro", [(1, 8, 8), (2, 4, 8)])
def test_fsdp_step_equals_unsharded(model, unsharded, data, fsdp, micro):
  mesh = shd.make_mesh(data=data, fsdp=fsdp, tensor=1)
  delta0, m0, _ = unsharded
  delta, m, new = run(model, micro=micro, mesh=mesh)
  assert_trees_close(delta, delta0, atol=1e-5)
  for k in m0:
    np.testing.assert_allclose(m[k], m0[k], rtol=1e-5, atol=1e-6, err_msg=k)
  # every weight matrix (embedding, kernels) is split over fsdp along its model
  # (embed) dimension, in params, ref params and both AdamW moments
  def fsdp_split(tree):
    return [jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_leaves_with_path(tree)
            if "fsdp" in str(x.sharding.spec)]

  weights = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(new.params)
             if "kernel" in jax.tree_util.keystr(p) or "'embed'" in jax.tree_util.keystr(p)]
  assert len(weights) == 1 + 2 * 7
  assert fsdp_split(new.params) == weights and fsdp_split(new.ref_params) == weights
  assert len(fsdp_split(new.opt_state)) == 2 * len(weights)


def test_fsdp_step_with_attention_remat_equals_unsharded(unsharded):
  """remat='attention' (attention outside the layer's two checkpoints) under FSDP
  gives the unsharded update without remat."""
  model = Decoder(tiny_config(remat="attention"), rngs=nnx.Rngs(0))
  delta0, m0, _ = unsharded
  delta, m, _ = run(model, micro=8, mesh=shd.make_mesh(data=2, fsdp=4, tensor=1))
  assert_trees_close(delta, delta0, atol=1e-5)
  for k in m0:
    np.testing.assert_allclose(m[k], m0[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_fsdp_divides_state_and_activation_memory():
  """Per-device state ~ 1/8, and temporaries ~ 1/8 (activations stay batch-split)."""
  cfg = tiny_config(hidden_size=64, intermediate_size=128, num_layers=2)
  model = memory.abstract_decoder(cfg)
  loss, optim = LossConfig(kl_coef=0.0, entropy_coef=0.0), OptimConfig()

  def measure(mesh, micro):
    step = make_train_step(model, loss, optim, batch_size=16, group_size=N,
                           micro_batch_size=micro, mesh=mesh, length_buckets=1)
    state = abstract_train_state(model, loss, optim, batch_size=16, mesh=mesh)
    return memory.step_memory(step, state, abstract_batch(16, 512, mesh=mesh))

  one = measure(shd.make_mesh(devices=jax.devices()[:1]), 8)
  fsdp = measure(shd.make_mesh(fsdp=8), 8)
  print(f"unsharded {one}\nfsdp=8    {fsdp}")
  assert fsdp.state < one.state / 6
  assert fsdp.temporaries < one.temporaries / 4, (fsdp.temporaries, one.temporaries)
