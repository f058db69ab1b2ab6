"""Speed of the RL update step, as ratios against references run in the same process.

    python bench/train_step.py            # 4 layers, d=256, 256 seqs x 256 tokens (~3 min)
    python bench/train_step.py --small    # 2 layers, d=128, 64 x 64 (under a minute)
    python bench/train_step.py --layers 2 --seqs 8 --tokens 2048 --micro 8 --remat attention

Prints
  * tokens/s of the jitted step (``isojax.rl.step``; forward, backward,
    optimiser update, metrics) over all B*T positions;
  * achieved FLOP/s as a ratio to this machine's fp32 matmul FLOP/s, measured
    here on a 2048^3 matmul (best of several). FLOPs are *model* FLOPs: 3x the
    forward (dense matmuls incl. lm head, plus attention scores and mixing as
    computed: all T x T up to `attention.BLOCK` positions, the causal blocks above), nothing for recomputation or elementwise work (XLA's own
    cost_analysis is not used: it counts a scan body once, not per micro-batch);
  * the ratio to PyTorch ``transformers`` forward+backward of the same loss on
    the same batch and the same weights (written with ``save_pretrained`` and
    read back by transformers), micro-batched the same way; the two losses are
    printed so the comparison is checked to compute the same thing.

A benchmark, not a test: nothing is asserted. Timings are the best of a few
runs (JAX after its compiling first call), taken in rounds that time the matmul,
isojax and transformers back to back, so on a shared machine the three see similar
load; they are still only as good as the machine is idle, so the load average is
printed too.
"""

import argparse
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from isojax.models import Decoder, ModelConfig, save_pretrained
from isojax.models.attention import BLOCK
from isojax.rl import Batch, LossConfig, OptimConfig, init_train_state, make_train_step


def timed(fn, repeats):
  """(best wall time, all times, last result) of fn() over `repeats` runs."""
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    out = fn()
    times.append(time.perf_counter() - t)
  return min(times), times, out


def matmul_fn(n=2048):
  """A compiled fp32 n^3 matmul, ready to time (2 n^3 FLOPs a call)."""
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
  b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
  f = jax.jit(jnp.matmul)
  f(a, b).block_until_ready()
  return lambda: f(a, b).block_until_ready()


def model_flops(cfg: ModelConfig, B, T):
  """Training FLOPs of one step over B x T positions (3 x forward)."""
  D, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
  NH, KH = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  dense = cfg.num_layers * (D * NH + 2 * D * KH + NH * D + 3 * D * F) + D * V
  # QK^T and PV as computed: all T x T scores up to one block, then the blocked
  # kernel's causal blocks (query block i visits i + 1 key blocks).
  blocks = -(-T // BLOCK)
  width = T if T <= BLOCK else BLOCK * (blocks + 1) / 2
  attn = cfg.num_layers * 2 * width * NH
  return 3 * 2 * B * T * (dense + attn)


def make_batch(B, T, prompt, V, seed=0):
  rng = np.random.default_rng(seed)
  ids = rng.integers(3, V, (B, T)).astype(np.int32)
  attn = np.ones((B, T), np.int32)
  loss_mask = np.zeros((B, T), np.float32)
  for b in range(B):
    attn[b, :rng.integers(0, prompt // 2)] = 0  # left padding of the prompt
    end = T - rng.integers(0, (T - prompt) // 2)  # right padding of the completion
    attn[b, end:] = 0
    loss_mask[b, prompt:end] = 1
  ids *= attn
  sampler = (-rng.uniform(0.1, 3.0, (B, T)) * loss_mask).astype(np.float32)
  rewards = rng.integers(0, 2, B).astype(np.float32)
  return Batch(input_ids_BxT=jnp.asarray(ids), attention_mask_BxT=jnp.asarray(attn),
               loss_mask_BxT=jnp.asarray(loss_mask), sampler_logp_BxT=jnp.asarray(sampler),
               rewards_B=jnp.asarray(rewards))


def torch_step_fn(path, batch, group_size, micro, clip_low, clip_high):
  """forward+backward of GRPO's clipped token-mean loss in transformers."""
  import torch
  from transformers import AutoModelForCausalLM

  torch.set_num_threads(os.cpu_count())
  model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
  model.train()
  ids = torch.from_numpy(np.array(batch.input_ids_BxT)).long()
  attn = torch.from_numpy(np.array(batch.attention_mask_BxT)).long()
  mask = torch.from_numpy(np.array(batch.loss_mask_BxT))
  r = torch.from_numpy(np.array(batch.rewards_B)).view(-1, group_size)
  std = r.std(dim=1, keepdim=True)
  adv = torch.where(std > 0, (r - r.mean(1, keepdim=True)) / (std + 1e-6),
                    torch.zeros_like(r)).view(-1)
  pos = (attn.cumsum(1) - 1).clamp(min=0)  # positions from the mask, as isojax does
  total = mask.sum()

  def step():
    model.zero_grad(set_to_none=True)
    loss_sum = 0.0
    for s in range(0, ids.shape[0], micro):
      sl = slice(s, s + micro)
      logits = model(input_ids=ids[sl], attention_mask=attn[sl],
                     position_ids=pos[sl]).logits[:, :-1].float()
      logp = torch.log_softmax(logits, -1).gather(-1, ids[sl, 1:, None])[..., 0]
      ratio = torch.exp(logp - logp.detach())
      a = adv[sl, None]
      pg = torch.maximum(-a * ratio, -a * ratio.clamp(1 - clip_low, 1 + clip_high))
      loss = (pg * mask[sl, 1:]).sum() / total
      loss.backward()
      loss_sum += loss.item()
    return loss_sum

  return step


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--small", action="store_true", help="2 layers, d=128, 64 x 64 tokens")
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--hidden", type=int, default=256)
  ap.add_argument("--vocab", type=int, default=1024)
  ap.add_argument("--seqs", type=int, default=256)
  ap.add_argument("--tokens", type=int, default=256)
  ap.add_argument("--micro", type=int, default=64, help="micro-batch rows")
  ap.add_argument("--group", type=int, default=8, help="rollouts per prompt")
  ap.add_argument("--repeats", type=int, default=3, help="timed rounds")
  ap.add_argument("--logits-chunk", type=int, default=None,
                  help="lm-head positions per chunk (make_train_step's logits_chunk)")
  ap.add_argument("--remat", default="none", help="ModelConfig.remat")
  ap.add_argument("--no-torch", action="store_true")
  args = ap.parse_args()
  if args.small:
    args.layers, args.hidden, args.seqs, args.tokens, args.micro = 2, 128, 64, 64, 32
    args.repeats = max(args.repeats, 3)

  D = args.hidden
  cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=args.vocab, hidden_size=D,
                    intermediate_size=4 * D, num_layers=args.layers, num_heads=D // 64,
                    num_kv_heads=D // 64, head_dim=64, max_position_embeddings=4 * args.tokens,
                    remat=args.remat)
  B, T = args.seqs, args.tokens
  print(f"devices: {jax.devices()}  cpu cores: {os.cpu_count()}  load avg: "
        f"{os.getloadavg()[0]:.1f}")
  print(f"model: {cfg.num_layers} layers, d={D}, ff={4 * D}, heads={cfg.num_heads}, "
        f"vocab={cfg.vocab_size}; batch {B} x {T} tokens, micro-batch {args.micro}, "
        f"remat {cfg.remat}")

  model = Decoder(cfg, rngs=nnx.Rngs(0))
  loss_cfg, optim_cfg = LossConfig(), OptimConfig()
  step = make_train_step(model, loss_cfg, optim_cfg, batch_size=B, group_size=args.group,
                         micro_batch_size=args.micro, logits_chunk=args.logits_chunk)
  batch = make_batch(B, T, T // 4, cfg.vocab_size)
  state = init_train_state(model, loss_cfg, optim_cfg, batch_size=B)
  holder = {"state": state}

  def jax_step():
    holder["state"], metrics = step(holder["state"], batch)
    jax.block_until_ready(holder["state"])
    return float(metrics["loss"])

  matmul = matmul_fn()
  t = time.perf_counter()
  first_loss = jax_step()  # from the initial weights
  print(f"first call (compile + run): {time.perf_counter() - t:.1f} s")
  torch_step = None
  tmp = tempfile.TemporaryDirectory()
  if not args.no_torch:
    save_pretrained(Decoder(cfg, rngs=nnx.Rngs(0)), cfg, tmp.name)  # the initial weights
    torch_step = torch_step_fn(tmp.name, batch, args.group, args.micro, loss_cfg.clip_low,
                               loss_cfg.clip_high)

  # Rounds of (matmul, isojax, transformers): on a shared machine the three see the
  # same load in each round, and the best of each is compared. No torch compile to
  # warm up: every torch run is timed (the first one too).
  times = {"matmul": [], "isojax": [], "transformers": []}
  torch_loss = None
  for _ in range(args.repeats):
    times["matmul"].append(timed(matmul, 3)[0])
    times["isojax"].append(timed(jax_step, 1)[0])
    if torch_step is not None:
      t = time.perf_counter()
      torch_loss = torch_step()
      times["transformers"].append(time.perf_counter() - t)
  tmp.cleanup()
  peak = 2 * 2048 ** 3 / min(times["matmul"])
  jax_s = min(times["isojax"])
  print(f"fp32 matmul 2048^3: {peak / 1e9:.1f} GFLOP/s   load avg now: "
        f"{os.getloadavg()[0]:.1f}")
  flops = model_flops(cfg, B, T)
  print(f"isojax step: {jax_s:.3f} s (runs {', '.join(f'{x:.3f}' for x in times['isojax'])})"
        f"  {B * T / jax_s:,.0f} tokens/s")
  print(f"  model FLOPs {flops / 1e12:.3f} T -> {flops / jax_s / 1e9:.1f} GFLOP/s = "
        f"{flops / jax_s / peak:.2f} x matmul peak (goal >= 0.5)")
  if torch_step is None:
    return
  torch_s = min(times["transformers"])
  print(f"transformers fwd+bwd: {torch_s:.3f} s (runs "
        f"{', '.join(f'{x:.3f}' for x in times['transformers'])})  "
        f"{B * T / torch_s:,.0f} tokens/s")
  print(f"  same loss: isojax {first_loss:.6e}  transformers {torch_loss:.6e}")
  print(f"isojax / transformers speed: {torch_s / jax_s:.2f}x (goal >= 1.5)")


if __name__ == "__main__":
  main()
