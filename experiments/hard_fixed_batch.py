r"""Hard split (base-model avg@16 in [0, 0.0625]): Bp vs n at fixed B = Bp*n (§4.2, Figs. 9-10, 18-19).

Run one budget point from the repo root (any field overridable, e.g.
--config.rl.kl_coef=0):

  python -m isojax.main --config=experiments/hard_fixed_batch.py:batch=8192,n=64,budget=2e6 --workdir=runs/hard_fixed_batch/b8192_n64

Laptop scale (tiny base model, B_max 256, 2048 rollouts, CPU learning rate):

  python -m isojax.main --config=experiments/hard_fixed_batch.py:smoke --workdir=/tmp/isojax/hard_fixed_batch

Args: bp, n, budget (rollouts), batch (the fixed B; bp = batch / n), smoke;
a key left out takes the study's default.

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
  a = common.parse_arg(arg, bp=0, n=0, budget=0.0, batch=0, smoke=False)
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
  c.sweep.study, c.sweep.split = "fixed_batch", "hard"
  bp_values = None  # at smoke scale: every Bp on the line
  if a.smoke:
    common.smoke_scale(c)
    c.b_max = 256
    c.n, c.budget, default_batch = a.n or 4, a.budget or 2048.0, 32
    c.sweep.n_values = [2, 4, 8, 16]
  else:
    c.b_max = budget.PAPER_B_MAX_HARD
    # App. B, Figs. 18-19 fix B at 4096, 8192 and 16384.
    c.n, c.budget, default_batch = a.n or 64, a.budget or 2e6, 8192
    c.sweep.n_values = list(budget.PAPER_N_VALUES)  # 8 .. 2048
    # The paper's Bp grid (§4).
    bp_values = budget.PAPER_BP_VALUES
  # B = Bp * n is fixed: batch= (else bp * n when bp= is given) sets Bp = B / n.
  common.fix_batch(c, a.batch or (a.bp * c.n if a.bp else default_batch), bp=a.bp,
                   bp_values=bp_values)
  c.sweep.budgets = [c.budget]
  return c
