r"""ScaleRL's leave-one-out ablation (its Fig. 8): the recipe of experiments/scalerl.py
with one component turned back to the common alternative.

drop= names the component; each changes exactly these fields:

  cispo         rl.kind cispo -> ppo_clip (same clips: 0.2 either side)
  prompt_mean   rl.agg prompt_mean -> token_mean
  batch_norm    rl.adv_estimator batch -> grpo (per-prompt normalisation)
  zero_var      rl.zero_var_filter all -> off
  resampling    data.drop_solved_above 0.9 -> 0.0 (solved prompts stay)
  interruption  sampler.interrupt_think_tokens -> 0 (no forced interruption)
  pipeline      rl.pipeline.max_lag 8 -> 0 with rl.off_policy_k 1 -> 8 (PPO-off-policy-8,
                ScaleRL's alternative: 8 batches sampled with one policy, then 8 updates)
  fp32_head     model.lm_head_fp32 True -> False (the head in the trunk's bfloat16)

Each run's config.recipe is
"scalerl_drop_<component>", so the recipe comparison fits one curve per component
beside the recipe's ("scalerl").

Run one ablation from the repo root, with the recipe's model and data flags (see
experiments/scalerl.py):

  python -m isojax.main --config=experiments/scalerl_ablate.py:drop=cispo --workdir=runs/scalerl/drop_cispo \
      --config.model.path=/ckpt/Qwen3-8B --config.sampler.backend=vllm \
      --config.sampler.server_devices=64 --config.data.train=/data/polaris_53k.jsonl \
      --config.data.chat_template=True --config.data.reward=math

Laptop scale (the recipe's smoke point):

  python -m isojax.main --config=experiments/scalerl_ablate.py:drop=pipeline,smoke --workdir=/tmp/isojax/scalerl_drop_pipeline

Args: drop (required), and experiments/scalerl.py's bp, n, budget, smoke.
"""

from experiments import common, scalerl

# Component -> {dotted config field: its value without the component}.
ABLATIONS = {
    "cispo": {"rl.kind": "ppo_clip"},
    "prompt_mean": {"rl.agg": "token_mean"},
    "batch_norm": {"rl.adv_estimator": "grpo"},
    "zero_var": {"rl.zero_var_filter": "off"},
    "resampling": {"data.drop_solved_above": 0.0},
    "interruption": {"sampler.interrupt_think_tokens": 0},
    "pipeline": {"rl.pipeline.max_lag": 0, "rl.off_policy_k": 8},
    "fp32_head": {"model.lm_head_fp32": False},
}


def get_config(arg=None):
  """The recipe without one component (see the module docstring for `arg`).

  Raises:
    ValueError: naming the known components, for a missing or unknown drop=.
  """
  mine, rest = common.split_arg(arg, drop="")
  if mine.drop not in ABLATIONS:
    raise ValueError(f"scalerl_ablate: drop={mine.drop!r} is not a component; "
                     f"known: {sorted(ABLATIONS)}")
  c = scalerl.get_config(rest)
  for dotted, value in ABLATIONS[mine.drop].items():
    *sections, field = dotted.split(".")
    node = c
    for section in sections:
      node = node[section]
    node[field] = value
  c.recipe = f"{scalerl.RECIPE}_drop_{mine.drop}"
  return c
