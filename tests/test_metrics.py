"""metrics.jsonl writing: durable lines, truncation on resume, torn last line."""

import errno
import json
import pathlib
import struct
import time
from unittest import mock

import numpy as np
import pytest

from isojax import metrics as metrics_lib
from isojax.errors import DiskFullError


def _purge_marks(tb_dir) -> list[list[int]]:
  """Per event file (oldest first): the steps of its session-start records, from
  which TensorBoard hides every earlier file's events."""
  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
  marks = []
  for path in sorted(tb_dir.iterdir()):
    data, i, steps = path.read_bytes(), 0, []
    while i < len(data):  # TFRecord: length (8 bytes), its crc (4), data, data crc (4)
      (size,) = struct.unpack("<Q", data[i:i + 8])
      event = event_pb2.Event.FromString(data[i + 12:i + 12 + size])
      i += 16 + size
      if event.HasField("session_log"):
        steps.append(event.step)
    marks.append(steps)
  return marks


def test_tensorboard_hides_what_a_restart_rewrites(tmp_path):
  """A resume hides the events after its checkpoint; a fresh start (a run killed
  before its first checkpoint) hides all earlier events, as it empties metrics.jsonl."""
  for resume_step, steps in ((None, range(3)), (None, range(2)), (0, range(1, 3))):
    time.sleep(1.1)  # an event file is named by the second it was opened in
    w = metrics_lib.MetricsWriter(tmp_path, resume_step=resume_step)
    for step in steps:
      w.write(step, {"train/reward": 0.1 * step})
    w.close()
  assert _purge_marks(tmp_path / "tensorboard") == [[0], [0], [1]]


def test_write_and_truncate_on_resume(tmp_path):
  w = metrics_lib.MetricsWriter(tmp_path, resume_step=None, tensorboard=True)
  for step in range(5):
    w.write(step, {"train/reward": np.float32(step / 3), "rollouts": np.int64(32 * step),
                   "loss": float("nan") if step == 2 else 0.5})
  w.close()
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert len(lines) == 5
  assert json.loads(lines[1]) == {"step": 1, "train/reward": float(np.float32(1 / 3)),
                                  "rollouts": 32, "loss": 0.5}
  assert np.isnan(json.loads(lines[2])["loss"])
  assert list((tmp_path / "tensorboard").iterdir())

  # A killed run left a torn line; resuming from step 2 keeps steps 0..2 only.
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 5, "train/rew')
  w = metrics_lib.MetricsWriter(tmp_path, resume_step=2, tensorboard=False)
  w.write(3, {"x": 1})
  w.close()
  got = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert got[:3] == lines[:3]
  assert [json.loads(x)["step"] for x in got] == [0, 1, 2, 3]

  # A file cut (or deleted) below the checkpoint's step is refused, left as it was.
  (tmp_path / "metrics.jsonl").write_text("".join(x + "\n" for x in got[:2]))
  with pytest.raises(ValueError, match=r"reaches step 1, but the run resumes from its "
                     r"checkpoint at step 3: the lines of steps 2..3 are gone"):
    metrics_lib.MetricsWriter(tmp_path, resume_step=3, tensorboard=False)
  assert (tmp_path / "metrics.jsonl").read_text().splitlines() == got[:2]
  (tmp_path / "metrics.jsonl").unlink()
  with pytest.raises(ValueError, match=r"reaches step none, .* steps 0..3 are gone"):
    metrics_lib.MetricsWriter(tmp_path, resume_step=3, tensorboard=False)

  # No checkpoint: a fresh start empties the file.
  metrics_lib.MetricsWriter(tmp_path, resume_step=None, tensorboard=False).close()
  assert (tmp_path / "metrics.jsonl").read_text() == ""


@pytest.mark.parametrize("value", [pathlib.Path("/tmp"), 1 + 2j, object(),
                                   np.datetime64("2020-01-01"), [1.0, object()]])
def test_a_value_with_no_json_form_is_refused_by_name(tmp_path, value):
  w = metrics_lib.MetricsWriter(tmp_path, resume_step=None, tensorboard=False)
  with pytest.raises(TypeError, match=r"metric 'val/x' is .*; a metric is a number"):
    w.write(1, {"val/x": value})
  with pytest.raises(ValueError, match=r"'step' entry \(7\): it would replace"):
    w.write(1, {"step": 7})
  record = w.write(1, {"a": np.array(["p", "q"]), "b": np.array([1, 2], object),
                       "c": {"d": np.float32(0.5)}, "e": np.bool_(True)})
  w.close()
  assert record == {"step": 1, "a": ["p", "q"], "b": [1, 2], "c": {"d": 0.5}, "e": True}
  assert [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
      record]  # nothing of the refused writes reached the file


def test_a_tensorboard_tag_holds_one_key_and_kind(tmp_path, caplog):
  w = metrics_lib.MetricsWriter(tmp_path, resume_step=None)
  w.write(0, {"train/pass@1": 0.25})
  w.write_histogram(0, "train/pass@1_hist", [0.0, 0.5])
  w._tb = mock.Mock(wraps=w._tb)  # what reaches TensorBoard from here on
  caplog.set_level("WARNING")
  w.write_histogram(0, "train/pass@1", [0.0, 0.5])
  w.write(1, {"val/avg@4": 0.5, "val/avg_4": 0.25})
  w.write(2, {"val/avg@4": 0.75, "val/avg_4": 0.5})
  w.write(2, {"train/pass@1": 0.5})  # the same key again is the same curve
  w.close()
  assert caplog.text.count("shares TensorBoard tag") == 2  # once per key left out
  assert "the histogram 'train/pass@1' shares TensorBoard tag 'train/pass_1' with the " \
      "scalar 'train/pass@1'" in caplog.text
  w._tb.add_histogram.assert_not_called()
  assert [c.args for c in w._tb.add_scalar.call_args_list] == [
      ("val/avg_4", 0.5), ("val/avg_4", 0.75), ("train/pass_1", 0.5)]
  lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [x.get("val/avg_4") for x in lines] == [None, 0.25, 0.5, None]  # kept here


def test_a_full_disk_while_cutting_back_names_the_file_and_keeps_it(tmp_path):
  path = tmp_path / "metrics.jsonl"
  text = "".join(json.dumps({"step": s}) + "\n" for s in range(4))
  path.write_text(text)

  def full(*args, **kwargs):  # as a write on a full disk raises: with no file name
    raise OSError(errno.ENOSPC, "No space left on device")

  with mock.patch.object(metrics_lib.files, "write_atomic", full):
    with pytest.raises(DiskFullError, match=rf"no space left on {path} while writing the "
                       r"metrics cut back to the resumed step; the run can be resumed"):
      metrics_lib.MetricsWriter(tmp_path, resume_step=2, tensorboard=False)
  assert path.read_text() == text
