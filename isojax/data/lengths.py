"""Prompts against the model's context, checked when the data is loaded.

Every rollout of a problem needs its prompt plus `max_tokens` response tokens
inside the model's context. A problem that cannot fit would otherwise fail the
run at whatever step first samples it (and again at the same step after every
resume), so the whole problem set is checked once, up front: an error names the
file and line, the problem id, its length and the limit; or, when asked, such
problems are dropped and counted.

A prompt far longer than the limit (a 10 MB prompt) is never tokenised whole:
its first `PREFIX_CHARS_PER_TOKEN * limit` characters are, which already hold
more than `limit` tokens for any real tokenizer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from isojax.data.sources import Problem, encode_prompts

# No tokenizer's tokens average anywhere near this many characters, so a prefix of
# this many characters per allowed token is either too long already or the whole
# prompt is encoded. It bounds the work on a huge prompt to ~limit * 32 characters.
PREFIX_CHARS_PER_TOKEN = 32


@dataclasses.dataclass(frozen=True)
class TooLong:
  """A problem whose prompt does not fit; `tokens` is a lower bound when `at_least`."""

  problem: Problem
  tokens: int
  at_least: bool

  def describe(self, limit: int) -> str:
    p = self.problem
    where = f"{p.where}: " if p.where else ""
    size = f"{'more than ' if self.at_least else ''}{self.tokens}"
    return f"{where}problem {p.id!r} has a prompt of {size} tokens > the limit of {limit}"


def fit_prompts(tokenizer, problems: Sequence[Problem], *, context: int, max_tokens: int,
                drop: bool = False, what: str = "problem",
                **encode_kwargs) -> tuple[list[Problem], list[list[int]], list[TooLong]]:
  """Encodes the prompts of `problems` and checks prompt + max_tokens <= context.

  Args:
    tokenizer: as for `encode_prompts`.
    problems: the problems (their `where` names them in messages).
    context: the model's context length in tokens.
    max_tokens: the response budget each rollout may use.
    drop: leave out problems that do not fit (reported in the third return value)
      instead of raising.
    what: how messages name the set, e.g. "training problem".
    **encode_kwargs: chat_template, system_prompt, prompt_template.

  Returns:
    (kept problems, their prompt ids, the problems left out).

  Raises:
    ValueError: when `drop` is False and a prompt does not fit, naming the first
      few (file:line, id, length, limit) and how many there are; or when
      max_tokens alone does not fit the context.
  """
  limit = int(context) - int(max_tokens)
  if limit < 1:
    raise ValueError(f"config.sampler.max_tokens={max_tokens} leaves no room for a prompt "
                     f"in the model's context of {context} tokens")
  kept, ids, too_long = [], [], []
  cap = PREFIX_CHARS_PER_TOKEN * limit
  for p in problems:
    if len(p.prompt) > cap:
      head = encode_prompts(tokenizer, [dataclasses.replace(p, prompt=p.prompt[:cap])],
                            **encode_kwargs)[0]
      if len(head) > limit:
        too_long.append(TooLong(p, len(head), at_least=True))
        continue
    x = encode_prompts(tokenizer, [p], **encode_kwargs)[0]
    if len(x) > limit:
      too_long.append(TooLong(p, len(x), at_least=False))
      continue
    kept.append(p)
    ids.append(x)
  if too_long and not drop:
    shown = "; ".join(t.describe(limit) for t in too_long[:3])
    more = f" (and {len(too_long) - 3} more)" if len(too_long) > 3 else ""
    raise ValueError(
        f"{len(too_long)} {what}(s) of {len(problems)} do not fit the model's context: "
        f"{shown}{more}. The limit is the context of {context} tokens minus "
        f"config.sampler.max_tokens={max_tokens}; shorten them, lower max_tokens, or "
        f"set config.data.drop_too_long=True to leave them out")
  return kept, ids, too_long
