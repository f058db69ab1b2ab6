r"""Hard split (base-model avg@16 in [0, 0.0625]): n vs M at fixed Bp: parallel rollouts against sequential updates (§4.1, Fig. 6, App. B).

Run one budget point from the repo root (any field overridable, e.g.
--config.rl.kl_coef=0):

  python -m isojax.main --config=experiments/hard_n_vs_m.py:bp=32,n=64,budget=2e6 --workdir=runs/hard_n_vs_m/bp32_n64

Laptop scale (tiny base model, B_max 256, 2048 rollouts, CPU learning rate):

  python -m isojax.main --config=experiments/hard_n_vs_m.py:smoke --workdir=/tmp/isojax/hard_n_vs_m

Args: bp, n, budget (rollouts), smoke.
Sweep grid (config.sweep, for launch/): n in 8..2048 at fixed Bp = 32 (other
fixed Bp: pass bp=), M = floor(budget / (Bp*n)).

Recipe (IsoCompute playbook Table 1, App. A): GRPO with truncated importance
sampling, KL + entropy regularisation OFF (on hard sets they drive entropy and
length explosion), no zero-variance filter, sqrt(B) learning rate with eta_base
= 1e-6 at B = 1024, temperature 0.6, top-p 1.0, B_max = 16,384.

The built-in default is the synthetic task with the committed tiny base model.
The paper's setting is Qwen2.5-7B-Instruct on the Guru-Math hard split:
  --config.model.path=/ckpt/Qwen2.5-7B-Instruct --config.sampler.backend=vllm
  --config.data.train=/data/guru_hard_train.jsonl
  --config.data.val=/data/guru_hard_val.jsonl --config.data.chat_template=True
  --config.data.reward=math
(sampler.max_tokens is 0, "the study's length": 8 tokens on the tiny model,
the paper's 8,192 once model.path names a real model; set it to override.)
"""

from experiments import common


def get_config(arg=None):
  return common.study_config("hard", "n_vs_m", arg)
