"""Builds the parts a run loop drives (model, data, sampler, step, reward) and
opens a run directory (resume from its last checkpoint, config.json, metrics).

Kept apart from `isojax/run.py` so the loop reads as the loop. Everything here
is set-up (load, tokenize, compile-once objects, restore); no training happens.
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
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx

from isojax import assets, batching, files, models, rl, sharding
from isojax import budget as budget_lib
from isojax import checkpoint as ckpt_lib
from isojax import data as data_lib
from isojax import metrics as metrics_lib
from isojax.assets import BASE_MODEL_DIR
from isojax.checkpoint import HostState
from isojax.data import problem_sets
from isojax.data.lengths import fit_prompts
from isojax.errors import disk_full_as
from isojax.models.critic import Critic, init_critic_from, load_critic
from isojax.rl import ppo
from isojax.rollout.interruption import InterruptingSampler, interruption_from_config
from isojax.rollout.jax_sampler import JaxSampler
from isojax.rollout.memory import check_run_split
from isojax.run_config import check_run_dir
from isojax.rundir import CHECKPOINT_DIR, CONFIG_FILE, lock_run_dir

REWARDS = {"exact": "exact_match", "math": "math_verify"}


@dataclasses.dataclass
class RunParts:
  """The objects one run needs, built once from its config."""
  mesh: Any
  graphdef: Any
  rest: Any  # the model's non-parameter state (e.g. RoPE tables)
  tokenizer: Any
  train_problems: list
  val_problems: list  # the primary validation set
  val_sets: dict[str, list]  # every validation set by name, primary first
  train_eval_problems: list
  prompt_ids: dict[str, list[int]]  # problem id -> prompt token ids (train set)
  prompt_width: int
  eval_prompt_len: int  # the longest evaluation prompt (validation and training sets)
  max_tokens: int  # response-length cap (config.sampler.max_tokens, 0 resolved)
  pad_id: int
  stop_token_ids: tuple[int, ...]
  loader: Any
  sampler: Any
  reward_fn: Callable[[str, str], float]
  train_step: Any
  init_state: Callable[[], Any]
  # PPO: attention mask -> the critic FLOPs of an update (ledger critic_flops); else None.
  critic_flops: Callable[[Any], int] | None = None

  def close(self) -> None:
    close = getattr(self.sampler, "close", None)
    if close is not None:
      close()


def model_of(parts: RunParts, state) -> nnx.Module:
  """The Decoder with the train state's parameters (no copy)."""
  return nnx.merge(parts.graphdef, state.params, parts.rest)


def model_path(config) -> pathlib.Path:
  """config.model.path, or the committed tiny base model when it is empty."""
  return pathlib.Path(config.model.path) if config.model.path else BASE_MODEL_DIR


def load_problem_sets(config) -> tuple[list, dict[str, list]]:
  """(train, {name: val problems}, primary first) from config.data.

  The source forms (synthetic, synthetic:NAME splits under isojax/assets/splits,
  mixtures, files), data.num_train and the validation-set mapping are those of
  `isojax.data.problem_sets`.
  """
  return problem_sets.load_problem_sets(config.data, assets.ASSETS_DIR / "splits")


def _mesh(config):
  m = config.mesh
  sizes = (m.data, m.fsdp, m.tensor)
  devices = jax.devices()
  if -1 not in sizes:  # an explicit mesh may use fewer devices than the host has
    devices = devices[:int(np.prod(sizes))]
  return sharding.make_mesh(m.data, m.fsdp, m.tensor, devices=devices)


def _sampler(config, model, mesh, *, in_flight: bool = False):
  # Each backend is imported only when chosen: the vLLM client needs `requests`
  # (the `vllm` extra), which a JAX-only install lacks.
  if config.sampler.backend == "jax":
    return JaxSampler(model, mesh=mesh, max_rows=config.sampler.get("max_rows") or None,
                      kv_budget_gib=config.sampler.get("kv_budget_gib") or None,
                      decode_chunk=config.sampler.get("decode_chunk") or None)
  from isojax.rollout.vllm_client import VLLMSampler  # pylint: disable=g-import-not-at-top
  s = config.sampler
  sampler = VLLMSampler(s.vllm_url, weights_root=s.vllm_weights_dir or None,
                        connect_timeout_s=s.vllm_connect_timeout_s,
                        probe_timeout_s=s.vllm_probe_timeout_s,
                        request_timeout_s=s.vllm_request_timeout_s,
                        in_flight=in_flight)
  try:
    sampler.wait_until_ready()  # before writing a weight snapshot for it
    sampler.update_weights(model, version=0)  # the server may hold other weights
  except BaseException:
    sampler.close()  # the run never holds it: remove its snapshots now
    raise
  return sampler


def abstract_critic(model):
  """The critic of `model`'s architecture with shapes only (no parameter memory)."""
  return nnx.eval_shape(lambda: Critic(model.cfg, rngs=nnx.Rngs(0)))


def build_critic(config, model, mesh):
  """PPO's critic: a copy of `model`'s trunk, or config.critic.path's, on `mesh`."""
  if not config.critic.path:
    return init_critic_from(model, rngs=nnx.Rngs(config.seed))
  return load_critic(
      config.critic.path, rngs=nnx.Rngs(config.seed),
      dtype=jnp.dtype(config.model.param_dtype), mesh=mesh, rules=sharding.DEFAULT_RULES,
      compute_dtype=jnp.dtype(config.model.dtype), remat=config.model.remat,
      attention=config.model.attention)


def make_step(config, run_plan, model, mesh, critic=None):
  """The run's jitted update step (`model` may be abstract: `nnx.eval_shape`).

  With a value estimator (PPO) the joint policy + critic step; `critic`
  defaults to an abstract one of `model`'s architecture (shapes are all the
  step needs).
  """
  kwargs = dict(batch_size=run_plan.point.batch, group_size=run_plan.point.n,
                micro_batch_size=run_plan.micro_batch, mesh=mesh,
                rules=sharding.DEFAULT_RULES, logits_chunk=config.rl.logits_chunk,
                temperature=config.sampler.temperature)
  if run_plan.value is None:
    # Batches sampled by an older policy (PPO-off-policy-k, PipelineRL-k): ratios
    # against the sampler.
    old_logp = "sampler" if run_plan.stale else "current"
    return rl.make_train_step(model, run_plan.loss, run_plan.optim, old_logp=old_logp,
                              **kwargs)
  return ppo.make_ppo_train_step(
      model, abstract_critic(model) if critic is None else critic, run_plan.loss,
      run_plan.value, run_plan.optim, run_plan.critic_optim, **kwargs)


def abstract_state(run_plan, model, mesh):
  """`make_step`'s state as sharded shapes (for `TrainStep.lower`)."""
  kwargs = dict(batch_size=run_plan.point.batch, mesh=mesh, rules=sharding.DEFAULT_RULES)
  if run_plan.value is None:
    return rl.abstract_train_state(model, run_plan.loss, run_plan.optim, **kwargs)
  return ppo.abstract_ppo_train_state(model, abstract_critic(model), run_plan.loss,
                                      run_plan.optim, run_plan.critic_optim, **kwargs)


def _init_state(run_plan, model, critic, mesh):
  """The run's fresh-state builder, called once. A critic is handed over: the
  state holds a copy of its parameters, so the builder lets the module go (kept,
  it would double the critic's memory for the whole run)."""
  kwargs = dict(batch_size=run_plan.point.batch, mesh=mesh, rules=sharding.DEFAULT_RULES)
  if critic is None:
    return lambda: rl.init_train_state(model, run_plan.loss, run_plan.optim, **kwargs)
  handed = [critic]

  def init():
    return ppo.init_ppo_train_state(model, handed.pop(), run_plan.loss, run_plan.optim,
                                    run_plan.critic_optim, **kwargs)
  return init


def build_parts(config, run_plan) -> RunParts:
  """Loads model, tokenizer and data; builds sampler, loader and the jitted step."""
  mesh = _mesh(config)
  path = model_path(config)
  model, _ = models.load_pretrained(
      path, dtype=jnp.dtype(config.model.param_dtype), mesh=mesh,
      rules=sharding.DEFAULT_RULES, compute_dtype=jnp.dtype(config.model.dtype),
      lm_head_fp32=config.model.lm_head_fp32, remat=config.model.remat,
      attention=config.model.attention)
  tokenizer = models.Tokenizer.from_pretrained(path)
  train, val_sets = load_problem_sets(config)
  context, max_tokens = model.cfg.max_position_embeddings, run_plan.max_tokens
  train, ids = fit_context(config, tokenizer, context, max_tokens, train, "training")
  fitted = {name: fit_context(config, tokenizer, context, max_tokens, problems,
                              f"validation ({name})") for name, problems in val_sets.items()}
  val_sets = {name: kept for name, (kept, _) in fitted.items()}
  prompt_ids = {p.id: x for p, x in zip(train, ids)}
  if len(prompt_ids) != len(train):
    raise ValueError("training problems must have distinct ids")
  # A fixed subset for the pass@1 histogram: the same problems at every eval.
  order = np.random.default_rng(config.data.split_seed).permutation(len(train))
  train_eval = [train[i] for i in np.sort(order[:config.eval.num_train])]
  point = run_plan.point
  loader = data_lib.EpochLoader(train, batch_size=point.bp, seed=config.seed)
  graphdef, _, rest = nnx.split(model, nnx.Param, ...)
  critic = None if run_plan.value is None else build_critic(config, model, mesh)
  step = make_step(config, run_plan, model, mesh, critic=critic)
  eos = tokenizer.eos_token_id
  interrupt = interruption_from_config(config.sampler, max_tokens=run_plan.max_tokens,
                                       encode=tokenizer.encode)
  # PipelineRL: weight pushes keep a vLLM server's requests in flight.
  sampler = _sampler(config, model, mesh, in_flight=bool(run_plan.max_lag))
  if interrupt is not None:  # ScaleRL's forced length interruption, either backend
    sampler = InterruptingSampler(sampler, interrupt)
  return RunParts(
      mesh=mesh, graphdef=graphdef, rest=rest, tokenizer=tokenizer,
      train_problems=train, val_problems=next(iter(val_sets.values())),
      val_sets=val_sets, train_eval_problems=train_eval,
      prompt_ids=prompt_ids,
      prompt_width=batching.prompt_bucket(max(len(x) for x in ids)),
      eval_prompt_len=max(len(x) for x in ids + [x for _, v in fitted.values() for x in v]),
      max_tokens=run_plan.max_tokens,
      pad_id=int(tokenizer.pad_token_id or 0),
      stop_token_ids=() if eos is None else (int(eos),),
      loader=loader, sampler=sampler,
      reward_fn=data_lib.get_reward_fn(REWARDS[config.data.reward]),
      train_step=step, critic_flops=None if critic is None else functools.partial(
          ppo.critic_update_flops, critic.cfg),
      init_state=_init_state(run_plan, model, critic, mesh))


def fit_context(config, tokenizer, context: int, max_tokens: int, problems: list,
                what: str):
  """(problems, their prompt ids) with every prompt + max_tokens within `context`.

  Raises ValueError naming the problems that do not fit, unless
  config.data.drop_too_long, which leaves them out with a count in the log.
  `what` names the set in messages ("training", "validation (NAME)").
  """
  kept, ids, out = fit_prompts(tokenizer, problems, context=context, max_tokens=max_tokens,
                               drop=config.data.drop_too_long, what=f"{what} problem",
                               chat_template=config.data.chat_template)
  if out:
    logging.warning("config.data.drop_too_long: left out %d of %d %s problems whose "
                    "prompt + max_tokens exceed the context of %d tokens (first: %s)",
                    len(out), len(problems), what, context,
                    out[0].describe(context - max_tokens))
  if not kept:
    raise ValueError(f"no {what} problem fits the model's context of {context} tokens "
                     f"with max_tokens={max_tokens} (config.sampler.max_tokens)")
  return kept, ids


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

  def close(self) -> None:
    _close_all(self.writer.close, self.ckpt.close, self.parts.close, self.unlock)


def open_run(config, run_plan, workdir: pathlib.Path, resolved: dict) -> OpenRun:
  """Builds the run's parts, resumes from the last checkpoint in `workdir` if any,
  records config.json and opens metrics.jsonl.

  A saved config.json that lacks fields added since its run started
  (`isojax.run_config.ADDED_FIELDS`, at the values their absence means) is
  rewritten with `resolved` once the run has started.

  Raises:
    ValueError: if `workdir` holds a run with a different config or seed, or
      checkpoints without a config.json, or another process runs in it.
  """
  point = run_plan.point
  workdir.mkdir(parents=True, exist_ok=True)
  lock = lock_run_dir(workdir) if writes_run_files() else None
  unlock = (lambda: None) if lock is None else functools.partial(os.close, lock)
  closes = [unlock]  # what a failure below must undo, newest first
  try:
    lacking = check_run_dir(workdir, resolved)  # fields the saved config.json predates
    logging.info("budget point %s: B=%d, C=%d rollouts, lr=%.3g", point.name,
                 point.batch, point.compute, run_plan.lr)
    t0 = time.time()
    parts = build_parts(config, run_plan)
    closes.insert(0, parts.close)  # a vLLM client's snapshots go too
    state = parts.init_state()
    files.check_not_link(workdir / CHECKPOINT_DIR)
    _log_memory_split(config, parts, state, point, pipelined=bool(run_plan.max_lag))
    ckpt = ckpt_lib.RunCheckpointer(workdir / CHECKPOINT_DIR,
                                    max_to_keep=config.keep_checkpoints)
    closes.insert(0, ckpt.close)
    resumed, start = None, ckpt.latest_step()
    if start is not None:
      state, resumed = ckpt.restore(start, state)
      if list(resumed.rng) != run_key(config):
        raise ValueError(f"checkpoint {start} in {workdir} was made with another seed")
      parts.loader.load_state_dict(resumed.loader)
      parts.sampler.update_weights(model_of(parts, state), version=start)
      logging.info("resumed from the checkpoint at step %d", start)
    writes_files = writes_run_files()
    # Only a run that really started (model, data, sampler and state loaded) records
    # its config: a failed start (a bad model path) must not hold its config against
    # the corrected command in the same workdir. A config.json from before fields
    # were added is rewritten whole (atomically), so the next rerun compares all.
    if writes_files and (lacking or not (workdir / CONFIG_FILE).exists()):
      if lacking:
        logging.info("%s predates the fields %s: rewritten with them", CONFIG_FILE, lacking)
      with disk_full_as(workdir, CONFIG_FILE):
        write_json(workdir / CONFIG_FILE, resolved)
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

  split = check_run_split(
      config, cfg, state,
      train_cache=largest(point.bp, config.rl.n_est or config.n, parts.prompt_width),
      eval_cache=(largest(eval_problems, config.eval.k, parts.eval_prompt_len)
                  if eval_problems else None),
      pipelined_params=state.params if pipelined else None)
  if split is not None:
    logging.info("memory per device: trainer state %.2f GiB + sampler weights %.2f GiB + "
                 "KV cache %.2f GiB (%d rows) of %.2f GiB", split["trainer_gib"],
                 split["sampler_weights_gib"], split["kv_gib"], split["rows"],
                 split["device_gib"])


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
