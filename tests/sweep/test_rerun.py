"""A rerun of a sweep skips a finished point only when the same command finished it on
the same experiment config; otherwise the run itself compares its saved config
(isojax.run_config), locally and in a SLURM task."""

import json
import os
import shutil
import textwrap

from isojax import sweep
from isojax.sweep import slurm
from tests.test_sweep import TINY, _env, _launch

# The part of `python -m isojax.main` a rerun of a finished point exercises: it saves
# its arguments as its config and, once DONE, exits 0 for the same ones and refuses
# others with the run's message.
CHECKING_RUNNER = textwrap.dedent('''
    import json, os, sys
    args = sys.argv[1:]
    workdir = [a.split("=", 1)[1] for a in args if a.startswith("--workdir=")][0]
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "starts.log"), "a") as f:
        f.write("started\\n")
    saved = os.path.join(workdir, "config.json")
    if os.path.exists(os.path.join(workdir, "DONE")):
        if json.load(open(saved)) != args:
            print(f"isojax.main: error: {saved} was written by a run with a different "
                  f"config; use a fresh --workdir or the same config", flush=True)
            sys.exit(2)
        sys.exit(0)
    json.dump(args, open(saved, "w"))
    open(os.path.join(workdir, "DONE"), "w").close()
''')
GRID = ("--bp=4", "--n=2,4", "--budget=64")
NAMES = ("bp4_n2_m8_s0", "bp4_n4_m4_s0")


def _runner(tmp_path):
  path = tmp_path / "checking_runner.py"
  path.write_text(CHECKING_RUNNER)
  return str(path)


def _starts(run_dir):
  return (run_dir / "starts.log").read_text().count("started")


def test_a_local_rerun_with_other_run_arguments_is_checked_by_the_run(tmp_path):
  root, runner = tmp_path / "r", _runner(tmp_path)
  sweep_args = (f"--config={TINY}", f"--root={root}", *GRID, f"--runner={runner}")
  _launch(*sweep_args)
  proc = _launch(*sweep_args)  # the same command: skipped without starting a run
  assert proc.stdout.count("already finished") == 2, proc.stdout
  assert [_starts(root / n) for n in NAMES] == [1, 1]
  proc = _launch(*sweep_args, "--", "--config.eval_every=4", check=False)
  assert proc.returncode == 1, proc.stdout
  for name in NAMES:  # each run was asked, and refused with its own message
    assert f"FAILED {name}: exit code 2" in proc.stdout
  assert proc.stdout.count("was written by a run with a different config") == 2
  assert "already finished" not in proc.stdout
  proc = _launch(*sweep_args)  # a refused attempt does not count as finishing it
  assert proc.stdout.count("already finished") == 2
  assert [_starts(root / n) for n in NAMES] == [2, 2]


def test_a_rerun_after_the_experiment_file_changed_is_checked_by_the_run(tmp_path):
  # The same command, but the study file now sets another learning rate: the
  # finished points are not skipped on their command alone.
  root, runner, study = tmp_path / "r", _runner(tmp_path), tmp_path / "study.py"
  shutil.copy(TINY, study)
  sweep_args = (f"--config={study}", f"--root={root}", *GRID, f"--runner={runner}")
  _launch(*sweep_args)
  with open(study, "a") as f:
    f.write(textwrap.dedent("""
        _tiny_config = get_config

        def get_config(arg=None):
          c = _tiny_config(arg)
          c.rl.lr_base = 3e-5
          return c
        """))
  proc = _launch(*sweep_args)
  # This runner checks only its arguments, which are the same: it exits 0.
  assert proc.stdout.count("finished under another command or config") == 2, proc.stdout
  assert proc.stdout.count("found its config unchanged") == 2
  assert [_starts(root / n) for n in NAMES] == [2, 2]
  proc = _launch(*sweep_args)  # recorded under the new config: skipped
  assert proc.stdout.count("same command and config") == 2, proc.stdout
  assert [_starts(root / n) for n in NAMES] == [2, 2]


def test_a_point_finished_without_a_recorded_command_is_checked_once(tmp_path):
  root, runner = tmp_path / "r", _runner(tmp_path)
  sweep_args = (f"--config={TINY}", f"--root={root}", *GRID, f"--runner={runner}")
  _launch(*sweep_args)
  os.remove(root / NAMES[0] / sweep.ATTEMPTS_FILE)  # finished by hand, say
  proc = _launch(*sweep_args)
  assert "the run checks its config" in proc.stdout
  assert "skip   bp4_n2_m8_s0: already finished; the run found its config unchanged" \
      in proc.stdout
  assert [_starts(root / n) for n in NAMES] == [2, 1]
  _launch(*sweep_args)  # now recorded: skipped without a start
  assert [_starts(root / n) for n in NAMES] == [2, 1]


def test_a_slurm_task_of_a_point_finished_by_another_command_is_checked(
    tmp_path, monkeypatch):
  root, runner = tmp_path / "r", _runner(tmp_path)
  sweep_args = (f"--config={TINY}", f"--root={root}", *GRID, f"--runner={runner}")
  _launch(*sweep_args, "--", "--config.eval_every=4")  # finished locally
  _launch(*sweep_args, "--slurm")
  points = str(root / "slurm" / slurm.POINTS_FILE)
  monkeypatch.setattr(os, "environ", _env())
  out = []
  assert slurm.run_task(points, 0, print_fn=out.append) == 2  # refused by the run
  assert _starts(root / NAMES[0]) == 2 and "checks its config" in out[0]
  # The same command as finished it: skipped at once.
  os.remove(points)
  _launch(*sweep_args, "--slurm", "--", "--config.eval_every=4")
  assert slurm.run_task(points, 0, print_fn=out.append) == 0
  assert _starts(root / NAMES[0]) == 2 and "already finished" in out[-1]
  # A task records its attempts as the local launcher does.
  ends = [json.loads(x) for x in (root / NAMES[0] / sweep.ATTEMPTS_FILE).open()]
  assert ends[-1]["event"] == "end" and ends[-1]["rc"] == 2
