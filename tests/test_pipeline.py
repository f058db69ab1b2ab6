"""PipelineRL-k (config.rl.pipeline.max_lag): the producer thread and the run.

The producer, with a stand-in for sampling and a scripted trainer:
* batch b starts only once b - 1 - k updates are done, and with a slow trainer
  the producer does run k batches ahead;
* it starts no batch past a checkpoint step before that checkpoint is written;
* its errors reach the trainer's `take`; a token older than k updates is refused;
* an in-process sampler gets a copy of the weights (the next update donates them).
The run, on the tiny CPU config with the JAX sampler:
* max_lag = 0 writes what a config without the field writes (tested with
  off_policy_k = 1 in test_run_batches);
* max_lag = 2: every update trains on tokens at most 2 updates old, the ledger
  charges each batch once, ratios are against the sampler;
* stopped after a checkpoint and restarted, it resumes from the drained
  checkpoint and redoes the first update after it exactly;
* a malformed max_lag, or one combined with off_policy_k > 1 or a critic, fails
  before any work naming the field.
"""

import threading
import time
import types

import jax
import numpy as np
import pytest
from flax import nnx

from isojax import pipeline as pipeline_lib
from isojax import run
from isojax.models import Decoder, ModelConfig
from isojax.run_batches import SampledBatch
from tests import run_records
# compilation_cache: test_run's autouse persistent XLA cache, for this module's runs.
from tests.test_run import compilation_cache, tiny_config  # pylint: disable=unused-import

POINT = "bp=4,n=4,budget=96"  # B = 16, M = 6
LAG2 = {"rl.pipeline.max_lag": 2, "sampler.decode_chunk": 4, "eval_every": 100,
        "checkpoint_every": 3, "eval.num_train": 0}


class _Sampler:
  def __init__(self):
    self.pushed = []

  def update_weights(self, model, *, version=None):
    self.pushed.append((version, model))


class _Producer:
  """Stands in for `sample_batch`: records what the pipeline looked like when
  batch b started, and labels its tokens with `version`."""

  def __init__(self, pipeline=None, fail_at=None, stale_at=None):
    self.pipeline, self.fail_at, self.stale_at = pipeline, fail_at, stale_at
    self.started = {}  # b -> (updates done, last checkpoint written)

  def __call__(self, parts, config, step, *, version):
    self.started[step] = (self.pipeline._done, self.pipeline._released)
    if step == self.fail_at:
      raise ValueError(f"sampling batch {step} failed")
    label = 0 if step == self.stale_at else version
    return SampledBatch(step=step, batch=None, rollouts=None, dropped=0, host={},
                        version_BxT=np.array([[-1, label, label]], np.int32))


def _pipeline(monkeypatch, *, max_lag, checkpoint_every=100, last=12, **kw):
  parts = types.SimpleNamespace(sampler=_Sampler())
  p = pipeline_lib.Pipeline(parts, None, first=1, last=last, max_lag=max_lag,
                            checkpoint_every=checkpoint_every, copy_weights=False)
  producer = _Producer(p, **kw)
  monkeypatch.setattr(pipeline_lib, "sample_batch", producer)
  return p.start(model=None), producer


def _train(p, steps, *, update_s=0.0, checkpoint_every=None):
  for step in steps:
    sampled, charged = p.take(step)
    assert sampled.step == step and charged == [sampled]
    time.sleep(update_s)
    p.after_update(step, model=f"weights {step}", eval_due=False)
    if checkpoint_every and step % checkpoint_every == 0:
      assert p.checkpoint_ready(step)
      p.checkpoint_written(step)


@pytest.mark.parametrize("k", [1, 3])
def test_producer_runs_ahead_by_at_most_k(monkeypatch, k):
  p, producer = _pipeline(monkeypatch, max_lag=k)
  _train(p, range(1, 13), update_s=0.03)  # a slow trainer: the producer waits on it
  p.close()
  lead = [b - 1 - done for b, (done, _) in sorted(producer.started.items())]
  assert max(lead) == k and min(lead) >= 0 and len(lead) == 12
  assert [v for v, _ in p.parts.sampler.pushed] == list(range(1, 13))


def test_checkpoint_drains_the_pipeline(monkeypatch):
  p, producer = _pipeline(monkeypatch, max_lag=4, checkpoint_every=4)
  _train(p, range(1, 13), update_s=0.01, checkpoint_every=4)
  p.close()
  for b, (done, released) in producer.started.items():
    assert released >= (b - 1) // 4 * 4, (b, released)  # 5..8 only after checkpoint 4
    assert done >= b - 5


def test_producer_errors_and_stale_tokens_reach_the_trainer(monkeypatch):
  p, _ = _pipeline(monkeypatch, max_lag=2, fail_at=3)
  _train(p, [1, 2])
  with pytest.raises(ValueError, match="sampling batch 3 failed"):
    p.take(3)
  p.close()
  p, _ = _pipeline(monkeypatch, max_lag=2, stale_at=5)
  _train(p, range(1, 5))
  with pytest.raises(pipeline_lib.StaleBatchError, match=r"update 5: .* after 0 updates, "
                                                          r"4 behind.*max_lag=2"):
    p.take(5)
  p.close()


def test_close_stops_a_waiting_producer(monkeypatch):
  p, producer = _pipeline(monkeypatch, max_lag=1)
  _train(p, [1])
  time.sleep(0.05)
  closer = threading.Thread(target=p.close)
  closer.start()
  closer.join(timeout=10)
  assert not closer.is_alive() and max(producer.started) <= 3


def test_in_process_sampler_gets_a_copy_of_the_weights():
  model = Decoder(ModelConfig(architecture="Qwen2ForCausalLM", vocab_size=16,
                              hidden_size=8, intermediate_size=16, num_layers=1,
                              num_heads=2, num_kv_heads=1, head_dim=4),
                  rngs=nnx.Rngs(0))
  parts = types.SimpleNamespace(sampler=_Sampler())
  p = pipeline_lib.Pipeline(parts, None, first=1, last=1, max_lag=1,
                            checkpoint_every=1, copy_weights=True)
  p.after_update(1, model, eval_due=False)
  version, state = parts.sampler.pushed[0]
  assert version == 1
  for trainer, copied in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(state)):
    assert np.array_equal(copied, trainer)
    assert copied.unsafe_buffer_pointer() != trainer.unsafe_buffer_pointer()


def test_malformed_max_lag_fails_before_any_work(tmp_path):
  for bad in (-1,):
    with pytest.raises(ValueError, match=r"config\.rl\.pipeline\.max_lag=-1 must be an "
                                         r"integer >= 0"):
      run.run(tiny_config(POINT, **{"rl.pipeline.max_lag": bad}), tmp_path / "run")
  for other in ({"rl.off_policy_k": 2}, {"rl.adv_estimator": "gae"}):
    with pytest.raises(ValueError, match=r"config\.rl\.pipeline\.max_lag=2 goes with "
                                         r"neither"):
      run.run(tiny_config(POINT, **{"rl.pipeline.max_lag": 2, **other}), tmp_path / "run")
  assert not (tmp_path / "run").exists()
  plan = run.plan_run(tiny_config(POINT, **{"rl.pipeline.max_lag": 2, "rl.clip_high": 0.28}))
  assert plan.stale and plan.max_lag == 2 and plan.loss.clip_high == 0.28


@pytest.fixture(scope="module")
def lag2_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("lag2")
  return workdir, run.run(tiny_config(POINT, **LAG2), workdir)


def test_lag2_run_bounds_the_lag_and_charges_each_batch_once(lag2_run):
  workdir, last = lag2_run
  records = run_records.records(workdir)[1:]
  assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
  assert all(0 <= r["train/policy_lag_max"] <= 2 for r in records)
  assert all(r["train/policy_lag_mean"] <= r["train/policy_lag_max"] for r in records)
  assert [r["rollouts"] for r in records] == [16 * s for s in range(1, 7)]
  assert records[0]["train/policy_lag_max"] == 0  # batch 1: the base model's alone
  assert records[3]["train/policy_lag_max"] == 0  # batch 4: drained at checkpoint 3
  assert all(r["train/skipped"] == 0 for r in records)
  assert "train/approx_kl_old" in last


def test_lag2_resumes_from_the_drained_checkpoint(lag2_run, tmp_path, monkeypatch):
  """Stopped before update 5: checkpoint 3 holds no pending batch, and batch 4 is
  sampled with the weights after update 3 alone (the update waits for it), so the
  restart redoes step 4 exactly; steps 5 and 6 depend on timing, as in any run."""
  reference, _ = lag2_run
  run_records.stop_before_update(monkeypatch, 5)
  with pytest.raises(KeyboardInterrupt):
    run.run(tiny_config(POINT, **LAG2), tmp_path)
  stopped = [run_records.without_timing(r) for r in run_records.records(tmp_path)]
  assert [r["step"] for r in stopped] == [0, 1, 2, 3, 4]
  monkeypatch.undo()
  run.run(tiny_config(POINT, **LAG2), tmp_path)
  resumed = [run_records.without_timing(r) for r in run_records.records(tmp_path)]
  assert resumed[:5] == stopped
  assert [r["step"] for r in resumed] == list(range(7))
  assert [r["rollouts"] for r in resumed] == [
      r["rollouts"] for r in run_records.records(reference)]
  assert all(r["train/policy_lag_max"] <= 2 for r in resumed[1:])


def test_the_memory_check_counts_the_step_with_the_first_updates_compile(
    tmp_path, monkeypatch, caplog):
  """On a device of known memory, PipelineRL's check adds the update step's
  temporaries (the step runs while the sampler decodes), read from a compile
  the first update then runs: the step compiles once."""
  from isojax.rollout import memory as rollout_memory
  monkeypatch.setattr(rollout_memory, "device_gib", lambda: 64.0)  # as on a GPU
  splits, check = [], rollout_memory.check_memory_split
  monkeypatch.setattr(rollout_memory, "check_memory_split",
                      lambda *a, **kw: splits.append(check(*a, **kw)) or splits[-1])
  run_records.stop_before_update(monkeypatch, 2)
  caplog.set_level("INFO")
  with jax.log_compiles(True), pytest.raises(KeyboardInterrupt):
    run.run(tiny_config(POINT, **LAG2), tmp_path)
  (split,) = splits
  assert 0 < split["step_gib"] < 0.1 and split["trainer_gib"] > 0
  assert any(m.startswith("memory per device: trainer state") for m in caplog.messages)
  compiles = [m for m in caplog.messages if m.startswith("Compiling jit(step)")]
  assert len(compiles) == 1, compiles
  # A device that holds all but half the step's share: the error names it.
  rest = split["trainer_gib"] + split["sampler_weights_gib"] + split["kv_gib"]
  monkeypatch.setattr(rollout_memory, "device_gib", lambda: rest + split["step_gib"] / 2)
  with pytest.raises(ValueError, match=r"trainer \(.* GiB\) \+ update step's temporaries"):
    run.run(tiny_config(POINT, **LAG2), tmp_path / "small")


@pytest.mark.parametrize("field, value", [("max_lag", 0), ("max_lag", -1), ("max_lag", 1.5),
                                          ("checkpoint_every", 0), ("first", 0),
                                          ("last", -1)])
def test_bad_sizes_are_refused_by_name(field, value):
  args = {**dict(first=1, last=4, max_lag=1, checkpoint_every=2), field: value}
  with pytest.raises(ValueError, match=rf"Pipeline: {field}={value}; expected an int >="):
    pipeline_lib.Pipeline(types.SimpleNamespace(sampler=_Sampler()), None,
                          copy_weights=False, **args)


def _take_in_thread(p, step):
  """What `p.take(step)` raised, from a thread given 10 s (a hang fails the test)."""
  out = []

  def take():
    try:
      p.take(step)
      out.append(None)
    except ValueError as e:
      out.append(e)

  t = threading.Thread(target=take, daemon=True)
  t.start()
  t.join(timeout=10)
  assert not t.is_alive(), f"take({step}) hung"
  return out[0]


def test_a_batch_that_is_not_coming_fails_the_take(monkeypatch):
  p, _ = _pipeline(monkeypatch, max_lag=1, last=2)
  _train(p, [1, 2])
  assert "updates 1..2" in str(_take_in_thread(p, 3))
  assert "sampled all it had to" in str(_take_in_thread(p, 2))  # taken already
  p.close()
  p, _ = _pipeline(monkeypatch, max_lag=1, last=4)
  _train(p, [1])
  p.close()
  p.take(2)  # sampled before the close: still there
  assert "been closed" in str(_take_in_thread(p, 3))
