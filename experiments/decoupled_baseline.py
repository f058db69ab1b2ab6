r"""Decoupled baseline (App. G, Fig. 26): is large n's gain a better baseline?

Three settings at a fixed Bp (128 in the paper) on the easy set (App. G names no
split; isojax takes the easy one, whose B_max admits Bp * 256 = 32768):
  large      n = 256 rollouts per problem, baseline and gradient from all 256
  small      n = 64
  decoupled  256 rollouts sampled (config.rl.n_est = 256), the group baseline from
             all of them, 64 picked at random per problem for the gradient
The ledger counts every sampled rollout, so a decoupled point spends
C = Bp * n_est * M and gets M = floor(C / (Bp * n_est)) updates, like `large`.
The paper finds large >> decoupled ~ small: the gain from n is exploration, not
a lower-variance baseline. Run one setting from the repo root:

  python -m isojax.main --config=experiments/decoupled_baseline.py:setting=decoupled,budget=2e6 --workdir=runs/decoupled_baseline/decoupled

Laptop scale (tiny base model, Bp = 8, n = 16 / 4 / 4 of 16):

  python -m isojax.main --config=experiments/decoupled_baseline.py:smoke,setting=decoupled --workdir=/tmp/isojax/decoupled_baseline/decoupled

A setting's runs at several budgets or seeds (one sweep root per setting):

  python launch/sweep.py --config=experiments/decoupled_baseline.py:setting=decoupled --root=runs/decoupled_baseline/decoupled --budget=5e5,2e6

Args: setting (large | small | decoupled), bp, budget, smoke (n is the setting's). The decoupled runs
carry the analysis label data.difficulty = "easy_decoupled" (the others "easy"), so
the analysis never pools a 64-of-256 run with a plain n = 64 one; compare the
settings' reward-vs-rollouts curves (metrics "rollouts" and "val/avg@4").

Study, recipe and lengths: experiments/easy_n_vs_m.py at the setting's n; the paper's
setting is Qwen2.5-7B-Instruct with the flags listed there.
"""

from experiments import common, easy_n_vs_m

# setting -> (n, n_est) at paper scale and at laptop scale.
SETTINGS = {"large": (256, 0), "small": (64, 0), "decoupled": (64, 256)}
SMOKE_SETTINGS = {"large": (16, 0), "small": (4, 0), "decoupled": (4, 16)}
PAPER_BP = 128
SMOKE_BP = 8


def get_config(arg=None):
  """One setting's budget point of the easy n-vs-M study."""
  a, rest = common.split_arg(arg, setting="decoupled", bp=0, n=0, smoke=False)
  settings = SMOKE_SETTINGS if a.smoke else SETTINGS
  if a.setting not in settings:
    raise ValueError(f"setting={a.setting!r}; expected one of {sorted(settings)}")
  n, n_est = settings[a.setting]
  if a.n and a.n != n:  # the sweep launcher passes the setting's own n back
    raise ValueError(f"n={a.n}: setting={a.setting} trains n={n} (n is the setting's)")
  bp = a.bp or (SMOKE_BP if a.smoke else PAPER_BP)
  c = easy_n_vs_m.get_config(",".join(
      [rest, f"bp={bp},n={n}"] + (["smoke"] if a.smoke else [])).strip(","))
  c.rl.n_est = n_est
  c.data.difficulty = "easy_decoupled" if n_est else "easy"
  c.sweep.study = "decoupled_baseline"
  c.sweep.bp_values, c.sweep.n_values = [bp], [n]  # one setting per sweep
  return c
