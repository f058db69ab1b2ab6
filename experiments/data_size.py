r"""Data size D (§5.2, Fig. 13): the easy set's n-vs-M study trained on D problems.

Fig. 13 compares D = 6k with D = 500 easy problems: with less data the frontier
saturates at a smaller n and larger n overfits. `d` sets data.num_train, a seeded
subsample (data.split_seed, the same for every run of the sweep) of the training
problems left after the validation set is held out; d=0 keeps them all. The
validation set is the same for every D. Run one budget point from the repo root
with the paper's setting, Qwen2.5-7B-Instruct on its Guru-Math easy split (6k
training problems beside 300 for validation):

  python -m isojax.main --config=experiments/data_size.py:d=500,n=64,budget=2e6 --workdir=runs/data_size/d500/n64 \
      --config.model.path=/ckpt/Qwen2.5-7B-Instruct --config.sampler.backend=vllm \
      --config.data.train=/data/guru_easy_train.jsonl \
      --config.data.val=/data/guru_easy_val.jsonl --config.data.chat_template=True \
      --config.data.reward=math

The built-in default is the synthetic easy split of the committed tiny base model:
it holds 520 problems, so with the study's 300 held out d=0 trains on 220 and d
must lie between Bp (a batch never holds a problem twice) and 220; d=500 is the
paper's data only.

Laptop scale (tiny base model; the synthetic easy split holds 520 problems, 64 of
them held out, so d=0 trains on 456 and d=40 on a twelfth of them, the paper's
500 / 6k):

  python -m isojax.main --config=experiments/data_size.py:smoke,d=40 --workdir=/tmp/isojax/data_size/d40

Args: d (training problems; 0 = all) and those of experiments/easy_n_vs_m.py (bp, n,
budget, smoke), whose study, grid and recipe this is, once per D. Runs of each D
carry the analysis label data.difficulty = "easy_d<D>" ("easy_dall" for d=0), so one
`python -m isojax.analysis` over both sweeps draws one frontier per D.
"""

from experiments import common, easy_n_vs_m


def get_config(arg=None):
  """One budget point of the easy n-vs-M study trained on `d` problems."""
  a, rest = common.split_arg(arg, d=0)
  c = easy_n_vs_m.get_config(rest)
  c.data.num_train = a.d
  c.data.difficulty = f"easy_d{a.d or 'all'}"
  c.sweep.study = "data_size"
  return c
