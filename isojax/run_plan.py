"""What a run's config asks for, checked and derived before any work (`plan_run`).

Every check that needs no model, data or device lives here, so that an
infeasible budget point or a bad field fails at once, naming its numbers or the
field; `isojax.main --dry_run` asks the same questions before compiling.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from isojax import assets, run_setup
from isojax import budget as budget_lib
from isojax.data.loader import check_retire_threshold
from isojax.data.problem_sets import check_data_config
from isojax.models.attention import check_implementation
from isojax.models.config import REMAT_POLICIES, as_dtype, as_remat
from isojax.models.tokenizer import Tokenizer
from isojax.rl import LossConfig, OptimConfig, learning_rate
from isojax.rl.advantages import ESTIMATORS, min_group_size
from isojax.rl.value import VALUE_ESTIMATORS, ValueConfig
from isojax.rollout.base import check_sampling
from isojax.rollout.interruption import interruption_from_config


@dataclasses.dataclass(frozen=True)
class RunPlan:
  """What `config` asks for, derived once and frozen (the config is never written).

  Attributes:
    point: the budget point (Bp, n, M) from config.bp, config.n, config.budget
      (and config.rl.n_est: a decoupled baseline samples n_est per problem).
    loss: the isojax.rl LossConfig.
    optim: the isojax.rl OptimConfig.
    lr: the peak learning rate the optimiser's rule gives for B = Bp * n.
    micro_batch: rollouts per gradient-accumulation chunk (B when 0 in config).
    max_tokens: the response-length cap, config.sampler.max_tokens with 0
      resolved (`isojax.budget.study_max_tokens`).
    val_sets: data.val's (name, source) pairs, the primary first.
    value: the critic's isojax.rl ValueConfig when rl.adv_estimator is a
      value estimator ("gae": PPO), else None.
    critic_optim: the critic's OptimConfig (the policy's with config.critic.lr_base),
      or None.
    off_policy_k: batches sampled with one policy, then updated on one by one
      (config.rl.off_policy_k; 1: on-policy).
    max_lag: PipelineRL-k's bound on a trained token's lag
      (config.rl.pipeline.max_lag; 0: the synchronous loop).
    eval_every: config.eval_every, update steps between regular evaluations (0: none).
    eval_steps: the update steps that evaluate besides every eval_every-th and
      the last: config.eval_steps, and with config.evals_per_doubling = k > 0 the
      first to reach each 2^(j/k) rollouts (`BudgetPoint.log_spaced_steps`).
  """
  point: budget_lib.BudgetPoint
  loss: object
  optim: object
  lr: float
  micro_batch: int
  max_tokens: int = budget_lib.SYNTHETIC_MAX_TOKENS
  val_sets: tuple = ()
  value: object = None
  critic_optim: object = None
  off_policy_k: int = 1
  max_lag: int = 0
  eval_every: int = 10
  eval_steps: frozenset = frozenset()

  def eval_due(self, step: int) -> bool:
    """Whether update `step` ends with an evaluation (the last one always does)."""
    return ((self.eval_every > 0 and step % self.eval_every == 0) or step == self.point.m
            or step in self.eval_steps)

  @property
  def stale(self) -> bool:
    """Batches may be sampled by an older policy than the one they update."""
    return self.off_policy_k > 1 or self.max_lag > 0


def plan_run(config) -> RunPlan:
  """Validates `config` and derives the budget point; does no work.

  Raises:
    ValueError: naming the numbers, for an infeasible budget point (Bp * n >
      b_max, or a budget below one batch so that M = 0) or any bad field.
  """
  n_est = config.rl.n_est or None
  per = n_est or config.n
  if n_est is not None and n_est < config.n:
    raise ValueError(f"config.rl.n_est={n_est} must be 0 (off) or >= n={config.n}: the "
                     f"baseline is estimated from n_est rollouts, n of them trained on")
  point = budget_lib.BudgetPoint.feasible(config.budget, bp=config.bp, n=config.n,
                                          n_est=n_est, b_max=config.b_max)
  fixed = config.get("sweep", {}).get("batch") or 0
  if fixed and point.batch != fixed:
    # The file derived bp from its n argument; a flag that moves n or bp alone takes
    # the run off its study's line (its config.json would still claim it).
    raise ValueError(f"config.sweep.batch={fixed} (a fixed-batch study: Bp*n = {fixed}) "
                     f"but Bp*n = {config.bp}*{config.n} = {point.batch}: give n in the "
                     f"experiment file's argument (it sets bp = {fixed} / n), not as "
                     f"--config.n or --config.bp")
  # The estimator's baseline is taken over the n_est sampled rollouts when set.
  check_min_n(per, config.rl.adv_estimator)
  eval_steps = _eval_steps(config, point)
  for name in ("checkpoint_every", "keep_checkpoints", "max_consecutive_skips"):
    if config[name] < 1:
      raise ValueError(f"config.{name}={config[name]} must be >= 1")
  server = config.sampler.server_devices
  if (isinstance(server, bool) or not isinstance(server, int) or server < 0
      or (server and config.sampler.backend != "vllm")):
    raise ValueError(f"config.sampler.server_devices={server!r} must be an int >= 0, and 0 "
                     f"unless sampler.backend is 'vllm' (a vLLM server's accelerators, "
                     f"counted in device-hours)")
  if config.sampler.backend not in ("jax", "vllm"):
    raise ValueError(f"config.sampler.backend={config.sampler.backend!r}; expected "
                     f"'jax' or 'vllm'")
  _check_model_and_sampler_fields(config)
  max_tokens = budget_lib.study_max_tokens(config.sampler.max_tokens, config.model.path)
  interruption_from_config(config.sampler, max_tokens=max_tokens, encode=lambda text: (
      Tokenizer.from_pretrained(run_setup.model_path(config)).encode(text)))
  if config.eval.k < 1:
    raise ValueError(f"config.eval.k={config.eval.k} must be >= 1")
  if config.data.reward not in ("exact", "math"):
    raise ValueError(f"config.data.reward={config.data.reward!r}; expected 'exact' or "
                     f"'math'")
  val_sets = check_data_config(config.data, assets.ASSETS_DIR / "splits")
  if config.data.drop_solved_above:  # 0.0 = off
    check_retire_threshold(config.data.drop_solved_above,
                           name="config.data.drop_solved_above")
  rl = config.rl
  loss = LossConfig.from_config(rl, name="config.rl")
  off_policy_k = check_off_policy_k(rl)
  max_lag = check_max_lag(rl)
  if max_lag and (off_policy_k > 1 or rl.adv_estimator in VALUE_ESTIMATORS):
    raise ValueError(f"config.rl.pipeline.max_lag={max_lag} goes with neither "
                     f"config.rl.off_policy_k={off_policy_k} > 1 nor a critic "
                     f"(rl.adv_estimator={rl.adv_estimator!r}): one way of producing "
                     f"batches per run, and critic-free")
  if off_policy_k == 1 and not max_lag:
    loss.check_on_policy(name="config.rl")  # clip settings would be silent no-ops
  try:
    optim = OptimConfig(
        lr_base=rl.lr_base, batch_base=rl.batch_base, lr_rule=rl.lr_rule,
        warmup_steps=rl.warmup_steps, weight_decay=rl.weight_decay,
        max_grad_norm=rl.max_grad_norm)
  except ValueError as e:  # OptimConfig names itself; the flag is config.rl's
    raise ValueError(str(e).replace("OptimConfig.", "config.rl.")) from None
  micro = rl.micro_batch or point.batch
  if rl.logits_chunk is not None and rl.logits_chunk < 1:
    raise ValueError(f"config.rl.logits_chunk={rl.logits_chunk} must be >= 1 (sequence "
                     f"positions per lm-head chunk) or None (all at once)")
  if point.batch % micro:
    raise ValueError(f"config.rl.micro_batch={micro} does not divide B = Bp*n = "
                     f"{point.batch}")
  value, critic_optim = _critic_plan(config, optim, point.m)
  return RunPlan(point=point, loss=loss, optim=optim,
                 lr=learning_rate(optim, point.batch), micro_batch=micro,
                 max_tokens=max_tokens, val_sets=tuple(val_sets), value=value,
                 critic_optim=critic_optim, off_policy_k=off_policy_k, max_lag=max_lag,
                 eval_every=config.eval_every, eval_steps=eval_steps)


# Seeds, and sizes where 0 means all or off: a negative one would be sliced from
# the end or reach numpy's SeedSequence, which names no field.
COUNT_FIELDS = ("seed", "eval_every", "data.split_seed", "data.num_train",
                "rl.micro_batch", "eval.num_train", "eval.batch_problems")


def _check_model_and_sampler_fields(config) -> None:
  """config.model's dtypes and attention, `COUNT_FIELDS`, the in-process sampler's
  caps (0 = off) and the sampling settings (top-p and top-k off: rollouts are
  trained on), each by name: otherwise they fail later as a bare numpy TypeError,
  or only once the sampler is built, first called or the step traced (after a
  `--dry_run` said the run was fine, and config.json was written)."""
  for field in ("dtype", "param_dtype"):
    try:
      as_dtype(config.model[field])
    except ValueError as e:
      raise ValueError(f"config.model.{field}: {e}") from None
  if np.dtype(as_dtype(config.model.param_dtype)).itemsize < 4:
    # AdamW's steps (about the learning rate, 1e-6 to 1e-5) are far below a 16-bit
    # float's spacing at the weights' scale (bfloat16: ~1e-4 at 0.02): most updates
    # would round back to the old weight while the logged update norm looked fine.
    raise ValueError(f"config.model.param_dtype={config.model.param_dtype!r}: the trained "
                     f"(master) weights must be float32, or AdamW's small steps round "
                     f"away; model.dtype sets the compute dtype (bfloat16 is fine there)")
  try:  # else the model's load refuses it, naming the model's config.json as the culprit
    as_remat(config.model.remat)
  except ValueError:
    raise ValueError(f"config.model.remat={config.model.remat!r}: expected one of "
                     f"{REMAT_POLICIES} (or True/False for full/none)") from None
  try:  # "cudnn" needs a GPU and 16-bit compute; the first update would say so
    if config.model.attention != "auto":  # "auto" always runs (and needs no backend)
      check_implementation(config.model.attention, as_dtype(config.model.dtype))
  except ValueError as e:
    raise ValueError(f"config.model.attention: {e}") from None
  for name in COUNT_FIELDS:
    section, field = name.split(".") if "." in name else (None, name)
    _check_count(name, (config[section] if section else config)[field])
  if config.seed >= 2**32:
    raise ValueError(f"config.seed={config.seed} must be below 2**32: a JAX key keeps a "
                     f"seed's low 32 bits, so it would repeat the run of seed "
                     f"{config.seed % 2**32}")
  for field in ("max_rows", "decode_chunk", "kv_budget_gib"):
    value = config.sampler.get(field, 0)
    if value is not None and value < 0:
      raise ValueError(f"config.sampler.{field}={value} must be >= 0 (0: no cap)")
  # The sampler checks these too, but only at the first generate: after config.json
  # was written, which would then hold the bad value against the corrected command.
  check_sampling(config.sampler.temperature, config.sampler.top_p, config.sampler.top_k,
                 prefix="config.sampler.")
  if config.sampler.top_p < 1 or config.sampler.top_k:
    # The sampler's log-probs are then those of the renormalised nucleus / top-k:
    # pi / mu sits below 1 by the kept mass with no policy change at all.
    raise ValueError(
        f"config.sampler.top_p={config.sampler.top_p}, top_k={config.sampler.top_k}: the "
        f"trainer scores rollouts under the full softmax(logits / temperature), so they "
        f"must be sampled from it; top-p and top-k renormalise over fewer tokens, which "
        f"would bias every importance ratio and TIS weight (set top_p=1.0, top_k=0)")
  check_sampling(config.eval.temperature, prefix="config.eval.")


def _check_count(name: str, value, what: str = "") -> None:
  """A count field (`COUNT_FIELDS`): an int >= 0, else a ValueError naming it."""
  if isinstance(value, bool) or not isinstance(value, int) or value < 0:
    raise ValueError(f"config.{name}={value!r} must be an integer >= 0{what}")


def _eval_steps(config, point) -> frozenset[int]:
  """The steps that evaluate besides every eval_every-th and the last (`RunPlan`),
  with config.eval_steps and evals_per_doubling checked (eval_every is a count field:
  0, no fixed cadence)."""
  check_eval_steps(config.eval_steps, point.m)
  per_doubling = config.get("evals_per_doubling", 0)
  _check_count("evals_per_doubling", per_doubling,
               " (evaluations per doubling of the rollouts spent; 0: off)")
  log_spaced = point.log_spaced_steps(per_doubling) if per_doubling else ()
  return frozenset(config.eval_steps) | frozenset(log_spaced)


def check_eval_steps(eval_steps, m: int) -> None:
  """config.eval_steps: extra evaluation steps, each an int in [1, M]; a step that
  can never come would silently drop an evaluation a study planned on."""
  bad = [s for s in eval_steps
         if isinstance(s, bool) or not isinstance(s, int) or not 1 <= s <= m]
  if isinstance(eval_steps, str) or bad:
    raise ValueError(f"config.eval_steps={tuple(eval_steps)!r}: every entry must be an "
                     f"update step, an int in [1, M={m}]; not {bad or eval_steps!r}")


def check_off_policy_k(rl) -> int:
  """config.rl.off_policy_k (1 when absent), checked; ValueError naming the field."""
  k = rl.get("off_policy_k", 1)
  if isinstance(k, bool) or not isinstance(k, int) or k < 1:
    raise ValueError(f"config.rl.off_policy_k={k!r} must be an integer >= 1 (batches "
                     f"sampled with one policy before it is updated; 1 = on-policy)")
  if k > 1 and rl.adv_estimator in VALUE_ESTIMATORS:
    raise ValueError(f"config.rl.off_policy_k={k} needs a critic-free estimator: the "
                     f"critic's step (rl.adv_estimator={rl.adv_estimator!r}) takes its "
                     f"ratio against the current policy, exact only on-policy")
  return k


def _critic_plan(config, optim, m: int):
  """(ValueConfig, the critic's OptimConfig) from config.critic, or (None, None).

  Refuses, naming the field, what a critic's advantages leave without effect: a
  decoupled baseline's extra rollouts (sampled and billed, never read) and a
  group filter (PPO's step would refuse it only once the run is built); and a
  critic warm-up as long as the run's M updates, which would spend the whole
  budget with the policy frozen.
  """
  rl = config.rl
  if rl.adv_estimator not in VALUE_ESTIMATORS:
    return None, None
  why = (f"with rl.adv_estimator={rl.adv_estimator!r} the critic's values, not a group "
         f"baseline, give the advantages")
  if rl.n_est and rl.n_est > config.n:
    raise ValueError(f"config.rl.n_est={rl.n_est} > n={config.n}: {why}, so the extra "
                     f"rollouts would be sampled and billed but never used; set "
                     f"rl.n_est=0")
  if rl.zero_var_filter != "off":
    raise ValueError(f"config.rl.zero_var_filter={rl.zero_var_filter!r}: {why}; use "
                     f"'off'")
  c = config.critic
  # Checked here: OptimConfig's and ValueConfig's own errors would name the
  # policy's lr_base and a field called critic_warmup.
  if not c.lr_base > 0:
    raise ValueError(f"config.critic.lr_base={c.lr_base} must be > 0 (the critic's "
                     f"learning rate at rl.batch_base rollouts per update)")
  w = c.warmup_steps
  if isinstance(w, bool) or not isinstance(w, int) or not 0 <= w < m:
    raise ValueError(f"config.critic.warmup_steps={w!r} must be an int in [0, M={m}): "
                     f"updates that train the critic only, the policy frozen; at M or "
                     f"more the policy is never updated")
  value = ValueConfig(gamma=c.gamma, lam=c.lam, whiten=c.whiten,
                      cliprange_value=c.cliprange_value,
                      value_coef=c.value_coef, critic_warmup=c.warmup_steps)
  return value, dataclasses.replace(optim, lr_base=c.lr_base)


def check_min_n(n: int, estimator: str) -> None:
  """Raises ValueError when n rollouts per problem are too few for the estimator."""
  if estimator not in ESTIMATORS and estimator not in VALUE_ESTIMATORS:
    raise ValueError(f"config.rl.adv_estimator={estimator!r}; choose from "
                     f"{sorted([*ESTIMATORS, *VALUE_ESTIMATORS])}")
  need = min_group_size(estimator)
  if n < need:
    fits = sorted(k for k in [*ESTIMATORS, *VALUE_ESTIMATORS] if min_group_size(k) <= n)
    raise ValueError(f"n={n} rollouts per problem: config.rl.adv_estimator="
                     f"{estimator!r} needs n >= {need} (below, its per-problem baseline "
                     f"is undefined or is the reward itself, every advantage 0); raise n "
                     f"or use one of {fits}")


def resolved_config(config, run_plan: RunPlan) -> dict:
  """config.json's content: the config plus the derived point (analysis reads it).

  "budget" becomes {"requested", "bp", "n", "m", "batch", "compute"} (and
  "n_est" for a decoupled baseline), and bp, n, m sit at top level too; "lr" is
  the derived peak learning rate and "max_tokens" the response-length cap used.
  """
  out = config.to_dict()
  out["budget"] = {"requested": config.budget, **run_plan.point.to_dict()}
  out["m"] = run_plan.point.m
  out["lr"] = run_plan.lr
  out["max_tokens"] = run_plan.max_tokens
  return json.loads(json.dumps(out))  # tuples -> lists, as a reload would see them


def check_max_lag(rl) -> int:
  """config.rl.pipeline.max_lag (0 when absent), checked; ValueError naming the field."""
  pipeline = rl.get("pipeline")
  k = 0 if pipeline is None else pipeline.get("max_lag", 0)
  if isinstance(k, bool) or not isinstance(k, int) or k < 0:
    raise ValueError(f"config.rl.pipeline.max_lag={k!r} must be an integer >= 0 (the "
                     f"most updates a trained token may lag the policy; 0 = the "
                     f"synchronous loop)")
  return k
