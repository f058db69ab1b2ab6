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

Determinism: the samples of step s are drawn with a seed derived from (seed, s)
alone via `jax.random.fold_in`, evals with fixed per-run seeds, and the data
order comes from (seed, epoch) and the problems retired as solved before the
epoch (checkpointed with the position); nothing depends on process history. A run
restarted from its checkpoint at step k therefore redoes
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
import tqdm
from absl import logging

from isojax import assets, batching, rundir, run_setup
from isojax import budget as budget_lib
from isojax import evaluate as ev
from isojax import metrics as metrics_lib
from isojax.checkpoint import HostState
from isojax.data.loader import check_retire_threshold, group_pass_rates
from isojax.data.problem_sets import check_data_config, metric_prefix
from isojax.errors import IsojaxError, disk_full_as
from isojax.evaluate import score_rollouts
from isojax.models.tokenizer import Tokenizer
from isojax.rl import LossConfig, OptimConfig, learning_rate
from isojax.rl.advantages import ESTIMATORS, min_group_size
from isojax.rl.value import VALUE_ESTIMATORS, ValueConfig
from isojax.rollout.interruption import interruption_from_config
from isojax.rundir import CONFIG_FILE, DONE_FILE, METRICS_FILE
from isojax.run_setup import (OpenRun, RunParts, check_same_config, model_of,
                              nonfinite_step_message, open_run, run_key, write_json)

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
  if config.sampler.server_devices < 0:
    raise ValueError(f"config.sampler.server_devices={config.sampler.server_devices} "
                     f"must be >= 0 (a vLLM server's accelerators, for device-hours)")
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
                 critic_optim=critic_optim)


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
  """One update: sample, score, pack, step.

  Returns:
    (state, metrics, rollouts, dropped): the new train state; the step's metrics
    ("train/...", the device's and the host's); every rollout sampled, also those
    only the baseline saw (the ledger pays for all); and how many of them a
    filter dropped from the loss.
  """
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
  retire_at = config.data.drop_solved_above
  if retire_at:  # no-positive-resampling: pass rates over all n_est sampled per problem
    pass_rate_Bp = group_pass_rates(rewards_B, n_est)
    parts.loader.record_pass_rates(problems, pass_rate_Bp, retire_at)
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
  host = {"train/reward": float(np.mean(rewards_B)),
          "train/response_len": float(np.mean(rollouts.lengths_B)),
          "train/truncated_frac": float(np.mean(rollouts.finish_reason_B == "length")),
          "train/interrupted_frac": float(np.mean(rollouts.interrupted_B))}
  if baseline_B is not None:
    host["train/baseline_reward"] = float(np.mean(baseline_B))
  if retire_at:
    host["train/retired_prompts"] = parts.loader.num_retired
  # Rollouts the loss drops were still paid for (the ledger says so): all n_est
  # sampled for each group it leaves out, by the step's own rule.
  dropped_Bp = LossConfig.from_config(config.rl).dropped_groups(
      rewards_B, group_size=n, baseline_rewards_B=baseline_B)
  dropped = n_est * int(np.sum(dropped_Bp))
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
    last = train_loop(opened, config, run_plan.point)
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


def compute_devices(config) -> int:
  """Devices a step occupies, for device-hours: the trainer's (every process's) plus
  those of a separate vLLM server (config.sampler.server_devices)."""
  return jax.device_count() + int(config.sampler.server_devices)


def train_loop(opened: OpenRun, config, point: budget_lib.BudgetPoint) -> dict | None:
  """Runs the updates after the opened run's last step up to M: sample, update,
  sync weights, count, [eval], write metrics, [checkpoint].

  Returns:
    the last metrics record written, or None when nothing was left to do.
  """
  parts, writer, ckpt, state = opened.parts, opened.writer, opened.ckpt, opened.state
  last = None
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
  devices = compute_devices(config)
  for step in range(start + 1, point.m + 1):
    t_step = time.perf_counter()
    state, record, rollouts, dropped = sample_and_update(parts, config, state, step)
    # The step donates its input: the sampler must get the new arrays even when
    # the update was skipped (same values, fresh buffers).
    parts.sampler.update_weights(model_of(parts, state))
    ledger = ledger.add_rollouts(
        rollouts, dropped_rollouts=dropped,
        critic_flops=record.get("train/critic_flops", 0),
        device_seconds=devices * (time.perf_counter() - t_step))
    skips = skips + 1 if record["train/skipped"] > 0 else 0
    critic = {} if parts.critic_flops is None else {"critic_flops": ledger.critic_flops}
    record = {"rollouts": ledger.rollouts, "tokens": ledger.tokens,
              "dropped_rollouts": ledger.dropped_rollouts,
              "device_hours": ledger.device_hours, **critic, **record,
              "consecutive_skips": skips}
    counts = None
    if step % config.eval_every == 0 or step == point.m or step in extra_evals:
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
    if step % config.checkpoint_every == 0 or step == point.m:
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
