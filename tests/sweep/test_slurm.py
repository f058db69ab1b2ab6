"""Tests for isojax/sweep/slurm.py: the #SBATCH lines as sbatch reads them, and what
write_array refuses."""

import json
import os
import threading

import pytest

from isojax import budget, sweep
from isojax.sweep import slurm

TINY = os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "tiny.py")


def sbatch_arguments(line: str) -> list[str]:
  """The arguments sbatch takes from one `#SBATCH` line: split at white space outside
  quotes ('...' or "..."), a backslash escaping the next character anywhere, `#`
  outside quotes ending the line; an unmatched quote is sbatch's fatal error."""
  args, arg, quote, escape, started = [], "", "", False, False
  for c in line[len("#SBATCH"):]:
    if escape:
      arg, escape, started = arg + c, False, True
    elif c == "\\":
      escape = True
    elif quote:
      if c == quote:
        quote = ""
      else:
        arg += c
    elif c in "\"'":
      quote, started = c, True
    elif c == "#":
      break
    elif c.isspace():
      if started or arg:
        args.append(arg)
      arg, started = "", False
    else:
      arg, started = arg + c, True
  assert not quote, f"sbatch: unmatched {quote} in {line!r}"
  return args + [arg] if started or arg else args


def test_the_tokenizer_follows_sbatch():
  assert sbatch_arguments("#SBATCH --a=1 --b=\"x y\" # note") == ["--a=1", "--b=x y"]
  assert sbatch_arguments("#SBATCH --a='it''s' --b=x\\ y\\#") == ["--a=its", "--b=x y#"]
  assert sbatch_arguments("#SBATCH --job-name=sweep #1") == ["--job-name=sweep"]


def test_sbatch_values_survive_any_root_name(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  root = "my dir's \"sweep\" #1 50% a\\b"
  sp = sweep.SweepPoint(budget.BudgetPoint(bp=8, n=4, m=2))
  options = slurm.SlurmOptions(partition="gpu debug", account="lab#2", time="01:00:00")
  script, _ = slurm.write_array(sweep.Sweep(config=TINY, root=root, points=(sp,)),
                                options)
  lines = [x for x in open(script).read().splitlines() if x.startswith("#SBATCH")]
  argv = [a for line in lines for a in sbatch_arguments(line)]
  logs = os.path.join(str(tmp_path), root, "slurm", "logs").replace("%", "%%")
  assert argv == [f"--job-name=isojax-{root}", "--array=0-0", "--nodes=1",
                  "--ntasks-per-node=1", f"--output={logs}/%A_%a.out",
                  "--partition=gpu debug", "--account=lab#2", "--time=01:00:00"]


def test_multi_node_points_with_a_script_runner_are_refused_when_written(tmp_path):
  sp = sweep.SweepPoint(budget.BudgetPoint(bp=8, n=4, m=2))
  study = sweep.Sweep(config=TINY, root=str(tmp_path / "r"), points=(sp,),
                      runner=("fake_runner.py",))
  with pytest.raises(ValueError, match="a multi-node point needs a module runner"):
    slurm.write_array(study, slurm.SlurmOptions(nodes=2))
  assert not (tmp_path / "r").exists()  # no array left behind to submit


def test_two_launchers_writing_other_arrays_at_once_refuse_the_second(tmp_path,
                                                                     monkeypatch):
  # Launcher B writes its array while A has checked the root is free and not yet
  # written: B must wait for A and then refuse, not write an array A overwrites.
  monkeypatch.chdir(tmp_path)
  def grid(n):
    return sweep.Sweep(config=TINY, root="sl",
                       points=(sweep.SweepPoint(budget.BudgetPoint(bp=4, n=n, m=2)),))
  real_check, outcome = slurm._check_no_other_array, {}

  def write_b():
    try:
      slurm.write_array(grid(8), slurm.SlurmOptions())
      outcome["b"] = "written"
    except ValueError as e:
      outcome["b"] = str(e)

  def check_then_let_b_in(points_path, spec):
    real_check(points_path, spec)
    if spec["points"][0]["name"].startswith("bp4_n2"):  # launcher A
      monkeypatch.setattr(slurm, "_check_no_other_array", real_check)
      b = threading.Thread(target=write_b)
      b.start()
      b.join(timeout=2)  # B runs to its end here unless the array lock holds it
      outcome["b_waited"] = b.is_alive()
      outcome["thread"] = b

  monkeypatch.setattr(slurm, "_check_no_other_array", check_then_let_b_in)
  _, points = slurm.write_array(grid(2), slurm.SlurmOptions())
  outcome["thread"].join(timeout=30)
  assert outcome["b_waited"]
  assert "already holds the SLURM array of another sweep" in outcome["b"]
  assert [p["name"] for p in json.load(open(points))["points"]] == ["bp4_n2_m2_s0"]
