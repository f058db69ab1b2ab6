r"""Tiny CPU run: the synthetic arithmetic tasks on the committed tiny base model.

A laptop (2 CPU cores) trains it in well under a minute to a few minutes; it is
also the configuration the end-to-end, resume and CLI tests drive. Run from the
repo root:

  python -m isojax.main --config=experiments/tiny.py:bp=8,n=4,budget=2048 --workdir=/tmp/isojax/tiny

Args (all optional): bp, n, budget (rollouts; M = floor(budget / (bp*n))).
Any field is overridable, e.g. --config.rl.kl_coef=0 --config.eval_every=4.
On this base model n = 4 leaves ~3/4 of the groups with equal rewards (no
signal); n = 16 (`bp=8,n=16,budget=1536`) raises val avg@4 by ~0.05 in 12 steps.

Recipe: the paper's easy-set recipe (KL + entropy on, no zero-variance filter,
sqrt(B) learning rate) on the synthetic task (all five families, held-out
validation problems), with a learning-rate anchor for this base model: 2e-5 at
B = 32. It was early-stopped while sharp, and Adam steps above ~3e-5 made GRPO
collapse on it.
"""

from experiments import common


def get_config(arg=None):
  a = common.parse_arg(arg, bp=8, n=4, budget=2048.0)
  c = common.base_config()
  c.bp, c.n, c.budget = a.bp, a.n, a.budget
  c.b_max = 256
  c.eval_every, c.evals_per_doubling = 8, 0
  c.checkpoint_every = 8
  c.max_consecutive_skips = 3

  c.model.path = ""  # isojax/assets/base_model
  c.mesh.fsdp = 1    # one CPU device: nothing to shard
  c.data.train = "synthetic"  # all five families; needs no split files
  c.data.num_val = 128
  c.sampler.max_tokens = 8

  c.rl.lr_base = common.TINY_LR_BASE
  c.rl.batch_base = common.TINY_B_BASE
  c.rl.warmup_steps = 2
  c.rl.weight_decay = 0.0

  c.eval.num_train = 64
  c.sweep.study = "tiny"
  c.sweep.split = "synthetic"  # all five task families (data.train)
  c.sweep.bp_values = [4, 8, 16]
  c.sweep.n_values = [2, 4, 8, 16]
  c.sweep.budgets = [c.budget]
  return c
