"""Creating the files of a run directory or sweep root without following links;
reading the tail of a log.

A run directory or sweep root may sit on a shared cluster filesystem, where
anyone who can write into it could plant a symbolic link at a name isojax is
about to create (`.sweep.lock`, `config.json.tmp`, `metrics.jsonl`, ...) and have
the run overwrite a file of the user's elsewhere. Every file and directory isojax
creates under such a root is therefore opened with `O_NOFOLLOW` (the open fails
on a link at the last component) or checked not to be a link first, and a link
is refused with an `UnsafePathError` naming it. Renames onto a name replace a
link there rather than write through it, so `write_atomic` is safe too.
"""

from __future__ import annotations

import errno
import os
import stat

from isojax.errors import UnsafePathError

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _refuse(path: str | os.PathLike, what: str) -> UnsafePathError:
  try:
    target = f" -> {os.readlink(path)}"
  except OSError:
    target = ""
  return UnsafePathError(
      f"refusing to write through {os.fspath(path)}{target}: {what} (isojax creates "
      f"this name itself and never follows a link there; remove it)")


def check_not_link(path: str | os.PathLike) -> None:
  """Raises UnsafePathError if `path` exists as a symbolic link."""
  if os.path.islink(path):
    raise _refuse(path, "it is a symbolic link")


def open_nofollow(path: str | os.PathLike, flags: int, mode: int = 0o644) -> int:
  """`os.open` that refuses a symbolic link (or a non-regular file) at `path`."""
  try:
    fd = os.open(path, flags | _NOFOLLOW | _CLOEXEC, mode)
  except OSError as e:
    if e.errno == errno.ELOOP or os.path.islink(path):
      raise _refuse(path, "it is a symbolic link") from None
    raise
  if not stat.S_ISREG(os.fstat(fd).st_mode):
    os.close(fd)
    raise _refuse(path, "it is not a regular file")
  return fd


def open_append(path: str | os.PathLike, binary: bool = False):
  """A file object appending to `path` (created if missing), never through a link."""
  fd = open_nofollow(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
  return os.fdopen(fd, "ab" if binary else "a")


def try_flock(path: str | os.PathLike, holder: str) -> int | None:
  """An fd holding an exclusive flock on `path` (created, never through a link), with
  `holder` written in it for messages; None if another process holds it.

  The kernel releases the lock when every process holding the fd has exited, so
  a killed holder never leaves a stale lock behind.
  """
  # POSIX only, imported here: the analysis imports this module on any platform.
  import fcntl  # pylint: disable=import-outside-toplevel
  fd = open_nofollow(path, os.O_RDWR | os.O_CREAT)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    os.close(fd)
    return None
  except BaseException:
    os.close(fd)
    raise
  os.ftruncate(fd, 0)
  os.write(fd, f"{holder}\n".encode())
  return fd


def lock_holder(path: str | os.PathLike, unknown: str = "unknown") -> str:
  """Who wrote the lock file at `path` last (`try_flock`'s holder), for messages."""
  try:
    with open(path, encoding="utf-8", errors="replace") as f:
      return f.read().strip() or unknown
  except OSError:
    return unknown


def write_atomic(path: str | os.PathLike, data: str | bytes, *, fsync: bool = True) -> None:
  """Writes `data` to `path` via `path.tmp` + rename, never through a link.

  With `fsync`, the data and then the rename reach the disk before it returns:
  a rename is a change to the directory, which a crash can lose unless the
  directory is synced too (a run's checkpoints would then lie beside no
  config.json, and the run could not resume). A write that fails (a full disk)
  leaves `path` as it was and removes `path.tmp`; a stale one left by a killed
  writer is overwritten (it is a regular file of ours); a link there is refused.
  """
  path = os.fspath(path)
  tmp = path + ".tmp"
  fd = open_nofollow(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data.encode() if isinstance(data, str) else data)
      f.flush()
      if fsync:
        os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    # A full disk: the part written would only hold space the user must free.
    try:
      os.unlink(tmp)
    except OSError:
      pass
    raise
  if fsync:
    fsync_dir(os.path.dirname(path) or ".")


def fsync_dir(path: str | os.PathLike) -> None:
  """Syncs a directory's entries to disk; a no-op where the platform or the
  filesystem cannot (no directory fds, or fsync refused on one)."""
  try:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
  except OSError:
    return
  try:
    os.fsync(fd)
  except OSError:
    pass
  finally:
    os.close(fd)


def make_dir(path: str | os.PathLike) -> None:
  """`mkdir -p` for a directory isojax names; refuses a link at the last component
  (the parents are the user's to choose)."""
  check_not_link(path)
  os.makedirs(path, exist_ok=True)
  check_not_link(path)  # lost a race with someone planting a link


# How much of a log `log_tail` reads: the last lines of any real log.
_LOG_TAIL_BYTES = 64 * 1024


def read_tail(path: str | os.PathLike, num_bytes: int) -> bytes:
  """The last `num_bytes` bytes of a file (all of a shorter one); raises OSError."""
  with open(path, "rb") as f:
    f.seek(0, os.SEEK_END)
    f.seek(max(0, f.tell() - num_bytes))
    return f.read()


def log_tail(path: str | os.PathLike, lines: int = 20) -> str:
  """The last `lines` lines of a log file (a run's, the vLLM server's) for an error
  message, or a note saying why there is none."""
  try:
    text = read_tail(path, _LOG_TAIL_BYTES).decode("utf-8", "replace")
  except OSError as e:
    return f"(no log: {e})"
  return "\n".join(text.splitlines()[-lines:])
