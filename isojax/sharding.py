"""Meshes and the logical -> mesh axis rules (sharding is data, never a global).

Models name parameter axes logically (`vocab`, `embed`, `mlp`, `heads`, ...) in
their nnx metadata; this module alone decides which mesh axis (`data`, `fsdp`,
`tensor`) each name is split over. Every function takes the mesh explicitly.
"""

from __future__ import annotations

import collections
import math
import os
from typing import Any, Sequence

import jax
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")
# The mesh axes a batch's rows (rollouts, training rows, activations) are split over.
BATCH_AXES = ("data", "fsdp")

# (logical name, mesh axis | tuple of mesh axes | None). First match wins.
# FSDP shards the model dimension of every matrix; tensor parallelism splits the
# head / MLP / vocab dimension (Megatron layout); norms and head_dim stay whole.
DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", BATCH_AXES),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("norm", None),
    ("length", None),
)


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A (data, fsdp, tensor) mesh over `devices` (default: all); one size may be -1."""
  devices = list(jax.devices() if devices is None else devices)
  sizes = [data, fsdp, tensor]
  if any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) or (s < 1 and s != -1)
         for s in sizes):
    raise ValueError(f"mesh sizes must be ints >= 1 or -1 (the rest), got data={data} "
                     f"fsdp={fsdp} tensor={tensor}")
  if sizes.count(-1) > 1:
    raise ValueError(f"at most one mesh axis may be -1, got data={data} fsdp={fsdp} "
                     f"tensor={tensor}")
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if known <= 0 or len(devices) % known:
      raise ValueError(f"{len(devices)} devices do not split into data={data} "
                       f"fsdp={fsdp} tensor={tensor}")
    sizes[sizes.index(-1)] = len(devices) // known
  if math.prod(sizes) != len(devices):
    raise ValueError(f"mesh data={sizes[0]} x fsdp={sizes[1]} x tensor={sizes[2]} = "
                     f"{math.prod(sizes)} != {len(devices)} devices")
  # Auto axes: classic GSPMD propagation (jax.make_mesh may default to Explicit).
  grid = np.asarray(devices, dtype=object).reshape(sizes)
  return Mesh(grid, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3)


def logical_to_spec(logical_names: Sequence[str | None] | None,
                    rules=DEFAULT_RULES) -> PartitionSpec:
  """Map logical axis names to a PartitionSpec by `rules` (unknown names -> None).

  A mesh axis already used by an earlier dimension is not used again (a
  PartitionSpec may name each mesh axis once).
  """
  if not logical_names:
    return PartitionSpec()
  table = {}
  for name, axes in rules:
    table.setdefault(name, axes)
  used: set[str] = set()
  spec = []
  for name in logical_names:
    axes = table.get(name)
    axes_t = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    axes_t = tuple(a for a in axes_t if a not in used)
    used.update(axes_t)
    spec.append(None if not axes_t else axes_t[0] if len(axes_t) == 1 else axes_t)
  return PartitionSpec(*spec)


def _fit_spec(spec: PartitionSpec, shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
  """Drop the split of any dimension the mesh axes do not divide evenly.

  Uneven shards are not supported by `jax.make_array_from_callback` (used to place
  checkpoint tensors) and would pad otherwise; replicating that one dimension (e.g.
  1 kv head on tensor=2, or an odd vocab) is the usual fallback and costs only memory.
  """
  out = []
  for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
    axes_t = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    unknown = [a for a in axes_t if a not in mesh.shape]
    if unknown:
      raise ValueError(f"sharding rules name mesh axes {unknown} that the mesh lacks "
                       f"(its axes: {list(mesh.shape)}); spec {spec} for shape {tuple(shape)}")
    size = math.prod(mesh.shape[a] for a in axes_t)
    out.append(axes if size and dim % size == 0 else None)
  return PartitionSpec(*out)


def spec_for(names, shape, mesh: Mesh, rules=DEFAULT_RULES) -> PartitionSpec:
  """logical_to_spec, then fitted to `shape` on `mesh` (see `_fit_spec`)."""
  return _fit_spec(logical_to_spec(names, rules), shape, mesh)


def state_shardings(abstract_state, mesh: Mesh, rules=DEFAULT_RULES):
  """NamedSharding per leaf of an nnx State (or any pytree of Variables / arrays).

  Logical names come from each Variable's `out_sharding` metadata; leaves without
  names (plain arrays, scalars, optimizer counters) are replicated. The result has
  the input's structure with each Variable replaced by its NamedSharding, usable
  as jit in/out_shardings for the matching state.
  """

  unsplit: collections.Counter = collections.Counter()

  def one(leaf):
    if isinstance(leaf, nnx.Variable):
      names = leaf.get_metadata().get("out_sharding")
      shape = getattr(leaf.get_value(), "shape", ())
    else:
      names, shape = None, getattr(leaf, "shape", ())
    if not names or len(names) != len(shape):
      return NamedSharding(mesh, PartitionSpec())
    wanted = logical_to_spec(names, rules)
    spec = _fit_spec(wanted, shape, mesh)
    for name, dim, axes, got in zip(names, shape, wanted, spec):
      if axes is not None and got is None:
        unsplit[name, dim, axes] += 1
    return NamedSharding(mesh, spec)

  shardings = jax.tree.map(one, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  # Replicating a dimension the mesh does not divide is legal but costs memory and
  # repeated compute on every device of that axis (e.g. 14 heads on tensor=4):
  # say so once per dimension, so a mesh choice is not silently wasted.
  for (name, dim, axes), count in sorted(unsplit.items(), key=str):
    axes_t = (axes,) if isinstance(axes, str) else tuple(axes)
    ways = math.prod(mesh.shape[a] for a in axes_t)
    logging.warning("%s of size %d is not divisible by mesh axis %s (%d): replicated "
                    "along it in %d arrays", name, dim, "x".join(axes_t), ways, count)
  return shardings


def batch_shards(mesh: Mesh) -> int:
  """How many ways a batch's rows are split: data x fsdp."""
  return math.prod(mesh.shape[a] for a in BATCH_AXES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (batch) axis split over data x fsdp, the rest replicated."""
  return NamedSharding(mesh, PartitionSpec(BATCH_AXES))


def put_host_array(x, target: NamedSharding) -> jax.Array:
  """A host array placed under `target`, in every process of a multi-host run.

  `jax.device_put` takes only shardings of this process's devices; on a mesh that
  spans several processes each one places its own shards from its host copy,
  which must be the same in every process (the run loop computes it from the
  same seed and data everywhere).
  """
  if target.is_fully_addressable:
    return jax.device_put(x, target)
  if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
    # A typed key has no numpy form: its key data travels instead.
    data = put_host_array(jax.random.key_data(x), target)
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, target, lambda index: x[index])


def constrain_batch(x: jax.Array) -> jax.Array:
  """Pin the leading (batch) axis of an activation to data x fsdp, inside a traced step.

  For the model's forward: under FSDP every weight is split along its model
  dimension, and without this XLA may follow the weights and split activations
  along that dimension too, computing every row on every device. A no-op
  outside a mesh context (``jax.sharding.use_abstract_mesh``, entered by the
  update step) and for mesh axes the batch does not divide.

  The one place that reads the mesh from context rather than an argument: it
  runs deep inside the model, whose call signature stays free of meshes, and the
  step that enters the context was itself given its mesh explicitly.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  axes = tuple(a for a in BATCH_AXES if sizes.get(a, 1) > 1)
  if not axes or x.shape[0] % math.prod(sizes[a] for a in axes):
    return x
  return jax.lax.with_sharding_constraint(x, PartitionSpec(axes))


def initialize_distributed(coordinator_address: str | None = None,
                           num_processes: int | None = None,
                           process_id: int | None = None) -> bool:
  """Start jax.distributed for multi-host runs; returns True if it was initialised.

  With all arguments None, JAX detects the cluster itself (SLURM, Open MPI, TPU
  pods); outside such an environment this is a no-op so the same entry point runs
  on a laptop. Must run before any other JAX call touches devices.
  """
  explicit = any(a is not None for a in (coordinator_address, num_processes, process_id))
  # Explicit arguments are what a job not started by srun is told to give: the SLURM
  # variables are then not read (nor checked).
  if not explicit and not (_slurm_tasks() > 1 or "OMPI_COMM_WORLD_SIZE" in os.environ):
    return False
  devices = None if explicit else _node_devices_of_a_lone_task()
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=num_processes, process_id=process_id,
                             **({"local_device_ids": devices} if devices else {}))
  return True


def _node_devices_of_a_lone_task() -> list[int] | None:
  """Every GPU of this node when this task is the node's only one, else None.

  JAX's cluster detection gives each task the one GPU of its local rank (a task
  per GPU); a sweep starts one task per node (`srun --ntasks-per-node=1`), which
  would then train on each node's GPU 0 alone. The count is what SLURM or the
  user hands the task (CUDA_VISIBLE_DEVICES, else SLURM_GPUS_ON_NODE); None where
  it is unknown, several tasks share the node, or JAX_LOCAL_DEVICE_IDS says
  (JAX reads that itself).
  """
  env = os.environ
  if env.get("JAX_LOCAL_DEVICE_IDS"):
    return None
  if "SLURM_JOB_ID" in env:
    lone = env.get("SLURM_STEP_NUM_TASKS") is not None and (
        env.get("SLURM_STEP_NUM_TASKS") == env.get("SLURM_STEP_NUM_NODES"))
  else:
    lone = env.get("OMPI_COMM_WORLD_LOCAL_SIZE") == "1"
  visible = env.get("CUDA_VISIBLE_DEVICES", "")
  if visible and visible != "NoDevFiles":  # SLURM's value for a task without GPUs
    count = len(visible.split(","))
  else:
    count = int(env["SLURM_GPUS_ON_NODE"]) if env.get("SLURM_GPUS_ON_NODE", "").isdigit() else 0
  return list(range(count)) if lone and count > 1 else None


# What jax.distributed reads to join a SLURM job: `srun` sets them for each task.
_SRUN_VARS = ("SLURM_STEP_NODELIST", "SLURM_PROCID", "SLURM_LOCALID")


def _slurm_tasks() -> int:
  """SLURM_NTASKS of this SLURM job (1 outside one).

  Raises:
    ValueError: if it is not a count, or the job has several tasks but this
      process was not started by `srun` (jax.distributed would stop with
      "coordinator_address should be defined").
  """
  if "SLURM_JOB_ID" not in os.environ:
    return 1
  raw = os.environ.get("SLURM_NTASKS", "1")
  try:
    tasks = int(raw)
  except ValueError:
    raise ValueError(f"SLURM_NTASKS={raw!r} is not a number of tasks") from None
  missing = [v for v in _SRUN_VARS if v not in os.environ]
  if tasks > 1 and missing:
    raise ValueError(
        f"SLURM job {os.environ['SLURM_JOB_ID']} has SLURM_NTASKS={tasks}, but this "
        f"process was not started by srun ({', '.join(missing)} unset): start one process "
        f"per task with srun, or give coordinator_address, num_processes and process_id")
  return tasks
