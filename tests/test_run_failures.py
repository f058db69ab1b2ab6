"""A run that cannot work fails before any work, naming the input; one that fails
mid-way says so in one message and leaves files a rerun can resume from.

* n below the advantage estimator's minimum fails in `plan`, before any file;
* a prompt longer than the context fails when the data is loaded (file:line);
* a start that fails (bad model path) does not record its config, so the
  corrected command runs in the same workdir; nor does a run that died before its
  first checkpoint hold its config against the next (nothing to resume);
* a link at a name the run creates (config.json.tmp, metrics.jsonl,
  checkpoints) is refused, and the file it points at is untouched;
* a full disk while checkpointing is one DiskFullError naming the checkpoint,
  and the rerun completes;
* trainer + sampler over the device's memory stop before the first update,
  naming the numbers (the evaluation's cache and PipelineRL's weight copy too);
* `python -m isojax.main` prints such an error as one line and exits with 2;
* sampling settings, eval_steps, cuDNN attention where it cannot run and negative
  seeds or counts fail before config.json is written, as does a Bp above the
  training set's size;
* a rerun on other problems than its checkpoints' (the data files changed) is
  refused, naming the sets;
* a second process in a run directory, checkpoints without their config.json, a
  damaged config.json, DONE or checkpoint are each refused, naming the file; the
  lock is held until DONE is written.
"""

import dataclasses
import errno
import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from experiments import tiny
from isojax import checkpoint as ckpt_lib, files, run, run_setup, rundir
from isojax.data import Problem, write_jsonl
from isojax.rollout import memory
from isojax.errors import DiskFullError, UnsafePathError
from tests.config_overrides import set_fields
from tests.xla_cache import persistent_compilation_cache

# M = 4 updates of B = 8; a small eval so that a whole run takes seconds.
POINT = "bp=4,n=2,budget=32"


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(tmp_path_factory):
  """A persistent XLA cache for this module: most runs below share the step's and
  the sampler's shapes, so all but the first load their executables instead of
  compiling them. A cached executable is the compiled one: results are unchanged."""
  with persistent_compilation_cache(str(tmp_path_factory.mktemp("jax_cache"))):
    yield


def small_config(arg=POINT, **overrides):
  c = tiny.get_config(arg)
  c.eval_every, c.checkpoint_every = 4, 2
  c.data.num_val, c.eval.num_train = 8, 0
  return set_fields(c, overrides)


def test_n_below_the_estimators_minimum_fails_before_any_work(tmp_path):
  with pytest.raises(ValueError, match=r"n=1 rollouts per problem: config.rl.adv_estimator="
                                       r"'grpo' needs n >= 2 .*\['gae'\]"):
    run.run(small_config("bp=4,n=1,budget=64"), tmp_path / "x1")
  assert not (tmp_path / "x1").exists()
  # A group mean over one rollout is its reward: every advantage would be 0.
  for estimator in ("drgrpo", "batch", "rloo"):
    with pytest.raises(ValueError, match=f"'{estimator}' needs n >= 2"):
      run.plan_run(small_config("bp=4,n=1,budget=64", **{"rl.adv_estimator": estimator}))
  run.plan_run(small_config("bp=4,n=1,budget=64", **{"rl.adv_estimator": "gae"}))  # a critic
  # A decoupled baseline: grpo's std is taken over the n_est = 4 sampled rollouts.
  run.plan_run(small_config("bp=4,n=1,budget=64", **{"rl.n_est": 4}))


def test_a_flag_that_moves_a_fixed_batch_point_off_its_line_is_refused(tmp_path):
  run.plan_run(small_config(**{"sweep.batch": 8}))  # Bp * n = 4 * 2 = 8: on the line
  with pytest.raises(ValueError, match=r"config.sweep.batch=8 \(a fixed-batch study: "
                                       r"Bp\*n = 8\) but Bp\*n = 4\*4 = 16: give n in "
                                       r"the experiment file's argument"):
    run.run(small_config(**{"sweep.batch": 8, "n": 4}), tmp_path / "run")
  assert not (tmp_path / "run").exists()


def test_prompt_longer_than_the_context_fails_at_load_naming_the_line(tmp_path):
  lines = [{"id": f"p{i}", "prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(30)]
  lines[17]["prompt"] = "12+34=" * 40  # far past the tiny model's context
  path = tmp_path / "train.jsonl"
  path.write_text("".join(json.dumps(x) + "\n" for x in lines))
  config = small_config(**{"data.train": str(path), "data.num_val": 4})
  workdir = tmp_path / "run"
  with pytest.raises(ValueError, match=rf"{path}:18: problem '17' has a prompt of \d+ "
                                       r"tokens > the limit of \d+"):
    run.run(config, workdir)
  assert not (workdir / "config.json").exists() and not (workdir / "metrics.jsonl").exists()


def _problems_file(path, first: int, count: int):
  lines = [{"id": f"p{i}", "prompt": f"{i}+1=", "answer": str(i + 1)}
           for i in range(first, first + count)]
  path.write_text("".join(json.dumps(x) + "\n" for x in lines))
  return path


def test_a_rerun_on_changed_data_is_refused(tmp_path):
  # The config names the same file, but its problems changed since the run
  # started: the loader's position and the validation curve would continue on
  # other problems.
  path = _problems_file(tmp_path / "train.jsonl", 0, 30)
  config = small_config(**{"data.train": str(path), "data.num_val": 4})
  workdir = tmp_path / "run"
  run.run(config, workdir)
  digests = json.loads((workdir / rundir.DATA_FILE).read_text())
  assert sorted(digests) == ["train", "val/val"] and digests["train"]["problems"] == 26
  (workdir / rundir.DONE_FILE).unlink()  # as if killed after its last checkpoint
  original = path.read_text()
  _problems_file(path, 100, 30)
  with pytest.raises(ValueError, match=r"the problems of \['train', 'val/val'\] are not "
                     r"those this run started with \(train: 26 problems then, 26 problems "
                     r"now; .*data.train='.*train.jsonl'.*use a fresh --workdir"):
    run.run(config, workdir)
  # Before its first checkpoint a rerun starts afresh, on the problems it finds.
  shutil.rmtree(workdir / "checkpoints")
  run.run(config, workdir)
  assert json.loads((workdir / rundir.DATA_FILE).read_text())["train"] != digests["train"]
  (workdir / rundir.DONE_FILE).unlink()
  assert run.run(config, workdir)["step"] == 4  # the same problems resume
  path.write_text(original)
  (workdir / rundir.DONE_FILE).unlink()
  with pytest.raises(ValueError, match=r"the problems of \['train', 'val/val'\]"):
    run.run(config, workdir)
  (workdir / rundir.DATA_FILE).write_text('{"train": 26}')
  with pytest.raises(ValueError, match=r"data.json is not what a run writes"):
    run.run(config, workdir)


def test_a_batch_larger_than_the_training_set_is_refused(tmp_path):
  path = _problems_file(tmp_path / "train.jsonl", 0, 7)
  config = small_config(**{"data.train": str(path), "data.num_val": 4})
  with pytest.raises(ValueError, match=r"Bp=4 problems per batch, but 3 training problems "
                     r"\(data.train="):
    run.run(config, tmp_path / "run")
  assert not (tmp_path / "run" / "config.json").exists()


def test_failed_start_then_fixed_command_links_refused(tmp_path, monkeypatch):
  workdir = tmp_path / "run"
  with pytest.raises(Exception, match="no-such-model"):
    run.run(small_config(**{"model.path": str(tmp_path / "no-such-model")}), workdir)
  assert not (workdir / "config.json").exists()

  victim = tmp_path / "victim.txt"
  victim.write_text("precious\n")
  config = small_config()
  closed, close = [], run_setup.RunParts.close  # the sampler is closed on every failure
  monkeypatch.setattr(run_setup.RunParts, "close", lambda self: closed.append(close(self)))
  # Every name the run creates in its directory, in the order it creates them;
  # DONE.tmp is the last write of a run that trained to the end.
  for name in ("checkpoints", "config.json.tmp", "data.json.tmp", "metrics.jsonl.tmp",
               "metrics.jsonl", "tensorboard", "DONE.tmp"):
    (workdir / name).symlink_to(victim)
    with pytest.raises(UnsafePathError, match=rf"{workdir / name} -> {victim}"):
      run.run(config, workdir)
    (workdir / name).unlink()
  # The checkpoints link is refused before any part is built (nothing to close).
  assert victim.read_text() == "precious\n" and len(closed) == 6
  # The run directory's lock is taken first, before any part is built.
  (workdir / rundir.RUN_LOCK_FILE).unlink()  # left by the attempts above
  (workdir / rundir.RUN_LOCK_FILE).symlink_to(victim)
  with pytest.raises(UnsafePathError, match=rf"{workdir / rundir.RUN_LOCK_FILE} -> {victim}"):
    run.run(config, workdir)
  (workdir / rundir.RUN_LOCK_FILE).unlink()
  assert victim.read_text() == "precious\n" and len(closed) == 6

  last = run.run(config, workdir)  # the corrected command, same workdir
  assert last["step"] == 4 and (workdir / "DONE").exists()
  assert json.loads((workdir / "config.json").read_text())["model"]["path"] == ""
  # Nothing else was created: the names above are all there is to guard.
  assert sorted(os.listdir(workdir)) == [rundir.RUN_LOCK_FILE, "DONE", "checkpoints",
                                         "config.json", "data.json", "metrics.jsonl",
                                         "tensorboard"]


def test_a_run_dead_before_its_first_checkpoint_reruns_with_another_config(tmp_path,
                                                                          monkeypatch):
  workdir = tmp_path / "run"
  real_loop = run.train_loop

  def out_of_memory(*args, **kwargs):
    raise MemoryError("the first update did not fit")

  monkeypatch.setattr(run, "train_loop", out_of_memory)
  with pytest.raises(MemoryError):
    run.run(small_config(), workdir)
  assert json.loads((workdir / "config.json").read_text())["rl"]["micro_batch"] == 0
  monkeypatch.setattr(run, "train_loop", real_loop)
  # Nothing to resume: the corrected command starts afresh and records its config.
  fixed = small_config(**{"rl.micro_batch": 4})
  assert run.run(fixed, workdir)["step"] == 4
  assert json.loads((workdir / "config.json").read_text())["rl"]["micro_batch"] == 4
  steps = [r["step"] for r in rundir.read_metrics(workdir / "metrics.jsonl").records]
  assert steps == [0, 1, 2, 3, 4]
  # Once it has checkpoints (here: finished), another config is refused again.
  (workdir / "DONE").unlink()
  with pytest.raises(ValueError, match=r"different config .*rl\.micro_batch"):
    run.run(small_config(), workdir)


def test_full_disk_while_checkpointing_is_one_message_and_resumable(tmp_path, monkeypatch):
  real_save = ckpt_lib.RunCheckpointer.save

  def full_at_4(self, step, state, host):
    if step == 4:
      raise OSError(errno.ENOSPC, "No space left on device", str(self.directory / "4"))
    return real_save(self, step, state, host)

  monkeypatch.setattr(ckpt_lib.RunCheckpointer, "save", full_at_4)
  workdir = tmp_path / "run"
  with pytest.raises(DiskFullError) as info:
    run.run(small_config(), workdir)
  assert str(info.value) == (
      f"no space left on {workdir.absolute() / 'checkpoints' / '4'} while writing "
      f"checkpoint 4; the run can be resumed: free space and rerun the same command")
  steps = [r["step"] for r in rundir.read_metrics(workdir / "metrics.jsonl").records]
  assert steps == [0, 1, 2, 3, 4] and not (workdir / "DONE").exists()

  monkeypatch.setattr(ckpt_lib.RunCheckpointer, "save", real_save)
  last = run.run(small_config(), workdir)  # resumes from checkpoint 2
  assert last["step"] == 4 and (workdir / "DONE").exists()
  steps = [r["step"] for r in rundir.read_metrics(workdir / "metrics.jsonl").records]
  assert steps == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("max_lag,caches,concurrency", [
    (0, r"8 prompts x 16 \+ 32 rows x 8 positions", ""),
    (1, r"4 prompts x 16 \+ 8 rows x 8 positions; 8 prompts x 16 \+ 32 rows x 8 positions",
     ", 2 generate calls at once")])
def test_trainer_and_sampler_over_the_device_fail_before_the_first_update(
    tmp_path, monkeypatch, max_lag, caches, concurrency):
  """On an accelerator that cannot hold them (a device memory patched in: CPU
  reports none), the run stops before the first update naming the numbers. The
  cache is the largest generate call's, laid out as the sampler will (each
  prompt held once beside its rows): the evaluation's 8 problems x k=4 rows
  beside a batch of 8; with PipelineRL both decode at once, beside the
  sampler's own copy of the weights and the update step's temporaries."""
  monkeypatch.setattr(memory, "device_gib", lambda: 1e-5)
  copy = (r" \+ update step's temporaries \(\d\.\d\d GiB\) \+ sampler's weight copy "
          r"\(\d\.\d\d GiB\)" if max_lag else "")
  with pytest.raises(ValueError, match=rf"trainer \(\d\.\d\d GiB\){copy} \+ sampler KV "
                     rf"cache \(\d\.\d\d GiB per device: {caches}; \d\.\d\d MiB per row of "
                     rf"24 positions{concurrency}\) = .* > device memory 0\.00 GiB; not one "
                     rf"cache row per device fits beside the trainer"):
    run.run(small_config(**{"rl.pipeline.max_lag": max_lag}), tmp_path / "run")
  assert not (tmp_path / "run" / rundir.CHECKPOINT_DIR).exists()


def test_the_memory_check_sizes_evaluation_by_the_validation_prompts(tmp_path, monkeypatch):
  """Validation prompts longer than the training set's take a wider prompt bucket
  in the evaluation's cache (32 positions here, against training's 16)."""
  longer = tmp_path / "longer.jsonl"
  write_jsonl([Problem(f"l{i}", "1+" * 10 + f"{i}=", str(10 + i)) for i in range(8)], longer)
  monkeypatch.setattr(memory, "device_gib", lambda: 1e-5)
  with pytest.raises(ValueError, match=r"per device: 8 prompts x 32 \+ 32 rows x 8 positions"):
    run.run(small_config(**{"data.val": f"longer={longer}"}), tmp_path / "run")


def test_main_prints_one_line_and_exits_2(tmp_path):
  repo = pathlib.Path(__file__).resolve().parents[1]
  argv = [sys.executable, "-m", "isojax.main", "--config=experiments/tiny.py:bp=4,n=1,budget=64",
          f"--workdir={tmp_path / 'x1'}"]
  env = {**os.environ, "PYTHONPATH": str(repo)}
  proc = subprocess.run(argv, cwd=repo, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr
  assert proc.stderr.strip().splitlines()[-1] == (
      "isojax.main: error: n=1 rollouts per problem: config.rl.adv_estimator='grpo' needs "
      "n >= 2 (below, its per-problem baseline is undefined or is the reward itself, "
      "every advantage 0); raise n or use one of ['gae'] (--verbose prints the traceback)")
  assert "Traceback" not in proc.stderr and not (tmp_path / "x1").exists()
  proc = subprocess.run(argv + ["--verbose"], cwd=repo, env=env, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 2 and "Traceback" in proc.stderr


_AFTER_UPDATE_1 = (r", i.e. the weights after update 1 give inf/NaN.*"
                   r"config.rl.lr_base=2e-05.*Lower config.rl.lr_base")


# PipelineRL may sample step 2's batch with the initial weights, before update 1.
@pytest.mark.parametrize("max_lag, advice", [
    (0, _AFTER_UPDATE_1), (2, f"({_AFTER_UPDATE_1}| with the initial weights)")])
def test_weights_that_sample_non_finite_logprobs_stop_with_advice(tmp_path, monkeypatch,
                                                                  max_lag, advice):
  # What a far too large learning rate does: an update with finite loss, gradient
  # and weights after which the policy's log-probs overflow. The run stops at the
  # next step naming the learning rate, instead of a Batch validation error.
  from isojax.rollout.jax_sampler import JaxSampler
  real_generate, calls = JaxSampler.generate, []

  def overflowing(self, prompt_ids, *, n, **kw):
    out = real_generate(self, prompt_ids, n=n, **kw)
    if n == 2:  # training samples (evals draw k = 4)
      calls.append(1)
      if len(calls) == 2:
        out = dataclasses.replace(out, logprobs_BxT=np.full_like(out.logprobs_BxT, -np.inf))
    return out

  monkeypatch.setattr(JaxSampler, "generate", overflowing)
  # PipelineRL samples step 2's batch while update 1 may still run: the step is the
  # batch's, the weights those its tokens' labels name.
  with pytest.raises(run.NonFiniteLossError,
                     match=r"stopping at step 2: the sampler's log-probs are not "
                           rf"finite{advice}"):
    run.run(small_config(**{"rl.pipeline.max_lag": max_lag}), tmp_path / "run")


def test_initial_weights_that_sample_non_finite_logprobs_do_not_blame_the_lr(tmp_path,
                                                                            monkeypatch):
  from isojax.rollout.jax_sampler import JaxSampler
  real_generate = JaxSampler.generate

  def overflowing(self, prompt_ids, *, n, **kw):
    out = real_generate(self, prompt_ids, n=n, **kw)
    return dataclasses.replace(out, logprobs_BxT=np.full_like(out.logprobs_BxT, np.nan))

  monkeypatch.setattr(JaxSampler, "generate", overflowing)
  with pytest.raises(run.NonFiniteLossError,
                     match=r"stopping at step 1: .* not finite with the initial weights "
                           r"\(no update has run\).*config.model.dtype") as e:
    run.run(small_config(), tmp_path / "run")
  assert "lr_base" not in str(e.value)


def test_drop_too_long_leaves_problems_out_with_a_count_in_the_log(caplog):
  from isojax import run_setup
  from isojax.data import Problem
  from isojax.models import Tokenizer
  tokenizer = Tokenizer.from_pretrained(run_setup.BASE_MODEL_DIR)
  train = [Problem(f"t{i}", f"{i}+1=", str(i + 1)) for i in range(5)]
  train[3] = Problem("t3", "12+34=" * 20, "1")
  val = [Problem("v0", "2+2=", "4"), Problem("v1", "1+1=" * 40, "2")]
  config = small_config(**{"data.drop_too_long": True})
  caplog.set_level("WARNING")
  kept, ids = run_setup.fit_context(config, tokenizer, 64, 8, train, "training")
  kept_val, _ = run_setup.fit_context(config, tokenizer, 64, 8, val, "validation")
  assert [p.id for p in kept] == ["t0", "t1", "t2", "t4"] and [p.id for p in kept_val] == ["v0"]
  assert len(ids) == 4
  assert any("left out 1 of 5 training problems" in m for m in caplog.messages)
  assert any("left out 1 of 2 validation problems" in m for m in caplog.messages)
  with pytest.raises(ValueError, match="no validation problem fits the model's context"):
    run_setup.fit_context(config, tokenizer, 64, 8, val[1:], "validation")
  config.data.drop_too_long = False
  with pytest.raises(ValueError, match=r"problem 't3' has a prompt of \d+ tokens > the "
                                       r"limit of 56"):
    run_setup.fit_context(config, tokenizer, 64, 8, train, "training")


@pytest.mark.parametrize("args, expect", [
    (["--config=experiments/tiny.py", "--config.sampler.max_tokes=3"],
     'isojax.main: error: a --config.* override names no config field: max_tokes Did you '
     'mean "max_tokens" instead of "max_tokes"?'),
    (["--config=experiments/tiny.py:bp=abc"],
     "isojax.main: error: flag --config=experiments/tiny.py:bp=abc: Error whilst parsing "
     "config file: ValueError: config argument bp='abc': expected int, got str"),
    (["--config=experiments/tiny.py", "--dry_run", "--device_memory_gib=0"],
     "isojax.main: error: flag --device_memory_gib=0.0: --device_memory_gib must be > 0 "
     "(GiB of one accelerator)"),
])
def test_main_config_typos_are_one_line(tmp_path, args, expect):
  repo = pathlib.Path(__file__).resolve().parents[1]
  proc = subprocess.run([sys.executable, "-m", "isojax.main", *args,
                         f"--workdir={tmp_path / 'x'}"], cwd=repo, capture_output=True,
                        text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(repo)})
  assert proc.returncode == 2 and proc.stderr.strip() == expect, proc.stderr


@pytest.mark.parametrize("field, value, match", [
    ("sampler.top_p", 0.0, r"config.sampler.top_p=0.0 must be in \(0, 1\]"),
    ("sampler.top_p", 1.5, r"config.sampler.top_p=1.5 must be in \(0, 1\]"),
    ("sampler.top_k", -1, r"config.sampler.top_k=-1 must be None or an int >= 0"),
    ("sampler.top_p", 0.9, r"config.sampler.top_p=0.9, top_k=0: the trainer scores rollouts"),
    ("sampler.top_k", 50, r"top_k=50: .* renormalise .* \(set top_p=1.0, top_k=0\)"),
    ("sampler.temperature", -0.5, r"config.sampler.temperature=-0.5 must be a number >= 0"),
    ("eval.temperature", float("nan"), r"config.eval.temperature=nan must be a number"),
    ("eval_steps", (0, 2), r"config.eval_steps=\(0, 2\): .* in \[1, M=4\]; not \[0\]"),
    ("eval_steps", (2, 5), r"config.eval_steps=\(2, 5\): .* in \[1, M=4\]; not \[5\]"),
    ("eval_steps", ("abc",), r"config.eval_steps=\('abc',\): .*; not \['abc'\]"),
    ("eval_steps", (2.5,), r"not \[2.5\]"),
    ("eval_every", -1, r"config.eval_every=-1 must be an integer >= 0"),
    ("evals_per_doubling", -2, r"config.evals_per_doubling=-2 must be an integer >= 0"),
    ("model.attention", "cudnn", r"config.model.attention: .*'cudnn' needs a GPU and 16-bit"),
    ("model.remat", "sometimes", r"^config.model.remat='sometimes': expected one of "),
    ("rl.adv_estimator", "bogus", r"^config.rl.adv_estimator='bogus'; choose from \['batch'"),
    ("rl.lr_rule", "cubic", r"^config.rl.lr_rule='cubic'; choose from"),
    ("rl.agg", "bogus", r"^config.rl.agg='bogus'; choose from"),
    ("seed", -1, r"config.seed=-1 must be an integer >= 0"),
    ("model.param_dtype", "bfloat16", r"config.model.param_dtype='bfloat16': the trained "
     r"\(master\) weights must be float32"),
    ("seed", 2**32 + 5, r"config.seed=4294967301 must be below 2\*\*32: .* seed 5$"),
    ("data.split_seed", -1, r"config.data.split_seed=-1 must be an integer >= 0"),
    ("data.num_train", -5, r"config.data.num_train=-5 must be"),
    ("rl.micro_batch", -4, r"config.rl.micro_batch=-4 must be an integer >= 0"),
    ("eval.num_train", -1, r"config.eval.num_train=-1 must be an integer >= 0"),
    ("eval.batch_problems", -1, r"config.eval.batch_problems=-1 must be an integer >= 0"),
])
def test_sampling_settings_and_eval_steps_fail_before_config_json(tmp_path, field, value,
                                                                   match):
  # The sampler would refuse them only at its first call, after config.json was
  # written: the corrected command would then be refused as "a different config".
  with pytest.raises(ValueError, match=match):
    run.run(small_config(**{field: value}), tmp_path / "run")
  assert not (tmp_path / "run").exists()
  run.plan_run(small_config(eval_steps=(1, 4)))


def test_a_second_process_in_the_workdir_is_refused(tmp_path):
  workdir = tmp_path / "run"
  workdir.write_text("notes\n")
  with pytest.raises(ValueError, match=rf"--workdir {workdir} is a file, not a run dir"):
    run.run(small_config(), workdir)
  workdir.unlink()
  workdir.mkdir()
  held = rundir.lock_run_dir(workdir)  # a separate open: flock refuses it like a process
  try:
    with pytest.raises(ValueError, match=rf"{workdir} is in use by run {os.getpid()} on .*: "
                                         r"two runs in one directory would mix"):
      run.run(small_config(), workdir)
    assert sorted(os.listdir(workdir)) == [rundir.RUN_LOCK_FILE]
  finally:
    os.close(held)


def test_done_is_written_before_the_run_directory_is_unlocked(tmp_path, monkeypatch):
  # Unlocked before DONE, a second run started in between would find the run
  # unfinished and free, and resume it.
  workdir = tmp_path / "run"
  monkeypatch.setattr(run, "train_loop", lambda *args, **kwargs: {"step": 4})
  real_write, lock_free = run.write_json, []

  def probe_lock_then_write(path, obj):
    if path.name == rundir.DONE_FILE:
      fd = files.try_flock(workdir / rundir.RUN_LOCK_FILE, "probe")
      lock_free.append(fd is not None)
      if fd is not None:
        os.close(fd)
    real_write(path, obj)

  monkeypatch.setattr(run, "write_json", probe_lock_then_write)
  assert run.run(small_config(), workdir) == {"step": 4}
  assert lock_free == [False] and rundir.is_done(workdir)
  os.close(rundir.lock_run_dir(workdir))  # and released once DONE is on disk


@pytest.mark.parametrize("text, what", [('{"bp": 4, "n"', "is not valid JSON"),
                                        ("[]", "holds a JSON list, not the object")])
def test_a_damaged_config_json_or_checkpoints_without_one_are_named(tmp_path, text, what):
  workdir = tmp_path / "run"
  (workdir / "checkpoints" / "2").mkdir(parents=True)
  with pytest.raises(ValueError, match=rf"{workdir} holds checkpoints .* but no "
                                       r"config.json: .* not resumed"):
    run.run(small_config(), workdir)
  (workdir / "config.json").write_text(text)
  with pytest.raises(ValueError, match=rf"{workdir / 'config.json'} {what}"):
    run.run(small_config(), workdir)


def test_a_damaged_checkpoint_names_the_step_to_remove(tmp_path):
  config, workdir = small_config(checkpoint_every=2), tmp_path / "run"
  run.run(config, workdir)
  (workdir / "DONE").write_text('{"step": 4, "la')
  with pytest.raises(ValueError, match=rf"{workdir / 'DONE'} is not valid JSON"):
    run.run(config, workdir)
  (workdir / "DONE").unlink()
  for chunk in (workdir / "checkpoints" / "4" / "state").rglob("d/*"):
    chunk.write_bytes(chunk.read_bytes()[:8])  # a copy cut short
  with pytest.raises(ValueError, match=rf"checkpoint 4 in {workdir / 'checkpoints'} cannot "
                                       rf"be restored \(.*\); if it is damaged, remove "
                                       rf"{workdir / 'checkpoints' / '4'} to resume from "
                                       r"step 2"):
    run.run(config, workdir)
  shutil.rmtree(workdir / "checkpoints" / "4")
  assert run.run(config, workdir)["step"] == 4 and (workdir / "DONE").exists()
