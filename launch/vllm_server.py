"""Start or stop a local vLLM server for an HF model directory.

    # foreground: serve until Ctrl-C / SIGTERM, then stop the server's process group
    python launch/vllm_server.py --model runs/x/base --port 8000

    # background: start, wait until healthy and warmed up, print the URL, exit
    python launch/vllm_server.py --model DIR --pid-file /tmp/vllm.pid --detach
    python launch/vllm_server.py --stop --pid-file /tmp/vllm.pid

    # extra vLLM flags go after `--`
    python launch/vllm_server.py --model DIR -- --enforce-eager

The vLLM virtualenv comes from --venv, else $VLLM_VENV, else <repo>/.venv-vllm
(build it with `bash launch/setup_vllm_venv.sh`). The server binds 127.0.0.1 by
default: it runs with VLLM_SERVER_DEV_MODE=1, whose endpoints (/collective_rpc)
can run arbitrary worker methods, so never expose it beyond loopback unless the
network is trusted. In Python use `isojax.rollout.vllm_server.VLLMServer` (a
context manager) instead.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from isojax.rollout.vllm_server import VLLMServer, stop_pid_file

__all__ = ["VLLMServer", "main"]


def _parse(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", help="HF-format model directory to serve")
  p.add_argument("--venv", default=None, help="vLLM virtualenv ($VLLM_VENV)")
  p.add_argument("--host", default="127.0.0.1",
                 help="bind address (dev-mode endpoints: keep it on loopback)")
  p.add_argument("--port", type=int, default=None, help="default: a free port")
  p.add_argument("--dtype", default="auto", help="float32 | bfloat16 | auto")
  p.add_argument("--max-model-len", type=int, default=None)
  p.add_argument("--max-num-seqs", type=int, default=512)
  p.add_argument("--skip-tokenizer-init", action="store_true",
                 help="serve a directory without tokenizer files (token ids only)")
  p.add_argument("--workdir", default=None, help="log, pid file and vLLM cache")
  p.add_argument("--pid-file", default=None)
  p.add_argument("--startup-timeout", type=float, default=300.0)
  p.add_argument("--detach", action="store_true",
                 help="leave the server running and exit once it is ready")
  p.add_argument("--stop", action="store_true", help="stop the server in --pid-file")
  p.add_argument("extra", nargs="*", help="after --: more vLLM api_server flags")
  args = p.parse_args(argv)
  if args.stop and not args.pid_file:
    p.error("--stop needs --pid-file")
  if not args.stop and not args.model:
    p.error("--model is required")
  if args.detach and not args.pid_file:
    p.error("--detach needs --pid-file (to stop the server later)")
  return args


def main(argv=None) -> int:
  args = _parse(sys.argv[1:] if argv is None else argv)
  if args.stop:
    stopped = stop_pid_file(args.pid_file)
    print(f"stopped server from {args.pid_file}" if stopped
          else f"no pid file at {args.pid_file}; nothing to stop")
    return 0
  if args.host not in ("127.0.0.1", "localhost", "::1"):
    print(f"WARNING: binding {args.host}: dev-mode endpoints (/collective_rpc) can run "
          "arbitrary worker methods; expose them only on a trusted network",
          file=sys.stderr)
  server = VLLMServer(args.model, venv=args.venv, host=args.host, port=args.port,
                      dtype=args.dtype, max_model_len=args.max_model_len,
                      max_num_seqs=args.max_num_seqs,
                      skip_tokenizer_init=args.skip_tokenizer_init,
                      extra_args=args.extra, workdir=args.workdir,
                      pid_file=args.pid_file, startup_timeout_s=args.startup_timeout)
  server.start()
  print(f"vLLM server ready at {server.base_url} (pid {server.process.pid}, "
        f"log {server.log_path}, started in {server.startup_s:.1f} s)", flush=True)
  if args.detach:
    server.detach()
    return 0
  done = threading.Event()
  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, lambda *_: done.set())
  try:
    while not done.wait(1.0):
      if server.process.poll() is not None:
        print(f"vLLM server exited with code {server.process.returncode}; see "
              f"{server.log_path}", file=sys.stderr)
        return 1
  finally:
    server.stop()
  return 0


if __name__ == "__main__":
  sys.exit(main())
