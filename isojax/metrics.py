"""Writes a run's metrics: `metrics.jsonl` (the record) and TensorBoard (the view).

`metrics.jsonl` holds one JSON object per line, each with an integer `step`.
Every line is flushed and fsynced as it is written, so a killed run loses at
most the line being written. On resume the file is cut back to the lines with
step <= the restored checkpoint's step (and any torn last line is dropped): the
resumed run then rewrites the later steps, and the file equals that of a run
that was never interrupted (but for the measured `device_hours` column).

Values are written as Python floats/ints via `json.dumps` (repr of a float is
exact), so equal numbers give byte-equal lines. NaN/inf are written as the
JSON extensions NaN/Infinity, which Python's json reads back.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import pathlib
import re
from typing import Any

import numpy as np
from absl import logging

from isojax import files, rundir
from isojax.errors import disk_full_as

_TB_ILLEGAL = re.compile(r"[^-/\w\.]")


def _plain(value: Any, key: str) -> Any:
  """NumPy/JAX scalars and small arrays as JSON-native Python values.

  Raises:
    TypeError: naming `key`, for a value with no JSON form (a path, a complex
      number, an object): NumPy hands such a value back from `.item()` unchanged.
  """
  if isinstance(value, (bool, str)) or value is None:
    return value
  if isinstance(value, numbers.Integral):
    return int(value)
  if isinstance(value, numbers.Real):
    return float(value)
  if isinstance(value, dict):
    return {str(k): _plain(v, f"{key}.{k}") for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_plain(v, key) for v in value]
  arr = np.asarray(value)
  if arr.ndim:
    return _plain(arr.tolist(), key)
  if arr.dtype.kind in "biufU":  # a NumPy/JAX scalar: .item() is its Python value
    return _plain(arr.item(), key)
  raise TypeError(f"metric {key!r} is {value!r} ({type(value).__name__}); a metric "
                  f"is a number, string, bool, None, or a list or dict of them")


def tb_tag(key: str) -> str:
  """A TensorBoard-legal tag: "val/avg@4" -> "val/avg_4" (as tensorboardX would
  rename it, minus the log line per tag)."""
  return _TB_ILLEGAL.sub("_", key)


def truncate_metrics(path: str | pathlib.Path, max_step: int | None) -> int:
  """Keeps only complete lines with step <= max_step (none if max_step is None).

  Rewrites the file atomically (temporary file, fsync, rename). Returns the
  number of lines kept.

  Raises:
    ValueError: naming the steps, when the file does not reach max_step (a step's
      line is written, and synced, before its checkpoint: it was cut or replaced).
  """
  path = pathlib.Path(path)
  files.check_not_link(path)
  kept = [] if max_step is None else [
      r for r in rundir.read_metrics(path).records if int(r["step"]) <= max_step]
  reached = max((int(r["step"]) for r in kept), default=-1)
  if max_step is not None and reached < max_step:
    raise ValueError(
        f"{path} reaches step {reached if kept else 'none'}, but the run resumes from its "
        f"checkpoint at step {max_step}: the lines of steps {reached + 1}..{max_step} are "
        f"gone (the file was cut, replaced or deleted) and the run's curve would keep that "
        f"gap; restore the file, or run again in a fresh --workdir")
  files.write_atomic(path, "".join(json.dumps(record) + "\n" for record in kept))
  return len(kept)


class MetricsWriter:
  """Appends metric records to metrics.jsonl and mirrors scalars to TensorBoard.

  Args:
    workdir: the run directory.
    resume_step: the step of the checkpoint the run continues from (lines after
      it are removed), or None for a fresh start (the file is emptied).
    tensorboard: write TensorBoard event files under <workdir>/tensorboard.
    enabled: False on all but the first process of a multi-host run: records
      are still built and returned, nothing is written (one writer per file).
  """

  def __init__(self, workdir: str | pathlib.Path, *, resume_step: int | None,
               tensorboard: bool = True, enabled: bool = True):
    self.path = pathlib.Path(workdir) / rundir.METRICS_FILE
    self._file = self._tb = None
    # TensorBoard tag -> (kind, key) of what was written to it first.
    self._tags: dict[str, tuple[str, str]] = {}
    self._refused: set[tuple[str, str]] = set()
    if not enabled:
      return
    # A rerun while the disk is still full fails here first, in a write that names
    # no file; the cut is atomic, so the file is as the last run left it.
    with disk_full_as(self.path, "the metrics cut back to the resumed step"):
      truncate_metrics(self.path, resume_step)
    self._file = files.open_append(self.path)
    if tensorboard:
      # Imported where events are written: importing isojax.run (as the tests
      # and notebooks do) must not need TensorBoard installed.
      from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
      # purge_step hides the events a killed run wrote after its last checkpoint,
      # or all of them on a fresh start (metrics.jsonl is emptied then too).
      purge = 0 if resume_step is None else resume_step + 1
      files.make_dir(pathlib.Path(workdir) / rundir.TENSORBOARD_DIR)
      self._tb = SummaryWriter(str(pathlib.Path(workdir) / rundir.TENSORBOARD_DIR),
                               purge_step=purge)

  def write(self, step: int, metrics: dict) -> dict:
    """Appends {"step": step, **metrics} as one durable line; returns the record.

    Raises:
      ValueError: for a metric named "step" (it would replace the line's step,
        which resuming cuts the file by).
      TypeError: naming the metric, for a value with no JSON form.
    """
    if "step" in metrics:
      raise ValueError(f"metrics of step {step} have a 'step' entry ({metrics['step']!r}): "
                       f"it would replace the line's step; rename it")
    record = {"step": int(step), **{k: _plain(v, k) for k, v in metrics.items()}}
    if self._file is None:
      return record
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()
    os.fsync(self._file.fileno())
    if self._tb is not None:
      for key, value in record.items():
        if (key != "step" and isinstance(value, (int, float))
            and not isinstance(value, bool) and math.isfinite(value)
            and self._claim_tag(key, "scalar")):
          self._tb.add_scalar(tb_tag(key), value, global_step=int(step))
      self._tb.flush()
    return record

  def write_histogram(self, step: int, tag: str, values) -> None:
    """A TensorBoard histogram (e.g. per-problem pass@1); not part of the jsonl."""
    if self._tb is not None and self._claim_tag(tag, "histogram"):
      self._tb.add_histogram(tb_tag(tag), np.asarray(values), global_step=int(step))

  def _claim_tag(self, key: str, kind: str) -> bool:
    """Whether `key` may be drawn under its TensorBoard tag: one key and kind per tag.

    TensorBoard files a tag under the kind first written to it (a histogram sharing a
    scalar's tag never shows), and two keys that `tb_tag` makes one ("a@b", "a_b")
    would draw as one curve. The later key is left out of TensorBoard with a warning
    (once): metrics.jsonl, the run's record, keeps both, and a run is not stopped
    over how a curve is named.
    """
    tag = tb_tag(key)
    first = self._tags.setdefault(tag, (kind, key))
    if first == (kind, key):
      return True
    if (kind, key) not in self._refused:
      self._refused.add((kind, key))
      logging.warning("the %s %r shares TensorBoard tag %r with the %s %r: it is left out "
                      "of TensorBoard (metrics.jsonl has it)", kind, key, tag, *first)
    return False

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
    if self._tb is not None:
      self._tb.close()
