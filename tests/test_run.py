"""The run loop end to end on the tiny CPU config.

* it learns: validation avg@4 rises over the base model's;
* it leaves a run directory the analysis can read (config.json with the derived
  point, metrics.jsonl, TensorBoard events, finite checkpoints, DONE);
* a SIGKILLed run restarted with the same command resumes from its checkpoint
  and writes a metrics.jsonl byte-identical to an uninterrupted run's;
* non-finite updates are skipped, counted, and stop the run after
  max_consecutive_skips, with no NaN ever checkpointed;
* impossible budget points fail before any work; finished runs are not rerun;
* with data.drop_solved_above, the count of retired prompts grows and survives resume.
"""

import gc
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import weakref

import jax
import numpy as np
import pytest
from flax import nnx

from experiments import tiny
from isojax import assets, batching, checkpoint as ckpt_lib, errors, run, run_batches
from isojax import data as data_lib
from isojax import run_open, run_setup
from isojax.models import Decoder
from tests.config_overrides import set_fields
from tests.rl.test_step import tiny_config as tiny_model
from tests import run_records
from tests.xla_cache import persistent_compilation_cache

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The tiny config at n = 16 (B = 128), M = 12: n = 4 leaves most groups with
# equal rewards on this base model (zero_var_frac ~0.75), n = 16 learns faster.
POINT = "bp=8,n=16,budget=1536"
FLAGS = ("--config.eval_every=6", "--config.checkpoint_every=6")


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(tmp_path_factory):
  """A persistent XLA cache for this module: the runs below share shapes, so all
  but the first load the step and sampler executables instead of compiling
  (the killed subprocess gets it through JAX_COMPILATION_CACHE_DIR). A cached
  executable is the compiled one, so results are bitwise unchanged."""
  with persistent_compilation_cache(str(tmp_path_factory.mktemp("jax_cache"))) as path:
    yield path


def tiny_config(arg=POINT, **overrides):
  """experiments/tiny.py at `arg` as FLAGS set it; `overrides` are dotted fields."""
  c = tiny.get_config(arg)
  c.eval_every = 6
  c.checkpoint_every = 6
  return set_fields(c, overrides)




@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """One uninterrupted tiny run: bp=8, n=16, M=12, eval and checkpoint every 6."""
  workdir = tmp_path_factory.mktemp("tiny")
  start = time.time()
  last = run.run(tiny_config(), workdir)
  return workdir, last, time.time() - start


def test_impossible_point_fails_before_any_work(tmp_path):
  workdir = tmp_path / "run"
  with pytest.raises(ValueError, match=r"Bp\*n = 32\*16 = 512 exceeds b_max = 256"):
    run.run(tiny_config("bp=32,n=16,budget=4096"), workdir)
  with pytest.raises(ValueError, match=r"C=31 .*8\*4 = 32.* = 0 updates"):
    run.run(tiny_config("bp=8,n=4,budget=31"), workdir)
  assert not workdir.exists()


def test_plan_loss_config_comes_from_config_rl():
  assert run.plan_run(tiny_config()).loss.tis_cap == 2.0  # the paper's TIS cap (App. A)
  assert run.plan_run(tiny_config(**{"rl.tis_cap": 3})).loss.tis_cap == 3.0
  loss = run.plan_run(tiny_config(**{"rl.tis_cap": None, "rl.kl_coef": 0.5})).loss
  assert (loss.tis_cap, loss.kl_coef, loss.clip_dual) == (None, 0.5, None)
  with pytest.raises(ValueError, match=r"^config\.rl\.tis_cap=0\.0 must be >= 1 or None"):
    run.plan_run(tiny_config(**{"rl.tis_cap": 0}))
  assert run.plan_run(tiny_config(**{"rl.kind": "cispo"})).loss.kind == "cispo"
  with pytest.raises(ValueError, match=r"config\.rl\.clip_high=0\.28 .* cannot affect"):
    run.plan_run(tiny_config(**{"rl.clip_high": 0.28}))
  with pytest.raises(ValueError, match=r"config\.rl\.clip_dual=3\.0 .* cannot affect"):
    run.plan_run(tiny_config(**{"rl.clip_dual": 3}))
  # No "0 means off": None (a config file) or inf (a flag) is no clipping.
  assert run.plan_run(tiny_config(**{"rl.max_grad_norm": None})).optim.max_grad_norm is None
  assert run.plan_run(tiny_config(**{"rl.max_grad_norm": float("inf")})
                      ).optim.max_grad_norm == float("inf")
  with pytest.raises(ValueError, match=r"^config\.rl\.max_grad_norm=0\.0 must be > 0"):
    run.plan_run(tiny_config(**{"rl.max_grad_norm": 0}))
  c = tiny_config()
  del c.rl["kl_estimator"]
  with pytest.raises(ValueError, match=r"config\.rl has no LossConfig field kl_estimator"):
    run.plan_run(c)


def test_dropped_rollouts_follow_the_steps_zero_variance_rule(tmp_path):
  """zero_var_filter="all": the ledger counts every rollout of each group the step
  found zero-variance (paid for, not trained on); one rule on host and device."""
  run.run(tiny_config("bp=4,n=4,budget=48", **{"rl.zero_var_filter": "all"}), tmp_path)
  records = run_records.records(tmp_path)[1:]  # step 0 is the evaluation before any update
  want = np.cumsum([round(r["train/zero_var_frac"] * 4) * 4 for r in records])
  assert len(records) == 3 and want[-1] > 0
  assert [r["dropped_rollouts"] for r in records] == want.tolist()


def test_retired_prompts_grow_and_resume_exactly(tmp_path, monkeypatch):
  """data.drop_solved_above: solved problems of 8 leave later epochs; the count is
  logged, and a run stopped after its step-3 checkpoint (mid-epoch, problems retired)
  and restarted writes the uninterrupted run's metrics."""
  overrides = {"data.train": "synthetic:easy", "data.num_train": 8, "data.num_val": 16,
               "eval.num_train": 0, "data.drop_solved_above": 0.75,
               "eval_every": 100, "checkpoint_every": 3}
  point = "bp=4,n=4,budget=80"  # M = 5 batches of 4 from the 8 problems
  whole = run.run(tiny_config(point, **overrides), tmp_path / "whole")
  retired = [r["train/retired_prompts"] for r in run_records.records(tmp_path / "whole")[1:]]
  assert retired == sorted(retired) and 0 < retired[-1] < 8, retired
  sample_group = run_batches.sample_group

  def stop_at_step_4(parts, config, first, last):
    if first == 4:
      assert parts.loader.state_dict()["retired"], "nothing retired by step 3"
      raise KeyboardInterrupt("stopped after the step-3 checkpoint")
    return sample_group(parts, config, first, last)

  monkeypatch.setattr(run_batches, "sample_group", stop_at_step_4)
  with pytest.raises(KeyboardInterrupt):
    run.run(tiny_config(point, **overrides), tmp_path / "cut")
  monkeypatch.setattr(run_batches, "sample_group", sample_group)
  last = run.run(tiny_config(point, **overrides), tmp_path / "cut")
  assert [run_records.without_timing(r) for r in run_records.records(tmp_path / "cut")] == [
      run_records.without_timing(r) for r in run_records.records(tmp_path / "whole")]
  assert run_records.without_timing(last) == run_records.without_timing(whole)


def test_retiring_below_a_batch_stops_with_one_message_and_its_checkpoint(tmp_path):
  """Retirements that leave fewer active problems than Bp stop the run with one line
  naming the counts and the threshold; its last checkpoint stays, and a rerun
  resumes from it and stops the same way (a batch never holds a problem twice)."""
  overrides = {"data.train": "synthetic:easy", "data.num_train": 8, "data.num_val": 16,
               "eval.num_train": 0, "data.drop_solved_above": 0.25,
               "eval_every": 100, "checkpoint_every": 1}
  point = "bp=4,n=4,budget=160"  # M = 10; epoch 1 begins at update 3
  for _ in range(2):
    with pytest.raises(data_lib.TooFewActiveError) as e:
      run.run(tiny_config(point, **overrides), tmp_path)
    assert errors.is_expected(e.value) and "\n" not in errors.message(e.value)
    assert re.search(r"[5-7] of 8 problems are retired as solved \(data\.drop_solved_"
                     r"above=0\.25\): epoch 1 has [1-3] left, fewer than a batch of 4",
                     str(e.value)), str(e.value)
    ck = ckpt_lib.RunCheckpointer(tmp_path / "checkpoints", max_to_keep=2)
    assert ck.latest_step() == 2  # the two updates of epoch 0
    ck.close()
  assert not (tmp_path / "DONE").exists()


def test_validation_improves_over_the_base_model(trained):
  workdir, last, wall_s = trained
  records = run_records.records(workdir)
  base, final = records[0]["val/avg@4"], last["val/avg@4"]
  print(f"tiny run: {wall_s:.0f} s, val avg@4 {base:.3f} -> {final:.3f}")
  # Margin 0.025. Every eval of a run uses the same sampling seed (common random
  # numbers): an unchanged policy scores exactly the same, and a changed one
  # differs only where its change flips samples, so the rise measures learning,
  # not fresh sampling noise (independent evals of 128 problems x 4 samples would
  # differ by SD <= sqrt(2 * 0.25 / 512) = 0.031). Measured rises at step 12:
  # +0.049 (seed 0, this test), +0.039, +0.043, +0.063 (seeds 1-3), and
  # +0.04..+0.07 over lr 1e-5..5e-5 and n 4..16; 0.025 is below all of them,
  # while a loop that does not learn stays at +0.00.
  assert final >= base + 0.025, (base, final)
  assert last["val/best@4"] >= last["val/avg@4"] >= last["val/worst@4"]


def test_trainer_scores_rollouts_under_the_sampled_distribution(trained):
  # On-policy with the in-process sampler, the trainer's logprobs must be the
  # sampler's (softmax(logits / temperature)) up to float rounding. Scoring at
  # temperature 1 instead of the config's 0.6 gave gaps of 0.03-0.08 and TIS
  # weights of 0.96-0.98.
  workdir, _, _ = trained
  steps = [r for r in run_records.records(workdir) if "train/logp_gap_max" in r]
  assert steps
  for r in steps:
    assert r["train/logp_gap_max"] < 1e-3, r["train/logp_gap_max"]
    assert abs(r["train/tis_weight_mean"] - 1.0) < 1e-4, r["train/tis_weight_mean"]


def test_lm_head_precision_reaches_the_model(monkeypatch):
  loaded = {}

  def load(path, **kwargs):
    loaded.update(kwargs)
    raise KeyboardInterrupt  # stop before any other work

  monkeypatch.setattr(run_setup.models, "load_pretrained", load)
  for fp32 in (True, False):
    config = tiny_config(**{"model.lm_head_fp32": fp32})
    with pytest.raises(KeyboardInterrupt):
      run_setup.build_parts(config, run.plan_run(config))
    assert loaded["lm_head_fp32"] is fp32


def test_logits_chunk_reaches_the_step(monkeypatch):
  with pytest.raises(ValueError, match=r"config\.rl\.logits_chunk=0 must be >= 1"):
    run.plan_run(tiny_config(**{"rl.logits_chunk": 0}))
  built = {}
  monkeypatch.setattr(run_setup.rl, "make_train_step",
                      lambda *a, **kw: built.update(kw))
  for chunk in (None, 64):
    config = tiny_config(**{"rl.logits_chunk": chunk})
    run_setup.make_step(config, run.plan_run(config), None, None)
    assert built["logits_chunk"] == chunk


def test_the_state_builder_lets_the_loaded_model_go():
  """The state copies the loaded parameters; once built, nothing of the run may
  hold the loaded module, or its parameters stay alive beside the state's."""
  model = Decoder(tiny_model(), rngs=nnx.Rngs(0))
  embed = weakref.ref(model.embed[...])
  init = run_setup._init_state(run.plan_run(tiny_config()), model, None, mesh=None)
  del model
  state = init()
  assert state.params["embed"][...].shape == (64, 32)
  gc.collect()
  assert embed() is None


@pytest.mark.parametrize("field, value, match", [
    ("model.dtype", "bf16", r"config\.model\.dtype: unsupported dtype 'bf16'; expected one of "
     r"\['bfloat16', 'float16', 'float32'\]"),
    ("model.param_dtype", "float64", r"config\.model\.param_dtype: unsupported dtype 'float64'"),
    ("sampler.max_rows", -1, r"config\.sampler\.max_rows=-1 must be >= 0"),
    ("sampler.decode_chunk", -2, r"config\.sampler\.decode_chunk=-2 must be >= 0"),
    ("sampler.kv_budget_gib", -1.0, r"config\.sampler\.kv_budget_gib=-1\.0 must be >= 0"),
])
def test_bad_dtypes_and_sampler_caps_fail_in_the_plan(field, value, match):
  with pytest.raises(ValueError, match=match):
    run.plan_run(tiny_config(**{field: value}))


def test_run_directory_layout(trained):
  workdir, last, elapsed_s = trained
  config = json.loads((workdir / "config.json").read_text())
  assert config["budget"] == {"requested": 1536.0, "bp": 8, "n": 16, "m": 12,
                              "batch": 128, "compute": 1536}
  assert (config["bp"], config["n"], config["m"]) == (8, 16, 12)
  records = run_records.records(workdir)
  assert [r["step"] for r in records] == list(range(13))
  # The ledger counts every rollout: Bp*n per step.
  assert [r["rollouts"] for r in records] == [128 * s for s in range(13)]
  assert all(r["tokens"] >= r["rollouts"] for r in records[1:])  # >= 1 token each
  # Device-hours: wall-clock of sampling + updating (a part of the run's time)
  # times the devices.
  hours = [r["device_hours"] for r in records]
  assert hours[0] == 0 and all(b > a for a, b in zip(hours, hours[1:])), hours
  assert hours[-1] < jax.device_count() * elapsed_s / 3600
  evals = [r["step"] for r in records if "val/avg@4" in r]
  assert evals == [0, 6, 12]
  for key in ("train/reward", "train/loss", "train/skipped", "train/lr",
              "train/zero_pass_frac", "val/best@4", "val/worst@4"):
    assert key in last
  assert 0 < last["train/pad_fraction"] < 1  # prompts and completions vary in length
  assert last == records[-1]
  assert list((workdir / "tensorboard").glob("events.out.tfevents.*"))
  done = json.loads((workdir / "DONE").read_text())
  assert done["step"] == 12 and done["last"] == last
  ck = ckpt_lib.RunCheckpointer(workdir / "checkpoints", max_to_keep=2)
  assert ck.all_steps() == [6, 12]
  ck.close()


def test_finished_run_is_not_rerun(trained, monkeypatch):
  workdir, last, _ = trained
  before = (workdir / "metrics.jsonl").read_bytes()

  def no_work(*args, **kwargs):
    raise AssertionError("a finished run must not build anything")

  monkeypatch.setattr(run_setup, "build_parts", no_work)
  assert run.run(tiny_config(), workdir) == last
  assert (workdir / "metrics.jsonl").read_bytes() == before
  with pytest.raises(ValueError, match=r"different config .*rl\.kl_coef"):
    run.run(tiny_config(**{"rl.kl_coef": 0.5}), workdir)


def _wait_for_checkpoint(proc, ckpt_dir, timeout_s=600):
  deadline = time.time() + timeout_s
  while time.time() < deadline:
    # Orbax renames a step's temporary directory to its bare number when complete.
    if ckpt_dir.is_dir() and any(p.name.isdigit() for p in ckpt_dir.iterdir()):
      return
    if proc.poll() is not None:
      raise AssertionError(f"run exited with {proc.returncode} before checkpointing:\n"
                           f"{proc.stdout.read()}")
    time.sleep(0.2)
  raise AssertionError(f"no checkpoint in {ckpt_dir} after {timeout_s} s")


def test_resume_after_sigkill_is_bitwise_identical(trained, tmp_path, compilation_cache):
  reference, _, _ = trained
  workdir = tmp_path / "killed"
  cmd = [sys.executable, "-m", "isojax.main", f"--config=experiments/tiny.py:{POINT}",
         f"--workdir={workdir}", *FLAGS]
  env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": compilation_cache,
         "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
         "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
  proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env=env)
  try:
    _wait_for_checkpoint(proc, workdir / "checkpoints")
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  assert not (workdir / "DONE").exists()
  killed_at = max(r["step"] for r in run_records.records(workdir))
  assert 6 <= killed_at < 12, killed_at
  # Same command again: resumes from step 6 and finishes.
  last = run.run(tiny_config(), workdir)
  assert (workdir / "DONE").exists()
  assert [run_records.without_timing(r) for r in run_records.records(workdir)] == [
      run_records.without_timing(r) for r in run_records.records(reference)]
  assert run_records.without_timing(last) == run_records.without_timing(run_records.records(reference)[-1])


def test_non_finite_updates_are_skipped_counted_and_stop_the_run(tmp_path, monkeypatch):
  real_build = batching.build_batch
  calls = []

  def overflowing_rewards(*args, **kwargs):
    """From the 3rd update on, finite rewards whose group mean overflows float32:
    they pass the step's input checks but make the advantages, hence the loss, NaN."""
    batch = real_build(*args, **kwargs)
    calls.append(1)
    if len(calls) >= 3:
      r = np.tile(np.float32([3e38, 3e38, 3e38, 0.0]), len(batch.rewards_B) // 4)
      batch = batch.replace(rewards_B=r)
    return batch

  monkeypatch.setattr(batching, "build_batch", overflowing_rewards)
  config = tiny_config(checkpoint_every=2, eval_every=100, max_consecutive_skips=3)
  workdir = tmp_path / "nan"
  with pytest.raises(run.NonFiniteLossError,
                     match=r"step 5: 3 updates in a row .*max_consecutive_skips=3"):
    run.run(config, workdir)
  records = run_records.records(workdir)
  assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5]
  assert [r["train/skipped"] for r in records[1:]] == [0, 0, 1, 1, 1]
  assert [r["consecutive_skips"] for r in records[1:]] == [0, 0, 1, 2, 3]
  assert np.isnan(records[3]["train/loss"])
  assert not (workdir / "DONE").exists()
  # Checkpoints at steps 2 and 4 exist, hold no NaN, and the skipped steps 3-4
  # left the state exactly as update 2 made it.
  parts_state = _restore_all(workdir, config)
  assert sorted(parts_state) == [2, 4]
  for state in parts_state.values():
    assert not ckpt_lib.nonfinite_leaves(state)
  assert int(parts_state[4].step) == 2
  for a, b in zip(jax.tree.leaves(parts_state[2]), jax.tree.leaves(parts_state[4])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _restore_all(workdir, config):
  parts = run_setup.build_parts(config, run.plan_run(config))
  template = parts.init_state()
  ck = ckpt_lib.RunCheckpointer(pathlib.Path(workdir) / "checkpoints", max_to_keep=5)
  out = {s: ck.restore(s, template)[0] for s in ck.all_steps()}
  ck.close()
  parts.close()
  return out


def test_progress_bar_only_on_a_terminal(monkeypatch):
  import io

  class Terminal(io.StringIO):
    def isatty(self):
      return True

  monkeypatch.setattr(sys, "stderr", io.StringIO())
  bar = run._progress(10, 2, "bp8_n4_m10")
  bar.update(1)
  bar.close()
  assert sys.stderr.getvalue() == ""
  monkeypatch.setattr(sys, "stderr", Terminal())
  bar = run._progress(10, 2, "bp8_n4_m10")
  bar.update(1)
  bar.close()
  assert "bp8_n4_m10:  30%" in sys.stderr.getvalue() and "<" in sys.stderr.getvalue()  # ETA


def test_missing_split_file_is_named(monkeypatch, tmp_path):
  monkeypatch.setattr(assets, "ASSETS_DIR", tmp_path)
  config = tiny_config(**{"data.train": "synthetic:easy"})
  with pytest.raises(ValueError, match=r"no split file .*easy\.jsonl; .*launch/difficulty_splits\.py"):
    run_setup.load_problem_sets(config)


def test_problem_file_with_held_out_validation(tmp_path):
  from isojax.data import Problem, write_jsonl
  problems = [Problem(id=f"p{i}", prompt=f"{i}+1=", answer=str(i + 1)) for i in range(20)]
  write_jsonl(problems, tmp_path / "train.jsonl")
  config = tiny_config(**{"data.train": str(tmp_path / "train.jsonl"), "data.num_val": 5})
  train, sets = run_setup.load_problem_sets(config)
  val = sets["val"]
  assert len(train) == 15 and len(val) == 5
  assert not {p.id for p in train} & {p.id for p in val}
  # The held-out set depends on data.split_seed only, never on the run's seed.
  config.seed = 7
  assert run_setup.load_problem_sets(config)[1]["val"] == val
  config.data.num_val = 20
  with pytest.raises(ValueError, match=r"20 problems cannot give data.num_val=20"):
    run_setup.load_problem_sets(config)


def test_extra_eval_steps(tmp_path):
  # eval_steps adds evals beside the multiples of eval_every and the last step.
  run.run(tiny_config("bp=8,n=16,budget=384", eval_steps=(1,)), tmp_path / "r")
  evals = [r["step"] for r in run_records.records(tmp_path / "r") if "val/avg@4" in r]
  assert evals == [0, 1, 3]
  # Log-spaced evals, and none at a fixed cadence: 128 rollouts per update reach
  # 2^0..2^7 at step 1, 2^8 at 2, 2^9 at 4 (the last step, M = 5, evaluates anyway).
  run.run(tiny_config("bp=8,n=16,budget=640", eval_every=0, evals_per_doubling=1),
          tmp_path / "log")
  rows = run_records.records(tmp_path / "log")
  assert [r["step"] for r in rows if "val/avg@4" in r] == [0, 1, 2, 4, 5]
  assert [r["rollouts"] for r in rows if r["step"] in (1, 2, 4)] == [128, 256, 512]


def test_only_the_first_process_writes_the_run_files(trained, tmp_path, monkeypatch):
  # Another host of a multi-host run: it trains in step with the first (same
  # records) but leaves config.json, metrics.jsonl, TensorBoard and DONE to it.
  monkeypatch.setattr(run_open, "writes_run_files", lambda: False)
  workdir = tmp_path / "host1"
  last = run.run(tiny_config(), workdir)
  assert run_records.without_timing(last) == run_records.without_timing(run_records.records(trained[0])[-1])
  assert sorted(os.listdir(workdir)) == ["checkpoints"]


def test_every_evaluation_is_logged_with_or_without_the_train_histogram(monkeypatch):
  # config.eval.num_train = 0 turns the train-set histogram off, not the evaluation.
  logged = []
  monkeypatch.setattr(run.logging, "info", lambda msg, *args: logged.append(msg % args))

  class Bar:
    def update(self, n):
      pass

    def set_postfix(self, **kw):
      pass

  config = tiny.get_config("bp=4,n=2,budget=64")
  point = run.plan_run(config).point
  run._report(Bar(), 3, point, {"train/reward": 0.5}, config, time.time())
  assert not logged
  record = {"train/reward": 0.5, f"val/avg@{config.eval.k}": 0.25}
  run._report(Bar(), 4, point, record, config, time.time())
  assert len(logged) == 1 and f"val avg@{config.eval.k} 0.250" in logged[0]
