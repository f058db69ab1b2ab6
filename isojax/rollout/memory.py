"""What the in-process sampler's KV cache costs, and whether it fits beside the trainer.

On one accelerator the trainer's state (parameters, optimizer state, the update
step's activations) and the sampler's KV cache share the memory. The sampler
takes its share as `config.sampler.kv_budget_gib` (or a row cap,
`config.sampler.max_rows`): it decodes at most as many rows at once as that
budget holds, refilling finished rows with waiting ones. `check_memory_split`
is the check a run makes before its first update.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from isojax.models.kv_cache import DEFAULT_BLOCK, KVCache, block_size
from isojax.rollout import decode

GIB = 1 << 30


def cache_slots(max_len: int, block: int = DEFAULT_BLOCK) -> int:
  """Slots a cache for `max_len` positions really holds (whole attention blocks
  of `block` slots, `JaxSampler`'s cache_block)."""
  blk = block_size(max_len, block)
  return -(-int(max_len) // blk) * blk


def kv_bytes_per_row(cfg, max_len: int, block: int = DEFAULT_BLOCK) -> int:
  """Bytes of one cache row holding `max_len` positions (keys, values and the
  valid mask, all layers), in the model's compute dtype."""
  slots = cache_slots(max_len, block)
  per_slot = KVCache.bytes_per_slot(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                    cfg.dtype)
  return slots * (per_slot + jnp.dtype(bool).itemsize)


def lockstep_cache_bytes(cfg, rollouts: int, n: int, prompt_len: int,
                         completion_len: int, block: int = DEFAULT_BLOCK,
                         row_multiple: int = 1) -> int:
  """Bytes of the cache of `rollouts` decoding at once (in lockstep), all the
  `row_multiple` devices their rows are split across together: every rollout's
  own `completion_len`, and each of their rollouts / n prompts' `prompt_len`
  positions, held once when the prompt count divides the devices, else on
  every device (`decode` replicates prompts it cannot split evenly)."""
  layout = CacheLayout(prompt_len, completion_len, pairs=rollouts, rows=rollouts, n=n,
                       row_multiple=row_multiple, block=block)
  return layout.bytes_per_device(cfg) * row_multiple


def padded_prompts(num_prompts: int, n: int, row_multiple: int) -> int:
  """The prompt count a request is padded to: a power of two, raised so that its
  prompts x n rollouts split evenly over `row_multiple` devices."""
  q = decode.next_pow2(num_prompts)
  m = row_multiple // math.gcd(n, row_multiple)
  return -(-q // m) * m


def rows_at_once(cfg, rollouts: int, cache_len: int, *, n: int = 1, prompt_len: int = 0,
                 max_rows: int | None = None, kv_budget_gib: float | None = None,
                 row_multiple: int = 1, block: int = DEFAULT_BLOCK) -> int:
  """Rows decoded at once for `rollouts` pairs (n per prompt) with `cache_len`
  positions each, `prompt_len` of them the prompt's: all of them when their
  lockstep cache over all devices (`lockstep_cache_bytes`) fits the KV budget,
  else fewer rows of `cache_len`, as many as it holds; at most `max_rows`; a
  multiple of `row_multiple` (the devices rows are split over) below
  `rollouts`. Whatever the caps, the cache all devices hold together stays
  within the budget.

  Raises ValueError naming the cap when it allows fewer rows than `row_multiple`
  (each device must decode at least one).
  """
  caps = {"rollouts": rollouts}
  if max_rows is not None:
    caps["max_rows"] = max_rows
  if kv_budget_gib is not None:
    refilled = max_rows is not None and max_rows < rollouts
    if refilled or lockstep_cache_bytes(cfg, rollouts, n, prompt_len, cache_len - prompt_len,
                                        block, row_multiple) > kv_budget_gib * GIB:
      # A cache of fewer rows than pairs is refilled, each row holding its own
      # prompt: one of every pair's rows can cost more than the lockstep cache
      # (whose prompts are shared), so it is capped below the pairs too.
      caps["kv_budget_gib"] = min(rows_for_budget(cfg, kv_budget_gib, cache_len, block),
                                  rollouts - 1)
  cap = min(caps, key=caps.get)
  rows = caps[cap]
  if rows >= rollouts:
    return rows
  if rows < row_multiple:
    given = (max_rows if cap == "max_rows"
             else f"{kv_budget_gib:g} (room for {rows} row{'s' * (rows != 1)})")
    raise ValueError(
        f"sampler {cap}={given} allows fewer rollout rows at once than the {row_multiple} "
        f"devices the rows are split over (each decodes at least one row of {cache_len} "
        f"positions); raise it to at least {row_multiple} rows, or use a mesh with fewer "
        f"data x fsdp devices")
  return rows // row_multiple * row_multiple  # every device decodes as many rows


@dataclasses.dataclass(frozen=True)
class CacheLayout:
  """The KV cache of one generate call, as `JaxSampler` allocates it.

  Attributes:
    prompt_len, completion_len: the prompt bucket and max_tokens' bucket.
    pairs: rollouts, the prompt count padded (`padded_prompts`) times n.
    rows: rows decoded at once; all pairs (lockstep: each prompt's positions
      held once, beside every row's completion) or fewer, of prompt_len +
      completion_len positions each, refilled as they finish.
    n: rollouts per prompt.
    row_multiple: devices the rows (and prompts, when their count divides) are
      split over.
    block: slots per attention block (the cache holds whole blocks).
  """
  prompt_len: int
  completion_len: int
  pairs: int
  rows: int
  n: int
  row_multiple: int = 1
  block: int = DEFAULT_BLOCK

  @property
  def lockstep(self) -> bool:
    return self.rows == self.pairs

  @property
  def cache_len(self) -> int:
    return self.prompt_len + self.completion_len

  def bytes_per_device(self, cfg) -> int:
    """What one device holds of the cache (the admission's prompt cache, alive
    while it prefills, aside)."""
    m, blk = self.row_multiple, self.block
    if not self.lockstep:
      return -(-self.rows // m) * kv_bytes_per_row(cfg, self.cache_len, blk)
    prompts = -(-self.pairs // self.n)
    held = prompts // m if prompts % m == 0 else prompts  # split, else replicated
    return (held * kv_bytes_per_row(cfg, self.prompt_len, blk)
            + -(-self.rows // m) * kv_bytes_per_row(cfg, self.completion_len, blk))

  def __str__(self) -> str:
    per_device = f" over {self.row_multiple} devices" if self.row_multiple > 1 else ""
    if self.lockstep:
      return (f"{self.pairs // self.n} prompts x {self.prompt_len} + {self.rows} rows x "
              f"{self.completion_len} positions{per_device}")
    return f"{self.rows} rows x {self.cache_len} positions{per_device}"


def cache_layout(cfg, num_prompts: int, n: int, longest_prompt: int, max_tokens: int, *,
                 min_prompt_bucket: int = 16, max_rows: int | None = None,
                 kv_budget_gib: float | None = None, row_multiple: int = 1,
                 block: int = DEFAULT_BLOCK) -> CacheLayout:
  """The cache of a generate call of `num_prompts` prompts (the longest
  `longest_prompt` tokens), n rollouts each, up to `max_tokens` new tokens."""
  prompt_len = max(decode.next_pow2(longest_prompt), min_prompt_bucket)
  completion_len = decode.next_pow2(max_tokens)
  pairs = padded_prompts(num_prompts, n, row_multiple) * n
  rows = rows_at_once(cfg, pairs, prompt_len + completion_len, n=n, prompt_len=prompt_len,
                      max_rows=max_rows, kv_budget_gib=kv_budget_gib,
                      row_multiple=row_multiple, block=block)
  return CacheLayout(prompt_len, completion_len, pairs, rows, n, row_multiple, block)


def rows_for_budget(cfg, kv_budget_gib: float, max_len: int,
                    block: int = DEFAULT_BLOCK) -> int:
  """The most cache rows of `max_len` positions that fit in `kv_budget_gib`.

  Raises ValueError naming the numbers when not even one row fits.
  """
  per_row = kv_bytes_per_row(cfg, max_len, block)
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


def check_memory_split(cfg, *, device_gib: float, trainer_gib: float,
                       caches: Sequence[CacheLayout], sampler_weights_gib: float = 0.0,
                       step_gib: float = 0.0) -> dict:
  """Checks that the trainer's state and the sampler's caches fit on one device.

  Args:
    cfg: the model config (layers, kv heads, head_dim, dtype).
    device_gib: memory of one accelerator.
    trainer_gib: the trainer's per-device memory (e.g. the compiled update
      step's, as a dry run reports it).
    caches: the KV cache of each generate call that may decode at once
      (`cache_layout`), each held whole.
    sampler_weights_gib: a copy of the parameters the sampler holds beside the
      trainer's (0: it decodes with the trainer's own).
    step_gib: the update step's temporaries, where it runs while the sampler
      decodes (PipelineRL; 0: it runs between generate calls).

  Returns:
    {"rows", "kv_gib", "trainer_gib", "step_gib", "sampler_weights_gib",
    "device_gib"}: the split per device (rows: of all the calls together, over
    all devices).
  Raises:
    ValueError naming every number when trainer + sampler exceed the device,
    and the kv_budget_gib and max_rows under which the caches, laid out again
    (`relayout`), fit.
  """
  kv_gib = sum(c.bytes_per_device(cfg) for c in caches) / GIB
  used = trainer_gib + step_gib + sampler_weights_gib + kv_gib
  if used > device_gib:
    left = max(device_gib - trainer_gib - step_gib - sampler_weights_gib, 0)
    concurrent = len(caches)  # each call may fill its own budget at once
    widest = max(caches, key=lambda c: c.cache_len)
    per_row = kv_bytes_per_row(cfg, widest.cache_len, widest.block)
    extra = (f" + update step's temporaries ({step_gib:.2f} GiB)" if step_gib else "") + (
        f" + sampler's weight copy ({sampler_weights_gib:.2f} GiB)"
        if sampler_weights_gib else "")
    at_once = f", {concurrent} generate calls at once" if concurrent > 1 else ""
    raise ValueError(
        f"trainer ({trainer_gib:.2f} GiB){extra} + sampler KV cache ({kv_gib:.2f} GiB per "
        f"device: {'; '.join(map(str, caches))}; {per_row / 2**20:.2f} MiB per row of "
        f"{widest.cache_len} positions{at_once}) = {used:.2f} GiB > device memory "
        f"{device_gib:.2f} GiB; {_split_advice(cfg, caches, left)}")
  return {"rows": sum(c.rows for c in caches), "kv_gib": kv_gib, "trainer_gib": trainer_gib,
          "step_gib": step_gib, "sampler_weights_gib": sampler_weights_gib,
          "device_gib": device_gib}


def relayout(cfg, layout: CacheLayout, *, max_rows: int | None = None,
             kv_budget_gib: float | None = None) -> CacheLayout:
  """`layout`'s request (buckets, pairs, devices) laid out under these caps."""
  rows = rows_at_once(cfg, layout.pairs, layout.cache_len, n=layout.n,
                      prompt_len=layout.prompt_len, max_rows=max_rows,
                      kv_budget_gib=kv_budget_gib, row_multiple=layout.row_multiple,
                      block=layout.block)
  return dataclasses.replace(layout, rows=rows)


def _fits(cfg, caches: Sequence[CacheLayout], left_gib: float, **caps) -> bool:
  """Whether the caches, laid out again under `caps`, fit in `left_gib` per device."""
  try:
    held = sum(relayout(cfg, c, **caps).bytes_per_device(cfg) for c in caches)
  except ValueError:  # the cap leaves a device without a row
    return False
  return held <= left_gib * GIB * (1 + 1e-9)  # device - trainer in floats: 0.09999...


def _round_down(x: float, digits: int = 3) -> float:
  """`x` cut to `digits` significant digits, never rounded up (advice to follow)."""
  if x <= 0:
    return 0.0
  unit = 10.0 ** (math.floor(math.log10(x)) - digits + 1)
  return math.floor(x / unit * (1 + 1e-9)) * unit  # 0.0999...9 is 0.1


def _split_advice(cfg, caches: Sequence[CacheLayout], left_gib: float) -> str:
  """A kv_budget_gib and a max_rows under which the caches, laid out again as the
  sampler would, fit in `left_gib` per device (checked, not estimated)."""
  # A budget B keeps a call's cache within B over its devices, so within
  # B / devices on each (`rows_at_once`); the calls share what is left.
  budget = _round_down(left_gib / sum(1 / c.row_multiple for c in caches))
  advice = []
  if budget and _fits(cfg, caches, left_gib, kv_budget_gib=budget):
    advice.append(f"sampler.kv_budget_gib <= {budget:g}")
  m = max(c.row_multiple for c in caches)
  per_row = max(kv_bytes_per_row(cfg, c.cache_len, c.block) for c in caches)
  rows = int(left_gib * GIB // per_row) // len(caches) * m
  for c in sorted(caches, key=lambda c: c.pairs):
    if rows >= c.pairs and not _fits(cfg, [c], left_gib / len(caches), max_rows=rows):
      rows = (c.pairs - 1) // m * m  # its lockstep cache does not fit: refill rows
  if rows >= m and _fits(cfg, caches, left_gib, max_rows=rows):
    advice.append(f"sampler.max_rows <= {rows}")
  if not advice:
    return "not one cache row per device fits beside the trainer"
  return "set " + " (or ".join(advice) + ")" * (len(advice) - 1)


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


def check_run_split(config, model_cfg, train_state, *, train_cache: CacheLayout,
                    eval_cache: CacheLayout | None = None, pipelined_params=None,
                    step_gib: Callable[[], float] | None = None,
                    device_memory_gib: float | None = None) -> dict | None:
  """The check a run makes before its first update, on one accelerator shared by
  the trainer and the in-process sampler.

  The trainer's share is its initialised state on this device (parameters,
  optimizer moments, reference parameters). The sampler's share is the KV
  cache of its largest generate call, a training batch's (`train_cache`) or
  an evaluation's (`eval_cache`), as the sampler lays it out
  (`JaxSampler.cache_layouts`: buckets, the row cap of
  `config.sampler.kv_budget_gib` / `max_rows`, rows split over the mesh). With
  PipelineRL (`pipelined_params`: the parameters) the sampler holds its own
  copy of them (the update donates the trainer's while it decodes), an
  evaluation decodes while the producer samples (both caches count), and the
  update step's temporaries share the device with them: `step_gib()` gives
  those (GiB per device, from the compiled step), called only then. Without
  PipelineRL the step runs between generate calls; its activations are the
  compiler's to fit (`python -m isojax.main --dry_run` reports them). Returns
  the split, or None where it does not apply (another backend, or device
  memory unknown, as on CPU).
  """
  if config.sampler.backend != "jax":
    return None
  device_memory_gib = device_memory_gib or device_gib()
  if device_memory_gib is None:
    return None
  caches = [c for c in (train_cache, eval_cache) if c is not None]
  if pipelined_params is None:  # one call at a time: the larger
    caches = [max(caches, key=lambda c: c.bytes_per_device(model_cfg))]
  pipelined = pipelined_params is not None
  return check_memory_split(
      model_cfg, device_gib=device_memory_gib, trainer_gib=per_device_gib(train_state),
      caches=caches, sampler_weights_gib=per_device_gib(pipelined_params) if pipelined else 0.0,
      step_gib=step_gib() if pipelined and step_gib is not None else 0.0)
