"""isojax.files: names isojax creates are never written through a symbolic link, and
an atomic write that fails (a full disk) leaves the file as it was and no temporary."""

import os

import pytest

from isojax import files
from isojax.errors import UnsafePathError
from tests.file_limits import files_capped_at


@pytest.fixture
def victim(tmp_path):
  """A user file elsewhere that a planted link points at; it must stay untouched."""
  path = tmp_path / "victim.txt"
  path.write_text("precious\n")
  return path


def test_write_atomic_replaces_the_file(tmp_path):
  path = tmp_path / "config.json"
  files.write_atomic(path, "one\n")
  files.write_atomic(path, b"two\n")
  assert path.read_text() == "two\n"
  assert sorted(os.listdir(tmp_path)) == ["config.json"]


def test_write_atomic_syncs_the_data_then_the_rename(tmp_path, monkeypatch):
  # A rename is a change to the directory: without syncing it a crash can leave
  # the old file (or none), whatever was synced of the data.
  synced, replaced = [], []
  fsync, replace = os.fsync, os.replace
  monkeypatch.setattr(os, "fsync", lambda fd: synced.append(
      (os.path.realpath(f"/proc/self/fd/{fd}"), bool(replaced))) or fsync(fd))
  monkeypatch.setattr(os, "replace", lambda a, b: replaced.append(b) or replace(a, b))
  path = tmp_path / "config.json"
  files.write_atomic(path, "one\n")
  assert synced == [(str(path) + ".tmp", False), (str(tmp_path), True)]
  synced.clear()
  files.write_atomic(path, "two\n", fsync=False)
  assert synced == [] and path.read_text() == "two\n"
  files.fsync_dir(tmp_path / "missing")  # nothing to sync: no error


def test_write_atomic_on_a_full_disk_keeps_the_file_and_leaves_no_temp(tmp_path):
  path = tmp_path / "metrics.jsonl"
  files.write_atomic(path, "kept\n")
  with pytest.raises(OSError), files_capped_at(64):
    files.write_atomic(path, "x" * 1000)
  assert path.read_text() == "kept\n"
  assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]


def test_write_atomic_refuses_a_link_at_the_temp_name(tmp_path, victim):
  (tmp_path / "config.json.tmp").symlink_to(victim)
  with pytest.raises(UnsafePathError, match=r"config\.json\.tmp -> .*victim\.txt"):
    files.write_atomic(tmp_path / "config.json", "x")
  assert victim.read_text() == "precious\n"


def test_write_atomic_replaces_a_link_at_the_name_itself(tmp_path, victim):
  # rename() replaces the link, it does not write through it.
  (tmp_path / "DONE").symlink_to(victim)
  files.write_atomic(tmp_path / "DONE", "done\n")
  assert not (tmp_path / "DONE").is_symlink()
  assert victim.read_text() == "precious\n"


def test_open_append_and_open_nofollow_refuse_links(tmp_path, victim):
  (tmp_path / "metrics.jsonl").symlink_to(victim)
  with pytest.raises(UnsafePathError, match="metrics.jsonl"):
    files.open_append(tmp_path / "metrics.jsonl")
  (tmp_path / "lock").symlink_to(tmp_path / "does-not-exist")  # a dangling link too
  with pytest.raises(UnsafePathError, match="lock"):
    files.open_nofollow(tmp_path / "lock", os.O_RDWR | os.O_CREAT)
  assert not (tmp_path / "does-not-exist").exists()
  assert victim.read_text() == "precious\n"
  with files.open_append(tmp_path / "log", binary=True) as f:
    f.write(b"a")
  with files.open_append(tmp_path / "log", binary=True) as f:
    f.write(b"b")
  assert (tmp_path / "log").read_bytes() == b"ab"


def test_make_dir_refuses_a_link(tmp_path):
  (tmp_path / "elsewhere").mkdir()
  (tmp_path / "tensorboard").symlink_to(tmp_path / "elsewhere")
  with pytest.raises(UnsafePathError, match="tensorboard"):
    files.make_dir(tmp_path / "tensorboard")
  files.make_dir(tmp_path / "a" / "b")
  assert (tmp_path / "a" / "b").is_dir()
