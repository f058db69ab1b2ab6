"""Sampling throughput: JaxSampler vs `transformers` generate (vs a vLLM CPU server).

All backends get the same weights (written once with `save_pretrained`), the same
prompts and the same shapes (default 32 prompts x n=16 = 512 sequences x 32 new
tokens, temperature 1, no top-k/top-p, no EOS so every sequence runs to the end)
and are timed in this process; the result is printed as tokens/s and ratios.

    python bench/sampler.py            # 512 x 32 (under ~3 min on 2 cores)
    python bench/sampler.py --small    # 64 x 16, a quick smoke run
    VLLM_VENV=.venv-vllm python bench/sampler.py   # adds the vLLM CPU server
    python bench/sampler.py --gpu      # Qwen2.5 shapes on an accelerator (see below)
    python bench/sampler.py --gpu --small   # the same path at toy sizes (runs on CPU)
    python bench/sampler.py --memory_check   # 1.5B x 512 x 8192 memory, compiled on CPU

"jax (n=1)" passes every sequence as its own prompt (no prefill shared between
the n samples of a prompt), like `generate` on the repeated rows does.
Each backend is warmed up (compilation, first-call overheads) and then run
`--repeats` times; the best time is used (the machine may be shared; the best run
is the least disturbed). `transformers` is timed with 1 intra-op thread and with
all cores, and the faster is the reference (`--torch_threads` pins one): XLA
runs on all cores, but on a machine shared with other jobs torch with all cores
can be several times slower than with one, which would flatter the JAX ratio. The JAX model is a 2-layer d=128 Qwen2 with head_dim 32
(the size of the committed tiny base model) and random weights.

`--gpu` runs the Qwen2.5-0.5B shape (random bf16 weights, 64 prompts x n=8 x 512
new tokens, prompt length 128, temperature 1) beside `transformers` generate (and
the JAX sampler with every rollout as its own prompt, n=1: transformers' work), then
the Qwen2.5-1.5B shape with 512 rollouts x 8192 new tokens inside a KV budget
(`--kv_budget_gib`, continuous batching; `--long_prompts` x 8 rollouts; run
once, its compilation included); `--shapes 1.5b` runs only the latter. Each
line prints tokens/s, ms per decode step, the HBM-bandwidth bound from the
bytes a step must read (every weight and every cached position once; the device's
bandwidth, or `--hbm_gbps`), the fraction of it reached, and the peak device
memory; the 0.5B shape also runs with one decode step per check of the decode
loop's condition (`JaxSampler(steps_per_sync=1)`) beside the backend's default.

`--memory_check` compiles the 1.5B x 512 x 8192 sampler from shapes only (no
weights) with the KV budget and prints XLA's memory analysis: what one device must
hold, against the dense cache that would not fit.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import tempfile
import time

# Before jax/torch are imported: CPU only, no hub access.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # pylint: disable=g-import-not-at-top

GIB = 1 << 30
# Qwen2.5 shapes (config.json of the released checkpoints; weights are random).
QWEN25 = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
}


def qwen25_config(size: str) -> dict:
  return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
          "vocab_size": 151936, "hidden_act": "silu", "max_position_embeddings": 32768,
          "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "torch_dtype": "bfloat16",
          **QWEN25[size]}


def model_config(vocab: int) -> dict:
  return {
      "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": vocab,
      "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
      "hidden_act": "silu", "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
      "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32",
  }


def write_model(path: str, vocab: int, seed: int) -> None:
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from isojax.models import Decoder, ModelConfig, save_pretrained  # pylint: disable=g-import-not-at-top
  cfg = ModelConfig.from_hf_dict(model_config(vocab), dtype=jnp.float32)
  model = Decoder(cfg, rngs=nnx.Rngs(seed))
  # Sharper than the 0.02-std init so samples are not near-uniform.
  model.norm.scale[...] = model.norm.scale[...] * 10.0
  save_pretrained(model, cfg, path)


# The seed of every warm-up call; timed run i gets seed i + 1 (samplers take seeds >= 0).
WARMUP_SEED = 0


def time_runs(fn, repeats: int, warmup: bool = True) -> tuple[float, float, int]:
  """(best seconds, median seconds, tokens of the last run) of `fn(seed)` after one
  warm-up (without it, the first run's time includes compilation)."""
  if warmup:
    fn(WARMUP_SEED)
  times, tokens = [], 0
  for i in range(repeats):
    t0 = time.perf_counter()
    tokens = fn(i + 1)
    times.append(time.perf_counter() - t0)
  return min(times), statistics.median(times), tokens


def bench_jax(path, prompts, n, max_tokens, repeats, label="jax"):
  """As the trainer calls it (n samples per prompt: one prefill per prompt)."""
  from isojax.models import load_pretrained  # pylint: disable=g-import-not-at-top
  from isojax.rollout.jax_sampler import JaxSampler  # pylint: disable=g-import-not-at-top
  model, _ = load_pretrained(path)
  sampler = JaxSampler(model)

  def run(seed):
    r = sampler.generate(prompts, n=n, max_tokens=max_tokens, temperature=1.0, seed=seed)
    return r.num_generated_tokens

  t0 = time.perf_counter()
  run(WARMUP_SEED)
  print(f"  {label}: first call (compile + run) {time.perf_counter() - t0:.1f}s")
  return time_runs(run, repeats)


def bench_jax_rows(path, prompts, n, max_tokens, repeats):
  """Every sequence as its own prompt (n=1): the prefill is not shared."""
  return bench_jax(path, [p for p in prompts for _ in range(n)], 1, max_tokens, repeats,
                   label="jax (n=1)")


def bench_transformers(path, prompts, n, max_tokens, repeats, threads, device="cpu"):
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  torch.set_num_threads(threads)
  dtype = torch.float32 if device == "cpu" else torch.bfloat16  # as the weights are
  model = transformers.AutoModelForCausalLM.from_pretrained(
      path, dtype=dtype, attn_implementation="sdpa").to(device)
  model.eval()
  model.generation_config.eos_token_id = None
  model.generation_config.pad_token_id = 0
  rows = [p for p in prompts for _ in range(n)]
  width = max(map(len, rows))
  ids = np.zeros((len(rows), width), np.int64)
  mask = np.zeros_like(ids)
  for i, p in enumerate(rows):  # left padding, as generate expects
    ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
  ids, mask = torch.from_numpy(ids).to(device), torch.from_numpy(mask).to(device)

  def run(seed):
    torch.manual_seed(seed + 1)
    with torch.inference_mode():
      out = model.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                           top_p=1.0, max_new_tokens=max_tokens, min_new_tokens=max_tokens)
    if device != "cpu":
      torch.cuda.synchronize()
    return int((out.shape[1] - width) * out.shape[0])

  return time_runs(run, repeats)


def bench_transformers_best(path, prompts, args):
  """`bench_transformers` with `--torch_threads`, else the faster of 1 thread and
  all cores (each printed)."""
  counts = ([args.torch_threads] if args.torch_threads else
            sorted({1, os.cpu_count() or 1}))
  timed = []
  for threads in counts:
    best, median, tokens = bench_transformers(path, prompts, args.n, args.max_tokens,
                                              args.repeats, threads)
    print(f"  transformers, {threads} thread(s): best {best:.3f}s, median {median:.3f}s")
    timed.append((best, median, tokens))
  return min(timed)


def bench_vllm(path, prompts, n, max_tokens, repeats):
  from isojax.rollout.vllm_client import VLLMSampler  # pylint: disable=g-import-not-at-top
  from isojax.rollout.vllm_server import VLLMServer  # pylint: disable=g-import-not-at-top
  with VLLMServer(path, dtype="float32", max_num_seqs=512, skip_tokenizer_init=True) as server:
    sampler = VLLMSampler(server.base_url, eos_token_ids=())

    def run(seed):
      r = sampler.generate(prompts, n=n, max_tokens=max_tokens, temperature=1.0, seed=seed)
      return r.num_generated_tokens

    return time_runs(run, repeats)


def _decode_bound_s(cfg, rows, prompt_len, max_tokens, hbm_gbps, waves=1, prompts=None):
  """Seconds the HBM bandwidth allows for the decode steps: the bytes a step must
  read at the least, every weight once and every cached position once (keys and
  values of every layer), over the bandwidth. With `prompts` (every rollout has its
  row: lockstep) each prompt's positions are read once for all its rows; otherwise
  every row holds its prompt. The sampler reads more than this (whole cache blocks,
  or power-of-two extents when rows are refilled), so bound / time is the fraction
  of the roofline reached, not of what this implementation could reach."""
  from isojax.models.kv_cache import KVCache  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  d, f, v, l = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers
  qkvo = d * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim + cfg.num_heads * cfg.head_dim * d
  weights = (l * (qkvo + 3 * d * f) + v * d) * jnp.dtype(cfg.param_dtype).itemsize
  per_slot = KVCache.bytes_per_slot(l, cfg.num_kv_heads, cfg.head_dim, cfg.dtype)
  # Step i attends over the prompt and the i + 1 completion positions written so far.
  if prompts:
    slots = sum(prompts * prompt_len + rows * (i + 1) for i in range(max_tokens))
  else:
    slots = sum(rows * (prompt_len + i + 1) for i in range(max_tokens))
  return waves * (max_tokens * weights + slots * per_slot) / (hbm_gbps * 1e9)


# HBM bandwidth (GB/s) by the words of a device kind ("NVIDIA H100 80GB HBM3"), the
# first entry whose words all appear: the --hbm_gbps default. GH200 comes with two
# memories (4000 or 4900 GB/s), so it is left to --hbm_gbps.
HBM_GBPS = ((("GH200",), None), (("H200",), 4800.0), (("H100", "NVL"), 3900.0),
            (("H100", "PCIe"), 2000.0), (("H100",), 3350.0),
            (("A100", "80GB", "PCIe"), 1935.0), (("A100-SXM4-80GB",), 2039.0),
            (("A100",), 1555.0))


def hbm_gbps(device_kind: str, asked: float | None) -> float | None:
  """--hbm_gbps if given, else the bandwidth of `device_kind` (None if unknown)."""
  if asked is not None:
    return asked
  words = set(device_kind.replace("-", " ").split()) | set(device_kind.split())
  return next((gbps for names, gbps in HBM_GBPS if set(names) <= words), None)


@contextlib.contextmanager
def compile_clock():
  """{"programs", "seconds"}: what XLA compiled inside the block, and how long it took."""
  import jax  # pylint: disable=g-import-not-at-top
  totals = {"programs": 0, "seconds": 0.0}

  def listen(event, duration, **_):
    if event == "/jax/core/compile/backend_compile_duration":
      totals["programs"] += 1
      totals["seconds"] += duration

  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    yield totals
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)


def torch_device() -> str:
  import torch  # pylint: disable=g-import-not-at-top
  return "cuda" if torch.cuda.is_available() else "cpu"


def bench_gpu(args):
  """The issue's accelerator shapes: JaxSampler beside transformers generate."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from isojax.models import Decoder, ModelConfig, save_pretrained  # pylint: disable=g-import-not-at-top
  from isojax.rollout.jax_sampler import JaxSampler  # pylint: disable=g-import-not-at-top
  dev = jax.devices()[0]
  gbps = hbm_gbps(dev.device_kind, args.hbm_gbps)
  print(f"device: {dev.device_kind}; HBM bound at "
        + (f"{gbps:g} GB/s" if gbps else "an unknown bandwidth (pass --hbm_gbps)"))
  shapes = [("0.5b", 64, 8, 512, None),
            ("1.5b", args.long_prompts, 8, 8192, args.kv_budget_gib)]
  shrink = {}
  if args.small:  # the same code path at toy sizes (e.g. on CPU)
    shapes = [("0.5b", 4, 2, 16, None), ("1.5b", 4, 2, 64, 0.0005)]
    shrink = dict(num_hidden_layers=2, vocab_size=512)
  shapes = [shape for shape in shapes if shape[0] in args.shapes.split(",")]
  print(f"{'shape':<7}{'rollouts':>9}{'new':>6}{'rows':>6}{'s':>9}{'tok/s':>10}"
        f"{'ms/step':>9}{'bound s':>9}{'roofline':>9}{'peak GiB':>10}")
  for size, prompts_n, n, max_tokens, budget in shapes:
    cfg = ModelConfig.from_hf_dict({**qwen25_config(size), **shrink}, dtype=jnp.bfloat16,
                                   param_dtype=jnp.bfloat16)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, 128).tolist() for _ in range(prompts_n)]
    sampler = JaxSampler(model, kv_budget_gib=budget)
    rows = sampler.num_rows(prompts_n * n, 128 + max_tokens, n=n, prompt_len=128)
    request = lambda s, seed: s.generate(prompts, n=n, max_tokens=max_tokens, temperature=1.0,
                                         seed=seed).num_generated_tokens
    run = lambda seed: request(sampler, seed)
    # A long request runs once, compilation included: its time is an upper bound,
    # and the compile time is reported beside it.
    long = max_tokens > 1024
    with compile_clock() as compiling:
      best, _, tokens = time_runs(run, 1 if long else args.repeats, warmup=not long)
    waves = -(-prompts_n * n // rows)
    bound = math.nan if gbps is None else _decode_bound_s(
        cfg, rows, 128, max_tokens, gbps, waves,
        prompts=prompts_n if rows == prompts_n * n else None)
    peak = (dev.memory_stats() or {}).get("peak_bytes_in_use", 0) / GIB
    print(f"{size:<7}{prompts_n * n:>9}{max_tokens:>6}{rows:>6}{best:>9.2f}"
          f"{tokens / best:>10.0f}{1e3 * best / (waves * max_tokens):>9.2f}{bound:>9.2f}"
          f"{bound / best:>9.2f}{peak:>10.1f}")
    if long:
      print(f"  (one run: {compiling['seconds']:.0f} s of it compiled "
            f"{compiling['programs']} programs)")
    samplers = [(f"{sampler.steps_per_sync} steps per loop check", sampler)]
    if not long and sampler.steps_per_sync > 1:  # the default beside one step per check
      single = JaxSampler(model, kv_budget_gib=budget, steps_per_sync=1)
      best_1, _, tok_1 = time_runs(lambda seed: request(single, seed), args.repeats)
      print(f"{'  1 step per loop check':<28}{best_1:>9.2f}s {tok_1 / best_1:>10.0f} tok/s; "
            f"{sampler.steps_per_sync} steps per check (above): {best_1 / best:.2f}x as fast")
      samplers.append(("1 step per loop check", single))
      del single  # held by `samplers` until the profiles are done
    if args.profile and not long:
      import device_profile  # pylint: disable=g-import-not-at-top  (bench/, beside this file)
      for label, profiled in samplers:
        with tempfile.TemporaryDirectory() as tmp:
          profile = device_profile.profile_call(lambda: request(profiled, 0), tmp)
        print(f"  profile, {label}:\n{profile.table(args.profile)}")
      del profiled
    del samplers  # the transformers control below wants the device's memory
    if size == "0.5b" and not args.skip_transformers:
      # transformers prefills every rollout's copy of its prompt; so does this control.
      copies = [p for p in prompts for _ in range(n)]
      best_1, _, tok_1 = time_runs(
          lambda seed: sampler.generate(copies, n=1, max_tokens=max_tokens, temperature=1.0,
                                        seed=seed).num_generated_tokens, args.repeats)
      print(f"{'  jax (n=1, own prompts)':<28}{best_1:>9.2f}s {tok_1 / best_1:>10.0f} tok/s")
      with tempfile.TemporaryDirectory(prefix="isojax_bench_") as tmp:
        save_pretrained(model, cfg, tmp)
        del sampler, model
        best_t, _, tok_t = bench_transformers(tmp, prompts, n, max_tokens, args.repeats,
                                              args.torch_threads or os.cpu_count() or 1,
                                              device=torch_device())
      print(f"{'  transformers (sdpa)':<28}{best_t:>9.2f}s {tok_t / best_t:>10.0f} tok/s; "
            f"jax speed-up {best_t / best:.2f}x ({best_t / best_1:.2f}x at n=1, the same "
            f"work)")


def memory_check(args):
  """1.5B x 512 rollouts x 8192 tokens inside the KV budget, compiled from shapes."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from isojax.models import Decoder, ModelConfig  # pylint: disable=g-import-not-at-top
  from isojax.rollout import memory  # pylint: disable=g-import-not-at-top
  from isojax.rollout import decode  # pylint: disable=g-import-not-at-top
  cfg = ModelConfig.from_hf_dict(qwen25_config("1.5b"), dtype=jnp.bfloat16,
                                 param_dtype=jnp.bfloat16)
  rollouts, prompt_len, max_tokens = 512, 256, 8192
  cache_len = prompt_len + max_tokens
  abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))  # no parameters made
  rows = min(rollouts, memory.rows_for_budget(cfg, args.kv_budget_gib, cache_len))
  dense = rollouts * memory.kv_bytes_per_row(cfg, cache_len) / GIB
  print(f"Qwen2.5-1.5B shape, {rollouts} rollouts x {max_tokens} new tokens (prompt "
        f"bucket {prompt_len}): dense cache {dense:.1f} GiB; kv_budget_gib="
        f"{args.kv_budget_gib:g} -> {rows} rows")
  s = decode.Static(max_tokens=max_tokens, greedy=False, top_k=0, use_top_p=False)
  t0 = time.perf_counter()
  programs = memory.compiled_sampler_memory(abstract, s, rows=rows, cache_len=cache_len,
                                            pairs=rollouts, prompts=rows // 8,
                                            prompt_len=prompt_len)
  print(f"  both programs compiled in {time.perf_counter() - t0:.0f}s")
  params = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(abstract))) / GIB
  total = 0.0
  for name, mem in programs.items():
    holds = (mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes
             - mem.alias_size_in_bytes) / GIB
    total = max(total, holds)
    unaliased = (mem.output_size_in_bytes - mem.alias_size_in_bytes) / GIB
    print(f"  {name:<7} arguments {mem.argument_size_in_bytes / GIB:.2f} GiB (params "
          f"{params:.2f}, cache + outputs), temporaries {mem.temp_size_in_bytes / GIB:.2f} "
          f"GiB, outputs not aliased {unaliased:.2f} GiB: {holds:.1f} GiB")
  print(f"  one device holds {total:.1f} GiB ({'fits' if total <= args.device_gib else 'does NOT fit'}"
        f" in {args.device_gib:g} GiB; the dense cache alone would need {dense:.1f} GiB)")
  return total


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--small", action="store_true", help="64 sequences x 16 tokens")
  ap.add_argument("--num_prompts", type=int, default=32)
  ap.add_argument("--n", type=int, default=16, help="samples per prompt")
  ap.add_argument("--max_tokens", type=int, default=32)
  ap.add_argument("--prompt_len", type=int, default=12)
  ap.add_argument("--vocab", type=int, default=16)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--skip_transformers", action="store_true")
  ap.add_argument("--torch_threads", type=int, default=None,
                  help="torch intra-op threads (default: the faster of 1 and all cores, "
                  "each timed; on a machine shared with other jobs 1 can be much faster)")
  ap.add_argument("--gpu", action="store_true", help="the Qwen2.5 shapes on an accelerator")
  ap.add_argument("--memory_check", action="store_true",
                  help="compile 1.5B x 512 x 8192 with the KV budget, print its memory")
  ap.add_argument("--kv_budget_gib", type=float, default=40.0)
  ap.add_argument("--profile", type=int, default=0, metavar="N",
                  help="--gpu: trace one 0.5B request, print its N costliest device ops")
  ap.add_argument("--shapes", default="0.5b,1.5b",
                  help="--gpu: which requests to run (0.5b: 512 x 512; 1.5b: x 8192 tokens)")
  ap.add_argument("--long_prompts", type=int, default=64,
                  help="--gpu: prompts (x n=8) of the 1.5B x 8192-token request")
  ap.add_argument("--device_gib", type=float, default=80.0)
  ap.add_argument("--hbm_gbps", type=float, default=None,
                  help="HBM bandwidth in GB/s (default: the device's, e.g. H100 SXM "
                  "3350, H200 4800)")
  args = ap.parse_args(argv)
  if args.memory_check:
    memory_check(args)
    return
  if args.gpu:
    if os.environ.get("JAX_PLATFORMS") == "cpu":  # the CPU default set above
      del os.environ["JAX_PLATFORMS"]
    bench_gpu(args)
    return
  if args.small:
    args.num_prompts, args.n, args.max_tokens, args.repeats = 8, 8, 16, 3

  rng = np.random.default_rng(0)
  # Prompt lengths vary (left padding is exercised), mean about --prompt_len.
  prompts = [rng.integers(0, args.vocab, size=int(rng.integers(args.prompt_len // 2,
                                                               args.prompt_len * 3 // 2 + 1))
                          ).tolist() for _ in range(args.num_prompts)]
  seqs = args.num_prompts * args.n
  print(f"sampler bench: {seqs} sequences ({args.num_prompts} prompts x n={args.n}) x "
        f"{args.max_tokens} new tokens, 2-layer d=128 Qwen2 (vocab {args.vocab}), "
        f"{os.cpu_count()} CPU cores")

  results = {}
  with tempfile.TemporaryDirectory(prefix="isojax_bench_") as tmp:
    path = os.path.join(tmp, "model")
    write_model(path, args.vocab, seed=0)
    results["jax"] = bench_jax(path, prompts, args.n, args.max_tokens, args.repeats)
    results["jax (n=1)"] = bench_jax_rows(path, prompts, args.n, args.max_tokens,
                                          args.repeats)
    if not args.skip_transformers:
      results["transformers"] = bench_transformers_best(path, prompts, args)
    if os.environ.get("VLLM_VENV"):
      try:
        results["vllm"] = bench_vllm(path, prompts, args.n, args.max_tokens, args.repeats)
      except Exception as e:  # pylint: disable=broad-except
        print(f"  vllm: skipped, the server failed: {type(e).__name__}: {e}")
    else:
      print("  vllm: skipped (set VLLM_VENV to a vLLM CPU virtualenv, e.g. built by "
            "launch/setup_vllm_venv.sh, to include it)")

  expected = seqs * args.max_tokens
  print(f"\n{'backend':<14}{'tokens':>8}{'best s':>9}{'median s':>10}{'tok/s (best)':>14}"
        f"{'jax speed-up':>14}")
  jax_rate = expected / results["jax"][0]
  for name, (best, median, tokens) in results.items():
    rate = tokens / best
    print(f"{name:<14}{tokens:>8}{best:>9.3f}{median:>10.3f}{rate:>14.0f}"
          f"{jax_rate / rate:>13.2f}x")
    if tokens != expected:
      print(f"  note: {name} generated {tokens} tokens, expected {expected}")


if __name__ == "__main__":
  main()
