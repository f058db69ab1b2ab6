r"""ScaleRL's recipe (Khatri et al. 2025), PipelineRL-8 included.

What isojax has of the recipe, each turned on here: PipelineRL-8 (rl.pipeline.max_lag
= 8: sampling runs beside the updates, weights reach generation in flight, no token
trained on is more than 8 updates old), CISPO (rl.kind = "cispo"),
prompt-level loss aggregation (rl.agg = "prompt_mean"), batch-level advantage
normalisation (rl.adv_estimator = "batch"), zero-variance filtering
(rl.zero_var_filter = "all"), no-positive-resampling (data.drop_solved_above =
0.9), forced length interruption (sampler.interrupt_*), and compute in
device-hours (metrics.jsonl's device_hours, ScaleRL's x-axis), and the FP32 lm
head (model.lm_head_fp32) beside a bfloat16 trunk (model.dtype; the smoke point
keeps the tiny model's float32, where the head's precision changes nothing).

The JAX sampler picks up new weights every sampler.decode_chunk = 256 decoded
tokens; a vLLM server at every update.

ScaleRL's numbers, where its summary sets one: G = 16 generations per prompt and a
batch of 768 = 48 prompts x 16 (its base setting; bp=128 gives the 2048 batch that
reaches a higher asymptote more slowly); 14k generated tokens, interrupted at a
thinking budget of 12k (the summary gives 10k-12k; isojax takes one fixed budget,
the answer gets what is left); validation on 1000 held-out prompts every 100
updates. Where it sets none, isojax's: CISPO's cap rl.clip_high = 0.2 (the weight
is min(r, 1.2)), the sqrt learning-rate rule anchored as the paper studies do
(eta = 1e-6 * sqrt(B / 1024)), temperature 0.6, and a budget of 4e6 rollouts
(~5.2k updates at B = 768; ScaleRL budgets in GPU-hours). Its loss lists no KL or
entropy term, so both are off.

The default phrase and length need a real model (the tiny model's digit
vocabulary cannot spell the phrase); run one budget point from the repo root with
ScaleRL's setting (an 8B model on Polaris-53K, 64 generator + 16 trainer GPUs):

  python -m isojax.main --config=experiments/scalerl.py --workdir=runs/scalerl/recipe \
      --config.model.path=/ckpt/Qwen3-8B --config.sampler.backend=vllm \
      --config.sampler.server_devices=64 --config.data.train=/data/polaris_53k.jsonl \
      --config.data.chat_template=True --config.data.reward=math

Laptop scale (tiny base model, interruption phrase "=", 512 rollouts = 16 updates,
weights picked up every 2 tokens, CPU learning rate):

  python -m isojax.main --config=experiments/scalerl.py:smoke --workdir=/tmp/isojax/scalerl

Args: bp, n, budget (rollouts), smoke; a key left out takes the study's default.
The leave-one-out ablations are experiments/scalerl_ablate.py; compare the runs
under runs/scalerl with
  python -m isojax.analysis runs/scalerl --out runs/scalerl/report --compare-recipes --unit device_hours
"""

from experiments import common

RECIPE = "scalerl"  # config.recipe: how isojax.analysis.compare_recipes groups runs
MAX_LAG = 8         # PipelineRL-k's k
DECODE_CHUNK = 256  # tokens between the JAX sampler's weight pick-ups
# ScaleRL's lengths: 14k generated tokens, the thinking budget 12k.
MAX_TOKENS = 14 * 1024
THINK_TOKENS = 12 * 1024
# The tiny model's vocabulary: digits and arithmetic signs; "=" is one token. Its
# study length is 8 tokens: 5 of thinking, the phrase, 2 of answer.
SMOKE_PHRASE = "="
SMOKE_THINK_TOKENS = 5


def get_config(arg=None):
  """One budget point of the recipe (see the module docstring for `arg`)."""
  a = common.parse_arg(arg, bp=0, n=0, budget=0.0, smoke=False)
  c = common.base_config()
  c.recipe = RECIPE
  c.data.train = "synthetic:easy"
  c.data.drop_solved_above = 0.9   # no-positive-resampling
  c.rl.kind = "cispo"
  c.rl.clip_high = 0.2             # CISPO's cap on the weight; binds on stale batches
  c.rl.agg = "prompt_mean"
  c.rl.adv_estimator = "batch"
  c.rl.zero_var_filter = "all"
  c.rl.pipeline.max_lag = MAX_LAG
  c.sampler.decode_chunk = DECODE_CHUNK
  # With stale batches the ratio is taken against the sampler's log-probs, so the
  # sampler/trainer correction is inside CISPO's capped weight; no TIS on top.
  c.rl.tis_cap = None
  c.rl.kl_coef = 0.0
  c.rl.entropy_coef = 0.0
  c.rl.lr_rule, c.rl.lr_base, c.rl.batch_base = "sqrt", 1e-6, 1024
  c.sweep.study = "scalerl"
  if a.smoke:
    common.smoke_scale(c)
    c.b_max = 256
    c.bp, c.n, c.budget = a.bp or 8, a.n or 4, a.budget or 512.0
    c.sampler.max_tokens = 0       # the tiny model's study length, 8
    c.sampler.interrupt_think_tokens = SMOKE_THINK_TOKENS
    c.sampler.interrupt_phrase = SMOKE_PHRASE
    c.sampler.decode_chunk = 2
  else:
    c.bp, c.n, c.budget = a.bp or 48, a.n or 16, a.budget or 4e6
    c.model.dtype = "bfloat16"     # the trunk; the head stays float32
    c.sampler.max_tokens = MAX_TOKENS
    c.sampler.interrupt_think_tokens = THINK_TOKENS  # the phrase: isojax's default
    c.data.num_val = 1000
    c.eval_every, c.evals_per_doubling = 100, 0  # ScaleRL's cadence
  c.sampler.interrupt_answer_tokens = 0  # what max_tokens leaves after think + phrase
  c.sweep.bp_values, c.sweep.n_values, c.sweep.budgets = [c.bp], [c.n], [c.budget]
  return c
