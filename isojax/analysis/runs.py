"""Loading run directories written by the trainer, tolerant of what real sweeps leave.

A run directory holds `config.json` (the resolved config; Bp, n, M either at top level
or under "budget") and `metrics.jsonl` (one JSON object per line: "step", "rollouts",
"tokens", "train/reward", and at evaluation steps "val/avg@k", "val/best@k",
"val/worst@k"; runs that record it also log "device_hours", the cumulative wall-clock
seconds x devices / 3600 spent so far). Sweeps copied from a cluster contain runs that crashed, are still
running (a truncated last line) or diverged (NaN rewards), and sometimes the same run
twice (a directory copied next to its original); none of that may stop the analysis,
but every such thing is reported.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from isojax.rundir import (CONFIG_FILE, METRICS_FILE, is_runtime_field, read_json_object,
                           read_metrics)

# Compute axes a curve can be drawn against: rollouts (the IsoCompute playbook's),
# generated tokens (its App. E), updates M = rollouts / (Bp * n), and device-hours
# (ScaleRL's), read from the "device_hours" column of runs that log it.
UNITS = ("rollouts", "tokens", "steps", "device_hours")
DEVICE_HOURS = "device_hours"


class RunLoadWarning(UserWarning):
  """Something in a run directory was skipped or dropped while loading."""


@dataclasses.dataclass(frozen=True)
class LoadProblem:
  """One thing found wrong while loading: where, what kind, and the details."""

  path: str
  kind: str  # no_metrics, no_config, bad_config, empty, corrupt_lines, non_finite,
  # duplicate_steps, duplicate_run, no_eval, no_runs
  detail: str

  def __str__(self) -> str:
    return f"{self.path}: [{self.kind}] {self.detail}"


@dataclasses.dataclass(frozen=True)
class Run:
  """One training run: its budget point, config and metric rows (sorted by step).

  Attributes:
    name: path relative to the loaded root (POSIX separators); the sort key.
    path: absolute path of the run directory.
    bp, n: problems per batch and rollouts per problem.
    m: the planned number of updates (None when the config does not say).
    difficulty: the analysis group (`_difficulty`: data.difficulty, else sweep.split;
      None when the config names none).
    seed: the run's seed (None when absent).
    config: the whole resolved config as loaded from config.json.
    rows: metric records, one dict per logged step, sorted by step.
  """

  name: str
  path: str
  bp: int
  n: int
  m: int | None
  difficulty: str | None
  seed: int | None
  config: Mapping[str, Any]
  rows: tuple[Mapping[str, Any], ...]

  @property
  def batch(self) -> int:
    """Rollouts sampled per update: Bp * n, or Bp * n_est for a decoupled baseline."""
    n_est = _find(self.config, "n_est")
    return self.bp * (n_est if isinstance(n_est, int) and n_est > self.n else self.n)

  def get(self, dotted: str, default=None):
    """A config field by dotted path, e.g. run.get("rl.kl_coef")."""
    return _lookup(self.config, dotted, default)

  def column(self, key: str) -> np.ndarray:
    """A scalar metric as float64 per row, NaN where the row lacks it."""
    out = np.full(len(self.rows), np.nan)
    for i, row in enumerate(self.rows):
      v = row.get(key)
      if _is_value(v):
        out[i] = v
    return out

  def compute(self, unit: str = "rollouts") -> np.ndarray:
    """Cumulative compute per row in `unit` (one of UNITS; NaN where a row lacks it).

    Raises:
      ValueError: for an unknown unit, or "device_hours" from a run that never
        logged that column (runs written before it existed).
    """
    if unit not in UNITS:
      raise ValueError(f"unit must be one of {UNITS}, got {unit!r}")
    if unit == "tokens":
      return self.column("tokens")
    if unit == DEVICE_HOURS:
      hours = self.column(DEVICE_HOURS)
      if not np.isfinite(hours).any():
        raise ValueError(
            f"run {self.name!r} has no {DEVICE_HOURS!r} column in "
            f"{os.path.join(self.path, METRICS_FILE)} (cumulative wall-clock seconds x "
            f"devices / 3600, logged by newer runs); compute in device-hours needs it, "
            f"use unit 'rollouts' or 'tokens' for this run")
      return hours
    rollouts = self.column("rollouts")
    # Rows without a ledger count fall back to the budget identity C = Bp*n*step.
    missing = np.isnan(rollouts)
    if missing.any():
      rollouts[missing] = self.column("step")[missing] * self.batch
    return rollouts / self.batch if unit == "steps" else rollouts

  def points(self, metric: str, unit: str = "rollouts") -> tuple[np.ndarray, np.ndarray]:
    """(compute, value) at the rows that logged `metric`, both finite."""
    c, v = self.compute(unit), self.column(metric)
    keep = np.isfinite(c) & np.isfinite(v)
    return c[keep], v[keep]

  def metric_names(self) -> list[str]:
    """Every key logged by any row, sorted."""
    return sorted({k for row in self.rows for k in row})

  @property
  def config_key(self) -> tuple:
    """(difficulty, bp, n): runs sharing it are seeds of one configuration."""
    return (self.difficulty or "", self.bp, self.n)


@dataclasses.dataclass(frozen=True)
class LoadResult:
  """Everything `read_runs` found: the usable runs and the problems met."""

  runs: tuple[Run, ...]
  problems: tuple[LoadProblem, ...]


def _is_value(v) -> bool:
  """A metric value: a real number, NumPy's too (rows built in a notebook from
  arrays hold float32 / int64 scalars, which are no Python float or int)."""
  return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))


def _find(config: Mapping, key: str):
  """A budget field at top level, else under "budget" (both layouts are written)."""
  if key in config and config[key] is not None:
    return config[key]
  budget = config.get("budget")
  if isinstance(budget, Mapping) and budget.get(key) is not None:
    return budget[key]
  return None


def _as_int(value, what: str) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
          math.isfinite(value) and value == int(value) and value > 0):
    raise ValueError(f"{what} must be a positive integer, got {value!r}")
  return int(value)


def _parse_config(config: Mapping) -> dict:
  bp, n, m = _find(config, "bp"), _find(config, "n"), _find(config, "m")
  if bp is None or n is None:
    raise ValueError(f"no bp/n at top level or under 'budget' (keys: {sorted(config)})")
  seed = config.get("seed")
  return dict(bp=_as_int(bp, "bp"), n=_as_int(n, "n"),
              m=None if m is None else _as_int(m, "m"),
              difficulty=_difficulty(config),
              seed=seed if isinstance(seed, int) and not isinstance(seed, bool) else None)


def _lookup(config: Mapping, dotted: str, default=None):
  """A config field by dotted path; `default` where a part is missing."""
  node: Any = config
  for part in dotted.split("."):
    if not isinstance(node, Mapping) or part not in node:
      return default
    node = node[part]
  return node


def _difficulty(config: Mapping) -> str | None:
  """The run's analysis group: data.difficulty where a study sets a label of its
  own (easy_d500, mix_tri), else a top-level "difficulty", else the split its
  study file names (sweep.split: easy, hard); None when none is set."""
  for dotted in ("data.difficulty", "difficulty", "sweep.split"):
    value = _lookup(config, dotted)
    if value not in (None, ""):
      return str(value)
  return None


def _read_metrics(path: str, problems: list[LoadProblem]) -> list[dict]:
  """Rows of metrics.jsonl; corrupt lines and non-finite values are reported."""
  lines = read_metrics(path, tolerant=True)
  rows: dict[Any, dict] = {}
  corrupt, duplicates, non_finite = list(lines.corrupt), 0, {}
  for row in lines.records:
    clean = {}
    for k, v in row.items():
      if isinstance(v, float) and not math.isfinite(v):
        non_finite[k] = non_finite.get(k, 0) + 1
        continue  # dropped: a NaN reward must not pull a fit
      clean[k] = v
    if row["step"] in rows:
      duplicates += 1  # a resumed run re-logs steps; the last write wins
    rows[row["step"]] = clean
  if corrupt:
    shown = ", ".join(map(str, corrupt[:10])) + (" ..." if len(corrupt) > 10 else "")
    problems.append(LoadProblem(path, "corrupt_lines",
                                f"skipped {len(corrupt)} unparseable line(s): {shown}"))
  if non_finite:
    detail = ", ".join(f"{k} x{c}" for k, c in sorted(non_finite.items()))
    problems.append(LoadProblem(path, "non_finite",
                                f"dropped non-finite values: {detail}"))
  if duplicates:
    problems.append(LoadProblem(path, "duplicate_steps",
                                f"{duplicates} step(s) logged twice; kept the last"))
  return [rows[s] for s in sorted(rows)]


def _load_one(root: str, path: str, problems: list[LoadProblem]) -> Run | None:
  config_path = os.path.join(path, CONFIG_FILE)
  metrics_path = os.path.join(path, METRICS_FILE)
  if not os.path.isfile(metrics_path):
    problems.append(LoadProblem(path, "no_metrics", f"no {METRICS_FILE}; run skipped"))
    return None
  if not os.path.isfile(config_path):
    problems.append(LoadProblem(path, "no_config", f"no {CONFIG_FILE}; run skipped"))
    return None
  try:
    config = read_json_object(config_path)
    fields = _parse_config(config)
  except (ValueError, OSError) as e:
    problems.append(LoadProblem(config_path, "bad_config", f"{e}; run skipped"))
    return None
  rows = _read_metrics(metrics_path, problems)
  if not rows:
    problems.append(LoadProblem(path, "empty", "no usable metric rows; run skipped"))
    return None
  if not any(k.startswith("val/") for row in rows for k in row):
    problems.append(LoadProblem(path, "no_eval", "no 'val/...' metrics logged yet"))
  name = os.path.relpath(path, root).replace(os.sep, "/")
  return Run(name=name, path=path, config=config, rows=tuple(rows), **fields)


def _run_dirs(root: str) -> list[str]:
  """Directories holding a config.json or metrics.jsonl; their insides are not searched
  (checkpoints live there)."""
  found = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
    if CONFIG_FILE in filenames or METRICS_FILE in filenames:
      found.append(dirpath)
      dirnames[:] = []
  return sorted(found)


# How far a run goes (config.json's budget point, also at top level): runs that
# differ only in these (and in fields that change nothing it computes) follow one
# trajectory, the shorter a prefix of the longer.
_LENGTH_FIELDS = ("requested", "m", "compute")


def _trajectory(config: Mapping) -> str:
  """`config` without its length fields and runtime fields, as a key."""
  def keep(prefix: str, tree: Mapping) -> dict:
    return {k: keep(f"{prefix}{k}.", v) if isinstance(v, Mapping) else v
            for k, v in tree.items()
            if not (k in _LENGTH_FIELDS and prefix in ("", "budget."))
            and not is_runtime_field(f"{prefix}{k}")}
  return json.dumps(keep("", config), sort_keys=True)


def _drop_copies(runs: list[Run], problems: list[LoadProblem]) -> list[Run]:
  """One run per trajectory (the whole config, seed included, but for its length
  and the fields that change nothing it computes, `rundir.is_runtime_field`).

  Two directories with the same config.json are two copies of one run. Runs that
  differ only in their budget (`launch/sweep.py --budget=1024,4096`, which also
  writes each budget list into sweep.budgets) are one run stopped at two points:
  the same data order, schedule and random draws, so the shorter is a prefix of
  the longer. Counting both would weigh one run twice and pass it off as two
  seeds (§4 reads one run at every compute). The run that got furthest (most
  metric rows; then the first by name) is kept.
  """
  by_trajectory: dict[str, list[Run]] = {}
  for r in runs:
    by_trajectory.setdefault(_trajectory(r.config), []).append(r)
  keep = []
  for copies in by_trajectory.values():
    kept = min(copies, key=lambda r: (-len(r.rows), r.name))
    keep.append(kept)
    for r in copies:
      if r is kept:
        continue
      what = ("a copy of one run" if r.m == kept.m else
              f"the same run planned to stop at M={r.m} instead of {kept.m}")
      problems.append(LoadProblem(
          r.path, "duplicate_run",
          f"same config and seed ({r.get('seed')}) as {kept.name}: {what}, left out so "
          f"it is not counted twice (kept {kept.name}, {len(kept.rows)} metric rows; "
          f"this one has {len(r.rows)})"))
  return keep


def read_runs(root: str | os.PathLike) -> LoadResult:
  """Loads every run under `root` and returns them with the problems found.

  Runs are sorted by their path relative to `root`, so results never depend on the
  order the filesystem lists them. Copies of one run (the same config.json, seed
  included, or one differing only in its budget) are reported and counted once.

  Raises:
    ValueError: if `root` is not a directory.
  """
  root = os.path.abspath(os.fspath(root))
  if not os.path.isdir(root):
    raise ValueError(f"runs directory {root!r} does not exist or is not a directory")
  problems: list[LoadProblem] = []
  runs = [r for p in _run_dirs(root) if (r := _load_one(root, p, problems)) is not None]
  runs = _drop_copies(runs, problems)
  if not runs:
    problems.append(LoadProblem(root, "no_runs", "no loadable run directory found"))
  runs.sort(key=lambda r: r.name)
  return LoadResult(runs=tuple(runs), problems=tuple(problems))


def load_runs(root: str | os.PathLike) -> list[Run]:
  """Every run directory under `root`, sorted by name; problems become warnings.

  Each problem (corrupt lines with their count, a directory without metrics, dropped
  non-finite values, ...) is issued as a `RunLoadWarning`; use `read_runs` to get them
  as data instead.
  """
  result = read_runs(root)
  for problem in result.problems:
    warnings.warn(str(problem), RunLoadWarning, stacklevel=2)
  return list(result.runs)


_HIST_LIST_KEYS = ("train/pass1_hist", "train/pass@1_hist")
_HIST_PREFIX = "train/pass@1_hist/"


def pass1_histogram(row: Mapping) -> np.ndarray | None:
  """The training pass@1 histogram of a metric row as fractions per bin, or None.

  Two layouts are read: a list of bin counts under "train/pass1_hist", or one scalar
  per bin, "train/pass@1_hist/<bin start>" (the run loop's flattened form).
  """
  for key in _HIST_LIST_KEYS:
    v = row.get(key)
    if isinstance(v, list) and v:
      counts = np.asarray([x if isinstance(x, (int, float)) else np.nan for x in v],
                          dtype=np.float64)
      break
  else:
    bins = []
    for k, v in row.items():
      if k.startswith(_HIST_PREFIX) and isinstance(v, (int, float)):
        try:
          bins.append((float(k[len(_HIST_PREFIX):]), float(v)))
        except ValueError:
          continue
    if not bins:
      return None
    counts = np.asarray([v for _, v in sorted(bins)])
  total = counts.sum()
  if not np.isfinite(total) or total <= 0 or np.any(counts < 0):
    return None
  return counts / total


def evaluation_gaps(runs, metric: str, unit: str = "rollouts") -> list[str]:
  """A line per run with no finite `metric` at `unit` > 0, saying why, for the report.

  Such a run adds nothing to any curve: the normal state of a run still going (only
  its step-0 evaluation so far) or of one that stopped early or diverged.
  """
  out = []
  for run in runs:
    c, _ = run.points(metric, unit)
    if (c > 0).any():
      continue
    why = (f"no {metric!r} evaluation after step 0 (a run still going, or one that "
           f"stopped)" if c.size else f"{metric!r} never logged as a finite number")
    out.append(f"run {run.name} (Bp={run.bp}, n={run.n}): {why}; left out of the fits")
  return out


def eval_metrics(runs) -> list[str]:
  """The validation metrics ("val/avg@4", ...) logged by any of `runs`, sorted."""
  return sorted({k for r in runs for row in r.rows for k in row
                 if k.startswith("val/") and _is_value(row[k])})
