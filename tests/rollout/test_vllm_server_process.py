"""How VLLMServer starts and stops its process group, with fake servers.

A vLLM API server leads its own process group and forks EngineCore and Worker
processes into it, which outlive the API server when it dies. The fakes do the
same: a leader that forks a long sleep (its "engine core") and then exits or
keeps running. No vLLM, no network, CPU only; every group a test starts is
SIGKILLed at teardown, whatever happened.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from isojax.rollout.vllm_server import VLLMServer, stop_pid_file, stop_process_group
from tests.rollout.test_vllm_server import _fake_venv

# Named like vLLM's engine core (it sets its title to "VLLM::EngineCore"), which
# is how stop_pid_file recognises a vLLM group whose API server is gone.
ENGINE_CORE = [sys.executable, "-c", "import time; time.sleep(300)", "VLLM::EngineCore"]
OTHER_PROGRAM = ["sleep", "300"]


def _live_members(pgid: int) -> list[int]:
  """Pids in process group `pgid` that have not exited, read from /proc.

  Zombies do not count: they are dead, only waiting for init to reap them
  (which takes seconds in some containers).
  """
  pids = []
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/stat", "rb") as f:
        state, _, pgrp = f.read().rpartition(b")")[2].split()[:3]
    except (FileNotFoundError, ProcessLookupError):
      continue  # exited while we looked
    if int(pgrp) == pgid and state != b"Z":
      pids.append(int(entry))
  return pids


@pytest.fixture
def groups():
  """Process groups the test started; SIGKILLed at teardown."""
  started: list[int] = []
  yield started
  for pgid in started:
    with contextlib.suppress(ProcessLookupError):
      os.killpg(pgid, signal.SIGKILL)


@pytest.fixture
def popened(monkeypatch, groups):
  """Pids of the servers VLLMServer.start() launches (and owns their groups)."""
  pids: list[int] = []
  real_popen = subprocess.Popen

  def popen(*args, **kwargs):
    process = real_popen(*args, **kwargs)
    pids.append(process.pid)
    groups.append(process.pid)  # start_new_session: its pgid is its pid
    return process

  monkeypatch.setattr(subprocess, "Popen", popen)
  return pids


def _dead_leader_group(groups: list[int], child: list[str]) -> int:
  """A process group whose leader started `child` and exited; returns its pgid."""
  leader = subprocess.Popen(
      [sys.executable, "-c", "import subprocess, sys; subprocess.Popen(sys.argv[1:])",
       *child], start_new_session=True, stdin=subprocess.DEVNULL)
  groups.append(leader.pid)
  assert leader.wait(timeout=60) == 0  # the leader is gone and reaped ...
  assert _live_members(leader.pid)  # ... and its child lives on in its group
  return leader.pid


def _fake_server(tmp_path, script: str) -> tuple[str, str]:
  """(model_dir, venv) where the venv's `python` is a shell script: the API server."""
  return str(tmp_path / "model"), _fake_venv(tmp_path, script)


def _engine_core_then(then: str) -> str:
  return " ".join(f'"{arg}"' for arg in ENGINE_CORE) + " &\n" + then


def test_stop_process_group_stops_the_children_of_a_reaped_leader(groups):
  pgid = _dead_leader_group(groups, ENGINE_CORE)
  stop_process_group(pgid, grace_s=10)
  assert not _live_members(pgid)


def test_failed_start_stops_the_engine_core_a_dead_server_left(tmp_path, popened):
  """start() reaps the dead API server (poll()) before stop() runs."""
  model, venv = _fake_server(tmp_path, _engine_core_then(
      'echo "RuntimeError: Engine core initialization failed" >&2; exit 3'))
  server = VLLMServer(model, venv=venv, workdir=str(tmp_path / "w"), startup_timeout_s=60)
  with pytest.raises(RuntimeError, match=r"(?s)exited with code 3 .*initialization failed"):
    server.start()
  assert server.process is None and len(popened) == 1
  assert not _live_members(popened[0])


def test_stop_pid_file_stops_the_group_of_a_dead_server(tmp_path, groups):
  pgid = _dead_leader_group(groups, ENGINE_CORE)
  pid_file = tmp_path / "vllm.pid"
  pid_file.write_text(f"{pgid}\n")
  assert stop_pid_file(str(pid_file), grace_s=10)
  assert not _live_members(pgid)
  assert not pid_file.exists()


def test_stop_pid_file_leaves_a_group_without_vllm_running(tmp_path, groups):
  """A stale pid file whose number now names a group of another program."""
  pgid = _dead_leader_group(groups, OTHER_PROGRAM)
  pid_file = tmp_path / "vllm.pid"
  pid_file.write_text(f"{pgid}\n")
  with pytest.raises(ValueError, match=rf"pid {pgid} from .*vllm.pid is gone and its "
                     rf"process group {pgid} holds no vLLM process \('sleep 300'\)"):
    stop_pid_file(str(pid_file), grace_s=10)
  assert _live_members(pgid)
  assert pid_file.exists()


def test_start_that_cannot_write_its_pid_file_stops_the_server(tmp_path, popened):
  model, venv = _fake_server(tmp_path, _engine_core_then("exec sleep 300"))
  server = VLLMServer(model, venv=venv, workdir=str(tmp_path / "w"),
                      pid_file=str(tmp_path / "missing" / "vllm.pid"), startup_timeout_s=60)
  with pytest.raises(FileNotFoundError, match="missing/vllm.pid"):
    server.start()
  assert server.process is None and len(popened) == 1
  assert not _live_members(popened[0])


def test_stop_of_a_server_that_outlives_sigkill_returns(tmp_path, popened, monkeypatch):
  """A server stuck in the kernel (stood in for by a kill that does nothing) is
  left with its pid file: stop() and the atexit hook must not wait on it forever."""
  from isojax.rollout import vllm_server
  model, venv = _fake_server(tmp_path, _engine_core_then("exec sleep 300"))
  server = VLLMServer(model, venv=venv, workdir=str(tmp_path / "w"), startup_timeout_s=60)
  monkeypatch.setattr(VLLMServer, "_wait_healthy", lambda self: None)
  monkeypatch.setattr(VLLMServer, "_warm_up", lambda self: None)
  server.start()
  pid = server.process.pid
  monkeypatch.setattr(vllm_server, "stop_process_group", lambda pid, grace_s: None)
  monkeypatch.setattr(vllm_server, "_KILL_WAIT_S", 0.5)
  stopper = threading.Thread(target=server.stop, daemon=True)
  t0 = time.monotonic()
  stopper.start()
  stopper.join(timeout=20)
  assert not stopper.is_alive(), "stop() waited on a process that survived the kill"
  assert time.monotonic() - t0 < 10 and server.process is None
  assert os.path.exists(server.pid_file) and _live_members(pid)
