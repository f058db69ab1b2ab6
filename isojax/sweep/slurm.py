"""SLURM arrays for sweeps: one array task per budget point, all the logic in Python.

`write_array` writes two files into `<root>/slurm/`:

* `points.json`: every point's name, run directory and full run command, in array order;
* `sweep.sbatch`: `#SBATCH --array=0-(N-1)` and one line that hands
  `$SLURM_ARRAY_TASK_ID` to `launch/sweep.py --task_file=points.json --task_index=...`.

The script does no arithmetic; the task runner (`run_task`) looks its point up, skips it
if finished, starts a vLLM server for it when the config samples from one, and runs the
command, under `srun` over all of the job's nodes when a point spans several, where each
process joins the multi-host JAX job through `isojax.sharding.initialize_distributed`.
No JAX import here either; only tasks of vLLM configs import the server helper.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import shlex
import shutil
import subprocess
import sys

from isojax import files
from isojax import rundir
from isojax.sweep import attempts
from isojax.sweep.local import with_compilation_cache, with_experiment_imports
from isojax.sweep.points import Sweep

POINTS_FILE = "points.json"
SCRIPT_FILE = "sweep.sbatch"
ARRAY_LOCK_FILE = ".array.lock"  # held while the points file is checked and written
# `python -c` prologue of a multi-node run: join jax.distributed (coordinator, process
# count and id from SLURM's environment), then run the runner as if it were __main__.
_DISTRIBUTED_BOOTSTRAP = (
    "import runpy, sys; from isojax import sharding; "
    "sharding.initialize_distributed(); "
    "mod = sys.argv[1]; sys.argv = [mod] + sys.argv[2:]; "
    "runpy.run_module(mod, run_name='__main__', alter_sys=True)")
VLLM_START_TIMEOUT_S = 1800.0  # a large model on a cold node loads for many minutes


@dataclasses.dataclass(frozen=True)
class SlurmOptions:
  """Resources of one array task (= one budget point).

  Attributes:
    nodes: nodes per point; > 1 runs the point as one multi-host JAX job.
    gpus_per_node, cpus_per_task, mem, partition, account, time: the usual sbatch
      options; None/0 leaves them to the cluster's defaults.
    max_parallel: array throttle (`--array=0-7%2`); None = no limit.
    sbatch_args: further `#SBATCH` options, verbatim (e.g. "--qos=high").
  """

  nodes: int = 1
  gpus_per_node: int = 0
  cpus_per_task: int | None = None
  mem: str | None = None
  partition: str | None = None
  account: str | None = None
  time: str | None = None
  max_parallel: int | None = None
  sbatch_args: tuple[str, ...] = ()

  def __post_init__(self):
    if self.nodes < 1:
      raise ValueError(f"SLURM nodes per point must be >= 1, got {self.nodes}")
    if self.max_parallel is not None and self.max_parallel < 1:
      raise ValueError(f"SLURM max_parallel must be >= 1, got {self.max_parallel}")


def write_array(sweep: Sweep, options: SlurmOptions, *,
                vllm_model: str | None = None,
                launcher: str = os.path.join("launch", "sweep.py")) -> tuple[str, str]:
  """Writes `<root>/slurm/points.json` and `<root>/slurm/sweep.sbatch`.

  Args:
    sweep: the points and how to run each.
    options: per-task resources.
    vllm_model: HF directory a per-task vLLM server serves; None = no server (the
      config samples in-process).
    launcher: path of launch/sweep.py from the current directory, where the tasks
      run too (relative paths in the sweep resolve there).

  Returns:
    (script path, points path).

  Raises:
    ValueError: for an empty sweep, multi-node points with a `.py` runner (they
      need a module, `task_command`), a vLLM config with multi-node points (the
      per-task server listens on the loopback of the first node only), or a root
      whose points file describes another array (`_check_no_other_array`).
  """
  if not sweep.points:
    raise ValueError("a SLURM array needs at least one point; the sweep has none")
  vllm = vllm_model is not None
  if vllm and options.nodes > 1:
    raise ValueError(
        f"nodes={options.nodes} with the vLLM backend: the per-task vLLM server "
        "binds 127.0.0.1 on the first node, which the other nodes cannot reach; "
        "use --nodes=1 for configs that sample with vLLM")
  # Each task checks its runner again; refusing here keeps a whole array from
  # being queued only for every task to fail.
  task_command(sweep.command(sweep.points[0]), nodes=options.nodes)
  workdir = os.getcwd()
  out_dir = os.path.join(sweep.root, "slurm")
  files.make_dir(out_dir)
  files.make_dir(os.path.join(out_dir, "logs"))
  points_path = os.path.join(out_dir, POINTS_FILE)
  script_path = os.path.join(out_dir, SCRIPT_FILE)
  entries = [{"index": i, "name": sp.name, "run_dir": sweep.run_dir(sp),
              "command": sweep.command(sp), "config_digest": sweep.config_digest(sp)}
             for i, sp in enumerate(sweep.points)]
  spec = {"config": sweep.config, "root": sweep.root, "nodes": options.nodes,
          "vllm_model": vllm_model, "points": entries}
  # Two launchers writing arrays of other grids into one root at once would both
  # find no points file and both write one; the array submitted first would then
  # run the other's points. The check and the writes are one step under a lock,
  # held for milliseconds (and dropped by the kernel if its holder is killed).
  lock = files.open_nofollow(os.path.join(out_dir, ARRAY_LOCK_FILE), os.O_RDWR | os.O_CREAT)
  try:
    fcntl.flock(lock, fcntl.LOCK_EX)
    _check_no_other_array(points_path, spec)
    files.write_atomic(points_path, json.dumps(spec, indent=1) + "\n", fsync=False)
    files.write_atomic(script_path, _script(sweep, options, launcher=launcher,
                                            workdir=workdir, points_path=points_path,
                                            vllm=vllm), fsync=False)
  finally:
    os.close(lock)
  os.chmod(script_path, 0o755)
  return script_path, points_path


def _check_no_other_array(points_path: str, spec: dict) -> None:
  """Refuses to replace a points file that describes another array.

  The tasks of an array written (perhaps submitted) earlier look their point up by
  index in this file when they start, so replacing it would run other points under
  that array's indices. The same array again (same points and commands) may be
  rewritten: writing it is idempotent.
  """
  files.check_not_link(points_path)
  try:
    with open(points_path) as f:
      old = json.load(f)
  except FileNotFoundError:
    return
  except (OSError, ValueError) as e:
    raise ValueError(f"{points_path} (in sweep root {spec['root']}) is unreadable ({e}) "
                     "and may belong to an array already submitted: use a new --root, "
                     "or remove it if no job uses it") from e
  if old == json.loads(json.dumps(spec)):  # as read back: lists, not tuples
    return
  old_points = old.get("points") if isinstance(old, dict) else None
  old_names = [p.get("name") for p in old_points or () if isinstance(p, dict)]
  what = ("the same points with other run commands, options or experiment configs"
          if old_names == [p["name"] for p in spec["points"]]
          else f"{len(old_names)} task(s): {_name_range(old_names)}")
  raise ValueError(f"sweep root {spec['root']} already holds the SLURM array of another "
                   f"sweep in {points_path} ({what}); its tasks read that file, so it "
                   "is not overwritten: use a new --root for this sweep (or remove the "
                   "file if no job of that array is queued or running)")


def _name_range(names: list) -> str:
  return ", ".join(map(str, names)) if len(names) <= 3 else (
      f"{names[0]}, {names[1]}, ..., {names[-1]}")


def _script(sweep, options, *, launcher, workdir, points_path, vllm) -> str:
  n = len(sweep.points)
  array = f"0-{n - 1}" + (f"%{options.max_parallel}" if options.max_parallel else "")
  study = os.path.basename(os.path.normpath(sweep.root)) or "sweep"
  logs = os.path.join(os.path.abspath(os.path.join(workdir, sweep.root)), "slurm", "logs")
  # SLURM expands %A, %a, ... in the output pattern and reads %% as one %.
  output = logs.replace("%", "%%") + "/%A_%a.out"
  sbatch = [f"--job-name={_sbatch_quote(f'isojax-{study}')}", f"--array={array}",
            f"--nodes={options.nodes}", "--ntasks-per-node=1",
            f"--output={_sbatch_quote(output)}"]
  for flag, value in (("gpus-per-node", options.gpus_per_node),
                      ("cpus-per-task", options.cpus_per_task), ("mem", options.mem),
                      ("partition", options.partition), ("account", options.account),
                      ("time", options.time)):
    if value:
      sbatch.append(f"--{flag}={_sbatch_quote(value) if isinstance(value, str) else value}")
  sbatch += list(options.sbatch_args)
  lines = ["#!/bin/bash",
           f"# isojax sweep: {n} run(s) of {sweep.config} under {sweep.root}, "
           "one array task per point.",
           "# Written by launch/sweep.py --slurm; the task runner reads "
           f"{POINTS_FILE} (task -> command)"
           + ("; each task starts its own vLLM server." if vllm else "."),
           *[f"#   task {i}: {sp.name}" for i, sp in enumerate(sweep.points)],
           *[f"#SBATCH {s}" for s in sbatch],
           "set -euo pipefail",
           f"cd {shlex.quote(workdir)}",
           f"exec {shlex.quote(sweep.python)} {shlex.quote(launcher)} "
           f"--task_file={shlex.quote(points_path)} "
           '--task_index="${SLURM_ARRAY_TASK_ID}"']
  return "\n".join(lines) + "\n"


def _sbatch_quote(value: str) -> str:
  """`value` as one argument of an `#SBATCH` line. sbatch splits those lines itself, not
  with a shell: at white space outside quotes, with `#` outside quotes starting a
  comment and a backslash escaping the next character anywhere, so a double-quoted
  value with `"` and `\\` escaped reaches sbatch as written (a root with a space, a
  quote or a `#` in its name)."""
  if "\n" in value:
    raise ValueError(f"SLURM option value {value!r} holds a line break, which an "
                     f"#SBATCH line cannot")
  return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def submit(script_path: str) -> str:
  """`sbatch --parsable SCRIPT`; returns the job id.

  Raises:
    ValueError: if sbatch is not on PATH or refuses the script (with its message).
  """
  if shutil.which("sbatch") is None:
    raise ValueError(f"sbatch not found on PATH; submit {script_path} on the cluster "
                     f"with: sbatch {script_path}")
  proc = subprocess.run(["sbatch", "--parsable", script_path], capture_output=True,
                        text=True)
  if proc.returncode != 0:
    raise ValueError(f"sbatch {script_path} failed ({proc.returncode}): "
                     f"{proc.stderr.strip()}")
  return proc.stdout.strip().split(";")[0]


def load_task(points_path: str, index: int) -> tuple[dict, dict]:
  """(the whole points file, the entry of task `index`), with clear errors."""
  try:
    with open(points_path) as f:
      spec = json.load(f)
  except (OSError, ValueError) as e:
    raise ValueError(f"cannot read SLURM points file {points_path!r}: {e}") from e
  points = spec.get("points", [])
  if not 0 <= index < len(points):
    raise ValueError(f"task index {index} out of range: {points_path} has "
                     f"{len(points)} points (array 0-{len(points) - 1})")
  return spec, points[index]


def task_command(command: list[str], *, nodes: int) -> list[str]:
  """The command of one task: as is on one node; on several, every node runs it under
  srun after joining jax.distributed (the runner must be a `-m module`)."""
  if nodes == 1:
    return list(command)
  python, rest = command[0], command[1:]
  if rest[:1] != ["-m"] or len(rest) < 2:
    raise ValueError(f"a multi-node point needs a module runner (python -m ...), "
                     f"got {command[:3]}")
  return ["srun", f"--nodes={nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
          python, "-c", _DISTRIBUTED_BOOTSTRAP, *rest[1:]]


def run_task(points_path: str, index: int, *, print_fn=print) -> int:
  """Runs array task `index` of a points file; returns its exit code.

  A point finished under the same command and config (`Sweep.config_digest`, taken
  when the array was written) exits 0 at once; one finished under another command or
  config runs that command alone (no server, one node), so that the run compares its
  saved config as on any rerun: it exits 0 when they match and refuses, naming the
  fields, when they do not. A locked point (running in another task) exits 1.
  With a `vllm_model`, a vLLM server (isojax.rollout.vllm_server, loopback only) is
  started on a free port of this node for the task, the run is pointed at it with
  `--config.sampler.vllm_url`, and it is stopped when the run ends.
  """
  spec, entry = load_task(points_path, index)
  run_dir, command = entry["run_dir"], list(entry["command"])
  digest = entry.get("config_digest")
  if rundir.is_done(run_dir) and attempts.finished_as(run_dir, command, digest):
    print_fn(f"skip {entry['name']}: already finished under the same command and config")
    return 0
  fd = attempts.try_lock(run_dir)
  if fd is None:
    print_fn(f"{entry['name']} is locked by {attempts.lock_holder(run_dir)}")
    return 1
  server, checking = None, rundir.is_done(run_dir)
  try:
    if checking and attempts.finished_as(run_dir, command, digest):
      print_fn(f"skip {entry['name']}: finished by another task")
      return 0
    if checking:
      print_fn(f"{entry['name']} finished under another command or config: the run "
               f"checks its config")
    elif spec.get("vllm_model"):
      # Imported here: only vLLM tasks need it (and its `requests` dependency).
      from isojax.rollout.vllm_server import VLLMServer
      server = VLLMServer(spec["vllm_model"], workdir=os.path.join(run_dir, "vllm"),
                          startup_timeout_s=VLLM_START_TIMEOUT_S).start()
    argv = list(command)
    if server is not None:
      argv.append(f"--config.sampler.vllm_url={server.base_url}")
    argv = task_command(argv, nodes=1 if checking else int(spec.get("nodes", 1)))
    print_fn(f"run {entry['name']}: {shlex.join(argv)}")
    sys.stdout.flush()  # before the run's own output
    env = with_compilation_cache(os.environ, spec["root"])
    proc = subprocess.Popen(argv, pass_fds=(fd,),
                            env=with_experiment_imports(env, spec["config"]))
    attempts.record_attempt(run_dir, event="start", pid=proc.pid, command=command,
                            config_digest=digest)
    rc = proc.wait()
    attempts.record_attempt(run_dir, event="end", pid=proc.pid, rc=rc,
                            done=rundir.is_done(run_dir))
  finally:
    if server is not None:
      server.stop()
    os.close(fd)
  if rc == 0 and not rundir.is_done(run_dir):
    print_fn(f"{entry['name']}: exit 0 but no {rundir.DONE_FILE} marker")
    return 1
  return rc
