r"""Easy split, PPO with a value model: the n-sweep of App. F (Fig. 25, left).

Is the finding that larger n wins at larger compute an artefact of GRPO's group
baseline? The same n-vs-M protocol as experiments/easy_n_vs_m.py (Bp, recipe,
sampling, lengths, compute in rollouts) with advantages from a critic instead:
token-level GAE (gamma = lambda = 1), whitened, a clipped value loss, the
critic's trunk a copy of the policy's (config.critic; verl's defaults). The
critic's forward/backward FLOPs are logged as critic_flops beside the rollouts.

Run one budget point from the repo root (any field overridable, e.g.
--config.critic.lr_base=5e-6):

  python -m isojax.main --config=experiments/easy_ppo.py:bp=32,n=64,budget=2e6 --workdir=runs/easy_ppo/bp32_n64

Laptop scale (tiny base model, B_max 256, 2048 rollouts, CPU learning rates):

  python -m isojax.main --config=experiments/easy_ppo.py:smoke --workdir=/tmp/isojax/easy_ppo

Args: bp, n, budget (rollouts), smoke; a key left out takes the study's default.
n may be 1 (a critic needs no group). The paper's model and data flags are those
of experiments/easy_n_vs_m.py.
"""

from experiments import common, easy_n_vs_m

# App. F, Fig. 25: the n grid of the PPO and CISPO sweeps.
APP_F_N_VALUES = [16, 32, 64, 128, 256]
SMOKE_N_VALUES = [1, 2, 4, 8, 16]


def get_config(arg=None):
  """One budget point of the study (see the module docstring for `arg`)."""
  a = common.parse_arg(arg, bp=0, n=0, budget=0.0, smoke=False)
  return with_critic(easy_n_vs_m.get_config(arg), smoke=a.smoke)


def with_critic(c, *, smoke):
  """An n-vs-M study's config `c` made App. F's PPO sweep; returns `c`."""
  c.rl.adv_estimator = "gae"
  # 10x the policy's base rate at B = 1024, as verl's PPO examples (critic 1e-5,
  # actor 1e-6); the tiny model's: 10x its policy anchor (common.TINY_LR_BASE).
  c.critic.lr_base = 2e-4 if smoke else 1e-5
  c.sweep.study = "ppo_n_sweep"
  c.sweep.n_values = SMOKE_N_VALUES if smoke else APP_F_N_VALUES
  return c
