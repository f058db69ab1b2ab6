"""A run directory as the launcher sees it: finished, locked, how far, what it logged.

Each point is guarded by an `fcntl.flock` on a lock file in its run directory, held by
the launcher *and* inherited by the run, so neither a second launcher nor a rerun after
a crash can start a point that is still running; the kernel drops the lock when both
have exited, so a killed launcher never leaves a stale lock behind.
"""

from __future__ import annotations

import fcntl
import json
import os
import time

from isojax import files

# Written by the run (isojax/run.py, DONE_FILE) when its last update, eval and
# checkpoint are done.
DONE_MARKER = "DONE"
LOCK_FILE = ".sweep.lock"
LOG_FILE = "sweep.log"             # the run's stdout + stderr, appended per attempt
ATTEMPTS_FILE = "sweep_attempts.jsonl"  # one line per start / end of a run attempt
LOG_TAIL_LINES = 20


def is_done(run_dir: str) -> bool:
  return os.path.exists(os.path.join(run_dir, DONE_MARKER))


def try_lock(run_dir: str) -> int | None:
  """An fd holding an exclusive flock on the point's lock file, or None if held.

  The fd is inherited by the run (so the lock outlives a killed launcher for exactly
  as long as its run lives); the kernel releases it when every holder has exited.
  """
  files.make_dir(run_dir)
  fd = files.open_nofollow(os.path.join(run_dir, LOCK_FILE), os.O_RDWR | os.O_CREAT)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    os.close(fd)
    return None
  os.ftruncate(fd, 0)
  os.write(fd, f"launcher {os.getpid()} on {os.uname().nodename}\n".encode())
  return fd


def lock_holder(run_dir: str) -> str:
  """Who wrote the lock file last (for messages only)."""
  try:
    with open(os.path.join(run_dir, LOCK_FILE)) as f:
      return f.read().strip() or "unknown"
  except OSError:
    return "unknown"


def read_progress(run_dir: str) -> dict | None:
  """The last complete line of the run's metrics.jsonl, or None."""
  path = os.path.join(run_dir, "metrics.jsonl")
  try:
    with open(path, "rb") as f:
      f.seek(0, os.SEEK_END)
      f.seek(max(0, f.tell() - 8192))
      lines = f.read().split(b"\n")
  except OSError:
    return None
  for line in reversed(lines[:-1]):  # the last element is '' or a partial line
    try:
      return json.loads(line)
    except ValueError:
      continue
  return None


def log_tail(path: str, lines: int = LOG_TAIL_LINES) -> str:
  try:
    with open(path, "rb") as f:
      f.seek(0, os.SEEK_END)
      f.seek(max(0, f.tell() - 64 * 1024))
      text = f.read().decode("utf-8", "replace")
  except OSError as e:
    return f"(no log: {e})"
  return "\n".join(text.splitlines()[-lines:])


def record_attempt(run_dir: str, **event) -> None:
  """Appends one event (start / end of an attempt) to the run's attempts file."""
  event = {"time": time.time(), "launcher_pid": os.getpid(), **event}
  with files.open_append(os.path.join(run_dir, ATTEMPTS_FILE)) as f:
    f.write(json.dumps(event) + "\n")
