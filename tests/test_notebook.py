"""Executes notebooks/isocompute_quickstart.ipynb top to bottom on the tiny configuration.

The kernel is ipykernel's built-in "python3", which jupyter_client starts with the
interpreter running the tests (sys.executable), so no kernel spec has to be installed.
The notebook trains its own tiny sweep (ISOJAX_RUNS points it at a temporary root, so
a `runs/demo` in the checkout does not change what is tested).
"""

import os
import re
import sys

import pytest

from isojax import sweep

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(REPO, "notebooks", "isocompute_quickstart.ipynb")


def _text(cell) -> str:
  out = []
  for o in cell.get("outputs", []):
    if o.get("output_type") == "stream":
      out.append(o["text"])
    elif "data" in o and "text/plain" in o["data"]:
      out.append(o["data"]["text/plain"])
  return "".join(out)


def test_quickstart_notebook_executes(tmp_path, monkeypatch):
  root = tmp_path / "runs"
  # The kernel inherits this environment: a small study, one CPU device per process.
  monkeypatch.setenv("ISOJAX_RUNS", str(root))
  monkeypatch.setenv("ISOJAX_NOTEBOOK_GRID",
                     "--bp=4 --n=2,4 --budget=48 --max_concurrent=2")
  monkeypatch.setenv("ISOJAX_NOTEBOOK_RUN_ARGS",
                     "--config.eval_every=2 --config.checkpoint_every=6 "
                     "--config.data.num_val=8 --config.eval.num_train=0")
  monkeypatch.setenv("XLA_FLAGS", "")
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  nb = nbformat.read(NOTEBOOK, as_version=4)
  client = nbclient.NotebookClient(
      nb, timeout=600, kernel_name="python3",
      resources={"metadata": {"path": os.path.join(REPO, "notebooks")}})
  client.execute()  # raises CellExecutionError (with the cell's traceback) on failure

  code = [c for c in nb.cells if c.cell_type == "code"]
  assert "IN_COLAB" in code[0].source and "google.colab" in code[0].source
  text = "\n".join(_text(c) for c in code)
  # The notebook ran in this interpreter, from the repository root.
  assert f"repository: {REPO}" in text and f"python: {sys.executable}" in text
  # It trained the two points of the grid with the launcher and loaded them.
  runs = sorted(set(os.listdir(root)) - {sweep.COMPILATION_CACHE_DIR})
  assert runs == ["bp4_n2_m6_s0", "bp4_n4_m3_s0"]
  assert all(os.path.exists(root / d / "DONE") for d in runs)
  assert "2 runs; metric: val/avg@4" in text
  # The fitting functions recover the known curve and n* law of section 2.
  fitted = re.search(r"fitted: r0=(\S+) a=(\S+) c_mid=(\S+) b=(\S+) ", text)
  r0, a, c_mid, b = map(float, fitted.groups())
  assert abs(r0 - 0.2) < 0.02 and abs(a - 0.7) < 0.02 and abs(b - 1.3) < 0.15
  assert abs(c_mid / 3e4 - 1) < 0.1
  law = re.search(r"n\* law: L=(\S+) k=(\S+) x0=(\S+) b=(\S+) ", text)
  assert [round(float(v)) for v in law.groups()] == [8, 2, 6, 2]
  # Figures are shown inline (at least the records plot).
  images = [o for c in code for o in c.get("outputs", [])
            if "image/png" in o.get("data", {})]
  assert images, "no inline figure"
  # The hand-made update: Bp=4 x n=8 rollouts, a batch of 32 rows, the step's metrics.
  assert "rewards per problem (Bp x n)" in text
  assert "batch input_ids_BxT: (32, " in text
  assert "loss" in text
