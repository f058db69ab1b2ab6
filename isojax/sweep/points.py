"""A study as data: its points, their run directories and commands, the dry-run table."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Iterable, Sequence

from isojax import budget as budget_lib
from isojax.assets import ASSETS_DIR, BASE_MODEL_DIR
from isojax.data import problem_sets
from isojax.sweep.run_args import apply_overrides, b_max_args, check_run_args

DEFAULT_RUNNER = ("-m", "isojax.main")  # what follows the interpreter in a run command


@dataclasses.dataclass(frozen=True, order=True)
class SweepPoint:
  """One run of a sweep: a budget point and the seed it is trained with."""

  point: budget_lib.BudgetPoint
  seed: int = 0

  @property
  def name(self) -> str:
    """Stable run-directory name, e.g. 'bp32_n64_m12_s0'."""
    return f"{self.point.name}_s{self.seed}"

  def config_arg(self) -> str:
    """The experiment file's argument for this point. budget = Bp*n*M exactly, so
    the run's M = floor(budget / (Bp*n)) is this point's M."""
    p = self.point
    return f"bp={p.bp},n={p.n},budget={p.compute}"


def expand_points(bp_values: Iterable, n_values: Iterable, *, b_max, budgets,
                  seeds: Iterable[int] = (0,), min_n: int = 1, estimator: str = "",
                  n_est: int | None = None, batch: int | None = None) -> list[SweepPoint]:
  """All feasible (Bp, n, M) points of the grid (via `budget.sweep_grid`) x seeds.

  Args:
    min_n: the fewest rollouts per problem the run's advantage estimator (named
      `estimator`, for messages) is defined for; smaller n are infeasible.
    n_est: the config's decoupled baseline (rl.n_est), which sets M as the run does.
    batch: a fixed-batch study's B (§4.2): only the pairs on its line Bp * n = B.

  Raises:
    ValueError: for an empty seed list, or when no point fits (naming the numbers).
  """
  seeds = [int(s) for s in seeds]
  if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
    raise ValueError(f"seeds must be a non-empty list of distinct ints >= 0, got {seeds}")
  n_values = list(n_values)
  if n_values and all(float(n) < min_n for n in n_values):
    raise ValueError(f"no feasible budget point: every n in {n_values} is below the "
                     f"{min_n} rollouts per problem the {estimator or 'advantage'} "
                     f"estimator needs")
  grid = budget_lib.sweep_grid(bp_values, n_values, b_max=b_max, budget=budgets,
                              n_est=n_est)
  if batch:
    grid = [p for p in grid if p.batch == batch]
    if not grid:
      raise ValueError(f"no feasible budget point on the fixed batch Bp*n = {batch} of "
                       f"Bp={list(bp_values)} x n={n_values}")
  return [SweepPoint(p, s) for p in grid if p.n >= min_n for s in seeds]


def dropped_points(bp_values: Iterable, n_values: Iterable, *, b_max, budgets,
                   min_n: int = 1, estimator: str = "", n_est: int | None = None,
                   batch: int | None = None) -> list[str]:
  """Why each (Bp, n, C) of the grid that `expand_points` leaves out is infeasible,
  one line each in `BudgetPoint.feasible`'s words, e.g. 'Bp=64 n=8 C=256: infeasible
  budget point: Bp*n = 64*8 = 512 exceeds b_max = 256'. With a fixed `batch`, pairs
  off its line are not the study's and are not listed."""
  budgets = list(budgets) if isinstance(budgets, Sequence) and not isinstance(
      budgets, str) else [budgets]
  out = []
  for c in sorted({float(x) for x in budgets}):
    for bp in sorted({int(x) for x in bp_values}):
      for n in sorted({int(x) for x in n_values}):
        if batch and bp * n != batch:
          continue
        why = []
        try:
          budget_lib.BudgetPoint.feasible(c, bp=bp, n=n, n_est=n_est, b_max=b_max)
        except ValueError as e:
          why.append(str(e))
        if n < min_n:
          why.append(f"n < {min_n}, the fewest the {estimator or 'advantage'} "
                     f"estimator is defined for")
        if why:
          out.append(f"Bp={bp} n={n} C={c:g}: {'; '.join(why)}")
  return out


def load_experiment(config_path: str, arg: str = ""):
  """Calls `get_config(arg)` of an experiment file (no flags, no locking).

  Raises:
    ValueError: if the file does not exist or defines no `get_config`.
  """
  if not os.path.isfile(config_path):
    raise ValueError(f"experiment file {config_path!r} does not exist")
  # Experiment files import their siblings as `experiments.common`: make the
  # directory above their package importable, as it is for the runs
  # (`experiment_import_root`), and the cwd, as under `python -m isojax.main`.
  for directory in (experiment_import_root(config_path), os.getcwd()):
    if directory not in sys.path:
      sys.path.insert(0, directory)
  spec = importlib.util.spec_from_file_location("_isojax_experiment", config_path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  get_config = getattr(module, "get_config", None)
  if get_config is None:
    raise ValueError(f"experiment file {config_path!r} defines no get_config(arg)")
  return get_config(arg) if inspect.signature(get_config).parameters else get_config()


def experiment_import_root(config_path: str) -> str:
  """The directory an experiment file's imports resolve from: the parent of the
  outermost package that holds it (the repository root for `experiments/tiny.py`,
  which imports `experiments.common`), or its own directory outside a package."""
  directory = os.path.dirname(os.path.abspath(_split_config(config_path)[0]))
  while (os.path.isfile(os.path.join(directory, "__init__.py"))
         and os.path.dirname(directory) != directory):
    directory = os.path.dirname(directory)
  return directory


def vllm_model(config) -> str | None:
  """The HF directory a vLLM server must serve for runs of `config`, or None when the
  config samples in-process."""
  sampler = config.get("sampler") or {}
  if sampler.get("backend", "jax") != "vllm":
    return None
  # An empty model.path means the committed tiny base model, to the run as here.
  return (config.get("model") or {}).get("path", "") or str(BASE_MODEL_DIR)


@dataclasses.dataclass(frozen=True)
class Sweep:
  """What a launcher runs: one experiment file, a root and its points.

  Attributes:
    config: the experiment file, with the study's own argument when it has one
      (`experiments/data_size.py:d=500`); each point adds bp, n and budget.
    root: the sweep root; each point runs in `root/<point name>`.
    points: the runs.
    runner: what follows the interpreter in a run command; tests inject a fake.
    extra_args: appended to every run command (e.g. `--config.eval_every=2`).
    python: the interpreter that runs the points.
  """

  config: str
  root: str
  points: tuple[SweepPoint, ...]
  runner: tuple[str, ...] = DEFAULT_RUNNER
  extra_args: tuple[str, ...] = ()
  python: str = sys.executable
  # Grid points left out, with the reason (`dropped_points`; Bp above the training set).
  dropped: tuple[str, ...] = ()

  def __post_init__(self):
    check_run_args(self.extra_args)
    names = [sp.name for sp in self.points]
    dupes = sorted({x for x in names if names.count(x) > 1})
    if dupes:
      raise ValueError(f"sweep has duplicate run names {dupes}")

  def run_dir(self, sp: SweepPoint) -> str:
    return os.path.join(self.root, sp.name)

  def command(self, sp: SweepPoint) -> list[str]:
    """The full argv that trains one point."""
    sep = "," if ".py:" in self.config else ":"
    return [self.python, *self.runner, f"--config={self.config}{sep}{sp.config_arg()}",
            f"--workdir={self.run_dir(sp)}", f"--config.seed={sp.seed}",
            *self.extra_args]

  def config_digest(self, sp: SweepPoint) -> str:
    """sha256 of the config `command(sp)` gives its run, read from the experiment file
    now: the same command after the file, or one it imports, was edited (another
    learning rate in experiments/common.py) gives another digest, so a finished point
    is not skipped on its command alone.

    Raises:
      ValueError: when the file cannot be loaded or an argument does not apply.
    """
    path, arg = _split_config(self.config)
    config = load_experiment(path, ",".join(filter(None, (arg, sp.config_arg()))))
    config = apply_overrides(config, [f"--config.seed={sp.seed}", *self.extra_args])
    text = config.to_json_best_effort(sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def plan_sweep(config_path: str, root: str, *, bp=None, n=None, budgets=None,
               b_max=None, seeds: Sequence[int] = (0,), runner: str = "isojax.main",
               extra_args: Sequence[str] = (), python: str = sys.executable):
  """A `Sweep` of an experiment file; grids not given come from its `config.sweep`.

  Args:
    config_path: the experiment file, optionally with the study's own argument
      (`FILE:setting=decoupled`), which may not set bp, n or budget: the launcher
      sets them for each point.
    root: the sweep root.
    bp, n, budgets, b_max: the grid; None = the config's sweep.bp_values,
      sweep.n_values, sweep.budgets and b_max. A b_max given reaches every run
      as `--config.b_max` (`b_max_args`).
    seeds: one run per point per seed.
    runner: a module (`isojax.main`) or a `.py` file run for each point.
    extra_args: appended to every run command (`--config.eval_every=2`); none may
      set what the launcher sets per point (`check_run_args`).

  Returns:
    (sweep, config) where config is `get_config(ARG)` of the file.

  Raises:
    ValueError: for a bad grid or argument, or when no point is left (every one
      infeasible, or every Bp above the training problems the launcher counted).
  """
  check_run_args(extra_args)
  extra_args = b_max_args(b_max, extra_args)
  path, arg = _split_config(config_path)
  config = apply_overrides(load_experiment(path, arg), extra_args)
  config_path = f"{path}:{arg}" if arg else path
  grid = config.get("sweep", {})
  bp = grid.get("bp_values") if bp is None else bp
  n = grid.get("n_values") if n is None else n
  budgets = grid.get("budgets") if budgets is None else budgets
  b_max = config.get("b_max")
  for name, value in (("bp", bp), ("n", n), ("budget", budgets), ("b_max", b_max)):
    if value is None or (not value and not isinstance(value, (int, float))):
      raise ValueError(f"no {name} values: pass --{name} or set them in "
                       f"{config_path} (config.sweep / config.b_max)")
  rl = config.get("rl") or {}
  estimator = rl.get("adv_estimator", "")
  # With a decoupled baseline (rl.n_est) the estimator sees n_est rollouts per
  # problem whatever n is; the run checks n_est itself.
  n_est = int(rl.get("n_est") or 0) or None
  min_n = 1 if n_est else _min_n(estimator)
  # A fixed-batch study (§4.2) runs the pairs on its line Bp * n = B only.
  batch = int(grid.get("batch") or 0) or None
  points = expand_points(bp, n, b_max=b_max, budgets=budgets, seeds=seeds, min_n=min_n,
                         estimator=estimator, n_est=n_est, batch=batch)
  dropped = dropped_points(bp, n, b_max=b_max, budgets=budgets, min_n=min_n,
                           estimator=estimator, n_est=n_est, batch=batch)
  points, too_big = _fit_training_set(points, config, config_path)
  run = (runner,) if runner.endswith(".py") else ("-m", runner)
  return Sweep(config=config_path, root=root, points=tuple(points), runner=run,
               extra_args=tuple(extra_args), python=python,
               dropped=tuple(dropped + too_big)), config


def _training_problem_count(config) -> int | None:
  """How many training problems `config.data` gives, before data.drop_too_long (which
  needs the model's tokenizer); None when they cannot be loaded here (a file only the
  compute nodes see, a reader this machine lacks, a data setting the run will name):
  each run checks again."""
  data = config.get("data")
  if data is None:
    return None
  try:
    train, _ = problem_sets.load_problem_sets(data, ASSETS_DIR / "splits")
  except (OSError, ImportError, ValueError):
    return None
  return len(train)


def _fit_training_set(points: list[SweepPoint], config, config_path: str
                      ) -> tuple[list[SweepPoint], list[str]]:
  """The points whose Bp the training set can fill, and a line for each left out:
  a batch of more problems than the set holds would repeat one, and the run refuses it."""
  count = _training_problem_count(config)
  if count is None:
    return points, []
  kept = [sp for sp in points if sp.point.bp <= count]
  where = f"the {count} training problems of data.train={config.data.train!r}"
  if not kept:
    raise ValueError(f"no point of {config_path} fits {where}: every Bp in "
                     f"{sorted({sp.point.bp for sp in points})} exceeds it; lower Bp or use "
                     f"more problems")
  too_big = sorted({sp.point for sp in points if sp.point.bp > count})
  return kept, [f"Bp={p.bp} n={p.n} M={p.m}: Bp exceeds {where}" for p in too_big]


# What the launcher sets in each point's `--config=FILE:ARG` (`SweepPoint.config_arg`).
POINT_ARGS = ("bp", "n", "budget")


def _split_config(config_path: str) -> tuple[str, str]:
  """(file, study argument) of `--config=FILE[:ARG]`; ARG may not set a point's keys.

  The file is a .py (its name ends where ".py:" is), so ARG may hold "/" and ":".
  """
  path, sep, arg = config_path.partition(".py:")
  path = path + ".py" if sep else config_path.rstrip(":")
  items = [x.strip() for x in arg.split(",") if x.strip()]
  taken = [x for x in items if x.partition("=")[0].strip() in POINT_ARGS]
  if taken:
    raise ValueError(f"--config={config_path!r}: {', '.join(taken)} is set by the "
                     f"launcher for each point; use --bp, --n and --budget")
  return path, ",".join(items)


def _min_n(estimator: str) -> int:
  """The run's own rule (isojax.rl.advantages.min_group_size); 1 without an estimator."""
  if not estimator:
    return 1
  from isojax.rl.advantages import min_group_size  # lazy: imports JAX
  try:
    return min_group_size(estimator)
  except ValueError as e:  # its message names the estimator, not the field that set it
    raise ValueError(f"config.rl.adv_estimator: {e}") from None


def max_tokens(config) -> int | None:
  """The response-length cap a run of `config` samples to, or None without one.

  sampler.max_tokens = 0 is resolved as the run resolves it (the study's length,
  `isojax.budget.study_max_tokens`): every study file leaves it at 0, and reading
  0 as "no cap" left their dry-run tables without a token estimate.
  """
  sampler = config.get("sampler") or {}
  value = sampler.get("max_tokens")
  if value is None:
    return None
  model_path = (config.get("model") or {}).get("path", "")
  return budget_lib.study_max_tokens(int(value), model_path)


def format_points(points: Sequence[SweepPoint], max_tokens: int | None) -> str:
  """The dry-run table: one row per run, with a total row.

  est_tokens is an upper bound, C * max_tokens (responses may stop earlier);
  '-' when the config gives no max_tokens.
  """
  header = ["run", "Bp", "n", "B", "M", "compute", "est_tokens"]
  rows, total_c, total_t = [], 0, 0
  for sp in points:
    p = sp.point
    tokens = budget_lib.estimate_tokens(p, max_tokens) if max_tokens else None
    total_c += p.compute
    total_t += tokens or 0
    rows.append([sp.name, p.bp, p.n, p.batch, p.m, p.compute,
                 "-" if tokens is None else tokens])
  rows.append(["total", "", "", "", "", total_c, total_t if max_tokens else "-"])
  rows = [[str(v) for v in r] for r in rows]
  widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
  fmt = lambda r: "  ".join(  # noqa: E731
      v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths)))
  return "\n".join([fmt(header), *map(fmt, rows)])
