"""Local execution: a bounded pool of run subprocesses, each with its own log file.

A point is skipped once its run wrote the DONE marker under the same command, and an
unfinished point is simply rerun with the same workdir: the run resumes from its own
checkpoint. A point finished under another command (other run arguments, another
runner) is started again, so that the run compares its saved config with the new one
itself, as it does for any rerun: it exits at once when they match and refuses, naming
the fields, when they do not. A failing run is reported with the tail of its log while
the sweep goes on.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable

from isojax import files
from isojax.errors import IsojaxError
from isojax.files import log_tail
from isojax.rundir import DONE_FILE, METRICS_FILE, is_done, last_record
from isojax.sweep.attempts import (ATTEMPTS_FILE, LOG_FILE, finished_as, lock_holder,
                                   record_attempt, try_lock)
from isojax.sweep.points import Sweep, SweepPoint, experiment_import_root


def cpu_count() -> int:
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:
    return os.cpu_count() or 1


def has_accelerator(env=os.environ) -> bool:
  """A cheap guess without importing JAX: a GPU driver is present and JAX may use it."""
  if env.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
    return False
  return shutil.which("nvidia-smi") is not None or os.path.exists("/dev/accel0")


# A small CPU run is mostly single-threaded (Python sampling loop, compilation, small
# matmuls), so one run per core, each limited to one thread, uses a CPU machine best.
# Measured on a 2-core machine: two tiny-config runs one at a time with 2 threads each
# took 57 s, both at once with 1 thread each 34 s. On an accelerator a run owns all
# devices (and JAX preallocates their memory), so one run at a time.
CORES_PER_RUN = 1


def default_concurrency(cpus: int | None = None, accelerator: bool | None = None) -> int:
  """Concurrent local runs that fit the machine: 1 with an accelerator, else
  max(1, cpus // CORES_PER_RUN)."""
  cpus = cpu_count() if cpus is None else cpus
  accelerator = has_accelerator() if accelerator is None else accelerator
  return 1 if accelerator else max(1, cpus // CORES_PER_RUN)


def run_env(base: dict | None = None, *, threads: int) -> dict:
  """The environment of one run: math libraries limited to `threads` threads.

  With one thread per run XLA's CPU backend is also made single-threaded, so that
  concurrent runs on a small machine do not oversubscribe it. User settings win.
  """
  env = dict(os.environ if base is None else base)
  for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    env.setdefault(var, str(threads))
  env.setdefault("TOKENIZERS_PARALLELISM", "false")
  env.setdefault("PYTHONUNBUFFERED", "1")
  xla = env.get("XLA_FLAGS", "")
  if threads == 1 and "multi_thread_eigen" not in xla:
    # XLA rejects unknown flags at start-up; this one exists in every jaxlib we pin.
    env["XLA_FLAGS"] = (xla + " --xla_cpu_multi_thread_eigen=false").strip()
  return env


# JAX's persistent compilation cache, shared by the runs of one sweep, under its root.
COMPILATION_CACHE_DIR = "xla_cache"


def with_compilation_cache(env, root: str) -> dict:
  """`env` with JAX_COMPILATION_CACHE_DIR at the sweep's shared cache, unless it is set
  (set empty, it turns the cache off). Runs of one shape (a Bp and n at several
  budgets or seeds, a resumed run) then load their compiled programs instead of
  compiling them again; on a GPU the update step of a 1.5B model alone compiles for
  one to two minutes."""
  env = dict(env)
  env.setdefault("JAX_COMPILATION_CACHE_DIR",
                 os.path.abspath(os.path.join(root, COMPILATION_CACHE_DIR)))
  return env


def with_experiment_imports(env, config: str) -> dict:
  """`env` with the directory the experiment file `config`'s imports resolve from
  (`experiment_import_root`) first on PYTHONPATH. A run starts as `python -m
  isojax.main` in the launcher's cwd (a SLURM task in the cwd the array was written
  from), which need not be that directory: without it the run cannot import
  `experiments.common`."""
  env = dict(env)
  root = experiment_import_root(config)
  paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
  if root not in paths:
    env["PYTHONPATH"] = os.pathsep.join([root, *paths])
  return env


def _die_with_launcher(launcher_pid: int) -> Callable[[], None]:
  """preexec_fn: the run gets SIGTERM when the launcher dies (Linux), so a killed
  launcher does not leave orphans; elsewhere the inherited lock still protects."""
  def preexec():
    try:
      libc = ctypes.CDLL(None, use_errno=True)
      libc.prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
      return
    if os.getppid() != launcher_pid:  # the launcher died before prctl took effect
      os._exit(1)
  return preexec


@dataclasses.dataclass
class SweepReport:
  """What a local sweep did, by run name."""

  finished: list[str] = dataclasses.field(default_factory=list)
  skipped: list[str] = dataclasses.field(default_factory=list)
  failed: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> why

  @property
  def ok(self) -> bool:
    return not self.failed


@dataclasses.dataclass
class _Running:
  sp: SweepPoint
  proc: subprocess.Popen
  lock_fd: int
  log: object
  started: float
  checking: bool = False  # finished under another command: the run checks its config


def _fmt_s(seconds: float) -> str:
  seconds = int(seconds)
  return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else (
      f"{seconds // 60}m{seconds % 60:02d}s")


def run_local(sweep: Sweep, *, max_concurrent: int, env: dict | None = None,
              poll_s: float = 0.5, status_every_s: float = 30.0,
              print_fn: Callable[[str], None] = print) -> SweepReport:
  """Runs every unfinished point with at most `max_concurrent` runs at a time.

  A failing run is reported with the tail of its log and the sweep goes on. A point
  locked by another live launcher (or its still-running run) is retried until the lock
  frees, then skipped if that run finished it. Returns the report; never raises for a
  failing run.
  """
  if max_concurrent < 1:
    raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent}")
  # The cores are shared by the runs that can be going at once: with fewer points left
  # than slots, each run gets more threads.
  unfinished = sum(not is_done(sweep.run_dir(sp)) for sp in sweep.points)
  threads = max(1, cpu_count() // max(1, min(max_concurrent, unfinished)))
  env = with_compilation_cache(run_env(env, threads=threads), sweep.root)
  pool = _Pool(sweep, with_experiment_imports(env, sweep.config), print_fn)
  print_fn(f"sweep: {pool.total} runs under {sweep.root}, up to {max_concurrent} at a "
           f"time ({threads} thread(s) each)")
  try:
    pool.drive(max_concurrent, poll_s=poll_s, status_every_s=status_every_s)
  finally:
    pool.stop_all()  # interrupted (Ctrl-C): stop runs, keep checkpoints
  report = pool.report
  print_fn(f"sweep: {len(report.finished)} finished, {len(report.skipped)} already done, "
           f"{len(report.failed)} failed in {_fmt_s(time.time() - pool.t0)}")
  return report


class _Pool:
  """The runs of one local sweep: which are pending, locked elsewhere or running."""

  def __init__(self, sweep: Sweep, env: dict, print_fn: Callable[[str], None]):
    self.sweep, self.env, self.print_fn = sweep, env, print_fn
    self.report = SweepReport()
    self.pending = collections.deque(sweep.points)
    self.waiting: list[SweepPoint] = []    # locked elsewhere; retried after each poll
    self.running: dict[str, _Running] = {}
    self.announced: set[str] = set()       # names already reported as locked
    # Config digests, read once per point: a waiting point is retried after each poll.
    self.digests: dict[str, str] = {}
    self.total = len(sweep.points)
    self.start_progress = {sp.name: _rollouts(sweep, sp) for sp in sweep.points}
    self.t0 = time.time()

  def drive(self, max_concurrent: int, *, poll_s: float, status_every_s: float) -> None:
    """Starts, reaps and retries runs until every point is done, skipped or failed."""
    last_status = self.t0
    while self.pending or self.running or self.waiting:
      while self.pending and len(self.running) < max_concurrent:
        self.launch(self.pending.popleft())
      for name, r in list(self.running.items()):
        if r.proc.poll() is not None:
          del self.running[name]
          self.reap(r)
      if time.time() - last_status >= status_every_s and (self.running or self.waiting):
        last_status = time.time()
        self.print_fn(_status_line(self.sweep, self.report, self.running, self.waiting,
                                   self.start_progress, self.t0, self.total))
      if self.pending and len(self.running) < max_concurrent:
        continue  # a run just ended: fill its slot now
      time.sleep(poll_s)
      if self.waiting and not self.pending:
        self.pending.extend(self.waiting)  # retry locked points; `launch` re-queues held ones
        self.waiting.clear()

  def _fail(self, sp: SweepPoint, why: str, shown: str | None = None) -> None:
    self.report.failed[sp.name] = why
    self.print_fn(f"FAILED {sp.name}: {shown or why}")

  def _skip(self, sp: SweepPoint, why: str) -> None:
    self.report.skipped.append(sp.name)
    self.print_fn(f"skip   {sp.name}: {why}")

  def launch(self, sp: SweepPoint) -> None:
    """Starts `sp` unless it is finished or locked by another launcher."""
    run_dir, cmd = self.sweep.run_dir(sp), self.sweep.command(sp)
    if sp.name not in self.digests:
      try:
        self.digests[sp.name] = self.sweep.config_digest(sp)
      except Exception as e:  # the user's get_config: whatever it raises fails this point
        self._fail(sp, _why(e, "cannot read its config"))
        return
    digest = self.digests[sp.name]
    if is_done(run_dir) and finished_as(run_dir, cmd, digest):
      self._skip(sp, f"already finished ({DONE_FILE} present, same command and config)")
      return
    try:
      fd = try_lock(run_dir)
    except (IsojaxError, OSError) as e:  # a link (never followed) or a file at the run
      self._fail(sp, _why(e, f"cannot lock {run_dir}"))  # dir, a full disk: this point
      return
    if fd is None:
      self.waiting.append(sp)
      if sp.name not in self.announced:
        self.announced.add(sp.name)
        self.print_fn(f"wait   {sp.name}: locked by {lock_holder(run_dir)}")
      return
    if is_done(run_dir) and finished_as(run_dir, cmd, digest):
      os.close(fd)  # finished by another launcher while we were not looking
      self._skip(sp, "finished by another launcher")
      return
    self._start(sp, run_dir, fd, cmd, digest)

  def _start(self, sp: SweepPoint, run_dir: str, fd: int, cmd: list[str],
             digest: str) -> None:
    """Starts the run of a locked point, its output appended to the point's log."""
    log = None
    try:
      files.check_not_link(os.path.join(run_dir, ATTEMPTS_FILE))
      log = files.open_append(os.path.join(run_dir, LOG_FILE), binary=True)
      log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} launcher "
                f"{os.getpid()}: {' '.join(cmd)}\n".encode())
      log.flush()
    except (IsojaxError, OSError) as e:  # a link, a full disk: this point only
      if log is not None:
        _close_quietly(log)
      os.close(fd)
      self._fail(sp, _why(e, f"cannot write in {run_dir}"))
      return
    resumed = os.path.exists(os.path.join(run_dir, METRICS_FILE))
    checking = is_done(run_dir)
    try:
      proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                              stdin=subprocess.DEVNULL, pass_fds=(fd,),
                              preexec_fn=_die_with_launcher(os.getpid()))
    except OSError as e:
      log.close()
      os.close(fd)
      self._fail(sp, f"could not start {cmd[0]}: {e}", f"could not start {cmd}: {e}")
      return
    try:
      record_attempt(run_dir, event="start", pid=proc.pid, resumed=resumed, command=cmd,
                     config_digest=digest)
    except (IsojaxError, OSError) as e:
      # Unrecorded, a finished run would not be known as finished by this command.
      proc.terminate()
      proc.wait()
      _close_quietly(log)
      os.close(fd)
      self._fail(sp, _why(e, f"cannot record the attempt in {run_dir}"))
      return
    self.running[sp.name] = _Running(sp, proc, fd, log, time.time(), checking)
    how = ("finished under another command or config: the run checks its config"
           if checking else "resume" if resumed else "fresh")
    self.print_fn(f"start  {sp.name} ({how}, M={sp.point.m}) "
                  f"log: {os.path.join(run_dir, LOG_FILE)}")

  def reap(self, r: _Running) -> None:
    """Records how a run ended; a failure is printed with the tail of its log."""
    rc = r.proc.returncode
    run_dir = self.sweep.run_dir(r.sp)
    _close_quietly(r.log)
    seconds = time.time() - r.started
    try:
      record_attempt(run_dir, event="end", pid=r.proc.pid, rc=rc,
                     done=is_done(run_dir), seconds=round(seconds, 3))
    except (IsojaxError, OSError) as e:  # the run's outcome stands; a rerun checks it
      self.print_fn(f"note   {r.sp.name}: its end is not recorded in {run_dir}: {e}")
    os.close(r.lock_fd)  # after the attempt is recorded: the lock orders the records
    if rc == 0 and is_done(run_dir) and r.checking:
      self._skip(r.sp, "already finished; the run found its config unchanged")
      return
    if rc == 0 and is_done(run_dir):
      self.report.finished.append(r.sp.name)
      n_done = len(self.report.finished) + len(self.report.skipped)
      self.print_fn(f"done   {r.sp.name} in {_fmt_s(seconds)} [{n_done}/{self.total}]")
      return
    why = (f"exit code {rc}" if rc != 0
           else f"exit code 0 but no {DONE_FILE} marker was written")
    log_path = os.path.join(run_dir, LOG_FILE)
    self._fail(r.sp, why, f"{why} after {_fmt_s(seconds)}; log: {log_path}\n"
               f"--- last lines of {log_path} ---\n{log_tail(log_path)}\n---")

  def stop_all(self) -> None:
    """Terminates the runs still going (SIGTERM, then SIGKILL after 30 s)."""
    for r in self.running.values():
      r.proc.terminate()
    for r in self.running.values():
      try:
        r.proc.wait(timeout=30)
      except subprocess.TimeoutExpired:
        r.proc.kill()
      r.log.close()
      os.close(r.lock_fd)


def _why(error: Exception, what: str) -> str:
  """A point's failure: isojax's own message names the path already; an OSError's
  names at most a file, so `what` says which step met it."""
  return str(error) if isinstance(error, IsojaxError) else f"{what}: {error}"


def _close_quietly(f) -> None:
  try:
    f.close()
  except OSError:  # a full disk refusing what is left in the buffer: nothing to keep
    pass


def _rollouts(sweep: Sweep, sp: SweepPoint) -> int:
  if is_done(sweep.run_dir(sp)):
    return sp.point.compute
  progress = last_record(sweep.run_dir(sp)) or {}
  return int(progress.get("rollouts", 0))


def _status_line(sweep, report, running, waiting, start_progress, t0, total) -> str:
  """'3/8 done | bp8_n4_m16_s0 step 5/16 | ETA 3m20s', ETA from rollouts per second."""
  parts = [f"progress: {len(report.finished) + len(report.skipped)}/{total} done"]
  for r in running.values():
    step = (last_record(sweep.run_dir(r.sp)) or {}).get("step", 0)
    parts.append(f"{r.sp.name} step {step}/{r.sp.point.m}")
  if waiting:
    parts.append(f"{len(waiting)} locked elsewhere")
  live = [sp for sp in sweep.points if sp.name not in report.failed]
  now = {sp.name: _rollouts(sweep, sp) for sp in live}
  gained = sum(now[n] - start_progress[n] for n in now)
  remaining = sum(sp.point.compute - now[sp.name] for sp in live)
  if gained > 0 and remaining > 0:
    parts.append(f"ETA {_fmt_s(remaining * (time.time() - t0) / gained)}")
  return " | ".join(parts)
