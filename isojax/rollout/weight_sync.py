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
5. `POST /resume` (always, even when 3 or 4 failed, so the server is not left
   paused).

Only the last `keep_last` snapshots are kept on disk: the one being served and
the one before it.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
import weakref
from typing import Any

from isojax.rollout.base import VLLMError

_SNAPSHOT = "weights_{:06d}"
_SNAPSHOT_RE = re.compile(r"^weights_(\d{6,})$")


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
  """

  def __init__(self, client: Any, *, weights_root: str | None = None, keep_last: int = 2,
               in_flight: bool = False):
    if keep_last < 1:
      raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    self.client = client
    self._weights_root = os.path.abspath(weights_root) if weights_root else None
    self._owns_root = False  # True once a temp dir of our own holds the snapshots
    self.keep_last = int(keep_last)
    self.in_flight = bool(in_flight)
    self._written: list[str] = []
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
    """A snapshot directory numbered after every one already in weights_root."""
    os.makedirs(self.weights_root, exist_ok=True)
    taken = [int(m.group(1)) for name in os.listdir(self.weights_root)
             if (m := _SNAPSHOT_RE.match(name))]
    return os.path.join(self.weights_root, _SNAPSHOT.format(max(taken, default=0) + 1))

  def push(self, model: Any, cfg: Any = None) -> str:
    """Saves `model` and makes the server serve it; returns the snapshot dir.

    Args:
      model: an `isojax.models.Decoder`.
      cfg: its `ModelConfig` (default: `model.cfg`).

    Raises:
      VLLMError: naming the URL of the step that failed; the server is resumed
        before the error propagates.
    """
    from isojax.models import save_pretrained  # pylint: disable=g-import-not-at-top
    cfg = cfg if cfg is not None else getattr(model, "cfg", None)
    if cfg is None:
      raise ValueError("update_weights: model has no .cfg; pass its ModelConfig")
    t0 = time.perf_counter()
    path = self.next_dir()
    save_pretrained(model, cfg, path)
    self._written.append(path)
    t1 = time.perf_counter()
    self.load(path)
    self.last_timings["save_s"] = t1 - t0
    self.prune()
    return path

  def load(self, path: str) -> None:
    """Steps 2-5 of the protocol for an existing HF snapshot at `path`."""
    c = self.client
    timings = {}
    t = time.perf_counter()
    c.request("POST", "/pause", params={"mode": "keep" if self.in_flight else "wait"})
    timings["pause_s"] = time.perf_counter() - t
    try:
      t = time.perf_counter()
      c.request("POST", "/collective_rpc",
                json_body={"method": "reload_weights",
                           "kwargs": {"weights_path": os.path.abspath(path)}})
      timings["reload_s"] = time.perf_counter() - t
      t = time.perf_counter()
      self._reset_prefix_cache()
      timings["reset_prefix_cache_s"] = time.perf_counter() - t
    finally:
      t = time.perf_counter()
      c.request("POST", "/resume")
      timings["resume_s"] = time.perf_counter() - t
    self.num_pushes += 1
    self.last_timings = timings

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
    a given `weights_root` is left alone, pruned to the last `keep_last`.
    """
    if self._owns_root:
      self._cleanup()  # rmtree, once
      self._weights_root, self._owns_root, self._written = None, False, []
