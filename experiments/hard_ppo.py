r"""Hard split, PPO with a value model: the n-sweep of App. F (Fig. 25, middle).

The same n-vs-M protocol as experiments/hard_n_vs_m.py (Bp, recipe with KL and
entropy off, sampling, lengths, compute in rollouts) with advantages from a
critic: token-level GAE (gamma = lambda = 1), whitened, a clipped value loss, the
critic's trunk a copy of the policy's (config.critic; verl's defaults). On the
hard set most rewards of a small-n batch are 0; a critic still learns from a
prompt whose rollouts all failed, where a group baseline has no signal.

Run one budget point from the repo root (any field overridable):

  python -m isojax.main --config=experiments/hard_ppo.py:bp=32,n=64,budget=2e6 --workdir=runs/hard_ppo/bp32_n64

Laptop scale (tiny base model, B_max 256, 2048 rollouts, CPU learning rates):

  python -m isojax.main --config=experiments/hard_ppo.py:smoke --workdir=/tmp/isojax/hard_ppo

Args: bp, n, budget (rollouts), smoke; a key left out takes the study's default.
n may be 1. The paper's model and data flags are those of
experiments/hard_n_vs_m.py.
"""

from experiments import common, easy_ppo, hard_n_vs_m


def get_config(arg=None):
  """One budget point of the study (see the module docstring for `arg`)."""
  a = common.parse_arg(arg, bp=0, n=0, budget=0.0, smoke=False)
  c = hard_n_vs_m.get_config(arg)
  c.rl.adv_estimator = "gae"
  # 10x the policy's base rate at B = 1024, as verl's PPO examples (critic 1e-5,
  # actor 1e-6); the tiny model's: 10x its policy anchor (common.TINY_LR_BASE).
  c.critic.lr_base = 2e-4 if a.smoke else 1e-5
  c.sweep.study = "ppo_n_sweep"
  c.sweep.n_values = easy_ppo.SMOKE_N_VALUES if a.smoke else easy_ppo.APP_F_N_VALUES
  return c
