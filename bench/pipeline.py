"""PipelineRL-k overlap: completions/s of the tiny config for k in {0, 1, 4, 8}.

Each k runs `isojax.run.run` on experiments/tiny.py (bp=8, n=16: B = 128, M = 16
updates by default, no evals or checkpoints but the last) with the JAX sampler
and, when $VLLM_VENV names a vLLM CPU virtualenv, with a vLLM server. An
iteration's time is read from the run itself: the median per-update growth of
metrics.jsonl's device_hours over the devices (evals and the compiling first
update excluded).
The k = 0 run also times its two halves, sampling a batch (S) and updating on
it (U), so each line prints the iteration time against max(S, U), what full
overlap would give, and S + U, what no overlap gives; the goal is <= 1.2 x max.

    python bench/pipeline.py                    # JAX sampler, k in {0, 1, 4, 8}
    python bench/pipeline.py --updates 8        # a quicker run
    VLLM_VENV=$PWD/.venv-vllm python bench/pipeline.py   # adds the vLLM CPU server

On a CPU the sampler and the update share the same cores (and the vLLM server
its process's), so they can overlap only where each leaves cores idle; the
overlap the pipeline is for needs separate devices, e.g. a vLLM server on its
own GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # pylint: disable=g-import-not-at-top
from experiments import tiny  # pylint: disable=g-import-not-at-top
from isojax import assets, run, run_batches  # pylint: disable=g-import-not-at-top
from isojax.rundir import METRICS_FILE  # pylint: disable=g-import-not-at-top

LAGS = (0, 1, 4, 8)
BATCH = 128  # bp=8 x n=16


def config_for(max_lag: int, updates: int, backend: str, url: str = ""):
  c = tiny.get_config(f"bp=8,n=16,budget={BATCH * updates}")
  c.rl.pipeline.max_lag = max_lag
  c.sampler.decode_chunk = 2 if max_lag else 0  # the tiny study's 8 tokens: 4 chunks
  if max_lag:
    c.rl.clip_high = 0.28  # stale batches: the clips act (ScaleRL's asymmetric ones)
  c.eval_every = c.checkpoint_every = 10 ** 6  # only the last step's
  c.eval.num_train = 0
  c.sampler.backend = backend
  if url:
    c.sampler.vllm_url = url
  return c


class Halves:
  """Times `sample_batch` and `update_on` in the synchronous loop (k = 0)."""

  def __init__(self):
    self.sample_s, self.update_s = [], []

  def __enter__(self):
    self._sample, self._update = run_batches.sample_batch, run.update_on

    def sample(*a, **kw):
      t = time.perf_counter()
      out = self._sample(*a, **kw)
      self.sample_s.append(time.perf_counter() - t)
      return out

    def update(*a, **kw):
      t = time.perf_counter()
      out = self._update(*a, **kw)
      self.update_s.append(time.perf_counter() - t)
      return out

    run_batches.sample_batch, run.update_on = sample, update
    return self

  def __exit__(self, *exc):
    run_batches.sample_batch, run.update_on = self._sample, self._update


def iteration_seconds(workdir: pathlib.Path, devices: int) -> float:
  """The median update's wall-clock seconds, from the run's own ledger (the
  per-step growth of device_hours; the first update, which compiles, excluded)."""
  hours = [json.loads(line)["device_hours"]
           for line in (workdir / METRICS_FILE).read_text().splitlines()]
  return statistics.median(3600 * (b - a) / devices for a, b in zip(hours[1:], hours[2:]))


def bench(backend: str, updates: int, root: pathlib.Path, url: str = "", devices: int = 1):
  print(f"\n{backend} sampler, B = {BATCH} rollouts x {updates} updates:")
  warm = config_for(0, 2, backend, url)  # compiles every shape once
  run.run(warm, root / f"{backend}_warm")
  rows = {}
  for k in LAGS:
    workdir = root / f"{backend}_k{k}"
    if k == 0:
      with Halves() as halves:
        run.run(config_for(k, updates, backend, url), workdir)
      # The first batch and update compile; medians of the rest.
      s = statistics.median(halves.sample_s[1:])
      u = statistics.median(halves.update_s[1:])
    else:
      run.run(config_for(k, updates, backend, url), workdir)
    iteration = iteration_seconds(workdir, devices)
    rows[k] = (iteration, BATCH / iteration)
  print(f"  halves (k = 0): sample S = {s * 1e3:.0f} ms, update U = {u * 1e3:.0f} ms per batch; "
        f"max(S, U) = {max(s, u) * 1e3:.0f} ms, S + U = {(s + u) * 1e3:.0f} ms")
  for k, (iteration, per_s) in rows.items():
    print(f"  k = {k}: {per_s:7.1f} completions/s, iteration {iteration * 1e3:6.0f} ms "
          f"= {iteration / max(s, u):.2f} x max(S, U), {iteration / (s + u):.2f} x (S + U)")


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--updates", type=int, default=16)
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as tmp:
    root = pathlib.Path(tmp)
    bench("jax", args.updates, root, devices=jax.device_count())
    if not os.environ.get("VLLM_VENV"):
      print("\nvllm: skipped (set VLLM_VENV to a vLLM CPU virtualenv, e.g. built by "
            "launch/setup_vllm_venv.sh, to include it)")
      return
    from isojax.rollout.vllm_server import VLLMServer  # pylint: disable=g-import-not-at-top
    t0 = time.time()
    with VLLMServer(str(assets.BASE_MODEL_DIR), dtype="float32", max_num_seqs=256,
                    extra_args=["--enforce-eager"], workdir=str(root / "server"),
                    startup_timeout_s=600) as server:
      print(f"\nvLLM server up in {time.time() - t0:.0f} s")
      bench("vllm", args.updates, root, url=server.base_url, devices=jax.device_count())


if __name__ == "__main__":
  main()
