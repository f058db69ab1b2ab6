"""`DaemonPool`: a thread pool whose threads never hold the interpreter's exit.

`concurrent.futures.ThreadPoolExecutor` joins its threads when the interpreter
exits, even after `shutdown(wait=False)`: a request in flight to a server that
accepts connections but never answers then keeps a stopped run (Ctrl-C, an
error) alive for its whole read timeout. This pool's threads are daemons, and
`shutdown` lets them go.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any


class DaemonPool:
  """Runs submitted calls on up to `max_workers` daemon threads, in submission order.

  The subset of `ThreadPoolExecutor` that `VLLMSampler` uses: `submit` and
  `shutdown(cancel_futures=True)`, without waiting.
  """

  def __init__(self, max_workers: int, thread_name_prefix: str):
    if max_workers < 1:
      raise ValueError(f"DaemonPool: max_workers={max_workers} must be >= 1")
    self.max_workers = int(max_workers)
    self._prefix = thread_name_prefix
    self._queue: queue.SimpleQueue = queue.SimpleQueue()
    self._lock = threading.Lock()
    self._threads: list[threading.Thread] = []
    self._idle = 0
    self._shut = False

  def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
    """Queues `fn(*args)`; its future holds the result or the exception."""
    future = concurrent.futures.Future()
    with self._lock:
      if self._shut:
        raise RuntimeError("DaemonPool.submit after shutdown")
      self._queue.put((future, fn, args))
      if self._idle:
        self._idle -= 1
      elif len(self._threads) < self.max_workers:
        t = threading.Thread(target=self._work, daemon=True,
                             name=f"{self._prefix}_{len(self._threads)}")
        self._threads.append(t)
        t.start()
    return future

  def _work(self) -> None:
    while True:
      item = self._queue.get()
      if item is None:
        return
      future, fn, args = item
      if future.set_running_or_notify_cancel():
        try:
          result = fn(*args)
        except BaseException as e:  # pylint: disable=broad-except
          future.set_exception(e)
        else:
          future.set_result(result)
      with self._lock:
        self._idle += 1

  def shutdown(self, cancel_futures: bool = True) -> None:
    """Cancels the calls not started (if `cancel_futures`) and lets every thread
    end after its current call; returns at once."""
    with self._lock:
      self._shut = True
      while cancel_futures:
        try:
          item = self._queue.get_nowait()
        except queue.Empty:
          break
        if item is not None:
          item[0].cancel()
      for _ in self._threads:
        self._queue.put(None)
