"""What the in-process sampler's KV cache costs, and whether it fits beside the trainer.

On one accelerator the trainer's state (parameters, optimizer state, the update
step's activations) and the sampler's KV cache share the memory. The sampler
takes its share as `config.sampler.kv_budget_gib` (or a row cap,
`config.sampler.max_rows`): it decodes at most as many rows at once as that
budget holds, refilling finished rows with waiting ones. `check_memory_split`
is the check a run makes before its first update.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from isojax.models.kv_cache import KVCache, block_size

GIB = 1 << 30


def cache_slots(max_len: int) -> int:
  """Slots a cache for `max_len` positions really holds (whole attention blocks)."""
  blk = block_size(max_len)
  return -(-int(max_len) // blk) * blk


def kv_bytes_per_row(cfg, max_len: int) -> int:
  """Bytes of one cache row holding `max_len` positions (keys, values and the
  valid mask, all layers), in the model's compute dtype."""
  slots = cache_slots(max_len)
  per_slot = KVCache.bytes_per_slot(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                    cfg.dtype)
  return slots * (per_slot + jnp.dtype(bool).itemsize)


def rows_for_budget(cfg, kv_budget_gib: float, max_len: int) -> int:
  """The most cache rows of `max_len` positions that fit in `kv_budget_gib`.

  Raises ValueError naming the numbers when not even one row fits.
  """
  per_row = kv_bytes_per_row(cfg, max_len)
  rows = int(kv_budget_gib * GIB // per_row)
  if rows < 1:
    raise ValueError(
        f"sampler kv_budget_gib={kv_budget_gib:g} holds no cache row of {max_len} positions "
        f"({per_row / GIB:.3f} GiB per row: {cfg.num_layers} layers x {cfg.num_kv_heads} kv "
        f"heads x head_dim {cfg.head_dim}, {jnp.dtype(cfg.dtype).name}); raise the budget "
        f"or lower sampler.max_tokens")
  return rows


def check_memory_split(cfg, *, max_len: int, device_gib: float, trainer_gib: float,
                       kv_budget_gib: float = 0.0, max_rows: int = 0,
                       rollouts: int | None = None) -> dict:
  """Checks that the trainer's state and the sampler's cache fit on one device.

  Args:
    cfg: the model config (layers, kv heads, head_dim, dtype).
    max_len: prompt + completion positions a cache row holds.
    device_gib: memory of one accelerator.
    trainer_gib: the trainer's per-device memory (e.g. the compiled update
      step's, as a dry run reports it).
    kv_budget_gib: the sampler's budget (0 = none given: max_rows, else every
      rollout at once, sets the cache size).
    max_rows: the sampler's row cap (0 = none).
    rollouts: rollouts per batch (rows needed when nothing caps them).

  Returns:
    {"rows", "kv_gib", "trainer_gib", "device_gib"}: the split.
  Raises:
    ValueError naming every number when trainer + cache exceed the device.
  """
  per_row = kv_bytes_per_row(cfg, max_len)
  caps = [r for r in (max_rows or None, rollouts) if r]
  if kv_budget_gib:
    caps.append(rows_for_budget(cfg, kv_budget_gib, max_len))
  if not caps:
    raise ValueError("check_memory_split: give kv_budget_gib, max_rows or rollouts")
  rows = min(caps)
  kv_gib = rows * per_row / GIB
  if trainer_gib + kv_gib > device_gib:
    raise ValueError(
        f"trainer ({trainer_gib:.2f} GiB) + sampler KV cache ({kv_gib:.2f} GiB = {rows} rows "
        f"x {max_len} positions x {per_row / 2**20:.2f} MiB per row) = "
        f"{trainer_gib + kv_gib:.2f} GiB > device memory {device_gib:.2f} GiB; set "
        f"sampler.kv_budget_gib <= {max(device_gib - trainer_gib, 0):.2f} (or "
        f"sampler.max_rows <= {int(max(device_gib - trainer_gib, 0) * GIB // per_row)})")
  return {"rows": rows, "kv_gib": kv_gib, "trainer_gib": trainer_gib,
          "device_gib": device_gib}


def device_gib() -> float | None:
  """Memory of the first local accelerator, None where the backend does not say (CPU)."""
  stats = jax.local_devices()[0].memory_stats() or {}
  limit = stats.get("bytes_limit")
  return None if not limit else limit / GIB


def per_device_gib(tree) -> float:
  """GiB the first local device holds of `tree`'s arrays (its shards only)."""
  dev = jax.local_devices()[0]
  total = 0
  for x in jax.tree.leaves(tree):
    shards = getattr(x, "addressable_shards", None)
    if shards is None:
      continue
    total += sum(s.data.nbytes for s in shards if s.device == dev)
  return total / GIB


def check_run_split(config, model_cfg, train_state, *, rollouts: int, max_len: int,
                    device_memory_gib: float | None = None) -> dict | None:
  """The check a run makes before its first update, on one accelerator shared by
  the trainer and the in-process sampler.

  The trainer's share is its initialised state on this device (parameters,
  optimizer moments, reference parameters); the update step's activations come
  on top (`python -m isojax.main --dry_run` reports the compiled step). The
  sampler's share is `config.sampler.kv_budget_gib` / `max_rows` (else every
  rollout of a batch at once). Returns the split, or None where it does not
  apply (another backend, or device memory unknown, as on CPU).
  """
  if config.sampler.backend != "jax":
    return None
  device_memory_gib = device_memory_gib or device_gib()
  if device_memory_gib is None:
    return None
  return check_memory_split(
      model_cfg, max_len=max_len, device_gib=device_memory_gib,
      trainer_gib=per_device_gib(train_state),
      kv_budget_gib=float(config.sampler.get("kv_budget_gib", 0.0)),
      max_rows=int(config.sampler.get("max_rows", 0)), rollouts=rollouts)
