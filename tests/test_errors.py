"""isojax.errors: expected errors are one line and exit status 2; a full disk is named."""

import errno

import pytest

from isojax import errors


def test_disk_full_anywhere_in_the_chain_becomes_one_message(tmp_path):
  def wrapped_write():  # libraries (orbax) wrap the OSError in their own type
    try:
      raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x"))
    except OSError as e:
      raise RuntimeError("save failed") from e

  with pytest.raises(errors.DiskFullError) as info:
    with errors.disk_full_as(tmp_path, "checkpoint 7"):
      wrapped_write()
  assert str(info.value) == (f"no space left on {tmp_path / 'x'} while writing checkpoint "
                             f"7; the run can be resumed: free space and rerun the same "
                             f"command")
  with pytest.raises(KeyError):  # anything else passes through unchanged
    with errors.disk_full_as(tmp_path, "checkpoint 7"):
      raise KeyError("k")


def test_report_prints_one_line_unless_verbose():
  try:
    raise ValueError("config.n=1 is too small")
  except ValueError as e:
    exc = e
  lines = []
  assert errors.report(exc, "isojax.main", verbose=False, print_fn=lines.append) == 2
  assert lines == ["isojax.main: error: config.n=1 is too small "
                   "(--verbose prints the traceback)"]
  lines.clear()
  errors.report(exc, "isojax.main", verbose=True, print_fn=lines.append)
  assert lines[0].startswith("Traceback") and "raise ValueError" in lines[0]
  assert lines[1] == "isojax.main: error: config.n=1 is too small"


def test_which_errors_are_expected(tmp_path):
  assert errors.is_expected(ValueError("bad input"))
  assert errors.is_expected(errors.DiskFullError("full"))
  read_only = OSError(errno.EROFS, "Read-only file system", str(tmp_path))
  assert errors.is_expected(read_only)
  assert errors.message(read_only) == f"Read-only file system on {tmp_path}"
  assert not errors.is_expected(KeyError("a bug"))
  assert not errors.is_expected(OSError(errno.EIO, "I/O error"))


def test_disk_full_reported_as_text_by_a_storage_library(tmp_path):
  # tensorstore (under orbax) reports ENOSPC as a ValueError with the errno in text.
  text = ("RESOURCE_EXHAUSTED: Error writing \"x\" in OCDBT database: Failed to write "
          "965154 bytes to file 21: No space left on device [os_error_code='28']")
  with pytest.raises(errors.DiskFullError,
                     match=rf"^no space left on {tmp_path} while writing checkpoint 2; "):
    with errors.disk_full_as(tmp_path, "checkpoint 2"):
      raise ValueError(text)
  with pytest.raises(ValueError, match="RESOURCE_EXHAUSTED: out of memory"):
    with errors.disk_full_as(tmp_path, "checkpoint 2"):
      raise ValueError("RESOURCE_EXHAUSTED: out of memory")
