"""Start and stop a local vLLM OpenAI-compatible server for `VLLMSampler`.

The server runs in its own virtualenv (`launch/setup_vllm_venv.sh` builds it;
vLLM pins its own torch/transformers, which must not leak into the trainer's
environment), as its own process group, so that `stop()` can take down the API
server and its engine-core child together.

Security: the server is started with VLLM_SERVER_DEV_MODE=1, which exposes
`/collective_rpc` (runs arbitrary worker methods) and friends. It binds to
127.0.0.1 unless told otherwise; binding anywhere else exposes those endpoints
to the network.

    with VLLMServer("runs/x/weights/step_000000") as server:
      sampler = VLLMSampler(server.base_url, weights_root="runs/x/weights")
      ...
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence

import requests
from absl import logging

from isojax.files import log_tail

VENV_ENV_VAR = "VLLM_VENV"
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_VENV = os.path.join(_REPO_ROOT, ".venv-vllm")


def resolve_venv(venv: str | None = None) -> str:
  """The vLLM virtualenv: `venv`, else $VLLM_VENV, else <repo>/.venv-vllm; an
  absolute path (the server runs in its workdir, where a relative one fails)."""
  venv = os.path.abspath(venv or os.environ.get(VENV_ENV_VAR) or DEFAULT_VENV)
  python = os.path.join(venv, "bin", "python")
  if not os.path.exists(python):
    raise FileNotFoundError(
        f"no vLLM virtualenv at {venv} ({python} missing); build it with "
        f"`bash launch/setup_vllm_venv.sh` or point ${VENV_ENV_VAR} at one")
  return venv


def free_port(host: str = "127.0.0.1") -> int:
  """A TCP port that was free a moment ago (the OS picks it)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind((host, 0))
    return s.getsockname()[1]


# How long to wait for a SIGKILLed group to vanish before giving up on it.
_KILL_WAIT_S = 5.0

# vLLM's engine talks over Unix sockets named <VLLM_RPC_BASE_PATH>/<uuid4>, the
# base being the temp dir unless set. A socket path holds 107 bytes: a longer
# base fails inside the engine (a ZMQError in its log) after a slow start.
_SOCKET_PATH_MAX = 107
_SOCKET_NAME = 37  # "/" and a uuid4


def _rpc_dir(env: dict[str, str]) -> str:
  """Where the server's engine will put its sockets, as vLLM reads `env`."""
  if env.get("VLLM_RPC_BASE_PATH"):
    return env["VLLM_RPC_BASE_PATH"]
  return os.path.abspath(next((env[k] for k in ("TMPDIR", "TEMP", "TMP") if env.get(k)),
                              "/tmp"))


def stop_process_group(pid: int, *, grace_s: float = 20.0) -> None:
  """SIGTERM the process group led by `pid`, then SIGKILL it after `grace_s`.

  vLLM's API server forks EngineCore and Worker processes; killing the group
  takes them all down. `pid` must lead its group (start_new_session=True). A
  group already gone is not an error; one that outlives SIGKILL by
  `_KILL_WAIT_S` is left (its members are dead or stuck in the kernel).
  """
  # Signal the group by `pid` itself, not by os.getpgid(pid): the engine core
  # and workers outlive an API server that died, and once that leader is reaped
  # getpgid fails while its group (whose id Linux keeps reserved) lives on.
  for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, _KILL_WAIT_S)):
    with contextlib.suppress(ProcessLookupError):
      os.killpg(pid, sig)
    if _wait_group_gone(pid, wait_s):
      return


def _wait_group_gone(pid: int, timeout_s: float) -> bool:
  """Whether the group led by `pid` is gone within `timeout_s`."""
  deadline = time.monotonic() + timeout_s
  while True:
    with contextlib.suppress(ChildProcessError):
      os.waitpid(pid, os.WNOHANG)  # reap our own child so it stops existing
    try:
      os.killpg(pid, 0)
    except ProcessLookupError:
      return True
    if time.monotonic() >= deadline:
      return False
    time.sleep(0.1)


def _cmdline(pid: int) -> str | None:
  """`pid`'s command line from /proc; None once it is gone, "" for a zombie."""
  try:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
      return f.read().replace(b"\0", b" ").decode(errors="replace")
  except (FileNotFoundError, ProcessLookupError):
    return None


def _group_members(pgid: int) -> dict[int, str]:
  """pid -> command line of the live (not zombie) processes in group `pgid`."""
  members = {}
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/stat", "rb") as f:
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
        state, _, pgrp = f.read().rpartition(b")")[2].split()[:3]
    except (FileNotFoundError, ProcessLookupError):
      continue  # exited while we looked
    cmdline = _cmdline(int(entry)) if int(pgrp) == pgid and state != b"Z" else None
    if cmdline is not None:
      members[int(entry)] = cmdline
  return members


class VLLMServer:
  """A vLLM server process for one HF model directory.

  Args:
    model_dir: HF-format directory (config.json + safetensors) to serve.
    venv: vLLM virtualenv (default: $VLLM_VENV, else <repo>/.venv-vllm).
    host: bind address; 127.0.0.1 by default because dev-mode endpoints can run
      arbitrary worker methods.
    port: TCP port; a free one is picked when None.
    dtype: weights/activation dtype on the server ("float32" makes its logprobs
      comparable to the trainer's at ~1e-5; "bfloat16" is what one runs at scale).
    max_model_len: context length; defaults to the model's.
    max_num_seqs: scheduler batch limit (512 helps CPU throughput).
    skip_tokenizer_init: serve a directory without tokenizer files; the client
      sends and receives token ids only.
    chunked_prefill: False (default) schedules every prompt's prefill whole.
      vLLM 0.32 on CPU crashes ("CPU Generator does not use offset") when a
      seeded request's prefill is split across steps, and VLLMSampler always
      seeds; GPU builds can turn it back on.
    extra_args: more `vllm.entrypoints.openai.api_server` flags.
    workdir: where the log, pid file and vLLM cache go (a temp dir by default).
    pid_file: where to write the server's pid (default <workdir>/vllm_server.pid).
    startup_timeout_s: how long to wait for /health before giving up.
    env: extra environment variables for the server.
  """

  def __init__(self, model_dir: str, *, venv: str | None = None,
               host: str = "127.0.0.1", port: int | None = None,
               dtype: str = "auto", max_model_len: int | None = None,
               max_num_seqs: int = 512, skip_tokenizer_init: bool = False,
               chunked_prefill: bool = False,
               extra_args: Sequence[str] = (), workdir: str | None = None,
               pid_file: str | None = None, startup_timeout_s: float = 300.0,
               env: dict[str, str] | None = None):
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
      raise FileNotFoundError(f"model_dir {model_dir} has no config.json")
    self.model_dir = os.path.abspath(model_dir)
    self.venv = resolve_venv(venv)
    self.host = host
    self.port = port or free_port(host)
    self.dtype = dtype
    self.max_model_len = max_model_len
    self.max_num_seqs = max_num_seqs
    self.skip_tokenizer_init = skip_tokenizer_init
    self.chunked_prefill = chunked_prefill
    self.extra_args = list(extra_args)
    self._own_workdir = workdir is None
    self.workdir = workdir or tempfile.mkdtemp(prefix="isojax-vllm-")
    os.makedirs(self.workdir, exist_ok=True)
    self.log_path = os.path.join(self.workdir, "vllm_server.log")
    self.pid_file = pid_file or os.path.join(self.workdir, "vllm_server.pid")
    self.startup_timeout_s = startup_timeout_s
    self.extra_env = dict(env or {})
    self.process: subprocess.Popen | None = None
    self.startup_s: float | None = None

  @property
  def base_url(self) -> str:
    host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
    return f"http://{host}:{self.port}"

  def command(self) -> list[str]:
    """The server's argv (`vllm serve` looks up the wrong distribution name)."""
    cmd = [os.path.join(self.venv, "bin", "python"), "-m",
           "vllm.entrypoints.openai.api_server",
           "--model", self.model_dir, "--host", self.host, "--port", str(self.port),
           "--dtype", self.dtype, "--max-num-seqs", str(self.max_num_seqs),
           # Logprobs of the distribution actually sampled from (after
           # temperature/top-p), and sampling defaults from the request only,
           # not from the model's generation_config.json: both must match the
           # trainer's view of the sampler.
           "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm"]
    if self.max_model_len is not None:
      cmd += ["--max-model-len", str(self.max_model_len)]
    if self.skip_tokenizer_init:
      cmd += ["--skip-tokenizer-init"]
    if not self.chunked_prefill:
      # Without chunking one step must fit a whole max-length prompt.
      with open(os.path.join(self.model_dir, "config.json")) as f:
        context = self.max_model_len or json.load(f).get("max_position_embeddings", 0)
      cmd += ["--no-enable-chunked-prefill", "--max-num-batched-tokens",
              str(max(context, self.max_num_seqs, 8192))]
    return cmd + self.extra_args

  def environment(self) -> dict[str, str]:
    env = dict(os.environ)
    # The trainer's venv must not shadow vLLM's packages.
    for key in ("PYTHONPATH", "VIRTUAL_ENV", "XLA_FLAGS", "JAX_PLATFORMS"):
      env.pop(key, None)
    env["PATH"] = os.path.join(self.venv, "bin") + os.pathsep + env.get("PATH", "")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU
    env["VLLM_CACHE_ROOT"] = os.path.join(self.workdir, "vllm_cache")
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env["VLLM_SERVER_DEV_MODE"] = "1"  # /pause, /collective_rpc, /reset_prefix_cache
    env["VLLM_NO_USAGE_STATS"] = "1"
    env.update(self.extra_env)
    return env

  def start(self) -> VLLMServer:
    """Starts the server, waits for /health, sends one warm-up request."""
    if self.process is not None:
      raise RuntimeError(f"server at {self.base_url} already started")
    env = self.environment()
    rpc_dir = _rpc_dir(env)
    if len(rpc_dir.encode()) + _SOCKET_NAME > _SOCKET_PATH_MAX:
      raise ValueError(
          f"vLLM's engine would put its sockets in {rpc_dir} (the temp dir, or "
          f"VLLM_RPC_BASE_PATH): {len(rpc_dir.encode())} bytes, and a Unix socket path "
          f"holds {_SOCKET_PATH_MAX} with the socket's {_SOCKET_NAME}-byte name; set "
          f"VLLM_RPC_BASE_PATH to a directory of at most "
          f"{_SOCKET_PATH_MAX - _SOCKET_NAME} bytes, e.g. /tmp")
    t0 = time.monotonic()
    with open(self.log_path, "ab") as log:
      self.process = subprocess.Popen(
          self.command(), stdout=log, stderr=subprocess.STDOUT,
          stdin=subprocess.DEVNULL, env=env, cwd=self.workdir,
          start_new_session=True)  # own process group, see stop()
    # From here on a failure (the pid file included) must not leave it running.
    atexit.register(self.stop)
    try:
      with open(self.pid_file, "w") as f:
        f.write(f"{self.process.pid}\n")
      self._wait_healthy()
      self._warm_up()
    except BaseException:
      self.stop()
      raise
    self.startup_s = time.monotonic() - t0
    return self

  def _wait_healthy(self) -> None:
    url = f"{self.base_url}/health"
    deadline = time.monotonic() + self.startup_timeout_s
    while True:
      code = self.process.poll()
      if code is not None:
        raise RuntimeError(
            f"vLLM server for {self.model_dir} exited with code {code} before "
            f"{url} answered; last lines of {self.log_path}:\n{log_tail(self.log_path, lines=40)}")
      try:
        if requests.get(url, timeout=2).status_code == 200:
          return
      except requests.RequestException:
        pass
      if time.monotonic() > deadline:
        raise TimeoutError(
            f"vLLM server for {self.model_dir} did not answer {url} within "
            f"{self.startup_timeout_s:.0f} s; last lines of {self.log_path}:\n"
            f"{log_tail(self.log_path, lines=40)}")
      time.sleep(0.5)

  def _warm_up(self) -> None:
    url = f"{self.base_url}/v1/completions"
    body = {"prompt": [0], "max_tokens": 2, "temperature": 0.0,
            "return_token_ids": True}
    r = requests.post(url, json=body, timeout=120)
    if r.status_code != 200:
      raise RuntimeError(f"warm-up request to {url} failed with HTTP "
                         f"{r.status_code}: {r.text[:500]}")

  def stop(self, grace_s: float = 20.0) -> None:
    """Stops the server's process group (SIGTERM, then SIGKILL). Idempotent."""
    if self.process is None:
      return
    stop_process_group(self.process.pid, grace_s=grace_s)
    try:
      # Bounded: a server stuck in the kernel (a hung GPU driver) outlives SIGKILL,
      # and an unbounded wait here (atexit's too) would keep this process alive.
      self.process.wait(timeout=_KILL_WAIT_S)
      stopped = True
    except subprocess.TimeoutExpired:
      logging.warning("vLLM server pid %d outlived SIGKILL; left running (its pid "
                      "file %s stays, for stop_pid_file)", self.process.pid, self.pid_file)
      stopped = False
    self.process = None
    atexit.unregister(self.stop)
    if not stopped:
      return
    with contextlib.suppress(FileNotFoundError):
      os.remove(self.pid_file)
    if self._own_workdir:
      # Keep the log of a server that failed to start (its path is in the error).
      shutil.rmtree(os.path.join(self.workdir, "vllm_cache"), ignore_errors=True)

  def detach(self) -> int:
    """Leaves the server running after this process exits; returns its pid."""
    if self.process is None:
      raise RuntimeError("server not started")
    atexit.unregister(self.stop)
    pid = self.process.pid
    self.process = None
    return pid

  def __enter__(self) -> VLLMServer:
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()


def stop_pid_file(pid_file: str, *, grace_s: float = 20.0) -> bool:
  """Stops the server whose pid is in `pid_file`; False if there was none."""
  try:
    with open(pid_file) as f:
      pid = int(f.read().strip())
  except FileNotFoundError:
    return False
  except ValueError as e:
    raise ValueError(f"pid file {pid_file} does not hold a pid: {e}") from e
  cmdline = _cmdline(pid)
  if cmdline:  # the API server is alive (a zombie's cmdline is empty)
    if "vllm.entrypoints" not in cmdline:
      raise ValueError(f"pid {pid} from {pid_file} is not a vLLM server ({cmdline[:200]!r}); "
                       f"not stopping it (stale pid file?)")
    stop_process_group(pid, grace_s=grace_s)
  else:
    # The API server is gone, but its EngineCore and Workers may live on in its
    # group. Linux does not hand out `pid` again while a group of that id
    # exists, so a live group `pid` is this server's, or one that a later
    # process reusing the pid started after this one had emptied. vLLM titles
    # its engine processes "VLLM::EngineCore" / "VLLM::Worker": a group with a
    # vLLM process in it is taken to be the server's, any other is left alone.
    members = _group_members(pid)
    if members and not any("vllm" in c.lower() for c in members.values()):
      shown = "; ".join(c.strip() for c in members.values())[:200]
      raise ValueError(f"pid {pid} from {pid_file} is gone and its process group {pid} "
                       f"holds no vLLM process ({shown!r}); not stopping it (stale pid file?)")
    if members:
      stop_process_group(pid, grace_s=grace_s)
  os.remove(pid_file)
  return True
