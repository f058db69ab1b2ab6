"""Rollouts + rewards -> one fixed-shape `isojax.rl.Batch` for the update step.

Every update of a run must have the same array shapes, or the jitted step would
compile again for each new shape. A batch is therefore always
[B, prompt_width + max_tokens]: each prompt left-padded to `prompt_width` (a
bucket fixed for the run from its longest training prompt), each completion
right-padded to `max_tokens`:

    pad pad p0 p1 p2 | c0 c1 c2 pad pad
    attention         1  1  1 |  1  1  1   0   0
    loss mask         0  0  0 |  1  1  1   0   0
    sampler logp      0  0  0 | l0 l1 l2   0   0

Completion tokens the sampler appended rather than sampled (`Rollouts.forced_BxT`,
a forced interruption's phrase) are attended to but not trained on: attention 1,
loss mask 0, sampler logp 0.

Row i*n + j holds prompt i's j-th completion (prompt-major groups, as the
advantages in the step expect).

Decoupled baseline (App. G): with n_est > n rollouts per prompt, `train_rows`
picks n of each prompt's n_est at random, `take_rollouts` keeps those rows, and
all n_est rewards go into the batch as `baseline_rewards_B`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from isojax.rl import Batch
from isojax.rollout import Rollouts

MIN_PROMPT_BUCKET = 16


def prompt_bucket(max_prompt_len: int, minimum: int = MIN_PROMPT_BUCKET) -> int:
  """The smallest power of two >= max_prompt_len (and >= `minimum`)."""
  if max_prompt_len < 1:
    raise ValueError(f"max_prompt_len must be >= 1, got {max_prompt_len}")
  return max(minimum, 1 << (int(max_prompt_len) - 1).bit_length())


def train_rows(bp: int, n_est: int, n: int, seed: int) -> np.ndarray:
  """Rows of a [Bp * n_est] prompt-major batch to train on: n per prompt, at random.

  Prompt i's picks come from rows [i * n_est, (i + 1) * n_est), drawn without
  replacement and kept in increasing order, so the result is prompt-major groups
  of n (the paper subsamples 64 of 256 "randomly"; a fixed prefix would do as well
  for i.i.d. samples, but a sampler may order a prompt's samples).
  """
  if not 1 <= n <= n_est:
    raise ValueError(f"train_rows needs 1 <= n <= n_est; got n={n}, n_est={n_est}")
  rng = np.random.default_rng(seed)
  picks_BpxN = np.sort(np.stack([rng.choice(n_est, size=n, replace=False)
                                 for _ in range(bp)]), axis=1)
  return (np.arange(bp)[:, None] * n_est + picks_BpxN).reshape(-1)


def take_rollouts(rollouts: Rollouts, rows: np.ndarray) -> Rollouts:
  """The rollouts at `rows`, in that order (same width T), version labels included."""
  rows = np.asarray(rows, np.int64)
  lengths_B = np.asarray(rollouts.lengths_B)[rows]
  forced_BxT = np.asarray(rollouts.forced_BxT)[rows]
  version_BxT = None if rollouts.version_BxT is None else rollouts.version_BxT[rows]
  return Rollouts(tokens_BxT=np.asarray(rollouts.tokens_BxT)[rows],
                  logprobs_BxT=np.asarray(rollouts.logprobs_BxT)[rows],
                  lengths_B=lengths_B,
                  finish_reason_B=np.asarray(rollouts.finish_reason_B)[rows],
                  num_rollouts=len(rows),
                  num_generated_tokens=int(lengths_B.sum() - forced_BxT.sum()),
                  forced_BxT=forced_BxT, version_BxT=version_BxT)


def build_batch(prompt_ids: Sequence[Sequence[int]], rollouts: Rollouts,
                rewards_B: np.ndarray, *, n: int, prompt_width: int, max_tokens: int,
                pad_id: int, baseline_rewards_B: np.ndarray | None = None) -> Batch:
  """Packs len(prompt_ids) * n rollouts into a Batch of width prompt_width + max_tokens.

  Args:
    prompt_ids: the Bp prompts' token ids, in the order they were sampled.
    rollouts: the sampler's output for them (prompt-major, n per prompt).
    rewards_B: one reward per rollout.
    n: rollouts per prompt.
    prompt_width: left-padded prompt length (>= every prompt's length).
    max_tokens: completion width (>= every completion's length).
    pad_id: token id written into padding (masked out everywhere).
    baseline_rewards_B: optional [Bp * n_est] rewards of every rollout sampled
      for the decoupled baseline (prompt-major, the trained ones among them).

  Returns:
    an `isojax.rl.Batch` of NumPy arrays (the step places them on the mesh).
  """
  bp = len(prompt_ids)
  b = bp * n
  if rollouts.num_rollouts != b:
    raise ValueError(f"rollouts hold {rollouts.num_rollouts} rows; expected "
                     f"{bp} prompts x n={n} = {b}")
  rewards_B = np.asarray(rewards_B, np.float32)
  if rewards_B.shape != (b,):
    raise ValueError(f"rewards_B has shape {rewards_B.shape}, expected ({b},)")
  lengths_B = np.asarray(rollouts.lengths_B, np.int64)
  if lengths_B.size and lengths_B.max() > max_tokens:
    raise ValueError(f"a completion has {int(lengths_B.max())} tokens > max_tokens="
                     f"{max_tokens}")
  width = prompt_width + max_tokens
  ids_BxT = np.full((b, width), pad_id, np.int32)
  attn_BxT = np.zeros((b, width), np.int32)
  for i, p in enumerate(prompt_ids):
    if not 0 < len(p) <= prompt_width:
      raise ValueError(f"prompt {i} has {len(p)} tokens; the run's prompt width is "
                       f"{prompt_width}")
    rows = slice(i * n, (i + 1) * n)
    ids_BxT[rows, prompt_width - len(p):prompt_width] = np.asarray(p, np.int32)
    attn_BxT[rows, prompt_width - len(p):prompt_width] = 1
  # Completions: column prompt_width + t holds token t while t < length.
  t_T = np.arange(max_tokens)
  comp_BxT = (t_T[None, :] < lengths_B[:, None]).astype(np.int32)
  tc = min(rollouts.tokens_BxT.shape[1], max_tokens)
  tokens_BxT = np.full((b, max_tokens), pad_id, np.int32)
  tokens_BxT[:, :tc] = rollouts.tokens_BxT[:, :tc]
  logp_BxT = np.zeros((b, max_tokens), np.float32)
  logp_BxT[:, :tc] = rollouts.logprobs_BxT[:, :tc]
  forced_BxT = np.zeros((b, max_tokens), np.int32)
  forced_BxT[:, :tc] = rollouts.forced_BxT[:, :tc]
  ids_BxT[:, prompt_width:] = np.where(comp_BxT == 1, tokens_BxT, pad_id)
  attn_BxT[:, prompt_width:] = comp_BxT
  loss_BxT = np.zeros((b, width), np.int32)
  loss_BxT[:, prompt_width:] = comp_BxT * (1 - forced_BxT)
  sampler_logp_BxT = np.zeros((b, width), np.float32)
  sampler_logp_BxT[:, prompt_width:] = logp_BxT * comp_BxT
  if baseline_rewards_B is not None:
    baseline_rewards_B = np.asarray(baseline_rewards_B, np.float32)
    if baseline_rewards_B.ndim != 1 or baseline_rewards_B.shape[0] % bp or (
        baseline_rewards_B.shape[0] < b):
      raise ValueError(f"baseline_rewards_B has shape {baseline_rewards_B.shape}; "
                       f"expected ({bp} prompts x n_est >= n={n},)")
  return Batch(input_ids_BxT=ids_BxT, attention_mask_BxT=attn_BxT,
               loss_mask_BxT=loss_BxT, sampler_logp_BxT=sampler_logp_BxT,
               rewards_B=rewards_B, baseline_rewards_B=baseline_rewards_B)
