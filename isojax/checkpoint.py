"""Run checkpoints: the train state plus the host-side state that makes resume exact.

One orbax `CheckpointManager` under `<workdir>/checkpoints/<step>/` holds two
items per step:
  state  the train-state pytree (params, optimiser state, step, ...), sharded
         arrays restored onto the shardings of a template state;
  host   a `HostState` as JSON: data-loader position, compute ledger, RNG key
         data, the consecutive-skip count: what else the loop needs to continue.
Orbax writes a step into a temporary directory and renames it when complete, so
a run killed mid-save leaves the previous checkpoint as the latest one. Saving is
synchronous: the loop's metrics line for a step is on disk before the step's
checkpoint, and the checkpoint is complete before the next step donates the
state's buffers.

A checkpoint never holds a non-finite number: `save` checks every floating leaf
first and raises `NonFiniteStateError` naming the leaves instead of writing.

Orbax stores arrays without checksums: a byte changed on disk after the save (a
bad copy, a failing disk) can restore as different numbers with no error. The
host item therefore also records, per state leaf, its dtype, shape and a
position-weighted sum of its bits (`state_checksums`), which `restore` checks.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from isojax.budget import Ledger
from isojax.errors import IsojaxError, UnsafePathError


# The host item's key for `state_checksums` (beside `HostState.to_json`'s keys).
# A checkpoint written before it existed lacks it and restores unchecked.
_CHECKSUMS_KEY = "state_checksums"


class NonFiniteStateError(IsojaxError):
  """Raised instead of writing a checkpoint whose state holds NaN or inf."""


def nonfinite_leaves(tree: Any) -> list[str]:
  """Key paths of the floating-point leaves of `tree` that hold NaN or inf."""
  bad = []
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    dtype = getattr(leaf, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.inexact):
      continue
    if not bool(jnp.all(jnp.isfinite(leaf))):
      bad.append(jax.tree_util.keystr(path))
  return bad


def _leaf_checksum(x: jax.Array) -> jax.Array:
  """sum_i bits_i * (2 i + 1) mod 2**32 over the leaf's elements, as uint32.

  Integer sums wrap exactly whatever the summation order, so the value does not
  depend on the mesh the leaf is sharded over (a checkpoint restores onto other
  meshes); the odd weight per position makes any single changed element, or two
  swapped ones, change the sum.
  """
  if x.dtype == jnp.bool_:
    bits = x.astype(jnp.uint32)
  else:
    width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    bits = jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32)
  index = jnp.zeros(bits.shape, jnp.uint32)
  for dim in range(bits.ndim):  # the row-major position, without reshaping a sharded array
    stride = np.uint32(math.prod(bits.shape[dim + 1:]) % 2**32)
    index = index + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, dim) * stride
  return jnp.sum(bits * (2 * index + 1), dtype=jnp.uint32)


# One call per leaf, not one over the tree: a state's leaves may sit on different
# devices (a replicated counter beside mesh-sharded parameters), which one jit
# refuses; calls are cached by shape, so a model's layers share compiles.
_leaf_checksum_jit = jax.jit(_leaf_checksum)


def state_checksums(tree: Any) -> dict[str, list]:
  """{key path: [dtype, shape, checksum]} of every numeric array leaf of `tree`."""
  paths, leaves = [], []
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    dtype = getattr(leaf, "dtype", None)
    if dtype is None or not (jnp.issubdtype(dtype, jnp.number) or dtype == jnp.bool_):
      continue  # e.g. PRNG key arrays: not numbers, left unchecked
    if jnp.issubdtype(dtype, jnp.complexfloating):
      continue
    paths.append(path)
    leaves.append(leaf)
  # One leaf at a time: with many sharded reductions in flight, XLA's CPU runtime
  # can deadlock when a process has several devices (each reduction's rendezvous
  # waits for threads that queued ones hold; seen with 4 devices on 2 cores, in
  # one process and across two). A round trip per leaf is nothing beside the write.
  sums = [jax.device_get(_leaf_checksum_jit(x)) for x in leaves]
  return {jax.tree_util.keystr(p): [str(np.dtype(x.dtype)), list(x.shape), int(s)]
          for p, x, s in zip(paths, leaves, sums)}


def _checksum_mismatches(saved: dict, restored: dict) -> list[str]:
  """What differs between the checksums saved with a state and the restored one's."""
  bad = []
  for path, (dtype, shape, total) in saved.items():
    now = restored.get(path)
    if now is None:
      bad.append(f"{path} (not in the restored state)")
    elif [dtype, list(shape)] != now[:2]:
      bad.append(f"{path} (saved as {dtype}{tuple(shape)}, restored as "
                 f"{now[0]}{tuple(now[1])})")
    elif int(total) != now[2]:
      bad.append(f"{path} (its values differ from those saved)")
  return bad


@dataclasses.dataclass(frozen=True)
class HostState:
  """What a checkpoint stores beside the train state's arrays, so that a resumed
  run continues exactly; written and read only through this definition.

  Attributes:
    step: the update the checkpoint follows.
    loader: the data loader's position and retired problems (`EpochLoader.state_dict()`).
    ledger: the compute spent up to `step`.
    consecutive_skips: non-finite updates in a row up to `step`.
    rng: the run's PRNG key data (`key_to_host`), checked against the seed on resume.
  """

  step: int
  loader: dict
  ledger: Ledger
  consecutive_skips: int
  rng: tuple[int, ...]

  def to_json(self) -> dict:
    """The JSON object the checkpoint's `host` item holds."""
    return {"step": self.step, "loader": dict(self.loader),
            "ledger": self.ledger.state_dict(),
            "consecutive_skips": self.consecutive_skips, "rng": list(self.rng)}

  @classmethod
  def from_json(cls, host: dict) -> "HostState":
    """Inverse of `to_json`; accepts NumPy scalars (as orbax restores them).

    Raises:
      ValueError: naming the keys, for a host item of another layout.
    """
    expected = sorted(f.name for f in dataclasses.fields(cls))
    if sorted(host) != expected:
      raise ValueError(f"checkpoint host state has keys {sorted(host)}; expected "
                       f"{expected}")
    return cls(step=int(host["step"]), loader=dict(host["loader"]),
               ledger=Ledger.from_state_dict(host["ledger"]),
               consecutive_skips=int(host["consecutive_skips"]),
               rng=tuple(int(x) for x in host["rng"]))


def _check_no_linked_steps(directory: pathlib.Path) -> None:
  """Refuses a step directory that is a symbolic link (a step moved to other storage
  and linked back). Orbax restores through it, but deleting it as an old step
  (max_to_keep) fails after the next step is written: every later checkpoint of the
  run would stop it, with an OSError that names no path.
  """
  try:
    names = os.listdir(directory)
  except (FileNotFoundError, NotADirectoryError):
    return  # no checkpoints yet
  linked = sorted((n for n in names if n.isdigit() and os.path.islink(directory / n)), key=int)
  if linked:
    raise UnsafePathError(
        f"{directory} holds checkpoint steps that are symbolic links ({', '.join(linked)}): "
        f"the run deletes old steps as it saves new ones and cannot delete a link; "
        f"replace each with the directory it points to, or remove it")


class RunCheckpointer:
  """Saves and restores (train state, `HostState`) pairs under `directory`."""

  def __init__(self, directory: str | pathlib.Path, *, max_to_keep: int):
    if max_to_keep < 1:
      raise ValueError(f"max_to_keep must be >= 1, got {max_to_keep}")
    self.directory = pathlib.Path(directory).absolute()
    _check_no_linked_steps(self.directory)
    # The first save makes the directory: opening one to ask for its latest step
    # (a run deciding whether it resumes) leaves nothing behind.
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, create=False, enable_async_checkpointing=False)
    self._manager = ocp.CheckpointManager(
        self.directory, item_names=("state", "host"), options=options)

  def latest_step(self) -> int | None:
    """The newest complete checkpoint's step, or None when there is none."""
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def save(self, step: int, state: Any, host: HostState) -> None:
    """Writes `state` and `host` as checkpoint `step`.

    Raises:
      NonFiniteStateError: if any floating leaf of `state` is NaN/inf; nothing is
        written.
      ValueError: if `host` is another step's.
    """
    if host.step != step:
      raise ValueError(f"checkpoint {step} given the host state of step {host.step}")
    bad = nonfinite_leaves(state)
    if bad:
      shown = ", ".join(bad[:5]) + (f" (+{len(bad) - 5} more)" if len(bad) > 5 else "")
      raise NonFiniteStateError(
          f"refusing to checkpoint step {step}: non-finite values in {shown}")
    host_json = {**host.to_json(), _CHECKSUMS_KEY: state_checksums(state)}
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), host=ocp.args.JsonSave(host_json)))
    self._manager.wait_until_finished()

  def restore(self, step: int, template_state: Any) -> tuple[Any, HostState]:
    """Restores checkpoint `step` onto the shardings of `template_state` (e.g. a
    freshly initialised state, on any mesh); returns (state, host).

    Raises:
      ValueError: naming the step, if it cannot be read, its arrays differ from
        the checksums saved with them (damaged on disk, or a template of other
        dtypes or shapes, which would not resume the run exactly), or its host
        state is another step's (a step directory renamed or copied).
    """
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template_state)
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract), host=ocp.args.JsonRestore()))
      host = dict(restored["host"])
      saved = host.pop(_CHECKSUMS_KEY, None)
      if saved is not None:
        bad = _checksum_mismatches(saved, state_checksums(restored["state"]))
        if bad:
          shown = "; ".join(bad[:3]) + (f" (+{len(bad) - 3} more)" if len(bad) > 3 else "")
          raise ValueError(f"the restored state does not match the checksums saved "
                           f"with it: {shown}")
      host_state = HostState.from_json(host)
      if host_state.step != step:  # a step directory renamed or copied over another
        raise ValueError(f"its host state is that of step {host_state.step}")
      return restored["state"], host_state
    except Exception as e:  # pylint: disable=broad-except
      # A damaged step (a copy cut short, a file removed) fails deep in orbax or
      # tensorstore; say which step, and how to fall back to the one before.
      earlier = [s for s in self.all_steps() if s < step]
      fallback = (f"to resume from step {max(earlier)}" if earlier else "to start over")
      cause = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
      raise ValueError(f"checkpoint {step} in {self.directory} cannot be restored "
                       f"({type(e).__name__}: {cause}); if it is damaged, remove "
                       f"{self.directory / str(step)} {fallback}") from e

  def close(self) -> None:
    self._manager.close()


def key_to_host(key: jax.Array) -> list[int]:
  """A PRNG key as a JSON list of ints (its raw key data)."""
  return np.asarray(jax.random.key_data(key)).astype(np.uint32).tolist()


def key_from_host(data: list[int]) -> jax.Array:
  """Inverse of `key_to_host` for the default PRNG implementation."""
  return jax.random.wrap_key_data(np.asarray(data, dtype=np.uint32))
