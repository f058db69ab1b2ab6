"""The one place in ``isojax.rl`` that calls ``jax.jit``, and what it returns.

``jit_step`` jits a step ``(state, batch) -> (state, metrics)`` with
``in_shardings``/``out_shardings`` over an explicit mesh and the state donated;
``make_train_step`` (``isojax.rl.step``) and PPO's ``make_ppo_train_step`` both
build through it. ``TrainStep`` wraps the jitted function with the host-side
checks that name a bad batch or state before jit sees it.
"""

import dataclasses
import functools
import warnings
from typing import Any, Callable

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from isojax import sharding as shd
from isojax.rl.batch import Batch, as_arrays, validate_batch
from isojax.rl.state import TrainState, check_state

__all__ = ["TrainStep", "jit_step"]


@dataclasses.dataclass(frozen=True)
class TrainStep:
  """The built step. Call it as ``state, metrics = train_step(state, batch)``.

  ``__call__`` takes Batch fields as arrays or (nested) lists, runs
  ``validate_batch`` and ``check_state`` (against ``state_shapes``) on the
  host, then ``jitted`` (the ``jax.jit`` object). ``lower`` compiles ahead of
  time from shapes alone (``abstract_train_state`` / ``abstract_batch``):
  ``lower(...).compile().memory_analysis()`` gives the step's memory before any
  array exists. The state argument is donated: its arrays are invalid afterwards.

  The step is compiled for one batch width T: a batch of another width compiles
  it again (seconds to minutes for a large model), with a warning the first time
  each new width is seen. Pad batches to a few fixed widths (a run pads every
  batch to prompt width + max tokens).
  """

  jitted: Callable
  state_shapes: Any
  state_shardings: Any
  batch_sharding: NamedSharding
  batch_size: int
  group_size: int
  micro_batch_size: int
  batch_shards: int
  vocab_size: int
  # Batch widths called with so far (a compile each); mutable inside the frozen step.
  widths_seen: set = dataclasses.field(default_factory=set, compare=False, repr=False)

  def __call__(self, state: TrainState, batch: Batch):
    batch = as_arrays(batch)
    validate_batch(batch, group_size=self.group_size, batch_size=self.batch_size,
                   micro_batch_size=self.micro_batch_size, batch_shards=self.batch_shards,
                   vocab_size=self.vocab_size)
    check_state(state, self.state_shapes, expected_flat=self._state_flat)
    self._note_width(batch.input_ids_BxT.shape[1])
    if not self.batch_sharding.is_fully_addressable:
      # jit places host arrays only on this process's devices; on a mesh over
      # several processes each places its own rows of the (same) host batch.
      batch = jax.tree.map(lambda x: shd.put_host_array(x, self.batch_sharding), batch)
    else:
      # jit refuses arrays committed to another placement (one device, another
      # mesh); the batch is data, so those move. Host arrays stay as they are:
      # placed here, they would miss an executable compiled from plain shapes.
      batch = jax.tree.map(
          lambda x: (jax.device_put(x, self.batch_sharding)
                     if isinstance(x, jax.Array) and x.sharding != self.batch_sharding
                     else x), batch)
    return self.jitted(state, batch)

  def _note_width(self, width: int) -> None:
    if width in self.widths_seen:
      return
    if self.widths_seen:
      warnings.warn(
          f"the update step compiles again for a batch of width T={width} (compiled so "
          f"far for T in {sorted(self.widths_seen)}); pad batches to a few fixed widths "
          f"so that each update does not compile", stacklevel=3)
    self.widths_seen.add(width)

  @functools.cached_property
  def _state_flat(self):
    return jax.tree.flatten(self.state_shapes)

  def lower(self, state: TrainState, batch: Batch):
    """``jax.jit(...).lower`` of the step; arrays or ``jax.ShapeDtypeStruct`` leaves."""
    return self.jitted.lower(state, batch)


def jit_step(step: Callable, state_shapes, state_sharding, mesh: Mesh, *, batch_size: int,
             group_size: int, micro_batch_size: int, vocab_size: int,
             donate: bool) -> TrainStep:
  """``step(state, batch) -> (state, metrics)`` jitted with shardings: the state
  (shaped like ``state_shapes``) on ``state_sharding`` (donated), the batch
  split over data x fsdp, the metrics replicated."""
  batch_sh = shd.batch_sharding(mesh)
  jitted = jax.jit(step, in_shardings=(state_sharding, batch_sh),
                   out_shardings=(state_sharding, NamedSharding(mesh, PartitionSpec())),
                   donate_argnums=(0,) if donate else ())
  return TrainStep(jitted=jitted, state_shapes=state_shapes, state_shardings=state_sharding,
                   batch_sharding=batch_sh, batch_size=batch_size, group_size=group_size,
                   micro_batch_size=micro_batch_size,
                   batch_shards=shd.batch_shards(mesh), vocab_size=vocab_size)
