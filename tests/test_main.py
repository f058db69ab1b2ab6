"""The command line: `python -m isojax.main --config=FILE:ARGS --workdir=DIR`."""

import json
import os
import pathlib
import subprocess
import sys
import textwrap
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _main(*args, timeout=600):
  return subprocess.run([sys.executable, "-m", "isojax.main", *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=timeout)


def test_readme_one_point_command_trains_and_a_rerun_does_nothing(readme, tmp_path):
  workdir = tmp_path / "tiny"
  argv = readme.argv(readme.command("python -m isojax.main --config=experiments/tiny.py:"),
                     {"--workdir=runs/tiny_point": f"--workdir={workdir}"})
  assert argv[3] == "--config=experiments/tiny.py:bp=8,n=4,budget=2048", argv
  start = time.time()
  proc = _main(*argv[3:])
  wall_s = time.time() - start
  assert proc.returncode == 0, proc.stderr[-3000:]
  print(f"tiny command: {wall_s:.0f} s")
  config = json.loads((workdir / "config.json").read_text())
  assert config["budget"]["m"] == 64 and config["m"] == 64
  lines = (workdir / "metrics.jsonl").read_text().splitlines()
  assert [json.loads(x)["step"] for x in lines] == list(range(65))
  assert (workdir / "DONE").exists()

  before = (workdir / "metrics.jsonl").read_bytes()
  again = _main(*argv[3:])
  assert again.returncode == 0, again.stderr[-3000:]
  assert "not rerunning" in again.stderr
  assert (workdir / "metrics.jsonl").read_bytes() == before


def test_impossible_point_exits_with_the_numbers(tmp_path):
  workdir = tmp_path / "never"
  proc = _main("--config=experiments/tiny.py:bp=64,n=8,budget=4096", f"--workdir={workdir}",
               timeout=120)
  assert proc.returncode != 0
  assert "Bp*n = 64*8 = 512 exceeds b_max = 256" in proc.stderr
  assert not workdir.exists()


def test_flags_are_checked(tmp_path):
  proc = _main("--config=experiments/tiny.py", f"--workdir={tmp_path}",
               "--config.rl.kl_cof=0", timeout=120)
  assert proc.returncode != 0 and "kl_cof" in proc.stderr
  proc = _main("--config=experiments/tiny.py", timeout=120)
  assert proc.returncode != 0 and "workdir" in proc.stderr
  assert not os.listdir(tmp_path)


def test_an_empty_workdir_or_a_missing_experiment_file_is_named(tmp_path):
  # `--workdir=$WD` with WD unset must not train into the current directory.
  env = {**os.environ, "PYTHONPATH": str(ROOT)}
  proc = subprocess.run([sys.executable, "-m", "isojax.main",
                         f"--config={ROOT / 'experiments/tiny.py'}:bp=4,n=2,budget=16",
                         "--workdir="], cwd=tmp_path, env=env, capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
      "isojax.main: error: flag --workdir is required (the run directory), unless "
      "--dry_run; it was given empty (--verbose prints the traceback)"]
  assert not os.listdir(tmp_path)
  (tmp_path / "notes").write_text("")  # a file where the run directory's parent goes
  proc = _main(f"--config={ROOT / 'experiments/tiny.py'}:bp=4,n=2,budget=16",
               f"--workdir={tmp_path / 'notes' / 'run'}", timeout=120)
  assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
      f"isojax.main: error: Not a directory on {tmp_path / 'notes' / 'run'} (--verbose "
      "prints the traceback)"]
  proc = _main("--config=experiments/no_such_study.py", f"--workdir={tmp_path / 'x'}",
               timeout=120)
  assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
      "isojax.main: error: --config: cannot load the experiment file: [Errno 2] No such "
      "file or directory: 'experiments/no_such_study.py'"]
  (tmp_path / "study.py").write_text("def config():\n  return None\n")
  proc = _main(f"--config={tmp_path / 'study.py'}", f"--workdir={tmp_path / 'x'}",
               timeout=120)
  assert proc.returncode == 2 and proc.stderr.strip().startswith(
      "isojax.main: error: --config: the experiment file defines no get_config(arg)")
  assert not (tmp_path / "x").exists()


def test_readme_dry_run_prints_memory_and_writes_nothing(readme, tmp_path):
  argv = readme.argv(readme.command("python -m isojax.main --dry_run"),
                     {"--device_memory_gib=80": "--device_memory_gib=0.001"})
  workdir = tmp_path / "run"
  proc = _main(*argv[3:], f"--workdir={workdir}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = proc.stdout
  assert "B=32 x T=24" in out, out  # 8 prompts x 4; prompt bucket 16 + 8 tokens
  for row in ("state (params + optimiser)", "temporaries", "total"):
    assert row in out, out
  assert "does NOT fit in 0.001 GiB per device" in out, out
  assert not workdir.exists()


def test_optional_fields_take_none_from_the_command_line():
  """`--config.rl.tis_cap=None` turns truncated IS off (a float field declared with
  its type), as `=none` does an int one; a plain number field refuses None."""
  # isojax.main's flags, parsed in a fresh interpreter (its absl flags would clash
  # with other modules' in this one).
  script = textwrap.dedent("""
      import json, sys
      from absl import flags
      import isojax.main
      from isojax import run_config
      flags.FLAGS(sys.argv)
      rl = isojax.main._CONFIG.value.rl
      try:
        run_config.check_none_override(isojax.main._CONFIG.value, "rl.lr_base")
        refused = ""
      except ValueError as e:
        refused = str(e)
      print(json.dumps([rl.tis_cap, rl.logits_chunk, rl.clip_dual, rl.max_grad_norm,
                        refused]))
  """)
  proc = subprocess.run(
      [sys.executable, "-c", script, "--config=experiments/tiny.py",
       "--config.rl.tis_cap=None", "--config.rl.logits_chunk=none",
       "--config.rl.clip_dual=3", "--config.rl.max_grad_norm=None",
       "--config.rl.lr_base=None"],
      cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  tis_cap, chunk, clip_dual, max_grad_norm, refused = json.loads(
      proc.stdout.strip().splitlines()[-1])
  assert (tis_cap, chunk, clip_dual, max_grad_norm) == (None, None, 3.0, None)
  assert "--config.rl.lr_base=None: rl.lr_base is not an optional field" in refused


def test_none_for_a_plain_number_field_exits_with_one_line(tmp_path):
  proc = _main("--config=experiments/tiny.py", f"--workdir={tmp_path}/run",
               "--config.rl.lr_base=None", timeout=120)
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert "rl.lr_base is not an optional field" in proc.stderr
  assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()
