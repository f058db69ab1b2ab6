"""A multi-host run, as two processes on this machine joined by jax.distributed.

Each process starts as a multi-node SLURM task does (`isojax.sweep.slurm.task_command`:
join jax.distributed, then run `isojax.main`), with 2 CPU devices of its own and
SLURM's variables faked; the coordinator runs on a free local port. The tiny run
over a data=2 x fsdp=2 mesh spanning both processes must write the metrics of the
same run in one process on 4 devices (up to the order of float reductions), and
only process 0 writes run files.
"""

import os
import pathlib
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from experiments import tiny
from isojax import run
from isojax.sweep import slurm
from tests import run_records
from tests.config_overrides import set_fields

ROOT = pathlib.Path(__file__).resolve().parents[1]
POINT = "bp=4,n=4,budget=32"  # B = 16, M = 2: an eval at steps 0 and 2, one checkpoint
# 4 validation problems x k = 4 sample as many rows as an update, so the sampler
# compiles once for both; no pass@1 histogram (another shape).
OVERRIDES = {"mesh.data": 2, "mesh.fsdp": 2, "data.num_val": 4, "eval.num_train": 0}
PROCESSES, DEVICES_EACH = 2, 2
TIMEOUT_S = 300

pytestmark = pytest.mark.skipif(
    not hasattr(jax.config, "jax_cpu_collectives_implementation"),
    reason="this jaxlib has no cross-process collectives on CPU")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _task_argv(workdir) -> list[str]:
  """What srun starts on every node for a two-node point, without srun itself."""
  flags = [f"--config.{k}={v}" for k, v in OVERRIDES.items()]
  argv = slurm.task_command([sys.executable, "-m", "isojax.main",
                             f"--config=experiments/tiny.py:{POINT}",
                             f"--workdir={workdir}", *flags], nodes=PROCESSES)
  return argv[argv.index(sys.executable):]


def _start_processes(workdir, logs) -> list[subprocess.Popen]:
  """Starts the point in PROCESSES processes."""
  env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES_EACH}",
         "JAX_PLATFORMS": "cpu", "SLURM_JOB_ID": "1", "SLURM_NTASKS": str(PROCESSES),
         "SLURM_STEP_NODELIST": "localhost", "SLURM_LOCALID": "0",
         # Overrides the port JAX derives from the job id, which may be taken here.
         "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{_free_port()}"}
  procs = []
  for i in range(PROCESSES):
    with open(logs / f"process{i}.log", "w") as log:
      procs.append(subprocess.Popen(_task_argv(workdir), cwd=ROOT, stdout=log,
                                    stderr=subprocess.STDOUT,
                                    env={**env, "SLURM_PROCID": str(i)}))
  return procs


def _wait(procs: list[subprocess.Popen], deadline: float) -> list[int]:
  """Their exit codes; raises subprocess.TimeoutExpired past `deadline`."""
  for p in procs:
    p.wait(timeout=max(1.0, deadline - time.time()))
  return [p.returncode for p in procs]


def _kill(procs: list[subprocess.Popen]) -> None:
  # SIGKILL: a process in a jax.distributed job takes SIGTERM as a preemption
  # notice, and one stuck in a collective would not stop for it.
  for p in procs:
    if p.poll() is None:
      p.kill()
      p.wait()


def _tail(path, lines=30) -> str:
  return "\n".join(pathlib.Path(path).read_text(errors="replace").splitlines()[-lines:])


def test_two_processes_train_as_one_process_on_as_many_devices(tmp_path):
  workdir, logs = tmp_path / "two", tmp_path / "logs"
  logs.mkdir()
  deadline = time.time() + TIMEOUT_S
  procs = _start_processes(workdir, logs)
  try:
    # Meanwhile, the same run in this process: 8 CPU devices, the mesh takes 4.
    one = tmp_path / "one"
    run.run(set_fields(tiny.get_config(POINT), dict(OVERRIDES)), one)
    codes = _wait(procs, deadline)
  except subprocess.TimeoutExpired:
    pytest.fail(f"the two processes did not finish in {TIMEOUT_S} s:\n"
                + _tail(logs / "process0.log"))
  finally:
    _kill(procs)
  assert codes == [0] * PROCESSES, "\n\n".join(
      f"process {i} exited {c}:\n{_tail(logs / f'process{i}.log')}"
      for i, c in enumerate(codes))

  # Process 0 alone wrote the run files: one line per step, one TensorBoard file.
  assert (workdir / "DONE").exists()
  assert [r["step"] for r in run_records.records(workdir)] == [0, 1, 2]
  assert len(os.listdir(workdir / "tensorboard")) == 1
  assert sorted(os.listdir(workdir / "checkpoints")) == ["2"]

  two_rows = [run_records.without_timing(r) for r in run_records.records(workdir)]
  one_rows = [run_records.without_timing(r) for r in run_records.records(one)]
  assert [sorted(r) for r in two_rows] == [sorted(r) for r in one_rows]
  for two_row, one_row in zip(two_rows, one_rows):
    for key, value in one_row.items():
      if isinstance(value, float):
        # Cross-process reductions add in another order; a loss summed over
        # advantages is ~0, hence the absolute tolerance.
        np.testing.assert_allclose(two_row[key], value, rtol=1e-4, atol=1e-6,
                                   err_msg=f"step {one_row['step']}: {key}")
      else:
        assert two_row[key] == value, (one_row["step"], key)
