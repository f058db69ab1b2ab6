"""End to end: python -m isojax.analysis RUNS_DIR --out REPORT_DIR."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from isojax.analysis import compare_recipes, fit_curves, plots, read_runs
from isojax.analysis import report
from isojax.analysis.__main__ import main
from tests.file_limits import files_capped_at

from . import fake_runs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory):
  root = tmp_path_factory.mktemp("cli_runs")
  configs = fake_runs.bp8_configs() + [(16, 8), (16, 32), (32, 4), (4, 64)]
  fake_runs.make_sweep(root, configs=configs, budget=8 * 64 * 1000, seeds=(0, 1),
                       noise=0.01, run_sigma=0.005, rho=0.5, n_evals=40, difficulty="easy",
                       hist_bins=10)
  fake_runs.write_run(root / "crashed", {"bp": 8, "n": 16, "data": {"difficulty": "easy"}},
                      [{"step": 1, "rollouts": 128, "val/avg@4": 0.1}],
                      raw_lines=['{"step": 2, "rollo'])
  os.makedirs(root / "never_started")
  with open(root / "never_started" / "config.json", "w") as f:
    json.dump({"bp": 8, "n": 4}, f)
  fake_runs.write_run(root / "diverged", {"bp": 8, "n": 32, "data": {"difficulty": "easy"}},
                      [{"step": 1, "rollouts": 256, "val/avg@4": 0.1},
                       {"step": 2, "rollouts": 512, "val/avg@4": float("nan")}])
  shutil.copytree(root / "easy_bp8_n16_s1", root / "zz_copy" / "easy_bp8_n16_s1")
  return root


@pytest.fixture(scope="module")
def report_dir(runs_dir, tmp_path_factory):
  out = tmp_path_factory.mktemp("report")
  assert main([str(runs_dir), "--out", str(out), "--n-boot", "12",
               "--budgets", "2e4,5e5,5e6"]) == 0
  return out


def test_writes_report_fits_and_figures(report_dir):
  files = set(os.listdir(report_dir))
  assert {"report.md", "fits.json"} <= files
  for prefix in ("fig5_", "fig6_", "fig7_", "fig9_", "fig10_", "fig11_", "extrapolation_"):
    pngs = [f for f in files if f.startswith(prefix) and f.endswith(".png")]
    assert pngs, prefix
    for f in pngs:
      with open(report_dir / f, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
      assert os.path.getsize(report_dir / f) > 10_000


def test_report_lists_law_prescriptions_and_problems(report_dir):
  md = (report_dir / "report.md").read_text()
  for text in ("n*(C) law", "Frontier", "Prescriptions", "| 5e+06 |", "Fixed batch",
               "Sensitivity", "Extrapolation check", "unparseable line", "no metrics.jsonl",
               "non-finite", "tie tolerance 0", "record-breaking points per run",
               "running average of n* over 0.5 decades (Fig. 7)",
               "From the joint (Bp, n, M) study's n*(C) law (App. C)",
               "[duplicate_run] same config and seed (1) as easy_bp8_n16_s1"):
    assert text in md, text


def test_fits_json_has_full_precision_and_intervals(report_dir, runs_dir):
  fits = json.loads((report_dir / "fits.json").read_text())
  group = fits["groups"]["easy"]
  primary = next(s for s in group["sweeps"] if s["primary"])
  assert primary["label"] == "bp=8" and primary["unit"] == "rollouts"
  # Independent recomputation on the same runs gives bit-identical parameters.
  runs = [r for r in read_runs(runs_dir).runs if r.bp == 8]
  ref = fit_curves(runs, metric="val/avg@4").fits
  for n, f in ref.items():
    d = primary["curves"][f"n={n}"]
    assert (d["a"], d["b"], d["c_mid"], d["r0"]) == (f.a, f.b, f.c_mid, f.r0)
    iv = d["interval"]["a"]
    assert iv["n_ok"] > 0 and iv["low"] <= iv["high"]
  law = primary["n_star_law"]
  assert set(law["interval"]) == {"L", "k", "x0", "b"}
  assert fits["options"] == {"records": "per run", "bin_width": 0.005, "tie_tol": 0.0,
                             "law_points": "running_average", "law_window_decades": 0.5}
  points = primary["law_points"]
  assert points["method"] == "running_average" and len(points["compute"]) == 200
  assert {"compute", "reward", "n_star"} <= set(primary["frontier"])
  # Bp=8 and Bp=16 were each run at several n: a joint study, so its law prescribes,
  # at the smallest Bp of the study (4; none of its runs was unstable).
  assert group["prescription_law"]["label"] == "joint"
  assert group["prescription_law"]["joint"] is True and group["prescription_law"]["bp"] == 4
  assert [p["budget"] for p in group["prescriptions"]] == [2e4, 5e5, 5e6]
  assert [p["law"] for p in group["prescriptions"]] == ["joint"] * 3
  assert group["prescriptions"][2]["extrapolated"] is True
  # The one-point "crashed" and "diverged" runs are third seeds of (8, 16) and (8, 32),
  # both on the joint frontier: a resample that draws one of them twice lacks that
  # curve, and more resamples do than the interval's tail, so n* has no interval and
  # the extrapolation is refused, naming them.
  assert all(p["n_star_interval"] is None for p in group["prescriptions"])
  assert group["prescriptions"][2]["refused"] is True
  assert "Bp=8, n=16 (fitted in" in group["prescriptions"][2]["note"]
  point = group["prescriptions"][1]["point"]
  assert point["bp"] == 4 and point["compute"] <= 5e5
  assert any(s["label"] == "joint" for s in group["sweeps"])
  units = {(s["metric"], s["unit"]) for s in group["sweeps"] if s["label"] == "bp=8"}
  assert units == {("val/avg@4", "rollouts"), ("val/avg@4", "tokens"),
                   ("val/best@4", "rollouts"), ("val/worst@4", "rollouts")}
  assert len(fits["load_problems"]) == 4


def test_module_entry_point_and_failure_status(tmp_path, runs_dir):
  env = dict(os.environ, PYTHONPATH=REPO)
  proc = subprocess.run([sys.executable, "-m", "isojax.analysis", str(tmp_path / "none"),
                         "--out", str(tmp_path / "out")], capture_output=True, text=True,
                        env=env, cwd=REPO, timeout=120)
  assert proc.returncode == 1 and "does not exist" in proc.stderr
  empty = tmp_path / "empty"
  os.makedirs(empty)
  assert main([str(empty), "--out", str(tmp_path / "out2")]) == 1


def test_out_naming_an_existing_file_is_a_message_not_a_traceback(tmp_path, runs_dir):
  taken = tmp_path / "report.md"
  taken.write_text("mine")
  proc = subprocess.run([sys.executable, "-m", "isojax.analysis", str(runs_dir), "--out",
                         str(taken), "--n-boot", "0"], capture_output=True, text=True,
                        env=dict(os.environ, PYTHONPATH=REPO), cwd=REPO, timeout=120)
  assert proc.returncode == 1
  assert "is an existing file, not a directory" in proc.stderr
  assert "Traceback" not in proc.stderr and taken.read_text() == "mine"
  # A file where a parent directory of --out would go: the same kind of message.
  assert main([str(runs_dir), "--out", str(taken / "sub"), "--n-boot", "0"]) == 1


@pytest.mark.parametrize("argv, match", [
    (["--tie-tol", "-1"], "tie_tol must be >= 0"),
    (["--law-window", "0"], "law_window must be > 0"),
    (["--law-window", "inf"], "law_window must be > 0 decades and finite, got inf"),
    (["--bin-width", "inf"], "bin_width must be > 0 and finite, got inf"),
    (["--tie-tol", "nan"], "tie_tol must be >= 0 and finite, got nan"),
    (["--compare-recipes", "--tolerance", "inf"], "tolerance must be > 0 and finite"),
])
def test_bad_frontier_options_are_messages(tmp_path, runs_dir, capsys, argv, match):
  assert main([str(runs_dir), "--out", str(tmp_path / "o"), "--n-boot", "0", *argv]) == 1
  assert match in capsys.readouterr().err


def test_importing_analysis_does_not_import_jax():
  code = ("import isojax.analysis, sys; "
          "bad = [m for m in ('jax', 'flax', 'optax', 'transformers', 'torch') "
          "if m in sys.modules]; assert not bad, bad")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        env=dict(os.environ, PYTHONPATH=REPO), cwd=REPO, timeout=120)
  assert proc.returncode == 0, proc.stderr


def test_readme_analysis_command_and_snippet(readme, tmp_path):
  """README's "Analysing runs": its command and its Python, on a fake Bp=8 sweep."""
  runs = tmp_path / "tiny"
  fake_runs.make_sweep(runs, configs=fake_runs.bp8_configs(), budget=8 * 64 * 1000,
                       seeds=(0,), noise=0.005, n_evals=24, difficulty="easy")
  argv = readme.argv(readme.command("python -m isojax.analysis runs/tiny"),
                     {"runs/tiny": str(runs)})
  proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=600,
                        env=dict(os.environ, PYTHONPATH=REPO))
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert {"report.md", "fits.json"} <= set(os.listdir(runs / "report"))

  snippet = readme.python("plan(").replace('"runs/tiny"', repr(str(runs)))
  assert repr(str(runs)) in snippet
  *body, last = snippet.strip().splitlines()  # the last line is the prescription
  namespace = {}
  exec(compile("\n".join(body), "README.md", "exec"), namespace)  # pylint: disable=exec-used
  point = eval(last.split("#")[0], namespace)  # pylint: disable=eval-used
  # The fake sweep's n* grows with C (4 -> 64), so a budget past its end picks a large n.
  assert point.bp == 32 and point.n >= 16 and point.bp * point.n * point.m <= 2e6


def test_compare_recipes_writes_the_table_fits_and_figure(recipe_runs, tmp_path, capsys):
  out = tmp_path / "report"
  assert main([str(recipe_runs), "--out", str(out), "--compare-recipes", "--unit",
               "device_hours", "--n-boot", "20", "--seed", "3"]) == 0
  assert "from 9 runs" in capsys.readouterr().out
  assert sorted(os.listdir(out)) == ["fits.json", "recipes_device_hours.png", "report.md"]
  with open(out / "recipes_device_hours.png", "rb") as fh:
    assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
  ref = compare_recipes(read_runs(recipe_runs).runs, unit="device_hours", n_boot=20,
                        seed=3)
  md = (out / "report.md").read_text()
  assert ref.to_markdown() in md and "# isojax recipe comparison" in md
  assert "## Frontier" not in md  # runs of different recipes are not seeds of one n
  fits = json.loads((out / "fits.json").read_text())
  assert fits["unit"] == "device_hours" and fits["root"] == str(recipe_runs)
  for r in ref.recipes:
    got = fits["recipes"][r.label]
    assert (got["fit"]["a"], got["fit"]["b"], got["fit"]["c_mid"]) == (
        r.fit.a, r.fit.b, r.fit.c_mid)
    assert got["interval"]["a"]["low"] == r.intervals["a"].low
    assert got["extrapolation"]["passed"] is True


def test_compare_recipes_failures_are_messages(recipe_runs, tmp_path, capsys):
  old = tmp_path / "old"
  fake_runs.make_recipes(old, {"pipeline": fake_runs.RECIPES["pipeline"]},
                         budget=8 * 16 * 400, seeds=(0,), device_hours=False)
  assert main([str(old), "--out", str(tmp_path / "o"), "--compare-recipes", "--unit",
               "device_hours"]) == 1
  err = capsys.readouterr().err
  assert "run 'pipeline_s0' has no 'device_hours' column" in err
  assert main([str(old), "--out", str(tmp_path / "o"), "--compare-recipes",
               "--group-by", "rl.nothing", "--n-boot", "0"]) == 1
  assert "no config field 'rl.nothing'" in capsys.readouterr().err
  # A metric no run logs is named, as without --compare-recipes, and nothing is written.
  assert main([str(old), "--out", str(tmp_path / "m"), "--compare-recipes",
               "--metric", "val/aime/avg@4", "--n-boot", "0"]) == 1
  assert "--metric 'val/aime/avg@4' is logged by none of the runs" in capsys.readouterr().err
  assert not (tmp_path / "m").exists()
  for argv, match in ((["--unit", "tokens"], "--unit: only used with --compare-recipes"),
                      (["--compare-recipes", "--tie-tol", "0.01", "--bp", "8"],
                       "--tie-tol, --bp: frontier options, not used with "
                       "--compare-recipes")):
    with pytest.raises(SystemExit):
      main([str(recipe_runs), "--out", str(tmp_path / "o"), *argv])
    assert match in capsys.readouterr().err


def test_readme_recipe_command_and_snippet(readme, tmp_path):
  """README's "Comparing recipes": its command and its Python, on fake recipes."""
  runs = tmp_path / "scalerl"
  fake_runs.make_recipes(runs, fake_runs.RECIPES, budget=8 * 16 * 2000, seeds=(0, 1),
                         noise=0.005, n_evals=30)
  argv = readme.argv(readme.command("python -m isojax.analysis runs/scalerl"),
                     {"runs/scalerl": str(runs)})
  proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=600,
                        env=dict(os.environ, PYTHONPATH=REPO))
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = (runs / "report" / "report.md").read_text()
  assert "C_mid (device_hours)" in report and report.count("| pass |") == 3

  snippet = readme.python("compare_recipes(").replace('"runs/scalerl"', repr(str(runs)))
  assert repr(str(runs)) in snippet
  *body, last = snippet.strip().splitlines()
  namespace = {}
  exec(compile("\n".join(body), "README.md", "exec"), namespace)  # pylint: disable=exec-used
  passed = eval(last.split("#")[0], namespace)  # pylint: disable=eval-used
  assert passed == {label: True for label in fake_runs.RECIPES}


def test_metric_of_a_named_validation_set(tmp_path):
  # Runs with a second validation set "ood" whose reward is 0.6x the primary's:
  # --metric val/ood/avg@4 fits that set's curves and frontier.
  root = tmp_path / "runs"
  fake_runs.make_sweep(root, configs=fake_runs.bp8_configs(), budget=8 * 64 * 2000,
                       n_evals=60, difficulty="easy")
  for d in os.listdir(root):
    path = root / d / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for r in rows:
      for m in ("avg@4", "best@4", "worst@4"):
        r[f"val/ood/{m}"] = 0.6 * r[f"val/{m}"]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  out = tmp_path / "ood"
  assert main([str(root), "--out", str(out), "--n-boot", "0",
               "--metric", "val/ood/avg@4"]) == 0
  fits = json.loads((out / "fits.json").read_text())
  primary = next(s for s in fits["groups"]["easy"]["sweeps"] if s["primary"])
  assert primary["metric"] == "val/ood/avg@4"
  for n, p in fake_runs.TRUE_PARAMS.items():
    assert primary["curves"][f"n={n}"]["a"] == pytest.approx(0.6 * p["a"], abs=0.02)
  assert "val/ood/avg@4" in (out / "report.md").read_text()
  # A set no run logged is named, with the metrics the runs do log.
  assert main([str(root), "--out", str(tmp_path / "x"), "--n-boot", "0",
               "--metric", "val/aime/avg@4"]) == 1


def test_unknown_metric_lists_the_logged_ones(tmp_path, runs_dir, capsys):
  assert main([str(runs_dir), "--out", str(tmp_path / "o"), "--n-boot", "0",
               "--metric", "val/ood/avg@4"]) == 1
  err = capsys.readouterr().err
  assert "--metric 'val/ood/avg@4' is logged by none of the runs" in err
  assert "'val/avg@4'" in err


def _unfinished_sweep(root):
  """Bp=8 at n = 4, 8, 16 fully evaluated; n=32 evaluated only at step 0 (a run still
  going); n=64 with val/avg@4 NaN at every evaluation (a diverged run)."""
  fake_runs.make_sweep(root, configs=[(8, 4), (8, 8), (8, 16)], budget=8 * 64 * 500,
                       n_evals=25)
  fake_runs.write_run(root / "live_n32", {"bp": 8, "n": 32, "m": 1000},
                      [{"step": 0, "rollouts": 0, "tokens": 0, "val/avg@4": 0.1},
                       {"step": 1, "rollouts": 256, "tokens": 25600,
                        "train/reward": 0.1}])
  rows = fake_runs.run_rows(8, 64, 500, lambda c: fake_runs.true_reward(8, 64, c),
                            n_evals=25)
  fake_runs.write_run(root / "nan_n64", {"bp": 8, "n": 64, "m": 500},
                      [{**row, "val/avg@4": float("nan")} for row in rows])


def test_unevaluated_configurations_are_problems_not_a_crash(tmp_path):
  _unfinished_sweep(tmp_path / "runs")
  out = tmp_path / "report"
  assert main([str(tmp_path / "runs"), "--out", str(out), "--n-boot", "0"]) == 0
  files = set(os.listdir(out))
  for prefix in ("fig5_records", "fig6_frontier", "fig7_nstar"):
    assert any(f.startswith(prefix) for f in files), prefix
  md = (out / "report.md").read_text()
  assert "### Frontier" in md and "### n*(C) law" in md
  assert "run live_n32 (Bp=8, n=32): no 'val/avg@4' evaluation after step 0" in md
  assert "run nan_n64 (Bp=8, n=64): 'val/avg@4' never logged as a finite number" in md
  assert "n=32 not fitted" in md and "n=64 not fitted" in md
  fits = json.loads((out / "fits.json").read_text())
  primary = next(s for s in fits["groups"]["all"]["sweeps"] if s["primary"])
  assert set(primary["curves"]) == {"n=4", "n=8", "n=16"}


def test_a_report_of_only_unevaluated_runs_still_lists_its_problems(tmp_path):
  root = tmp_path / "runs"
  fake_runs.write_run(root / "live_n4", {"bp": 8, "n": 4, "m": 100},
                      [{"step": 0, "rollouts": 0, "val/avg@4": 0.1},
                       {"step": 1, "rollouts": 32, "train/reward": 0.1}])
  out = tmp_path / "report"
  assert main([str(root), "--out", str(out), "--n-boot", "0"]) == 0
  md = (out / "report.md").read_text()
  assert "run live_n4 (Bp=8, n=4): no 'val/avg@4' evaluation after step 0" in md


def test_an_analysis_failing_part_way_leaves_no_stale_report(runs_dir, tmp_path,
                                                             monkeypatch):
  out = tmp_path / "report"
  os.makedirs(out)
  # Earlier analyses drew groups this one does not have (one of them failed before
  # its report.md); the user keeps files of their own.
  (out / "report.md").write_text("# an earlier analysis")
  (out / "fits.json").write_text("{}")
  for name in ("fig7_nstar_hard.png", "fig11_pass1_hist_hard.png", "recipes_rollouts.png",
               "notes.png", "fig7_notes.txt"):
    (out / name).write_bytes(b"\x89PNG")

  def broken(*args, **kwargs):
    raise RuntimeError("a bug in a figure")

  monkeypatch.setattr(plots, "plot_records", broken)
  with pytest.raises(RuntimeError, match="a bug in a figure"):  # a bug still surfaces
    main([str(runs_dir), "--out", str(out), "--n-boot", "0"])
  assert set(os.listdir(out)) == {"notes.png", "fig7_notes.txt"}


def test_a_report_cut_short_by_a_full_disk_leaves_no_partial_file(tmp_path):
  fits = {"groups": [{"n": n, "a": 0.5} for n in range(200)]}
  with pytest.raises(OSError), files_capped_at(1000):
    report._write(str(tmp_path), fits, "# report\n" * 200)
  assert os.listdir(tmp_path) == []  # not a cut fits.json that reads as the result
  with pytest.raises(OSError), files_capped_at(10_000):  # fits.json fits, report.md not
    report._write(str(tmp_path), fits, "# report\n" * 2000)
  assert os.listdir(tmp_path) == ["fits.json"]
  assert json.loads((tmp_path / "fits.json").read_text()) == fits


@pytest.mark.parametrize("argv, match", [
    (["--budgets", "nan"], "argument --budgets: must be finite positive numbers"),
    (["--budgets", "1e5,inf"], "argument --budgets: must be finite positive numbers"),
    (["--budgets", "1e5,-3"], "argument --budgets: must be finite positive numbers"),
    (["--bp", "0"], "argument --bp: must be >= 1, got '0'"),
    (["--bp", "8.5"], "argument --bp: must be an integer, got '8.5'"),
    (["--n-boot", "-1"], "argument --n-boot: must be >= 0, got '-1'"),
])
def test_bad_values_stop_at_argument_parsing(tmp_path, capsys, argv, match):
  with pytest.raises(SystemExit) as stop:
    main([str(tmp_path), "--out", str(tmp_path / "o"), *argv])
  assert stop.value.code == 2
  err = capsys.readouterr().err
  assert match in err and argv[1] in err.splitlines()[-1]
