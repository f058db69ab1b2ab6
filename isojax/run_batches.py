"""The run's training batches: sampled one per update, or k ahead with one policy.

`sample_group` draws the batches of the updates `first..last` with the sampler's
current weights, in update order: one batch (on-policy, config.rl.off_policy_k =
1) or a group of k (PPO-off-policy-k: k batches from one policy, then k updates,
one per batch). Batch s uses the data loader's next problems and the sampling
seed of update s alone (`derive_seed(seed, TRAIN, s)`), whatever the group size,
so a group redone after a resume is the one the uninterrupted run drew.

Every trained token carries the version of the policy that sampled it (the
number of updates done when it was sampled); an update's lag is the updates done
since (`lag_metrics`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from isojax import batching
from isojax.data.loader import group_pass_rates
from isojax.errors import IsojaxError
from isojax.evaluate import score_rollouts
from isojax.rl import LossConfig
from isojax.rollout.base import FINISH_LENGTH

# Streams of seed-derived randomness (see `derive_seed`). Validation set i > 0
# (data.val's i-th set) uses stream VAL_EXTRA + i.
TRAIN, VAL, TRAIN_EVAL, TRAIN_ROWS, VAL_EXTRA = 0, 1, 2, 3, 100


class NonFiniteLossError(IsojaxError):
  """Raised when config.max_consecutive_skips updates in a row were non-finite, or
  when the sampler's log-probs are not finite."""


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


@dataclasses.dataclass(frozen=True)
class SampledBatch:
  """One update's batch, sampled and scored, waiting for its update.

  Attributes:
    step: the update that trains on it.
    batch: the packed `isojax.rl.Batch` (n rollouts per problem).
    rollouts: every rollout sampled, also those only the baseline saw (the
      ledger pays for all).
    dropped: how many of `rollouts` a filter drops from the loss.
    host: the batch's host-side metrics ("train/reward", ...).
    version_BxT: int32, per token of `batch`, the number of updates done when
      the policy that sampled it was current (-1 off the loss mask).
  """
  step: int
  batch: Any
  rollouts: Any
  dropped: int
  host: dict
  version_BxT: np.ndarray


def nonfinite_policy_message(step: int, weights: int, config) -> str:
  if weights == 0:  # no update has run: the learning rate is not the cause
    return (f"stopping at step {step}: the sampler's log-probs are not finite with the "
            f"initial weights (no update has run): the model gives inf/NaN logits. "
            f"Check the checkpoint in config.model and its compute dtype "
            f"(config.model.dtype={config.model.dtype!r}).")
  return (f"stopping at step {step}: the sampler's log-probs are not finite, i.e. the "
          f"weights after update {weights} give inf/NaN logits although that update "
          f"was finite (config.rl.lr_base={config.rl.lr_base:g} is far too large?). "
          f"Lower config.rl.lr_base (or set config.rl.max_grad_norm) and start again in "
          f"a fresh --workdir: resuming would reload these weights.")


def sample_group(parts, config, first: int, last: int) -> list[SampledBatch]:
  """The batches of updates first..last, all sampled with the sampler's current
  weights (those after update first - 1), in update order."""
  return [sample_batch(parts, config, step, version=first - 1)
          for step in range(first, last + 1)]


def sample_batch(parts, config, step: int, *, version: int) -> SampledBatch:
  """Samples, scores and packs the batch of update `step` with the sampler's current
  weights, which are those after `version` updates."""
  n = config.n
  n_est = config.rl.n_est or n  # rollouts sampled per problem
  problems = parts.loader.next_batch()
  prompt_ids = [parts.prompt_ids[p.id] for p in problems]
  rollouts = parts.sampler.generate(
      prompt_ids, n=n_est, max_tokens=parts.max_tokens,
      temperature=config.sampler.temperature, top_p=config.sampler.top_p,
      top_k=config.sampler.top_k or None, stop_token_ids=parts.stop_token_ids,
      seed=derive_seed(config.seed, TRAIN, step))
  bad_BxT = ~np.isfinite(rollouts.logprobs_BxT)
  if bad_BxT.any():
    # PipelineRL's tokens may come from weights newer than `version`: their labels say.
    labels = rollouts.version_BxT
    weights = version if labels is None else int(np.asarray(labels)[bad_BxT].max())
    raise NonFiniteLossError(nonfinite_policy_message(step, weights, config))
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
                               seed=derive_seed(config.seed, TRAIN_ROWS, step))
    baseline_B, rewards_B = rewards_B, rewards_B[rows]
    rollouts = batching.take_rollouts(rollouts, rows)
  batch = batching.build_batch(prompt_ids, rollouts, rewards_B, n=n,
                               prompt_width=parts.prompt_width,
                               max_tokens=parts.max_tokens, pad_id=parts.pad_id,
                               baseline_rewards_B=baseline_B)
  host = {"train/reward": float(np.mean(rewards_B)),
          "train/response_len": float(np.mean(rollouts.lengths_B)),
          "train/truncated_frac": float(np.mean(rollouts.finish_reason_B == FINISH_LENGTH)),
          "train/interrupted_frac": float(np.mean(rollouts.interrupted_B))}
  if baseline_B is not None:
    host["train/baseline_reward"] = float(np.mean(baseline_B))
  if retire_at:
    host["train/retired_prompts"] = parts.loader.num_retired
  # Rollouts the loss drops were still paid for (the ledger says so): all n_est
  # sampled for each group it leaves out, by the step's own rule.
  dropped_Bp = LossConfig.from_config(config.rl).dropped_groups(
      rewards_B, group_size=n, baseline_rewards_B=baseline_B)
  version_BxT = token_versions(batch.loss_mask_BxT, rollouts, parts.prompt_width, version)
  return SampledBatch(step=step, batch=batch, rollouts=sampled,
                      dropped=n_est * int(np.sum(dropped_Bp)), host=host,
                      version_BxT=version_BxT)


def token_versions(loss_mask_BxT, rollouts, prompt_width: int, version: int) -> np.ndarray:
  """Per token of a packed batch: the version of the policy that sampled it (-1 off
  the loss mask). The sampler's own labels when it gives them (a generation that
  picked up new weights in flight mixes versions), else `version` for every token.
  """
  on_BxT = np.asarray(loss_mask_BxT) > 0
  labels = rollouts.version_BxT
  if labels is None:
    return np.where(on_BxT, version, -1).astype(np.int32)
  out_BxT = np.full(on_BxT.shape, -1, np.int32)
  width = min(labels.shape[1], on_BxT.shape[1] - prompt_width)
  out_BxT[:, prompt_width:prompt_width + width] = labels[:, :width]
  return np.where(on_BxT, out_BxT, -1)


class GroupedBatches:
  """The batch source of the synchronous loop: a group of k batches sampled with one
  policy, then k updates (k = 1: on-policy, one batch per update).

  `take(step)` returns the batch of update `step` and the batches sampled for it
  (the ledger charges them when sampled); `after_update` gives the sampler the
  new weights when it next generates (for an eval or the next group: a group's
  other updates need no push, which for a vLLM server is a save and reload);
  `checkpoint_ready` holds a due checkpoint until the group's end, so that no
  sampled batch is ever pending in one.
  """

  def __init__(self, parts, config, *, k: int, last: int):
    self.parts, self.config, self.k, self.last = parts, config, k, last
    self.pending: list[SampledBatch] = []

  def take(self, step: int) -> tuple[SampledBatch, list[SampledBatch]]:
    sampled = []
    if not self.pending:  # a group starts: its batches from the current policy
      sampled = sample_group(self.parts, self.config, step, min(step + self.k - 1, self.last))
      self.pending = list(sampled)
    return self.pending.pop(0), sampled

  def after_update(self, step: int, model, *, eval_due: bool) -> None:
    if eval_due or not self.pending:
      self.parts.sampler.update_weights(model, version=step)

  def checkpoint_ready(self, step: int) -> bool:
    return not self.pending

  def checkpoint_written(self, step: int) -> None:
    pass

  def close(self) -> None:
    pass


def lag_metrics(version_BxT: np.ndarray, updates_done: int) -> dict[str, float]:
  """train/policy_lag_mean and _max over the trained tokens: updates done since the
  policy that sampled each token (0 on-policy)."""
  lag = updates_done - version_BxT[version_BxT >= 0]
  if lag.size == 0:  # no trained token: nothing lagged
    return {"train/policy_lag_mean": 0.0, "train/policy_lag_max": 0.0}
  return {"train/policy_lag_mean": float(np.mean(lag)),
          "train/policy_lag_max": float(np.max(lag))}
