"""metrics.jsonl writing: durable lines, truncation on resume, torn last line."""

import json

import numpy as np
import pytest

from isojax import metrics as metrics_lib


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

  # No checkpoint: a fresh start empties the file.
  metrics_lib.MetricsWriter(tmp_path, resume_step=None, tensorboard=False).close()
  assert (tmp_path / "metrics.jsonl").read_text() == ""
