"""Sampling throughput: JaxSampler vs `transformers` generate (vs a vLLM CPU server).

All backends get the same weights (written once with `save_pretrained`), the same
prompts and the same shapes (default 32 prompts x n=16 = 512 sequences x 32 new
tokens, temperature 1, no top-k/top-p, no EOS so every sequence runs to the end)
and are timed in this process; the result is printed as tokens/s and ratios.

    python bench/sampler.py            # 512 x 32 (under ~3 min on 2 cores)
    python bench/sampler.py --small    # 64 x 16, a quick smoke run
    VLLM_VENV=.venv-vllm python bench/sampler.py   # adds the vLLM CPU server

"jax (n=1)" passes every sequence as its own prompt (no prefill shared between
the n samples of a prompt), like `generate` on the repeated rows does.
Each backend is warmed up (compilation, first-call overheads) and then run
`--repeats` times; the best time is used (the machine may be shared; the best run
is the least disturbed). The JAX model is a 2-layer d=128 Qwen2 with head_dim 32
(the size of the committed tiny base model) and random weights.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

# Before jax/torch are imported: CPU only, no hub access.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # pylint: disable=g-import-not-at-top


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


def time_runs(fn, repeats: int) -> tuple[float, float, int]:
  """(best seconds, median seconds, tokens of the last run) after one warm-up."""
  fn(-1)
  times, tokens = [], 0
  for i in range(repeats):
    t0 = time.perf_counter()
    tokens = fn(i)
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
  run(-1)
  print(f"  {label}: first call (compile + run) {time.perf_counter() - t0:.1f}s")
  return time_runs(run, repeats)


def bench_jax_rows(path, prompts, n, max_tokens, repeats):
  """Every sequence as its own prompt (n=1): the prefill is not shared."""
  return bench_jax(path, [p for p in prompts for _ in range(n)], 1, max_tokens, repeats,
                   label="jax (n=1)")


def bench_transformers(path, prompts, n, max_tokens, repeats, threads):
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  torch.set_num_threads(threads)
  model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
  model.eval()
  model.generation_config.eos_token_id = None
  model.generation_config.pad_token_id = 0
  rows = [p for p in prompts for _ in range(n)]
  width = max(map(len, rows))
  ids = np.zeros((len(rows), width), np.int64)
  mask = np.zeros_like(ids)
  for i, p in enumerate(rows):  # left padding, as generate expects
    ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
  ids, mask = torch.from_numpy(ids), torch.from_numpy(mask)

  def run(seed):
    torch.manual_seed(seed + 1)
    with torch.inference_mode():
      out = model.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                           top_p=1.0, max_new_tokens=max_tokens, min_new_tokens=max_tokens)
    return int((out.shape[1] - width) * out.shape[0])

  return time_runs(run, repeats)


def bench_vllm(path, prompts, n, max_tokens, repeats):
  from isojax.rollout.vllm_client import VLLMSampler  # pylint: disable=g-import-not-at-top
  from isojax.rollout.vllm_server import VLLMServer  # pylint: disable=g-import-not-at-top
  with VLLMServer(path, dtype="float32", max_num_seqs=512, skip_tokenizer_init=True) as server:
    sampler = VLLMSampler(server.base_url, eos_token_ids=())

    def run(seed):
      r = sampler.generate(prompts, n=n, max_tokens=max_tokens, temperature=1.0, seed=seed)
      return r.num_generated_tokens

    return time_runs(run, repeats)


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
  ap.add_argument("--torch_threads", type=int, default=os.cpu_count() or 1,
                  help="torch intra-op threads (default: all cores; on a machine "
                  "shared with other jobs 1 can be much faster)")
  args = ap.parse_args(argv)
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
      results["transformers"] = bench_transformers(path, prompts, args.n, args.max_tokens,
                                                   args.repeats, args.torch_threads)
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
