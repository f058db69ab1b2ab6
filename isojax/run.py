"""The run: trains one budget point (Bp, n, M) and leaves a run directory.

    sample Bp problems -> n rollouts each -> rewards -> Batch -> step (advantages,
    loss, update inside) -> weight sync -> ledger -> [eval] -> metrics -> [checkpoint]

`plan_run(config)` (`isojax.run_plan`) validates everything that can be checked
without work (the budget point above all: an infeasible point fails here, naming
its numbers); `run` then opens the run (builds the parts, resumes from the last
checkpoint) and loops until M updates are done. The workdir (layout:
`isojax.rundir`) holds

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
resumed run restarts at a group boundary with no batch pending. With
config.rl.pipeline.max_lag = k > 0 (PipelineRL-k, `isojax.pipeline`) a thread
samples while the loop updates, and every update's weights reach generation in
flight; a checkpoint drains it.

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

import os
import pathlib
import sys
import time

import jax
import numpy as np
import tqdm
from absl import logging

from isojax import rundir, run_open
from isojax import budget as budget_lib
from isojax import evaluate as ev
from isojax import metrics as metrics_lib
from isojax.checkpoint import HostState
from isojax.data.problem_sets import metric_prefix
from isojax.errors import disk_full_as
from isojax.pipeline import Pipeline
from isojax.rundir import CONFIG_FILE, DONE_FILE, METRICS_FILE
from isojax.run_batches import (TRAIN_EVAL, VAL, VAL_EXTRA, GroupedBatches,
                                NonFiniteLossError, SampledBatch, derive_seed, lag_metrics)
from isojax.run_config import check_saved_config
from isojax.run_plan import RunPlan, plan_run, resolved_config
from isojax.run_open import OpenRun, open_run, run_key, write_json
from isojax.run_setup import RunParts, model_of


def nonfinite_step_message(step: int, skips: int, limit: int, last_ckpt: int | None) -> str:
  return (f"stopping at step {step}: {skips} updates in a row had a non-finite loss or "
          f"gradient and were skipped (config.max_consecutive_skips={limit}); the "
          f"parameters are unchanged since the last good update. Last checkpoint: "
          f"{'none' if last_ckpt is None else f'step {last_ckpt}'} (never holds NaN). "
          f"Lower the learning rate or inspect the rewards/logprobs of these steps.")


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


def update_on(parts: RunParts, state, sampled: SampledBatch, *, stale: bool) -> tuple:
  """One update on a sampled batch.

  Returns:
    (state, metrics): the new train state and the step's metrics ("train/...",
    the batch's host metrics and the device's; with stale batches the policy
    lag of its tokens too).
  """
  state, step_metrics = parts.train_step(state, sampled.batch)
  step_metrics = {f"train/{k}": float(v) for k, v in jax.device_get(step_metrics).items()}
  if parts.critic_flops is not None:  # PPO: the critic's cost of this update
    step_metrics["train/critic_flops"] = parts.critic_flops(sampled.batch.attention_mask_BxT)
  if stale:  # on-policy the lag is always 0: no columns for it
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
  if workdir.exists() and not workdir.is_dir():
    raise ValueError(f"--workdir {workdir} is a file, not a run directory")
  resolved = resolved_config(config, run_plan)
  if rundir.is_done(workdir):
    check_saved_config(workdir / CONFIG_FILE, resolved)  # a finished run keeps its file
    done = rundir.read_json_object(workdir / DONE_FILE)
    logging.info("%s: finished at step %d already; not rerunning", workdir, done["step"])
    return done["last"]
  opened = open_run(config, run_plan, workdir, resolved)
  # DONE is written before the run directory is unlocked: a second run let in
  # between would find it unfinished and resume it, rewriting its files.
  try:
    try:
      last = train_loop(opened, config, run_plan)
    finally:
      opened.close_files()
    if last is None:  # resumed at the last step: nothing was left to do
      last = rundir.read_metrics(workdir / METRICS_FILE).records[-1]
    point = run_plan.point
    if run_open.writes_run_files():  # on the module: a test stands in for another host
      with disk_full_as(workdir, DONE_FILE):
        write_json(workdir / DONE_FILE, {"step": point.m, "wall_s": time.time() - opened.t0,
                                         "last": last})
  finally:
    opened.unlock()
  logging.info("done: %s in %.1f s", point.name, time.time() - opened.t0)
  return last


def compute_devices(config, mesh) -> int:
  """Devices a step occupies, for device-hours: the trainer's mesh (every
  process's devices in it) plus a separate vLLM server's
  (config.sampler.server_devices)."""
  return mesh.devices.size + config.sampler.server_devices


def batch_source(parts: RunParts, config, run_plan: RunPlan, *, first: int, state):
  """Where the updates first..M get their batches: the synchronous loop's groups
  (`GroupedBatches`) or PipelineRL-k's producer thread (`Pipeline`, started)."""
  last = run_plan.point.m
  if not run_plan.max_lag:
    return GroupedBatches(parts, config, k=run_plan.off_policy_k, last=last)
  return Pipeline(parts, config, first=first, last=last, max_lag=run_plan.max_lag,
                  checkpoint_every=config.checkpoint_every,
                  copy_weights=config.sampler.backend == "jax").start(model_of(parts, state))


def train_loop(opened: OpenRun, config, run_plan: RunPlan) -> dict | None:
  """Runs the updates after the opened run's last step up to M: take the step's
  batch (sampling a group, or from the pipeline), update, hand the sampler the
  weights, count, [eval], write metrics, [checkpoint once no batch is pending].

  Returns:
    the last metrics record written, or None when nothing was left to do.
  """
  parts, writer, ckpt, state = opened.parts, opened.writer, opened.ckpt, opened.state
  point, last = run_plan.point, None
  if opened.resumed is None:
    start, ledger, skips = 0, budget_lib.Ledger(), 0
    val, counts = evaluate_step(parts, config)
    last = _write_step(writer, 0, {"rollouts": 0, "tokens": 0, "dropped_rollouts": 0,
                                   "device_hours": 0.0, **val}, counts, config.eval.k)
  else:
    start, ledger = opened.resumed.step, opened.resumed.ledger
    skips = opened.resumed.consecutive_skips
  bar = _progress(point.m, start, point.name)
  devices = compute_devices(config, parts.mesh)
  checkpoint_due = False
  source = batch_source(parts, config, run_plan, first=start + 1, state=state)
  try:
    for step in range(start + 1, point.m + 1):
      t_step = time.perf_counter()
      sampled, charged = source.take(step)
      for batch in charged:  # the ledger pays for a batch when it is sampled
        ledger = ledger.add_rollouts(batch.rollouts, dropped_rollouts=batch.dropped,
                                     updates=0)
      state, record = update_on(parts, state, sampled, stale=run_plan.stale)
      eval_due = run_plan.eval_due(step)
      # The step donated the old arrays, so the sampler gets the new ones even
      # after a skipped update (same values, fresh buffers).
      source.after_update(step, model_of(parts, state), eval_due=eval_due)
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
      _report(bar, step, point, record, config, opened.t0)
      if skips >= config.max_consecutive_skips:
        raise NonFiniteLossError(nonfinite_step_message(
            step, skips, config.max_consecutive_skips, ckpt.latest_step()))
      # A due checkpoint waits until no sampled batch is pending (a group's end).
      checkpoint_due = checkpoint_due or step % config.checkpoint_every == 0
      if (checkpoint_due and source.checkpoint_ready(step)) or step == point.m:
        checkpoint_due = False
        host = HostState(step=step, loader=parts.loader.state_dict(), ledger=ledger,
                         consecutive_skips=skips, rng=tuple(run_key(config)))
        with disk_full_as(ckpt.directory, f"checkpoint {step}"):
          ckpt.save(step, state, host)
        source.checkpoint_written(step)
  finally:
    source.close()
  bar.close()
  return last


def _report(bar, step: int, point, record: dict, config, t0: float) -> None:
  """The progress bar, and a log line at an eval."""
  bar.update(1)
  bar.set_postfix(reward=f"{record['train/reward']:.3f}")
  val_key = f"val/avg@{config.eval.k}"
  if val_key in record:
    logging.info("step %d/%d: train reward %.3f, val avg@%d %.3f (%.0f s)", step,
                 point.m, record["train/reward"], config.eval.k, record[val_key],
                 time.time() - t0)


def _write_step(writer: metrics_lib.MetricsWriter, step: int, record: dict,
                counts: np.ndarray | None, k: int) -> dict:
  """Writes a step's metrics line (and its pass@1 histogram at an eval); returns the
  record. A full disk becomes one message naming the step."""
  with disk_full_as(writer.path, f"the metrics of step {step}"):
    last = writer.write(step, record)
    if counts is not None:
      # Not "train/pass@1": that is the scalar mean, and a tag holds one kind.
      writer.write_histogram(step, "train/pass@1_hist", counts / k)
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
