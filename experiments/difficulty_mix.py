r"""Difficulty mixtures (§5.3, Fig. 14): what the training mixture does to n's scaling.

Three training distributions of the same size, each evaluated on three sets:
  hard    Hard only: problems with pass@128 = 0 (no success in 128 samples)
  dual    Heterogeneous dual mix: 50 % Hard, 50 % Easy
  tri     Heterogeneous tri mix: 50 % Hard, 25 % Easy, 25 % Very Easy (Polaris's
          J shape)
All three levels are chosen on 128 samples of the base model, as Fig. 14 does
(pass@128 read as the share of the 128 samples correct; isojax/data/splits.py):
Hard is the synthetic split extremely_hard (pass@128 = 0), Easy the split
easy_pass128 (pass@128 in [0.3, 0.6]; the main studies' easy split uses avg@16) and
Very Easy the split very_easy (pass@128 in [0.6, 0.9]); they are disjoint. The mixture is drawn
from the splits after their validation problems are removed (data.train =
"mix:SPLIT:W,...", isojax/data/problem_sets.py). Validation: data.num_val problems
of each split, logged as val/avg@4 (Hard, the primary set), val/easy/avg@4 and
val/very_easy/avg@4 (and best@4, worst@4 each). Run one point from the repo root:

  python -m isojax.main --config=experiments/difficulty_mix.py:mix=dual,n=64,budget=2e6 --workdir=runs/difficulty_mix/dual/n64

Laptop scale (tiny base model):

  python -m isojax.main --config=experiments/difficulty_mix.py:smoke,mix=tri --workdir=/tmp/isojax/difficulty_mix/tri

Args: mix (hard | dual | tri), bp, n, budget, smoke. Sweep grid: n in {8, 64} as
in Fig. 14 at Bp = 32. Runs carry the analysis label data.difficulty = "mix_<mix>";
draw a set's frontier with `python -m isojax.analysis RUNS --out R --metric
val/easy/avg@4`.

Sizes deviate from the paper's for the synthetic splits: every mixture trains on
data.num_train = 320 problems (Fig. 14: 5k) and each validation set holds
data.num_val = 100 (the playbook's sets hold 300), because the synthetic Hard split
has 426 problems: 300 held out would leave 126, short of a mixture's 160 Hard ones.

Study and recipe: experiments/hard_n_vs_m.py (KL and entropy off: at least half of
every mixture is hard). With a real model, point data.train at the mixture file, keep
all of it (num_train 0: 320 would subsample the file) and name the validation sets:

  python -m isojax.main --config=experiments/difficulty_mix.py:mix=dual,n=64,budget=2e6 --workdir=runs/difficulty_mix/dual/n64 \
      --config.model.path=/ckpt/Qwen2.5-7B-Instruct --config.sampler.backend=vllm \
      --config.data.train=/data/mix_dual_5k.jsonl --config.data.num_train=0 \
      --config.data.val=hard=/data/hard_val.jsonl,easy=/data/easy_val.jsonl,very_easy=/data/very_easy_val.jsonl \
      --config.data.chat_template=True --config.data.reward=math
"""

from experiments import common, hard_n_vs_m

MIXES = {"hard": "mix:extremely_hard:1.0",
         "dual": "mix:extremely_hard:0.5,easy_pass128:0.5",
         "tri": "mix:extremely_hard:0.5,easy_pass128:0.25,very_easy:0.25"}
VAL_SETS = ("hard=synthetic:extremely_hard,easy=synthetic:easy_pass128,"
            "very_easy=synthetic:very_easy")
NUM_TRAIN = 320
NUM_VAL = 100


def get_config(arg=None):
  """One budget point of the hard n-vs-M study trained on the mixture `mix`."""
  a, rest = common.split_arg(arg, mix="dual")
  if a.mix not in MIXES:
    raise ValueError(f"mix={a.mix!r}; expected one of {sorted(MIXES)}")
  c = hard_n_vs_m.get_config(rest)
  c.data.train = MIXES[a.mix]
  c.data.val = VAL_SETS
  c.data.num_train = NUM_TRAIN
  c.data.num_val = NUM_VAL
  c.data.difficulty = f"mix_{a.mix}"
  c.sweep.study = "difficulty_mix"
  c.sweep.n_values = [4, 16] if "smoke" in rest.split(",") else [8, 64]
  return c
