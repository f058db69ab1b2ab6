"""Reading vLLM's OpenAI-compatible answers: every field checked, by name.

A malformed answer (a server of another version, a proxy in between) fails with
a `VLLMResponseError` naming the URL and the field, never a KeyError or a
silently wrong rollout.
"""

from __future__ import annotations

import math
from typing import Any

from isojax.rollout.base import FINISH_LENGTH, FINISH_STOP, VLLMResponseError

# A log-probability is <= 0; a token of probability ~1 may come back a rounding
# error above it, never more.
LOGPROB_TOLERANCE = 1e-3
# vLLM writes a -inf log-probability as this (JSON has no -inf); a sampled token
# at or below it had probability 0, and the trainer's ratio against it is inf.
VLLM_NEG_INF_LOGPROB = -9999.0


def parse_completion(body: Any, *, prompts: list[list[int]], n: int, url: str,
                     vocab_size: int | None = None, max_tokens: int | None = None
                     ) -> tuple[list[list[int]], list[list[float]], list[str]]:
  """Checks and unpacks one /v1/completions answer for a batch of prompts.

  Returns (token ids, logprobs, finish reasons) for its len(prompts) * n
  choices in prompt-major index order. Raises VLLMResponseError naming the
  first missing or malformed field, or the value out of range: a token id >=
  `vocab_size` (the trainer's gather would clamp it and score another token),
  more than `max_tokens` tokens, a log-probability above 0 (beyond
  LOGPROB_TOLERANCE) or not finite (NaN, -inf, or vLLM's stand-in for -inf,
  VLLM_NEG_INF_LOGPROB). None skips the check.
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
    echoed = c.get("prompt_token_ids")
    if echoed is not None and (not isinstance(echoed, list) or echoed != prompt):
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
    bad = [t for t, x in enumerate(lps)
           if not isinstance(x, (int, float)) or isinstance(x, bool)]
    if bad:
      raise VLLMResponseError(
          f"vLLM answer from {url}: field '{where}logprobs.token_logprobs[{bad[0]}]' "
          f"is {lps[bad[0]]!r}: it holds null/non-numeric values at {len(bad)} of "
          f"{len(lps)} positions (was the request sent with logprobs=0? a NaN the "
          f"server wrote as null?)")
    _check_finite(ids, lps, url, where)
    _check_ranges(ids, lps, vocab_size, max_tokens, url, where)
    reason = c.get("finish_reason")
    if reason not in (FINISH_STOP, FINISH_LENGTH):
      raise VLLMResponseError(
          f"vLLM answer from {url}: field '{where}finish_reason' is {reason!r}, "
          f"expected 'stop' or 'length'")
    tokens.append(ids)
    logprobs.append([float(x) for x in lps])
    finish.append(reason)
  return tokens, logprobs, finish


def _check_finite(ids: list, lps: list, url: str, where: str) -> None:
  """Every sampled token's log-probability finite. Caught here, a NaN or -inf
  names its answer and position; passed on, it would surface only later, as a
  non-finite update (vLLM's -9999.0 is finite) or an error blaming the
  learning rate."""
  for t, x in enumerate(lps):
    if not math.isfinite(x) or x <= VLLM_NEG_INF_LOGPROB:
      shown = f"{x!r} (vLLM's stand-in for -inf)" if math.isfinite(x) else repr(float(x))
      raise VLLMResponseError(
          f"vLLM answer from {url}: field '{where}logprobs.token_logprobs[{t}]' is "
          f"{shown}, the log-probability of sampled token {ids[t]} at position {t}; "
          f"a sampled token's log-probability must be finite (the server's logits "
          f"were inf/NaN, from non-finite pushed weights or a dtype that overflows)")


def _check_ranges(ids: list, lps: list, vocab_size: int | None, max_tokens: int | None,
                  url: str, where: str) -> None:
  """Token ids in the vocabulary, at most max_tokens of them, log-probs <= 0."""
  if vocab_size is not None and ids and max(ids) >= vocab_size:
    raise VLLMResponseError(f"vLLM answer from {url}: field '{where}token_ids' holds "
                            f"token id {max(ids)}, outside the vocabulary of "
                            f"vocab_size={vocab_size}")
  if max_tokens is not None and len(ids) > max_tokens:
    raise VLLMResponseError(f"vLLM answer from {url}: field '{where}token_ids' holds "
                            f"{len(ids)} tokens, more than max_tokens={max_tokens}")
  if lps and max(lps) > LOGPROB_TOLERANCE:
    raise VLLMResponseError(f"vLLM answer from {url}: field '{where}logprobs."
                            f"token_logprobs' holds log-probability {max(lps)!r} > 0")


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
