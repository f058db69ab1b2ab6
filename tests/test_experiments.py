"""Every experiment file loads through absl flags (locked) and passes the run's
pre-flight validation; each docstring's launch command names a loadable config."""

import pathlib
import re

import numpy as np
import pytest
from absl import flags
from ml_collections import config_flags

from experiments import scalerl_ablate
from isojax import run, run_plan, run_setup
from isojax.data import problem_sets
from isojax.analysis import runs as analysis_runs
from tests.analysis import fake_runs

ROOT = pathlib.Path(__file__).resolve().parents[1]
FILES = sorted(p for p in (ROOT / "experiments").glob("*.py")
               if p.name not in ("__init__.py", "common.py"))
STUDY_FILES = [ROOT / "experiments" / f"{split}_{study}.py" for split in ("easy", "hard")
               for study in ("n_vs_m", "fixed_batch", "joint")]
AXIS_FILES = [ROOT / "experiments" / f"{name}.py"
              for name in ("data_size", "decoupled_baseline", "difficulty_mix")]
APP_F_FILES = [ROOT / "experiments" / f"{name}.py"
               for name in ("easy_ppo", "hard_ppo", "easy_cispo")]
DOCUMENTED = [ROOT / "experiments" / "tiny.py", *STUDY_FILES, *AXIS_FILES, *APP_F_FILES]
# ScaleRL's files: their full-scale points need a real model's tokenizer (the
# interruption phrase), and the ablation needs drop=; checked at smoke here and
# with a stand-in tokenizer in test_scalerl_full_scale_points.
SCALERL_SMOKE_SPECS = {"scalerl": "experiments/scalerl.py:smoke",
                       "scalerl_ablate": "experiments/scalerl_ablate.py:drop=cispo,smoke"}


def _load(spec: str, *overrides: str):
  """Parses --config=spec like isojax.main does (lock_config=True)."""
  argv = ["prog", f"--config={spec}", *overrides]
  fv = flags.FlagValues()
  # sys_argv lets the flag load the file early and register --config.x overrides.
  holder = config_flags.DEFINE_config_file("config", None, flag_values=fv,
                                           lock_config=True, sys_argv=argv)
  fv(argv)
  return holder.value


def test_all_study_files_exist():
  assert all(p in FILES for p in DOCUMENTED)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_every_file_loads_and_validates(path, monkeypatch):
  monkeypatch.chdir(ROOT)
  config = _load(SCALERL_SMOKE_SPECS.get(path.stem, f"experiments/{path.name}"))
  plan = run.plan_run(config)
  assert plan.point.m >= 1 and plan.point.batch <= config.b_max
  for field in ("eval_every", "checkpoint_every", "seed"):
    assert field in config


def test_paper_studies_evaluate_every_n_at_the_same_log_spaced_compute(monkeypatch):
  # At the paper's C = 2e6 and Bp = 32, n = 8 runs M = 7812 updates and n = 2048 only
  # 30: both are evaluated at the first update to reach each 2^(j/8) rollouts, so
  # n = 2048 gets enough points to fit its curve and n = 8 no more than it needs.
  monkeypatch.chdir(ROOT)
  reached = {}
  for n in (8, 2048):
    plan = run.plan_run(_load(f"experiments/easy_n_vs_m.py:n={n}"))
    steps = [s for s in range(1, plan.point.m + 1) if plan.eval_due(s)]
    compute = np.array(steps) * plan.point.sampled_batch
    reached[n] = {int(np.floor(8 * np.log2(c) + 1e-9)) for c in compute}  # last 2^(j/8)
    assert len(steps) == {8: 88, 2048: 23}[n] and steps[-1] == plan.point.m
  # Every threshold n = 2048 is evaluated at (from its first batch on), n = 8 is too.
  assert reached[2048] <= reached[8] and min(reached[2048]) == 16 * 8
  # The laptop-scale studies keep a fixed cadence (evaluations cost CPU time there).
  smoke = _load("experiments/easy_n_vs_m.py:smoke")
  assert (smoke.eval_every, smoke.evals_per_doubling) == (4, 0)


@pytest.mark.parametrize("path", DOCUMENTED, ids=lambda p: p.stem)
def test_docstring_commands_load_and_validate(path, monkeypatch):
  monkeypatch.chdir(ROOT)
  text = path.read_text()
  commands = re.findall(r"python -m isojax\.main --config=(\S+) --workdir=\S+", text)
  assert commands, f"{path.name}: docstring has no launch command"
  for spec in commands:
    assert spec.startswith(f"experiments/{path.name}")
    config = _load(spec)
    plan = run.plan_run(config)
    assert plan.point.m >= 1
    assert plan.point.batch <= config.b_max
    assert _load(spec, "--config.rl.kl_coef=0.5").rl.kl_coef == 0.5
    # Locked: a typo in an override is an error, not a new field.
    with pytest.raises((flags.Error, AttributeError), match="kl_cof"):
      _load(spec, "--config.rl.kl_cof=0")


def _launch_commands(text: str) -> list[tuple[str, list[str]]]:
  """(spec, --config.x=... flags) of each `python -m isojax.main` command in `text`,
  its backslash-continued lines joined."""
  joined = re.sub(r"\\\n\s*", " ", text)
  out = []
  for line in re.findall(r"python -m isojax\.main (.*)", joined):
    words = line.split()
    spec = next(w.partition("=")[2] for w in words if w.startswith("--config="))
    out.append((spec, [w for w in words if w.startswith("--config.")]))
  return out


@pytest.mark.parametrize("path", DOCUMENTED, ids=lambda p: p.stem)
def test_docstring_commands_find_their_data(path, monkeypatch):
  # A command on the built-in data (no model or data flags) gets a training set
  # that holds a batch of Bp distinct problems beside its validation sets; one with
  # the paper's flags parses them.
  monkeypatch.chdir(ROOT)
  for spec, overrides in _launch_commands(path.read_text()):
    config = _load(spec, *overrides)
    if any(o.startswith(("--config.data.", "--config.model.path")) for o in overrides):
      assert config.model.path and config.data.train.endswith(".jsonl"), spec
      continue
    train, val_sets = run_setup.load_problem_sets(config)
    assert len(train) >= config.bp, f"{spec}: {len(train)} problems, Bp={config.bp}"
    assert all(val_sets.values()), spec


@pytest.mark.parametrize("path", STUDY_FILES + APP_F_FILES, ids=lambda p: p.stem)
def test_paper_recipe(path, monkeypatch):
  monkeypatch.chdir(ROOT)
  c = _load(f"experiments/{path.name}")
  split = path.stem.split("_")[0]
  # Table 1 / App. A.
  assert c.rl.zero_var_filter == "off"
  assert (c.rl.lr_rule, c.rl.lr_base, c.rl.batch_base) == ("sqrt", 1e-6, 1024)
  assert (c.sampler.temperature, c.sampler.top_p) == (0.6, 1.0)
  assert c.eval.k == 4 and c.eval.temperature == 0.6
  assert c.rl.tis_cap > 0 and c.rl.warmup_steps == 10
  if split == "easy":
    assert c.rl.kl_coef > 0 and c.rl.entropy_coef > 0 and c.b_max == 65_536
  else:
    assert c.rl.kl_coef == 0 and c.rl.entropy_coef == 0 and c.b_max == 16_384
  smoke = _load(f"experiments/{path.name}:smoke")
  assert smoke.b_max == 256 and run.plan_run(smoke).point.compute <= 2048


def test_tiny_point_and_overrides(monkeypatch):
  monkeypatch.chdir(ROOT)
  c = _load("experiments/tiny.py:bp=8,n=4,budget=2048", "--config.rl.kl_coef=0")
  plan = run.plan_run(c)
  assert (plan.point.bp, plan.point.n, plan.point.m) == (8, 4, 64)
  assert c.rl.kl_coef == 0.0
  # The derived M is never written back into the config.
  assert "m" not in c


def test_fixed_batch_sets_bp_from_batch(monkeypatch):
  monkeypatch.chdir(ROOT)
  c = _load("experiments/easy_fixed_batch.py:batch=8192,n=64,budget=2e6")
  assert (c.bp, c.n) == (128, 64)
  with pytest.raises(Exception, match=r"batch=8192 must equal bp\*n with n=64, bp=32"):
    _load("experiments/easy_fixed_batch.py:batch=8192,n=64,bp=32")


def test_fixed_batch_sweeps_cover_the_papers_bp_grid(monkeypatch):
  # §4: Bp in 2^5 .. 2^10; §4.2 adds Bp = 8 and 16 on the easy set. On B = 8192
  # that is n = 8 .. 1024 (easy) and n = 8 .. 256 (hard), each n with its Bp.
  monkeypatch.chdir(ROOT)
  for split, bps in (("easy", [8, 16, 32, 64, 128, 256, 512, 1024]),
                     ("hard", [32, 64, 128, 256, 512, 1024])):
    c = _load(f"experiments/{split}_fixed_batch.py")
    assert sorted(c.sweep.bp_values) == bps
    assert sorted(c.sweep.n_values) == [8192 // bp for bp in reversed(bps)]
  smoke = _load("experiments/easy_fixed_batch.py:smoke")  # every Bp on the line
  assert smoke.sweep.n_values == [2, 4, 8, 16] and smoke.sweep.bp_values == [16, 8, 4, 2]


def test_bad_arguments_are_named(monkeypatch):
  monkeypatch.chdir(ROOT)
  with pytest.raises(Exception, match="unknown config argument 'bq'"):
    _load("experiments/tiny.py:bq=8")
  # Only the fixed-batch studies take a fixed B.
  with pytest.raises(Exception, match="unknown config argument 'batch'"):
    _load("experiments/easy_joint.py:batch=64")


def test_impossible_points_fail_in_preflight(monkeypatch):
  monkeypatch.chdir(ROOT)
  with pytest.raises(ValueError, match=r"32\*16 = 512 exceeds b_max = 256"):
    run.plan_run(_load("experiments/tiny.py:bp=32,n=16,budget=4096"))
  with pytest.raises(ValueError, match=r"C=16 .* 8\*4 = 32.*M = .* = 0"):
    run.plan_run(_load("experiments/tiny.py:bp=8,n=4,budget=16"))


def test_forced_interruption_is_checked_in_preflight(monkeypatch):
  monkeypatch.chdir(ROOT)
  on = "--config.sampler.interrupt_think_tokens=3"
  run.plan_run(_load("experiments/tiny.py", on, "--config.sampler.interrupt_phrase=="))
  # The default (ScaleRL's English phrase) has no token in the tiny model's vocabulary.
  with pytest.raises(ValueError, match="config.sampler.interrupt_phrase='Okay"):
    run.plan_run(_load("experiments/tiny.py", on))
  with pytest.raises(ValueError, match="config.sampler.interrupt_answer_tokens=-1"):
    run.plan_run(_load("experiments/tiny.py", "--config.sampler.interrupt_answer_tokens=-1"))
  with pytest.raises(ValueError, match="interrupt_think_tokens=8 must be below max_tokens=8"):
    run.plan_run(_load("experiments/tiny.py", "--config.sampler.interrupt_think_tokens=8"))


def test_retiring_solved_problems_is_checked_in_preflight(monkeypatch):
  monkeypatch.chdir(ROOT)
  assert _load("experiments/tiny.py").data.drop_solved_above == 0.0  # off
  run.plan_run(_load("experiments/tiny.py", "--config.data.drop_solved_above=0.9"))
  run.plan_run(_load("experiments/tiny.py", "--config.data.drop_solved_above=1"))
  for bad in ("-0.5", "1.5", "nan"):
    match = rf"config\.data\.drop_solved_above={bad}.* \(0, 1\]"
    with pytest.raises(ValueError, match=match):
      run.plan_run(_load("experiments/tiny.py", f"--config.data.drop_solved_above={bad}"))


@pytest.mark.parametrize("path", STUDY_FILES + AXIS_FILES + APP_F_FILES, ids=lambda p: p.stem)
def test_study_length_follows_the_model(path, monkeypatch):
  # max_tokens 0 = the study's length: 8 on the tiny model (the synthetic task),
  # the paper's 8,192 once model.path names a real model; an explicit value wins.
  monkeypatch.chdir(ROOT)
  spec = f"experiments/{path.name}"
  assert _load(spec).sampler.max_tokens == 0
  assert run.plan_run(_load(spec)).max_tokens == 8
  real = run.plan_run(_load(spec, "--config.model.path=/ckpt/Qwen2.5-7B-Instruct"))
  assert real.max_tokens == 8192
  assert run.plan_run(_load(spec, "--config.model.path=/ckpt/m",
                        "--config.sampler.max_tokens=4096")).max_tokens == 4096


def test_axis_files(monkeypatch):
  monkeypatch.chdir(ROOT)
  small = _load("experiments/data_size.py:d=500")
  assert small.data.num_train == 500 and small.data.difficulty == "easy_d500"
  assert _load("experiments/data_size.py").data.num_train == 0
  dec = run.plan_run(_load("experiments/decoupled_baseline.py:setting=decoupled,budget=2e6"))
  assert (dec.point.bp, dec.point.n, dec.point.n_est, dec.point.m) == (128, 64, 256, 61)
  large = run.plan_run(_load("experiments/decoupled_baseline.py:setting=large,budget=2e6"))
  assert (large.point.n, large.point.m) == (256, 61)  # same M as decoupled
  with pytest.raises(Exception, match=r"n=8: setting=decoupled trains n=64"):
    _load("experiments/decoupled_baseline.py:n=8")
  assert _load("experiments/decoupled_baseline.py:n=64").n == 64  # the sweep's echo
  for mix, weights in (("hard", "extremely_hard:1.0"),
                       ("tri", "extremely_hard:0.5,easy_pass128:0.25,very_easy:0.25")):
    c = _load(f"experiments/difficulty_mix.py:mix={mix}")
    assert c.data.train == f"mix:{weights}" and c.data.num_train == 320
    assert [name for name, _ in run.plan_run(c).val_sets] == ["hard", "easy", "very_easy"]
  # With a real mixture file the paper's command keeps all of it (Fig. 14: 5k), not
  # the synthetic splits' 320.
  (real,) = [flags for _, flags in _launch_commands(AXIS_FILES[2].read_text()) if flags]
  c = _load("experiments/difficulty_mix.py:mix=dual", *real)
  assert c.data.num_train == 0 and c.data.train.endswith("5k.jsonl")
  assert [n for n, _ in problem_sets.parse_val_spec(c.data.val)] == ["hard", "easy",
                                                                      "very_easy"]


def test_appendix_f_files(monkeypatch):
  # Fig. 25: the n grid; PPO's advantages come from a critic (n may be 1), CISPO
  # keeps the group baseline. Each is its n-vs-M study otherwise.
  monkeypatch.chdir(ROOT)
  for name, base in (("easy_ppo", "easy_n_vs_m"), ("hard_ppo", "hard_n_vs_m"),
                     ("easy_cispo", "easy_n_vs_m")):
    c, ref = _load(f"experiments/{name}.py"), _load(f"experiments/{base}.py")
    assert c.sweep.n_values == [16, 32, 64, 128, 256]
    assert (c.bp, c.n, c.budget, c.b_max) == (ref.bp, ref.n, ref.budget, ref.b_max)
    assert c.sampler.to_dict() == ref.sampler.to_dict()
  for name in ("easy_ppo", "hard_ppo"):
    c = _load(f"experiments/{name}.py")
    assert c.rl.adv_estimator == "gae" and c.critic.lr_base == 1e-5
    assert run.plan_run(_load(f"experiments/{name}.py:n=1,smoke")).point.n == 1
  cispo = _load("experiments/easy_cispo.py")
  assert (cispo.rl.kind, cispo.rl.adv_estimator) == ("cispo", "grpo")
  with pytest.raises(ValueError, match="adv_estimator='grpo' needs n >= 2"):
    run.plan_run(_load("experiments/easy_cispo.py:n=1,smoke"))


def test_the_analysis_groups_runs_by_their_studys_split(monkeypatch, tmp_path):
  # The split a study file names reaches the analysis through config.json: easy and
  # hard runs analysed together are two frontiers, not seeds of one; an axis file's
  # data.difficulty label is finer than its split.
  monkeypatch.chdir(ROOT)
  specs = {"easy": "experiments/easy_n_vs_m.py", "hard": "experiments/hard_ppo.py",
           "easy_d500": "experiments/data_size.py:d=500"}
  for name, spec in specs.items():
    config = _load(spec)
    fake_runs.write_run(tmp_path / name, run_plan.resolved_config(config, run.plan_run(config)),
                        [{"step": 1, "rollouts": config.bp * config.n, "val/avg@4": 0.5}])
  loaded = analysis_runs.read_runs(tmp_path).runs
  assert {r.name: r.difficulty for r in loaded} == {name: name for name in specs}


class _WordTokenizer:
  """Stands in for a real model's tokenizer: one id per word."""

  @classmethod
  def from_pretrained(cls, path):
    del path
    return cls()

  def encode(self, text):
    return list(range(len(text.split())))


def _flat(config) -> dict:
  """{"rl.kind": "cispo", ...} for every leaf of a config."""
  out = {}
  for key, value in config.items():
    if hasattr(value, "items"):
      out.update({f"{key}.{k}": v for k, v in _flat(value).items()})
    else:
      out[key] = value
  return out


def test_scalerl_recipe(monkeypatch):
  monkeypatch.chdir(ROOT)
  c = _load("experiments/scalerl.py")
  assert c.recipe == "scalerl"
  assert (c.rl.kind, c.rl.clip_high, c.rl.agg) == ("cispo", 0.2, "prompt_mean")
  assert (c.rl.adv_estimator, c.rl.zero_var_filter) == ("batch", "all")
  assert c.rl.pipeline.max_lag == 8 and c.data.drop_solved_above == 0.9
  assert (c.rl.off_policy_k, c.sampler.decode_chunk) == (1, 256)
  assert (c.bp, c.n, c.bp * c.n) == (48, 16, 768)
  assert (c.sampler.max_tokens, c.sampler.interrupt_think_tokens) == (14_336, 12_288)
  assert (c.rl.lr_rule, c.rl.lr_base, c.rl.batch_base) == ("sqrt", 1e-6, 1024)
  assert c.rl.kl_coef == 0 and c.rl.entropy_coef == 0
  assert (c.data.num_val, c.eval_every) == (1000, 100)


def test_scalerl_full_scale_points(monkeypatch):
  # The default phrase and 14k tokens need a real model: its tokenizer stands in.
  monkeypatch.chdir(ROOT)
  monkeypatch.setattr(run_plan, "Tokenizer", _WordTokenizer)
  real = "--config.model.path=/ckpt/m"
  specs = ["experiments/scalerl.py"] + [f"experiments/scalerl_ablate.py:drop={drop}"
                                        for drop in scalerl_ablate.ABLATIONS]
  for spec in specs:
    plan = run.plan_run(_load(spec, real))
    assert (plan.point.batch, plan.max_tokens) == (768, 14_336)
  for name in ("scalerl", "scalerl_ablate"):
    text = (ROOT / "experiments" / f"{name}.py").read_text()
    commands = re.findall(r"python -m isojax\.main --config=(\S+) --workdir=\S+", text)
    assert len(commands) == 2, f"{name}.py: expected a full-scale and a smoke command"
    for spec in commands:
      assert spec.startswith(f"experiments/{name}.py")
      config = _load(spec, *(() if spec.endswith("smoke") else (real,)))
      assert run.plan_run(config).point.m >= 1


def test_scalerl_ablations_change_exactly_their_component(monkeypatch):
  monkeypatch.chdir(ROOT)
  for scale in ("", ",smoke"):
    recipe = _flat(_load("experiments/scalerl.py" + scale.replace(",", ":")))
    labels = set()
    for drop, fields in scalerl_ablate.ABLATIONS.items():
      ablated = _load(f"experiments/scalerl_ablate.py:drop={drop}{scale}")
      flat = _flat(ablated)
      changed = {k for k in recipe if flat[k] != recipe[k]}
      assert set(flat) == set(recipe)
      assert changed == {"recipe", *fields}, drop
      assert all(flat[k] == v for k, v in fields.items())
      labels.add(ablated.recipe)
      if scale:
        run.plan_run(ablated)
    assert len(labels) == len(scalerl_ablate.ABLATIONS) and "scalerl" not in labels
  run.plan_run(_load("experiments/scalerl.py:smoke"))


def test_scalerl_ablate_names_its_components(monkeypatch):
  monkeypatch.chdir(ROOT)
  known = r"known: \['batch_norm', 'cispo', 'fp32_head', 'interruption', 'pipeline'"
  for bad in ("drop=kl,smoke", "smoke"):
    with pytest.raises(Exception, match=known):
      _load(f"experiments/scalerl_ablate.py:{bad}")
  fp32 = _load("experiments/scalerl_ablate.py:drop=fp32_head")
  assert (fp32.model.dtype, fp32.model.lm_head_fp32) == ("bfloat16", False)
