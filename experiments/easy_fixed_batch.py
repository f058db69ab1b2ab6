r"""Easy split (base-model avg@16 in [0.3, 0.6]): Bp vs n at fixed B = Bp*n (§4.2, Figs. 9-10, 18-19).

Run one budget point from the repo root (any field overridable, e.g.
--config.rl.kl_coef=0):

  python -m isojax.main --config=experiments/easy_fixed_batch.py:batch=8192,n=64,budget=2e6 --workdir=runs/easy_fixed_batch/b8192_n64

Laptop scale (tiny base model, B_max 256, 2048 rollouts, CPU learning rate):

  python -m isojax.main --config=experiments/easy_fixed_batch.py:smoke --workdir=/tmp/isojax/easy_fixed_batch

Args: bp, n, budget (rollouts), batch (the fixed B; bp = batch / n), smoke.
Sweep grid (config.sweep, for launch/): n in 8..2048 with Bp = B / n at fixed B
in {4096, 8192, 16384}.

Recipe (IsoCompute playbook Table 1, App. A): GRPO with truncated importance
sampling, KL + entropy regularisation ON (entropy collapse is the easy set's
failure mode), no zero-variance filter, sqrt(B) learning rate with eta_base =
1e-6 at B = 1024, temperature 0.6, top-p 1.0, B_max = 65,536.

The built-in default is the synthetic task with the committed tiny base model.
The paper's setting is Qwen2.5-7B-Instruct on the Guru-Math easy split:
  --config.model.path=/ckpt/Qwen2.5-7B-Instruct --config.sampler.backend=vllm
  --config.data.train=/data/guru_easy_train.jsonl
  --config.data.val=/data/guru_easy_val.jsonl --config.data.chat_template=True
  --config.data.reward=math
(sampler.max_tokens is 0, "the study's length": 8 tokens on the tiny model,
the paper's 8,192 once model.path names a real model; set it to override.)
"""

from experiments import common


def get_config(arg=None):
  return common.study_config("easy", "fixed_batch", arg)
