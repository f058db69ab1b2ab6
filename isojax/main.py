r"""Trains one budget point: `python -m isojax.main --config=FILE[:ARGS] --workdir=DIR`.

  python -m isojax.main --config=experiments/tiny.py:bp=8,n=4,budget=2048 --workdir=/tmp/isojax/tiny

Any config field is overridable (`--config.rl.kl_coef=0`). Rerunning the same
command resumes from the last checkpoint; a finished run is not rerun.
JAX_COMPILATION_CACHE_DIR (which launch/sweep.py sets for its runs) shares compiled
steps between runs: points with the same batch shape compile once.

`--dry_run` compiles the update step from shapes only (no weights are loaded,
nothing is trained or written), prints its memory per device and whether it
fits `--device_memory_gib`, and exits 0; `--dry_run_devices=8` compiles it for
the mesh of 8 devices on a machine with fewer (as 8 CPU devices).
"""

import os
import signal
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from isojax import errors, run_config


class _NoneOr(flags.ArgumentParser):
  """A number field's command-line parser that also reads None: the off value of
  optional settings (`--config.rl.tis_cap=None` turns truncated IS off)."""

  def __init__(self, parser: flags.ArgumentParser):
    super().__init__()
    self._parser = parser

  def parse(self, argument):
    if isinstance(argument, str) and argument.strip().lower() == "none":
      return None
    return self._parser.parse(argument)

  def flag_type(self):
    return self._parser.flag_type()


config_flags.register_flag_parser_for_type(float, _NoneOr(flags.FloatParser()))
config_flags.register_flag_parser_for_type(int, _NoneOr(flags.IntegerParser()))

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment file and its argument, e.g. experiments/tiny.py:bp=8",
    lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (created if missing).")
_DRY_RUN = flags.DEFINE_bool(
    "dry_run", False, "Only compile the update step from shapes and print its memory per "
    "device; trains nothing and writes no run directory.")
_DEVICE_MEMORY_GIB = flags.DEFINE_float(
    "device_memory_gib", 80.0, "Memory of one accelerator, for --dry_run's verdict.")
_DRY_RUN_DEVICES = flags.DEFINE_integer(
    "dry_run_devices", None, "With --dry_run: compile on this many CPU devices, for the "
    "mesh of a run's GPUs on a machine without them (mesh.fsdp=-1 then fills them); "
    "default: this machine's devices.", lower_bound=1)
flags.register_validator("device_memory_gib", lambda gib: gib > 0,
                         message="--device_memory_gib must be > 0 (GiB of one accelerator)")
flags.mark_flags_as_required(["config"])


def main(argv):
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments: {argv[1:]} (flags are written --name=value)")
  logging.set_verbosity(logging.INFO)
  for path, value in config_flags.get_override_values(flags.FLAGS["config"]).items():
    if value is None:
      run_config.check_none_override(_CONFIG.value, path)
  if _DRY_RUN.value:
    from isojax import memory  # after flag parsing: keeps `--help` fast
    if _DRY_RUN_DEVICES.value is not None:
      memory.use_cpu_devices(_DRY_RUN_DEVICES.value)
    mem, what = memory.dry_run(_CONFIG.value, _DRY_RUN_DEVICES.value)
    print(f"update step: B={what['batch']} x T={what['seq_len']}, micro-batch "
          f"{what['micro_batch']}, mesh {what['mesh']}, {what['params'] / 1e6:.2f}M parameters")
    print(mem.report(_DEVICE_MEMORY_GIB.value))
    return
  if not (_WORKDIR.value or "").strip():
    # An unset shell variable (`--workdir=$WD`) must not train into the cwd.
    raise ValueError("flag --workdir is required (the run directory), unless --dry_run"
                         + ("; it was given empty" if _WORKDIR.value is not None else ""))
  from isojax import run  # after flag parsing, like memory: JAX loads only for work
  run.run(_CONFIG.value, _WORKDIR.value)


_VERBOSE = flags.DEFINE_bool(
    "verbose", False, "On an error isojax raises on purpose (bad config, data, budget, "
    "model, server, full disk), print the traceback too; without it, one line naming "
    "the input, and exit status 2.")


def _exit_on_sigterm(signum, frame):
  # SystemExit unwinds through the run's `finally` blocks (temp weight snapshots,
  # open files), which the default SIGTERM action would skip.
  del frame
  sys.exit(128 + signum)


def main_reporting_errors(argv):
  """`main`, with an expected error printed as one line and exit status 2."""
  signal.signal(signal.SIGTERM, _exit_on_sigterm)
  try:
    main(argv)
  except Exception as e:  # pylint: disable=broad-except
    if not errors.is_expected(e):
      raise
    code = errors.report(e, "isojax.main", verbose=_VERBOSE.value)
    # The run's own clean-up has run; what is left of interpreter shutdown is the
    # checkpoint library's threads printing tracebacks (one per write a full disk
    # refused; "Event loop is closed" after a damaged checkpoint was named), which
    # would bury the message above.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # pylint: disable=protected-access


def _parse_flags(argv):
  """absl's flag parsing, with a bad experiment argument or an override naming no
  config field reported in one line (exit 2) instead of a chained traceback."""
  try:
    rest = flags.FLAGS(argv)
    _CONFIG.value.keys()  # a config that failed to load raises on first use
    return rest
  except OSError as e:  # ml_collections defers a missing experiment file to here
    lines = [x.strip() for x in str(e).strip().splitlines() if x.strip()]
    what = f"--config: cannot load the experiment file: {lines[-1]}"
  except flags.Error as e:
    # ml_collections embeds the experiment file's traceback in the message: keep
    # its first line (which flag) and last line (what was wrong).
    lines = [x.strip() for x in str(e).strip().splitlines() if x.strip()]
    what = lines[0] if len(lines) < 2 else f"{lines[0]} {lines[-1]}"
  except (AttributeError, KeyError) as e:  # ml_collections: --config.NO_SUCH_FIELD=...
    # Its message is a repr of a repr: "'\\'max_tokes\\'\\nDid you mean ...".
    text = str(e.args[0] if e.args else e)
    text = " ".join(text.replace("\\n", "\n").replace("\\'", "").replace("'", "").split())
    what = (f"--config: the experiment file defines no get_config(arg) ({text})"
            if "get_config" in text else
            f"a --config.* override names no config field: {text}")
  print(f"isojax.main: error: {what}", file=sys.stderr, flush=True)
  sys.exit(errors.EXIT_USER_ERROR)


if __name__ == "__main__":
  app.run(main_reporting_errors, flags_parser=_parse_flags)
