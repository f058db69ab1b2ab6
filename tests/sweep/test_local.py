"""Tests for isojax/sweep/local.py: what a local sweep gives its runs."""

import os
import subprocess
import sys
import textwrap

from tests.test_sweep import LAUNCHER, REPO, _env

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
