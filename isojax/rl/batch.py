"""The update's input batch: its type, host-side checks and abstract shapes.

``Batch`` is what the run builds from rollouts (``isojax.batching``) and the
step (``isojax.rl.step``) consumes; ``validate_batch`` runs on the host before
every update, ``abstract_batch`` gives its shapes for ahead-of-time compiles.
"""

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from isojax import sharding as shd
from isojax.rl.state import default_mesh

__all__ = ["Batch", "abstract_batch", "as_arrays", "validate_batch"]


@flax.struct.dataclass
class Batch:
  """One update's rollouts; B = Bp * n rows, prompt-major groups of n.

  Attributes:
    input_ids_BxT: int32, left-padded prompt ++ right-padded completion.
    attention_mask_BxT: 1 on real (non-pad) tokens.
    loss_mask_BxT: 1 where input_ids[t] is a completion token trained on
      (never column 0, which has no prediction).
    sampler_logp_BxT: the sampler's log-prob of input_ids[t], aligned like
      loss_mask; 0 elsewhere.
    rewards_B: float32 rewards.
    baseline_rewards_B: optional [Bp * n_est] rewards for a decoupled baseline
      (see ``isojax.rl.advantages``); None: baseline from ``rewards_B``.
  """

  input_ids_BxT: jax.Array
  attention_mask_BxT: jax.Array
  loss_mask_BxT: jax.Array
  sampler_logp_BxT: jax.Array
  rewards_B: jax.Array
  baseline_rewards_B: jax.Array | None = None


def as_arrays(batch):
  """``batch`` with fields given as Python lists or tuples made NumPy arrays (jit
  would take a list for a pytree of scalars); anything else unchanged."""
  if not isinstance(batch, Batch):
    return batch
  arrays = {}
  for f in dataclasses.fields(batch):
    x = getattr(batch, f.name)
    if isinstance(x, (list, tuple)):
      try:
        arrays[f.name] = np.asarray(x)
      except ValueError as e:  # ragged rows: pad them to one width T
        raise ValueError(f"Batch.{f.name} is not an array: {e}") from None
  return batch.replace(**arrays)


_BxT_FIELDS = ("input_ids_BxT", "attention_mask_BxT", "loss_mask_BxT", "sampler_logp_BxT")


def _first_true(mask) -> tuple[int, ...]:
  """The index of `mask`'s first True (row-major), as Python ints, for a message."""
  return tuple(int(i) for i in np.argwhere(mask)[0])


def validate_batch(batch: Batch, *, group_size: int, batch_size: int | None = None,
                   micro_batch_size: int | None = None, batch_shards: int = 1,
                   vocab_size: int | None = None) -> None:
  """Host-side checks before an update; raises ValueError naming the input.

  Checks shapes against each other and the static sizes, that group_size
  divides B, that token ids lie in [0, vocab_size) (given it), that the masks
  are 0/1 with the loss mask inside the attention mask and off column 0,
  each row's first real token and any token right after a pad, and that
  rewards and sampler log-probs are finite.
  """
  if not isinstance(batch, Batch):
    raise ValueError(f"batch must be an isojax.rl.Batch, got {type(batch).__name__}")
  shape = np.shape(batch.input_ids_BxT)
  if len(shape) != 2:
    raise ValueError(f"Batch.input_ids_BxT must be 2-D [B, T], got shape {shape}")
  for name in _BxT_FIELDS[1:]:
    if np.shape(getattr(batch, name)) != shape:
      raise ValueError(f"Batch.{name} has shape {np.shape(getattr(batch, name))}, "
                       f"expected {shape} like input_ids_BxT")
  b = shape[0]
  if np.shape(batch.rewards_B) != (b,):
    raise ValueError(f"Batch.rewards_B has shape {np.shape(batch.rewards_B)}, expected ({b},)")
  if batch_size is not None and b != batch_size:
    raise ValueError(f"batch has B={b} rows but the step was built for batch_size="
                     f"{batch_size} (the learning rate depends on it)")
  if b % group_size:
    raise ValueError(f"group_size={group_size} does not divide B={b}")
  if micro_batch_size is not None and b % micro_batch_size:
    raise ValueError(f"micro_batch_size={micro_batch_size} does not divide B={b}")
  if not np.issubdtype(np.asarray(batch.input_ids_BxT[:1, :1]).dtype, np.integer):
    raise ValueError("Batch.input_ids_BxT must be an integer array")
  if vocab_size is not None:
    # Out of range, jnp.take's embedding row is NaN (the update is then skipped
    # as non-finite, with nothing pointing at the ids) and the target gather
    # scores another token: pad ids included, as a NaN key poisons attention.
    ids = np.asarray(batch.input_ids_BxT)
    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any():
      r, t = _first_true(bad)
      raise ValueError(f"Batch.input_ids_BxT has token ids outside [0, vocab_size="
                       f"{vocab_size}), {int(bad.sum())} in all, the first {int(ids[r, t])} "
                       f"at row {r}, column {t}: the tokenizer and the model disagree")
  attn = np.asarray(batch.attention_mask_BxT)
  loss_mask = np.asarray(batch.loss_mask_BxT)
  for name, m in (("attention_mask_BxT", attn), ("loss_mask_BxT", loss_mask)):
    if not np.all((m == 0) | (m == 1)):
      raise ValueError(f"Batch.{name} must hold only 0/1")
  if np.any((loss_mask > 0) & (attn == 0)):
    raise ValueError("Batch.loss_mask_BxT is 1 where attention_mask_BxT is 0")
  if np.any(loss_mask[:, 0] > 0):
    raise ValueError("Batch.loss_mask_BxT[:, 0] must be 0 (the first token has no "
                     "prediction)")
  # Likewise a row's first real token: in the batch's layout its log-prob would come
  # from a pad position, in the step's left-aligned one (length buckets) it is 0.
  real = attn > 0
  first_B = np.argmax(real, axis=1)
  rows_B = real.any(axis=1) & (loss_mask[np.arange(b), first_B] > 0)
  if rows_B.any():
    raise ValueError(f"Batch.loss_mask_BxT is 1 on the first real token of row "
                     f"{int(np.argmax(rows_B))} (no token before it to predict it from)")
  # A trained token's log-prob comes from the logits one column back; after a pad
  # (a right-padded prompt ++ completion) that is a pad position's output.
  after_pad = (loss_mask[:, 1:] > 0) & ~real[:, :-1]
  if after_pad.any():
    r, t = _first_true(after_pad)
    raise ValueError(f"Batch.loss_mask_BxT is 1 at row {r}, column {t + 1}, after a pad "
                     f"(attention_mask_BxT is 0 at column {t}): its log-prob would come "
                     f"from the pad's logits; lay rows out as left-padded prompt ++ "
                     f"right-padded completion, with no pads between")
  checks = [("rewards_B", batch.rewards_B), ("sampler_logp_BxT", batch.sampler_logp_BxT)]
  if batch.baseline_rewards_B is not None:
    checks.append(("baseline_rewards_B", batch.baseline_rewards_B))
    nb = np.shape(batch.baseline_rewards_B)
    bp = b // group_size
    if len(nb) != 1 or nb[0] % bp or nb[0] // bp < group_size or nb[0] % batch_shards:
      raise ValueError(f"Batch.baseline_rewards_B has shape {nb}; expected [Bp*n_est] "
                       f"with Bp={bp}, n_est >= {group_size}, divisible by "
                       f"{batch_shards} batch shards")
  for name, x in checks:
    bad = ~np.isfinite(np.asarray(x, np.float64))
    if bad.any():
      first = _first_true(bad)
      raise ValueError(f"Batch.{name} has {int(bad.sum())} non-finite values "
                       f"(first at index {first})")
  # A log-prob is <= 0 (rounding leaves ~1e-7 above): a larger one is a negative
  # log-likelihood or a probability, whose ratios the loss would clip silently.
  above = (np.asarray(batch.sampler_logp_BxT) > 1e-3) & (loss_mask > 0)  # no float64 copy
  if above.any():
    r, t = _first_true(above)
    raise ValueError(f"Batch.sampler_logp_BxT is {float(batch.sampler_logp_BxT[r, t]):.4g} "
                     f"> 0 at row {r}, column {t} ({int(above.sum())} trained tokens): "
                     f"log-probs are <= 0; was a negative log-likelihood or a "
                     f"probability given?")


def abstract_batch(batch_size: int, seq_len: int, *, mesh: Mesh | None = None,
                   baseline_size: int | None = None) -> Batch:
  """A ``Batch`` of ``jax.ShapeDtypeStruct`` [batch_size, seq_len] placed like the step's.

  ``baseline_size``: length of ``baseline_rewards_B`` (Bp * n_est), if any.
  """
  sh = shd.batch_sharding(default_mesh(mesh))

  def spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sh)

  bxt = (batch_size, seq_len)
  # The dtypes of a run's batches (isojax.batching): a step compiled from these
  # shapes is the program its first update runs, not a second one.
  return Batch(input_ids_BxT=spec(bxt, jnp.int32), attention_mask_BxT=spec(bxt, jnp.int32),
               loss_mask_BxT=spec(bxt, jnp.int32), sampler_logp_BxT=spec(bxt, jnp.float32),
               rewards_B=spec((batch_size,), jnp.float32),
               baseline_rewards_B=None if baseline_size is None
               else spec((baseline_size,), jnp.float32))
