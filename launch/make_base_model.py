"""Make the committed tiny base model: SFT of a 2-layer Qwen2 on the synthetic tasks.

    python launch/make_base_model.py --out isojax/assets/base_model --seed 0

Writes an HF directory (config.json, model.safetensors, tokenizer files) that
`isojax.models.load_pretrained`, `transformers` and a vLLM CPU server load, plus
`make_base_model.json` (the arguments, stop step and measured pass-rate histogram).

The model is trained on answer tokens only (AdamW, fresh problems every step, a fixed
family mixture that favours the slow arithmetic families) and stopped early, at the
first evaluation where its sampled pass@1 on held-out problems of the RL task
(`--digits`, default `isojax.data.synthetic.DEFAULT_DIGITS`) reaches `--target` and
every family reaches `--min_family`. An RL base needs per-problem pass rates spread
over 0..1 so that the paper's easy [0.3, 0.6] and hard [0, 0.0625] splits both
exist, here with problems of several families in each. Arithmetic is learned in a
sudden jump (after ~1,000 steps at seed 0), reversal and sorting earlier and
gradually, so at the stop the arithmetic families sit near 0.1-0.2 and the others
higher. Such an early-stopped base is sharp: keep RL learning rates small.
Everything is a function of --seed (same machine and JAX version: same bytes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from isojax import models as isojax_models  # noqa: E402  (needs the repo root on sys.path)
from isojax.data.synthetic import (  # noqa: E402
    BOS, DEFAULT_DIGITS, DEFAULT_FAMILIES, EOS, PAD, UNK, FAMILIES, VOCAB, digit_ranges,
    family_of, synthetic_problems)
from isojax.evaluate import format_histogram, pass_rate_histogram  # noqa: E402

# A fixed SFT mixture that favours the slow (arithmetic) families, so that all of them
# are partly learned when the fast ones (reversal, sorting) are; changing the mixture
# during training made the fast ones forget and oscillate.
DEFAULT_SFT_WEIGHTS = {"add": 0.3, "sub": 0.3, "mul": 0.2, "rev": 0.1, "sort": 0.1}
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}")


def build_tokenizer():
  """A character-level WordLevel tokenizer over `VOCAB` as a PreTrainedTokenizerFast.

  Whitespace is dropped, every other character is one token, BOS is prepended when
  special tokens are added, and decoding concatenates tokens with no spaces.
  """
  vocab = {tok: i for i, tok in enumerate(VOCAB)}
  tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.WhitespaceSplit(),
      pre_tokenizers.Split(Regex("."), behavior="isolated")])
  tok.post_processor = processors.TemplateProcessing(
      single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])])
  tok.decoder = decoders.Fuse()
  return PreTrainedTokenizerFast(
      tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
      chat_template=CHAT_TEMPLATE, padding_side="left", model_max_length=64,
      clean_up_tokenization_spaces=False)


def model_hf_config(hidden: int = 128, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                    intermediate: int = 384, max_len: int = 64) -> dict:
  """config.json of the tiny Qwen2 (head_dim = hidden/heads >= 32 for vLLM on CPU)."""
  vocab = {tok: i for i, tok in enumerate(VOCAB)}
  return {
      "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
      "vocab_size": len(VOCAB), "hidden_size": hidden, "intermediate_size": intermediate,
      "num_hidden_layers": layers, "num_attention_heads": heads,
      "num_key_value_heads": kv_heads, "head_dim": hidden // heads,
      "hidden_act": "silu", "max_position_embeddings": max_len, "rms_norm_eps": 1e-6,
      "rope_theta": 10000.0, "tie_word_embeddings": False, "use_sliding_window": False,
      "bos_token_id": vocab[BOS], "eos_token_id": vocab[EOS], "pad_token_id": vocab[PAD],
      "torch_dtype": "float32",
  }


def token_widths(ranges: dict) -> tuple[int, int]:
  """(longest prompt incl. BOS, longest answer incl. EOS) over the families' ranges."""
  prompt = {"add": lambda d: 2 * d + 3, "sub": lambda d: 2 * d + 3,
            "mul": lambda d: d + 4, "rev": lambda d: d + 3, "sort": lambda d: d + 3}
  answer = {"add": lambda d: d + 2, "sub": lambda d: d + 1, "mul": lambda d: d + 2,
            "rev": lambda d: d + 1, "sort": lambda d: d + 1}
  return (max(prompt[f](hi) for f, (_, hi) in ranges.items()),
          max(answer[f](hi) for f, (_, hi) in ranges.items()))


def encode_sft(problems, tok, width: int):
  """Right-padded [BOS prompt answer EOS] rows; the loss mask covers answer + EOS.

  Returns ids_BxT, mask_BxT, loss_mask_BxT (int32, T = width), where loss_mask[t]
  marks the targets ids[t] predicted from position t-1.
  """
  B = len(problems)
  ids = np.zeros((B, width), np.int32)
  mask = np.zeros((B, width), np.int32)
  loss = np.zeros((B, width), np.int32)
  for b, p in enumerate(problems):
    prompt = tok.encode(p.prompt, add_special_tokens=True)
    answer = tok.encode(p.answer, add_special_tokens=False) + [tok.eos_token_id]
    row = prompt + answer
    if len(row) > width:
      raise ValueError(f"problem {p.id!r} needs {len(row)} tokens > width {width}")
    ids[b, :len(row)] = row
    mask[b, :len(row)] = 1
    loss[b, len(prompt):len(row)] = 1
  return ids, mask, loss


def encode_prompts_left(problems, tok, width: int):
  """Left-padded [BOS prompt] rows for sampling: ids_BxP, mask_BxP."""
  B = len(problems)
  ids = np.zeros((B, width), np.int32)
  mask = np.zeros((B, width), np.int32)
  for b, p in enumerate(problems):
    row = tok.encode(p.prompt, add_special_tokens=True)
    ids[b, width - len(row):] = row
    mask[b, width - len(row):] = 1
  return ids, mask


def make_sampler(graphdef, max_tokens: int, eos_id: int):
  """A jitted full-forward sampler (no KV cache: the model is tiny, prompts short).

  sample(states, ids_BxP, mask_BxP, key, temperature) -> tokens_BxN, where `states`
  is the tuple of nnx states split from the model; after EOS a row keeps emitting EOS.
  """
  @jax.jit
  def sample(states, ids_BxP, mask_BxP, key, temperature):
    model = nnx.merge(graphdef, *states)
    B, P = ids_BxP.shape
    ids = jnp.concatenate([ids_BxP, jnp.zeros((B, max_tokens), jnp.int32)], 1)
    mask = jnp.concatenate([mask_BxP, jnp.ones((B, max_tokens), jnp.int32)], 1)

    def body(t, carry):
      ids, done_B = carry
      logits_BxV = model(ids, attention_mask=mask)[:, P + t - 1]
      tok_B = jax.random.categorical(jax.random.fold_in(key, t),
                                     logits_BxV / temperature)
      tok_B = jnp.where(done_B, eos_id, tok_B).astype(jnp.int32)
      ids = jax.lax.dynamic_update_slice(ids, tok_B[:, None], (0, P + t))
      return ids, done_B | (tok_B == eos_id)

    ids, _ = jax.lax.fori_loop(0, max_tokens, body, (ids, jnp.zeros((B,), bool)))
    return ids[:, P:]

  return sample


def count_correct(sample, state, problems, tok, samples: int, key, temperature: float,
                  prompt_width: int, chunk: int = 1024) -> np.ndarray:
  """Correct samples (exact match, EOS-terminated) out of `samples` per problem."""
  reps = [p for p in problems for _ in range(samples)]
  ids, mask = encode_prompts_left(reps, tok, prompt_width)
  correct = np.zeros(len(reps), bool)
  for i, start in enumerate(range(0, len(reps), chunk)):
    sl = slice(start, start + chunk)
    out = np.asarray(sample(state, ids[sl], mask[sl], jax.random.fold_in(key, i),
                            temperature))
    for j, row in enumerate(out):
      p = reps[start + j]
      row = row.tolist()
      if tok.eos_token_id in row:
        text = tok.decode(row[:row.index(tok.eos_token_id)])
        correct[start + j] = text == p.answer
  return correct.reshape(len(problems), samples).sum(1)


def family_rates(counts_P, problems, samples: int) -> dict[str, float]:
  """Mean pass rate per synthetic family (families absent from `problems` omitted)."""
  by_family: dict[str, list[float]] = {}
  for c, p in zip(counts_P, problems):
    by_family.setdefault(family_of(p), []).append(c / samples)
  return {f: float(np.mean(v)) for f, v in sorted(by_family.items(),
                                                  key=lambda kv: FAMILIES.index(kv[0]))}


@dataclasses.dataclass(frozen=True)
class SftTask:
  """The task arguments, parsed: families, RL-task digits, SFT digits, SFT mixture."""
  families: tuple[str, ...]
  digits: Any           # of the RL task: the stop rule and the histogram measure these
  sft_digits: Any       # of the SFT data
  weights: dict | None  # family -> SFT mixture weight; None = uniform

  @classmethod
  def from_args(cls, args) -> SftTask:
    digits = json.loads(args.digits)
    return cls(families=tuple(args.families.split(",")), digits=digits,
               sft_digits=json.loads(args.sft_digits) if args.sft_digits else digits,
               weights=json.loads(args.weights) if args.weights else None)

  def widths(self) -> tuple[int, int]:
    """(prompt width incl. BOS, answer width incl. EOS) over SFT and RL digits."""
    widths = [token_widths(digit_ranges(d, self.families))
              for d in (self.sft_digits, self.digits)]
    return max(w[0] for w in widths), max(w[1] for w in widths)


@dataclasses.dataclass(frozen=True)
class SftRun:
  """What the SFT loop ends with."""
  params: nnx.State
  steps: int
  loss: float
  stop_reason: str
  history: list[dict]
  train_s: float


def make_sft_step(graphdef, args):
  """AdamW (linear warm-up, then constant) and its jitted step on answer tokens.

  Returns (tx, step), step(params, opt_state, rest, ids, mask, loss_mask) ->
  (params, opt_state, loss), the loss a mean over the loss mask's tokens.
  """
  schedule = optax.join_schedules(
      [optax.linear_schedule(0.0, args.lr, args.warmup),
       optax.constant_schedule(args.lr)], [args.warmup])
  tx = optax.adamw(schedule, b1=0.9, b2=0.98, weight_decay=args.weight_decay)

  def loss_fn(params, rest, ids, mask, loss_mask):
    m = nnx.merge(graphdef, params, rest)
    logits = m(ids[:, :-1], attention_mask=mask[:, :-1])
    logp = jax.nn.log_softmax(logits, -1)
    tgt = jnp.take_along_axis(logp, ids[:, 1:, None], -1)[..., 0]
    w = loss_mask[:, 1:].astype(jnp.float32)
    return -(tgt * w).sum() / w.sum()

  @jax.jit
  def train_step(params, opt_state, rest, ids, mask, loss_mask):
    loss, grads = jax.value_and_grad(loss_fn)(params, rest, ids, mask, loss_mask)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return tx, train_step


def sft_until_target(args, task: SftTask, tok, graphdef, params, rest, sample, key,
                     t0: float) -> SftRun:
  """Trains on fresh problems every step until the stop rule holds or max_steps.

  Every `eval_every` steps it samples held-out problems of the RL task; it stops at
  the first evaluation where pass@1 >= target and every family >= min_family.
  """
  prompt_width, max_tokens = task.widths()
  tx, train_step = make_sft_step(graphdef, args)
  opt_state = tx.init(params)
  eval_problems = synthetic_problems(args.eval_problems, seed=args.seed + 7919,
                                     families=task.families, digits=task.digits,
                                     id_prefix="eval")
  history, step, stop_reason = [], 0, "max_steps"
  loss = float("nan")
  while step < args.max_steps:
    batch = synthetic_problems(args.batch, seed=args.seed * 1_000_003 + step,
                               families=task.families, digits=task.sft_digits,
                               weights=task.weights, unique=False)
    ids, mask, lmask = encode_sft(batch, tok, prompt_width + max_tokens)
    params, opt_state, loss = train_step(params, opt_state, rest, ids, mask, lmask)
    step += 1
    if step % args.eval_every == 0:
      counts = count_correct(sample, (params, rest), eval_problems, tok, args.eval_samples,
                             jax.random.fold_in(key, step), args.temperature,
                             prompt_width)
      rate = float(counts.sum() / (len(eval_problems) * args.eval_samples))
      fam = family_rates(counts, eval_problems, args.eval_samples)
      history.append({"step": step, "loss": float(loss), "pass@1": rate,
                      "families": fam, "time_s": time.time() - t0})
      print(f"step {step:5d} loss {float(loss):.4f} pass@1 {rate:.3f} "
            + " ".join(f"{f}={v:.2f}" for f, v in fam.items())
            + f"  ({time.time() - t0:.0f}s)", flush=True)
      if rate >= args.target and min(fam.values()) >= args.min_family:
        stop_reason = (f"pass@1 {rate:.3f} >= target {args.target} and every "
                       f"family >= {args.min_family}")
        break
  return SftRun(params=params, steps=step, loss=float(loss), stop_reason=stop_reason,
                history=history, train_s=time.time() - t0)


def measure_avg16(args, task: SftTask, tok, sample, state, key) -> dict[float, dict]:
  """The histogram the RL splits will see: avg@16 on fresh problems of the RL task, at
  the sampling temperature and at the paper's 0.6 (for configs that use it).

  Returns {temperature: {avg@16_histogram, avg@16_ranges, avg@16_per_family, pass@1}}.
  """
  prompt_width, _ = task.widths()
  final = synthetic_problems(args.hist_problems, seed=args.seed + 104729,
                             families=task.families, digits=task.digits,
                             id_prefix="hist")
  measured = {}
  for i, temp in enumerate(sorted({args.temperature, 0.6}, reverse=True)):
    counts = count_correct(sample, state, final, tok, 16,
                           jax.random.fold_in(key, 2**31 - 1 - i), temp, prompt_width)
    print(f"temperature {temp}: " + format_histogram(counts, 16))
    ranges = {"0": np.mean(counts == 0),
              "(0,0.3)": np.mean((counts > 0) & (counts < 4.8)),
              "[0.3,0.6]": np.mean((counts >= 4.8) & (counts <= 9.6)),
              "(0.6,1]": np.mean(counts > 9.6)}
    per_family = family_rates(counts, final, 16)
    print("  avg@16 ranges: " + ", ".join(f"{k} {v:.0%}" for k, v in ranges.items()))
    print("  per family avg@16: " + ", ".join(f"{f} {v:.2f}"
                                               for f, v in per_family.items()))
    measured[temp] = {"avg@16_histogram": pass_rate_histogram(counts, 16),
                      "avg@16_ranges": {k: float(v) for k, v in ranges.items()},
                      "avg@16_per_family": per_family,
                      "pass@1": float(counts.mean() / 16)}
  return measured


def train(args) -> dict:
  """Run the SFT and write the asset; returns the summary written beside it."""
  t0 = time.time()
  task = SftTask.from_args(args)
  tok = build_tokenizer()
  cfg = isojax_models.ModelConfig.from_hf_dict(model_hf_config(
      hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
      intermediate=args.intermediate))
  graphdef, params, rest = nnx.split(isojax_models.Decoder(cfg, rngs=nnx.Rngs(args.seed)),
                                     nnx.Param, ...)
  sample = make_sampler(graphdef, task.widths()[1], tok.eos_token_id)
  key = jax.random.key(args.seed)
  run = sft_until_target(args, task, tok, graphdef, params, rest, sample, key, t0)
  measured = measure_avg16(args, task, tok, sample, (run.params, rest), key)

  summary = {
      "command": f"python launch/make_base_model.py --out {args.out} "
                 f"--seed {args.seed}",
      "args": vars(args), "steps": run.steps, "stop_reason": run.stop_reason,
      "train_seconds": round(run.train_s, 1), "final_loss": run.loss,
      "num_params": int(sum(x.size for x in jax.tree.leaves(run.params))),
      "temperature": args.temperature, **measured[args.temperature],
      "at_temperature_0.6": measured[0.6], "history": run.history,
      "jax_version": jax.__version__,
  }
  out = isojax_models.save_pretrained(nnx.merge(graphdef, run.params, rest), cfg, args.out,
                                      tokenizer=isojax_models.Tokenizer(tok))
  with open(os.path.join(out, "make_base_model.json"), "w") as f:
    json.dump(summary, f, indent=1)
  print(f"wrote {out} ({summary['num_params']} parameters, {run.steps} steps, "
        f"{run.train_s:.0f}s)")
  return summary


def parse_args(argv=None):
  ap = argparse.ArgumentParser(prog="python launch/make_base_model.py",
                               description=__doc__.split("\n")[0])
  ap.add_argument("--out", required=True)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--families", default=",".join(DEFAULT_FAMILIES))
  ap.add_argument("--digits", default=json.dumps(DEFAULT_DIGITS),
                  help='digits of the RL task the stop rule and histogram measure '
                       '(JSON: an int, [min, max] or {"add": [2, 3], ...})')
  ap.add_argument("--sft_digits", default=None,
                  help="digits of the SFT data (default: --digits)")
  ap.add_argument("--hidden", type=int, default=128)
  ap.add_argument("--layers", type=int, default=2)
  ap.add_argument("--heads", type=int, default=4)
  ap.add_argument("--kv_heads", type=int, default=2)
  ap.add_argument("--intermediate", type=int, default=384)
  ap.add_argument("--batch", type=int, default=128)
  ap.add_argument("--lr", type=float, default=1e-3)
  ap.add_argument("--warmup", type=int, default=50)
  ap.add_argument("--weight_decay", type=float, default=0.01)
  ap.add_argument("--max_steps", type=int, default=5000)
  ap.add_argument("--eval_every", type=int, default=50)
  ap.add_argument("--eval_problems", type=int, default=400)
  ap.add_argument("--eval_samples", type=int, default=4)
  ap.add_argument("--hist_problems", type=int, default=500)
  ap.add_argument("--temperature", type=float, default=1.0,
                  help="sampling temperature of the stop rule and the histogram")
  ap.add_argument("--weights", default=json.dumps(DEFAULT_SFT_WEIGHTS),
                  help="JSON family -> SFT mixture weight ('' = uniform)")
  ap.add_argument("--target", type=float, default=0.3,
                  help="stop when the sampled pass@1 reaches this ...")
  ap.add_argument("--min_family", type=float, default=0.1,
                  help="... and every family's pass@1 reaches this")
  return ap.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  # CPU unless the caller names a platform (the model is tiny; the bytes are CPU's).
  if "JAX_PLATFORMS" not in os.environ:
    jax.config.update("jax_platforms", "cpu")
  train(args)


if __name__ == "__main__":
  main()
