"""Mesh construction and logical -> mesh axis rules, on 8 fake CPU devices."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from isojax import sharding
from isojax.models import Decoder, ModelConfig

TINY = dict(architecture="Qwen2ForCausalLM", vocab_size=128, hidden_size=64,
            intermediate_size=96, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
            attention_bias=True)


def test_make_mesh_sizes_and_errors():
  mesh = sharding.make_mesh(data=2, fsdp=-1, tensor=2)
  assert mesh.axis_names == ("data", "fsdp", "tensor")
  assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
  assert sharding.make_mesh().shape["fsdp"] == 8
  assert sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1]).size == 1
  with pytest.raises(ValueError, match="3 = 3 != 8 devices|!= 8 devices"):
    sharding.make_mesh(data=3, fsdp=1, tensor=1)
  with pytest.raises(ValueError, match="do not split"):
    sharding.make_mesh(data=3, fsdp=-1)
  with pytest.raises(ValueError, match="at most one"):
    sharding.make_mesh(data=-1, fsdp=-1)
  # Two negative sizes multiply to 8: still refused, by name.
  with pytest.raises(ValueError, match=r"ints >= 1 or -1 \(the rest\), got data=-2 fsdp=-4"):
    sharding.make_mesh(data=-2, fsdp=-4)
  with pytest.raises(ValueError, match=r"got data=2.0 fsdp=-1"):
    sharding.make_mesh(data=2.0)


def test_logical_to_spec():
  assert sharding.logical_to_spec(("vocab", "embed")) == P("tensor", "fsdp")
  assert sharding.logical_to_spec(("batch", "length")) == P(("data", "fsdp"), None)
  assert sharding.logical_to_spec(("heads", "head_dim", "embed")) == P("tensor", None, "fsdp")
  assert sharding.logical_to_spec(("unknown",)) == P(None)
  assert sharding.logical_to_spec(None) == P()
  # A mesh axis is used once per spec: the second "mlp" cannot take "tensor" again.
  assert sharding.logical_to_spec(("mlp", "mlp")) == P("tensor", None)
  rules = (("embed", ("fsdp", "tensor")), ("mlp", "tensor"))
  assert sharding.logical_to_spec(("embed", "mlp"), rules) == P(("fsdp", "tensor"), None)


def test_state_shardings_follow_param_metadata_and_fall_back_when_indivisible(caplog):
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  cfg = ModelConfig(**TINY)
  state = nnx.state(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
  shard = sharding.state_shardings(state, mesh)
  assert shard["embed"].spec == P("tensor", "fsdp")
  assert shard["layers"][0]["attn"]["q_kernel"].spec == P("fsdp", "tensor", None)
  assert shard["layers"][0]["mlp"]["down_kernel"].spec == P("tensor", "fsdp")
  assert shard["norm"]["scale"].spec == P(None)
  # One kv head cannot be split over tensor=2: that dimension is replicated.
  cfg1 = ModelConfig(**{**TINY, "num_kv_heads": 1})
  state1 = nnx.state(nnx.eval_shape(lambda: Decoder(cfg1, rngs=nnx.Rngs(0))))
  shard1 = sharding.state_shardings(state1, mesh)
  assert shard1["layers"][0]["attn"]["k_kernel"].spec == P("fsdp", None, None)
  # ... and said once for that dimension, not silently.
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    sharding.state_shardings(state1, mesh)
  assert caplog.text.count("not divisible") == 1, caplog.text
  assert ("kv_heads of size 1 is not divisible by mesh axis tensor (2): replicated along "
          "it in 4 arrays") in caplog.text  # k, v kernels and biases
  # A rule naming an axis the mesh lacks (a typo) is named, not a bare KeyError.
  with pytest.raises(ValueError, match=r"mesh axes \['fsdq'\] that the mesh lacks \(its "
                     r"axes: \['data', 'fsdp', 'tensor'\]\)"):
    sharding.state_shardings(state, mesh, rules=(("embed", "fsdq"),))
  # Plain arrays (e.g. an optimizer step counter) are replicated.
  plain = sharding.state_shardings({"count": jnp.zeros(()), "m": jnp.zeros((8, 4))}, mesh)
  assert plain["count"].is_fully_replicated and plain["m"].is_fully_replicated


def test_state_shardings_drive_jit_init_without_materialising_on_one_device():
  mesh = sharding.make_mesh(data=1, fsdp=4, tensor=2)
  cfg = ModelConfig(**TINY)
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
  shard = sharding.state_shardings(abstract, mesh)
  state = jax.jit(lambda: nnx.state(Decoder(cfg, rngs=nnx.Rngs(0))), out_shardings=shard)()
  q = state["layers"][0]["attn"]["q_kernel"][...]
  assert q.sharding.spec == P("fsdp", "tensor", None)
  assert q.addressable_shards[0].data.shape == (16, 2, 16)
  model = nnx.merge(graphdef, state)
  assert jax.jit(lambda m, x: m(x))(model, jnp.zeros((2, 3), jnp.int32)).shape == (2, 3, 128)


def test_batch_sharding_and_distributed_noop(monkeypatch):
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  x = jax.device_put(np.zeros((8, 5), np.float32), sharding.batch_sharding(mesh))
  assert x.addressable_shards[0].data.shape == (2, 5)  # 8 rows over data x fsdp = 4
  for var in ("SLURM_JOB_ID", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
    monkeypatch.delenv(var, raising=False)
  assert sharding.initialize_distributed() is False  # single process: nothing to start


def test_constrain_batch_pins_rows_to_data_x_fsdp_inside_a_mesh_context():
  x = jnp.ones((8, 4, 6))
  assert sharding.constrain_batch(x) is x  # no mesh context: nothing to pin to
  mesh = sharding.make_mesh(data=2, fsdp=4)

  def f(x):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return sharding.constrain_batch(x * 2)

  replicated = jax.sharding.NamedSharding(mesh, P())
  out = jax.jit(f, in_shardings=replicated).lower(x).compile().output_shardings
  assert out.spec == P(("data", "fsdp"))
  assert jax.jit(f, in_shardings=replicated).lower(x[:6]).compile().output_shardings.spec in (
      P(), P(None))  # 6 rows do not split 8 ways: left to XLA
  one_axis = sharding.make_mesh(data=1, fsdp=8)

  def g(x):
    with jax.sharding.use_abstract_mesh(one_axis.abstract_mesh):
      return sharding.constrain_batch(x * 2)

  spec = jax.jit(g, in_shardings=jax.sharding.NamedSharding(one_axis, P())).lower(
      x).compile().output_shardings.spec
  assert spec == P("fsdp") or spec == P(("fsdp",)), spec


def test_distributed_names_a_slurm_job_not_started_by_srun(monkeypatch):
  for var in ("SLURM_STEP_NODELIST", "SLURM_PROCID", "SLURM_LOCALID", "OMPI_COMM_WORLD_SIZE"):
    monkeypatch.delenv(var, raising=False)
  monkeypatch.setenv("SLURM_JOB_ID", "42")
  monkeypatch.setenv("SLURM_NTASKS", "1")
  assert sharding.initialize_distributed() is False  # one task: nothing to join
  monkeypatch.setenv("SLURM_NTASKS", "4")
  with pytest.raises(ValueError, match=r"SLURM job 42 has SLURM_NTASKS=4, but this process "
                     r"was not started by srun \(SLURM_STEP_NODELIST, SLURM_PROCID, "
                     r"SLURM_LOCALID unset\)"):
    sharding.initialize_distributed()
  monkeypatch.setenv("SLURM_NTASKS", "")
  with pytest.raises(ValueError, match=r"SLURM_NTASKS='' is not a number of tasks"):
    sharding.initialize_distributed()
  # Given explicitly, as the message advises, the coordinates are what JAX joins with.
  monkeypatch.setenv("SLURM_NTASKS", "4")
  joined = []
  monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: joined.append(kw))
  assert sharding.initialize_distributed("10.0.0.1:1234", 4, 0) is True
  assert joined == [dict(coordinator_address="10.0.0.1:1234", num_processes=4,
                         process_id=0)]


_LONE_TASKS = {"SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "2"}  # one per node


@pytest.mark.parametrize("env, devices", [
    ({**_LONE_TASKS, "CUDA_VISIBLE_DEVICES": "0,1,2,3"}, [0, 1, 2, 3]),
    ({**_LONE_TASKS, "SLURM_GPUS_ON_NODE": "8"}, list(range(8))),
    ({**_LONE_TASKS, "CUDA_VISIBLE_DEVICES": "NoDevFiles"}, None),  # no GPU: JAX's choice
    ({**_LONE_TASKS}, None),  # a count nobody gave: JAX's choice
    ({**_LONE_TASKS, "CUDA_VISIBLE_DEVICES": "0,1", "JAX_LOCAL_DEVICE_IDS": "1"}, None),
    # A task per GPU (8 per node): JAX's own pick, the GPU of the local rank.
    ({"SLURM_STEP_NUM_TASKS": "16", "SLURM_STEP_NUM_NODES": "2",
      "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, None),
])
def test_a_lone_task_on_its_node_joins_with_every_gpu_of_the_node(monkeypatch, env, devices):
  # JAX's SLURM detection gives a task the GPU of its local rank: with one task
  # per node, as the sweep's srun starts them, each node would train on GPU 0.
  for var in ("CUDA_VISIBLE_DEVICES", "SLURM_GPUS_ON_NODE", "JAX_LOCAL_DEVICE_IDS",
              "OMPI_COMM_WORLD_SIZE"):
    monkeypatch.delenv(var, raising=False)
  srun = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": env["SLURM_STEP_NUM_TASKS"],
          "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_PROCID": "1", "SLURM_LOCALID": "0"}
  for var, value in {**srun, **env}.items():
    monkeypatch.setenv(var, value)
  joined = []
  monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: joined.append(kw))
  assert sharding.initialize_distributed() is True
  given = {"local_device_ids": devices} if devices else {}
  assert joined == [dict(coordinator_address=None, num_processes=None, process_id=None,
                         **given)]
