"""Builds the parts a run loop drives: model, data, sampler, step, reward.

Kept apart from `isojax/run.py` so the loop reads as the loop. Everything here
is set-up (load, tokenize, compile-once objects); no training happens.
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
from flax import nnx

from isojax import rl, sharding
from isojax.models.critic import Critic, init_critic_from, load_critic
from isojax.rl import ppo
from isojax.rollout.jax_sampler import JaxSampler

ASSETS_DIR = pathlib.Path(__file__).resolve().parent / "assets"
BASE_MODEL_DIR = ASSETS_DIR / "base_model"
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


def nonfinite_step_message(step: int, skips: int, limit: int, last_ckpt: int | None) -> str:
  return (f"stopping at step {step}: {skips} updates in a row had a non-finite loss or "
          f"gradient and were skipped (config.max_consecutive_skips={limit}); the "
          f"parameters are unchanged since the last good update. Last checkpoint: "
          f"{'none' if last_ckpt is None else f'step {last_ckpt}'} (never holds NaN). "
          f"Lower the learning rate or inspect the rewards/logprobs of these steps.")


def model_path(config) -> pathlib.Path:
  """config.model.path, or the committed tiny base model when it is empty."""
  return pathlib.Path(config.model.path) if config.model.path else BASE_MODEL_DIR


def load_problem_sets(config) -> tuple[list, dict[str, list]]:
  """(train, {name: val problems}, primary first) from config.data.

  The source forms (synthetic, synthetic:NAME splits under isojax/assets/splits,
  mixtures, files), data.num_train and the validation-set mapping are those of
  `isojax.data.problem_sets`.
  """
  from isojax.data import problem_sets

  return problem_sets.load_problem_sets(config.data, ASSETS_DIR / "splits")


def _mesh(config):
  from isojax import sharding

  m = config.mesh
  sizes = (m.data, m.fsdp, m.tensor)
  devices = jax.devices()
  if -1 not in sizes:  # an explicit mesh may use fewer devices than the host has
    devices = devices[:int(np.prod(sizes))]
  return sharding.make_mesh(m.data, m.fsdp, m.tensor, devices=devices)


def _sampler(config, model, mesh):
  # Each backend is imported only when chosen: the vLLM client needs `requests`.
  if config.sampler.backend == "jax":
    return JaxSampler(model, mesh=mesh, max_rows=config.sampler.get("max_rows") or None,
                      kv_budget_gib=config.sampler.get("kv_budget_gib") or None)
  from isojax.rollout.vllm_client import VLLMSampler  # pylint: disable=g-import-not-at-top
  s = config.sampler
  sampler = VLLMSampler(s.vllm_url, weights_root=s.vllm_weights_dir or None,
                        connect_timeout_s=s.vllm_connect_timeout_s,
                        probe_timeout_s=s.vllm_probe_timeout_s,
                        request_timeout_s=s.vllm_request_timeout_s)
  try:
    sampler.wait_until_ready()  # before writing a weight snapshot for it
    sampler.update_weights(model)  # the server may hold other weights
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
                rules=sharding.DEFAULT_RULES, temperature=config.sampler.temperature)
  if run_plan.value is None:
    return rl.make_train_step(model, run_plan.loss, run_plan.optim, **kwargs)
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
  kwargs = dict(batch_size=run_plan.point.batch, mesh=mesh, rules=sharding.DEFAULT_RULES)
  if critic is None:
    return lambda: rl.init_train_state(model, run_plan.loss, run_plan.optim, **kwargs)
  return lambda: ppo.init_ppo_train_state(model, critic, run_plan.loss, run_plan.optim,
                                          run_plan.critic_optim, **kwargs)


def build_parts(config, run_plan) -> RunParts:
  """Loads model, tokenizer and data; builds sampler, loader and the jitted step."""
  from isojax import batching, data as data_lib, models, rl, sharding

  mesh = _mesh(config)
  path = model_path(config)
  model, _ = models.load_pretrained(
      path, dtype=jnp.dtype(config.model.param_dtype), mesh=mesh,
      rules=sharding.DEFAULT_RULES, compute_dtype=jnp.dtype(config.model.dtype),
      remat=config.model.remat, attention=config.model.attention)
  tokenizer = models.Tokenizer.from_pretrained(path)
  train, val_sets = load_problem_sets(config)
  context, max_tokens = model.cfg.max_position_embeddings, run_plan.max_tokens
  train, ids = fit_context(config, tokenizer, context, max_tokens, train, "training")
  val_sets = {name: fit_context(config, tokenizer, context, max_tokens, problems,
                                f"validation ({name})")[0]
              for name, problems in val_sets.items()}
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
  return RunParts(
      mesh=mesh, graphdef=graphdef, rest=rest, tokenizer=tokenizer,
      train_problems=train, val_problems=next(iter(val_sets.values())),
      val_sets=val_sets, train_eval_problems=train_eval,
      prompt_ids=prompt_ids,
      prompt_width=batching.prompt_bucket(max(len(x) for x in ids)),
      max_tokens=run_plan.max_tokens,
      pad_id=int(tokenizer.pad_token_id or 0),
      stop_token_ids=() if eos is None else (int(eos),),
      loader=loader, sampler=_sampler(config, model, mesh),
      reward_fn=data_lib.get_reward_fn(REWARDS[config.data.reward]),
      train_step=step, init_state=_init_state(run_plan, model, critic, mesh),
      critic_flops=None if critic is None else functools.partial(
          ppo.critic_update_flops, critic.cfg))


def fit_context(config, tokenizer, context: int, max_tokens: int, problems: list,
                what: str):
  """(problems, their prompt ids) with every prompt + max_tokens within `context`.

  Raises ValueError naming the problems that do not fit, unless
  config.data.drop_too_long, which leaves them out with a count in the log.
  `what` names the set in messages ("training", "validation (NAME)").
  """
  from absl import logging
  from isojax.data.lengths import fit_prompts

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
