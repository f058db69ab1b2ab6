"""Shapes before arrays: the step lowered from an abstract model, state and batch.

The abstract state must be exactly what ``init_train_state`` builds (shapes,
dtypes, shardings), and the compiled memory read from shapes must be that of
the step compiled on real arrays.
"""

import jax
import numpy as np
import pytest
from flax import nnx

from isojax import memory
from isojax import sharding as shd
from isojax.models import Decoder, ModelConfig
from isojax.rl.value import ValueConfig
from isojax.rl import (LossConfig, OptimConfig, abstract_batch, abstract_train_state,
                       init_train_state, make_train_step)
from tests.xla_cache import persistent_compilation_cache

B, T, N = 8, 16, 4
LOSS = LossConfig(kl_coef=0.1, entropy_coef=0.01)


def tiny_config(**kw):
  base = dict(architecture="Qwen2ForCausalLM", vocab_size=64, hidden_size=32,
              intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
              tie_word_embeddings=True, attention_bias=True)
  return ModelConfig(**{**base, **kw})


def test_abstract_state_is_init_train_state_without_arrays():
  mesh = shd.make_mesh(data=2, fsdp=4)
  real_model = Decoder(tiny_config(), rngs=nnx.Rngs(0))
  real = init_train_state(real_model, LOSS, OptimConfig(), batch_size=B, mesh=mesh)
  abstract = abstract_train_state(memory.abstract_decoder(tiny_config()), LOSS, OptimConfig(),
                                  batch_size=B, mesh=mesh)
  assert jax.tree.structure(real) == jax.tree.structure(abstract)
  fsdp_split = 0
  for (path, r), a in zip(jax.tree_util.tree_leaves_with_path(real), jax.tree.leaves(abstract)):
    assert isinstance(a, jax.ShapeDtypeStruct), jax.tree_util.keystr(path)
    assert (r.shape, r.dtype) == (a.shape, a.dtype), jax.tree_util.keystr(path)
    assert r.sharding.is_equivalent_to(a.sharding, r.ndim), jax.tree_util.keystr(path)
    fsdp_split += "fsdp" in str(a.sharding.spec)
  assert fsdp_split > 10  # params, both Adam moments and ref params are sharded
  # per-device bytes from shapes = what device 0 really holds
  on_dev0 = sum(s.data.nbytes for leaf in jax.tree.leaves(real)
                for s in leaf.addressable_shards if s.device == mesh.devices.flat[0])
  assert memory.per_device_bytes(abstract) == on_dev0
  # and jax.eval_shape of init_train_state itself gives the same shapes
  shapes = jax.eval_shape(lambda: init_train_state(
      memory.abstract_decoder(tiny_config()), LOSS, OptimConfig(), batch_size=B, mesh=mesh))
  assert [(x.shape, x.dtype) for x in jax.tree.leaves(shapes)] == [
      (x.shape, x.dtype) for x in jax.tree.leaves(abstract)]
  no_mesh = jax.eval_shape(lambda: init_train_state(
      memory.abstract_decoder(tiny_config()), LOSS, OptimConfig(), batch_size=B))
  assert jax.tree.map(lambda x: (x.shape, x.dtype), no_mesh) == jax.tree.map(
      lambda x: (x.shape, x.dtype), shapes)


def test_lower_from_shapes_equals_lower_from_arrays():
  mesh = shd.make_mesh(data=2, fsdp=2, tensor=2)
  abstract_model = memory.abstract_decoder(tiny_config())
  step = make_train_step(abstract_model, LOSS, OptimConfig(), batch_size=B, group_size=N,
                         micro_batch_size=4, mesh=mesh)
  state = abstract_train_state(abstract_model, LOSS, OptimConfig(), batch_size=B, mesh=mesh)
  batch = abstract_batch(B, T, mesh=mesh)
  from_shapes = memory.step_memory(step, state, batch)

  real_state = init_train_state(Decoder(tiny_config(), rngs=nnx.Rngs(0)), LOSS, OptimConfig(),
                                batch_size=B, mesh=mesh)
  real_batch = jax.tree.map(
      lambda s: jax.device_put(np.zeros(s.shape, s.dtype), s.sharding), batch)
  from_arrays = memory.step_memory(step, real_state, real_batch)
  assert from_shapes == from_arrays
  assert from_shapes.temporaries > 0 and from_shapes.state > 0
  # The report says which compiler's figure it is (a CPU compile is a GPU's guide).
  assert from_shapes.backend == "cpu"
  assert from_shapes.report().startswith("compiled update step on cpu, bytes per device:")
  # the abstract-model step runs on real arrays (the model's values are never used)
  new, metrics = step.jitted(real_state, real_batch)
  assert int(new.step) == 1 and float(metrics["tokens"]) == 0


def test_memory_report_total_and_verdict():
  mem = memory.StepMemory(state=3 * memory.GIB, batch=memory.GIB // 2, temporaries=5 * memory.GIB,
                          output_not_aliased=0, code=memory.GIB // 2)
  assert mem.total == 9 * memory.GIB
  assert mem.fits(9) and not mem.fits(8.99)
  assert "fits in 9 GiB" in mem.report(9)
  assert "does NOT fit in 8 GiB" in mem.report(8) and "112.5 %" in mem.report(8)


# The paper's scale, compiled (never run) on CPU from shapes: bf16 compute, fp32
# parameters and AdamW, per-layer remat, the lm head in 512-position chunks, no
# reference model (KL off, the hard-set recipe). Two small compiles (2 and 4
# layers) are extrapolated to the full depth (`extrapolated_step_memory`): a
# full-depth compile takes minutes on two cores.
BIG = dict(dtype="bfloat16", param_dtype="float32", remat=True)
BIG_LOSS = LossConfig(kl_coef=0.0, entropy_coef=0.0)

@pytest.mark.parametrize("remat", ["none", "full", "attention"])  # a loop; scans
def test_extrapolation_matches_a_full_compile(remat, tmp_path):
  cfg = tiny_config(num_layers=5, hidden_size=64, intermediate_size=128, remat=remat)
  kw = dict(batch_size=8, seq_len=64, group_size=N, micro_batch_size=4)
  # Probes (2, 5) put the line through the 5-layer compile itself: `full` is that
  # compile's figure whatever the lower probe, and with a persistent cache the
  # 2-layer probe is loaded from `est`'s instead of compiled again.
  with persistent_compilation_cache(str(tmp_path / "jax_cache")):
    est = memory.extrapolated_step_memory(cfg, LOSS, OptimConfig(), **kw)
    full = memory.extrapolated_step_memory(cfg, LOSS, OptimConfig(), probe_layers=(2, 5),
                                           **kw)
  assert est.state == full.state and est.batch == full.batch and est.backend == "cpu"
  np.testing.assert_allclose(est.temporaries, full.temporaries, rtol=0.1)


def test_qwen2_5_1_5b_32x4096_one_device_within_40_gib():
  cfg = memory.model_shape("qwen2.5-1.5b", **BIG)
  mem = memory.extrapolated_step_memory(
      cfg, BIG_LOSS, OptimConfig(), batch_size=32, seq_len=4096, group_size=8,
      mesh=shd.make_mesh(devices=jax.devices()[:1]), micro_batch_size=1, logits_chunk=512,
      length_buckets=1)
  print(mem.report(40))
  assert 16 < mem.state / memory.GIB < 18  # 1.54B x 12 bytes (fp32 params + 2 moments)
  assert mem.fits(40)


def test_qwen2_5_7b_64x8192_fsdp8_within_70_gib_per_device():
  cfg = memory.model_shape("qwen2.5-7b", **BIG)
  mem = memory.extrapolated_step_memory(
      cfg, BIG_LOSS, OptimConfig(), batch_size=64, seq_len=8192, group_size=8,
      mesh=shd.make_mesh(fsdp=8), micro_batch_size=8, logits_chunk=512, length_buckets=1)
  print(mem.report(70))
  assert 10 < mem.state / memory.GIB < 11  # 7.6B x 12 bytes / 8 devices
  assert mem.fits(70)


def test_ppo_qwen2_5_1_5b_policy_and_critic_32x4096_one_device_within_80_gib():
  # PPO trains a critic of the policy's size beside it: twice the parameters and
  # AdamW moments, and the critic's own forward and backward.
  cfg = memory.model_shape("qwen2.5-1.5b", **BIG)
  mem = memory.extrapolated_step_memory(
      cfg, LossConfig(adv_estimator="gae", kl_coef=0.0, entropy_coef=0.0), OptimConfig(),
      batch_size=32, seq_len=4096, group_size=8,
      mesh=shd.make_mesh(devices=jax.devices()[:1]), micro_batch_size=1, logits_chunk=512,
      length_buckets=1, value_cfg=ValueConfig(), critic_optim=OptimConfig(lr_base=1e-5))
  print(mem.report(80))
  # Policy 1.54B x 12 bytes plus a critic without the (tied) unembedding.
  assert 32 < mem.state / memory.GIB < 36
  assert mem.fits(80)
