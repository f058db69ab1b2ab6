"""Weight snapshots in a directory other processes may share: who wrote each one,
and which are left over from processes that are gone.

Every snapshot `weights_NNNNNN` that `WeightSync` writes holds `isojax_writer.json`,
naming its writer: host, kernel boot id, pid namespace, pid and the process's start
time. `remove_stale` deletes a snapshot only when all of these hold:

- it holds that record and nothing but the files isojax writes there (config.json,
  safetensors, their index, the record), so nothing a person put there is lost;
- its writer ran as this user under this kernel (same boot id) in this pid
  namespace, the only case in which its pid can be checked from here, and that
  process is gone (no such pid, or the pid of a process started at another time);
- no live process here names the snapshot in its command line (a `vllm serve`
  started from it) and it is not one the caller keeps (the served model's directory).

With such a snapshot go the writer's own leftovers beside it: the
`.weights_NNNNNN.tmp-*` directory `save_pretrained` was writing when the writer
was killed (a whole model's size) and a `.weights_NNNNNN.old-*` it had not yet
deleted, if they are this user's directories.

Anything else is left alone and counted in one log line: a writer on another host,
in another container or from before a reboot cannot be proven gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import stat
from collections.abc import Iterable

from absl import logging

SNAPSHOT = "weights_{:06d}"
SNAPSHOT_RE = re.compile(r"^weights_(\d{6,})$")
RECORD = "isojax_writer.json"
# What save_pretrained writes into a snapshot (WeightSync saves no tokenizer).
_OWN_FILE_RE = re.compile(
    r"^(config\.json|model(-\d+-of-\d+)?\.safetensors|model\.safetensors\.index\.json|"
    + re.escape(RECORD) + r")$")


def _read(path: str) -> str | None:
  try:
    with open(path, errors="replace") as f:
      return f.read().strip()
  except OSError:
    return None


def _start_time(pid: int) -> str | None:
  """Field 22 of /proc/<pid>/stat (clock ticks after boot): with the pid, it names
  one process of one boot; None when there is no such process."""
  stat = _read(f"/proc/{pid}/stat")
  return stat.rpartition(")")[2].split()[19] if stat else None


def writer_record() -> dict:
  """This process, as a snapshot's record names its writer."""
  pid_ns = None
  with contextlib.suppress(OSError):
    pid_ns = os.readlink("/proc/self/ns/pid")
  return {"host": socket.gethostname(), "boot_id": _read("/proc/sys/kernel/random/boot_id"),
          "pid_ns": pid_ns, "pid": os.getpid(), "start": _start_time(os.getpid())}


def write_record(snapshot: str) -> None:
  """Marks `snapshot` as written by this process."""
  with open(os.path.join(snapshot, RECORD), "w") as f:
    json.dump(writer_record(), f)


def reserve(root: str) -> str:
  """A new snapshot directory numbered after every one in `root`, made (so that a
  process sharing `root` cannot pick the same number) and marked as this one's."""
  os.makedirs(root, exist_ok=True)
  while True:
    taken = [int(m.group(1)) for name in os.listdir(root) if (m := SNAPSHOT_RE.match(name))]
    path = os.path.join(root, SNAPSHOT.format(max(taken, default=0) + 1))
    try:
      os.mkdir(path)
    except FileExistsError:
      continue  # another writer took it first
    write_record(path)
    return path


def writer_state(record: dict, here: dict | None = None) -> str:
  """"gone", "alive" or "unknown": of the process `record` names, as seen from
  this one (`here`). Only a writer under this kernel and in this pid namespace
  can be looked up by its pid."""
  here = here or writer_record()
  pid = record.get("pid")
  if (not (here["boot_id"] and here["pid_ns"] and here["start"])  # no /proc here
      or (record.get("boot_id"), record.get("pid_ns")) != (here["boot_id"], here["pid_ns"])
      or not isinstance(pid, int) or isinstance(pid, bool) or not record.get("start")):
    return "unknown"
  return "alive" if _start_time(pid) == record["start"] else "gone"


def _live_command_lines() -> list[str]:
  lines = []
  for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
    if entry.isdigit():
      raw = _read(f"/proc/{entry}/cmdline")
      if raw:
        lines.append(raw.replace("\0", " "))
  return lines


def _leftovers(root: str, name: str) -> list[str]:
  """The save_pretrained temporaries of snapshot `name` in `root` (see the module doc)."""
  found = []
  for entry in os.listdir(root):
    if entry.startswith((f".{name}.tmp-", f".{name}.old-")):
      path = os.path.join(root, entry)
      with contextlib.suppress(OSError):
        info = os.lstat(path)
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid():
          found.append(path)
  return found


def _bytes(path: str) -> int:
  total = 0
  for parent, _, files in os.walk(path):
    for name in files:
      with contextlib.suppress(OSError):
        total += os.lstat(os.path.join(parent, name)).st_size
  return total


def _classify(path: str, here: dict, keep: set[str], commands: list[str]) -> str:
  """"stale", "alive" (its writer lives) or "unknown" (left, and reported)."""
  try:
    names = os.listdir(path)
    owner = os.stat(path).st_uid
    with open(os.path.join(path, RECORD)) as f:
      record = json.load(f)
  except (OSError, ValueError):
    return "unknown"  # not (yet) marked: a writer may be between save and mark
  if owner != os.getuid():
    # /proc may hide other users' processes (hidepid): their pids prove nothing.
    return "unknown"
  state = writer_state(record, here) if isinstance(record, dict) else "unknown"
  if state != "gone":
    return state
  # A server started from a snapshot reads its config.json (and so does the
  # client); a name in any live command line keeps it (a false match only keeps).
  in_use = (os.path.realpath(path) in keep
            or any(os.path.basename(path) in c for c in commands))
  own_files = all(_OWN_FILE_RE.match(n) and not os.path.islink(os.path.join(path, n))
                  and os.path.isfile(os.path.join(path, n)) for n in names)
  return "stale" if own_files and not in_use else "unknown"


def remove_stale(root: str, *, keep: Iterable[str | None] = ()) -> list[str]:
  """Deletes the snapshots in `root` whose writer is gone (see the module doc),
  except those in `keep`; logs what it removed and what it left that it cannot
  judge. Returns the removed paths."""
  if not os.path.isdir(root):
    return []
  here = writer_record()
  keep = {os.path.realpath(k) for k in keep if k}
  names = sorted(n for n in os.listdir(root) if SNAPSHOT_RE.match(n))
  commands = _live_command_lines() if names else []
  removed, removed_bytes, left, left_bytes = [], 0, [], 0
  for name in names:
    path = os.path.join(root, name)
    kind = _classify(path, here, keep, commands)
    if kind == "unknown":
      left.append(name)
      left_bytes += _bytes(path)
    elif kind == "stale":
      for leftover in _leftovers(root, name):
        size = _bytes(leftover)
        shutil.rmtree(leftover, ignore_errors=True)
        removed_bytes += 0 if os.path.exists(leftover) else size
      size = _bytes(path)
      shutil.rmtree(path, ignore_errors=True)
      if not os.path.exists(path):
        removed.append(path)
        removed_bytes += size
  if removed:
    logging.info("removed %d weight snapshots (%.1f MiB) from %s whose writing process "
                 "on this host is gone: %s", len(removed), removed_bytes / 2**20, root,
                 ", ".join(os.path.basename(p) for p in removed))
  if left:
    logging.warning(
        "%s holds %d weight snapshots (%.1f MiB) not written by a live process here "
        "that isojax cannot prove unused (written on another host, in another "
        "container or before a reboot, in use by a process here, or holding files "
        "isojax did not write): %s; delete them by hand once no run or vLLM server "
        "uses them", root, len(left), left_bytes / 2**20, ", ".join(left))
  return removed
