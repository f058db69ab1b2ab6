"""Reading vLLM's OpenAI-compatible answers: every field checked, by name.

A malformed answer (a server of another version, a proxy in between) fails with
a `VLLMResponseError` naming the URL and the field, never a KeyError or a
silently wrong rollout.
"""

from __future__ import annotations

import math
from typing import Any

from isojax.rollout.base import FINISH_LENGTH, FINISH_STOP, VLLMResponseError


def parse_completion(body: Any, *, prompts: list[list[int]], n: int, url: str
                     ) -> tuple[list[list[int]], list[list[float]], list[str]]:
  """Checks and unpacks one /v1/completions answer for a batch of prompts.

  Returns (token ids, logprobs, finish reasons) for its len(prompts) * n
  choices in prompt-major index order. Raises VLLMResponseError naming the
  first missing or malformed field.
  """
  choices = answer_field(body, "choices", list, url)
  b = len(prompts) * n
  if len(choices) != b:
    raise VLLMResponseError(f"vLLM answer from {url}: field 'choices' has "
                            f"{len(choices)} entries, expected {len(prompts)} prompts "
                            f"x n={n} = {b}")
  by_index = {}
  for c in choices:
    idx = answer_field(c, "index", int, url, "choices[].")
    if not 0 <= idx < b or idx in by_index:
      raise VLLMResponseError(f"vLLM answer from {url}: field 'choices[].index' "
                              f"has bad or repeated value {idx} (expected 0..{b - 1})")
    by_index[idx] = c
  tokens, logprobs, finish = [], [], []
  for j in range(b):
    c, where = by_index[j], f"choices[{j}]."
    prompt = prompts[j // n]
    if c.get("prompt_token_ids") is not None and list(c["prompt_token_ids"]) != prompt:
      raise VLLMResponseError(
          f"vLLM answer from {url}: field '{where}prompt_token_ids' does not match "
          f"the prompt sent (the server re-tokenised it?)")
    ids = answer_field(c, "token_ids", list, url, where)
    lp_obj = answer_field(c, "logprobs", dict, url, where)
    lps = answer_field(lp_obj, "token_logprobs", list, url, where + "logprobs.")
    if len(lps) != len(ids):
      raise VLLMResponseError(
          f"vLLM answer from {url}: field '{where}logprobs.token_logprobs' has "
          f"{len(lps)} entries but '{where}token_ids' has {len(ids)}")
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
      raise VLLMResponseError(f"vLLM answer from {url}: field '{where}token_ids' "
                              f"holds non-token values")
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool)
               and not math.isnan(x) for x in lps):
      raise VLLMResponseError(
          f"vLLM answer from {url}: field '{where}logprobs.token_logprobs' holds "
          f"null/NaN/non-numeric values (was the request sent with logprobs=0?)")
    reason = c.get("finish_reason")
    if reason not in (FINISH_STOP, FINISH_LENGTH):
      raise VLLMResponseError(
          f"vLLM answer from {url}: field '{where}finish_reason' is {reason!r}, "
          f"expected 'stop' or 'length'")
    tokens.append(ids)
    logprobs.append([float(x) for x in lps])
    finish.append(reason)
  return tokens, logprobs, finish


def answer_field(obj: Any, name: str, kind: type, url: str, where: str = "") -> Any:
  """`obj[name]`, checked to be a `kind`; VLLMResponseError naming the field
  (`where` + name) and the URL otherwise."""
  if not isinstance(obj, dict):
    raise VLLMResponseError(f"vLLM answer from {url}: expected a JSON object "
                            f"holding field '{where}{name}', got {type(obj).__name__}")
  if name not in obj or obj[name] is None:
    raise VLLMResponseError(f"vLLM answer from {url}: field '{where}{name}' is missing")
  value = obj[name]
  if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
    raise VLLMResponseError(f"vLLM answer from {url}: field '{where}{name}' is "
                            f"{type(value).__name__}, expected {kind.__name__}")
  return value
