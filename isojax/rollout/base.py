"""The rollout interface: what every sampler returns and how requests are checked.

The trainer only ever sees `Sampler.generate(...) -> Rollouts` and
`Sampler.update_weights(model)`. Two implementations exist: the in-process
`JaxSampler` and the `VLLMSampler` HTTP client. Both validate a request with
`validate_request` before doing any work, so a bad request fails the same way
(a `ValueError` naming the offending input) whichever backend is in use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from isojax.errors import IsojaxError

if TYPE_CHECKING:  # for the annotation only: this interface loads no JAX
  from flax import nnx

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
_FINISH_REASONS = (FINISH_STOP, FINISH_LENGTH)
# The smallest positive sampling temperature: far below it, logits / temperature
# leave float32's precision (at 1e-10: wrong tokens, infinite log-probs), and vLLM
# raises any lower one to it (logging a warning), which the trainer, scoring at the
# configured temperature, would not know.
MIN_TEMPERATURE = 0.01
# Seeds are 64-bit: a larger one could only be reduced, colliding with a smaller.
MAX_SEED = 2**64


# The server's error types live here, not in vllm_client, because both the client
# and weight_sync (which the client imports) raise them.
class VLLMError(IsojaxError):
  """The vLLM server was unreachable or answered with an error."""


class VLLMResponseError(VLLMError):
  """The vLLM server answered 200 but the JSON lacks or mangles a field."""


class VLLMPausedError(VLLMError):
  """The vLLM server stayed paused after a weight update: /resume kept failing."""


@dataclasses.dataclass(frozen=True)
class Rollouts:
  """Completions for len(prompts) * n rollouts, prompt-major, on the host.

  Row `i * n + j` is the j-th sample of prompt i. Completions are right-padded
  with 0 to a common width T (T >= max(lengths_B)).

  Attributes:
    tokens_BxT: int32 completion token ids (prompt not included), 0 on padding.
      A stop/EOS token that ended a sequence is included and counted in
      `lengths_B` (it is a sampled token the policy is trained on).
    logprobs_BxT: float32 log-probability of each completion token under the
      distribution the sampler actually drew it from (after temperature and
      top-p/top-k renormalisation); 0 on padding. For greedy decoding
      (temperature 0) it is the log-softmax of the unscaled logits.
    lengths_B: int32 number of completion tokens per rollout.
    finish_reason_B: array of str, "stop" (EOS or a stop token was sampled) or
      "length" (max_tokens reached).
    num_rollouts: B, for the compute ledger.
    num_generated_tokens: the tokens the sampler drew, for the compute ledger:
      sum(lengths_B) less the forced tokens.
    forced_BxT: int32, 1 on completion tokens that were appended rather than
      sampled (a forced interruption's phrase, `isojax.rollout.interruption`):
      the model reads them but is not trained on them, and their logprob is 0.
      None (the default) means none: all zeros.
    version_BxT: int32 or None, the version label of the weights that sampled
      each completion token (`Sampler.update_weights(model, version=...)`), so
      that a sampler whose weights change while it generates says which tokens
      came from which weights; -1 on padding and on forced tokens (not
      sampled). None: the sampler does not label its tokens.
  """

  tokens_BxT: np.ndarray
  logprobs_BxT: np.ndarray
  lengths_B: np.ndarray
  finish_reason_B: np.ndarray
  num_rollouts: int
  num_generated_tokens: int
  forced_BxT: np.ndarray | None = None
  version_BxT: np.ndarray | None = None

  def __post_init__(self):
    if self.forced_BxT is None:
      object.__setattr__(self, "forced_BxT", np.zeros(np.shape(self.tokens_BxT), np.int32))
    b = self.num_rollouts
    if self.tokens_BxT.ndim != 2 or self.tokens_BxT.shape[0] != b:
      raise ValueError(
          f"Rollouts.tokens_BxT must be [num_rollouts={b}, T], got shape "
          f"{self.tokens_BxT.shape}")
    if self.logprobs_BxT.shape != self.tokens_BxT.shape:
      raise ValueError(
          f"Rollouts.logprobs_BxT shape {self.logprobs_BxT.shape} != "
          f"tokens_BxT shape {self.tokens_BxT.shape}")
    if self.lengths_B.shape != (b,) or self.finish_reason_B.shape != (b,):
      raise ValueError(
          f"Rollouts.lengths_B {self.lengths_B.shape} and finish_reason_B "
          f"{self.finish_reason_B.shape} must both be ({b},)")
    if b and int(self.lengths_B.max()) > self.tokens_BxT.shape[1]:
      raise ValueError(
          f"Rollouts.lengths_B max {int(self.lengths_B.max())} exceeds "
          f"tokens_BxT width {self.tokens_BxT.shape[1]}")
    bad = set(self.finish_reason_B.tolist()) - set(_FINISH_REASONS)
    if bad:
      raise ValueError(f"Rollouts.finish_reason_B has unknown values {sorted(bad)}; "
                       f"expected {_FINISH_REASONS}")
    self._check_forced()
    self._check_version()
    sampled = int(self.lengths_B.sum()) - int(self.forced_BxT.sum())
    if self.num_generated_tokens != sampled:
      raise ValueError(
          f"Rollouts.num_generated_tokens={self.num_generated_tokens} != "
          f"sum(lengths_B) - forced tokens = {sampled}")

  def _check_forced(self) -> None:
    """forced_BxT: tokens' shape, 0/1, only on completion tokens, logprob 0 there."""
    forced_BxT = self.forced_BxT
    if forced_BxT.shape != self.tokens_BxT.shape:
      raise ValueError(f"Rollouts.forced_BxT shape {forced_BxT.shape} != tokens_BxT "
                       f"shape {self.tokens_BxT.shape}")
    if not np.isin(forced_BxT, (0, 1)).all():
      raise ValueError("Rollouts.forced_BxT must hold only 0 and 1")
    real_BxT = np.arange(forced_BxT.shape[1])[None, :] < self.lengths_B[:, None]
    if (forced_BxT.astype(bool) & ~real_BxT).any():
      raise ValueError("Rollouts.forced_BxT marks padding (positions >= lengths_B)")
    if (self.logprobs_BxT[forced_BxT.astype(bool)] != 0).any():
      raise ValueError("Rollouts.logprobs_BxT must be 0 on forced tokens (forced_BxT "
                       "= 1): they were not sampled")

  def _check_version(self) -> None:
    """version_BxT: tokens' shape, >= 0 on sampled tokens, -1 elsewhere."""
    if self.version_BxT is None:
      return
    version_BxT = np.asarray(self.version_BxT)
    if version_BxT.shape != self.tokens_BxT.shape:
      raise ValueError(f"Rollouts.version_BxT shape {version_BxT.shape} != tokens_BxT "
                       f"shape {self.tokens_BxT.shape}")
    if not np.issubdtype(version_BxT.dtype, np.integer):
      raise ValueError(f"Rollouts.version_BxT must hold integers, got dtype "
                       f"{version_BxT.dtype}")
    real_BxT = np.arange(version_BxT.shape[1])[None, :] < self.lengths_B[:, None]
    sampled_BxT = real_BxT & ~self.forced_BxT.astype(bool)
    if (version_BxT[sampled_BxT] < 0).any():
      raise ValueError("Rollouts.version_BxT must be >= 0 on sampled tokens")
    if (version_BxT[~sampled_BxT] != -1).any():
      raise ValueError("Rollouts.version_BxT must be -1 on padding and forced tokens "
                       "(forced_BxT = 1)")
    object.__setattr__(self, "version_BxT", version_BxT.astype(np.int32, copy=False))

  @property
  def interrupted_B(self) -> np.ndarray:
    """bool, the rollouts with forced tokens (interrupted at a thinking budget)."""
    return self.forced_BxT.any(axis=1)

  @classmethod
  def from_sequences(cls, tokens: Sequence[Sequence[int]],
                     logprobs: Sequence[Sequence[float]],
                     finish_reasons: Sequence[str],
                     forced: Sequence[Sequence[int]] | None = None,
                     versions: Sequence[Sequence[int]] | None = None) -> Rollouts:
    """Builds Rollouts from ragged per-rollout lists, right-padding with 0.

    Args:
      tokens: one list of completion token ids per rollout (prompt-major).
      logprobs: one list of per-token logprobs per rollout, same lengths.
      finish_reasons: "stop" or "length" per rollout.
      forced: optional 0/1 list per rollout, same lengths: 1 on appended
        (not sampled) tokens; see `forced_BxT`.
      versions: optional weight-version label list per rollout, same lengths
        (-1 on forced tokens); see `version_BxT`. None: unlabelled.
    """
    forced = [[0] * len(t) for t in tokens] if forced is None else forced
    if not len(tokens) == len(logprobs) == len(finish_reasons) == len(forced):
      raise ValueError(
          f"from_sequences: got {len(tokens)} token lists, {len(logprobs)} "
          f"logprob lists, {len(finish_reasons)} finish reasons and {len(forced)} "
          f"forced-token lists")
    if versions is not None and len(versions) != len(tokens):
      raise ValueError(f"from_sequences: got {len(tokens)} token lists and "
                       f"{len(versions)} version lists")
    b = len(tokens)
    lengths = np.array([len(t) for t in tokens], dtype=np.int32)
    width = int(lengths.max()) if b else 0
    tokens_BxT = np.zeros((b, width), np.int32)
    logprobs_BxT = np.zeros((b, width), np.float32)
    forced_BxT = np.zeros((b, width), np.int32)
    version_BxT = None if versions is None else np.full((b, width), -1, np.int32)
    for i, (t, lp, f) in enumerate(zip(tokens, logprobs, forced)):
      if not len(t) == len(lp) == len(f):
        raise ValueError(f"from_sequences: rollout {i} has {len(t)} tokens but "
                         f"{len(lp)} logprobs and {len(f)} forced flags")
      tokens_BxT[i, :len(t)] = t
      logprobs_BxT[i, :len(lp)] = lp
      forced_BxT[i, :len(f)] = f
      if versions is not None:
        if len(versions[i]) != len(t):
          raise ValueError(f"from_sequences: rollout {i} has {len(t)} tokens but "
                           f"{len(versions[i])} version labels")
        version_BxT[i, :len(t)] = versions[i]
    return cls(tokens_BxT=tokens_BxT, logprobs_BxT=logprobs_BxT,
               lengths_B=lengths,
               finish_reason_B=np.array(list(finish_reasons), dtype=str),
               num_rollouts=b, num_generated_tokens=int(lengths.sum() - forced_BxT.sum()),
               forced_BxT=forced_BxT, version_BxT=version_BxT)

  def sequences(self) -> list[list[int]]:
    """The completions as ragged lists of token ids (padding dropped)."""
    return [self.tokens_BxT[i, :l].tolist() for i, l in enumerate(self.lengths_B)]


@runtime_checkable
class Sampler(Protocol):
  """What the trainer needs from a rollout backend."""

  def generate(self, prompt_ids: list[list[int]], *, n: int, max_tokens: int,
               temperature: float, top_p: float = 1.0, top_k: int | None = None,
               stop_token_ids: Sequence[int] = (), seed: int = 0) -> Rollouts:
    """Samples n completions per prompt; temperature 0 means greedy."""
    ...

  def update_weights(self, model: nnx.Module, *, version: int | None = None) -> None:
    """Makes `generate` sample from `model`'s parameters (the trainer passes its
    Decoder: the vLLM client saves it as a checkpoint).

    `version` labels these weights in `Rollouts.version_BxT` (None: the
    previous label + 1; the weights a sampler is built with are 0). May be
    called from another thread while `generate` runs; how soon that call's
    tokens use the new weights depends on the backend.
    """
    ...


def _is_int(x) -> bool:
  """A Python or NumPy integer, and not a bool (an int to Python: True would
  silently mean 1)."""
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def is_number(x) -> bool:
  """A Python or NumPy int or float, and not a bool."""
  return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def check_count(where: str, name: str, value, *, minimum: int, none: str = "") -> None:
  """Checks a count setting: an int (not a bool: True would mean 1) >= `minimum`,
  or None where `none` says what None means. The ValueError names `where`, the
  setting and its value."""
  if value is None and none:
    return
  if not _is_int(value) or value < minimum:
    alt = f" (or None: {none})" if none else ""
    raise ValueError(f"{where}: {name}={value!r}; expected an int >= {minimum}{alt}")


def next_version(current: int, version: int | None, *, where: str) -> int:
  """The label of weights passed to `update_weights`: `version`, checked, or
  `current` + 1 when None. `where` names the caller in the error."""
  if version is None:
    return current + 1
  if not _is_int(version) or version < 0:
    raise ValueError(f"{where}: version={version!r}; expected an int >= 0 (or None: "
                     f"the current label + 1)")
  return int(version)


class VersionLabels:
  """The weight-version label of every pair's tokens (`Rollouts.version_BxT`),
  filled as a sampler emits them, call by call."""

  def __init__(self, num_pairs: int, width: int):
    self.version_PxT = np.full((num_pairs, width), -1, np.int32)  # -1: not (yet) emitted
    self._emitted_P = np.zeros((num_pairs,), np.int32)

  def add(self, emitted_P: np.ndarray, label: int) -> None:
    """Labels the tokens emitted since the last call (`emitted_P`: tokens per
    pair so far, the outputs' lengths) with `label`."""
    new_P = np.flatnonzero(emitted_P != self._emitted_P)
    t_T = np.arange(self.version_PxT.shape[1])
    new_NxT = ((t_T >= self._emitted_P[new_P, None]) & (t_T < emitted_P[new_P, None]))
    self.version_PxT[new_P] = np.where(new_NxT, label, self.version_PxT[new_P])
    self._emitted_P = emitted_P.astype(np.int32)


def check_sampling(temperature=0.0, top_p=1.0, top_k=None, *, prefix: str = "") -> None:
  """Checks sampling settings: temperature 0 (greedy) or a number >=
  MIN_TEMPERATURE, top_p in (0, 1] (1 = off), top_k None or an int >= 0 (0 = off).
  The ValueError names the setting as `prefix` + its name (a config's fields:
  "config.sampler.")."""
  if not (is_number(temperature) and np.isfinite(temperature) and temperature >= 0):
    raise ValueError(f"{prefix}temperature={temperature!r} must be a number >= 0 "
                     f"(0 = greedy)")
  if 0 < temperature < MIN_TEMPERATURE:
    raise ValueError(f"{prefix}temperature={temperature!r} is below {MIN_TEMPERATURE}: "
                     f"vLLM would sample at {MIN_TEMPERATURE}, and far below it logits / "
                     "temperature lose float32 precision; use 0 for greedy decoding")
  if not (is_number(top_p) and 0 < top_p <= 1):
    raise ValueError(f"{prefix}top_p={top_p!r} must be in (0, 1] (1 = off)")
  if top_k is not None and (not _is_int(top_k) or top_k < 0):
    raise ValueError(f"{prefix}top_k={top_k!r} must be None or an int >= 0 (0 = off)")


def validate_request(prompt_ids: Sequence[Sequence[int]], *, n: int,
                     max_tokens: int, temperature: float, top_p: float = 1.0,
                     top_k: int | None = None, stop_token_ids: Sequence[int] = (),
                     seed: int = 0, vocab_size: int | None = None,
                     max_model_len: int | None = None) -> None:
  """Checks a generate() request before any work is done.

  Raises ValueError naming the offending argument. `max_model_len` is the
  model's context (e.g. max_position_embeddings): every prompt plus
  `max_tokens` must fit in it. `seed` is an int in [0, 2**64).
  """
  if not _is_int(seed) or not 0 <= seed < MAX_SEED:
    raise ValueError(f"seed={seed!r} must be an int in [0, 2**64)")
  if not isinstance(prompt_ids, Sequence) or isinstance(prompt_ids, (str, bytes)):
    raise ValueError(f"prompt_ids must be a list of token-id lists, got "
                     f"{type(prompt_ids).__name__}")
  if len(prompt_ids) == 0:
    raise ValueError("prompt_ids is empty: need at least one prompt")
  if not _is_int(n) or n < 1:
    raise ValueError(f"n must be a positive int, got {n!r}")
  if not _is_int(max_tokens) or max_tokens < 1:
    raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
  check_sampling(temperature, top_p, top_k)
  if (isinstance(stop_token_ids, (str, bytes))
      or not isinstance(stop_token_ids, Sequence | np.ndarray)):
    raise ValueError(f"stop_token_ids must be a list of token ids (() for none), got "
                     f"{stop_token_ids!r}")
  for s in stop_token_ids:
    if not _is_int(s) or s < 0 or (
        vocab_size is not None and s >= vocab_size):
      raise ValueError(f"stop_token_ids entry {s!r} is not a token id in "
                       f"[0, {vocab_size})")
  for i, p in enumerate(prompt_ids):
    if isinstance(p, (str, bytes)) or not isinstance(p, Sequence | np.ndarray):
      raise ValueError(f"prompt_ids[{i}] must be a list of ints, got "
                       f"{type(p).__name__}")
    if len(p) == 0:
      raise ValueError(f"prompt_ids[{i}] is empty")
    try:
      arr = np.asarray(p)
    except ValueError:  # ragged: a list among the ints
      arr = np.asarray(p, dtype=object)
    if arr.ndim != 1:
      raise ValueError(f"prompt_ids[{i}] must be a flat list of ints, got nested lists "
                       f"(shape {arr.shape})")
    if not np.issubdtype(arr.dtype, np.integer):
      raise ValueError(f"prompt_ids[{i}] has non-integer entries (dtype {arr.dtype})")
    if vocab_size is not None:
      if arr.min() < 0 or arr.max() >= vocab_size:
        raise ValueError(
            f"prompt_ids[{i}] has token ids outside [0, {vocab_size}): "
            f"min {int(arr.min())}, max {int(arr.max())}")
    if max_model_len is not None and len(p) + max_tokens > max_model_len:
      raise ValueError(
          f"prompt_ids[{i}] has {len(p)} tokens; with max_tokens={max_tokens} "
          f"that is {len(p) + max_tokens} > the sampler's context of "
          f"{max_model_len} tokens (its max_model_len)")
