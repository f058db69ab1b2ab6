"""A full disk's shape for tests: writes past a size are cut short, then fail."""

import contextlib
import resource
import signal


@contextlib.contextmanager
def files_capped_at(nbytes: int):
  """Within the block, no file of this process grows past `nbytes`: a write that
  would is cut short there and the next one fails (EFBIG), as a disk that fills
  mid-write does (ENOSPC). Only the soft limit is lowered, so it is restored."""
  soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
  old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an error, not a kill
  resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
  try:
    yield
  finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    signal.signal(signal.SIGXFSZ, old_handler)
