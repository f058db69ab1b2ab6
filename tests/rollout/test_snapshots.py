"""Which weight snapshots in a shared directory `remove_stale` may delete: only
isojax's, of a writer provably gone, unused by any live process here."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest

from isojax.rollout import snapshots

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")


@pytest.fixture(scope="module")
def gone():
  """The writer record of a process that has exited (its pid is free or reused)."""
  child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
  try:
    start = snapshots._start_time(child.pid)  # pylint: disable=protected-access
  finally:
    child.kill()
    child.wait()
  return dict(snapshots.writer_record(), pid=child.pid, start=start)


def _snapshot(root, name, record, files=("config.json", "model.safetensors")):
  path = root / name
  path.mkdir(parents=True)
  for f in files:
    (path / f).write_bytes(b"x" * 1000)
  if record is not None:
    (path / snapshots.RECORD).write_text(json.dumps(record))
  return path


def test_only_snapshots_of_gone_writers_here_are_removed(tmp_path, gone, caplog):
  root = tmp_path / "weights"
  here = snapshots.writer_record()
  reused = dict(here, start=str(int(here["start"]) + 1))  # our pid, another process
  _snapshot(root, "weights_000001", gone)
  _snapshot(root, "weights_000002", here)  # a live writer's: in use
  _snapshot(root, "weights_000003", gone, files=("config.json", "notes.txt"))
  _snapshot(root, "weights_000004", None)  # no record: not provably isojax's
  _snapshot(root, "weights_000005", dict(gone, boot_id="another boot"))
  _snapshot(root, "weights_000006", gone)  # a live process names it (vllm serve)
  _snapshot(root, "weights_000007", gone)  # the served model's directory
  _snapshot(root, "weights_000008", reused, files=(
      "config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
      "model.safetensors.index.json"))
  _snapshot(root, "my_model", gone)  # not a snapshot name
  # A writer killed inside save_pretrained: its temporaries go with its snapshot;
  # another snapshot's, or a file of that name, stay.
  _snapshot(root, ".weights_000001.tmp-ab12cd", None, files=("model.safetensors",))
  _snapshot(root, ".weights_000001.old-0f0f0f0f", None)
  _snapshot(root, ".weights_000002.tmp-ef34gh", None)
  (root / ".weights_000008.tmp-file").write_text("not a directory")
  serving = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                              "--model", str(root / "weights_000006")])
  try:
    deadline = time.monotonic() + 10
    while ("weights_000006" not in (snapshots._read(f"/proc/{serving.pid}/cmdline") or "")
           and time.monotonic() < deadline):  # until its exec has set the command line
      time.sleep(0.01)
    with caplog.at_level(logging.INFO):
      removed = snapshots.remove_stale(str(root), keep=[str(root / "weights_000007")])
  finally:
    serving.kill()
    serving.wait()
  assert removed == [str(root / "weights_000001"), str(root / "weights_000008")]
  assert sorted(p.name for p in root.iterdir()) == [
      ".weights_000002.tmp-ef34gh", ".weights_000008.tmp-file", "my_model",
      "weights_000002", "weights_000003", "weights_000004", "weights_000005",
      "weights_000006", "weights_000007"]
  assert "removed 2 weight snapshots (0.0 MiB)" in caplog.text
  assert ("holds 5 weight snapshots (0.0 MiB) not written by a live process here"
          in caplog.text)
  assert ("weights_000003, weights_000004, weights_000005, weights_000006, "
          "weights_000007; delete them by hand" in caplog.text)


def test_writer_state_checks_only_what_this_process_can_see(gone):
  here = snapshots.writer_record()
  assert snapshots.writer_state(here) == "alive"
  assert snapshots.writer_state(gone) == "gone"
  # Another pid namespace (a container), another boot, or a record without a
  # start time: the pid proves nothing here.
  for other in (dict(gone, pid_ns="pid:[1]"), dict(gone, boot_id="x"),
                dict(gone, start=None), dict(gone, pid="12")):
    assert snapshots.writer_state(other) == "unknown", other


def test_reserve_takes_the_next_free_number_and_marks_it(tmp_path):
  root = tmp_path / "w"
  (root / "weights_000005").mkdir(parents=True)  # another writer's, unmarked yet
  first, second = snapshots.reserve(str(root)), snapshots.reserve(str(root))
  assert [os.path.basename(first), os.path.basename(second)] == [
      "weights_000006", "weights_000007"]
  record = json.loads((root / "weights_000006" / snapshots.RECORD).read_text())
  assert record["pid"] == os.getpid() and snapshots.writer_state(record) == "alive"
