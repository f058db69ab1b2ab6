"""Sweeps: expand a study into budget points and run them, locally or as a SLURM array.

A study is an experiment file plus grids (Bp values, n values, budgets, seeds); every
(Bp, n, M, seed) is one run of `python -m isojax.main` in its own directory under the
sweep root, named from the point (`bp32_n64_m12_s0`). All budget arithmetic lives in
`isojax.budget`; launch scripts only pass numbers through.

    points.py   SweepPoint, Sweep (a run's command and directory), plan_sweep, dry run
    run_args.py the arguments after `--` passed to every run: checked, applied
    attempts.py a point's lock, log and attempts record (the run's own files:
                isojax.rundir)
    local.py    run_local: a bounded pool of subprocesses on this machine; the
                compilation cache a sweep's runs share
    slurm.py    write_array / run_task: one SLURM array task per point

Nothing here imports JAX: the launcher must start quickly and run where the trainer is
not importable (a login node, a laptop that only writes SLURM scripts).
"""

from isojax.sweep.attempts import (ATTEMPTS_FILE, LOCK_FILE, LOG_FILE, lock_holder,
                                   record_attempt, try_lock)
from isojax.sweep.local import (COMPILATION_CACHE_DIR, CORES_PER_RUN, SweepReport, cpu_count,
                                default_concurrency, has_accelerator, run_env, run_local,
                                with_compilation_cache)
from isojax.sweep.points import (BASE_MODEL_DIR, DEFAULT_RUNNER, Sweep, SweepPoint,
                                 expand_points, format_points, load_experiment,
                                 max_tokens, plan_sweep, vllm_model)
from isojax.sweep.run_args import RESERVED_RUN_FLAGS, apply_overrides, check_run_args

__all__ = [
    "ATTEMPTS_FILE", "BASE_MODEL_DIR", "COMPILATION_CACHE_DIR", "CORES_PER_RUN",
    "DEFAULT_RUNNER", "LOCK_FILE", "LOG_FILE", "RESERVED_RUN_FLAGS", "Sweep", "SweepPoint",
    "SweepReport",
    "apply_overrides", "check_run_args", "cpu_count", "default_concurrency",
    "expand_points", "format_points", "has_accelerator", "load_experiment",
    "lock_holder", "max_tokens", "plan_sweep", "record_attempt", "run_env", "run_local",
    "try_lock", "vllm_model", "with_compilation_cache",
]
