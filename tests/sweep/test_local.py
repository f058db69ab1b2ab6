"""Tests for isojax/sweep/local.py: what a local sweep gives its runs."""

import errno
import os
import subprocess
import sys
import textwrap

from isojax import budget, sweep
from isojax.sweep import local
from tests.test_sweep import FAKE_RUNNER, LAUNCHER, REPO, TINY, _env

# A run that needs the experiment file's package, as `isojax.main` does to load it.
IMPORTING_RUNNER = textwrap.dedent('''
    import os, sys
    import experiments.common
    workdir = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--workdir=")][0]
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "experiments_from.txt"), "w") as f:
        f.write(os.path.dirname(os.path.dirname(experiments.common.__file__)))
    open(os.path.join(workdir, "DONE"), "w").close()
''')


def test_runs_import_the_experiment_package_from_any_cwd(tmp_path):
  runner = tmp_path / "runner.py"
  runner.write_text(IMPORTING_RUNNER)
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  args = [sys.executable, LAUNCHER, f"--config={REPO}/experiments/tiny.py", "--bp=4",
          "--n=2", "--budget=64", f"--runner={runner}"]
  env = _env()
  # launch/sweep.py imports isojax from its own checkout; nothing else puts the
  # checkout on the path.
  env.pop("PYTHONPATH", None)
  proc = subprocess.run([*args, "--root=local"], cwd=elsewhere, env=env,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert (elsewhere / "local" / "bp4_n2_m8_s0" / "experiments_from.txt").read_text() == REPO
  # A SLURM task runs in the directory the array was written from: the same holds.
  subprocess.run([*args, "--root=slurm", "--slurm"], cwd=elsewhere, env=env, check=True,
                 capture_output=True, timeout=120)
  proc = subprocess.run(["bash", "slurm/slurm/sweep.sbatch"], cwd=elsewhere,
                        env={**env, "SLURM_ARRAY_TASK_ID": "0"}, capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert (elsewhere / "slurm" / "bp4_n2_m8_s0" / "experiments_from.txt").read_text() == REPO


def _points(*ns):
  return tuple(sweep.SweepPoint(budget.BudgetPoint(bp=4, n=n, m=2)) for n in ns)


def test_a_point_that_cannot_be_written_fails_alone(tmp_path, monkeypatch):
  runner = tmp_path / "runner.py"
  runner.write_text(FAKE_RUNNER)
  root = tmp_path / "root"
  study = sweep.Sweep(config=TINY, root=str(root), points=_points(2, 4, 8),
                      runner=(str(runner),))
  root.mkdir()
  (root / "bp4_n2_m2_s0").write_text("a file where the run directory goes")
  real = local.record_attempt

  def disk_full_for_n4(run_dir, **event):
    if run_dir.endswith("bp4_n4_m2_s0"):
      raise OSError(errno.ENOSPC, "No space left on device")
    return real(run_dir, **event)

  monkeypatch.setattr(local, "record_attempt", disk_full_for_n4)
  out = []
  report = sweep.run_local(study, max_concurrent=2, env=_env(), poll_s=0.05,
                           print_fn=out.append)
  assert sorted(report.failed) == ["bp4_n2_m2_s0", "bp4_n4_m2_s0"], out
  assert "bp4_n2_m2_s0" in report.failed["bp4_n2_m2_s0"]  # names the path
  assert "No space left on device" in report.failed["bp4_n4_m2_s0"]
  assert report.finished == ["bp4_n8_m2_s0"]


def test_threads_per_run_count_the_runs_that_can_be_going(tmp_path, monkeypatch):
  monkeypatch.setattr(local, "cpu_count", lambda: 8)
  runner = tmp_path / "runner.py"
  runner.write_text(FAKE_RUNNER)
  study = sweep.Sweep(config=TINY, root=str(tmp_path / "r"), points=_points(2, 4, 8),
                      runner=(str(runner),))
  (tmp_path / "r" / "bp4_n2_m2_s0").mkdir(parents=True)
  (tmp_path / "r" / "bp4_n2_m2_s0" / "DONE").touch()
  out = []
  sweep.run_local(study, max_concurrent=8, env={}, poll_s=0.05, print_fn=out.append)
  assert "(4 thread(s) each)" in out[0]  # two points left of three, eight cores
