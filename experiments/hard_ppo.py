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
  # The critic's settings and the n grid are easy_ppo's.
  return easy_ppo.with_critic(hard_n_vs_m.get_config(arg), smoke=a.smoke)
