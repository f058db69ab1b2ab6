"""Tests for isojax/sweep/ (points, run dirs, local pool, SLURM) and launch/sweep.py.

Most tests drive the launcher as a subprocess with a fake runner (a small script that
behaves like `python -m isojax.main`: resumable, checkpoints, DONE marker) so that locks,
kills and failures are exercised in seconds. `test_kill_and_rerun_real_tiny_sweep` runs
the real trainer on the tiny config.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from isojax import budget, run_plan, sweep
from isojax.sweep import points as sweep_points
from isojax.sweep import slurm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHER = os.path.join(REPO, "launch", "sweep.py")
TINY = "experiments/tiny.py"

# Behaves like the run as far as the launcher can tell: `--config=F:bp=..,n=..,budget=..
# --workdir=D --config.seed=S`; M = budget // (bp*n); a checkpoint every 2 steps; metrics
# cut back to the checkpoint on resume; DONE at the end. FAKE_STEP_S paces it, FAKE_FAIL
# names a run that crashes with a recognisable message.
FAKE_RUNNER = textwrap.dedent('''
    import json, os, sys, time
    args = dict(a[2:].split("=", 1) for a in sys.argv[1:])
    workdir = args["workdir"]
    point = dict(kv.split("=") for kv in args["config"].split(":", 1)[1].split(","))
    bp, n, budget = int(point["bp"]), int(point["n"]), float(point["budget"])
    m = int(budget) // (bp * n)
    os.makedirs(workdir, exist_ok=True)
    name = os.path.basename(workdir)
    if os.environ.get("FAKE_FAIL") == name:
        print("fake runner: something broke in " + name, flush=True)
        sys.exit(3)
    ckpt = os.path.join(workdir, "ckpt.json")
    start = json.load(open(ckpt))["step"] if os.path.exists(ckpt) else 0
    json.dump(sys.argv[1:], open(os.path.join(workdir, "argv.json"), "w"))
    with open(os.path.join(workdir, "xla_cache.txt"), "w") as f:
        f.write(os.environ.get("JAX_COMPILATION_CACHE_DIR", "(unset)"))
    with open(os.path.join(workdir, "starts.log"), "a") as f:
        f.write(("resumed from %d" % start if start else "run started fresh") + "\\n")
    json.dump({"bp": bp, "n": n, "m": m, "seed": int(args.get("config.seed", 0))},
              open(os.path.join(workdir, "config.json"), "w"))
    metrics = os.path.join(workdir, "metrics.jsonl")
    lines = open(metrics).readlines() if os.path.exists(metrics) else []
    lines = [l for l in lines if l.endswith("\\n") and json.loads(l)["step"] <= start]
    open(metrics, "w").writelines(lines)
    for step in range(start + 1, m + 1):
        time.sleep(float(os.environ.get("FAKE_STEP_S", "0")))
        with open(metrics, "a") as f:
            f.write(json.dumps({"step": step, "rollouts": step * bp * n, "tokens": step,
                                "train/reward": step / m, "val/avg@4": step / m}) + "\\n")
        if step % 2 == 0 or step == m:
            json.dump({"step": step}, open(ckpt + ".tmp", "w"))
            os.replace(ckpt + ".tmp", ckpt)
    open(os.path.join(workdir, "DONE"), "w").close()
    print("fake runner: finished " + name, flush=True)
''')


@pytest.fixture
def fake_runner(tmp_path):
  path = tmp_path / "fake_runner.py"
  path.write_text(FAKE_RUNNER)
  return str(path)


def _env(**extra):
  env = dict(os.environ)
  # One CPU device per run: the tests' 8 fake devices would only slow the trainer.
  env["XLA_FLAGS"] = ""
  env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the sweep's own cache, not the caller's
  env.update({k: str(v) for k, v in extra.items()})
  return env


def _launch(*args, env=None, check=True, timeout=120):
  proc = subprocess.run([sys.executable, LAUNCHER, *args], cwd=REPO, env=env or _env(),
                        capture_output=True, text=True, timeout=timeout)
  if check and proc.returncode != 0:
    raise AssertionError(f"launcher failed ({proc.returncode}):\n{proc.stdout}\n"
                         f"{proc.stderr}")
  return proc


def _attempts(run_dir):
  with open(os.path.join(run_dir, sweep.ATTEMPTS_FILE)) as f:
    return [json.loads(line) for line in f]


def _starts(run_dir):
  with open(os.path.join(run_dir, "starts.log")) as f:
    return f.read().splitlines()


# ------------------------------------------------------------------- points and names

def test_expand_points_matches_hand_computed_grid():
  points = sweep.expand_points([4, 8], [2, 4, 64], b_max=64, budgets=[1000], seeds=[0, 1])
  # Bp*n <= 64 excludes (4, 64) and (8, 64); M = floor(1000 / (Bp*n)).
  expected = {(4, 2, 125), (4, 4, 62), (8, 2, 62), (8, 4, 31)}
  assert {(p.point.bp, p.point.n, p.point.m) for p in points} == expected
  assert len(points) == 2 * len(expected)
  names = {p.name for p in points}
  assert "bp4_n4_m62_s1" in names and "bp8_n4_m31_s0" in names
  assert len(names) == len(points)


def test_expand_points_rejects_bad_input():
  with pytest.raises(ValueError, match="seeds"):
    sweep.expand_points([4], [2], b_max=64, budgets=[100], seeds=[])
  with pytest.raises(ValueError, match=r"seeds must be .* ints >= 0, got \[-1\]"):
    sweep.expand_points([4], [2], b_max=64, budgets=[100], seeds=[-1])
  with pytest.raises(ValueError, match="b_max"):
    sweep.expand_points([64], [64], b_max=16, budgets=[1e6])


def test_a_fixed_batch_study_runs_only_its_line(monkeypatch):
  # §4.2: B = Bp * n is fixed, so of the Bp x n grid only the line Bp * n = B is the
  # study; the rest would run (and mislabel) points of other batch sizes.
  points = sweep.expand_points([2, 4, 8], [2, 4, 8], b_max=64, budgets=[512], batch=16)
  assert [(p.point.bp, p.point.n) for p in points] == [(2, 8), (4, 4), (8, 2)]
  with pytest.raises(ValueError, match=r"no feasible budget point on the fixed batch "
                     r"Bp\*n = 3"):
    sweep.expand_points([2, 4], [2, 4], b_max=64, budgets=[512], batch=3)
  assert sweep_points.dropped_points([2, 4, 8], [2, 4, 8], b_max=8, budgets=[512], batch=16) == [
      f"Bp={bp} n={n} C=512: infeasible budget point: Bp*n = {bp}*{n} = 16 exceeds "
      f"b_max = 8" for bp, n in ((2, 8), (4, 4), (8, 2))]
  # An experiment file's fixed B (config.sweep.batch) sets the line.
  monkeypatch.chdir(REPO)
  plan, config = sweep.plan_sweep("experiments/easy_fixed_batch.py", "runs/t",
                                  extra_args=["--config.data.train=synthetic"])
  assert {sp.point.batch for sp in plan.points} == {config.sweep.batch} == {8192}
  assert len(plan.points) == len(config.sweep.n_values) and not plan.dropped


def test_points_whose_bp_exceeds_the_training_set_are_left_out(monkeypatch, tmp_path):
  # A batch of more problems than the training set holds would repeat one, and the run
  # refuses it at start: the plan leaves such points out and says why.
  monkeypatch.chdir(REPO)
  data = tmp_path / "six.jsonl"  # one of them held out for validation
  data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                          for i in range(6)))
  args = [f"--config.data.train={data}", "--config.data.num_val=1"]
  plan, _ = sweep.plan_sweep(TINY, "runs/t", bp=[4, 8], n=[2], budgets=[64], seeds=[0, 1],
                             extra_args=args)
  assert {sp.point.bp for sp in plan.points} == {4} and len(plan.points) == 2
  assert plan.dropped == (f"Bp=8 n=2 M=4: Bp exceeds the 5 training problems of "
                          f"data.train={str(data)!r}",)
  with pytest.raises(ValueError, match=r"no point of experiments/tiny.py fits the 5 "
                     r"training problems .* every Bp in \[8\] exceeds it"):
    sweep.plan_sweep(TINY, "runs/t", bp=[8], n=[2], budgets=[64], extra_args=args)
  # Data this machine cannot read (e.g. only the compute nodes see it) is left to the
  # runs, which check Bp themselves.
  plan, _ = sweep.plan_sweep(TINY, "runs/t", bp=[8], n=[2], budgets=[64],
                             extra_args=[f"--config.data.train={tmp_path / 'absent.jsonl'}"])
  assert [sp.point.bp for sp in plan.points] == [8] and not plan.dropped
  # The committed easy split holds 220 training problems: the paper's Bp = 256..1024
  # points of the fixed-batch study need the user's own (larger) set.
  plan, _ = sweep.plan_sweep("experiments/easy_fixed_batch.py", "runs/t")
  assert max(sp.point.bp for sp in plan.points) == 128 and len(plan.dropped) == 3


def test_a_study_argument_reaches_every_point(monkeypatch):
  # A study's own argument (App. G's setting=, data_size's d=, ...) goes to every
  # point beside the launcher's bp, n and budget, and sets the grid's defaults.
  monkeypatch.chdir(REPO)
  plan, config = sweep.plan_sweep("experiments/decoupled_baseline.py:setting=decoupled,smoke",
                                  "runs/t", budgets=[2048, 4096])
  assert config.rl.n_est == 16 and len(plan.points) == 2
  for sp in plan.points:
    spec = next(a for a in plan.command(sp) if a.startswith("--config="))
    path, _, arg = spec.removeprefix("--config=").partition(":")
    assert arg == f"setting=decoupled,smoke,{sp.config_arg()}"
    point = run_plan.plan_run(sweep_points.load_experiment(path, arg)).point
    assert point == sp.point and point.n_est == 16
  with pytest.raises(ValueError, match=r"n=4 is set by the launcher"):
    sweep.plan_sweep("experiments/data_size.py:d=500,n=4", "runs/t")
  # The file ends at ".py:": an argument may hold paths.
  assert sweep_points._split_config("exp/x.py:d=runs/a:b, smoke") == (
      "exp/x.py", "d=runs/a:b,smoke")
  assert sweep_points._split_config("exp/x.py:") == ("exp/x.py", "")
  sp = sweep.SweepPoint(budget.BudgetPoint(bp=8, n=4, m=31))
  study = sweep.Sweep(config="exp/x.py:d=runs/a", root="r", points=(sp,), python="py")
  assert study.command(sp)[3] == "--config=exp/x.py:d=runs/a,bp=8,n=4,budget=992"


def test_command_passes_the_point_through_unchanged():
  sp = sweep.SweepPoint(budget.BudgetPoint(bp=8, n=4, m=31), seed=2)
  s = sweep.Sweep(config=TINY, root="runs/x", points=(sp,), python="py",
                  extra_args=("--config.eval_every=2",))
  assert s.command(sp) == ["py", "-m", "isojax.main",
                           "--config=experiments/tiny.py:bp=8,n=4,budget=992",
                           "--workdir=runs/x/bp8_n4_m31_s2", "--config.seed=2",
                           "--config.eval_every=2"]
  # The budget written in the command gives back exactly this point's M.
  assert budget.BudgetPoint.from_budget(992, bp=8, n=4) == sp.point


def test_plan_reads_grid_defaults_from_the_experiment_file(monkeypatch):
  monkeypatch.chdir(REPO)
  plan, config = sweep.plan_sweep(TINY, "runs/t")
  expected = budget.sweep_grid(config.sweep.bp_values, config.sweep.n_values,
                               b_max=config.b_max, budget=config.sweep.budgets)
  assert [sp.point for sp in plan.points] == expected
  with pytest.raises(ValueError, match=r"bp=8 is set by the launcher for each point; "
                     r"use --bp, --n and --budget"):
    sweep.plan_sweep(TINY + ":bp=8", "runs/t")
  with pytest.raises(ValueError, match="does not exist"):
    sweep.plan_sweep("experiments/nope.py", "runs/t")
  # A value given, even if bad, is named as such (not as missing).
  with pytest.raises(ValueError, match="b_max must be a positive integer, got 0"):
    sweep.plan_sweep(TINY, "runs/t", b_max=0)


def test_default_concurrency_and_env():
  assert sweep.default_concurrency(cpus=2, accelerator=False) == 2
  assert sweep.default_concurrency(cpus=16, accelerator=False) == 16
  assert sweep.default_concurrency(cpus=16, accelerator=True) == 1
  env = sweep.run_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=2"},
                      threads=1)
  assert env["OMP_NUM_THREADS"] == "1"
  assert env["XLA_FLAGS"].startswith("--xla_force_host_platform_device_count=2 ")
  assert "--xla_cpu_multi_thread_eigen=false" in env["XLA_FLAGS"]
  assert "multi_thread_eigen" not in sweep.run_env({}, threads=4).get("XLA_FLAGS", "")
  # The runs' shared compilation cache: an absolute path under the root, unless the
  # user set one (empty turns it off).
  cache = sweep.with_compilation_cache({}, "runs/x")["JAX_COMPILATION_CACHE_DIR"]
  assert cache == os.path.join(os.getcwd(), "runs", "x", sweep.COMPILATION_CACHE_DIR)
  for mine in ("/scratch/xla", ""):
    env = sweep.with_compilation_cache({"JAX_COMPILATION_CACHE_DIR": mine}, "runs/x")
    assert env["JAX_COMPILATION_CACHE_DIR"] == mine


# ------------------------------------------------------------------------------ dry run

def test_dry_run_prints_only_the_table(tmp_path):
  root = tmp_path / "dry"
  proc = _launch(f"--config={TINY}", f"--root={root}", "--bp=8,4", "--n=2,4,128",
                 "--budget=1000,2048", "--b_max=256", "--seeds=0,1", "--dry_run")
  assert not root.exists()
  lines = proc.stdout.strip().splitlines()
  assert lines[0].split() == ["run", "Bp", "n", "B", "M", "compute", "est_tokens"]
  rows = [line.split() for line in lines[1:-1]]
  max_tokens = 8  # experiments/tiny.py: sampler.max_tokens
  expected = []
  for c in (1000, 2048):
    for bp in (4, 8):
      for n in (2, 4, 128):
        if bp * n > 256 or bp * n > c:
          continue
        m = c // (bp * n)
        for s in (0, 1):
          expected.append([f"bp{bp}_n{n}_m{m}_s{s}", str(bp), str(n),
                           str(bp * n), str(m), str(bp * n * m),
                           str(bp * n * m * max_tokens)])
  assert sorted(rows) == sorted(expected)
  total = lines[-1].split()
  assert total == ["total", str(sum(int(r[5]) for r in expected)),
                   str(sum(int(r[6]) for r in expected))]


def test_readme_sweep_command_prints_its_table(readme, tmp_path):
  root = tmp_path / "tiny"
  argv = readme.argv(readme.command("python launch/sweep.py"), {"runs/tiny": str(root)})
  assert argv[-1] == "--dry_run", argv
  proc = subprocess.run(argv, cwd=REPO, env=_env(), capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode == 0, proc.stderr
  names = [line.split()[0] for line in proc.stdout.strip().splitlines()[1:-1]]
  assert sorted(names) == sorted(f"bp8_n{n}_m{c // (8 * n)}_s{s}" for n in (2, 4, 8)
                                 for c in (1024, 4096) for s in (0, 1))
  assert not root.exists()


# --------------------------------------------------------------------- local execution

def test_failure_is_reported_with_log_tail_and_the_sweep_goes_on(tmp_path, fake_runner):
  root = tmp_path / "fail"
  proc = _launch(f"--config={TINY}", f"--root={root}", "--bp=4", "--n=2,4",
                 "--budget=64", "--max_concurrent=2", f"--runner={fake_runner}",
                 env=_env(FAKE_FAIL="bp4_n2_m8_s0"), check=False)
  assert proc.returncode == 1
  assert "FAILED bp4_n2_m8_s0: exit code 3" in proc.stdout
  assert "fake runner: something broke in bp4_n2_m8_s0" in proc.stdout  # the log tail
  assert os.path.exists(root / "bp4_n4_m4_s0" / "DONE")
  assert not os.path.exists(root / "bp4_n2_m8_s0" / "DONE")
  # The rerun retries only the failed point.
  proc = _launch(f"--config={TINY}", f"--root={root}", "--bp=4", "--n=2,4",
                 "--budget=64", f"--runner={fake_runner}")
  assert "skip   bp4_n4_m4_s0" in proc.stdout
  assert os.path.exists(root / "bp4_n2_m8_s0" / "DONE")
  assert _starts(root / "bp4_n4_m4_s0") == ["run started fresh"]
  # Every run of the sweep shares one persistent compilation cache under its root.
  assert (root / "bp4_n4_m4_s0" / "xla_cache.txt").read_text() == str(root / "xla_cache")


def test_two_launchers_never_run_the_same_point(tmp_path, fake_runner):
  root = tmp_path / "two"
  args = [sys.executable, LAUNCHER, f"--config={TINY}", f"--root={root}", "--bp=4",
          "--n=2,4,8,16", "--budget=64", "--max_concurrent=2", f"--runner={fake_runner}",
          "--status_every=1"]
  env = _env(FAKE_STEP_S=0.05)
  procs = [subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for _ in range(2)]
  outs = [p.communicate(timeout=120)[0] for p in procs]
  assert [p.returncode for p in procs] == [0, 0], outs
  names = [sp.name for sp in sweep.expand_points([4], [2, 4, 8, 16], b_max=64,
                                                 budgets=[64])]
  for name in names:
    run_dir = root / name
    assert os.path.exists(run_dir / "DONE")
    assert _starts(run_dir) == ["run started fresh"], name
    starts = [a for a in _attempts(run_dir) if a["event"] == "start"]
    assert len(starts) == 1, (name, outs)
  # Each point ran under exactly one of the launchers.
  launched = sum(out.count("start  ") for out in outs)
  assert launched == len(names), outs


def _wait_for(predicate, timeout=60.0, what="condition"):
  deadline = time.time() + timeout
  while time.time() < deadline:
    if predicate():
      return
    time.sleep(0.05)
  raise AssertionError(f"timed out waiting for {what}")


def _alive(pid):
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  # A zombie (exited, not yet reaped by init) counts as dead.
  with open(f"/proc/{pid}/stat") as f:
    return f.read().split(")")[-1].split()[0] != "Z"


def test_killed_launcher_stops_its_run_and_releases_the_lock(tmp_path, fake_runner):
  root = tmp_path / "kill"
  run_dir = root / "bp4_n2_m200_s0"
  proc = subprocess.Popen(
      [sys.executable, LAUNCHER, f"--config={TINY}", f"--root={root}", "--bp=4",
       "--n=2", "--budget=1600", f"--runner={fake_runner}"],
      cwd=REPO, env=_env(FAKE_STEP_S=0.05), stdout=subprocess.DEVNULL,
      stderr=subprocess.DEVNULL)
  _wait_for(lambda: (run_dir / "metrics.jsonl").exists(), what="the run to start")
  run_pid = _attempts(run_dir)[0]["pid"]
  assert sweep.try_lock(str(run_dir)) is None  # held while the run lives
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  _wait_for(lambda: not _alive(run_pid), timeout=20, what="the orphaned run to stop")
  fd = sweep.try_lock(str(run_dir))
  assert fd is not None
  os.close(fd)
  assert not (run_dir / "DONE").exists()


# ------------------------------------------------------------------------------- SLURM

def test_slurm_array_script_one_task_per_point(tmp_path, fake_runner):
  root = tmp_path / "slurm"
  proc = _launch(f"--config={TINY}", f"--root={root}", "--bp=4,8", "--n=2,4",
                 "--budget=64", "--seeds=0,1", "--slurm", "--partition=gpu",
                 "--time=01:00:00", f"--runner={fake_runner}", "--",
                 "--config.eval_every=2")
  script = (root / "slurm" / "sweep.sbatch").read_text()
  spec = json.loads((root / "slurm" / "points.json").read_text())
  names = [f"bp{bp}_n{n}_m{64 // (bp * n)}_s{s}"
           for bp, n in ((4, 2), (4, 4), (8, 2), (8, 4)) for s in (0, 1)]
  assert sorted(e["name"] for e in spec["points"]) == sorted(names)
  assert "#SBATCH --array=0-7\n" in script
  assert "#SBATCH --nodes=1\n" in script and '#SBATCH --partition="gpu"\n' in script
  assert '#SBATCH --time="01:00:00"\n' in script
  assert '--task_index="${SLURM_ARRAY_TASK_ID}"' in script
  assert "wrote" in proc.stdout and not any((root / n).exists() for n in names)
  for i, entry in enumerate(spec["points"]):
    assert entry["index"] == i and f"#   task {i}: {entry['name']}\n" in script
    bp, n, m, s = (int(x[1:] if x[0] != "b" else x[2:])
                   for x in entry["name"].split("_"))
    assert entry["command"] == [
        sys.executable, fake_runner, f"--config={TINY}:bp={bp},n={n},budget={bp*n*m}",
        f"--workdir={root}/{entry['name']}", f"--config.seed={s}",
        "--config.eval_every=2"]
  # The script itself, given an array index, runs exactly that point.
  env = _env(SLURM_ARRAY_TASK_ID=3)
  subprocess.run(["bash", str(root / "slurm" / "sweep.sbatch")], env=env, check=True,
                 capture_output=True, timeout=60)
  done = [e["name"] for e in spec["points"] if (root / e["name"] / "DONE").exists()]
  assert done == [spec["points"][3]["name"]]
  assert (root / done[0] / "xla_cache.txt").read_text() == str(root / "xla_cache")
  # A finished task is skipped when the array task is rerun (e.g. requeued).
  out = subprocess.run(["bash", str(root / "slurm" / "sweep.sbatch")], env=env,
                       check=True, capture_output=True, text=True, timeout=60).stdout
  assert "skip" in out and _starts(root / done[0]) == ["run started fresh"]


def test_slurm_multi_node_runs_each_node_under_jax_distributed(tmp_path):
  root = tmp_path / "mn"
  _launch(f"--config={TINY}", f"--root={root}", "--bp=8", "--n=4", "--budget=64",
          "--slurm", "--nodes=2", "--gpus_per_node=8")
  script = (root / "slurm" / "sweep.sbatch").read_text()
  spec = json.loads((root / "slurm" / "points.json").read_text())
  assert "#SBATCH --array=0-0\n" in script and "#SBATCH --nodes=2\n" in script
  assert "#SBATCH --gpus-per-node=8\n" in script and spec["nodes"] == 2
  cmd = slurm.task_command(spec["points"][0]["command"], nodes=2)
  assert cmd[:4] == ["srun", "--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
  assert cmd[4] == sys.executable and cmd[5] == "-c"
  assert "initialize_distributed()" in cmd[6]
  assert cmd[7:] == spec["points"][0]["command"][2:]  # isojax.main and its flags
  assert slurm.task_command(["py", "-m", "isojax.main"], nodes=1) == [
      "py", "-m", "isojax.main"]
  with pytest.raises(ValueError, match="task index 5 out of range"):
    slurm.load_task(str(root / "slurm" / "points.json"), 5)


def test_slurm_vllm_config_starts_a_server_per_task(tmp_path, fake_runner, monkeypatch):
  root = tmp_path / "vllm"
  _launch(f"--config={TINY}", f"--root={root}", "--bp=4", "--n=2,4", "--budget=64",
          "--slurm", f"--runner={fake_runner}", "--", "--config.sampler.backend=vllm")
  points_file = str(root / "slurm" / "points.json")
  spec = json.loads(open(points_file).read())
  assert spec["vllm_model"] == str(sweep.BASE_MODEL_DIR)  # model.path "" = the base model
  assert "vLLM server" in (root / "slurm" / "sweep.sbatch").read_text()

  events = []

  class FakeServer:  # stands in for isojax.rollout.vllm_server.VLLMServer
    def __init__(self, model_dir, *, workdir, startup_timeout_s):
      events.append(("init", model_dir, os.path.basename(workdir)))
      self.base_url = "http://127.0.0.1:54321"

    def start(self):
      events.append(("start",))
      return self

    def stop(self):
      events.append(("stop", (root / spec["points"][1]["name"] / "DONE").exists()))

  import isojax.rollout.vllm_server as vllm_server
  monkeypatch.setattr(vllm_server, "VLLMServer", FakeServer)
  monkeypatch.chdir(REPO)
  monkeypatch.setenv("XLA_FLAGS", "")
  assert slurm.run_task(points_file, 1, print_fn=lambda *_: None) == 0
  # The server came up before the run, which was pointed at it, and went down after.
  assert events == [("init", str(sweep.BASE_MODEL_DIR), "vllm"), ("start",), ("stop", True)]
  argv = json.loads((root / spec["points"][1]["name"] / "argv.json").read_text())
  assert argv == spec["points"][1]["command"][2:] + [
      "--config.sampler.vllm_url=http://127.0.0.1:54321"]
  # Multi-node points cannot reach a loopback server on the first node: refused.
  proc = _launch(f"--config={TINY}", f"--root={root}", "--bp=4", "--n=2", "--budget=64",
                 "--slurm", "--nodes=2", "--", "--config.sampler.backend=vllm",
                 check=False)
  assert proc.returncode != 0 and "--nodes=1" in proc.stderr


def test_run_arguments_are_checked_before_any_run(tmp_path):
  proc = _launch(f"--config={TINY}", f"--root={tmp_path}/x", "--bp=4", "--n=2",
                 "--budget=64", "--dry_run", "--", "--config.sampler.max_tokes=4",
                 check=False)
  assert proc.returncode != 0 and "sampler.max_tokes" in proc.stderr
  proc = _launch(f"--config={TINY}", f"--root={tmp_path}/x", "--bp=4", "--n=2",
                 "--budget=64", "--dry_run", "--", "--config.sampler.max_tokens=3")
  assert proc.stdout.splitlines()[1].split()[-1] == str(64 // 8 * 8 * 3)


def test_run_arguments_take_their_fields_declared_type():
  """A None placeholder (rl.clip_dual) parses as its declared float, a bad value
  fails naming the argument."""
  config = sweep.apply_overrides(
      sweep.load_experiment(TINY, ""),
      ["--config.rl.clip_dual=3", "--config.rl.tis_cap=2.5", "--config.eval.k=2",
       "--config.data.chat_template=true", "--config.data.train=synthetic:hard"])
  assert (config.rl.clip_dual, config.rl.tis_cap, config.eval.k) == (3.0, 2.5, 2)
  assert config.data.chat_template is True and config.data.train == "synthetic:hard"
  with pytest.raises(ValueError, match=r"run argument '--config.rl.clip_dual=x'"):
    sweep.apply_overrides(sweep.load_experiment(TINY, ""), ["--config.rl.clip_dual=x"])
  # Optional fields take None (off), as the run's own flags do; others refuse it.
  config = sweep.apply_overrides(sweep.load_experiment(TINY, ""),
                                 ["--config.rl.tis_cap=None", "--config.rl.logits_chunk=none"])
  assert config.rl.tis_cap is None and config.rl.logits_chunk is None
  with pytest.raises(ValueError, match=r"rl.lr_base is not an optional field"):
    sweep.apply_overrides(sweep.load_experiment(TINY, ""), ["--config.rl.lr_base=None"])


# What defines a point, as a run argument in each spelling the run's flag parser takes,
# and the launcher flag the refusal names instead.
RESERVED_RUN_ARGS = [
    (["--workdir={tmp}/shared"], "--root"),
    (["--workdir", "{tmp}/shared"], "--root"),
    (["--config=experiments/tiny.py:bp=16"], "the launcher's --config"),
    (["--config", "experiments/tiny.py"], "the launcher's --config"),
    (["--config.seed=5"], "--seeds"),
    (["--config.seed", "5"], "--seeds"),
    (["--config.bp=16"], "--bp"),
    (["--config.bp", "16"], "--bp"),
    (["--config.n=16"], "--n"),
    (["--config.n", "16"], "--n"),
    (["--config.budget=128"], "--budget"),
    (["--config.budget", "128"], "--budget"),
]


@pytest.mark.parametrize("run_args,instead", RESERVED_RUN_ARGS,
                         ids=[" ".join(a) for a, _ in RESERVED_RUN_ARGS])
def test_run_arguments_may_not_set_what_defines_a_point(tmp_path, run_args, instead):
  # Passed through, each would come after the launcher's own flag and win: runs in
  # one shared directory, or a run unlike the point its directory is named after.
  run_args = [a.format(tmp=tmp_path) for a in run_args]
  root = tmp_path / "root"
  proc = _launch(f"--config={TINY}", f"--root={root}", "--bp=8", "--n=2,4",
                 "--budget=64", "--seeds=0,1", "--slurm", "--", *run_args, check=False)
  refused = [a for a in run_args if a.startswith("-")][-1]  # not a value
  assert proc.returncode == 2, proc.stdout + proc.stderr
  [line] = proc.stderr.strip().splitlines()
  assert line.startswith(f"launch/sweep.py: error: run argument {refused!r} sets "), line
  assert f", which the launcher sets for each point: use {instead}" in line, line
  assert line.endswith("(--verbose prints the traceback)"), line
  assert not root.exists() and not (tmp_path / "shared").exists()


def test_flag_files_one_dash_and_harmless_run_arguments(tmp_path):
  flag_file = tmp_path / "run.flags"
  flag_file.write_text(f"--workdir={tmp_path}/shared\n")
  for spelling in ([f"--flagfile={flag_file}"], ["-flagfile", str(flag_file)]):
    with pytest.raises(ValueError, match="cannot check what a flag file sets"):
      sweep.check_run_args(spelling)
  # One dash is a spelling too, and a reserved argument is found wherever it is.
  with pytest.raises(ValueError, match=r"run argument '-workdir=x' .* use --root"):
    sweep.check_run_args(["-workdir=x"])
  with pytest.raises(ValueError, match=r"run argument '--config.seed=5' .* use --seeds"):
    sweep.check_run_args(["--config.eval_every=2", "--config.seed=5"])
  # Names that only begin like a reserved one are the user's to set.
  sweep.check_run_args(["--config.data.split_seed=3", "--config.n_values=2",
                        "--config.budgets", "5", "--config.workdir_note=x", "5"])
  sp = sweep.SweepPoint(budget.BudgetPoint(bp=8, n=4, m=31), seed=2)
  with pytest.raises(ValueError, match="use --seeds"):  # a Sweep built directly too
    sweep.Sweep(config=TINY, root="runs/x", points=(sp,), extra_args=("--config.seed=1",))
  root = tmp_path / "root"
  _launch(f"--config={TINY}", f"--root={root}", "--bp=4", "--n=2", "--budget=64",
          "--slurm", "--", "--config.rl.adv_estimator=gae", "--config.data.split_seed=3")
  [entry] = json.loads((root / "slurm" / "points.json").read_text())["points"]
  assert entry["command"][-4:] == [f"--workdir={root}/bp4_n2_m8_s0", "--config.seed=0",
                                   "--config.rl.adv_estimator=gae",
                                   "--config.data.split_seed=3"]


# ------------------------------------------------------------- end to end, real trainer

# Three points of the tiny config (M = 8 each), two at a time, small enough for two
# cores: the third starts when one of the first two is done, so the sweep can be
# killed with a point done and one with updates to go; a checkpoint every 2 updates,
# so that a kill mid-run has one to resume from.
E2E_GRID = ["--bp=4", "--n=2", "--budget=64", "--seeds=0,1,2"]
E2E_RUN_ARGS = ["--", "--config.checkpoint_every=2", "--config.eval_every=4",
                "--config.data.num_val=8", "--config.eval.num_train=0"]


def _metrics(run_dir):
  path = os.path.join(run_dir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.endswith("\n")]


def test_kill_and_rerun_real_tiny_sweep(tmp_path):
  from isojax.analysis import load_runs, read_runs

  root = tmp_path / "tiny"
  args = [sys.executable, LAUNCHER, f"--config={TINY}", f"--root={root}", *E2E_GRID,
          "--max_concurrent=2", "--status_every=5", *E2E_RUN_ARGS]
  points = sweep.expand_points([4], [2], b_max=256, budgets=[64], seeds=[0, 1, 2])
  dirs = {sp.name: root / sp.name for sp in points}
  log = open(tmp_path / "first.log", "w")
  first = subprocess.Popen(args, cwd=REPO, env=_env(), stdout=log, stderr=log)

  steps = {sp.name: sp.point.m for sp in points}

  def mid_sweep():
    # One point finished, another past its first checkpoint with at least 3 updates
    # to go: a run acts on the launcher's death (SIGTERM) between two calls into
    # XLA, and a tiny run can finish 2 updates before it does.
    done = [n for n, d in dirs.items() if (d / "DONE").exists()]
    partial = [n for n, d in dirs.items()
               if not (d / "DONE").exists() and 3 <= len(_metrics(d)) <= steps[n] - 2]
    assert first.poll() is None, "the sweep ended before it could be interrupted"
    return done and partial

  try:
    _wait_for(mid_sweep, timeout=600, what="a finished and a half-finished point")
  finally:
    first.send_signal(signal.SIGKILL)
    first.wait()
    log.close()

  def unlocked():  # the killed launcher's runs die with it, and their locks with them
    fds = [sweep.try_lock(str(d)) for d in dirs.values()]
    for fd in fds:
      if fd is not None:
        os.close(fd)
    return all(fd is not None for fd in fds)

  _wait_for(unlocked, timeout=60, what="the killed launcher's locks to be released")
  done_before = {n for n, d in dirs.items() if (d / "DONE").exists()}
  started = {n for n, d in dirs.items() if (d / "metrics.jsonl").exists()}
  interrupted = started - done_before
  assert done_before and interrupted
  # A run can write DONE and be killed with its launcher before it was reaped: no
  # end is recorded, so the rerun starts it once more and the run checks its config.
  unreaped = {n for n in done_before
              if not any(a["event"] == "end" for a in _attempts(dirs[n]))}

  second = subprocess.run(args, cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=900)
  if second.returncode != 0:
    pytest.fail(f"the rerun failed:\n{second.stdout}\n{second.stderr}", pytrace=False)
  for name in done_before:
    assert f"skip   {name}" in second.stdout
  for name in unreaped:
    assert f"skip   {name}: already finished; the run found its config unchanged" in \
        second.stdout

  for sp in points:
    run_dir = dirs[sp.name]
    done = json.loads((run_dir / "DONE").read_text())
    assert done["step"] == sp.point.m, (sp.name, done)
    attempts = _attempts(run_dir)
    starts = [a for a in attempts if a["event"] == "start"]
    ends = [a for a in attempts if a["event"] == "end"]
    # Started once, or (interrupted, or finished unrecorded) twice with the second a
    # resume; never after a recorded finish.
    assert len(starts) == (2 if sp.name in interrupted | unreaped else 1), (
        sp.name, attempts)
    if sp.name in interrupted:
      assert starts[1]["resumed"] and starts[1]["launcher_pid"] != first.pid
    if sp.name not in done_before:  # ended under the second launcher
      assert [(a["rc"], a["done"]) for a in ends] == [(0, True)], (sp.name, attempts)
    # Every update logged exactly once, in order, and the whole budget spent.
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(sp.point.m + 1)), sp.name
    assert rows[-1]["rollouts"] == sp.point.compute

  # The runs (one shape, three seeds, resumed ones) shared their compiled programs.
  assert list((root / sweep.COMPILATION_CACHE_DIR).glob("jit_step-*"))
  result = read_runs(root)
  assert sorted(r.name for r in result.runs) == sorted(dirs)
  assert not result.problems, result.problems
  runs = load_runs(root)
  assert {(r.bp, r.n, r.m, r.seed) for r in runs} == {
      (sp.point.bp, sp.point.n, sp.point.m, sp.seed) for sp in points}
  assert all(any("val/avg@4" in row for row in r.rows) for r in runs)


def test_slurm_submit_calls_sbatch(tmp_path, monkeypatch):
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  calls = tmp_path / "calls.txt"
  fake = bin_dir / "sbatch"  # records its arguments, answers like `sbatch --parsable`
  fake.write_text(f'#!/bin/bash\necho "$@" >> {calls}\necho "4242;cluster"\n')
  fake.chmod(0o755)
  root = tmp_path / "sub"
  env = _env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
  proc = _launch(f"--config={TINY}", f"--root={root}", "--bp=4", "--n=2", "--budget=64",
                 "--slurm", "--submit", env=env)
  assert "submitted job 4242" in proc.stdout
  assert calls.read_text().split() == ["--parsable", str(root / "slurm" / "sweep.sbatch")]
  monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
  with pytest.raises(ValueError, match="sbatch not found"):
    slurm.submit(str(root / "slurm" / "sweep.sbatch"))


# ------------------------------------------------------------ hostile grids and roots

def test_dry_run_lists_the_points_it_leaves_out(tmp_path):
  proc = _launch(f"--config={TINY}", f"--root={tmp_path}/x", "--bp=4,64", "--n=1,2",
                 "--budget=64", "--b_max=128", "--dry_run")
  names = [line.split()[0] for line in proc.stdout.strip().splitlines()[1:-1]]
  assert names == ["bp4_n2_m8_s0"]  # n=1: grpo needs 2; Bp=64, n=2: B=128 > C=64
  assert proc.stderr.splitlines()[-4:] == [
      "left out 3 infeasible grid point(s):",
      "  Bp=4 n=1 C=64: n < 2, the fewest the grpo estimator is defined for",
      "  Bp=64 n=1 C=64: n < 2, the fewest the grpo estimator is defined for",
      "  Bp=64 n=2 C=64: budget C=64 rollouts is smaller than one batch Bp*n = 64*2 = "
      "128: M = floor(C/(Bp*n)) = 0 updates"]


def test_a_decoupled_baseline_sets_each_points_m_as_the_run_does(tmp_path):
  # rl.n_est rollouts are sampled per problem: M = floor(C / (Bp n_est)), the name
  # says n_est, and an n above it is left out, all as isojax.main computes the point.
  proc = _launch(f"--config={TINY}", f"--root={tmp_path}/x", "--bp=4", "--n=2,4,8",
                 "--budget=256", "--dry_run", "--", "--config.rl.n_est=4")
  rows = [line.split() for line in proc.stdout.strip().splitlines()[1:-1]]
  assert [(r[0], r[4], r[5]) for r in rows] == [("bp4_n2e4_m16_s0", "16", "256"),
                                                ("bp4_n4_m16_s0", "16", "256")]
  assert proc.stderr.splitlines()[-1] == (
      "  Bp=4 n=8 C=256: n_est=4 rollouts per problem for the baseline must be >= n=8, "
      "the rollouts trained on")
  from isojax import run_plan
  from isojax.sweep import load_experiment
  config = load_experiment(TINY, "bp=4,n=2,budget=256")
  config.rl.n_est = 4
  assert run_plan.plan_run(config).point.name == "bp4_n2e4_m16"


def test_grid_of_only_infeasible_n_fails_in_one_line(tmp_path):
  proc = _launch(f"--config={TINY}", f"--root={tmp_path}/x", "--bp=4", "--n=1",
                 "--budget=64", "--dry_run", check=False)
  assert proc.returncode == 2 and "Traceback" not in proc.stderr
  assert proc.stderr.strip().splitlines()[-1] == (
      "launch/sweep.py: error: no feasible budget point: every n in [1.0] is below the 2 "
      "rollouts per problem the grpo estimator needs (--verbose prints the traceback)")
  proc = _launch(f"--config={TINY}", f"--root={tmp_path}/x", "--bp=4", "--n=1",
                 "--budget=64", "--dry_run", "--", "--config.rl.adv_estimator=drgrpo",
                 check=False)
  assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].endswith(
      "below the 2 rollouts per problem the drgrpo estimator needs (--verbose prints "
      "the traceback)")
  proc = _launch(f"--config={TINY}", f"--root={tmp_path}/x", "--bp=4", "--n=1",
                 "--budget=64", "--dry_run", "--", "--config.rl.adv_estimator=gae")
  assert proc.stdout.splitlines()[1].split()[0] == "bp4_n1_m16_s0"


@pytest.mark.parametrize("name", [sweep.LOCK_FILE, sweep.LOG_FILE, sweep.ATTEMPTS_FILE])
def test_launcher_never_writes_through_a_link_in_the_root(tmp_path, fake_runner, name):
  victim = tmp_path / "victim.txt"
  victim.write_text("precious\n")
  root = tmp_path / "root"
  (root / "bp4_n2_m8_s0").mkdir(parents=True)
  (root / "bp4_n2_m8_s0" / name).symlink_to(victim)
  proc = _launch(f"--config={TINY}", f"--root={root}", "--bp=4", "--n=2,4", "--budget=64",
                 f"--runner={fake_runner}", "--max_concurrent=1", check=False)
  assert proc.returncode == 1
  assert f"FAILED bp4_n2_m8_s0: refusing to write through {root}/bp4_n2_m8_s0/{name} -> " \
         f"{victim}" in proc.stdout
  assert victim.read_text() == "precious\n"
  assert (root / "bp4_n4_m4_s0" / "DONE").exists()  # the other point still ran


def test_sweep_fixed_after_a_typo_runs_in_the_same_root(tmp_path):
  # A typo'd value fails every point at start-up; it must not leave a config.json
  # that locks the points against the corrected command.
  root = tmp_path / "typo"
  grid = [f"--config={TINY}", f"--root={root}", "--bp=4", "--n=2", "--budget=16",
          "--max_concurrent=1"]
  proc = _launch(*grid, *E2E_RUN_ARGS, f"--config.model.path={tmp_path}/no-such-model",
                 check=False, timeout=300)
  run_dir = root / "bp4_n2_m2_s0"
  assert proc.returncode == 1 and "FAILED bp4_n2_m2_s0" in proc.stdout
  assert "no-such-model" in proc.stdout and not (run_dir / "config.json").exists()
  _launch(*grid, *E2E_RUN_ARGS, timeout=300)
  assert (run_dir / "DONE").exists()
  assert [r["step"] for r in _metrics(run_dir)] == [0, 1, 2]


def test_slurm_rerun_in_the_same_root_keeps_the_array_written_there(tmp_path):
  # The tasks of the first array read points.json by index: replacing it with another
  # grid would run other points under that array's indices.
  root = tmp_path / "sl"
  grid = [f"--config={TINY}", f"--root={root}", "--bp=4", "--budget=64", "--slurm"]
  _launch(*grid, "--n=2,4")
  points, script = root / "slurm" / "points.json", root / "slurm" / "sweep.sbatch"
  written = (points.read_text(), script.read_text())
  for other in (["--n=8"], ["--n=2,4", "--", "--config.eval_every=2"]):
    proc = _launch(*grid, *other, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith(f"launch/sweep.py: error: sweep root {root} already holds the "
                           f"SLURM array of another sweep in {points} ("), line
    assert "use a new --root" in line
    assert (points.read_text(), script.read_text()) == written
  # The same grid again is idempotent, and may change the sbatch resources.
  proc = _launch(*grid, "--n=2,4", "--partition=gpu")
  assert "wrote" in proc.stdout and points.read_text() == written[0]
  assert '#SBATCH --partition="gpu"\n' in script.read_text()


def test_slurm_never_writes_through_a_link_at_the_points_file(tmp_path):
  victim = tmp_path / "victim.json"
  victim.write_text("precious\n")
  root = tmp_path / "sl"
  (root / "slurm").mkdir(parents=True)
  (root / "slurm" / "points.json").symlink_to(victim)
  proc = _launch(f"--config={TINY}", f"--root={root}", "--bp=4", "--n=2", "--budget=64",
                 "--slurm", check=False)
  assert proc.returncode == 2 and "refusing to write through" in proc.stderr
  assert victim.read_text() == "precious\n"
  assert (root / "slurm" / "points.json").is_symlink()
