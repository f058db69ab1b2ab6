r"""Runs a study: every (Bp, n, M, seed) point of a grid, locally or as a SLURM array.

  python launch/sweep.py --config=experiments/tiny.py --root=runs/tiny \
      --bp=8 --n=2,4,8 --budget=1024,4096 --b_max=256 --seeds=0,1
  python launch/sweep.py ... --dry_run           # the table of points, nothing else
  python launch/sweep.py ... --slurm [--submit]  # <root>/slurm/sweep.sbatch, a task a point

Grid flags left out come from the experiment file's `config.sweep` (and `b_max`).
Arguments after `--` are appended to every run, e.g. `-- --config.eval_every=4`; those
that would set what the launcher sets per point (--workdir, --config, --config.seed,
.bp, .n, .budget) are refused, naming the launcher flag to use instead.
Rerunning the same command skips finished points and resumes unfinished ones; a point
finished under another command, or before the experiment file (or one it imports) was
edited, is started again, and its run checks its saved config
(as `python -m isojax.main` does on any rerun), refusing a different one. Points
are computed by isojax.sweep / isojax.budget; this file only parses flags.
"""

import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from isojax import errors, sweep  # noqa: E402  (needs the repo root on sys.path)
from isojax.sweep import slurm  # noqa: E402

_CONFIG = flags.DEFINE_string(
    "config", None, "Experiment file, e.g. experiments/tiny.py, with the study's own "
    "argument if any (experiments/data_size.py:d=500).")
_ROOT = flags.DEFINE_string("root", None, "Sweep root; each point runs in <root>/<name>.")
_BP = flags.DEFINE_list("bp", None, "Problems per batch Bp (default: sweep.bp_values).")
_N = flags.DEFINE_list("n", None, "Rollouts per problem n (default: sweep.n_values).")
_BUDGET = flags.DEFINE_list("budget", None,
                            "Rollout budgets C (default: config.sweep.budgets).")
_B_MAX = flags.DEFINE_integer("b_max", None, "Largest batch Bp*n (default: config.b_max); "
                              "given, every run gets it as --config.b_max.")
_SEEDS = flags.DEFINE_list("seeds", ["0"], "Seeds; one run per point per seed.")
_MAX_CONCURRENT = flags.DEFINE_integer(
    "max_concurrent", None, "Concurrent local runs (default: 1 with an accelerator, else "
    "one per CPU core, see isojax.sweep.default_concurrency).")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print the table of points and exit.")
_STATUS_EVERY = flags.DEFINE_float("status_every", 30.0, "Seconds between progress lines.")
_RUNNER = flags.DEFINE_string("runner", "isojax.main", "Module or .py file run per point.")

_SLURM = flags.DEFINE_bool("slurm", False, "Write a SLURM array script instead of running.")
_SUBMIT = flags.DEFINE_bool("submit", False, "With --slurm: also sbatch it.")
_NODES = flags.DEFINE_integer("nodes", 1, "SLURM nodes per point (>1: multi-host JAX).")
_GPUS = flags.DEFINE_integer("gpus_per_node", 0, "SLURM --gpus-per-node (0: unset).")
_CPUS = flags.DEFINE_integer("cpus_per_task", None, "SLURM --cpus-per-task.")
_MEM = flags.DEFINE_string("mem", None, "SLURM --mem.")
_PARTITION = flags.DEFINE_string("partition", None, "SLURM --partition.")
_ACCOUNT = flags.DEFINE_string("account", None, "SLURM --account.")
_TIME = flags.DEFINE_string("time", None, "SLURM --time, e.g. 24:00:00.")
_MAX_PARALLEL = flags.DEFINE_integer("max_parallel", None, "SLURM array throttle (%K).")
_SBATCH_ARG = flags.DEFINE_multi_string("sbatch_arg", [], "Extra #SBATCH option, verbatim.")

# Without --slurm these would be ignored while the sweep runs here instead.
_SLURM_ONLY = (_SUBMIT, _NODES, _GPUS, _CPUS, _MEM, _PARTITION, _ACCOUNT, _TIME,
               _MAX_PARALLEL, _SBATCH_ARG)

_VERBOSE = flags.DEFINE_bool("verbose", False,
                             "On an error, print the traceback, not just its message.")

_TASK_FILE = flags.DEFINE_string("task_file", None, "SLURM task mode: the points file.")
_TASK_INDEX = flags.DEFINE_integer("task_index", None, "SLURM task mode: the array index.")


def _numbers(name, values, kind):
  """Flag strings as numbers; isojax.budget checks they are positive integers."""
  if values is None:
    return None
  try:
    return [kind(v) for v in values]
  except ValueError as e:
    raise app.UsageError(f"--{name}={','.join(values)}: {e}") from e


def main(argv):
  try:
    _main(argv)
  except Exception as e:  # pylint: disable=broad-except
    if not errors.is_expected(e):
      raise
    sys.exit(errors.report(e, "launch/sweep.py", verbose=_VERBOSE.value))


def _main(argv):
  if _TASK_FILE.value is not None:
    if _TASK_INDEX.value is None:
      raise app.UsageError("--task_file needs --task_index")
    sys.exit(slurm.run_task(_TASK_FILE.value, _TASK_INDEX.value))
  if not _CONFIG.value or not _ROOT.value:
    raise app.UsageError("--config and --root are required")
  given = [f"--{f.name}" for f in _SLURM_ONLY if flags.FLAGS[f.name].present]
  if given and not _SLURM.value:
    raise app.UsageError(f"{', '.join(given)} only apply to a SLURM array: add --slurm, "
                         f"or leave {'them' if len(given) > 1 else 'it'} out to run here")
  study, config = sweep.plan_sweep(
      _CONFIG.value, _ROOT.value, bp=_numbers("bp", _BP.value, float),
      n=_numbers("n", _N.value, float), budgets=_numbers("budget", _BUDGET.value, float),
      b_max=_B_MAX.value, seeds=_numbers("seeds", _SEEDS.value, int),
      runner=_RUNNER.value, extra_args=argv[1:])
  if study.dropped:
    print(f"left out {len(study.dropped)} infeasible grid point(s):\n  "
          + "\n  ".join(study.dropped), file=sys.stderr)
  if _DRY_RUN.value:
    print(sweep.format_points(study.points, sweep.max_tokens(config)))
    return
  if _SLURM.value:
    options = slurm.SlurmOptions(
        nodes=_NODES.value, gpus_per_node=_GPUS.value, cpus_per_task=_CPUS.value,
        mem=_MEM.value, partition=_PARTITION.value, account=_ACCOUNT.value,
        time=_TIME.value, max_parallel=_MAX_PARALLEL.value,
        sbatch_args=tuple(_SBATCH_ARG.value))
    script, points = slurm.write_array(study, options,
                                       vllm_model=sweep.vllm_model(config),
                                       launcher=os.path.relpath(__file__))
    print(f"wrote {script} ({len(study.points)} tasks) and {points}")
    if _SUBMIT.value:
      print(f"submitted job {slurm.submit(script)}")
    return
  concurrent = _MAX_CONCURRENT.value or sweep.default_concurrency()
  try:
    report = sweep.run_local(study, max_concurrent=concurrent,
                             status_every_s=_STATUS_EVERY.value)
  except KeyboardInterrupt:  # the runs were stopped; their checkpoints stay
    print("interrupted: rerun the same command to resume")
    sys.exit(130)
  sys.exit(0 if report.ok else 1)


if __name__ == "__main__":
  app.run(main)
