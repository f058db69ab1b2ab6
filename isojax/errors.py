"""Errors isojax raises on purpose, and how an entry point reports them.

A bad config, data file, budget point, model file or server is the user's to
fix, not a bug: the entry points (`isojax.main`, `launch/sweep.py`) print one
line naming the input and exit with status 2 (`EXIT_USER_ERROR`); the traceback
is printed only with `--verbose`. `ValueError` is what the validators raise for
bad input throughout the package (config, data, budget, model file); failures of
the environment (full disk, unreachable server, non-finite training) subclass
`IsojaxError`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import traceback
from collections.abc import Callable, Iterator

EXIT_USER_ERROR = 2

# OS errors that are the environment's (full, read-only or forbidden disk, a
# link where isojax creates a file, a file where a path needs a directory),
# reported in one line like a bad input.
_ENVIRONMENT_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES,
                       errno.EPERM, errno.ELOOP, errno.ENOENT, errno.EEXIST, errno.ENOTDIR)


class IsojaxError(RuntimeError):
  """A failure isojax detected and names (disk, server, model file, training)."""


class DiskFullError(IsojaxError):
  """No space (or quota) left while writing a run file; the data on disk is intact."""


class UnsafePathError(IsojaxError):
  """A symbolic link (or other non-regular entry) sits at a name isojax creates."""


def find_oserror(exc: BaseException, codes=(errno.ENOSPC, errno.EDQUOT)
                 ) -> OSError | None:
  """The first OSError with one of `codes` in `exc`'s cause/context chain.

  Libraries (orbax, tensorboardX) re-raise I/O failures wrapped in their own
  types; the errno survives in the chain.
  """
  seen = set()
  while exc is not None and id(exc) not in seen:
    seen.add(id(exc))
    if isinstance(exc, OSError) and exc.errno in codes:
      return exc
    exc = exc.__cause__ or exc.__context__
  return None


@contextlib.contextmanager
def disk_full_as(path: str | os.PathLike, what: str) -> Iterator[None]:
  """Turns a full disk (ENOSPC / EDQUOT anywhere in the raised chain) while writing
  `what` under `path` into one DiskFullError saying the run can be resumed.

  Run files are written atomically or line by line with fsync, so what is on
  disk is still a consistent prefix of the run.
  """
  try:
    yield
  except Exception as e:  # pylint: disable=broad-except
    full = find_disk_full(e)
    if full is None:
      raise
    where = getattr(full, "filename", None) or os.fspath(path)
    raise DiskFullError(
        f"no space left on {where} while writing {what}; "
        f"the run can be resumed: free space and rerun the same command") from e


# How a full disk reads when a storage library (tensorstore under orbax) reports it
# as its own error type rather than an OSError: strerror(ENOSPC / EDQUOT), or the
# errno in tensorstore's status text.
_DISK_FULL_TEXT = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT),
                   f"os_error_code='{errno.ENOSPC}'", f"os_error_code='{errno.EDQUOT}'")


def find_disk_full(exc: BaseException) -> BaseException | None:
  """The error in `exc`'s chain that says the disk (or quota) is full, or None."""
  found = find_oserror(exc)
  if found is not None:
    return found
  seen = set()
  while exc is not None and id(exc) not in seen:
    seen.add(id(exc))
    if any(text in str(exc) for text in _DISK_FULL_TEXT):
      return exc
    exc = exc.__cause__ or exc.__context__
  return None


def is_expected(exc: BaseException) -> bool:
  """Whether `exc` is one isojax raises (or lets through) on purpose for bad input
  or a bad environment, as opposed to a bug whose traceback matters."""
  if isinstance(exc, (ValueError, IsojaxError)):
    return True
  return find_oserror(exc, _ENVIRONMENT_ERRNOS) is not None


def message(exc: BaseException) -> str:
  """One line (or a few, for a message that has several) describing `exc`."""
  os_err = None if isinstance(exc, (ValueError, IsojaxError)) else find_oserror(
      exc, _ENVIRONMENT_ERRNOS)
  if os_err is not None:
    where = f" on {os_err.filename}" if os_err.filename else ""
    return f"{os_err.strerror or os_err}{where}"
  return str(exc) or type(exc).__name__


def report(exc: BaseException, prog: str, *, verbose: bool,
           print_fn: Callable[[str], None] | None = None) -> int:
  """Prints `prog: error: <message>` (and the traceback when `verbose`); returns
  the exit status for an expected error."""
  print_fn = print_fn or (lambda s: print(s, file=sys.stderr, flush=True))
  if verbose:
    print_fn("".join(traceback.format_exception(exc)).rstrip())
  hint = "" if verbose else " (--verbose prints the traceback)"
  print_fn(f"{prog}: error: {message(exc)}{hint}")
  return EXIT_USER_ERROR
