"""What the launcher adds to a run directory: the point's lock, its log and attempts.

Whether a run finished and how far it got are read through `isojax.rundir`, the
layout the run writes.

Each point is guarded by an `fcntl.flock` on a lock file in its run directory, held by
the launcher *and* inherited by the run, so neither a second launcher nor a rerun after
a crash can start a point that is still running; the kernel drops the lock when both
have exited, so a killed launcher never leaves a stale lock behind.

Each start event records the run's command and the digest of the config it gives
the run (`Sweep.config_digest`), so that a rerun can tell a point finished by the same
command on the same experiment file (skipped) from one finished by another command,
or before the file (or a file it imports) was edited: that run starts again and
compares its saved config itself (`finished_as`).
"""

from __future__ import annotations

import json
import os
import time

from isojax import files

LOCK_FILE = ".sweep.lock"
LOG_FILE = "sweep.log"             # the run's stdout + stderr, appended per attempt
ATTEMPTS_FILE = "sweep_attempts.jsonl"  # one line per start / end of a run attempt


def try_lock(run_dir: str) -> int | None:
  """An fd holding an exclusive flock on the point's lock file, or None if held.

  The fd is inherited by the run (so the lock outlives a killed launcher for exactly
  as long as its run lives); the kernel releases it when every holder has exited.
  """
  files.make_dir(run_dir)
  return files.try_flock(os.path.join(run_dir, LOCK_FILE),
                         f"launcher {os.getpid()} on {os.uname().nodename}")


def lock_holder(run_dir: str) -> str:
  """Who wrote the point's lock file last (for messages only)."""
  return files.lock_holder(os.path.join(run_dir, LOCK_FILE))


def record_attempt(run_dir: str, **event) -> None:
  """Appends one event (start / end of an attempt) to the run's attempts file."""
  event = {"time": time.time(), "launcher_pid": os.getpid(), **event}
  path = os.path.join(run_dir, ATTEMPTS_FILE)
  with files.open_append(path) as f:
    # A launcher killed (or a disk filled) mid-line leaves it without its newline:
    # appended to, that fragment would swallow this event, and a point finished by
    # this attempt would not be known as finished (`finished_as`). The point's
    # lock keeps other launchers from appending meanwhile.
    torn = files.read_tail(path, 1) not in (b"", b"\n")
    f.write(("\n" if torn else "") + json.dumps(event) + "\n")


def finished_as(run_dir: str, command: list[str], config_digest: str) -> bool:
  """Whether the last attempt in `run_dir` that exited 0 with the run finished ran
  `command` on a config of `config_digest`. False too when no such attempt is
  recorded, or it was recorded without a digest (an older launcher), or the file is
  unreadable: the run then starts and checks its saved config."""
  started, finished = {}, None
  try:
    with open(os.path.join(run_dir, ATTEMPTS_FILE)) as f:
      lines = f.readlines()
  except OSError:
    return False
  for line in lines:
    try:
      event = json.loads(line)
    except ValueError:  # a line cut short by a full disk or a kill
      continue
    if not isinstance(event, dict):
      continue
    if event.get("event") == "start":
      started[event.get("pid")] = event
    elif event.get("event") == "end" and event.get("rc") == 0 and event.get("done"):
      finished = started.get(event.get("pid"))
  return (finished is not None and finished.get("command") == command
          and finished.get("config_digest") == config_digest)
