"""What every experiment file shares: the run schema with the paper's base recipe.

An experiment file calls `base_config()` and fills in its own study: budget point
and grids, B_max, learning-rate rule, regularisers, lengths, data. The run
(isojax/run.py) reads exactly these fields. Derived numbers (M from the budget,
the learning rate from B) are computed by the run into frozen objects and never
written back here.
"""

import ast

import ml_collections

from isojax import budget
from isojax.rollout import interruption

# The committed tiny base model (isojax/assets/base_model) was stopped early,
# while sharp: Adam steps above ~3e-5 made GRPO collapse on it. CPU configs
# anchor the sqrt rule at 2e-5 for B = 32 (4e-5 at B = 128, still stable over
# the tests' runs).
TINY_LR_BASE = 2e-5
TINY_B_BASE = 32


def parse_arg(arg: str | None, **defaults) -> ml_collections.ConfigDict:
  """Parses "bp=32,n=64,budget=2e6,smoke" into a ConfigDict over `defaults`.

  A bare word sets a boolean switch to True. Values are Python literals where
  they parse as one (2e6 -> 2000000.0) and strings otherwise. Unknown keys are an
  error naming the key and the known ones, so a typo never silently runs the
  default.
  """
  out = ml_collections.ConfigDict(dict(defaults))
  for item in filter(None, (s.strip() for s in (arg or "").split(","))):
    key, sep, raw = item.partition("=")
    key = key.strip()
    if key not in defaults:
      raise ValueError(f"unknown config argument {key!r} in {arg!r}; known: "
                       f"{sorted(defaults)}")
    if not sep:
      value = True
    else:
      try:
        value = ast.literal_eval(raw.strip())
      except (ValueError, SyntaxError):
        value = raw.strip()
    if isinstance(defaults[key], float) and isinstance(value, int):
      value = float(value)
    if defaults[key] is not None and not isinstance(value, type(defaults[key])):
      raise ValueError(f"config argument {key}={raw!r}: expected "
                       f"{type(defaults[key]).__name__}, got {type(value).__name__}")
    out[key] = value
  return out


def split_arg(arg: str | None, **extra) -> tuple[ml_collections.ConfigDict, str]:
  """Parses the keys of `extra` out of `arg`; returns them and the rest of `arg`.

  For a file that builds on another study file and adds arguments to its:
  "mix=tri,n=8,smoke" with extra mix="hard" gives ({mix: "tri"}, "n=8,smoke").
  """
  mine, rest = [], []
  for item in filter(None, (s.strip() for s in (arg or "").split(","))):
    (mine if item.partition("=")[0].strip() in extra else rest).append(item)
  return parse_arg(",".join(mine), **extra), ",".join(rest)


def base_config() -> ml_collections.ConfigDict:
  """The full run schema with the paper's defaults (the easy-set recipe).

  A field added here needs an entry in `isojax.run_config.ADDED_FIELDS`: the value
  that does what isojax did without it, so that runs started before it resume
  (tests/test_run_config.py fails until it has one).
  """
  c = ml_collections.ConfigDict()
  c.seed = 0

  # The budget point: C = bp * n * m rollouts, m = floor(budget / (bp * n)).
  c.bp = 32
  c.n = 16
  c.budget = 2e5          # rollouts (float so `budget=2e6` parses)
  c.b_max = 65_536        # largest feasible batch bp * n (memory bound)

  # Validation evals come after the first update to reach each 2^(j/8) rollouts
  # (8 per doubling of compute, `BudgetPoint.log_spaced_steps`) and at the end, so
  # runs of every (Bp, n, M) are observed at the same compute values, evenly in log
  # compute, as the frontier and n*(C) fits read them. A fixed cadence would not: at
  # C = 2e6 and Bp = 32, every 10 updates gives n = 2048 (M = 30) three evals (its
  # curve then rests on R0 fixed to the base reward) and n = 8 (M = 7812) 782, whose
  # noise the record-breaking points pick upwards, and whose validation rollouts
  # alone cost 47 % of C again (87 % with the pass@1 histogram's).
  c.eval_every = 0        # update steps between evals (0: only the ones below)
  c.evals_per_doubling = 8
  c.eval_steps = ()       # extra eval steps
  c.checkpoint_every = 10  # update steps between checkpoints (and at the end)
  c.keep_checkpoints = 2
  # A non-finite loss/gradient skips the update (state unchanged); this many
  # skips in a row stop the run: the state will not recover by itself.
  c.max_consecutive_skips = 5

  c.model = ml_collections.ConfigDict()
  c.model.path = ""       # HF directory; "" = the committed tiny base model
  c.model.dtype = "float32"        # activations
  c.model.param_dtype = "float32"  # master weights
  c.model.remat = "none"   # per-layer remat: none | full | dots | attention (True/False too)
  c.model.attention = "auto"  # "auto" (cudnn on GPU, else xla) | "xla" | "cudnn"
  # The lm head (logits, log-probs, entropies) in float32 whatever model.dtype:
  # ScaleRL's precision fix, which matters once the trunk computes in bfloat16.
  c.model.lm_head_fp32 = True

  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = 1
  c.mesh.fsdp = -1        # -1: all remaining devices
  c.mesh.tensor = 1

  c.data = ml_collections.ConfigDict()
  # "synthetic" (generated), "synthetic:NAME" (a committed difficulty split of
  # the synthetic task, isojax/assets/splits/NAME.jsonl), "mix:NAME:W,NAME:W"
  # (a mixture of those splits, §5.3) or a JSONL/Parquet/`datasets` path with
  # prompt and answer fields (isojax/data/problem_sets.py has the forms).
  c.data.train = "synthetic:easy"
  # Where a path's records hold the prompt and the answer (dotted paths reach nested
  # fields: "reward_model.ground_truth" in veRL's parquet), read the same way from
  # every path of data.train and data.val; the split of a `datasets` directory that
  # holds several ("" where it holds one).
  c.data.prompt_field = "prompt"
  c.data.answer_field = "answer"
  c.data.dataset_split = ""
  # "" = hold num_val out of data.train; a path; or named sets
  # "NAME=SOURCE,NAME=SOURCE" (the first is primary and logs val/avg@k, the
  # others val/NAME/avg@k; SOURCE: heldout | synthetic:NAME | a path).
  c.data.val = ""
  c.data.num_val = 300             # problems per held-out / split val set (paper: 300)
  # Training problems: a seeded subsample of data.train (data.split_seed), the
  # size of a mixture, or the count generated for "synthetic" (0 there: 4096);
  # 0 = all of the source (§5.2 varies it: 6k vs 500).
  c.data.num_train = 0
  c.data.split_seed = 0            # fixes val/train split for every run of a sweep
  c.data.chat_template = False     # wrap prompts with the tokenizer's chat template
  c.data.reward = "exact"          # "exact" (synthetic) | "math" (math-verify)
  # A prompt that leaves no room for max_tokens in the model's context fails the
  # run at load time (naming it); True leaves such problems out, counted in the log.
  c.data.drop_too_long = False
  # ScaleRL's no-positive-resampling: a problem whose latest group pass rate (share
  # of its sampled rollouts that are correct) is at or above this, in (0, 1],
  # leaves the later epochs for good (its rollouts are still charged); 0.0 = off.
  c.data.drop_solved_above = 0.0

  c.sampler = ml_collections.ConfigDict()
  c.sampler.backend = "jax"        # "jax" (in-process) | "vllm" (server)
  c.sampler.temperature = 0.6
  # Off, as the trainer requires: it scores rollouts under the full softmax.
  c.sampler.top_p = 1.0
  c.sampler.top_k = 0              # 0 = off
  # Response-length cap; 0 = the study's length: 8 for the synthetic task on the
  # committed tiny model (model.path ""), the paper's 8,192 when model.path names
  # a real model (isojax.budget.study_max_tokens). Any value > 0 overrides it.
  c.sampler.max_tokens = 0
  # Forced length interruption (ScaleRL, isojax.rollout.interruption): a rollout
  # that reaches interrupt_think_tokens gets interrupt_phrase appended (read, not
  # trained on) and up to interrupt_answer_tokens more. 0 = off.
  c.sampler.interrupt_think_tokens = 0
  # The answer budget after the phrase; 0 = what max_tokens leaves after the
  # thinking budget and the phrase (the three must fit in max_tokens).
  c.sampler.interrupt_answer_tokens = 0
  # The end-of-thinking phrase; it must tokenise to at least one token. It is
  # appended as is: for a model whose chat template thinks inside tags, end it
  # with the closing tag (e.g. "... final answer now.\n</think>\n\n") so the
  # answer budget is spent answering.
  c.sampler.interrupt_phrase = interruption.DEFAULT_PHRASE
  # In-process sampler on the trainer's accelerator: its KV-cache share. It decodes
  # at most max_rows rollouts at once (0 = all of a batch), fewer if the rows of
  # prompt + max_tokens positions do not fit in kv_budget_gib (0 = no budget; a
  # call's whole cache, over the devices its rows are split across); finished rows
  # are refilled. The run checks trainer + cache <= one device's memory.
  c.sampler.max_rows = 0
  c.sampler.kv_budget_gib = 0.0
  # At most this many tokens per jitted decode call (0 = no cap): with
  # rl.pipeline.max_lag > 0 new weights reach generation in flight between calls.
  c.sampler.decode_chunk = 0
  c.sampler.vllm_url = "http://127.0.0.1:8000"
  # Where the weight snapshots pushed to the server go; the server must read
  # them under the same path. "" = a temp dir on this host, removed at the end.
  c.sampler.vllm_weights_dir = ""
  # Bounded waits on the server: TCP connect, the first answer at start-up (a
  # server that accepts but never answers fails this fast), each later request.
  c.sampler.vllm_connect_timeout_s = 5.0
  c.sampler.vllm_probe_timeout_s = 30.0
  c.sampler.vllm_request_timeout_s = 600.0
  # Accelerators of a separate vLLM server: device-hours (metrics.jsonl's
  # device_hours, ScaleRL's compute axis) count them beside the trainer's.
  c.sampler.server_devices = 0

  # Field names are those of isojax.rl LossConfig / OptimConfig. clip_dual,
  # tis_cap and max_grad_norm are float fields that may hold None (off), declared
  # with their type so that flags can set both: --config.rl.clip_dual=3 turns one
  # on, --config.rl.tis_cap=None turns one off.
  c.rl = ml_collections.ConfigDict()
  c.rl.adv_estimator = "grpo"      # grpo | drgrpo | batch | rloo | gae (PPO: the critic below)
  c.rl.adv_std_eps = 1e-6
  c.rl.kind = "ppo_clip"           # ppo_clip | cispo | cispo_two_sided | gspo
  # The clips act on pi/pi_old, exactly 1 with one on-policy update per batch:
  # a run refuses other values unless updates reuse stale batches (off_policy_k,
  # pipeline.max_lag).
  c.rl.clip_low = 0.2
  c.rl.clip_high = 0.2             # also CISPO's weight cap
  c.rl.clip_dual = ml_collections.config_dict.placeholder(float)
  c.rl.agg = "token_mean"
  # Truncated IS (App. A uses TIS but gives no cap; 2 is Yao et al.'s C).
  c.rl.tis_cap = ml_collections.FieldReference(2.0, field_type=float)
  c.rl.kl_coef = 1e-3              # Table 1: each study file sets its split's value
  c.rl.kl_estimator = "k3"
  c.rl.entropy_coef = 1e-3
  c.rl.zero_var_filter = "off"     # off | all | regularizers (Table 1: off)
  c.rl.lr_rule = "sqrt"            # eta = lr_base * sqrt(B / batch_base) (§3, Fig. 4)
  c.rl.lr_base = 1e-6
  c.rl.batch_base = 1024
  c.rl.warmup_steps = 10           # App. A: 10-step linear warmup, then constant
  c.rl.weight_decay = 0.01
  c.rl.max_grad_norm = ml_collections.FieldReference(1.0, field_type=float)  # None = off
  c.rl.micro_batch = 0             # rollouts per gradient-accumulation chunk; 0 = all
  # Sequence positions per lm-head chunk, over every row of a micro-batch (None:
  # all at once). A chunk's logits are recomputed in the backward pass, so the
  # micro-batch's [rows * T, V] float32 logits never exist: at scale (V ~ 150k)
  # set e.g. 512.
  c.rl.logits_chunk = ml_collections.config_dict.placeholder(int)
  # Decoupled baseline (App. G): sample n_est > n rollouts per problem, estimate
  # the baseline from all of them, train on n; the ledger charges n_est, so
  # M = floor(budget / (bp * n_est)). 0 = off (n_est = n).
  c.rl.n_est = 0
  # PPO-off-policy-k (ScaleRL's baseline): sample k batches with one policy, then
  # k updates, one per batch (2..k on stale batches); ratios are then taken
  # against the sampler's log-probs and the clips above bind. 1 = on-policy.
  c.rl.off_policy_k = 1
  # PipelineRL-k (ScaleRL's choice): a thread samples while updates run, every
  # update's weights reach generation in flight, and a batch is trained on only
  # if its oldest token was sampled at most max_lag updates ago; ratios are
  # against the sampler's log-probs. 0 = the synchronous loop.
  c.rl.pipeline = ml_collections.ConfigDict()
  c.rl.pipeline.max_lag = 0

  # The value model of PPO, read only when rl.adv_estimator = "gae" (isojax.rl.ppo).
  # Defaults are verl's. The critic's forward/backward FLOPs go to the ledger's
  # critic_flops column; rollouts stay the compute unit.
  c.critic = ml_collections.ConfigDict()
  c.critic.path = ""             # HF directory of its trunk; "" = a copy of the policy's weights
  # Its own AdamW's rate at rl.batch_base, scaled with B by rl.lr_rule like the
  # policy's (verl: critic 1e-5 beside actor 1e-6); the other AdamW fields are rl's.
  c.critic.lr_base = 1e-5
  c.critic.warmup_steps = 0      # first updates train the critic only, the policy frozen
  c.critic.gamma = 1.0           # GAE discount
  c.critic.lam = 1.0             # GAE lambda (1: Monte Carlo return minus the value)
  c.critic.whiten = True         # whiten the advantages over the batch's trained tokens
  # New value clipped to old +- this in the loss; None (or inf) = off.
  c.critic.cliprange_value = ml_collections.FieldReference(0.5, field_type=float)
  # Weight of the value loss; with the critic's own Adam it acts only through
  # gradient-norm clipping and eps.
  c.critic.value_coef = 1.0

  c.eval = ml_collections.ConfigDict()
  c.eval.k = 4                     # samples per validation problem (avg@4/best@4/worst@4)
  c.eval.temperature = 0.6
  c.eval.num_train = 256           # training problems for the pass@1 histogram; 0 = off
  c.eval.batch_problems = 0        # problems per generate call; 0 = all at once

  # Static description of the sweep this config belongs to, for launch/ and the
  # analysis; the run itself only reads bp, n and budget.
  c.sweep = ml_collections.ConfigDict()
  c.sweep.study = ""
  # The problem split ("easy", "hard"): the analysis draws one frontier per split
  # (a study's data.difficulty label, where set, takes its place).
  c.sweep.split = ""
  c.sweep.bp_values = list(budget.PAPER_BP_VALUES)
  c.sweep.n_values = list(budget.PAPER_N_VALUES)
  c.sweep.budgets = [2e5]
  c.sweep.batch = 0  # the fixed B of a fixed_batch study
  return c


def smoke_scale(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Shrinks `c` to the committed tiny base model on one CPU (a study's `smoke`).

  Sets what every study shrinks alike (validation and histogram sizes, eval and
  checkpoint cadence, one device, the tiny model's learning-rate anchor); the
  study file sets its own small grid, B_max and budget. Returns `c`.
  """
  c.data.num_val = 64
  c.eval.num_train = 64
  c.eval_every, c.evals_per_doubling = 4, 0
  c.checkpoint_every = 8
  c.mesh.fsdp = 1
  c.rl.lr_base = TINY_LR_BASE
  c.rl.batch_base = TINY_B_BASE
  c.rl.warmup_steps = 2
  return c


def fix_batch(c: ml_collections.ConfigDict, batch: int, bp: int = 0,
              bp_values=None) -> ml_collections.ConfigDict:
  """Makes `c` a point of a fixed-batch study (§4.2): B = Bp * n = `batch`.

  Sets c.bp = batch / c.n and records B in c.sweep.batch: the sweep launcher runs
  only the pairs on the line Bp * n = B. c.sweep.n_values keeps the grid's n
  whose Bp = B / n is whole and, when `bp_values` is given, among them (the
  study's Bp range); c.sweep.bp_values holds those Bp. Returns `c`.

  Raises:
    ValueError: naming the numbers, if c.n does not divide `batch`, or if a given
      `bp` (nonzero) disagrees with it.
  """
  if batch % c.n or (bp and bp * c.n != batch):
    raise ValueError(f"fixed_batch study: batch={batch} must equal bp*n with n={c.n}"
                     + (f", bp={bp}" if bp else ""))
  c.sweep.batch = batch
  c.bp = batch // c.n
  c.sweep.n_values = [n for n in c.sweep.n_values if batch % n == 0 and (
      bp_values is None or batch // n in bp_values)]
  c.sweep.bp_values = [batch // n for n in c.sweep.n_values]
  return c
