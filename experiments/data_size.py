r"""Data size D (§5.2, Fig. 13): the easy set's n-vs-M study trained on D problems.

Fig. 13 compares D = 6k with D = 500 easy problems: with less data the frontier
saturates at a smaller n and larger n overfits. `d` sets data.num_train, a seeded
subsample (data.split_seed, the same for every run of the sweep) of the training
problems left after the validation set is held out; d=0 keeps them all. The
validation set is the same for every D. Run one budget point from the repo root:

  python -m isojax.main --config=experiments/data_size.py:d=500,n=64,budget=2e6 --workdir=runs/data_size/d500/n64

Laptop scale (tiny base model; the synthetic easy split holds 520 problems, 64 of
them held out, so d=0 trains on 456 and d=40 on a twelfth of them, the paper's
500 / 6k):

  python -m isojax.main --config=experiments/data_size.py:smoke,d=40 --workdir=/tmp/isojax/data_size/d40

Args: d (training problems; 0 = all), bp, n, budget, smoke. Sweep grid (config.sweep,
for launch/): n in 8..2048 at Bp = 32, once per D. Runs of each D carry the
analysis label data.difficulty = "easy_d<D>" ("easy_dall" for d=0), so one
`python -m isojax.analysis` over both sweeps draws one frontier per D.

Recipe: the easy-set recipe of experiments/easy_n_vs_m.py. The paper's setting is
Qwen2.5-7B-Instruct on its Guru-Math easy split (6k problems):
  --config.model.path=/ckpt/Qwen2.5-7B-Instruct --config.sampler.backend=vllm
  --config.data.train=/data/guru_easy_train.jsonl
  --config.data.val=/data/guru_easy_val.jsonl --config.data.chat_template=True
  --config.data.reward=math
(sampler.max_tokens is 0, "the study's length": 8 tokens on the tiny model,
the paper's 8,192 once model.path names a real model; set it to override.)
"""

from experiments import common


def get_config(arg=None):
  a, rest = common.split_arg(arg, d=0)
  c = common.study_config("easy", "n_vs_m", rest)
  c.data.num_train = a.d
  c.data.difficulty = f"easy_d{a.d or 'all'}"
  c.sweep.study = "data_size"
  return c
