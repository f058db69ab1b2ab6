r"""The main job (`make demo`): a small IsoCompute study on a CPU, then its report.

  python launch/demo.py --root=runs/demo            # what `make demo` runs
  python launch/demo.py --root=/tmp/demo --smoke    # the same workflow in a minute or two

1. writes the study's fixed problem pool (experiments/demo.py) to <root>/data/;
2. trains every (Bp, n, M, seed) point of the study through isojax.sweep, locally, into
   <root>/runs/<point>, printing which point runs, how far it is and an ETA;
3. analyses the runs with isojax.analysis into <root>/report/ (figures, fits.json,
   report.md);
4. prints the mean validation reward per n at matched compute (seeds pooled), the
   best n at small and at large C from those numbers alone, n*(C) along the fitted
   frontier, the prescriptions (one for 10x the largest budget) with their bootstrap
   intervals, and where the report is.

Rerunning the same command resumes: finished points are skipped, unfinished ones go on
from their last checkpoint, and the analysis is redone. The study itself (Bp, n values,
budget, seeds, the pool's spec, recipe) is the config experiments/demo.py; this file
writes the pool from that spec and drives the study.
"""

import json
import os
import sys
import time

import matplotlib
import numpy as np
from absl import app, flags

matplotlib.use("Agg")  # the report's figures go to files only

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The repo root must be on sys.path first (hence E402): `experiments` is not installed.
from experiments import demo as study  # noqa: E402
from isojax import sweep  # noqa: E402
from isojax.analysis import pipeline, read_runs, report  # noqa: E402
from isojax.data import synthetic_problems, write_jsonl  # noqa: E402
from isojax.data.synthetic import DEFAULT_DIGITS  # noqa: E402

EXPERIMENT = os.path.join("experiments", "demo.py")

_ROOT = flags.DEFINE_string("root", os.path.join("runs", "demo"),
                            "Study root: data/, runs/ and report/ go under it.")
_SMOKE = flags.DEFINE_bool("smoke", False, "A tiny study (tests, a first look): same "
                           "workflow, a few seconds of training per point.")
_MAX_CONCURRENT = flags.DEFINE_integer(
    "max_concurrent", None, "Concurrent runs (default: what fits the machine).")
_STATUS_EVERY = flags.DEFINE_float("status_every", 30.0, "Seconds between progress lines.")
_MODEL = flags.DEFINE_string("model", "", "Base model directory (default: the committed "
                             "tiny base model, isojax/assets/base_model).")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print the study's points and exit.")
_N_BOOT = flags.DEFINE_integer("n_boot", None, "Bootstrap resamples of the analysis "
                               "(default: the study's).")


def _fmt_s(seconds: float) -> str:
  seconds = int(seconds)
  return f"{seconds // 60}m{seconds % 60:02d}s"


def base_model_digits(model_dir: str | None = None):
  """The digit ranges the base model was trained on (its make_base_model.json), so
  the pool sits at the model's own difficulty; the synthetic default if unrecorded."""
  path = os.path.join(model_dir or sweep.BASE_MODEL_DIR, "make_base_model.json")
  if not os.path.exists(path):
    return DEFAULT_DIGITS
  with open(path, encoding="utf-8") as f:
    digits = json.load(f).get("args", {}).get("digits")
  return json.loads(digits) if isinstance(digits, str) else (digits or DEFAULT_DIGITS)


def write_problems(path: str, data: dict, model_dir: str | None = None) -> str:
  """Writes the study's fixed problem pool (a function of `data` and the base model's
  digit ranges) as JSONL.

  A study's runs must all read one pool: when `path` exists it must already hold
  exactly these problems (then nothing is written).

  Raises:
    ValueError: if `path` holds a different pool (the spec or the base model's digits
      changed since the study started): start a fresh root instead.
  """
  problems = synthetic_problems(
      data["num"], seed=data["seed"], families=data["families"],
      digits=data["digits"] or base_model_digits(model_dir), weights=data["weights"],
      id_prefix="demo")
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      if [json.loads(line) for line in f if line.strip()] == [p.to_dict() for p in problems]:
        return path
    raise ValueError(f"{path} holds a different problem pool than experiments/demo.py "
                     f"now makes ({len(problems)} problems from {data}); its runs were "
                     "trained on the old one. Use a fresh --root (or delete that study).")
  write_jsonl(problems, path)
  return path


def run_args(spec: dict, data_path: str) -> list[str]:
  """The `--config.*` arguments every run of the study gets."""
  return [f"--config.data.train={data_path}",
          f"--config.data.num_val={spec['data']['num_val']}",
          f"--config.eval.num_train={spec['eval_num_train']}"]


def run_sweep(spec: dict, root: str, *, model: str, max_concurrent: int | None,
              status_every: float, dry_run: bool = False) -> sweep.SweepReport | None:
  """Writes the problem pool, then trains every point of `spec` under root/runs
  (with `dry_run`, only prints the points)."""
  data_path = os.path.join(root, "data", "problems.jsonl")
  extra = run_args(spec, data_path) + ([f"--config.model.path={model}"] if model
                                             else [])
  plan, config = sweep.plan_sweep(
      EXPERIMENT, os.path.join(root, "runs"), bp=[spec["bp"]], n=list(spec["n_values"]),
      budgets=[spec["budget"]], b_max=spec["b_max"], seeds=list(spec["seeds"]),
      extra_args=extra)
  print(f"demo: {len(plan.points)} runs (Bp={spec['bp']}, n in {list(spec['n_values'])}, "
        f"C={spec['budget']:g} rollouts each, seeds {list(spec['seeds'])}); data "
        f"{data_path}\n{sweep.format_points(plan.points, sweep.max_tokens(config))}",
        flush=True)
  if dry_run:
    return None
  write_problems(data_path, spec["data"], model or None)
  # A tiny CPU run is mostly one busy thread (dispatch, sampling loop), so one
  # single-threaded run per core, which is the sweep's default on a CPU
  # (sweep.CORES_PER_RUN = 1); one run at a time on an accelerator.
  concurrent = max_concurrent or sweep.default_concurrency()
  return sweep.run_local(plan, max_concurrent=concurrent, status_every_s=status_every,
                         print_fn=lambda s: print(s, flush=True))


def analyse(root: str, *, n_boot: int):
  """Analyses root/runs into root/report; returns (analysis, runs, report dir)."""
  runs_dir, report_dir = os.path.join(root, "runs"), os.path.join(root, "report")
  loaded = read_runs(runs_dir)
  for problem in loaded.problems:
    print(f"warning: {problem}")
  analysis = pipeline.analyze(list(loaded.runs), root=runs_dir, n_boot=n_boot,
                              load_problems=loaded.problems)
  written = report.write_report(analysis, report_dir)
  print(f"analysis: {len(loaded.runs)} runs -> {report_dir}/report.md, fits.json, "
        f"{len(written['figures'])} figures")
  return analysis, loaded.runs, report_dir


def mean_by_n(runs, metric: str):
  """(ns, computes, means_CxN): `metric` averaged over seeds, per n, at every compute
  that all n evaluated (the demo evaluates every n at the same rollout counts)."""
  by_n: dict[int, dict[int, list[float]]] = {}
  for r in runs:
    c, y = r.points(metric)
    for ci, yi in zip(c, y):
      by_n.setdefault(r.n, {}).setdefault(int(ci), []).append(float(yi))
  ns = sorted(by_n)
  shared = sorted(set.intersection(*(set(v) for v in by_n.values()))) if ns else []
  means_CxN = np.array([[np.mean(by_n[n][c]) for n in ns] for c in shared])
  return ns, shared, means_CxN.reshape(len(shared), len(ns))


def matched_compute_table(runs, metric: str) -> str:
  """Mean `metric` per n (seeds pooled) at each evaluated compute; * marks the best."""
  ns, shared, means_CxN = mean_by_n(runs, metric)
  lines = [f"{'rollouts':>9} " + " ".join(f"{'n=' + str(n):>8}" for n in ns)]
  for c, means in zip(shared, means_CxN):
    best = int(means.argmax())
    lines.append(f"{c:>9} " + " ".join(
        f"{m:7.3f}{'*' if i == best else ' '}" for i, m in enumerate(means)))
  return "\n".join(lines)


def model_free_finding(runs, metric: str) -> str | None:
  """Which n is best at small and at large compute, from the data alone (no fit).

  Small compute: evaluations at C <= C_max/8; large: C >= 3/4 C_max (each at least the
  first / last evaluation after step 0). Rewards are averaged over seeds and over the
  evaluations in the window; the line gives every n's mean so the margin can be judged
  against the evaluation noise.
  """
  ns, shared, means_CxN = mean_by_n(runs, metric)
  c = [x for x in shared if x > 0]
  if len(ns) < 2 or not c:
    return None
  rows = {x: i for i, x in enumerate(shared)}
  early = [rows[x] for x in c if x <= c[-1] / 8] or [rows[c[0]]]
  late = [rows[x] for x in c if x >= 0.75 * c[-1]] or [rows[c[-1]]]
  e, l = means_CxN[early].mean(0), means_CxN[late].mean(0)
  n_early, n_late = ns[int(e.argmax())], ns[int(l.argmax())]
  trend = ("grows with C" if n_late > n_early else
           "shrinks with C" if n_late < n_early else "does not move")
  fmt = lambda m: ", ".join(f"n={n} {v:.3f}" for n, v in zip(ns, m))  # noqa: E731
  return (f"finding (data, seeds pooled, no fit): best n is {n_early} at C <= "
          f"{shared[early[-1]]:.3g} ({fmt(e)}) "
          f"and {n_late} at C >= {shared[late[0]]:.3g} ({fmt(l)}): n* {trend} "
          f"({n_early} -> {n_late}); at large C the best leads the worst n by "
          f"{l.max() - l.min():.3f}")


def summary(analysis, runs) -> list[str]:
  """What the demo found: the data's best n at small and large C, n*(C) along the
  fitted frontier, and the prescriptions (with bootstrap intervals when computed)."""
  out = []
  for g in analysis.groups:
    finding = model_free_finding([r for r in runs if r.difficulty == g.difficulty],
                                 g.metric)
    if finding:
      out.append(finding)
    p = g.primary
    if p is None or p.frontier is None:
      why = f"{len(g.problems)} problem(s), first: {g.problems[0]}" if g.problems else (
          "no curves")
      out.append(f"no frontier could be fitted ({why}); see report.md")
      continue
    c, n_star = p.frontier.n_star_points()
    if c.size:
      idx = sorted({int(round(k * (c.size - 1) / 5)) for k in range(6)})
      first, last = int(n_star[0]), int(n_star[-1])
      trend = ("grows with C" if last > first else
               "shrinks with C" if last < first else "does not move")
      out.append(f"fitted frontier ({p.label}, {g.metric}): n* {trend} ({first} -> "
                 f"{last}); " + ", ".join(f"C={c[i]:.3g}: n*={int(n_star[i])}"
                                          for i in idx))
    if g.law_choice is not None:
      out.append(f"prescriptions from {g.law_choice.reason}")
    for pr in g.prescriptions:
      pt = pr.point
      where = "beyond the data, extrapolated" if pr.extrapolated else "within the data"
      what = f"Bp={pt.bp}, n={pt.n}, M={pt.m}" if pt is not None else f"none ({pr.note})"
      ci = (f", {100 * g.intervals.level:.0f}% interval [{pr.interval[0]:.3g}, "
            f"{pr.interval[1]:.3g}]" if pr.interval is not None and g.intervals is not None
            else "")
      out.append(f"prescription for C={pr.budget:.3g} rollouts ({where}): {what} "
                 f"(law n*={pr.n_star:.3g}{ci})")
    if not g.prescriptions:
      why = [q for q in g.problems if "law" in q]
      out.append("no prescription: no n*(C) law could be fitted"
                 + (f" ({why[0]})" if why else ""))
  return out


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  t0 = time.time()
  root = _ROOT.value
  spec = study.study_spec(smoke=_SMOKE.value)
  try:
    result = run_sweep(spec, root, model=_MODEL.value, max_concurrent=_MAX_CONCURRENT.value,
                       status_every=_STATUS_EVERY.value, dry_run=_DRY_RUN.value)
  except ValueError as e:  # a bad study root (e.g. another pool), before any training
    print(f"demo: {e}")
    return 1
  except KeyboardInterrupt:
    print(f"\ndemo: interrupted after {_fmt_s(time.time() - t0)}; rerun the same "
          "command to resume (finished points are kept, the rest resume from their "
          "checkpoints).")
    return 130
  if result is None:  # --dry_run
    return 0
  n_boot = spec["n_boot"] if _N_BOOT.value is None else _N_BOOT.value
  try:
    analysis, runs, report_dir = analyse(root, n_boot=n_boot)
  except ValueError as e:  # e.g. every run failed: nothing to analyse
    print(f"demo: no analysis: {e}")
    return 1
  print(f"\nmean {analysis.metric} per n at matched compute (seeds pooled; * = best):")
  print(matched_compute_table(runs, analysis.metric))
  print()
  for line in summary(analysis, runs):
    print(line)
  print(f"\nreport: {os.path.join(report_dir, 'report.md')} (figures and fits.json "
        f"beside it); total {_fmt_s(time.time() - t0)}")
  if not result.ok:
    print(f"demo: {len(result.failed)} run(s) failed: {', '.join(result.failed)}; see "
          f"their sweep.log. Rerun the same command to retry them.")
    return 1
  return 0


if __name__ == "__main__":
  app.run(lambda argv: sys.exit(main(argv)))
