"""The main job, launch/demo.py: a smoke run of the whole workflow, and its summaries.

The smoke study (experiments/demo.py SMOKE) trains two tiny points end to end through
the sweep and the analysis; the summary functions are checked on fake run directories
whose ground truth is written from the formula (tests/analysis/fake_runs.py).
"""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests", "analysis"))

from experiments import demo as study  # noqa: E402
from isojax import sweep  # noqa: E402
from launch import demo as driver  # noqa: E402
import fake_runs  # noqa: E402


def _run_demo(root, timeout=600):
  return subprocess.run(
      [sys.executable, os.path.join("launch", "demo.py"), f"--root={root}", "--smoke",
       "--status_every=5"], cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
  root = str(tmp_path_factory.mktemp("demo"))
  first = _run_demo(root)
  assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
  return root, first


def _run_names(root):
  """The run directories under the sweep root (beside them: the shared XLA cache)."""
  entries = sorted(os.listdir(os.path.join(root, "runs")))
  assert sweep.COMPILATION_CACHE_DIR in entries  # the runs shared their compiled programs
  return [e for e in entries if e != sweep.COMPILATION_CACHE_DIR]


def test_smoke_trains_every_point_and_writes_the_report(smoke):
  root, first = smoke
  spec = study.study_spec(smoke=True)
  runs = _run_names(root)
  expected = sorted(f"bp{spec['bp']}_n{n}_m{int(spec['budget']) // (spec['bp'] * n)}_s{s}"
                    for n in spec["n_values"] for s in spec["seeds"])
  assert runs == expected
  for name in runs:
    run_dir = os.path.join(root, "runs", name)
    assert os.path.exists(os.path.join(run_dir, "DONE")), name
    config = json.load(open(os.path.join(run_dir, "config.json")))
    bp, n = config["bp"], config["n"]
    # The √B rule, from the numbers alone.
    want = config["rl"]["lr_base"] * math.sqrt(bp * n / config["rl"]["batch_base"])
    assert config["lr"] == pytest.approx(want, rel=1e-6)
    assert config["budget"]["compute"] == spec["budget"]
    # Every run trains on the one fixed pool the driver wrote.
    assert config["data"]["train"] == os.path.join(root, "data", "problems.jsonl")
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert rows[-1]["rollouts"] == spec["budget"]
    assert sum("val/avg@4" in r for r in rows) >= 2
  report_dir = os.path.join(root, "report")
  fits = json.load(open(os.path.join(report_dir, "fits.json")))
  assert fits["metric"] == "val/avg@4"
  assert os.path.getsize(os.path.join(report_dir, "report.md")) > 0
  out = first.stdout
  assert f"report: {os.path.join(report_dir, 'report.md')}" in out
  assert "progress:" in out or "done   " in out  # the sweep reported how far it was
  assert "per n at matched compute" in out


def test_problem_pool_is_the_documented_one(smoke):
  root, _ = smoke
  data = study.study_spec(smoke=True)["data"]
  rows = [json.loads(line) for line in open(os.path.join(root, "data", "problems.jsonl"))]
  assert len(rows) == data["num"]
  assert len({r["prompt"] for r in rows}) == data["num"]  # a fixed pool, no repeats
  for r in rows:  # answers recomputed here from the prompt
    p = r["prompt"].rstrip("=")
    if p[0] in "RS":
      want = p[1:][::-1] if p[0] == "R" else "".join(sorted(p[1:]))
    else:
      op = next(o for o in "+-*" if o in p)
      a, b = (int(x) for x in p.split(op))
      want = str(a + b if op == "+" else a - b if op == "-" else a * b)
    assert r["answer"] == want, r


def test_rerun_resumes_and_skips_finished_points(smoke):
  root, _ = smoke
  metrics = {name: open(os.path.join(root, "runs", name, "metrics.jsonl")).read()
             for name in _run_names(root)}
  second = _run_demo(root)
  assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
  assert second.stdout.count("already finished") == len(metrics)
  for name, text in metrics.items():
    assert open(os.path.join(root, "runs", name, "metrics.jsonl")).read() == text


def test_summary_fitted_frontier_and_prescriptions_on_known_curves(tmp_path):
  # Ground truth (fake_runs.TRUE_PARAMS): n=4 wins at small C, n=32 at 4e5 rollouts.
  fake_runs.make_sweep(str(tmp_path / "runs"), configs=fake_runs.bp8_configs(),
                       budget=400_000, seeds=(0, 1))
  analysis, runs, report_dir = driver.analyse(str(tmp_path), n_boot=2)
  lines = driver.summary(analysis, runs)
  fitted = next(line for line in lines if line.startswith("fitted frontier"))
  first, last = (int(x) for x in fitted.split("(", 2)[2].split(")")[0].split(" -> "))
  c_small = 8 * 4  # the first evaluation of the n=4 runs (one update)
  truth = {n: fake_runs.true_reward(8, n, 4e5) for n in fake_runs.TRUE_PARAMS}
  assert max(truth, key=truth.get) == 32  # n=16 is 0.03 below it, n=64 0.035
  assert fake_runs.true_reward(8, 4, c_small) > fake_runs.true_reward(8, 8, c_small)
  # Allow one step of fit error at the large end.
  assert first == 4 and last in (16, 32, 64) and "grows with C" in fitted, fitted
  prescribed = [line for line in lines if line.startswith("prescription for C=")]
  # Each with the bootstrap interval of n* that report.md gives it.
  assert prescribed and all("% interval [" in line for line in prescribed), prescribed
  assert os.path.exists(os.path.join(report_dir, "report.md"))


def _shared_grid_sweep(root, ns, *, bp=8, step_c=12_800, evals=32, seeds=(0, 1)):
  """Runs evaluated at the same rollout counts k*step_c (as the demo's are), with
  rewards from the closed-form ground truth."""
  for n in ns:
    for seed in seeds:
      rows = [{"step": 0, "rollouts": 0, "tokens": 0, "val/avg@4": 0.1}]
      for k in range(1, evals + 1):
        c = k * step_c
        rows.append({"step": c // (bp * n), "rollouts": c, "tokens": 100 * c,
                     "val/avg@4": float(fake_runs.true_reward(bp, n, c))})
      m = evals * step_c // (bp * n)
      fake_runs.write_run(os.path.join(root, f"bp{bp}_n{n}_s{seed}"),
                          {"seed": seed, "bp": bp, "n": n, "m": m}, rows)


def test_model_free_finding_names_the_best_n_early_and_late(tmp_path):
  ns, step_c, evals = (4, 8, 16, 32, 64), 12_800, 32
  _shared_grid_sweep(str(tmp_path), ns, step_c=step_c, evals=evals)
  from isojax.analysis import load_runs
  finding = driver.model_free_finding(load_runs(str(tmp_path)), "val/avg@4")
  # Expected from the formula, with the documented windows: C <= C_max/8, C >= 3/4 C_max.
  grid = [k * step_c for k in range(1, evals + 1)]
  early = [c for c in grid if c <= grid[-1] / 8]
  late = [c for c in grid if c >= 0.75 * grid[-1]]
  mean = lambda n, cs: np.mean([fake_runs.true_reward(8, n, c) for c in cs])  # noqa: E731
  best_early = max(ns, key=lambda n: mean(n, early))
  best_late = max(ns, key=lambda n: mean(n, late))
  assert best_late > best_early  # the ground truth's frontier moves
  assert f"best n is {best_early} at C <= {early[-1]:.3g}" in finding, finding
  assert f"and {best_late} at C >= {late[0]:.3g}" in finding, finding
  assert f"n* grows with C ({best_early} -> {best_late})" in finding, finding


def test_matched_compute_table_marks_the_best_mean(tmp_path):
  def curve(bp, n, c):  # n=4 better below 1e4 rollouts, n=16 above
    return np.where(np.asarray(c) < 1e4, 0.5 + 0.01 * (n == 4), 0.5 + 0.01 * (n == 16))

  fake_runs.make_sweep(str(tmp_path / "runs"), configs=[(8, 4), (8, 16)], budget=32_768,
                       curve=curve, seeds=(0, 1), n_evals=200)
  from isojax.analysis import load_runs
  table = driver.matched_compute_table(load_runs(str(tmp_path / "runs")), "val/avg@4")
  rows = [line.split() for line in table.splitlines()[1:]]
  assert rows, table
  for row in rows:
    c, a, b = int(row[0]), row[1], row[2]
    assert (a.endswith("*") if c < 1e4 else b.endswith("*")), table


def test_a_resumed_study_refuses_a_different_pool(tmp_path):
  data = study.study_spec(smoke=True)["data"]
  path = str(tmp_path / "problems.jsonl")
  driver.write_problems(path, data)
  before = open(path).read()
  driver.write_problems(path, data)  # same pool: accepted, file untouched
  assert open(path).read() == before
  with pytest.raises(ValueError, match="holds a different problem pool"):
    driver.write_problems(path, dict(data, seed=data["seed"] + 1))
  assert open(path).read() == before


def test_every_n_is_evaluated_at_the_same_rollout_counts():
  spec = study.study_spec()
  grids = {}
  for n in spec["n_values"]:
    c = study.get_config(f"n={n}")
    m = int(spec["budget"]) // (spec["bp"] * n)
    steps = {s for s in range(1, m + 1) if s % c.eval_every == 0 or s == m}
    steps |= set(c.eval_steps)
    grids[n] = sorted(s * spec["bp"] * n for s in steps)
  first = grids[spec["n_values"][0]]
  assert all(g == first for g in grids.values()), grids
  # 32 evenly spaced evaluations plus log-spaced ones below the first of them.
  assert first[-1] == spec["budget"] and len(first) > 32
  assert first[0] == spec["bp"] * max(spec["n_values"])  # one update of the largest n
