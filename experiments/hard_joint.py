r"""Hard split (base-model avg@16 in [0, 0.0625]): joint (Bp, n, M) under C = Bp*n*M (§4.3, App. C, Figs. 21-22).

Run one budget point from the repo root (any field overridable, e.g.
--config.rl.kl_coef=0):

  python -m isojax.main --config=experiments/hard_joint.py:bp=128,n=64,budget=2e6 --workdir=runs/hard_joint/bp128_n64

Laptop scale (tiny base model, B_max 256, 2048 rollouts, CPU learning rate):

  python -m isojax.main --config=experiments/hard_joint.py:smoke --workdir=/tmp/isojax/hard_joint

Args: bp, n, budget (rollouts), smoke; a key left out takes the study's default.

The built-in default is the synthetic task with the committed tiny base model;
the paper's setting is Qwen2.5-7B-Instruct on the Guru-Math hard split:
  --config.model.path=/ckpt/Qwen2.5-7B-Instruct --config.sampler.backend=vllm
  --config.data.train=/data/guru_hard_train.jsonl
  --config.data.val=/data/guru_hard_val.jsonl --config.data.chat_template=True
  --config.data.reward=math
"""

from experiments import common
from isojax import budget


def get_config(arg=None):
  """One budget point of the study (see the module docstring for `arg`)."""
  a = common.parse_arg(arg, bp=0, n=0, budget=0.0, smoke=False)
  c = common.base_config()
  c.data.train = "synthetic:hard"  # base-model avg@16 in [0, 0.0625] (§3)
  # 0 = the study's length: 8 tokens for the synthetic task on the tiny model,
  # App. A's 8,192 once --config.model.path names a real model.
  c.sampler.max_tokens = 0
  # The sqrt(B) rule (§3, Fig. 4): eta = 1e-6 * sqrt(Bp * n / 1024).
  c.rl.lr_rule, c.rl.lr_base, c.rl.batch_base = "sqrt", 1e-6, 1024
  # Table 1: KL and entropy off; on hard sets they drive entropy and length explosion.
  c.rl.kl_coef = 0.0
  c.rl.entropy_coef = 0.0
  c.sweep.study, c.sweep.split = "joint", "hard"
  if a.smoke:
    common.smoke_scale(c)
    c.b_max = 256
    c.bp, c.n, c.budget = a.bp or 8, a.n or 4, a.budget or 2048.0
    c.sweep.bp_values, c.sweep.n_values = [4, 8, 16], [2, 4, 8, 16]
  else:
    c.b_max = budget.PAPER_B_MAX_HARD
    c.bp, c.n, c.budget = a.bp or 32, a.n or 64, a.budget or 2e6
    c.sweep.bp_values = list(budget.PAPER_BP_VALUES)  # 32 .. 1024
    c.sweep.n_values = list(budget.PAPER_N_VALUES)    # 8 .. 2048
  # Every (Bp, n) of the grids with Bp * n <= b_max; M from the budget.
  c.sweep.budgets = [c.budget]
  return c
