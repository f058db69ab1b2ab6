"""The run directory's layout and its metrics reader, shared by run, sweep and analysis.

A run directory (`python -m isojax.main --workdir=DIR`) holds

    config.json     the resolved config, with the derived budget point
    data.json       digests of the problems it trains and validates on
    metrics.jsonl   one JSON object per line, each with a numeric "step"
    tensorboard/    the same scalars for TensorBoard
    checkpoints/    orbax steps: train state + host state
    DONE            written last; a finished run is not rerun
    .run.lock       held (flock) by the process training in it

The trainer writes it, the sweep launcher polls it, and the analysis reads copies of
it on machines without JAX: this module is plain Python so that all three can
import it.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import math
import os

from isojax.files import lock_holder, read_tail, try_flock

CONFIG_FILE = "config.json"
DATA_FILE = "data.json"
METRICS_FILE = "metrics.jsonl"
DONE_FILE = "DONE"
CHECKPOINT_DIR = "checkpoints"
TENSORBOARD_DIR = "tensorboard"
RUN_LOCK_FILE = ".run.lock"

# Standard logging, not absl's: the analysis imports this module without absl.
_log = logging.getLogger(__name__)

# config.json fields that do not change what a run computes, so a rerun may change
# them (isojax.run_config) and copies of one run may differ in them (the analysis):
# where the vLLM server and its weight snapshots are, how long to wait for it, how
# many checkpoints to keep...
RUNTIME_FIELDS = frozenset({
    "sampler.vllm_url", "sampler.vllm_weights_dir", "sampler.vllm_connect_timeout_s",
    "sampler.vllm_probe_timeout_s", "sampler.vllm_request_timeout_s", "keep_checkpoints",
})
# ...and the study the run is a point of (the launcher's grid; experiments/common.py).
STUDY_PREFIX = "sweep."


def is_runtime_field(key: str) -> bool:
  """Whether a dotted config.json field may differ between reruns of one run."""
  return key in RUNTIME_FIELDS or key.startswith(STUDY_PREFIX)


# How much of metrics.jsonl `last_record` reads: many lines of any real run.
_TAIL_BYTES = 8192


def is_done(run_dir: str | os.PathLike) -> bool:
  """Whether the run in `run_dir` finished (wrote DONE after its last step)."""
  return os.path.exists(os.path.join(run_dir, DONE_FILE))


def read_json_object(path: str | os.PathLike) -> dict:
  """A run file holding one JSON object (config.json, DONE); ValueError naming the
  file when it is not one (a truncated copy, an edit by hand)."""
  try:
    with open(path, encoding="utf-8") as f:
      value = json.load(f)
  except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
    raise ValueError(f"{path} is not valid JSON ({e}); a run writes it whole, so it "
                     f"was cut or edited: restore it") from None
  if not isinstance(value, dict):
    raise ValueError(f"{path} holds a JSON {type(value).__name__}, not the object a run "
                     f"writes: restore it")
  return value


def lock_run_dir(run_dir: str | os.PathLike) -> int | None:
  """Locks `run_dir` for the calling process (its fd: close it to release).

  Two processes training in one directory would interleave their metrics and
  checkpoints, so the second is refused (ValueError naming the holder). None
  where the filesystem has no flock (some cluster mounts): unguarded then, with
  a warning saying so.
  """
  path = os.path.join(run_dir, RUN_LOCK_FILE)
  try:
    fd = try_flock(path, f"run {os.getpid()} on {os.uname().nodename}")
  except OSError as e:
    if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
      _log.warning("%s cannot be locked (%s): nothing stops a second run in %s from "
                   "mixing its metrics and checkpoints with this one's; start one run "
                   "per --workdir", path, os.strerror(e.errno), os.fspath(run_dir))
      return None
    raise
  if fd is None:
    holder = lock_holder(path, unknown="another process")
    raise ValueError(f"{os.fspath(run_dir)} is in use by {holder} (it holds {path}): "
                     f"two runs in one directory would mix their metrics and "
                     f"checkpoints; wait for it to end, or use another --workdir")
  return fd


def parse_record(line: str | bytes) -> dict | None:
  """One metrics.jsonl line as a dict, or None unless it is a JSON object with a
  finite numeric "step" (`true` is not a step: JSON's booleans load as ints)."""
  try:
    record = json.loads(line)
  except ValueError:  # JSONDecodeError, or bytes that are not UTF-8
    return None
  step = record.get("step") if isinstance(record, dict) else None
  if isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step):
    return None
  return record


@dataclasses.dataclass(frozen=True)
class MetricsLines:
  """What `read_metrics` found: the records in file order and the lines it skipped.

  Attributes:
    records: the parsed lines, in the order they were written.
    corrupt: 1-based numbers of the lines skipped as unparseable (tolerant
      reading only; a strict read raises instead).
  """

  records: tuple[dict, ...]
  corrupt: tuple[int, ...] = ()


def read_metrics(path: str | os.PathLike, *, tolerant: bool = False) -> MetricsLines:
  """Every record of a metrics.jsonl file (none if it does not exist).

  Two policies, one per reader:
    strict (tolerant=False), the trainer resuming its own file: a torn last line
      (no newline: the write of a killed run) is skipped, and any other line that
      is not a record raises ValueError naming path and line;
    tolerant (tolerant=True), the analysis of copied sweeps: blank lines are
      ignored, and every line that is not a record is skipped and reported in
      `corrupt` (a torn last line that still parses is kept).
  """
  path = os.fspath(path)
  if not os.path.exists(path):
    return MetricsLines(records=())
  records, corrupt = [], []
  with open(path, encoding="utf-8", errors="replace") as f:
    for lineno, line in enumerate(f, start=1):
      if tolerant and not line.strip():
        continue
      if not tolerant and not line.endswith("\n"):
        break  # torn write of a killed run
      record = parse_record(line)
      if record is not None:
        records.append(record)
      elif tolerant:
        corrupt.append(lineno)
      else:
        raise ValueError(f"{path}:{lineno}: not a JSON object with a numeric step")
  return MetricsLines(records=tuple(records), corrupt=tuple(corrupt))


def last_record(run_dir: str | os.PathLike) -> dict | None:
  """The last complete record of the run's metrics.jsonl, or None.

  Reads only the file's tail, so polling many runs of a long sweep stays cheap;
  a longer one when no whole line fits in it (a record of many validation sets).
  """
  size = _TAIL_BYTES
  while True:
    try:
      tail = read_tail(os.path.join(run_dir, METRICS_FILE), size)
    except OSError:
      return None
    whole = len(tail) < size  # the tail is the whole file
    lines = tail.split(b"\n")[:-1]  # the last element is '' or a partial line
    for line in reversed(lines if whole else lines[1:]):  # lines[0] may be cut
      record = parse_record(line)
      if record is not None:
        return record
    if whole:
      return None
    size *= 4
