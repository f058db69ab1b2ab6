r"""Trains one budget point: `python -m isojax.main --config=FILE[:ARGS] --workdir=DIR`.

  python -m isojax.main --config=experiments/tiny.py:bp=8,n=4,budget=2048 --workdir=/tmp/isojax/tiny

Any config field is overridable (`--config.rl.kl_coef=0`). Rerunning the same
command resumes from the last checkpoint; a finished run is not rerun. Set
JAX_COMPILATION_CACHE_DIR to share compiled steps between the runs of a sweep
(points with the same batch shape compile once).

`--dry_run` compiles the update step from shapes only (no weights are loaded,
nothing is trained or written), prints its memory per device and whether it
fits `--device_memory_gib`, and exits 0.
"""

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment file and its argument, e.g. experiments/tiny.py:bp=8",
    lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (created if missing).")
_DRY_RUN = flags.DEFINE_bool(
    "dry_run", False, "Only compile the update step from shapes and print its memory per "
    "device; trains nothing and writes no run directory.")
_DEVICE_MEMORY_GIB = flags.DEFINE_float(
    "device_memory_gib", 80.0, "Memory of one accelerator, for --dry_run's verdict.")
flags.mark_flags_as_required(["config"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.INFO)
  if _DRY_RUN.value:
    from isojax import memory  # after flag parsing: keeps `--help` fast
    mem, what = memory.dry_run(_CONFIG.value)
    print(f"update step: B={what['batch']} x T={what['seq_len']}, micro-batch "
          f"{what['micro_batch']}, mesh {what['mesh']}, {what['params'] / 1e6:.2f}M parameters")
    print(mem.report(_DEVICE_MEMORY_GIB.value))
    return
  if _WORKDIR.value is None:
    raise app.UsageError("flag --workdir is required (the run directory), unless --dry_run")
  from isojax import run
  run.run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
