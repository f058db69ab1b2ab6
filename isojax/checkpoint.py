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
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from isojax.budget import Ledger
from isojax.errors import IsojaxError


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


class RunCheckpointer:
  """Saves and restores (train state, `HostState`) pairs under `directory`."""

  def __init__(self, directory: str | pathlib.Path, *, max_to_keep: int):
    if max_to_keep < 1:
      raise ValueError(f"max_to_keep must be >= 1, got {max_to_keep}")
    self.directory = pathlib.Path(directory).absolute()
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
    """
    bad = nonfinite_leaves(state)
    if bad:
      shown = ", ".join(bad[:5]) + (f" (+{len(bad) - 5} more)" if len(bad) > 5 else "")
      raise NonFiniteStateError(
          f"refusing to checkpoint step {step}: non-finite values in {shown}")
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), host=ocp.args.JsonSave(host.to_json())))
    self._manager.wait_until_finished()

  def restore(self, step: int, template_state: Any) -> tuple[Any, HostState]:
    """Restores checkpoint `step` onto the shapes, dtypes and shardings of
    `template_state` (e.g. a freshly initialised state); returns (state, host)."""
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template_state)
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract), host=ocp.args.JsonRestore()))
      return restored["state"], HostState.from_json(dict(restored["host"]))
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
