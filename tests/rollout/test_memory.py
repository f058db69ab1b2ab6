"""The sampler's KV-cache sizing and the trainer + sampler memory-split check."""

import re

import jax
import jax.numpy as jnp
import ml_collections
import pytest

from isojax.models import ModelConfig
from isojax.rollout import memory


def _cfg(dtype=jnp.float32, **kw):
  hf = dict(architectures=["Qwen2ForCausalLM"], vocab_size=32, hidden_size=64,
            intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=32, max_position_embeddings=64)
  hf.update(kw)
  return ModelConfig.from_hf_dict(hf, dtype=dtype)


def test_bytes_per_row_from_the_formula():
  # 2 layers x 1 kv head x 32 dims x (k, v) x 4 bytes + 1 valid byte per position.
  assert memory.kv_bytes_per_row(_cfg(), 24) == 24 * (2 * 2 * 1 * 32 * 4 + 1)
  # Whole blocks of 256 past one block: 300 positions take 512 slots.
  assert memory.cache_slots(300) == 512 and memory.cache_slots(20) == 24
  # Qwen2.5-1.5B in bf16: 28 layers x 2 kv heads x 128 dims, 28 KiB per position;
  # 512 rollouts x (256 prompt + 8192 new) positions is ~116 GiB dense.
  qwen = _cfg(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
              num_key_value_heads=2, head_dim=128, dtype=jnp.bfloat16)
  per_row = memory.kv_bytes_per_row(qwen, 256 + 8192)
  assert per_row == 8448 * (28 * 2 * 2 * 128 * 2 + 1)
  assert 115 < 512 * per_row / memory.GIB < 117
  assert memory.rows_for_budget(qwen, 24.0, 256 + 8192) == 24 * memory.GIB // per_row


def test_rows_at_once_honours_its_caps_over_a_mesh():
  cfg = _cfg()
  per_row = memory.kv_bytes_per_row(cfg, 24)
  at_once = lambda **kw: memory.rows_at_once(cfg, 64, 24, prompt_len=16, **kw)
  assert at_once(row_multiple=8) == 64  # lockstep: every rollout
  assert at_once(max_rows=12, row_multiple=8) == 8  # a multiple of the 8 devices, <= 12
  assert at_once(kv_budget_gib=20.5 * per_row / memory.GIB, row_multiple=8) == 16
  # A cap below one row per device is an error naming it, never silently exceeded.
  with pytest.raises(ValueError, match=r"sampler max_rows=2 allows fewer rollout rows .* "
                     r"than the 8 devices"):
    at_once(max_rows=2, row_multiple=8)
  with pytest.raises(ValueError, match=r"sampler kv_budget_gib=\S+ \(room for 1 row\)"):
    at_once(kv_budget_gib=1.5 * per_row / memory.GIB, row_multiple=8)
  assert at_once(max_rows=2) == 2  # one device


def _rows(cfg, rows, positions, row_multiple=1):
  """A refilled cache of `rows` rows of `positions` (no prompt shared)."""
  return memory.CacheLayout(prompt_len=16, completion_len=positions - 16, pairs=10**9,
                            rows=rows, n=1, row_multiple=row_multiple)


def test_memory_split_check_names_the_numbers():
  cfg = _cfg()
  per_row = memory.kv_bytes_per_row(cfg, 24)
  ok = memory.check_memory_split(cfg, device_gib=1.0, trainer_gib=0.5,
                                 caches=[_rows(cfg, 100, 24)])
  assert ok["rows"] == 100 and ok["kv_gib"] == pytest.approx(100 * per_row / memory.GIB)
  rows = memory.rows_for_budget(cfg, 0.2, 24)
  with pytest.raises(ValueError, match=r"trainer \(0\.90 GiB\) \+ sampler KV cache "
                     rf"\(0\.20 GiB per device: {rows} rows x 24 positions; 0\.01 MiB per row "
                     r"of 24 positions\).*> device memory 1\.00 GiB; "
                     r"set sampler.kv_budget_gib <= 0\.1 \(or sampler.max_rows <= 8721\)$"):
    memory.check_memory_split(cfg, device_gib=1.0, trainer_gib=0.9,
                              caches=[_rows(cfg, rows, 24)])
  # Rows split over 8 devices: each holds an eighth; a budget spans all 8.
  split = memory.check_memory_split(cfg, device_gib=1.0, trainer_gib=0.9,
                                    caches=[_rows(cfg, rows, 24, row_multiple=8)])
  assert split["kv_gib"] == pytest.approx(-(-rows // 8) * per_row / memory.GIB)
  with pytest.raises(ValueError, match=r"over 8 devices.*kv_budget_gib <= 0\.08 "):
    memory.check_memory_split(cfg, device_gib=1.0, trainer_gib=0.99,
                              caches=[_rows(cfg, rows, 24, row_multiple=8)])
  with pytest.raises(ValueError, match=r"not one cache row per device fits beside the trainer"):
    memory.check_memory_split(cfg, device_gib=1.0, trainer_gib=1.0,
                              caches=[_rows(cfg, 1, 24)])


def test_kv_budget_counts_prompts_copied_to_every_device():
  """4 prompts x n=64 over 8 devices: 4 prompts do not split 8 ways, so every
  device holds all 4 (32 prompt caches in all). A budget holding them once is
  far from what the lockstep cache takes; the rows it holds are refilled."""
  cfg = _cfg()
  once = 4 * memory.kv_bytes_per_row(cfg, 256) + 256 * memory.kv_bytes_per_row(cfg, 16)
  held = memory.lockstep_cache_bytes(cfg, 256, 64, 256, 16, row_multiple=8)
  assert held == 32 * memory.kv_bytes_per_row(cfg, 256) + 256 * memory.kv_bytes_per_row(
      cfg, 16) > 2 * once
  layout = memory.cache_layout(cfg, 4, 64, 200, 16, row_multiple=8,
                               kv_budget_gib=once / memory.GIB)
  rows = once // memory.kv_bytes_per_row(cfg, 256 + 16)  # 10 (272 positions: 512 slots)
  assert not layout.lockstep and layout.rows == rows // 8 * 8 == 8
  assert 8 * layout.bytes_per_device(cfg) <= once
  fits = memory.cache_layout(cfg, 4, 64, 200, 16, row_multiple=8,
                             kv_budget_gib=held / memory.GIB)
  assert fits.lockstep and 8 * fits.bytes_per_device(cfg) == held
  # A row cap below the pairs refills rows of prompt + completion: the budget
  # holds them too, though the lockstep cache would have fitted.
  capped = memory.cache_layout(cfg, 4, 64, 200, 16, row_multiple=8, max_rows=128,
                               kv_budget_gib=held / memory.GIB)
  assert capped.rows == held // memory.kv_bytes_per_row(cfg, 256 + 16) // 8 * 8 == 24


def _advice(message: str) -> dict:
  """{"kv_budget_gib": float, "max_rows": int} advised by a failed split check."""
  found = dict(re.findall(r"sampler\.(kv_budget_gib|max_rows) <= ([\d.e-]+)", message))
  return {"kv_budget_gib": float(found["kv_budget_gib"]), "max_rows": int(found["max_rows"])}


@pytest.mark.parametrize("prompts, n, devices, calls", [
    (4, 64, 8, 1),  # prompts copied to every device
    (2, 4, 4, 1),  # a row per device: the lockstep cache must be refilled
    (64, 4, 8, 2),  # prompts split; two calls at once
    (4, 64, 1, 2)])
def test_following_the_split_advice_fits(prompts, n, devices, calls):
  """The kv_budget_gib and the max_rows a failed check advises each make the
  caches the sampler then lays out fit beside the trainer."""
  cfg = _cfg()
  layout = lambda **caps: memory.cache_layout(cfg, prompts, n, 100, 16,
                                              row_multiple=devices, **caps)
  per_device = layout().bytes_per_device(cfg) / memory.GIB
  device_gib, trainer_gib = 1.0, 1.0 - 0.9 * calls * per_device
  with pytest.raises(ValueError, match=r"> device memory") as failed:
    memory.check_memory_split(cfg, device_gib=device_gib, trainer_gib=trainer_gib,
                              caches=[layout()] * calls)
  for cap, value in _advice(str(failed.value)).items():
    memory.check_memory_split(cfg, device_gib=device_gib, trainer_gib=trainer_gib,
                              caches=[layout(**{cap: value})] * calls)


def caches_on_device_0(sampler, generate) -> list[int]:
  """Bytes of keys, values and valid masks of each cache JaxSampler `sampler`
  allocates while `generate()` runs, on the first device."""
  device, held = jax.devices()[0], []

  def measured(*args):
    rows, out = empty(*args)
    cache = rows.cache
    arrays = [*cache.k_BxKxHxS, *cache.v_BxKxSxH, cache.valid_BxS,
              *cache.prefix_k_QxKxHxL, *cache.prefix_v_QxKxLxH, cache.prefix_valid_QxL]
    held.append(sum(sh.data.nbytes for x in arrays if x is not None
                    for sh in x.addressable_shards if sh.device == device))
    return rows, out

  empty, sampler._jit_empty = sampler._jit_empty, measured
  try:
    generate()
  finally:
    sampler._jit_empty = empty
  return held


@pytest.mark.parametrize("mesh, max_rows, lockstep, block", [
    (None, None, {True}, 256), (None, 4, {False}, 256), ("fsdp8", None, {True}, 256),
    ("fsdp8", 8, {True, False}, 256),
    (None, 4, {False}, 16)])  # 24 positions in blocks of 16: 32 slots
def test_cache_layout_is_what_generate_allocates_on_a_device(mesh, max_rows, lockstep,
                                                             block):
  """Prompt counts and max_tokens round up to powers of two, a lockstep cache
  holds each prompt once, a refilled one rows of prompt + completion, and rows
  split over the mesh: the layout the run checks is the sampler's, byte for byte."""
  from flax import nnx

  from isojax import sharding
  from isojax.models import Decoder
  from isojax.rollout.jax_sampler import JaxSampler

  cfg = _cfg(num_hidden_layers=1)
  model = Decoder(cfg, rngs=nnx.Rngs(0))
  mesh = sharding.make_mesh(devices=jax.devices()[:8]) if mesh else None
  sampler = JaxSampler(model, mesh=mesh, max_rows=max_rows, cache_block=block)
  for prompts, n, max_tokens in (([[1, 2, 3]] * 3, 2, 5), ([[4] * 20, [5]], 3, 9)):
    (layout,) = sampler.cache_layouts(len(prompts), n, max(map(len, prompts)), max_tokens)
    (got,) = caches_on_device_0(sampler, lambda: sampler.generate(
        prompts, n=n, max_tokens=max_tokens, temperature=1.0))
    assert got == layout.bytes_per_device(cfg), (prompts, n, layout)
    lockstep.discard(layout.lockstep)
  assert not lockstep  # both layouts met where expected


def test_generate_on_a_mesh_stays_within_the_kv_budget():
  """A budget holding 4 prompts' caches once (and 32 rollouts' completions): on
  8 devices the 4 prompts are copied to each, so the sampler refills rows, and
  what the 8 devices hold together stays within the budget."""
  from flax import nnx

  from isojax import sharding
  from isojax.models import Decoder
  from isojax.rollout.jax_sampler import JaxSampler

  cfg = _cfg(num_hidden_layers=1)
  budget = memory.lockstep_cache_bytes(cfg, 32, 8, 16, 8)  # one device's reckoning
  mesh = sharding.make_mesh(devices=jax.devices()[:8])
  sampler = JaxSampler(Decoder(cfg, rngs=nnx.Rngs(0)), mesh=mesh,
                       kv_budget_gib=budget / memory.GIB)
  (layout,) = sampler.cache_layouts(4, 8, 3, 5)
  assert not layout.lockstep
  (got,) = caches_on_device_0(sampler, lambda: sampler.generate(
      [[1, 2, 3]] * 4, n=8, max_tokens=5, temperature=1.0))
  assert got == layout.bytes_per_device(cfg) and 8 * got <= budget


def test_run_split_counts_the_train_state_on_the_device():
  config = ml_collections.ConfigDict({"sampler": {"backend": "jax"}})
  state = {"params": jnp.zeros((1024, 1024), jnp.float32),  # 4 MiB
           "opt": [jnp.zeros((1024, 512), jnp.float32)] * 2}  # 2 x 2 MiB
  cfg = _cfg()
  per_row = memory.kv_bytes_per_row(cfg, 64)
  batch = _rows(cfg, 64, 64)
  split = memory.check_run_split(config, cfg, state, train_cache=batch,
                                 device_memory_gib=1.0)
  assert split["trainer_gib"] == pytest.approx(8 / 1024)
  assert split["kv_gib"] == pytest.approx(64 * per_row / memory.GIB)
  # 8 MiB of state + 64 rows x 32 KiB = 10 MiB > 9 MiB.
  with pytest.raises(ValueError, match=r"trainer \(0\.01 GiB\) \+ sampler KV cache "
                     r"\(0\.00 GiB per device: 64 rows x 64 positions; 0\.03 MiB per row"):
    memory.check_run_split(config, cfg, state, train_cache=batch,
                           device_memory_gib=9 / 1024)
  config.sampler.backend = "vllm"  # the server's memory is not this device's
  assert memory.check_run_split(config, cfg, state, train_cache=batch,
                                device_memory_gib=1.0) is None


def test_run_split_counts_evaluation_and_pipelinerl():
  """The larger generate call sets the cache (an evaluation may be larger than a
  training batch); with PipelineRL the sampler's weight copy and two caches at
  once (the producer's and an evaluation's) count."""
  config = ml_collections.ConfigDict({"sampler": {"backend": "jax"}})
  params = {"w": jnp.zeros((1024, 1024), jnp.float32)}  # 4 MiB
  state = {"params": params, "opt": [jnp.zeros((1024, 1024), jnp.float32)] * 2}  # 12 MiB
  cfg = _cfg()
  per_row = memory.kv_bytes_per_row(cfg, 64) / memory.GIB
  batch, evaluation = _rows(cfg, 64, 64), _rows(cfg, 200, 64)
  sync = memory.check_run_split(config, cfg, state, train_cache=batch, eval_cache=evaluation,
                                device_memory_gib=1.0)
  assert sync["rows"] == 200 and sync["sampler_weights_gib"] == 0
  piped = memory.check_run_split(config, cfg, state, train_cache=batch,
                                 eval_cache=evaluation, pipelined_params=params,
                                 device_memory_gib=1.0)
  assert piped["rows"] == 264 and piped["kv_gib"] == pytest.approx(264 * per_row)
  assert piped["sampler_weights_gib"] == pytest.approx(4 / 1024)
  # 12 MiB of state + a 4 MiB copy + 164 rows x 32 KiB (5.1 MiB) > 20 MiB: the
  # advice splits what is left (4 MiB, 127 rows) between the two calls.
  with pytest.raises(ValueError, match=r"trainer \(0\.01 GiB\) \+ sampler's weight copy "
                     r"\(0\.00 GiB\) \+ sampler KV cache \(0\.01 GiB per device: 64 rows x "
                     r"64 positions; 100 rows x 64 positions; 0\.03 MiB per row of 64 "
                     r"positions, 2 generate calls at once\).*sampler.max_rows <= 63\)"):
    memory.check_run_split(config, cfg, state, train_cache=batch,
                           eval_cache=_rows(cfg, 100, 64), pipelined_params=params,
                           device_memory_gib=20 / 1024)


def test_compiled_sampler_holds_the_budgeted_cache_once():
  """Compiled from shapes with a KV budget (as bench/sampler.py --memory_check does
  for Qwen2.5-1.5B x 512 x 8192): each program's arguments are the parameters plus
  the budget's rows of cache, and both update the cache in place (no cache-sized
  temporary, e.g. a float32 widening of a bf16 cache, or a copy for the
  admission's scatter of prompts into rows)."""
  import jax
  from flax import nnx

  from isojax.models import Decoder
  from isojax.rollout import decode

  cfg = _cfg(dtype=jnp.bfloat16, num_hidden_layers=4, max_position_embeddings=1 << 16)
  prompt_len, max_tokens, pairs = 128, 4096, 512
  cache_len = prompt_len + max_tokens
  rows = memory.rows_for_budget(cfg, 0.125, cache_len)
  per_row = memory.kv_bytes_per_row(cfg, cache_len)
  assert rows == int(0.125 * memory.GIB // per_row) < pairs
  abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
  s = decode.Static(max_tokens=max_tokens, greedy=False, top_k=0, use_top_p=False)
  programs = memory.compiled_sampler_memory(abstract, s, rows=rows, cache_len=cache_len,
                                            pairs=pairs, prompts=8, prompt_len=prompt_len)
  cache = rows * per_row
  params = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(abstract)))
  outputs = pairs * max_tokens * 8 + rows * max_tokens * 4  # tokens + logps, uniforms
  prompts = 2 * 8 * prompt_len * 4 + (1 << 20)  # an admission's prompts and masks, ...
  for name, mem in programs.items():
    assert cache < mem.argument_size_in_bytes < cache + params + outputs + prompts, name
    # At most one layer's keys + values as attention reads them (a slice of the
    # cache), never a cache-sized temporary.
    assert mem.temp_size_in_bytes < cache * (2 / cfg.num_layers + 0.1), name
