"""Push new policy weights to a running vLLM server after every update.

The protocol (vLLM >= 0.32 with VLLM_SERVER_DEV_MODE=1):

1. `save_pretrained` writes an HF snapshot into a fresh directory (atomically:
   temp dir + rename, so the server never reads half a checkpoint);
2. `POST /pause?mode=wait` lets in-flight requests finish and holds new ones
   (`in_flight=True`: `mode=keep`, which freezes in-flight requests where they
   are, so sampling overlaps the update);
3. `POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}`
   makes every worker load DIR's safetensors in place (no restart, ~20 ms for
   a tiny model);
4. `POST /reset_prefix_cache`: cached KV blocks were computed with the old
   weights and would otherwise be reused for matching prompt prefixes (with
   `in_flight=True`, `?reset_running_requests=true`: the kept requests' KV is
   dropped too and recomputed, prompt and tokens so far, with the new weights);
5. `POST /resume` (always, even when 2, 3 or 4 failed, so the server is not
   left paused), retried `resume_attempts` times: vLLM's resume only clears its
   paused flag, so sending it again is safe. A server still paused after that
   would hold every request until its timeout; the push then raises
   `VLLMPausedError` naming the URL, and the next push or `generate` first
   resumes the server or raises that error again, sending nothing else.

Only the last `keep_last` snapshots are kept on disk: the one being served and
the one before it. A given `weights_root` may be shared and outlive the process:
at the first push, snapshots there whose writer is provably gone are deleted and
any others it cannot judge are logged (`isojax.rollout.snapshots`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import weakref
from typing import Any

from absl import logging

from isojax.rollout import snapshots
from isojax.rollout.base import VLLMError, VLLMPausedError


def _layout(hf: dict) -> dict:
  """What a snapshot's weights must match on the server: the config.json fields
  that set tensor names and shapes, with transformers' defaults filled in."""
  heads = hf.get("num_attention_heads")
  head_dim = hf.get("head_dim") or (
      hf["hidden_size"] // heads if heads and hf.get("hidden_size") else None)
  return {"architectures": hf.get("architectures"), "vocab_size": hf.get("vocab_size"),
          "hidden_size": hf.get("hidden_size"),
          "intermediate_size": hf.get("intermediate_size"),
          "num_hidden_layers": hf.get("num_hidden_layers"),
          "num_attention_heads": heads,
          "num_key_value_heads": hf.get("num_key_value_heads", heads),
          "head_dim": head_dim,
          "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False))}


def _function(hf: dict) -> dict:
  """The fields that change what the weights compute but no tensor's name or
  shape (RoPE, the norms' epsilon), as isojax reads them (either RoPE format);
  {} for a config.json isojax does not read."""
  from isojax.models import ModelConfig  # pylint: disable=g-import-not-at-top
  try:
    cfg = ModelConfig.from_hf_dict(hf)
  except (ValueError, KeyError, TypeError):
    return {}
  fields = ["rope_type", "rope_theta", "rms_norm_eps"]
  if cfg.rope_type == "llama3":
    fields += ["rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
               "rope_original_max_position"]
  return {f: getattr(cfg, f) for f in fields}


def check_matches_served(pushed: dict, served: dict, url: str) -> None:
  """Raises ValueError naming every layout field (`_layout`) or function field
  (`_function`) in which the pushed model's config.json differs from the served
  model's. vLLM reloads weights into the model it serves, keeping its config: a
  differing shape fails inside the server (and can kill it), an untied head
  pushed onto a tied one is silently not loaded, and another RoPE or norm epsilon
  would silently sample a model other than the one trained."""
  if not served:  # the served config.json is not visible from here
    return
  mine, theirs = _layout(pushed), _layout(served)
  mine_f, theirs_f = _function(pushed), _function(served)
  if mine_f and theirs_f:
    mine, theirs = {**mine, **mine_f}, {**theirs, **theirs_f}
  differ = [f"{k} {mine[k]!r} (served: {theirs.get(k)!r})" for k in mine
            if mine[k] is not None and theirs.get(k) is not None and mine[k] != theirs[k]]
  if differ:
    raise ValueError(f"update_weights: the model pushed to the vLLM server at {url} is "
                     f"not the one it serves: {'; '.join(differ)}. Serve this "
                     f"architecture (vllm serve <its HF directory>) or push a model of "
                     f"the served one")


class WeightSync:
  """Writes weight snapshots and tells the server behind `client` to load them.

  Args:
    client: a `VLLMSampler` (used for its `request` with retries and errors
      naming the URL).
    weights_root: where snapshots go; must be visible to the server under the
      same path. A fresh temp dir when None, removed again by `close()`.
    keep_last: snapshots kept on disk (>= 1).
    in_flight: keep the server's in-flight requests through the update and
      continue them with the new weights (pause `mode=keep`) instead of
      waiting for them to finish (`mode=wait`).
    resume_attempts: tries of `/resume` (each with the client's own retries of
      a refused connection) before the server is taken to be left paused.
  """

  def __init__(self, client: Any, *, weights_root: str | None = None, keep_last: int = 2,
               in_flight: bool = False, resume_attempts: int = 3):
    if keep_last < 1:
      raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    if (not isinstance(resume_attempts, int) or isinstance(resume_attempts, bool)
        or resume_attempts < 1):
      raise ValueError(f"resume_attempts={resume_attempts!r} must be an int >= 1")
    self.resume_attempts = resume_attempts
    # Why the server may be paused (a /resume that kept failing), else None.
    # Written by the pushing thread, read by generate's: one reference, replaced whole.
    self.paused_after: str | None = None
    self.client = client
    self._weights_root = os.path.abspath(weights_root) if weights_root else None
    self._owns_root = False  # True once a temp dir of our own holds the snapshots
    self.keep_last = int(keep_last)
    self.in_flight = bool(in_flight)
    self._written: list[str] = []
    self._swept = False  # stale snapshots of gone writers looked for in weights_root
    self.num_pushes = 0
    self.last_timings: dict[str, float] = {}

  @property
  def weights_root(self) -> str:
    if self._weights_root is None:  # created on first use only
      self._weights_root = tempfile.mkdtemp(prefix="isojax-vllm-weights-")
      self._owns_root = True
      # Removed at interpreter exit too, on any path that never reaches close()
      # (a failed start before the run holds the sampler, SystemExit on SIGTERM).
      self._cleanup = weakref.finalize(self, shutil.rmtree, self._weights_root,
                                       ignore_errors=True)
    return self._weights_root

  def next_dir(self) -> str:
    """A new snapshot directory, made and numbered after every one in weights_root.

    At the first call on a given root, the snapshots of writers that are gone
    are removed first (`snapshots.remove_stale`), except the served model's
    directory, which the server and this client read config.json from.
    """
    root = self.weights_root
    if not self._owns_root and not self._swept:
      self._swept = True
      snapshots.remove_stale(root, keep=[self.client.model_info().get("root")])
    return snapshots.reserve(root)

  def push(self, model: Any, cfg: Any = None) -> str:
    """Saves `model` and makes the server serve it; returns the snapshot dir.

    Args:
      model: an `isojax.models.Decoder`.
      cfg: its `ModelConfig` (default: `model.cfg`).

    Raises:
      ValueError: the model's layout differs from the served model's
        (`check_matches_served`); nothing is sent.
      VLLMError: naming the URL of the step that failed; the server is resumed
        before the error propagates.
    """
    from isojax.models import save_pretrained  # pylint: disable=g-import-not-at-top
    cfg = cfg if cfg is not None else getattr(model, "cfg", None)
    if cfg is None:
      raise ValueError("update_weights: model has no .cfg; pass its ModelConfig")
    check_matches_served(cfg.to_hf_dict(), self.client.model_info()["hf_config"],
                         self.client.base_url)
    self.ensure_resumed()  # before a snapshot is written for a server that is stuck
    t0 = time.perf_counter()
    path = self.next_dir()
    self._written.append(path)  # pruned even if the save fails
    save_pretrained(model, cfg, path)  # replaces the reserved directory whole
    snapshots.write_record(path)
    t1 = time.perf_counter()
    self.load(path)
    self.last_timings["save_s"] = t1 - t0
    self.prune()
    return path

  def load(self, path: str) -> None:
    """Steps 2-5 of the protocol for an existing HF snapshot at `path`."""
    c = self.client
    timings = {}
    try:
      t = time.perf_counter()
      c.request("POST", "/pause", params={"mode": "keep" if self.in_flight else "wait"})
      timings["pause_s"] = time.perf_counter() - t
      t = time.perf_counter()
      c.request("POST", "/collective_rpc",
                json_body={"method": "reload_weights",
                           "kwargs": {"weights_path": os.path.abspath(path)}})
      timings["reload_s"] = time.perf_counter() - t
      t = time.perf_counter()
      self._reset_prefix_cache()
      timings["reset_prefix_cache_s"] = time.perf_counter() - t
    except BaseException:
      # Resumed even when the pause itself failed: a pause the client stopped
      # waiting for still completes on the server, which would stay paused.
      try:
        self._resume(f"after a failed weight update (loading {path})")
      except VLLMPausedError as e:  # the step that failed is the error to report
        logging.warning("%s", e)
      raise
    t = time.perf_counter()
    # The server now holds the new weights; only resuming it is left.
    self._resume(f"after reloading its weights from {path}, which succeeded")
    timings["resume_s"] = time.perf_counter() - t
    self.num_pushes += 1
    self.last_timings = timings

  def ensure_resumed(self) -> None:
    """Resumes a server that a failed `/resume` left paused; a no-op otherwise.

    Raises:
      VLLMPausedError: naming the URL, when /resume fails again.
    """
    after = self.paused_after
    if after is not None:
      self._resume(after)
      logging.info("resumed the vLLM server at %s, paused %s", self.client.base_url,
                   after)

  def _resume(self, after: str) -> None:
    """POST /resume, up to `resume_attempts` times; VLLMPausedError if it never
    answers (and `paused_after` says why, for `ensure_resumed`)."""
    c = self.client
    for attempt in range(self.resume_attempts):
      try:
        c.request("POST", "/resume")
      except VLLMError as e:
        last = e
        if attempt + 1 < self.resume_attempts:
          time.sleep(c.backoff_s * 2**attempt)
        continue
      self.paused_after = None
      return
    self.paused_after = after
    raise VLLMPausedError(
        f"the vLLM server at {c.base_url} may be left paused {after}: POST "
        f"{c.base_url}/resume failed {self.resume_attempts} times (last: {last}). "
        f"A paused server holds every request until it times out; resume it by hand "
        f"(curl -X POST {c.base_url}/resume). The next update_weights or generate "
        f"tries /resume first and sends nothing else until it succeeds") from last

  def _reset_prefix_cache(self, attempts: int = 20) -> None:
    # vLLM refuses ({"success": false}) while KV blocks are still held; after a
    # pause in "wait" mode they are normally free, so a few short retries do.
    # Requests kept by a "keep" pause hold their blocks until they finish, so
    # no retry would do: reset_running_requests preempts them (their blocks,
    # computed with the old weights, are freed; on resume they are recomputed
    # with the new ones), and vLLM answers an error if even that cannot reset.
    # (vLLM 0.32's keep pause may already have preempted them, as its
    # clear_cache default; resetting here, after the reload, holds either way.)
    params = {"reset_running_requests": "true"} if self.in_flight else None
    for _ in range(attempts):
      answer = self.client.request("POST", "/reset_prefix_cache", params=params)
      if not isinstance(answer, dict) or answer.get("success", True):
        return
      time.sleep(0.05)
    raise VLLMError(f"{self.client.base_url}/reset_prefix_cache kept answering "
                    f"success=false after {attempts} attempts; the server would "
                    f"serve KV cached under the old weights")

  def prune(self) -> None:
    """Deletes snapshots this object wrote, except the last `keep_last`."""
    while len(self._written) > self.keep_last:
      shutil.rmtree(self._written.pop(0), ignore_errors=True)

  def close(self) -> None:
    """Removes the temp dir of snapshots, if this object made one.

    The server keeps serving the weights it loaded (they live in its memory);
    a given `weights_root` keeps this object's last `keep_last`, which the
    first push of a later process there removes once this one is gone.
    """
    if self._owns_root:
      self._cleanup()  # rmtree, once
      self._weights_root, self._owns_root, self._written = None, False, []
