"""Forced length interruption (ScaleRL): think within a budget, then answer.

`InterruptingSampler` wraps any `Sampler` (the in-process `JaxSampler` or the
`VLLMSampler` client) and samples in two stages:

1. every rollout with `max_tokens = think_tokens`;
2. each rollout that stopped by length (not by EOS or a stop token) is
   continued once from `prompt ++ completion ++ phrase` with
   `max_tokens = answer_tokens`, all continuations in one request.

The returned completion is `completion ++ phrase ++ answer`. The phrase is
prompt-side: `Rollouts.forced_BxT` is 1 and its logprob 0 there, so the update
reads it but is not trained on it. `lengths_B` and `finish_reason_B` describe the
final sequence; `num_generated_tokens` counts the sampled tokens of both stages.

Config (`config.sampler`): `interrupt_think_tokens` (0 = off),
`interrupt_answer_tokens` (0 = what max_tokens leaves after the thinking budget
and the phrase) and `interrupt_phrase`; `interruption_from_config` checks them
before any work.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from isojax.rollout.base import FINISH_LENGTH, Rollouts, Sampler

DEFAULT_PHRASE = ("Okay, time is up. Let me stop thinking and formulate a final answer "
                  "now.")
# Continuations draw from a stream apart from the first stage's: JaxSampler keys
# its randomness by (seed, rollout index), so with the same seed the k-th
# continuation would reuse the k-th first-stage rollout's random numbers.
_SEED_STRIDE = 1_000_003
_SEED_SALT = 0x1A7E
_SEED_MOD = 2**31 - 1


class BoundedSampler(Sampler, Protocol):
  """A `Sampler` that says how many prompt + completion tokens a request may use."""

  def max_model_len(self) -> int | None:
    """The context every prompt plus max_tokens must fit in (None: unbounded)."""
    ...


@dataclasses.dataclass(frozen=True)
class Interruption:
  """A checked interruption setting (see `interruption_from_config`).

  Attributes:
    think_tokens: the thinking budget: tokens sampled before the interruption.
    answer_tokens: tokens sampled after the phrase.
    phrase_ids: the end-of-thinking phrase's token ids (non-empty).
  """
  think_tokens: int
  answer_tokens: int
  phrase_ids: tuple[int, ...]

  def __post_init__(self):
    if self.think_tokens < 1 or self.answer_tokens < 1 or not self.phrase_ids:
      raise ValueError(f"Interruption needs think_tokens >= 1, answer_tokens >= 1 and a "
                       f"non-empty phrase; got {self.think_tokens}, {self.answer_tokens} "
                       f"and {len(self.phrase_ids)} phrase tokens")

  @property
  def completion_tokens(self) -> int:
    """The longest completion: thinking budget + phrase + answer budget."""
    return self.think_tokens + len(self.phrase_ids) + self.answer_tokens


def interruption_from_config(sampler_config, *, max_tokens: int,
                             encode: Callable[[str], Sequence[int]]
                             ) -> Interruption | None:
  """The run's interruption setting, or None when off; checks it before any work.

  Args:
    sampler_config: `config.sampler`, with interrupt_think_tokens (0 = off),
      interrupt_answer_tokens (0 = max_tokens less the thinking budget and the
      phrase) and interrupt_phrase.
    max_tokens: the run's response-length cap (config.sampler.max_tokens
      resolved): thinking budget + phrase + answer budget must fit in it.
    encode: the model's tokenizer, text -> ids without special tokens (e.g.
      `isojax.models.Tokenizer.encode`); called only when interruption is on.

  Raises:
    ValueError: naming the `config.sampler.<field>`, for a negative budget, a
      thinking budget >= max_tokens, a phrase that tokenises to nothing, or a
      total that exceeds max_tokens.
  """
  think = int(sampler_config.interrupt_think_tokens)
  answer = int(sampler_config.interrupt_answer_tokens)
  for name, value in (("interrupt_think_tokens", think),
                      ("interrupt_answer_tokens", answer)):
    if value < 0:
      raise ValueError(f"config.sampler.{name}={value} must be >= 0")
  if think == 0:
    return None
  if think >= max_tokens:
    raise ValueError(f"config.sampler.interrupt_think_tokens={think} must be below "
                     f"max_tokens={max_tokens} (config.sampler.max_tokens): the phrase "
                     f"and the answer come after it")
  phrase = sampler_config.interrupt_phrase
  phrase_ids = tuple(int(t) for t in encode(phrase))
  if not phrase_ids:
    raise ValueError(f"config.sampler.interrupt_phrase={phrase!r} tokenises to no "
                     f"tokens with this model's tokenizer")
  left = max_tokens - think - len(phrase_ids)
  if answer == 0:
    answer = left
  if answer < 1 or answer > left:
    raise ValueError(
        f"config.sampler.interrupt_answer_tokens={sampler_config.interrupt_answer_tokens}"
        f": interrupt_think_tokens={think} + the phrase's {len(phrase_ids)} tokens + the "
        f"answer budget must fit in max_tokens={max_tokens} (config.sampler.max_tokens), "
        f"which leaves {left} for the answer")
  return Interruption(think_tokens=think, answer_tokens=answer, phrase_ids=phrase_ids)


def continuation_seed(seed: int) -> int:
  """The seed of a request's continuations, a function of the request's seed alone."""
  return (int(seed) * _SEED_STRIDE + _SEED_SALT) % _SEED_MOD


class InterruptingSampler:
  """A `Sampler` that interrupts rollouts at a thinking budget (see the module doc).

  Args:
    sampler: the backend (`JaxSampler`, `VLLMSampler`, ...) with `max_model_len()`.
    interruption: the budgets and phrase (`interruption_from_config`).
  """

  def __init__(self, sampler: BoundedSampler, interruption: Interruption):
    self.sampler = sampler
    self.interruption = interruption

  def max_model_len(self) -> int | None:
    """The wrapped sampler's context."""
    return self.sampler.max_model_len()

  def update_weights(self, model: Any, *, version: int | None = None) -> None:
    """Passes `model` and its version label to the wrapped sampler: both stages
    sample from it (a stage already in flight as the backend allows)."""
    self.sampler.update_weights(model, version=version)

  def cache_layouts(self, num_prompts: int, n: int, longest_prompt: int,
                    max_tokens: int) -> tuple:
    """The wrapped sampler's caches of `generate`'s two calls: the thinking call,
    then (at most) every rollout continued, its prompt grown by the thinking
    budget and the phrase (`JaxSampler.cache_layouts`)."""
    spec = self.interruption
    return (*self.sampler.cache_layouts(num_prompts, n, longest_prompt, spec.think_tokens),
            *self.sampler.cache_layouts(
                num_prompts * n, 1, longest_prompt + spec.think_tokens + len(spec.phrase_ids),
                spec.answer_tokens))

  def close(self) -> None:
    """Closes the wrapped sampler, if it has anything to close."""
    close = getattr(self.sampler, "close", None)
    if close is not None:
      close()

  def generate(self, prompt_ids: list[list[int]], *, n: int, max_tokens: int,
               temperature: float, top_p: float = 1.0, top_k: int | None = None,
               stop_token_ids: Sequence[int] = (), seed: int = 0) -> Rollouts:
    """Samples n completions per prompt, interrupting those that reach the budget.

    `max_tokens` is the caller's completion width: thinking budget + phrase +
    answer budget must fit in it, and every prompt + that total in the
    sampler's context (both checked before any work, naming the numbers). The
    continuations use the same sampling settings and stop tokens, and the seed
    `continuation_seed(seed)`.
    """
    self._check_fits(prompt_ids, max_tokens)
    spec = self.interruption
    sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k,
                    stop_token_ids=stop_token_ids)
    thought = self.sampler.generate(prompt_ids, n=n, max_tokens=spec.think_tokens,
                                    seed=seed, **sampling)
    rows = np.flatnonzero(thought.finish_reason_B == FINISH_LENGTH)
    if not len(rows):
      return thought
    completions = thought.sequences()
    phrase = list(spec.phrase_ids)
    continuations = [list(prompt_ids[r // n]) + completions[r] + phrase for r in rows]
    answered = self.sampler.generate(continuations, n=1, max_tokens=spec.answer_tokens,
                                     seed=continuation_seed(seed), **sampling)
    return _splice(thought, rows, phrase, answered)

  def _check_fits(self, prompt_ids: Sequence[Sequence[int]], max_tokens: int) -> None:
    spec, total = self.interruption, self.interruption.completion_tokens
    if total > max_tokens:
      raise ValueError(
          f"forced interruption: thinking budget {spec.think_tokens} + phrase "
          f"{len(spec.phrase_ids)} + answer budget {spec.answer_tokens} = {total} "
          f"tokens > max_tokens={max_tokens}")
    context = self.sampler.max_model_len()
    if context is None or not len(prompt_ids):
      return  # an empty request fails in the sampler's own check
    longest = int(np.argmax([len(p) for p in prompt_ids]))
    if len(prompt_ids[longest]) + total > context:
      raise ValueError(
          f"forced interruption: prompt_ids[{longest}] has {len(prompt_ids[longest])} "
          f"tokens; with thinking budget {spec.think_tokens} + phrase "
          f"{len(spec.phrase_ids)} + answer budget {spec.answer_tokens} that is "
          f"{len(prompt_ids[longest]) + total} > the sampler's context of {context}")


def _splice(thought: Rollouts, rows: np.ndarray, phrase: list[int],
            answered: Rollouts) -> Rollouts:
  """`thought` with row rows[k] extended by phrase ++ answered's k-th completion.

  Version labels: the answer keeps the continuation call's, the phrase gets -1
  (not sampled); unlabelled (None) when either call was.
  """
  tokens = thought.sequences()
  logprobs = [thought.logprobs_BxT[i, :len(t)].tolist() for i, t in enumerate(tokens)]
  forced = [[0] * len(t) for t in tokens]
  labelled = thought.version_BxT is not None and answered.version_BxT is not None
  versions = ([thought.version_BxT[i, :len(t)].tolist() for i, t in enumerate(tokens)]
              if labelled else None)
  finish = thought.finish_reason_B.tolist()
  answers = answered.sequences()
  for k, r in enumerate(rows):
    answer = answers[k]
    tokens[r] = tokens[r] + phrase + answer
    logprobs[r] = (logprobs[r] + [0.0] * len(phrase)
                   + answered.logprobs_BxT[k, :len(answer)].tolist())
    forced[r] = forced[r] + [1] * len(phrase) + [0] * len(answer)
    if labelled:
      versions[r] = (versions[r] + [-1] * len(phrase)
                     + answered.version_BxT[k, :len(answer)].tolist())
    finish[r] = answered.finish_reason_B[k]
  return Rollouts.from_sequences(tokens, logprobs, finish, forced=forced,
                                 versions=versions)
