"""Fake run directories with known ground truth, written in the trainer's format.

Rewards follow per-configuration sigmoids written here from the formula (not from
isojax.analysis), plus optional noise: a per-run offset (run-to-run correlation) and
AR(1) noise along the run (checkpoint-to-checkpoint correlation).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np

TOKENS_PER_ROLLOUT = 100


def sigmoid(c, a, b, c_mid, r0):
  """R0 + (A - R0) / (1 + (C_mid / C)^B), from the ScaleRL paper."""
  c = np.asarray(c, dtype=np.float64)
  return r0 + (a - r0) / (1.0 + (c_mid / c) ** b)


# Per-n ground truth for a Bp = 8 sweep: larger n learns slower but reaches higher, so
# the frontier moves from n=4 to n=64 as compute grows (paper Fig. 6).
TRUE_PARAMS = {
    4: dict(a=0.55, b=1.2, c_mid=2.0e3, r0=0.10),
    8: dict(a=0.62, b=1.2, c_mid=5.0e3, r0=0.10),
    16: dict(a=0.68, b=1.2, c_mid=1.3e4, r0=0.10),
    32: dict(a=0.73, b=1.2, c_mid=3.5e4, r0=0.10),
    64: dict(a=0.77, b=1.2, c_mid=1.0e5, r0=0.10),
}


def true_reward(bp, n, c):
  """Ground truth avg@4 of configuration (bp, n) after c rollouts (bp is ignored:
  the paper finds Bp matters little; a small bp effect is added for sensitivity)."""
  p = TRUE_PARAMS[n]
  return sigmoid(c, **p) - 0.002 * math.log2(bp / 8)


def write_run(path, config: dict, rows: list[dict], *, raw_lines=()):
  """A run directory: config.json and metrics.jsonl (+ raw, possibly broken lines)."""
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f)
  with open(os.path.join(path, "metrics.jsonl"), "w") as f:
    for row in rows:
      f.write(json.dumps(row) + "\n")
    for line in raw_lines:
      f.write(line)
  return path


def run_rows(bp, n, m, curve, *, rng=None, noise=0.0, run_sigma=0.0, rho=0.0,
             n_evals=40, hist_bins=0, hist_layout="list", base_eval=False):
  """Metric rows at log-spaced steps up to m; rewards = curve(C) + noise, in [0, 1].

  base_eval: start with the step-0 evaluation the trainer logs (the base model's
  reward, curve(C -> 0)).
  """
  steps = np.unique(np.round(np.geomspace(1, m, n_evals)).astype(int))
  if base_eval:
    steps = np.concatenate([[0], steps])
  c = steps * bp * n
  clean = curve(np.maximum(c, 1e-12))
  offset = rng.normal(0.0, run_sigma) if run_sigma else 0.0
  ar = np.zeros(steps.size)
  for i in range(steps.size):
    eps = rng.normal(0.0, noise) if noise else 0.0
    ar[i] = (rho * ar[i - 1] if i else 0.0) + math.sqrt(1 - rho**2) * eps
  val = np.clip(clean + offset + ar, 0.0, 1.0)
  rows = []
  for s, ci, v in zip(steps, c, val):
    row = {"step": int(s), "rollouts": int(ci), "tokens": int(ci) * TOKENS_PER_ROLLOUT,
           "train/reward": float(v), "val/avg@4": float(v),
           "val/best@4": float(min(1.0, v + 0.15)),
           "val/worst@4": float(max(0.0, v - 0.2))}
    if hist_bins:
      # pass@1 histogram: problems spread around the mean; larger n more uniform
      edges = np.linspace(0, 1, hist_bins + 1)
      conc = 2.0 + 8.0 / math.log2(n + 1)
      counts = np.diff(_beta_cdf(edges, v * conc, (1 - v) * conc)) * 500
      if hist_layout == "list":  # bin counts as one list
        row["train/pass1_hist"] = [int(round(x)) for x in counts]
      else:  # the run loop's flattened fractions, "train/pass@1_hist/<bin start>"
        for lo, x in zip(edges[:-1], counts / counts.sum()):
          row[f"train/pass@1_hist/{lo:.1f}"] = float(x)
      row["train/zero_pass_frac"] = float(counts[0] / max(counts.sum(), 1))
    rows.append(row)
  return rows


def _beta_cdf(x, a, b):
  from scipy import special
  return special.betainc(max(a, 1e-3), max(b, 1e-3), x)


def make_sweep(root, *, configs, budget, curve=true_reward, seeds=(0,), noise=0.0,
               run_sigma=0.0, rho=0.0, n_evals=40, difficulty=None, layout="top",
               rng_seed=0, hist_bins=0, hist_layout="list", base_eval=False):
  """One run per (config, seed); each spends `budget` rollouts (M = budget//(bp n)).

  layout: "top" puts bp/n/m at the top of config.json, "budget" nests them.
  Returns the run directories written.
  """
  rng = np.random.default_rng(rng_seed)
  paths = []
  for bp, n in configs:
    for seed in seeds:
      m = budget // (bp * n)
      budget_cfg = {"bp": bp, "n": n, "m": m, "compute": bp * n * m}
      config = {"seed": seed, "data": {"difficulty": difficulty}}
      config.update(budget_cfg if layout == "top" else {"budget": budget_cfg})
      rows = run_rows(bp, n, m, lambda c: curve(bp, n, c), rng=rng, noise=noise,
                      run_sigma=run_sigma, rho=rho, n_evals=n_evals,
                      hist_bins=hist_bins, hist_layout=hist_layout, base_eval=base_eval)
      name = f"{difficulty or 'mix'}_bp{bp}_n{n}_s{seed}"
      paths.append(write_run(os.path.join(root, name), config, rows))
  return paths


def bp8_configs():
  return [(8, n) for n in sorted(TRUE_PARAMS)]


# Recipes as ScaleRL compares them: "pipeline" and "ppo_off_policy" reach one asymptote
# A at different efficiency B (§3.1: PipelineRL vs PPO-off-policy), "bf16_head" has a
# lower ceiling (§3.2: the LM head's precision moves A). They differ in config fields
# too, and in throughput: rollouts per device-hour.
RECIPES = {
    "pipeline": dict(a=0.61, b=1.6, c_mid=2.0e4, r0=0.10),
    "ppo_off_policy": dict(a=0.61, b=0.8, c_mid=4.0e4, r0=0.10),
    "bf16_head": dict(a=0.52, b=1.6, c_mid=2.0e4, r0=0.10),
}
RECIPE_CONFIG = {
    "pipeline": {"rl": {"max_lag": 8, "head_dtype": "float32"}},
    "ppo_off_policy": {"rl": {"max_lag": 0, "head_dtype": "float32"}},
    "bf16_head": {"rl": {"max_lag": 8, "head_dtype": "bfloat16"}},
}
ROLLOUTS_PER_DEVICE_HOUR = {"pipeline": 4000.0, "ppo_off_policy": 1500.0,
                            "bf16_head": 4000.0}


def make_recipes(root, truths, *, budget, bp=8, n=16, seeds=(0, 1, 2), noise=0.0,
                 run_sigma=0.0, rho=0.0, n_evals=40, rng_seed=0, device_hours=True,
                 recipe_field=True):
  """One run per (recipe, seed), all at one (Bp, n) to `budget` rollouts.

  truths: recipe label -> sigmoid parameters, or a function rollouts -> reward.
  device_hours: log cumulative device-hours, rollouts / ROLLOUTS_PER_DEVICE_HOUR
    (2000 rollouts an hour for a recipe it does not list).
  recipe_field: write the label as config "recipe" (else only RECIPE_CONFIG's fields
    tell the recipes apart). Returns the run directories written.
  """
  rng = np.random.default_rng(rng_seed)
  paths = []
  for label, truth in truths.items():
    curve = truth if callable(truth) else (lambda c, p=truth: sigmoid(c, **p))
    for seed in seeds:
      m = budget // (bp * n)
      config = {"seed": seed, "bp": bp, "n": n, "m": m, "eval_every": 10,
                **RECIPE_CONFIG.get(label, {})}
      if recipe_field:
        config["recipe"] = label
      rows = run_rows(bp, n, m, curve, rng=rng, noise=noise, run_sigma=run_sigma,
                      rho=rho, n_evals=n_evals)
      for row in rows:
        if device_hours:
          row["device_hours"] = row["rollouts"] / ROLLOUTS_PER_DEVICE_HOUR.get(label, 2e3)
      paths.append(write_run(os.path.join(root, f"{label}_s{seed}"), config, rows))
  return paths


def memory_run(bp, n, seed, steps, curve, *, base=None, metric="val/avg@4"):
  """An in-memory `Run` of (bp, n) evaluated at `steps`: metric = curve(rollouts),
  after a step-0 evaluation of `base` when given."""
  from isojax.analysis.runs import Run
  rows = [] if base is None else [{"step": 0, "rollouts": 0.0, metric: float(base)}]
  for s in steps:
    c = float(s * bp * n)
    rows.append({"step": int(s), "rollouts": c, metric: float(curve(c))})
  name = f"bp{bp}_n{n}_s{seed}"
  return Run(name=name, path=f"/fake/{name}", bp=bp, n=n, m=None, difficulty=None,
             seed=seed, config={"budget": {"bp": bp, "n": n}, "seed": seed},
             rows=tuple(rows))


def log_steps(bp, n, c_max, per_doubling=8):
  """Update steps at which a (bp, n) run is evaluated, 8 per doubling of rollouts."""
  steps = sorted({math.ceil(2 ** (j / per_doubling) / (bp * n))
                  for j in range(int(per_doubling * math.log2(c_max)) + 1)})
  return [s for s in steps if s * bp * n <= c_max]


@dataclasses.dataclass(frozen=True)
class PointsRun:
  """A run as `stability.collapsed` reads it: points(metric, unit) -> (compute, value)."""

  compute: list
  reward: list

  def points(self, metric, unit):
    del metric, unit
    return np.asarray(self.compute, float), np.asarray(self.reward, float)
