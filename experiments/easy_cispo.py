r"""Easy split, CISPO: the n-sweep of App. F (Fig. 25, right).

The same n-vs-M protocol as experiments/easy_n_vs_m.py (Bp, group baseline,
recipe, sampling, lengths, compute in rollouts) with MiniMax-M1's CISPO loss,
-sg(min(r, 1 + clip_high)) * A * log pi (config.rl.kind = "cispo").

isojax takes one on-policy update per batch, so the ratio r is 1 and no clip
binds: CISPO's gradient then equals PPO-clip's (isojax.rl.losses), and this
study differs from easy_n_vs_m at the same seed only by float rounding. The
two objectives part where the policy that sampled a batch lags the one trained
(an asynchronous sampler, several updates per batch).

Run one budget point from the repo root (any field overridable):

  python -m isojax.main --config=experiments/easy_cispo.py:bp=32,n=64,budget=2e6 --workdir=runs/easy_cispo/bp32_n64

Laptop scale (tiny base model, B_max 256, 2048 rollouts, CPU learning rate):

  python -m isojax.main --config=experiments/easy_cispo.py:smoke --workdir=/tmp/isojax/easy_cispo

Args: bp, n, budget (rollouts), smoke; a key left out takes the study's default.
The paper's model and data flags are those of experiments/easy_n_vs_m.py.
"""

from experiments import common, easy_n_vs_m, easy_ppo


def get_config(arg=None):
  """One budget point of the study (see the module docstring for `arg`)."""
  a = common.parse_arg(arg, bp=0, n=0, budget=0.0, smoke=False)
  c = easy_n_vs_m.get_config(arg)
  c.rl.kind = "cispo"
  c.sweep.study = "cispo_n_sweep"
  # The group baseline needs n >= 2, so the smoke grid starts there.
  c.sweep.n_values = (easy_ppo.SMOKE_N_VALUES[1:] if a.smoke
                      else easy_ppo.APP_F_N_VALUES)
  return c
