"""Builds the parts a run loop drives (model, data, sampler, step, reward).

Kept apart from `isojax/run.py` so the loop reads as the loop, and from
`isojax/run_open.py`, which opens a run directory around these parts. Everything
here is set-up (load, tokenize, compile-once objects); no training happens.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx

from isojax import assets, batching, models, rl, sharding
from isojax import data as data_lib
from isojax.assets import BASE_MODEL_DIR
from isojax.data import problem_sets
from isojax.data.lengths import fit_prompts
from isojax.models.critic import Critic, init_critic_from, load_critic
from isojax.rl import ppo
from isojax.rollout.interruption import InterruptingSampler, interruption_from_config
from isojax.rollout.jax_sampler import JaxSampler

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


def _mesh(config, devices=None):
  """config.mesh over `devices` (default: all of this process's view)."""
  m = config.mesh
  sizes = (m.data, m.fsdp, m.tensor)
  devices = list(jax.devices() if devices is None else devices)
  if -1 not in sizes:  # an explicit mesh may use fewer devices than there are
    size = int(np.prod(sizes))
    if 0 < size <= len(devices):  # else make_mesh names the sizes
      check_every_process_in(devices[:size], devices, config)
    devices = devices[:size]
  return sharding.make_mesh(m.data, m.fsdp, m.tensor, devices=devices)


def check_every_process_in(mesh_devices, devices, config) -> None:
  """Refuses a mesh that leaves out every device of some process: that process
  could place none of the step's arrays, and would fail on its first one."""
  left_out = sorted({d.process_index for d in devices}
                    - {d.process_index for d in mesh_devices})
  if left_out:
    m = config.mesh
    raise ValueError(
        f"config.mesh data={m.data} x fsdp={m.fsdp} x tensor={m.tensor} takes "
        f"{len(mesh_devices)} of the {len(devices)} devices of this "
        f"{len({d.process_index for d in devices})}-process run and none of process "
        f"{', '.join(map(str, left_out))}: every process must hold part of the mesh "
        f"(--config.mesh.fsdp=-1 takes every device)")


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
  _check_sampled_batch(run_plan.point, mesh)
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


def _check_sampled_batch(point, mesh) -> None:
  """A decoupled baseline's Bp * n_est rewards are split over the batch shards
  like the trained rows; the step would refuse them only at the first update,
  after a whole batch was sampled."""
  if point.n_est is None:
    return  # B itself: the step checks it against its micro-batches and shards
  shards = sharding.batch_shards(mesh)
  if point.sampled_batch % shards:
    raise ValueError(
        f"Bp*n_est = {point.bp}*{point.rollouts_per_problem} = {point.sampled_batch} "
        f"baseline rollouts per update are not divisible by the {shards} batch shards "
        f"(data x fsdp) of the mesh {dict(mesh.shape)}: choose config.rl.n_est so "
        f"that Bp*n_est is a multiple of {shards}")


def abstract_state(run_plan, model, mesh):
  """`make_step`'s state as sharded shapes (for `TrainStep.lower`)."""
  kwargs = dict(batch_size=run_plan.point.batch, mesh=mesh, rules=sharding.DEFAULT_RULES)
  if run_plan.value is None:
    return rl.abstract_train_state(model, run_plan.loss, run_plan.optim, **kwargs)
  return ppo.abstract_ppo_train_state(model, abstract_critic(model), run_plan.loss,
                                      run_plan.optim, run_plan.critic_optim, **kwargs)


def _init_state(run_plan, model, critic, mesh):
  """The run's fresh-state builder, called once. The model (and a critic) are
  handed over: the state holds copies of their parameters, and the sampler
  takes the state's after the first update, so the builder lets the modules go
  (kept, they would hold a second copy of the parameters for the whole run)."""
  kwargs = dict(batch_size=run_plan.point.batch, mesh=mesh, rules=sharding.DEFAULT_RULES)
  handed = [model, critic]

  def init():
    policy, value = handed.pop(0), handed.pop(0)
    if value is None:
      return rl.init_train_state(policy, run_plan.loss, run_plan.optim, **kwargs)
    return ppo.init_ppo_train_state(policy, value, run_plan.loss, run_plan.optim,
                                    run_plan.critic_optim, **kwargs)
  return init


def check_model_dirs(config, run_plan) -> None:
  """Refuses a model.path (or, with a critic, critic.path) that is no directory.

  The loader's own error names only the directory; this names the field, since the
  policy and the critic both load one, and fails before anything is loaded.
  """
  fields = {"model.path": model_path(config)}
  if run_plan.value is not None and config.critic.path:
    fields["critic.path"] = pathlib.Path(config.critic.path)
  for field, path in fields.items():
    if not path.is_dir():
      raise ValueError(f"config.{field}={str(path)!r} is not a directory (a Hugging Face "
                       f"model directory: config.json, model.safetensors, tokenizer)")


def build_parts(config, run_plan) -> RunParts:
  """Loads model, tokenizer and data; builds sampler, loader and the jitted step."""
  check_model_dirs(config, run_plan)
  mesh = _mesh(config)
  path = model_path(config)
  model, _ = models.load_pretrained(
      path, dtype=jnp.dtype(config.model.param_dtype), mesh=mesh,
      rules=sharding.DEFAULT_RULES, compute_dtype=jnp.dtype(config.model.dtype),
      lm_head_fp32=config.model.lm_head_fp32, remat=config.model.remat,
      attention=config.model.attention)
  tokenizer = models.Tokenizer.from_pretrained(path)
  train, val_sets = load_problem_sets(config)
  loaded = len(train)
  context, max_tokens = model.cfg.max_position_embeddings, run_plan.max_tokens
  train, ids = fit_context(config, tokenizer, context, max_tokens, train, "training")
  fitted = {name: fit_context(config, tokenizer, context, max_tokens, problems,
                              f"validation ({name})") for name, problems in val_sets.items()}
  val_sets = {name: kept for name, (kept, _) in fitted.items()}
  if len(train) < run_plan.point.bp:
    raise ValueError(
        f"Bp={run_plan.point.bp} problems per batch, but {len(train)} training problems "
        f"(data.train={config.data.train!r}, num_train={config.data.num_train}, "
        f"{config.data.num_val} of them held out for validation unless data.val names "
        f"a set; {loaded - len(train)} left out by data.drop_too_long): a batch would "
        f"hold a problem twice; lower bp or use more problems")
  prompt_ids = {p.id: x for p, x in zip(train, ids)}
  if len(prompt_ids) != len(train):
    raise ValueError("training problems must have distinct ids")
  # A fixed subset for the pass@1 histogram: the same problems at every eval.
  order = np.random.default_rng(config.data.split_seed).permutation(len(train))
  train_eval = [train[i] for i in np.sort(order[:config.eval.num_train])]
  point = run_plan.point
  # The threshold names itself when retirements run the set short, a resumed run too.
  loader = data_lib.EpochLoader(train, batch_size=point.bp, seed=config.seed,
                                retire_at=config.data.drop_solved_above or None)
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
