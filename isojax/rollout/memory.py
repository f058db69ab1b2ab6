"""What the in-process sampler's KV cache costs, and whether it fits beside the trainer.

On one accelerator the trainer's state (parameters, optimizer state, the update
step's activations) and the sampler's KV cache share the memory. The sampler
takes its share as `config.sampler.kv_budget_gib` (or a row cap,
`config.sampler.max_rows`): it decodes at most as many rows at once as that
budget holds, refilling finished rows with waiting ones. `check_memory_split`
is the check a run makes before its first update.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from isojax.models.kv_cache import KVCache, block_size
from isojax.rollout import decode

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


def lockstep_cache_bytes(cfg, rollouts: int, n: int, prompt_len: int,
                         completion_len: int) -> int:
  """Bytes of the cache of `rollouts` decoding at once (in lockstep): each of
  their rollouts / n prompts' `prompt_len` positions held once, and every
  rollout's own `completion_len`."""
  return (-(-rollouts // n) * kv_bytes_per_row(cfg, prompt_len)
          + rollouts * kv_bytes_per_row(cfg, completion_len))


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


def compiled_sampler_memory(model, s: decode.Static, *, rows: int, cache_len: int,
                            pairs: int, prompts: int, prompt_len: int) -> dict:
  """XLA's memory analysis of the sampler's two programs for a request whose
  `pairs` rollouts are decoded `rows` at a time (continuous batching), compiled
  from shapes only (`model` may come from `nnx.eval_shape`: no weights needed),
  as `JaxSampler` compiles them: decode state donated, the decode loop at the
  widest read extent (the whole cache, as a long request's last chunks run).

  Args:
    model: the Decoder (its graph and parameter shapes are used).
    s: the sampler's static settings (max_tokens bucket, sampling mode).
    rows, cache_len: cache rows and positions per row (prompt + completion).
    pairs, prompts, prompt_len: rollouts of the request, distinct prompts of an
      admission, and the prompt bucket.

  Returns:
    {"admit": stats, "decode": stats}: each program's `memory_analysis()`. One
    device holds the larger of their arguments + temporaries.
  """
  cfg = model.cfg
  graphdef, state = nnx.split(model)

  def analysis(program, *args):
    jitted = jax.jit(functools.partial(program, graphdef), static_argnums=0,
                     donate_argnums=(2, 3))
    return jitted.lower(s, state, *args).compile().memory_analysis()

  sds = jax.ShapeDtypeStruct
  ints = lambda *shape: sds(shape, jnp.int32)
  rows_in, out = jax.eval_shape(lambda: decode.empty(cfg, s, rows, cache_len, pairs))
  stop_V = sds((cfg.vocab_size,), bool)
  sampling = (sds((), jnp.float32), sds((), jnp.float32), ints())  # temperature, top_p, max_tokens
  a = decode.admission_size(rows)
  admit = analysis(decode.admit, rows_in, out, ints(prompts, prompt_len),
                   ints(prompts, prompt_len), ints(a), ints(a), ints(a), sds((a,), bool),
                   stop_V, jax.eval_shape(lambda: jax.random.key(0)), *sampling)
  widest = rows_in._replace(cache=rows_in.cache.with_read_len(rows_in.cache.max_len))
  steps = analysis(decode.decode_steps, widest, out, stop_V, *sampling, ints(), ints())
  return {"admit": admit, "decode": steps}


def check_memory_split(cfg, *, max_len: int, device_gib: float, trainer_gib: float,
                       kv_budget_gib: float = 0.0, max_rows: int = 0,
                       rollouts: int | Sequence[int] | None = None,
                       sampler_weights_gib: float = 0.0) -> dict:
  """Checks that the trainer's state and the sampler's cache fit on one device.

  Args:
    cfg: the model config (layers, kv heads, head_dim, dtype).
    max_len: prompt + completion positions a cache row holds.
    device_gib: memory of one accelerator.
    trainer_gib: the trainer's per-device memory (e.g. the compiled update
      step's, as a dry run reports it).
    kv_budget_gib: the sampler's budget per generate call (0 = none given:
      max_rows, else every rollout of the call at once, sets its cache size).
    max_rows: the sampler's row cap per call (0 = none).
    rollouts: rollouts of a generate call (rows needed when nothing caps them),
      or of each of several calls that decode at once (each has its own cache).
    sampler_weights_gib: a copy of the parameters the sampler holds beside the
      trainer's (0: it decodes with the trainer's own).

  Returns:
    {"rows", "kv_gib", "trainer_gib", "sampler_weights_gib", "device_gib"}: the
    split (rows: of all concurrent calls together).
  Raises:
    ValueError naming every number when trainer + sampler exceed the device.
  """
  per_row = kv_bytes_per_row(cfg, max_len)
  calls = [rollouts] if rollouts is None or isinstance(rollouts, int) else list(rollouts)
  calls = [c for c in calls if c != 0]  # None: a call of unknown size; 0: no call
  caps = [max_rows] if max_rows else []
  if kv_budget_gib:
    caps.append(rows_for_budget(cfg, kv_budget_gib, max_len))
  if not calls or (None in calls and not caps):
    raise ValueError("check_memory_split: give kv_budget_gib, max_rows or rollouts")
  rows = sum(min(caps + ([c] if c else [])) for c in calls)  # each call's own cache
  kv_gib = rows * per_row / GIB
  used = trainer_gib + sampler_weights_gib + kv_gib
  if used > device_gib:
    left = max(device_gib - trainer_gib - sampler_weights_gib, 0)
    concurrent = len(calls)  # each call may fill its own budget at once
    copy = (f" + sampler's weight copy ({sampler_weights_gib:.2f} GiB)"
            if sampler_weights_gib else "")
    at_once = f", {concurrent} generate calls at once" if concurrent > 1 else ""
    raise ValueError(
        f"trainer ({trainer_gib:.2f} GiB){copy} + sampler KV cache ({kv_gib:.2f} GiB = "
        f"{rows} rows x {max_len} positions x {per_row / 2**20:.2f} MiB per row{at_once}) = "
        f"{used:.2f} GiB > device memory {device_gib:.2f} GiB; set "
        f"sampler.kv_budget_gib <= {left / concurrent:.2f} (or sampler.max_rows <= "
        f"{int(left * GIB // per_row) // concurrent})")
  return {"rows": rows, "kv_gib": kv_gib, "trainer_gib": trainer_gib,
          "sampler_weights_gib": sampler_weights_gib, "device_gib": device_gib}


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
                    eval_rollouts: int = 0, pipelined_params=None,
                    device_memory_gib: float | None = None) -> dict | None:
  """The check a run makes before its first update, on one accelerator shared by
  the trainer and the in-process sampler.

  The trainer's share is its initialised state on this device (parameters,
  optimizer moments, reference parameters); the update step's activations come
  on top (`python -m isojax.main --dry_run` reports the compiled step). The
  sampler's share is the KV cache of its largest generate call, a training
  batch's `rollouts` or an evaluation's `eval_rollouts`, capped by
  `config.sampler.kv_budget_gib` / `max_rows`. With PipelineRL
  (`pipelined_params`: the parameters) the sampler holds its own copy of them
  (the update donates the trainer's while it decodes), and an evaluation
  decodes while the producer samples: both caches count. Returns the split, or
  None where it does not apply (another backend, or device memory unknown, as
  on CPU).
  """
  if config.sampler.backend != "jax":
    return None
  device_memory_gib = device_memory_gib or device_gib()
  if device_memory_gib is None:
    return None
  pipelined = pipelined_params is not None
  return check_memory_split(
      model_cfg, max_len=max_len, device_gib=device_memory_gib,
      trainer_gib=per_device_gib(train_state),
      kv_budget_gib=float(config.sampler.get("kv_budget_gib", 0.0)),
      max_rows=int(config.sampler.get("max_rows", 0)),
      rollouts=(rollouts, eval_rollouts) if pipelined else max(rollouts, eval_rollouts),
      sampler_weights_gib=per_device_gib(pipelined_params) if pipelined else 0.0)
