"""Loading run directories: tolerant of broken runs, and every problem reported."""

import json
import os
import pathlib
import random
import shutil

import numpy as np
import pytest

from isojax.analysis import (RunLoadWarning, analyze, fit_curves, frontier, load_runs,
                             read_runs)
from isojax.analysis.runs import Run, eval_metrics, evaluation_gaps, pass1_histogram

from . import fake_runs


def _rows(bp, n, rewards):
  return [{"step": i + 1, "rollouts": (i + 1) * bp * n, "tokens": (i + 1) * bp * n * 50,
           "train/reward": r, "val/avg@4": r} for i, r in enumerate(rewards)]


@pytest.fixture
def messy_root(tmp_path):
  """A good run, a corrupt line + truncated tail, an empty run, a config-only dir,
  non-finite rewards, a nested budget layout, a bad config and a duplicate step."""
  fake_runs.write_run(tmp_path / "good", {"bp": 8, "n": 4, "m": 3, "seed": 1,
                                          "data": {"difficulty": "easy"}},
                      _rows(8, 4, [0.1, 0.2, 0.3]))
  fake_runs.write_run(tmp_path / "corrupt", {"bp": 8, "n": 8, "m": 4},
                      _rows(8, 8, [0.1, 0.2]),
                      raw_lines=["this is not json\n",
                                 json.dumps(_rows(8, 8, [0, 0, 0.4])[2]) + "\n",
                                 '{"step": 4, "rollouts": 2'])
  fake_runs.write_run(tmp_path / "empty", {"bp": 8, "n": 16}, [])
  os.makedirs(tmp_path / "no_metrics")
  with open(tmp_path / "no_metrics" / "config.json", "w") as f:
    json.dump({"bp": 8, "n": 32}, f)
  nan_rows = _rows(8, 2, [0.1, 0.2, 0.3])
  # NaN / Infinity tokens, as Python's json writes non-finite floats.
  fake_runs.write_run(tmp_path / "nonfinite", {"budget": {"bp": 8, "n": 2, "m": 3,
                                                          "compute": 48}}, [],
                      raw_lines=[json.dumps(nan_rows[0]) + "\n",
                                 json.dumps(nan_rows[1]).replace("0.2", "NaN") + "\n",
                                 json.dumps(nan_rows[2]).replace('"train/reward": 0.3',
                                                                 '"train/reward": Infinity')
                                 + "\n"])
  fake_runs.write_run(tmp_path / "badconfig", {"n": 8}, _rows(8, 8, [0.1]))
  fake_runs.write_run(tmp_path / "sub" / "dup", {"bp": 4, "n": 4},
                      _rows(4, 4, [0.1, 0.2]) + _rows(4, 4, [0.15]))
  return tmp_path


def test_messy_directory_loads_and_reports_each_problem(messy_root):
  result = read_runs(messy_root)
  names = [r.name for r in result.runs]
  assert names == ["corrupt", "good", "nonfinite", "sub/dup"]
  kinds = {(os.path.basename(os.path.dirname(p.path)) if p.path.endswith(".jsonl")
            or p.path.endswith("config.json") else os.path.basename(p.path), p.kind)
           for p in result.problems}
  assert ("corrupt", "corrupt_lines") in kinds
  assert ("empty", "empty") in kinds
  assert ("no_metrics", "no_metrics") in kinds
  assert ("nonfinite", "non_finite") in kinds
  assert ("badconfig", "bad_config") in kinds
  assert ("dup", "duplicate_steps") in kinds
  corrupt = next(p for p in result.problems if p.kind == "corrupt_lines")
  assert "skipped 2 unparseable line(s): 3, 5" in corrupt.detail
  nonfinite = next(p for p in result.problems if p.kind == "non_finite")
  assert "train/reward x2" in nonfinite.detail and "val/avg@4 x1" in nonfinite.detail


def test_run_fields_and_values(messy_root):
  runs = {r.name: r for r in read_runs(messy_root).runs}
  good = runs["good"]
  assert (good.bp, good.n, good.m, good.seed, good.difficulty) == (8, 4, 3, 1, "easy")
  assert good.batch == 32 and good.get("data.difficulty") == "easy"
  assert good.get("missing.key", 5) == 5
  np.testing.assert_array_equal(good.compute("rollouts"), [32, 64, 96])
  np.testing.assert_array_equal(good.compute("steps"), [1, 2, 3])
  np.testing.assert_array_equal(good.compute("tokens"), [1600, 3200, 4800])
  # The corrupt run keeps its valid lines, including the one after the bad line.
  c, r = runs["corrupt"].points("val/avg@4")
  np.testing.assert_array_equal(r, [0.1, 0.2, 0.4])
  # Non-finite values are dropped, finite ones of the same row kept.
  nf = runs["nonfinite"]
  assert (nf.bp, nf.n, nf.m, nf.difficulty) == (8, 2, 3, None)
  c, r = nf.points("val/avg@4")
  np.testing.assert_array_equal(r, [0.1, 0.3])
  assert np.isnan(nf.column("train/reward")[2])
  # A duplicated step keeps its last value.
  np.testing.assert_array_equal(runs["sub/dup"].points("val/avg@4")[1], [0.15, 0.2])


def test_load_runs_warns_with_counts(messy_root):
  with pytest.warns(RunLoadWarning) as record:
    runs = load_runs(messy_root)
  assert len(runs) == 4
  messages = [str(w.message) for w in record]
  assert any("skipped 2 unparseable line(s)" in m for m in messages)
  assert any("no metrics.jsonl" in m for m in messages)


def test_missing_root_and_empty_root(tmp_path):
  with pytest.raises(ValueError, match="does not exist"):
    read_runs(tmp_path / "nope")
  result = read_runs(tmp_path)
  assert result.runs == () and result.problems[0].kind == "no_runs"


def test_messy_directory_analysis_completes(messy_root):
  result = read_runs(messy_root)
  analysis = analyze(list(result.runs), n_boot=0, load_problems=result.problems)
  assert len(analysis.load_problems) == len(result.problems)
  assert analysis.groups  # it ran; curves with too few points are reported
  assert any("not fitted" in p for g in analysis.groups for p in g.problems)


def test_results_do_not_depend_on_directory_creation_order(tmp_path):
  configs = fake_runs.bp8_configs()
  roots = []
  for order_seed in (0, 1):
    root = tmp_path / f"r{order_seed}"
    shuffled = configs[:]
    random.Random(order_seed).shuffle(shuffled)
    for bp, n in shuffled:  # same runs (same noise per config), different order
      fake_runs.make_sweep(root, configs=[(bp, n)], budget=8 * 64 * 500, noise=0.01,
                           rng_seed=n, n_evals=30)
    roots.append(root)
  fits = [fit_curves(read_runs(r).runs, metric="val/avg@4").fits for r in roots]
  assert fits[0] == fits[1]
  f0, f1 = frontier(fits[0]), frontier(fits[1])
  np.testing.assert_array_equal(f0.n_star, f1.n_star)


def test_pass1_histogram_reads_both_layouts():
  np.testing.assert_allclose(pass1_histogram({"train/pass1_hist": [1, 3, 0, 4]}),
                             [0.125, 0.375, 0.0, 0.5])
  flat = {"train/pass@1_hist/0.5": 0.6, "train/pass@1_hist/0.0": 0.4, "step": 3,
          "train/zero_pass_frac": 0.1}
  np.testing.assert_allclose(pass1_histogram(flat), [0.4, 0.6])
  assert pass1_histogram({"step": 1}) is None
  assert pass1_histogram({"train/pass1_hist": [0, 0]}) is None


def test_copies_of_one_run_are_flagged_and_counted_once(tmp_path):
  """The same run (same config, seed included) found twice under the root, e.g. a
  directory copied next to its original: counted once, the copy named."""
  configs = fake_runs.bp8_configs()
  fake_runs.make_sweep(tmp_path / "sweep", configs=configs, budget=8 * 64 * 500,
                       noise=0.01, n_evals=30)
  # An exact copy: the first by name is kept.
  shutil.copytree(tmp_path / "sweep" / "mix_bp8_n16_s0", tmp_path / "zz_backup" / "n16")
  # A copy that stopped earlier: the longer one is kept whatever the names say.
  shutil.copytree(tmp_path / "sweep" / "mix_bp8_n32_s0", tmp_path / "a_partial")
  metrics = tmp_path / "a_partial" / "metrics.jsonl"
  metrics.write_text("".join(metrics.read_text().splitlines(keepends=True)[:10]))
  result = read_runs(tmp_path)
  names = sorted(r.name for r in result.runs)
  assert names == sorted(f"sweep/mix_bp8_n{n}_s0" for _, n in configs)
  dups = {os.path.relpath(p.path, tmp_path): p.detail for p in result.problems
          if p.kind == "duplicate_run"}
  assert set(dups) == {"zz_backup/n16", "a_partial"}
  assert "kept sweep/mix_bp8_n16_s0" in dups["zz_backup/n16"]
  assert "a copy of one run" in dups["a_partial"] and "this one has 10" in dups["a_partial"]
  # Counted once: the fits equal those without the copies.
  alone = fit_curves(read_runs(tmp_path / "sweep").runs, metric="val/avg@4")
  both = fit_curves(result.runs, metric="val/avg@4")
  assert both.fits == alone.fits and both.n_runs == alone.n_runs
  # Different seeds are different runs, not copies.
  fake_runs.make_sweep(tmp_path / "seed1", configs=configs[:1], budget=8 * 64 * 500,
                       seeds=(1,), noise=0.01, n_evals=30)
  assert len(read_runs(tmp_path).runs) == len(configs) + 1
  # The same run at a smaller budget (`launch/sweep.py --budget=A,B`) stops on the
  # longer one's trajectory: one run, not a second seed (both layouts of config.json).
  # The sweep's grid and a vLLM task's port differ between them too.
  for layout in ("top", "budget"):
    for length, budget in (("short", 8 * 64 * 100), ("long", 8 * 64 * 500)):
      (path,) = fake_runs.make_sweep(tmp_path / f"{layout}_{length}", configs=configs[:1],
                                     budget=budget, noise=0.01, n_evals=30, layout=layout)
      config = json.loads((pathlib.Path(path) / "config.json").read_text())
      config["sweep"] = {"budgets": [budget], "study": "n_vs_m"}
      config["sampler"] = {"vllm_url": f"http://127.0.0.1:{budget}", "temperature": 0.6}
      (pathlib.Path(path) / "config.json").write_text(json.dumps(config))
  result = read_runs(tmp_path)
  dups = {os.path.relpath(p.path, tmp_path): p.detail for p in result.problems
          if p.kind == "duplicate_run"}
  for layout in ("top", "budget"):
    assert f"{layout}_short/mix_bp8_n4_s0" not in {r.name for r in result.runs}
    assert ("the same run planned to stop at M=1600 instead of 8000"
            in dups[f"{layout}_short/mix_bp8_n4_s0"])


def test_run_directories_of_older_layouts_still_load_and_analyse(tmp_path):
  """Budget fields nested under "budget" or at top level; no seed, no data section, no
  tokens and no rollouts counter (compute from Bp * n * step): all still analysed."""
  for n in (4, 8, 16, 32):
    m = 8 * 64 * 200 // (8 * n)
    steps = np.unique(np.geomspace(1, m, 25).round().astype(int))
    rows = [{"step": int(s), "val/avg@4": float(fake_runs.true_reward(8, n, s * 8 * n))}
            for s in steps]
    config = {"budget": {"bp": 8, "n": n, "m": m}} if n < 16 else {"bp": 8, "n": n}
    fake_runs.write_run(tmp_path / f"old_n{n}", config, rows)
  result = read_runs(tmp_path)
  assert len(result.runs) == 4 and not [p for p in result.problems if p.kind != "no_eval"]
  analysis = analyze(list(result.runs), n_boot=0)
  from isojax.analysis import fits_dict
  sweep = fits_dict(analysis)["groups"]["all"]["sweeps"][0]
  assert {"compute", "reward", "n_star"} <= set(sweep["frontier"])
  assert sweep["n_star_law"] is not None


def test_device_hours_are_read_from_their_column(tmp_path):
  rows = _rows(8, 4, [0.1, 0.2, 0.3])
  rows[1]["device_hours"], rows[2]["device_hours"] = 0.5, 0.75  # none at row 0
  fake_runs.write_run(tmp_path / "new", {"bp": 8, "n": 4, "seed": 0}, rows)
  fake_runs.write_run(tmp_path / "old", {"bp": 8, "n": 4, "seed": 1}, _rows(8, 4, [0.1]))
  runs = {r.name: r for r in read_runs(tmp_path).runs}  # both load
  np.testing.assert_array_equal(runs["new"].compute("device_hours"), [np.nan, 0.5, 0.75])
  c, v = runs["new"].points("val/avg@4", "device_hours")
  np.testing.assert_array_equal(c, [0.5, 0.75])
  np.testing.assert_array_equal(v, [0.2, 0.3])
  np.testing.assert_array_equal(runs["old"].compute("rollouts"), [32])
  with pytest.raises(ValueError, match=r"run 'old' has no 'device_hours' column in "
                     r".*old.metrics\.jsonl"):
    runs["old"].compute("device_hours")


def test_evaluation_gaps_name_runs_with_nothing_to_fit(tmp_path):
  fake_runs.write_run(tmp_path / "done", {"bp": 8, "n": 4, "m": 2},
                      [{"step": 0, "rollouts": 0, "val/avg@4": 0.1},
                       {"step": 2, "rollouts": 64, "val/avg@4": 0.2}])
  fake_runs.write_run(tmp_path / "started", {"bp": 8, "n": 8, "m": 9},
                      [{"step": 0, "rollouts": 0, "val/avg@4": 0.1},
                       {"step": 1, "rollouts": 64, "train/reward": 0.1}])
  fake_runs.write_run(tmp_path / "diverged", {"bp": 8, "n": 16, "m": 9},
                      [{"step": 1, "rollouts": 128, "val/avg@4": float("nan")}])
  runs = read_runs(tmp_path).runs
  assert evaluation_gaps(runs, "val/avg@4") == [
      "run diverged (Bp=8, n=16): 'val/avg@4' never logged as a finite number; left "
      "out of the fits",
      "run started (Bp=8, n=8): no 'val/avg@4' evaluation after step 0 (a run still "
      "going, or one that stopped); left out of the fits"]
  assert evaluation_gaps(runs, "val/best@4", "tokens") == [
      f"run {name} (Bp=8, n={n}): 'val/best@4' never logged as a finite number; left "
      f"out of the fits" for name, n in (("diverged", 16), ("done", 4), ("started", 8))]


def test_rows_holding_numpy_scalars_are_read():
  # A Run built in a notebook from arrays holds np.int64 / np.float32 values, which
  # are no Python int or float: they read as missing, and fit_curves said the run
  # had no points.
  steps = np.arange(1, 11)
  reward = np.linspace(0.1, 0.6, 10, dtype=np.float32)
  rows = tuple({"step": s, "rollouts": s * 32, "val/avg@4": r, "flag": np.bool_(True)}
               for s, r in zip(steps, reward))
  run = Run(name="nb", path="/nb", bp=8, n=4, m=None, difficulty=None, seed=0,
            config={}, rows=rows)
  compute, value = run.points("val/avg@4")
  np.testing.assert_array_equal(compute, steps * 32.0)
  np.testing.assert_array_equal(value, reward.astype(np.float64))
  assert np.isnan(run.column("flag")).all()  # a boolean is no metric value
  assert 4 in fit_curves([run], metric="val/avg@4").fits
  assert eval_metrics([run]) == ["val/avg@4"]
