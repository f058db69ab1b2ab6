"""Reading a run directory's metrics in tests."""

import pathlib

from isojax import run, rundir


def records(workdir) -> tuple[dict, ...]:
  """The metrics.jsonl records of the run in `workdir`."""
  return rundir.read_metrics(pathlib.Path(workdir) / rundir.METRICS_FILE).records


def without_timing(record: dict) -> dict:
  """A record without device_hours, the one column that measures wall-clock time."""
  return {k: v for k, v in record.items() if k != "device_hours"}


def stop_before_update(monkeypatch, step: int) -> None:
  """Makes `run.run` raise KeyboardInterrupt as it reaches update `step` (after
  writing the metrics of step - 1), as a kill would stop it."""
  update_on = run.update_on

  def stop(parts, state, sampled, **kw):
    if sampled.step == step:
      raise KeyboardInterrupt(f"stopped before update {step}")
    return update_on(parts, state, sampled, **kw)

  monkeypatch.setattr(run, "update_on", stop)
