"""Opens a run directory around a run's parts: its lock, config.json and data.json,
the resume from its last checkpoint (refused on other problems than the run's, or
a metrics.jsonl cut short of it), the memory check and the metrics writer.

Kept apart from `isojax/run_setup.py`, which builds the parts (model, data,
sampler, step) and knows nothing of run directories.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import sys
import time
from collections.abc import Callable

import jax
from absl import logging

from isojax import budget as budget_lib
from isojax import checkpoint as ckpt_lib
from isojax import files, memory, rl, run_setup
from isojax import metrics as metrics_lib
from isojax.checkpoint import HostState
from isojax.data import problems_digest
from isojax.errors import disk_full_as
from isojax.rollout.memory import check_run_split
from isojax.run_config import check_run_dir, check_saved_data
from isojax.run_setup import RunParts, model_of
from isojax.rundir import CHECKPOINT_DIR, CONFIG_FILE, DATA_FILE, lock_run_dir


def writes_run_files() -> bool:
  """Whether this process writes config.json, metrics.jsonl and DONE.

  Only the first process of a multi-host run does (orbax coordinates the
  checkpoints itself): every process appending to one metrics.jsonl on a shared
  filesystem would write each line once per host.
  """
  return jax.process_index() == 0


def write_json(path: pathlib.Path, obj) -> None:
  """A run file (config.json, DONE) as indented JSON, written atomically."""
  files.write_atomic(path, json.dumps(obj, indent=1, sort_keys=True) + "\n")


@dataclasses.dataclass
class OpenRun:
  """A run ready to loop: what `open_run` built and where the loop continues.

  Attributes:
    parts: model, data, sampler and the jitted step.
    state: the train state (fresh, or restored from the last checkpoint).
    ckpt: the run's checkpointer.
    writer: the metrics writer (cut back to the restored step).
    resumed: the checkpoint the run continues from, or None for a fresh start
      (the loop then evaluates the base model as step 0).
    t0: when the run started opening (wall-clock seconds).
    unlock: releases the run directory's lock (`rundir.lock_run_dir`).
  """

  parts: RunParts
  state: object
  ckpt: ckpt_lib.RunCheckpointer
  writer: metrics_lib.MetricsWriter
  resumed: HostState | None
  t0: float
  unlock: Callable[[], None]

  def close_files(self) -> None:
    """Closes the metrics writer, checkpointer and parts; the lock stays held (the
    caller writes DONE under it, then calls `unlock`)."""
    _close_all(self.writer.close, self.ckpt.close, self.parts.close)


def open_run(config, run_plan, workdir: pathlib.Path, resolved: dict) -> OpenRun:
  """Builds the run's parts, resumes from the last checkpoint in `workdir` if any,
  records config.json and data.json (digests of its problems) and opens
  metrics.jsonl.

  A saved config.json that lacks fields added since its run started
  (`isojax.run_config.ADDED_FIELDS`, at the values their absence means) is
  rewritten with `resolved` once the run has started.

  Raises:
    ValueError: if `workdir` holds a run with a different config, seed or
      problems (`run_config.check_saved_data`), checkpoints without a
      config.json or a metrics.jsonl cut short of them, or another process
      runs in it.
  """
  point = run_plan.point
  workdir.mkdir(parents=True, exist_ok=True)
  lock = lock_run_dir(workdir) if writes_run_files() else None
  unlock = (lambda: None) if lock is None else functools.partial(os.close, lock)
  closes = [unlock]  # what a failure below must undo, newest first
  try:
    files.check_not_link(workdir / CHECKPOINT_DIR)
    ckpt = ckpt_lib.RunCheckpointer(workdir / CHECKPOINT_DIR,
                                    max_to_keep=config.keep_checkpoints)
    closes.insert(0, ckpt.close)
    start = ckpt.latest_step()
    # Fields the saved config.json predates, or runtime fields this rerun changed.
    lacking = check_run_dir(workdir, resolved, resumable=start is not None)
    logging.info("budget point %s: B=%d, C=%d rollouts, lr=%.3g", point.name,
                 point.batch, point.compute, run_plan.lr)
    t0 = time.time()
    parts = run_setup.build_parts(config, run_plan)
    closes.insert(0, parts.close)  # a vLLM client's snapshots go too
    state = parts.init_state()
    _log_memory_split(config, parts, state, point, pipelined=bool(run_plan.max_lag))
    resumed = None
    digests = {"train": problems_digest(parts.train_problems),
               **{f"val/{name}": problems_digest(problems)
                  for name, problems in parts.val_sets.items()}}
    if start is not None:  # the files its config names may hold other problems by now
      check_saved_data(workdir / DATA_FILE, digests, config.data)
      state, resumed = ckpt.restore(start, state)
      if list(resumed.rng) != run_key(config):
        raise ValueError(f"checkpoint {start} in {workdir} was made with another seed")
      parts.loader.load_state_dict(resumed.loader)
      parts.sampler.update_weights(model_of(parts, state), version=start)
      logging.info("resumed from the checkpoint at step %d", start)
    writes_files = writes_run_files()
    # Only a run that really started (model, data, sampler and state loaded) records
    # its config and data digests: a failed start (a bad model path) must not hold
    # them against the corrected command in the same workdir. A config.json from
    # before fields were added, or with other runtime fields, is rewritten whole
    # (atomically), so the next rerun compares all. data.json holds what the run
    # starts on (a rerun before its first checkpoint starts afresh) or, for a run
    # older than it, what it resumed on.
    if writes_files and (lacking or not (workdir / CONFIG_FILE).exists()):
      if lacking:
        logging.info("%s rewritten with this run's %s", CONFIG_FILE, lacking)
      with disk_full_as(workdir, CONFIG_FILE):
        write_json(workdir / CONFIG_FILE, resolved)
    if writes_files and (start is None or not (workdir / DATA_FILE).exists()):
      with disk_full_as(workdir, DATA_FILE):
        write_json(workdir / DATA_FILE, digests)
    writer = metrics_lib.MetricsWriter(workdir, resume_step=start, enabled=writes_files)
  except BaseException:
    _close_all(*closes)
    raise
  return OpenRun(parts=parts, state=state, ckpt=ckpt, writer=writer, resumed=resumed,
                 t0=t0, unlock=unlock)


def _log_memory_split(config, parts: RunParts, state, point: budget_lib.BudgetPoint, *,
                      pipelined: bool) -> None:
  """Checks trainer state + sampler cache against the device (raises if they do not
  fit) and logs the split."""
  if config.sampler.backend != "jax":
    return  # the server's memory is not this device's
  eval_sets = [p for p in (*parts.val_sets.values(), parts.train_eval_problems) if p]
  eval_problems = max((min(len(p), config.eval.batch_problems or len(p)) for p in eval_sets),
                      default=0)
  cfg = model_of(parts, state).cfg

  def largest(num_prompts, n, longest):  # of the calls a request makes in turn
    calls = parts.sampler.cache_layouts(num_prompts, n, longest, parts.max_tokens)
    return max(calls, key=lambda c: c.bytes_per_device(cfg))

  def step_gib():
    # Compiled from the shapes of the run's host batches, without shardings as
    # they come (the step's in_shardings place both): jit's cache then hands the
    # first update this executable, so the figure costs no second compile.
    n_est = config.rl.n_est or point.n
    batch = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), rl.abstract_batch(
        point.batch, parts.prompt_width + parts.max_tokens,
        baseline_size=point.bp * n_est if n_est > point.n else None))
    mem = memory.step_memory(parts.train_step, state, batch)
    return (mem.temporaries + mem.output_not_aliased) / memory.GIB

  split = check_run_split(
      config, cfg, state,
      train_cache=largest(point.bp, config.rl.n_est or config.n, parts.prompt_width),
      eval_cache=(largest(eval_problems, config.eval.k, parts.eval_prompt_len)
                  if eval_problems else None),
      pipelined_params=state.params if pipelined else None, step_gib=step_gib)
  if split is not None:
    logging.info("memory per device: trainer state %.2f GiB + update step %.2f GiB + "
                 "sampler weights %.2f GiB + KV cache %.2f GiB (%d rows) of %.2f GiB",
                 split["trainer_gib"], split["step_gib"], split["sampler_weights_gib"],
                 split["kv_gib"], split["rows"], split["device_gib"])


def run_key(config) -> list[int]:
  """The run's PRNG key data, as the checkpoint's `HostState.rng` holds it."""
  return ckpt_lib.key_to_host(jax.random.key(config.seed))


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
