"""The run: trains one budget point (Bp, n, M) and leaves a run directory.

    sample Bp problems -> n rollouts each -> rewards -> Batch -> step (advantages,
    loss, update inside) -> weight sync -> ledger -> [eval] -> metrics -> [checkpoint]

`plan_run(config)` validates everything that can be checked without work (the
budget point above all: an infeasible point fails here, naming its numbers); `run`
then opens the run (builds the parts, resumes from the last checkpoint) and loops
until M updates are done. The workdir (layout: `isojax.rundir`) holds

    config.json     the resolved config, with the derived budget point
    metrics.jsonl   one line per step (step 0: the base model's eval)
    tensorboard/    the same scalars, plus pass@1 histograms
    checkpoints/    orbax steps: train state + `HostState` (data position, ledger, RNG)
    DONE            written last; a finished run is not rerun

Stale batches: with config.rl.off_policy_k = k > 1 (PPO-off-policy-k) the loop
samples k batches with one policy, then runs k updates, one per batch
(`isojax.run_batches`); the step takes its ratios against the sampler's
log-probs. The last group of the M updates is shorter when k does not divide M.
A checkpoint falls due as usual but is written at the end of its group, so a
resumed run restarts at a group boundary with no batch pending.

Determinism: the samples of step s are drawn with a seed derived from (seed, s)
alone via `jax.random.fold_in`, evals with fixed per-run seeds, and the data
order comes from (seed, epoch) and the problems retired as solved before the
epoch (checkpointed with the position); nothing depends on process history. A run
restarted from its checkpoint at step k therefore redoes
steps k+1.. exactly as the uninterrupted run did (bitwise on CPU), and
metrics.jsonl is cut back to step k first so it ends up identical, but for its
device_hours column, a wall-clock measurement.
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
import tqdm
from absl import logging

from isojax import assets, rundir, run_setup
from isojax import budget as budget_lib
from isojax import evaluate as ev
from isojax import metrics as metrics_lib
from isojax.checkpoint import HostState
from isojax.data.loader import check_retire_threshold
from isojax.data.problem_sets import check_data_config, metric_prefix
from isojax.errors import disk_full_as
from isojax.models.tokenizer import Tokenizer
from isojax.rl import LossConfig, OptimConfig, learning_rate
from isojax.rl.advantages import ESTIMATORS, min_group_size
from isojax.rl.value import VALUE_ESTIMATORS, ValueConfig
from isojax.rollout.interruption import interruption_from_config
from isojax.rundir import CONFIG_FILE, DONE_FILE, METRICS_FILE
from isojax.run_batches import (TRAIN_EVAL, VAL, VAL_EXTRA, NonFiniteLossError,
                                SampledBatch, derive_seed, lag_metrics, sample_group)
from isojax.run_setup import (OpenRun, RunParts, check_same_config, model_of,
                              nonfinite_step_message, open_run, run_key, write_json)


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
  # The estimator's baseline is taken over the n_est sampled rollouts when set.
  check_min_n(per, config.rl.adv_estimator)
  for name in ("eval_every", "checkpoint_every", "keep_checkpoints",
               "max_consecutive_skips"):
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
  if off_policy_k == 1:
    loss.check_on_policy(name="config.rl")  # clip settings would be silent no-ops
  optim = OptimConfig(
      lr_base=rl.lr_base, batch_base=rl.batch_base, lr_rule=rl.lr_rule,
      warmup_steps=rl.warmup_steps, weight_decay=rl.weight_decay,
      max_grad_norm=rl.max_grad_norm)
  micro = rl.micro_batch or point.batch
  if rl.logits_chunk is not None and rl.logits_chunk < 1:
    raise ValueError(f"config.rl.logits_chunk={rl.logits_chunk} must be >= 1 (sequence "
                     f"positions per lm-head chunk) or None (all at once)")
  if point.batch % micro:
    raise ValueError(f"config.rl.micro_batch={micro} does not divide B = Bp*n = "
                     f"{point.batch}")
  value, critic_optim = _critic_plan(config, optim)
  return RunPlan(point=point, loss=loss, optim=optim,
                 lr=learning_rate(optim, point.batch), micro_batch=micro,
                 max_tokens=max_tokens, val_sets=tuple(val_sets), value=value,
                 critic_optim=critic_optim, off_policy_k=off_policy_k)


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


def _critic_plan(config, optim):
  """(ValueConfig, the critic's OptimConfig) from config.critic, or (None, None)."""
  if config.rl.adv_estimator not in VALUE_ESTIMATORS:
    return None, None
  c = config.critic
  value = ValueConfig(gamma=c.gamma, lam=c.lam, whiten=c.whiten,
                      cliprange_value=c.cliprange_value,
                      value_coef=c.value_coef, critic_warmup=c.warmup_steps)
  return value, dataclasses.replace(optim, lr_base=c.lr_base)


def check_min_n(n: int, estimator: str) -> None:
  """Raises ValueError when n rollouts per problem are too few for the estimator."""
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


def evaluate_step(parts: RunParts, config) -> tuple[dict, np.ndarray | None]:
  """Validation avg/best/worst@k of every set and the training set's pass@1 histogram.

  The primary set logs val/avg@k etc., set NAME val/NAME/avg@k etc.
  """
  kwargs = dict(k=config.eval.k, temperature=config.eval.temperature,
                max_tokens=parts.max_tokens, top_p=config.sampler.top_p,
                reward_fn=parts.reward_fn, chat_template=config.data.chat_template,
                batch_size=config.eval.batch_problems or None)
  out = {}
  for i, (name, problems) in enumerate(parts.val_sets.items()):
    prefix = metric_prefix(i, name)
    val = ev.evaluate(parts.sampler, problems, parts.tokenizer, prefix=prefix,
                      seed=derive_seed(config.seed, VAL if i == 0 else VAL_EXTRA + i),
                      **kwargs)
    out.update(val.metrics)
    out[f"{prefix}response_len"] = val.mean_response_tokens
  counts = None
  if parts.train_eval_problems:
    tr = ev.evaluate(parts.sampler, parts.train_eval_problems, parts.tokenizer,
                     prefix="train_eval/", seed=derive_seed(config.seed, TRAIN_EVAL),
                     **kwargs)
    counts = tr.counts_P
    out.update(ev.histogram_metrics(counts, config.eval.k, prefix="train/"))
    out["train/pass@1"] = float(np.mean(counts / config.eval.k))
  return out, counts


def update_on(parts: RunParts, state, sampled: SampledBatch, *,
              off_policy_k: int) -> tuple:
  """One update on a sampled batch.

  Returns:
    (state, metrics): the new train state and the step's metrics ("train/...",
    the batch's host metrics and the device's; with off_policy_k > 1 the policy
    lag of its tokens too).
  """
  state, step_metrics = parts.train_step(state, sampled.batch)
  step_metrics = {f"train/{k}": float(v) for k, v in jax.device_get(step_metrics).items()}
  if parts.critic_flops is not None:  # PPO: the critic's cost of this update
    step_metrics["train/critic_flops"] = parts.critic_flops(sampled.batch.attention_mask_BxT)
  if off_policy_k > 1:  # on-policy the lag is always 0: no columns for it
    step_metrics.update(lag_metrics(sampled.version_BxT, updates_done=sampled.step - 1))
  return state, {**sampled.host, **step_metrics}


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
  run_plan = plan_run(config)
  workdir = pathlib.Path(workdir)
  resolved = resolved_config(config, run_plan)
  if rundir.is_done(workdir):
    check_same_config(workdir / CONFIG_FILE, resolved)
    done = json.loads((workdir / DONE_FILE).read_text())
    logging.info("%s: finished at step %d already; not rerunning", workdir, done["step"])
    return done["last"]
  opened = open_run(config, run_plan, workdir, resolved)
  try:
    last = train_loop(opened, config, run_plan.point, off_policy_k=run_plan.off_policy_k)
  finally:
    opened.close()
  if last is None:  # resumed at the last step: nothing was left to do
    last = rundir.read_metrics(workdir / METRICS_FILE).records[-1]
  point = run_plan.point
  if run_setup.writes_run_files():  # on the module: a test stands in for another host
    with disk_full_as(workdir, DONE_FILE):
      write_json(workdir / DONE_FILE, {"step": point.m, "wall_s": time.time() - opened.t0,
                                       "last": last})
  logging.info("done: %s in %.1f s", point.name, time.time() - opened.t0)
  return last


def compute_devices(config, mesh) -> int:
  """Devices a step occupies, for device-hours: the trainer's mesh (every
  process's devices in it) plus a separate vLLM server's
  (config.sampler.server_devices)."""
  return mesh.devices.size + config.sampler.server_devices


def train_loop(opened: OpenRun, config, point: budget_lib.BudgetPoint, *,
               off_policy_k: int = 1) -> dict | None:
  """Runs the updates after the opened run's last step up to M: [sample a group of
  off_policy_k batches], update on the next one, sync weights, count, [eval], write
  metrics, [checkpoint at a group's end].

  Returns:
    the last metrics record written, or None when nothing was left to do.
  """
  parts, writer, ckpt, state = opened.parts, opened.writer, opened.ckpt, opened.state
  last, pending, k = None, [], off_policy_k
  if opened.resumed is None:
    start, ledger, skips = 0, budget_lib.Ledger(), 0
    val, counts = evaluate_step(parts, config)
    last = _write_step(writer, 0, {"rollouts": 0, "tokens": 0, "dropped_rollouts": 0,
                                   "device_hours": 0.0, **val}, counts, config.eval.k)
  else:
    start, ledger = opened.resumed.step, opened.resumed.ledger
    skips = opened.resumed.consecutive_skips
  extra_evals = frozenset(config.eval_steps)
  bar = _progress(point.m, start, point.name)
  devices = compute_devices(config, parts.mesh)
  checkpoint_due = False
  for step in range(start + 1, point.m + 1):
    t_step = time.perf_counter()
    if not pending:  # a group starts: its batches from the current policy, charged now
      pending = sample_group(parts, config, step, min(step + k - 1, point.m))
      for sampled in pending:
        ledger = ledger.add_rollouts(sampled.rollouts, dropped_rollouts=sampled.dropped,
                                     updates=0)
    state, record = update_on(parts, state, pending.pop(0), off_policy_k=k)
    eval_due = step % config.eval_every == 0 or step == point.m or step in extra_evals
    if eval_due or not pending:
      # The sampler next generates for this eval or the next group: it gets these
      # weights now (a group's other updates need no push, which for a vLLM server
      # is a save and reload). The step donated the old arrays, so the sampler gets
      # the new ones even after a skipped update (same values, fresh buffers).
      parts.sampler.update_weights(model_of(parts, state))
    ledger = ledger.add(rollouts=0, tokens=0, updates=1,
                        critic_flops=record.get("train/critic_flops", 0),
                        device_seconds=devices * (time.perf_counter() - t_step))
    skips = skips + 1 if record["train/skipped"] > 0 else 0
    critic = {} if parts.critic_flops is None else {"critic_flops": ledger.critic_flops}
    record = {"rollouts": ledger.rollouts, "tokens": ledger.tokens,
              "dropped_rollouts": ledger.dropped_rollouts,
              "device_hours": ledger.device_hours, **critic, **record,
              "consecutive_skips": skips}
    counts = None
    if eval_due:
      val, counts = evaluate_step(parts, config)
      record.update(val)
    last = _write_step(writer, step, record, counts, config.eval.k)
    bar.update(1)
    bar.set_postfix(reward=f"{record['train/reward']:.3f}")
    if counts is not None:
      logging.info("step %d/%d: train reward %.3f, val avg@%d %.3f (%.0f s)", step,
                   point.m, record["train/reward"], config.eval.k,
                   record[f"val/avg@{config.eval.k}"], time.time() - opened.t0)
    if skips >= config.max_consecutive_skips:
      raise NonFiniteLossError(nonfinite_step_message(
          step, skips, config.max_consecutive_skips, ckpt.latest_step()))
    # Due checkpoints wait for the group's end: no sampled batch is ever pending in one.
    checkpoint_due = checkpoint_due or step % config.checkpoint_every == 0
    if (checkpoint_due and not pending) or step == point.m:
      checkpoint_due = False
      host = HostState(step=step, loader=parts.loader.state_dict(), ledger=ledger,
                       consecutive_skips=skips, rng=tuple(run_key(config)))
      with disk_full_as(ckpt.directory, f"checkpoint {step}"):
        ckpt.save(step, state, host)
  bar.close()
  return last


def _write_step(writer: metrics_lib.MetricsWriter, step: int, record: dict,
                counts: np.ndarray | None, k: int) -> dict:
  """Writes a step's metrics line (and its pass@1 histogram at an eval); returns the
  record. A full disk becomes one message naming the step."""
  with disk_full_as(writer.path, f"the metrics of step {step}"):
    last = writer.write(step, record)
    if counts is not None:
      writer.write_histogram(step, "train/pass@1", counts / k)
  return last


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
  return tqdm.tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True)
