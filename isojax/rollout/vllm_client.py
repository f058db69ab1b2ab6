"""`VLLMSampler`: rollouts from a vLLM server over its OpenAI-compatible API.

Prompts go out as token ids and completions come back as token ids
(`return_token_ids`), with the logprob of each sampled token (`logprobs=0`);
text is never re-tokenised, so the trainer sees exactly the tokens that were
sampled. The server must run with `--logprobs-mode processed_logprobs` (the
logprobs of the distribution actually sampled from, after temperature/top-p)
and `--generation-config vllm` (no sampling defaults from the model directory);
`isojax.rollout.vllm_server.VLLMServer` starts it that way.

Prompts go out `prompts_per_request` at a time, each request with `n` samples;
requests run on a bounded thread pool and the server batches them. A request
whose first prompt is prompt i carries seed `seed * 1_000_003 + i * n`, and vLLM
seeds the j-th sample of each of its prompts with seed + j, so a call is
reproducible. With the default `prompts_per_request=1` every rollout has its
own random stream. With more prompts per request (fewer HTTP round trips,
~3x the throughput of a tiny model on a 2-core CPU), prompts in one request
share their samples' random streams: each rollout is still an exact sample of
its prompt, but rollouts of different prompts are dependent. A prompt is never
sent twice in one request (it would get identical samples).

Answers are checked field by field, token ids against the vocabulary, lengths
against max_tokens, log-probs against 0 and for finiteness
(`isojax.rollout.vllm_answers`). Weight sync (`update_weights`) is in
`isojax.rollout.weight_sync`. vLLM does
not say which tokens of a request came after a reload, so every token of a
`generate` call carries the version label current when the call started
(`Rollouts.version_BxT`): a lower bound on the weights that sampled it. With
`in_flight=True` an update keeps the server's running requests and continues
them with the new weights; otherwise it waits for them to finish.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import requests
from absl import logging

from isojax.rollout import weight_sync
from isojax.rollout.base import (Rollouts, VLLMError, VLLMPausedError, VLLMResponseError,
                                 next_version, validate_request)
from isojax.rollout.daemon_pool import DaemonPool
from isojax.rollout.vllm_answers import answer_field, parse_completion

_SEED_STRIDE = 1_000_003
_SEED_MOD = 2**62


class VLLMSampler:
  """A `Sampler` backed by a running vLLM server.

  Args:
    base_url: e.g. "http://127.0.0.1:8000" (no trailing /v1).
    weights_root: directory for the weight snapshots `update_weights` writes;
      it must be readable by the server under the same path (same machine or a
      shared filesystem). Defaults to a fresh temp dir, removed by `close()`.
    max_concurrency: requests in flight at once (the thread-pool size).
    request_timeout_s: read timeout of one request (a server that accepts
      connections but never answers fails after this long).
    connect_timeout_s: TCP connect timeout.
    probe_timeout_s: read timeout of the first contact (`model_info`, which
      `wait_until_ready` calls); a start against a hung server fails this fast.
    wait_log_s: while `generate` waits on the server, a log line this often.
    max_retries: retries after a connection error or HTTP 503, with exponential
      backoff `backoff_s * 2**k`; a server that stays down fails after about
      `backoff_s * (2**max_retries - 1)` seconds.
    backoff_s: first backoff.
    eos_token_ids: tokens that end a completion besides `stop_token_ids`. None:
      the `eos_token_id` of the served model's config.json (what JaxSampler
      stops on; where its directory is not visible here, that of the first
      model `update_weights` pushes, and none before it, with a warning); ()
      to stop only on `stop_token_ids`. The client owns the stop
      set: requests carry `ignore_eos=true` plus the explicit list, because
      the server's own idea of EOS depends on its tokenizer (none with
      --skip-tokenizer-init) and generation_config.json.
    keep_last: weight snapshots kept on disk (the live one and the one before).
    prompts_per_request: prompts batched into one HTTP request (see above).
    in_flight: an update pauses the server keeping its requests in flight and
      continues them with the new weights (`WeightSync`), instead of waiting
      for them to finish (no overlap of sampling and reloading).
  """

  def __init__(self, base_url: str, *, weights_root: str | None = None,
               max_concurrency: int = 64, request_timeout_s: float = 600.0,
               connect_timeout_s: float = 5.0, max_retries: int = 4,
               backoff_s: float = 0.5, eos_token_ids: Sequence[int] | None = None,
               keep_last: int = 2, prompts_per_request: int = 1,
               probe_timeout_s: float = 30.0, wait_log_s: float = 60.0,
               in_flight: bool = False):
    if not base_url.startswith(("http://", "https://")):
      raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
    self.base_url = base_url.rstrip("/").removesuffix("/v1")
    if prompts_per_request < 1 or max_concurrency < 1:
      raise ValueError(f"prompts_per_request={prompts_per_request} and "
                       f"max_concurrency={max_concurrency} must be >= 1")
    self.prompts_per_request = int(prompts_per_request)
    self.max_concurrency = int(max_concurrency)
    self.request_timeout_s = float(request_timeout_s)
    self.connect_timeout_s = float(connect_timeout_s)
    self.probe_timeout_s = float(probe_timeout_s)
    self.wait_log_s = float(wait_log_s)
    for name in ("request_timeout_s", "connect_timeout_s", "probe_timeout_s",
                 "wait_log_s"):
      value = getattr(self, name)
      if not 0 < value < math.inf:
        raise ValueError(f"{name}={value} must be a positive, finite number of seconds")
    if (not isinstance(max_retries, int) or isinstance(max_retries, bool)
        or max_retries < 0):
      raise ValueError(f"max_retries={max_retries!r} must be an int >= 0 (0: no retry)")
    if not 0 <= backoff_s < math.inf:
      raise ValueError(f"backoff_s={backoff_s!r} must be a finite number of seconds >= 0")
    self.max_retries = int(max_retries)
    self.backoff_s = float(backoff_s)
    self._eos_token_ids = None if eos_token_ids is None else tuple(map(int, eos_token_ids))
    self._warned_no_eos = False
    self._local = threading.local()
    self._sessions: list[requests.Session] = []  # every thread's, for close()
    self._sessions_lock = threading.Lock()
    self._pool: DaemonPool | None = None
    self._model_info: dict[str, Any] | None = None
    self.weights = weight_sync.WeightSync(self, weights_root=weights_root,
                                          keep_last=keep_last, in_flight=in_flight)
    self._version = 0  # the label of the weights the server serves; replaced whole

  # -- HTTP -----------------------------------------------------------------

  def _session(self) -> requests.Session:
    s = getattr(self._local, "session", None)
    if s is None:
      s = self._local.session = requests.Session()
      with self._sessions_lock:
        self._sessions.append(s)
    return s

  def request(self, method: str, path: str, *, json_body: Any = None,
              params: dict | None = None, timeout_s: float | None = None) -> Any:
    """One HTTP call with retries; returns the decoded JSON (None if empty).

    Raises:
      VLLMError: naming the URL, when the server stays unreachable through all
        retries, times out, answers with an HTTP error or sends a broken
        answer (only refused connections and HTTP 503 are retried).
    """
    url = f"{self.base_url}{path}"
    timeout = (self.connect_timeout_s, timeout_s or self.request_timeout_s)
    for attempt in range(self.max_retries + 1):
      try:
        r = self._session().request(method, url, json=json_body, params=params,
                                    timeout=timeout)
      except requests.ConnectionError as e:
        # Covers refused/reset connections and connect timeouts: nothing was
        # processed, so sending again is safe.
        if attempt == self.max_retries:
          raise VLLMError(
              f"vLLM server at {url} is unreachable after {attempt + 1} attempts "
              f"(~{self.backoff_s * (2**attempt - 1):.1f} s of backoff): {e}") from e
        time.sleep(self.backoff_s * 2**attempt)
        continue
      except requests.Timeout as e:
        raise VLLMError(f"vLLM server at {url} did not answer within "
                        f"{timeout[1]:g} s (it accepts connections but does not "
                        f"respond: overloaded or hung?): {e}") from e
      except requests.RequestException as e:
        # An answer cut off or undecodable (a body shorter than its length, a
        # bad chunk): the server may have acted on the request, so it is not
        # sent again.
        raise VLLMError(f"vLLM server at {url} sent a broken answer to {method} "
                        f"({type(e).__name__}): {e}") from e
      if r.status_code == 503 and attempt < self.max_retries:
        time.sleep(self.backoff_s * 2**attempt)
        continue
      if r.status_code != 200:
        raise VLLMError(f"vLLM server at {url} answered HTTP {r.status_code}: "
                        f"{r.text[:1000]}")
      if not r.content:
        return None
      try:
        # The standard library's decoder, which reads NaN and -Infinity, so that
        # a non-finite log-probability is refused by field and position;
        # r.json() uses simplejson where installed, which refuses them as non-JSON.
        return json.loads(r.content)
      except ValueError as e:
        raise VLLMResponseError(
            f"vLLM server at {url} answered non-JSON: {r.text[:300]!r}") from e
    raise AssertionError("unreachable")

  def model_info(self) -> dict[str, Any]:
    """The served model's id, max_model_len and config.json (fetched once)."""
    if self._model_info is None:
      body = self.request("GET", "/v1/models",
                          timeout_s=min(self.probe_timeout_s, self.request_timeout_s))
      data = answer_field(body, "data", list, f"{self.base_url}/v1/models")
      if not data:
        raise VLLMResponseError(f"{self.base_url}/v1/models lists no model ('data' is empty)")
      model = data[0]
      url = f"{self.base_url}/v1/models"
      info = {"id": answer_field(model, "id", str, url, "data[0]."),
              "max_model_len": answer_field(model, "max_model_len", int, url, "data[0]."),
              "root": model.get("root")}
      info["hf_config"] = _read_hf_config(info["root"])
      self._model_info = info
    return self._model_info

  def wait_until_ready(self) -> dict[str, Any]:
    """First contact, logged: the served model's info, or a VLLMError within about
    connect + probe timeout (plus the retries' backoff for a refused connection)."""
    logging.info("contacting the vLLM server at %s (connect timeout %.0f s, first "
                 "answer within %.0f s, then %.0f s per request)", self.base_url,
                 self.connect_timeout_s, min(self.probe_timeout_s, self.request_timeout_s),
                 self.request_timeout_s)
    info = self.model_info()
    logging.info("vLLM server at %s serves %r (max_model_len %d)", self.base_url,
                 info["id"], info["max_model_len"])
    return info

  def max_model_len(self) -> int:
    """The server's context: every prompt + max_tokens must fit in it."""
    return self.model_info()["max_model_len"]

  def eos_token_ids(self) -> tuple[int, ...]:
    """The tokens that end every completion (see `eos_token_ids` in the class doc)."""
    if self._eos_token_ids is None:
      config = self.model_info()["hf_config"]
      if not config:  # not cached: a weight push may make a config.json known
        if not self._warned_no_eos:
          self._warned_no_eos = True
          logging.warning("the served model's config.json is not readable here (root "
                          "%r): completions from %s end only on stop_token_ids until "
                          "update_weights pushes a model; pass eos_token_ids= to set "
                          "them", self.model_info()["root"], self.base_url)
        return ()
      eos = config.get("eos_token_id")
      eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
      self._eos_token_ids = tuple(int(e) for e in eos)
    return self._eos_token_ids

  # -- Sampler API ----------------------------------------------------------

  def generate(self, prompt_ids: list[list[int]], *, n: int, max_tokens: int,
               temperature: float, top_p: float = 1.0, top_k: int | None = None,
               stop_token_ids: Sequence[int] = (), seed: int = 0) -> Rollouts:
    """Samples n completions per prompt; see `isojax.rollout.base.Sampler`.

    Raises:
      ValueError: bad arguments, or a prompt that does not fit the server's
        context with `max_tokens` (checked before anything is sent).
      VLLMError / VLLMResponseError: server faults, naming the URL / field.
      VLLMPausedError: a weight update left the server paused and /resume
        still fails (before any request is sent, or while waiting on them).
    """
    version = self._version  # before any request: a lower bound for all its tokens
    request = dict(n=n, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                   top_k=top_k, stop_token_ids=stop_token_ids, seed=seed)
    if self._model_info is None:  # before the first contact: what needs no server
      validate_request(prompt_ids, **request)
    info = self.model_info()
    validate_request(prompt_ids, **request, vocab_size=info["hf_config"].get("vocab_size"),
                     max_model_len=info["max_model_len"])
    stops = sorted({*map(int, stop_token_ids), *self.eos_token_ids()})
    base = {"model": info["id"], "n": int(n), "max_tokens": int(max_tokens),
            "temperature": float(temperature), "top_p": float(top_p),
            "top_k": int(top_k or 0), "stop_token_ids": stops, "ignore_eos": True,
            "logprobs": 0,
            "return_token_ids": True, "return_tokens_as_token_ids": True,
            "skip_special_tokens": False}
    # vLLM rejects n > 1 with greedy sampling; the n greedy rollouts of a
    # prompt are identical, so ask for one and repeat it.
    copies = int(n) if temperature == 0 else 1
    base["n"] = int(n) // copies
    # A paused server would hold these requests until request_timeout_s and
    # then fail as "hung": resume it first, or say that it is paused.
    self.weights.ensure_resumed()
    prompts = [[int(t) for t in p] for p in prompt_ids]
    bodies = [dict(base, prompt=[prompts[i] for i in chunk],
                   seed=(int(seed) * _SEED_STRIDE + chunk[0] * int(n)) % _SEED_MOD)
              for chunk in chunk_prompts(prompts, self.prompts_per_request)]
    pool = self._executor()
    futures = [pool.submit(self._complete, b) for b in bodies]
    try:
      t0 = time.monotonic()
      pending = set(futures)
      while pending:
        _, pending = concurrent.futures.wait(
            pending, timeout=self.wait_log_s,
            return_when=concurrent.futures.FIRST_EXCEPTION)
        cancelled = sum(f.cancelled() for f in futures)
        if cancelled:
          raise VLLMError(f"VLLMSampler.close() was called while generate waited: "
                          f"{cancelled} of its {len(futures)} requests to {self.base_url} "
                          f"were cancelled")
        failed = [f for f in futures if f.done() and f.exception() is not None]
        if failed:
          raise failed[0].exception()
        paused_after = self.weights.paused_after
        if pending and paused_after is not None:  # an update on another thread
          raise VLLMPausedError(
              f"{len(pending)}/{len(futures)} requests to {self.base_url} wait on a "
              f"server left paused {paused_after} (/resume kept failing)")
        if pending:
          logging.info("waiting for %d/%d requests to %s (%.0f s so far; each fails "
                       "after %.0f s without an answer)", len(pending), len(futures),
                       self.base_url, time.monotonic() - t0, self.request_timeout_s)
      per_prompt = [f.result() for f in futures]
    except BaseException:
      for f in futures:
        f.cancel()
      raise
    tokens, logprobs, finish = [], [], []
    for t, lp, fr in per_prompt:
      tokens += [x for x in t for _ in range(copies)]
      logprobs += [x for x in lp for _ in range(copies)]
      finish += [x for x in fr for _ in range(copies)]
    return Rollouts.from_sequences(tokens, logprobs, finish,
                                   versions=[[version] * len(t) for t in tokens])

  def update_weights(self, model: Any, *, version: int | None = None) -> None:
    """Saves `model` (an isojax Decoder) and makes the server serve it.

    See `isojax.rollout.weight_sync.WeightSync.push`. May be called from
    another thread while `generate` runs. `version` labels the tokens of
    `generate` calls that start after this returns (None: the current label
    + 1); the label changes only once the server serves the new weights.
    """
    label = next_version(self._version, version, where="VLLMSampler.update_weights")
    path = self.weights.push(model)
    info = self.model_info()
    if not info["hf_config"]:
      # The served directory is not visible here. The server now holds this
      # snapshot's weights, whose config.json names their EOS and vocabulary.
      info["hf_config"] = _read_hf_config(path)
    self._version = label

  def close(self) -> None:
    """Shuts the request thread pool down, hangs up the connections kept alive
    and removes temp weight snapshots."""
    if self._pool is not None:
      self._pool.shutdown(cancel_futures=True)
      self._pool = None
    with self._sessions_lock:
      sessions, self._sessions = self._sessions, []
      self._local = threading.local()
    for session in sessions:
      session.close()
    self.weights.close()

  def __enter__(self) -> VLLMSampler:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # -- internals ------------------------------------------------------------

  def _executor(self) -> DaemonPool:
    # Daemon threads: a request in flight to a hung server must not hold the
    # interpreter's exit after close() (ThreadPoolExecutor's threads would).
    if self._pool is None:
      self._pool = DaemonPool(
          max_workers=self.max_concurrency, thread_name_prefix="vllm-client")
    return self._pool

  def _complete(self, body: dict) -> tuple[list, list, list]:
    body_out = self.request("POST", "/v1/completions", json_body=body)
    return parse_completion(body_out, prompts=body["prompt"], n=body["n"],
                            url=f"{self.base_url}/v1/completions",
                            vocab_size=self.model_info()["hf_config"].get("vocab_size"),
                            max_tokens=body["max_tokens"])


def chunk_prompts(prompts: list[list[int]], size: int) -> list[list[int]]:
  """Consecutive prompt indices, at most `size` per chunk, no repeated prompt."""
  chunks, current, seen = [], [], set()
  for i, p in enumerate(prompts):
    key = tuple(p)
    if len(current) == size or key in seen:
      chunks.append(current)
      current, seen = [], set()
    current.append(i)
    seen.add(key)
  if current:
    chunks.append(current)
  return chunks


def _read_hf_config(root: str | None) -> dict:
  """config.json of the served model when its directory is visible here."""
  if not root:
    return {}
  try:
    with open(os.path.join(root, "config.json")) as f:
      return json.load(f)
  except (OSError, ValueError):
    return {}


__all__ = ["VLLMSampler", "VLLMError", "VLLMPausedError", "VLLMResponseError", "chunk_prompts",
           "parse_completion"]
