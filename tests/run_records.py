"""Reading a run directory's metrics in tests."""

import pathlib

from isojax import rundir


def records(workdir) -> tuple[dict, ...]:
  """The metrics.jsonl records of the run in `workdir`."""
  return rundir.read_metrics(pathlib.Path(workdir) / rundir.METRICS_FILE).records


def without_timing(record: dict) -> dict:
  """A record without device_hours, the one column that measures wall-clock time."""
  return {k: v for k, v in record.items() if k != "device_hours"}
