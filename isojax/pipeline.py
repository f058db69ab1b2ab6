"""PipelineRL-k: the sampler works in a thread beside the updates.

A producer thread samples the batches of updates first..last in update order,
each as `run_batches.sample_batch` does in the synchronous loop (its problems
from the loader, its seed from the step alone), into a queue the updates take
from. After every update the trainer hands the new weights to the sampler at
once, labelled with the number of updates done, and generation already in
flight picks them up: the JAX sampler between decode chunks
(config.sampler.decode_chunk tokens at most), a vLLM server by pausing its
requests, reloading and resuming them. A sequence may so mix policies; every
token carries the version that sampled it, and the update's ratio is taken
against the sampler's own log-probs.

Admission, the k of PipelineRL-k (config.rl.pipeline.max_lag): batch b is
started only once b - 1 - k updates are done, so that when update b trains on
it (b - 1 updates done) none of its tokens is more than k updates old. `take`
checks the lag of every batch again.

Checkpoints drain the pipeline: the producer starts no batch after a checkpoint
step until that checkpoint is written, so a checkpoint never has a batch queued
or in flight, and a resumed run restarts the producer at the checkpoint's loader
position with its weights. The state a run resumes from is exact; what follows
is not bitwise repeatable with k > 0, in an uninterrupted run either, because
which update's weights sampled a token depends on timing. The cost is a bubble
per checkpoint: the updates before it run without sampling beside them, and the
update after it waits for its batch.
"""

from __future__ import annotations

import collections
import threading

import jax
import jax.numpy as jnp
from flax import nnx

from isojax.errors import IsojaxError
from isojax.run_batches import SampledBatch, sample_batch


class StaleBatchError(IsojaxError):
  """A batch reached its update with tokens older than the admission bound."""


class Pipeline:
  """The batch source of PipelineRL-k, with the interface of
  `run_batches.GroupedBatches` (take / after_update / checkpoint_ready /
  checkpoint_written / close).

  Args:
    parts: the run's `RunParts` (loader and sampler are the producer's until
      `close`, but for reads while it waits at a checkpoint).
    config: the run's config.
    first, last: the updates whose batches to sample.
    max_lag: k >= 1.
    checkpoint_every: the loop's checkpoint period (the producer's barriers).
    copy_weights: hand the sampler a copy of the weights (an in-process sampler:
      the next update donates the trainer's buffers while it still decodes).
  """

  def __init__(self, parts, config, *, first: int, last: int, max_lag: int,
               checkpoint_every: int, copy_weights: bool):
    # Each would leave the producer waiting on an admission or barrier that never
    # opens, and the trainer waiting on it: checked here, where they can be named.
    for name, value, least in (("first", first, 1), ("last", last, first - 1),
                               ("max_lag", max_lag, 1),
                               ("checkpoint_every", checkpoint_every, 1)):
      if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"Pipeline: {name}={value!r}; expected an int >= {least}")
    self.parts, self.config = parts, config
    self.first, self.last, self.max_lag = first, last, max_lag
    self.checkpoint_every, self.copy_weights = checkpoint_every, copy_weights
    self._cond = threading.Condition()
    self._queue: collections.deque[SampledBatch] = collections.deque()
    self._done = first - 1  # updates done (and published to the sampler)
    self._released = first - 1  # the last checkpoint written (or the start)
    self._error: BaseException | None = None
    self._stop = False
    self._finished = False  # the producer sampled every batch of first..last
    self._thread = threading.Thread(target=self._produce, name="isojax-producer",
                                    daemon=True)

  def start(self, model: nnx.Module) -> Pipeline:
    """Starts the producer. An in-process sampler first gets a copy of `model`'s
    weights (those after first - 1 updates: the trainer's own buffers are donated
    to its first update); a server already holds them (`run_open`)."""
    if self.copy_weights:
      self.parts.sampler.update_weights(self._weights(model), version=self.first - 1)
    self._thread.start()
    return self

  # -- the producer's thread ------------------------------------------------

  def _may_start(self, b: int) -> bool:
    # Lag bound, and the barrier at the last checkpoint step before b.
    barrier = (b - 1) // self.checkpoint_every * self.checkpoint_every
    return self._done >= b - 1 - self.max_lag and self._released >= barrier

  def _produce(self) -> None:
    try:
      for b in range(self.first, self.last + 1):
        with self._cond:
          self._cond.wait_for(lambda b=b: self._stop or self._may_start(b))
          if self._stop:
            return
          version = self._done  # the sampler holds these weights or newer ones
        sampled = sample_batch(self.parts, self.config, b, version=version)
        with self._cond:
          self._queue.append(sampled)
          self._cond.notify_all()
      with self._cond:  # a take beyond its batches then fails instead of waiting
        self._finished = True
        self._cond.notify_all()
    except BaseException as e:  # pylint: disable=broad-except
      with self._cond:  # the trainer raises it at its next `take`
        self._error = e
        self._cond.notify_all()

  # -- the trainer's side ---------------------------------------------------

  def take(self, step: int) -> tuple[SampledBatch, list[SampledBatch]]:
    """The batch of update `step` (waiting for it), and [it] for the ledger.

    Raises:
      whatever stopped the producer (a non-finite sampler log-prob, a server
      error, ...); StaleBatchError if a token lags more than max_lag updates;
      ValueError for a step whose batch is not coming (outside first..last,
      taken already, or after `close`), which would otherwise wait forever.
    """
    if not self.first <= step <= self.last:
      raise ValueError(f"pipeline: update {step} has no batch; this pipeline samples "
                       f"those of updates {self.first}..{self.last}")
    with self._cond:
      self._cond.wait_for(lambda: self._queue or self._error is not None or self._stop
                          or self._finished)
      if not self._queue:  # the batches sampled before the error are still trained on
        if self._error is not None:
          raise self._error
        raise ValueError(f"pipeline: update {step} has no batch: the producer has "
                         f"{'been closed' if self._stop else 'sampled all it had to'}")
      sampled = self._queue.popleft()
    if sampled.step != step:
      raise RuntimeError(f"pipeline: update {step} got the batch of update {sampled.step}")
    versions = sampled.version_BxT[sampled.version_BxT >= 0]
    if versions.size and step - 1 - int(versions.min()) > self.max_lag:
      raise StaleBatchError(
          f"update {step}: a token was sampled by the policy after {int(versions.min())} "
          f"updates, {step - 1 - int(versions.min())} behind; "
          f"config.rl.pipeline.max_lag={self.max_lag}")
    return sampled, [sampled]

  def after_update(self, step: int, model: nnx.Module, *, eval_due: bool) -> None:
    """Hands the sampler the weights after update `step` at once (in flight too)."""
    del eval_due  # the sampler always has the newest weights
    self.parts.sampler.update_weights(self._weights(model), version=step)
    with self._cond:
      self._done = step
      self._cond.notify_all()

  def checkpoint_ready(self, step: int) -> bool:
    """True: at a checkpoint step the producer waits, nothing queued or in flight."""
    with self._cond:
      pending = len(self._queue)
    if pending:
      raise RuntimeError(f"pipeline: {pending} batches queued at the checkpoint of "
                         f"update {step}")
    return True

  def checkpoint_written(self, step: int) -> None:
    """Lets the producer go past the checkpoint of update `step`."""
    with self._cond:
      self._released = step
      self._cond.notify_all()

  def close(self) -> None:
    """Stops the producer (after the generation it is in, if any) and waits for it."""
    with self._cond:
      self._stop = True
      self._cond.notify_all()
    if self._thread.is_alive():
      self._thread.join()

  def _weights(self, model: nnx.Module):
    if not self.copy_weights:
      return model
    return jax.tree.map(jnp.copy, nnx.state(model))

