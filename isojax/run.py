"""The run: trains one budget point (Bp, n, M) and leaves a run directory.

    sample Bp problems -> n rollouts each -> rewards -> Batch -> step (advantages,
    loss, update inside) -> weight sync -> ledger -> [eval] -> metrics -> [checkpoint]

`plan(config)` validates everything that can be checked without work (the budget
point above all: an infeasible point fails here, naming its numbers); `run`
then builds the parts and loops until M updates are done. The workdir holds

    config.json     the resolved config, with the derived budget point
    metrics.jsonl   one line per step (step 0: the base model's eval)
    tensorboard/    the same scalars, plus pass@1 histograms
    checkpoints/    orbax steps: train state + data position, ledger, RNG
    DONE            written last; a finished run is not rerun

Determinism: the samples of step s are drawn with a seed derived from (seed, s)
alone via `jax.random.fold_in`, evals with fixed per-run seeds, and the data
order comes from (seed, epoch); nothing depends on process history. A run restarted from its checkpoint at step k therefore redoes
steps k+1.. exactly as the uninterrupted run did (bitwise on CPU), and
metrics.jsonl is cut back to step k first so it ends up identical.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sys
import time

import jax
import numpy as np
from absl import logging

from isojax import budget as budget_lib
from isojax import checkpoint as ckpt_lib
from isojax import files
from isojax import metrics as metrics_lib
from isojax import run_setup
from isojax.errors import IsojaxError, disk_full_as
from isojax.rollout.memory import check_run_split
from isojax.run_setup import RunParts, build_parts, model_of, nonfinite_step_message

CONFIG_FILE = "config.json"
DONE_FILE = "DONE"
CHECKPOINT_DIR = "checkpoints"

# Streams of seed-derived randomness (see `derive_seed`). Validation set i > 0
# (data.val's i-th set) uses stream _VAL_EXTRA + i.
_TRAIN, _VAL, _TRAIN_EVAL, _TRAIN_ROWS, _VAL_EXTRA = 0, 1, 2, 3, 100


class NonFiniteLossError(IsojaxError):
  """Raised when config.max_consecutive_skips updates in a row were non-finite."""


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


def _off_if_zero(x):
  return None if x == 0 else x


def plan(config) -> RunPlan:
  """Validates `config` and derives the budget point; does no work.

  Raises:
    ValueError: naming the numbers, for an infeasible budget point (Bp * n >
      b_max, or a budget below one batch so that M = 0) or any bad field.
  """
  from isojax.rl import LossConfig, OptimConfig, learning_rate  # lazy: JAX import

  from isojax.data.problem_sets import check_data_config

  n_est = config.rl.n_est or None
  per = n_est or config.n
  batch = config.bp * per
  if batch > config.b_max:
    what = "Bp*n" if n_est is None else "Bp*n_est"
    raise ValueError(f"infeasible budget point: {what} = {config.bp}*{per} = {batch} "
                     f"exceeds b_max = {config.b_max} (budget C={config.budget:g})")
  if n_est is not None and n_est < config.n:
    raise ValueError(f"config.rl.n_est={n_est} must be 0 (off) or >= n={config.n}: the "
                     f"baseline is estimated from n_est rollouts, n of them trained on")
  point = budget_lib.BudgetPoint.from_budget(config.budget, bp=config.bp, n=config.n,
                                             n_est=n_est)
  # The estimator's baseline is taken over the n_est sampled rollouts when set.
  check_min_n(per, config.rl.adv_estimator)
  for name in ("eval_every", "checkpoint_every", "keep_checkpoints",
               "max_consecutive_skips"):
    if config[name] < 1:
      raise ValueError(f"config.{name}={config[name]} must be >= 1")
  if config.sampler.backend not in ("jax", "vllm"):
    raise ValueError(f"config.sampler.backend={config.sampler.backend!r}; expected "
                     f"'jax' or 'vllm'")
  max_tokens = budget_lib.study_max_tokens(config.sampler.max_tokens, config.model.path)
  if config.eval.k < 1:
    raise ValueError(f"config.eval.k={config.eval.k} must be >= 1")
  if config.data.reward not in ("exact", "math"):
    raise ValueError(f"config.data.reward={config.data.reward!r}; expected 'exact' or "
                     f"'math'")
  val_sets = check_data_config(config.data, run_setup.ASSETS_DIR / "splits")
  rl = config.rl
  loss = LossConfig(
      kind=rl.kind, clip_low=rl.clip_low, clip_high=rl.clip_high,
      clip_dual=_off_if_zero(rl.clip_dual), agg=rl.agg, tis_cap=_off_if_zero(rl.tis_cap),
      kl_coef=rl.kl_coef, kl_estimator=rl.kl_estimator, entropy_coef=rl.entropy_coef,
      zero_var_filter=rl.zero_var_filter, adv_estimator=rl.adv_estimator,
      adv_std_eps=rl.adv_std_eps)
  optim = OptimConfig(
      lr_base=rl.lr_base, batch_base=rl.batch_base, lr_rule=rl.lr_rule,
      warmup_steps=rl.warmup_steps, weight_decay=rl.weight_decay,
      max_grad_norm=_off_if_zero(rl.max_grad_norm))
  micro = rl.micro_batch or point.batch
  if point.batch % micro:
    raise ValueError(f"config.rl.micro_batch={micro} does not divide B = Bp*n = "
                     f"{point.batch}")
  value, critic_optim = _critic_plan(config, optim)
  return RunPlan(point=point, loss=loss, optim=optim,
                 lr=learning_rate(optim, point.batch), micro_batch=micro,
                 max_tokens=max_tokens, val_sets=tuple(val_sets), value=value,
                 critic_optim=critic_optim)


def _critic_plan(config, optim):
  """(ValueConfig, the critic's OptimConfig) from config.critic, or (None, None)."""
  from isojax.rl.value import VALUE_ESTIMATORS, ValueConfig  # lazy: JAX import

  if config.rl.adv_estimator not in VALUE_ESTIMATORS:
    return None, None
  c = config.critic
  value = ValueConfig(gamma=c.gamma, lam=c.lam, whiten=c.whiten,
                      cliprange_value=_off_if_zero(c.cliprange_value),
                      value_coef=c.value_coef, critic_warmup=c.warmup_steps)
  return value, dataclasses.replace(optim, lr_base=c.lr_base)


def check_min_n(n: int, estimator: str) -> None:
  """Raises ValueError when n rollouts per problem are too few for the estimator."""
  from isojax.rl.advantages import ESTIMATORS, min_group_size  # lazy: JAX import
  from isojax.rl.value import VALUE_ESTIMATORS

  need = min_group_size(estimator)
  if n < need:
    fits = sorted(k for k in [*ESTIMATORS, *VALUE_ESTIMATORS] if min_group_size(k) <= n)
    raise ValueError(f"n={n} rollouts per problem: config.rl.adv_estimator="
                     f"{estimator!r} needs n >= {need} (its per-problem baseline is "
                     f"undefined below); raise n or use one of {fits}")


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


def derive_seed(seed: int, *path: int) -> int:
  """A sampler seed that depends only on `seed` and `path` (jax.random.fold_in).

  Training samples of step s use (seed, TRAIN, s). Each eval stream uses one
  seed for every eval of the run, on purpose: common random numbers, so the
  difference between two evals measures the policy's change rather than fresh
  sampling noise (the analysis's record-breaking points are far less noisy).
  """
  key = jax.random.key(seed)
  for x in path:
    key = jax.random.fold_in(key, x)
  return int(jax.random.randint(key, (), 0, np.iinfo(np.int32).max))


def writes_run_files() -> bool:
  """Whether this process writes config.json, metrics.jsonl and DONE.

  Only the first process of a multi-host run does (orbax coordinates the
  checkpoints itself): every process appending to one metrics.jsonl on a shared
  filesystem would write each line once per host.
  """
  return jax.process_index() == 0


def _write_json(path: pathlib.Path, obj) -> None:
  files.write_atomic(path, json.dumps(obj, indent=1, sort_keys=True) + "\n")


def _check_same_config(path: pathlib.Path, resolved: dict) -> None:
  old, new = _flat(json.loads(path.read_text())), _flat(resolved)
  diff = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
  if diff:
    raise ValueError(f"{path} was written by a run with a different config (differs in "
                     f"{diff[:8]}); use a fresh --workdir or the same config")


def _flat(d: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = json.dumps(v)
  return out


def evaluate_step(parts: RunParts, config) -> tuple[dict, np.ndarray | None]:
  """Validation avg/best/worst@k of every set and the training set's pass@1 histogram.

  The primary set logs val/avg@k etc., set NAME val/NAME/avg@k etc.
  """
  from isojax import evaluate as ev
  from isojax.data.problem_sets import metric_prefix

  kwargs = dict(k=config.eval.k, temperature=config.eval.temperature,
                max_tokens=parts.max_tokens, top_p=config.sampler.top_p,
                reward_fn=parts.reward_fn, chat_template=config.data.chat_template,
                batch_size=config.eval.batch_problems or None)
  out = {}
  for i, (name, problems) in enumerate(parts.val_sets.items()):
    prefix = metric_prefix(i, name)
    val = ev.evaluate(parts.sampler, problems, parts.tokenizer, prefix=prefix,
                      seed=derive_seed(config.seed, _VAL if i == 0 else _VAL_EXTRA + i),
                      **kwargs)
    out.update(val.metrics)
    out[f"{prefix}response_len"] = val.mean_response_tokens
  counts = None
  if parts.train_eval_problems:
    tr = ev.evaluate(parts.sampler, parts.train_eval_problems, parts.tokenizer,
                     prefix="train_eval/", seed=derive_seed(config.seed, _TRAIN_EVAL),
                     **kwargs)
    counts = tr.counts_P
    out.update(ev.histogram_metrics(counts, config.eval.k, prefix="train/"))
    out["train/pass@1"] = float(np.mean(counts / config.eval.k))
  return out, counts


def sample_and_update(parts: RunParts, config, state, step: int):
  """One update: sample, score, pack, step. Returns (state, host metrics, rollouts)."""
  from isojax import batching
  from isojax.evaluate import score_rollouts

  n = config.n
  n_est = config.rl.n_est or n  # rollouts sampled per problem
  problems = parts.loader.next_batch()
  prompt_ids = [parts.prompt_ids[p.id] for p in problems]
  rollouts = parts.sampler.generate(
      prompt_ids, n=n_est, max_tokens=parts.max_tokens,
      temperature=config.sampler.temperature, top_p=config.sampler.top_p,
      top_k=config.sampler.top_k or None, stop_token_ids=parts.stop_token_ids,
      seed=derive_seed(config.seed, _TRAIN, step))
  if not np.all(np.isfinite(rollouts.logprobs_BxT)):
    raise NonFiniteLossError(nonfinite_policy_message(step, config))
  rewards_B = score_rollouts(rollouts, [p.answer for p in problems], n_est,
                             parts.tokenizer, parts.reward_fn)
  sampled, baseline_B = rollouts, None
  if n_est > n:
    # App. G: every sampled reward feeds the baseline; n per problem are trained on.
    rows = batching.train_rows(len(problems), n_est, n,
                               seed=derive_seed(config.seed, _TRAIN_ROWS, step))
    baseline_B, rewards_B = rewards_B, rewards_B[rows]
    rollouts = batching.take_rollouts(rollouts, rows)
  batch = batching.build_batch(prompt_ids, rollouts, rewards_B, n=n,
                               prompt_width=parts.prompt_width,
                               max_tokens=parts.max_tokens, pad_id=parts.pad_id,
                               baseline_rewards_B=baseline_B)
  state, step_metrics = parts.train_step(state, batch)
  step_metrics = {f"train/{k}": float(v) for k, v in jax.device_get(step_metrics).items()}
  if parts.critic_flops is not None:  # PPO: the critic's cost of this update
    step_metrics["train/critic_flops"] = parts.critic_flops(batch.attention_mask_BxT)
  # A group is dropped when its baseline rewards are all equal (the step's rule);
  # every rollout sampled for it was paid for and none trained on.
  base_BpxN = (rewards_B if baseline_B is None else baseline_B).reshape(-1, n_est)
  zero_var_B = np.repeat(np.all(base_BpxN == base_BpxN[:, :1], axis=1), n_est)
  host = {"train/reward": float(np.mean(rewards_B)),
          "train/response_len": float(np.mean(rollouts.lengths_B)),
          "train/truncated_frac": float(np.mean(rollouts.finish_reason_B == "length"))}
  if baseline_B is not None:
    host["train/baseline_reward"] = float(np.mean(baseline_B))
  # Rollouts a filter drops from the loss were still paid for (the ledger says so).
  dropped = int(zero_var_B.sum()) if config.rl.zero_var_filter == "all" else 0
  return state, {**host, **step_metrics}, sampled, dropped


def nonfinite_policy_message(step: int, config) -> str:
  return (f"stopping at step {step}: the sampler's log-probs are not finite, i.e. the "
          f"weights after update {step - 1} give inf/NaN logits although that update "
          f"was finite (config.rl.lr_base={config.rl.lr_base:g} is far too large?). "
          f"Lower config.rl.lr_base (or set config.rl.max_grad_norm) and start again in "
          f"a fresh --workdir: resuming would reload these weights.")


def run(config, workdir: str | os.PathLike) -> dict:
  """Trains the budget point of `config` in `workdir`; resumes or skips if done.

  Returns:
    the last metrics record (that of the final step). With a decoupled baseline
    (config.rl.n_est > n) the ledger, and so "rollouts", counts all n_est
    rollouts sampled per problem, not only the n trained on.

  Raises:
    ValueError: before any work, for an infeasible point or a bad config, and if
      `workdir` holds a run with a different config.
    NonFiniteLossError: after config.max_consecutive_skips non-finite updates in
      a row (the last checkpoint is still clean: NaN is never checkpointed).
  """
  run_plan = plan(config)
  point = run_plan.point
  workdir = pathlib.Path(workdir)
  resolved = resolved_config(config, run_plan)
  if (workdir / DONE_FILE).exists():
    _check_same_config(workdir / CONFIG_FILE, resolved)
    done = json.loads((workdir / DONE_FILE).read_text())
    logging.info("%s: finished at step %d already; not rerunning", workdir, done["step"])
    return done["last"]
  writes_files = writes_run_files()
  workdir.mkdir(parents=True, exist_ok=True)
  if (workdir / CONFIG_FILE).exists():
    _check_same_config(workdir / CONFIG_FILE, resolved)
  logging.info("budget point %s: B=%d, C=%d rollouts, lr=%.3g", point.name, point.batch,
               point.compute, run_plan.lr)

  t0 = time.time()
  parts = build_parts(config, run_plan)
  state = parts.init_state()
  files.check_not_link(workdir / CHECKPOINT_DIR)
  split = check_run_split(config, model_of(parts, state).cfg, state,
                          rollouts=point.bp * (config.rl.n_est or config.n),
                          max_len=parts.prompt_width + parts.max_tokens)
  if split is not None:
    logging.info("memory per device: trainer state %.2f GiB + sampler KV cache %.2f GiB "
                 "(%d rows) of %.2f GiB", split["trainer_gib"], split["kv_gib"],
                 split["rows"], split["device_gib"])
  ckpt = ckpt_lib.RunCheckpointer(workdir / CHECKPOINT_DIR,
                                  max_to_keep=config.keep_checkpoints)
  ledger, skips, start = budget_lib.Ledger(), 0, ckpt.latest_step()
  if start is not None:
    state, host = ckpt.restore(start, state)
    if host["rng"] != ckpt_lib.key_to_host(jax.random.key(config.seed)):
      raise ValueError(f"checkpoint {start} in {workdir} was made with another seed")
    parts.loader.load_state_dict(host["loader"])
    ledger = budget_lib.Ledger.from_state_dict(host["ledger"])
    skips = int(host["consecutive_skips"])
    parts.sampler.update_weights(model_of(parts, state))
    logging.info("resumed from the checkpoint at step %d", start)
  # Only a run that really started (model, data, sampler and state loaded) records
  # its config: a failed start (a bad model path) must not hold its config against
  # the corrected command in the same workdir.
  if writes_files and not (workdir / CONFIG_FILE).exists():
    with disk_full_as(workdir, CONFIG_FILE):
      _write_json(workdir / CONFIG_FILE, resolved)
  writer = metrics_lib.MetricsWriter(workdir, resume_step=start, enabled=writes_files)
  last = None
  try:
    if start is None:
      start = 0
      val, counts = evaluate_step(parts, config)
      with disk_full_as(writer.path, "the metrics of step 0"):
        last = writer.write(0, {"rollouts": 0, "tokens": 0, "dropped_rollouts": 0, **val})
        if counts is not None:
          writer.write_histogram(0, "train/pass@1", counts / config.eval.k)
    extra_evals = frozenset(config.eval_steps)
    bar = _progress(point.m, start, point.name)
    for step in range(start + 1, point.m + 1):
      state, record, rollouts, dropped = sample_and_update(parts, config, state, step)
      # The step donates its input: the sampler must get the new arrays even when
      # the update was skipped (same values, fresh buffers).
      parts.sampler.update_weights(model_of(parts, state))
      ledger = ledger.add_rollouts(rollouts, dropped_rollouts=dropped,
                                   critic_flops=record.get("train/critic_flops", 0))
      skips = skips + 1 if record["train/skipped"] > 0 else 0
      critic = {} if parts.critic_flops is None else {"critic_flops": ledger.critic_flops}
      record = {"rollouts": ledger.rollouts, "tokens": ledger.tokens,
                "dropped_rollouts": ledger.dropped_rollouts, **critic, **record,
                "consecutive_skips": skips}
      counts = None
      if step % config.eval_every == 0 or step == point.m or step in extra_evals:
        val, counts = evaluate_step(parts, config)
        record.update(val)
      with disk_full_as(writer.path, f"the metrics of step {step}"):
        last = writer.write(step, record)
        if counts is not None:
          writer.write_histogram(step, "train/pass@1", counts / config.eval.k)
      bar.update(1)
      bar.set_postfix(reward=f"{record['train/reward']:.3f}")
      if counts is not None:
        logging.info("step %d/%d: train reward %.3f, val avg@%d %.3f (%.0f s)", step,
                     point.m, record["train/reward"], config.eval.k,
                     record[f"val/avg@{config.eval.k}"], time.time() - t0)
      if skips >= config.max_consecutive_skips:
        raise NonFiniteLossError(nonfinite_step_message(
            step, skips, config.max_consecutive_skips, ckpt.latest_step()))
      if step % config.checkpoint_every == 0 or step == point.m:
        with disk_full_as(ckpt.directory, f"checkpoint {step}"):
          ckpt.save(step, state, {
              "step": step, "loader": parts.loader.state_dict(),
              "ledger": ledger.state_dict(), "consecutive_skips": skips,
              "rng": ckpt_lib.key_to_host(jax.random.key(config.seed))})
    bar.close()
  finally:
    _close_all(writer.close, ckpt.close, parts.close)
  if last is None:  # resumed at the last step: nothing was left to do
    last = metrics_lib.read_metrics(workdir / metrics_lib.METRICS_FILE)[-1]
  if writes_files:
    with disk_full_as(workdir, DONE_FILE):
      _write_json(workdir / DONE_FILE, {"step": point.m, "wall_s": time.time() - t0,
                                        "last": last})
  logging.info("done: %s in %.1f s", point.name, time.time() - t0)
  return last


def _close_all(*closes) -> None:
  """Calls every close; while an error propagates (called from `finally`), a close
  that fails too (a full disk) is logged, not raised over the error's cause."""
  failing = sys.exc_info()[0] is not None
  for close in closes:
    try:
      close()
    except Exception as e:  # pylint: disable=broad-except
      if not failing:
        raise
      logging.warning("while stopping after an error, %s failed: %s", close, e)


class _NoBar:
  def update(self, *_):
    pass

  def set_postfix(self, **_):
    pass

  def close(self):
    pass


def _progress(total: int, initial: int, desc: str):
  """A tqdm bar with ETA on an interactive terminal; nothing in logs/pipes."""
  if not sys.stderr.isatty():
    return _NoBar()
  import tqdm
  return tqdm.tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True)
