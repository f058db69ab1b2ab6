r"""Writes the difficulty splits of a base model: per-problem pass counts, then split files.

  python launch/difficulty_splits.py --out isojax/assets/splits --num 4096 --seed 0 \
      --samples 16 --extreme_samples 128 --temperature 0.6 --max_tokens 8 \
      --mix hard_easy=hard:0.5,easy:0.5

Samples every problem through a `JaxSampler` on the base model (isojax.evaluate counts
the correct answers), then assigns the splits with the pure functions of
isojax.data.splits (the ranges and their source are documented there) and writes
`<name>.jsonl` per split and `summary.json`. This file only samples and parses flags.
"""

import argparse
import json
import os
import sys
from collections.abc import Sequence

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from isojax.data.rewards import get_reward_fn  # noqa: E402  (needs the repo root on sys.path)
from isojax.data.sources import Problem, load_problems  # noqa: E402
from isojax.data.splits import (EXTREME_SAMPLES, mixture_indices, mixture_size,  # noqa: E402
                                parse_mix, split_indices, write_splits)
from isojax.data.synthetic import synthetic_problems  # noqa: E402
from isojax.evaluate import evaluate, format_histogram  # noqa: E402
from isojax.models import Tokenizer, load_pretrained  # noqa: E402
from isojax.rollout.jax_sampler import JaxSampler  # noqa: E402
from isojax.run_setup import BASE_MODEL_DIR  # noqa: E402


def estimate_counts(sampler, problems: Sequence[Problem], tokenizer, *, n: int = 16,
                    temperature: float = 0.6, max_tokens: int = 16, reward_fn=None,
                    seed: int = 0, batch_size: int = 256, chat_template: bool = False
                    ) -> np.ndarray:
  """Correct counts out of n samples per problem under `sampler` (the base model)."""
  result = evaluate(sampler, problems, tokenizer, k=n, temperature=temperature,
                    max_tokens=max_tokens, reward_fn=reward_fn, seed=seed,
                    batch_size=batch_size, chat_template=chat_template, prefix="")
  return result.counts_P


def main(argv=None) -> None:
  """Estimate avg@16 (and pass@128 for the zeros) and write split files."""
  ap = argparse.ArgumentParser(prog="python launch/difficulty_splits.py",
                               description=main.__doc__)
  ap.add_argument("--model", default=str(BASE_MODEL_DIR))
  ap.add_argument("--source", default="synthetic",
                  help="'synthetic' or a .jsonl/.parquet/datasets path")
  ap.add_argument("--num", type=int, default=1024, help="synthetic problems to draw")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--samples", type=int, default=16)
  ap.add_argument("--extreme_samples", type=int, default=0,
                  help=f"e.g. {EXTREME_SAMPLES}: also write very_easy.jsonl and "
                       f"extremely_hard.jsonl (selected on this many samples)")
  ap.add_argument("--temperature", type=float, default=0.6)
  ap.add_argument("--max_tokens", type=int, default=16)
  ap.add_argument("--reward", default="exact_match")
  ap.add_argument("--chat_template", action="store_true")
  ap.add_argument("--mix", action="append", default=[],
                  help="a mixture file NAME=SPLIT:W,SPLIT:W (e.g. "
                       "hard_easy=hard:0.5,easy:0.5), as large as its smallest part allows")
  ap.add_argument("--out", required=True)
  args = ap.parse_args(argv)
  if args.extreme_samples and args.extreme_samples <= args.samples:
    ap.error(f"--extreme_samples={args.extreme_samples} must exceed "
             f"--samples={args.samples}")
  # split_indices refuses fewer, but only after every problem has been sampled.
  if args.extreme_samples and args.extreme_samples < EXTREME_SAMPLES:
    ap.error(f"--extreme_samples={args.extreme_samples} must be 0 (off) or >= "
             f"{EXTREME_SAMPLES}: extremely_hard means pass@{EXTREME_SAMPLES} = 0")

  problems = (synthetic_problems(args.num, seed=args.seed) if args.source == "synthetic"
              else load_problems(args.source))
  model, _ = load_pretrained(args.model)
  tokenizer = Tokenizer.from_pretrained(args.model)
  sampler = JaxSampler(model)
  kw = dict(temperature=args.temperature, max_tokens=args.max_tokens,
            reward_fn=get_reward_fn(args.reward), chat_template=args.chat_template)
  counts = estimate_counts(sampler, problems, tokenizer, n=args.samples, seed=args.seed,
                           **kw)
  print(format_histogram(counts, args.samples))
  extreme = None
  if args.extreme_samples:
    # Every problem is topped up to extreme_samples. The problems with no success
    # so far go first, in a call of their own, so that extremely_hard is drawn
    # exactly as it was when only they were topped up; the rest follow with
    # another seed (very_easy needs their 128-sample rate).
    extreme = counts.copy()
    for seed, idx in ((args.seed + 1, np.flatnonzero(counts == 0)),
                      (args.seed + 2, np.flatnonzero(counts > 0))):
      if len(idx):
        extreme[idx] += estimate_counts(sampler, [problems[i] for i in idx], tokenizer,
                                        n=args.extreme_samples - args.samples,
                                        seed=seed, **kw)
  splits = split_indices(counts, args.samples, extreme_counts_P=extreme,
                         extreme_n=args.extreme_samples or None)
  for spec in args.mix:
    name, weights = parse_mix(spec)
    splits[name] = mixture_indices(splits, weights, mixture_size(splits, weights),
                                   seed=args.seed)
  summary = write_splits(args.out, problems, counts, args.samples, splits,
                         extreme_counts_P=extreme, extreme_n=args.extreme_samples or None,
                         command=" ".join(["python launch/difficulty_splits.py",
                                           *(sys.argv[1:] if argv is None else argv)]))
  print(json.dumps(summary))


if __name__ == "__main__":
  main()
