"""The RL update step at the paper's scale on one accelerator, against transformers.

    python bench/gpu_step.py                         # 0.5B, 1.5B, Qwen3-4B x 32 x {2048, 4096, 8192}
    python bench/gpu_step.py --models qwen2.5-1.5b --lengths 4096
    python bench/gpu_step.py --models qwen2.5-1.5b --lengths 4096 --micro 8,16 --no-torch
    python bench/gpu_step.py --cpu-smoke             # tiny shapes on CPU, seconds

Random weights of the Qwen2.5-0.5B / 1.5B and Qwen3-4B shapes
(``isojax.memory.MODEL_SHAPES``), bf16 compute with fp32 master weights and AdamW,
per-layer remat, the fp32 lm head in chunks. For every (model, length) it prints

  * tokens/s of the jitted step (forward, backward, AdamW update) over all B*T
    positions of a batch whose rows are all real tokens;
  * model TFLOP/s: 6 x (dense matmul FLOPs + causal attention, half of T x T)
    per token, the lm head only over the chunks holding completion tokens
    (a GPU computes and masks the others: wasted, not counted), nothing for
    recomputation; MFU against the H100's 989 TFLOP/s dense bf16 spec and
    against a bf16 matmul measured in this run; beside it
    the MFU of PaLM's formula (Chowdhery et al. 2022, App. B: attention over
    all T x T), the convention most published MFU figures use;
  * peak device memory (``memory_stats``: the process's peak so far, so the
    first shape of a run is the clean figure for that shape) and XLA's
    compiled figure for the step;
  * with --profile N, the N device ops that took most of one traced step;
  * transformers on the same weights and batch: the same GRPO clipped
    token-mean loss, autocast bf16, SDPA attention, gradient checkpointing,
    AdamW (fused on CUDA), the same micro-batches; its time, peak memory and
    the speed ratio. Both print the token-mean entropy of the first step (same
    weights, same batch: equal up to bf16 rounding), which checks that the two
    compute the same thing (the on-policy loss itself is -mean(advantage),
    whatever the model).

A benchmark, not a test: nothing is asserted. Timings are the best of a few
runs after the first call; the compile (which the memory figure needs) is timed apart.
"""

import argparse
import itertools
import os
import sys
import tempfile
import time

# JAX and torch share the device here: without this JAX takes 75% of its memory at
# start-up and transformers runs out of it. Must be set before jax is imported.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import device_profile  # noqa: E402  (bench/, the script's directory)
from isojax import memory  # noqa: E402
from isojax.models import Decoder, ModelConfig, save_pretrained  # noqa: E402
from isojax.rl import Batch, LossConfig, OptimConfig, init_train_state  # noqa: E402
from isojax.rl import make_train_step  # noqa: E402

H100_BF16_TFLOPS = 989.0
DEFAULT_MODELS = ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen3-4b")
GROUP = 8  # rollouts per prompt
LOSS = LossConfig()  # GRPO, clipped token mean, no KL / entropy: what transformers runs
OPTIM = OptimConfig(lr_base=1e-6, warmup_steps=0, weight_decay=0.01, max_grad_norm=None)


def best_of(fn, repeats):
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    out = fn()
    times.append(time.perf_counter() - t)
  return min(times), out


def bf16_matmul_tflops(n, repeats=5):
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
  b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
  f = jax.jit(lambda a, b: a @ b)
  f(a, b).block_until_ready()
  return 2 * n ** 3 / best_of(lambda: f(a, b).block_until_ready(), repeats)[0] / 1e12


def model_flops(cfg: ModelConfig, B, T, head_positions, causal=True):
  """Training FLOPs of one step: 3 x forward. The lm head counts only at the
  `head_positions` it is needed for (`head_positions_computed`); attention
  scores causally (T^2 / 2 per head), or over all T^2 with causal=False (PaLM's MFU)."""
  D, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
  NH, KH = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  layers = cfg.num_layers * (D * NH + 2 * D * KH + NH * D + 3 * D * F)
  attn = cfg.num_layers * 2 * NH * (T / 2 if causal else T)
  return 3 * 2 * (B * T * (layers + attn) + head_positions * D * V)


def head_positions_computed(batch, chunk):
  """Positions the chunked lm head needs: every position of each chunk that
  holds a trained one (`isojax.rl.logprobs` skips the others off a GPU, and
  masks them on one; position t-1 predicts token t)."""
  need_BxS = np.asarray(batch.loss_mask_BxT)[:, 1:] > 0
  B, S = need_BxS.shape
  if chunk >= S:  # one unchunked head over every position
    return B * S
  n_chunks = -(-S // chunk)
  need_S = np.pad(need_BxS.any(axis=0), (0, n_chunks * chunk - S))
  return B * chunk * int(need_S.reshape(n_chunks, chunk).any(axis=1).sum())


def full_batch(B, T, V, seed=0):
  """Every position real (the FLOP count's assumption); the prompt is the first eighth."""
  rng = np.random.default_rng(seed)
  loss_mask = np.zeros((B, T), np.float32)
  loss_mask[:, T // 8:] = 1
  return Batch(input_ids_BxT=jnp.asarray(rng.integers(3, V, (B, T)), jnp.int32),
               attention_mask_BxT=jnp.ones((B, T), jnp.int32),
               loss_mask_BxT=jnp.asarray(loss_mask),
               sampler_logp_BxT=jnp.asarray(-loss_mask),
               rewards_B=jnp.asarray(rng.integers(0, 2, B), jnp.float32))


def peak_text(peak):
  return "n/a" if peak is None else f"{peak / 2**30:.1f} GiB"


def peak_bytes():
  stats = jax.local_devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


def run_isojax(cfg, batch, micro, args):
  """The timed step; returns the model, its figures and the step (for a profile)."""
  B, T = batch.input_ids_BxT.shape
  model = Decoder(cfg, rngs=nnx.Rngs(0))
  step = make_train_step(model, LOSS, OPTIM, batch_size=B, group_size=GROUP,
                         micro_batch_size=micro, logits_chunk=args.chunk)
  state = init_train_state(model, LOSS, OPTIM, batch_size=B)
  t = time.perf_counter()
  compiled = memory.step_memory(step, state, batch)  # the step's one compile
  compile_s = time.perf_counter() - t
  holder = {"state": state}

  def once():
    holder["state"], metrics = step(holder["state"], batch)
    return float(metrics["entropy"])  # waits for the step

  entropy = once()  # from the initial weights, as transformers' first step
  seconds, _ = best_of(once, args.repeats)
  return model, dict(seconds=seconds, entropy=entropy, compile_s=compile_s,
                     peak=peak_bytes(), compiled=compiled.total), once


def run_transformers(path, batch, micro, repeats):
  import torch
  from transformers import AutoModelForCausalLM

  cuda = torch.cuda.is_available()
  device = torch.device("cuda" if cuda else "cpu")
  model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                               attn_implementation="sdpa").to(device)
  getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
  model.config.use_cache = False
  model.train()
  opt = torch.optim.AdamW(model.parameters(), lr=OPTIM.lr_base, weight_decay=OPTIM.weight_decay,
                          fused=cuda)
  ids = torch.from_numpy(np.array(batch.input_ids_BxT)).long().to(device)
  mask = torch.from_numpy(np.array(batch.loss_mask_BxT)).to(device)
  r = torch.from_numpy(np.array(batch.rewards_B)).view(-1, GROUP).to(device)
  std = r.std(dim=1, keepdim=True)
  adv = torch.where(std > 0, (r - r.mean(1, keepdim=True)) / (std + LOSS.adv_std_eps),
                    torch.zeros_like(r)).view(-1)
  total = mask[:, 1:].sum()

  def step():
    opt.zero_grad(set_to_none=True)
    entropy_sum = 0.0
    for s in range(0, ids.shape[0], micro):
      sl = slice(s, s + micro)
      with torch.autocast(device.type, dtype=torch.bfloat16):
        logits = model(input_ids=ids[sl]).logits[:, :-1]
      logp_all = torch.log_softmax(logits.float(), -1)
      logp = logp_all.gather(-1, ids[sl, 1:, None])[..., 0]
      with torch.no_grad():  # the token-mean entropy isojax reports: checks model + batch
        ent = -(logp_all.exp() * logp_all).sum(-1)
        entropy_sum += float((ent * mask[sl, 1:]).sum() / total)
      ratio = torch.exp(logp - logp.detach())
      a = adv[sl, None]
      pg = torch.maximum(-a * ratio,
                         -a * ratio.clamp(1 - LOSS.clip_low, 1 + LOSS.clip_high))
      loss = (pg * mask[sl, 1:]).sum() / total
      loss.backward()
    opt.step()
    if cuda:
      torch.cuda.synchronize()
    return entropy_sum

  if cuda:
    torch.cuda.reset_peak_memory_stats()
  entropy = step()  # warm-up (allocator, kernels), from the same initial weights
  seconds, _ = best_of(step, repeats)
  peak = torch.cuda.max_memory_allocated() if cuda else None
  return dict(seconds=seconds, entropy=entropy, peak=peak)


def smoke_shape():
  return ModelConfig(architecture="Qwen2ForCausalLM", vocab_size=512, hidden_size=64,
                     intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=16, tie_word_embeddings=True, attention_bias=True)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--models", default=",".join(DEFAULT_MODELS),
                  help=f"comma-separated, from {sorted(memory.MODEL_SHAPES)}")
  ap.add_argument("--lengths", default="2048,4096,8192")
  ap.add_argument("--batch", type=int, default=32)
  ap.add_argument("--micro", default="4",
                  help="rows per micro-batch; comma-separated runs each (transformers once; "
                       "peak memory is the process's so far)")
  ap.add_argument("--chunk", type=int, default=512, help="lm-head positions per chunk")
  ap.add_argument("--remat", default="full",
                  help="ModelConfig.remat; comma-separated runs each (transformers once)")
  ap.add_argument("--attention", default="auto", help="ModelConfig.attention")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--no-torch", action="store_true")
  ap.add_argument("--profile", type=int, default=0, metavar="N",
                  help="after timing, trace one step and print its N costliest device ops")
  ap.add_argument("--cpu-smoke", action="store_true",
                  help="tiny shapes (2 layers, d=64), batch 8 x 64, on CPU: seconds")
  args = ap.parse_args()
  if args.cpu_smoke:
    args.batch, args.micro, args.chunk, args.repeats = 8, "4", 32, 1
    lengths, models = [64], [("smoke", smoke_shape())]
  else:
    lengths = [int(x) for x in args.lengths.split(",")]
    models = [(m, memory.model_shape(m)) for m in args.models.split(",")]
  matmul_n = 512 if args.cpu_smoke else 8192
  print(f"devices: {jax.devices()}  backend: {jax.default_backend()}")
  matmul = bf16_matmul_tflops(matmul_n)
  print(f"bf16 matmul {matmul_n}^3: {matmul:.3g} TFLOP/s "
        f"({matmul / H100_BF16_TFLOPS:.1%} of the {H100_BF16_TFLOPS:g} TFLOP/s H100 spec)")
  remats = args.remat.split(",")
  micros = [int(x) for x in str(args.micro).split(",")]
  for (name, shape), T, remat, micro in itertools.product(models, lengths, remats, micros):
    cfg = shape.replace(dtype=jnp.bfloat16, param_dtype=jnp.float32, remat=remat,
                        attention=args.attention, max_position_embeddings=max(lengths))
    B = args.batch
    batch = full_batch(B, T, cfg.vocab_size)
    head = head_positions_computed(batch, args.chunk)
    flops = model_flops(cfg, B, T, head)
    palm_mfu = model_flops(cfg, B, T, head, causal=False) / H100_BF16_TFLOPS / 1e12
    print(f"\n{name}: {cfg.num_layers} layers, d={cfg.hidden_size}; batch {B} x {T}, "
          f"micro-batch {micro}, remat {cfg.remat}, head chunk {args.chunk}, "
          f"attention {args.attention}")
    try:
      model, j, once = run_isojax(cfg, batch, micro, args)
    except Exception as e:  # e.g. out of memory: report it and go on
      print(f"  isojax: failed: {type(e).__name__}: {str(e)[:300]}")
      continue
    tflops = flops / j["seconds"] / 1e12
    print(f"  isojax:       {j['seconds']:.3f} s/step  {B * T / j['seconds']:,.0f} tokens/s  "
          f"{tflops:.3g} TFLOP/s = {tflops / H100_BF16_TFLOPS:.2%} MFU (spec), "
          f"{palm_mfu / j['seconds']:.2%} by PaLM's formula, "
          f"{tflops / matmul:.1%} of matmul; peak {peak_text(j['peak'])} (compiled "
          f"{j['compiled'] / 2**30:.1f} GiB); compile {j['compile_s']:.1f} s; "
          f"entropy {j['entropy']:.6f}", flush=True)
    if args.profile:  # after the figures above, so a run cut short here keeps them
      with tempfile.TemporaryDirectory() as tmp:
        print(device_profile.profile_call(once, tmp).table(args.profile), flush=True)
    del once  # holds the train state
    if args.no_torch or (remat, micro) != (remats[0], micros[0]):  # transformers once per shape
      del model
      continue
    with tempfile.TemporaryDirectory() as tmp:
      save_pretrained(model, cfg, tmp)
      del model
      try:
        t = run_transformers(tmp, batch, micro, args.repeats)
      except Exception as e:
        print(f"  transformers: failed: {type(e).__name__}: {str(e)[:300]}")
        continue
    print(f"  transformers: {t['seconds']:.3f} s/step  {B * T / t['seconds']:,.0f} tokens/s  "
          f"{flops / t['seconds'] / 1e12:.3g} TFLOP/s; peak {peak_text(t['peak'])}; "
          f"entropy {t['entropy']:.6f}")
    print(f"  isojax / transformers speed: {t['seconds'] / j['seconds']:.2f}x")


if __name__ == "__main__":
  main()
