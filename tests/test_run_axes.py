"""The paper's further experiment axes, each as a tiny run of the loop (seconds):

* several validation sets: the primary logs val/avg@4 exactly as a single set
  does, every other set val/NAME/avg@4, best@4, worst@4; a malformed mapping or a
  missing set fails before any work, naming the key;
* data size: data.num_train trains on a seeded subsample, recorded in config.json;
* decoupled baseline: n_est rollouts sampled per problem, all of them in the
  baseline, n trained on, the ledger charging n_est;
* difficulty mixtures: experiments/difficulty_mix.py trains on its mixture and
  logs its three sets.
"""

import json

import numpy as np
import pytest

from experiments import difficulty_mix, tiny
from isojax import assets, run, run_setup
from isojax.data import Problem, write_jsonl
from tests.config_overrides import set_fields
from tests import run_records
from tests.xla_cache import persistent_compilation_cache


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(tmp_path_factory):
  """Shared XLA cache: the runs below reuse the step and sampler shapes."""
  with persistent_compilation_cache(str(tmp_path_factory.mktemp("jax_cache"))):
    yield


def _config(arg="bp=4,n=4,budget=48", **overrides):
  """experiments/tiny.py shrunk to seconds: 32 val problems, 3 updates."""
  c = tiny.get_config(arg)
  c.data.num_val = 32
  c.eval.num_train = 0
  c.eval_every = 2
  c.checkpoint_every = 100
  return set_fields(c, overrides)




@pytest.fixture
def captured(monkeypatch):
  """The parts each run builds and the batches its step gets."""
  seen = {"parts": [], "batches": []}
  build = run_setup.build_parts

  def build_and_watch(config, run_plan):
    parts = build(config, run_plan)
    step = parts.train_step

    def watched(state, batch):
      seen["batches"].append(batch)
      return step(state, batch)

    parts.train_step = watched
    seen["parts"].append(parts)
    return parts

  monkeypatch.setattr(run_setup, "build_parts", build_and_watch)
  return seen


@pytest.fixture(scope="module")
def ood_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("ood") / "ood.jsonl"
  write_jsonl([Problem(f"o{i}", f"{i}+{i}=", str(2 * i)) for i in range(10, 26)], path)
  return path


def test_named_validation_sets(tmp_path, ood_file):
  single = run.run(_config(), tmp_path / "single")
  many = run.run(_config(**{"data.val": f"in_domain=heldout,ood={ood_file}"}),
                 tmp_path / "many")
  # The primary set is the one set of before, evaluated with the same seed on an
  # identically trained policy: its numbers are unchanged.
  for key in ("val/avg@4", "val/best@4", "val/worst@4", "val/response_len"):
    assert many[key] == single[key], key
  evals = [r for r in run_records.records(tmp_path / "many") if "val/avg@4" in r]
  assert [r["step"] for r in evals] == [0, 2, 3]
  for r in evals:
    for m in ("avg@4", "best@4", "worst@4", "response_len"):
      assert f"val/ood/{m}" in r
    assert r["val/ood/best@4"] >= r["val/ood/avg@4"] >= r["val/ood/worst@4"]
  assert not any(k.startswith("val/in_domain/") for r in evals for k in r)
  config = json.loads((tmp_path / "many" / "config.json").read_text())
  assert config["data"]["val"] == f"in_domain=heldout,ood={ood_file}"


@pytest.mark.parametrize("val, match", [
    ("in=heldout,ood", r"config\.data\.val=.*item 'ood' is not NAME=SOURCE"),
    ("in=heldout,ood=/nonexistent/ood.jsonl",
     r"config\.data\.val\['ood'\]: validation source '/nonexistent/ood\.jsonl' does not"),
    ("in=heldout,x=synthetic:medium", r"config\.data\.val\['x'\].*no split file"),
])
def test_bad_validation_mapping_fails_before_any_work(tmp_path, val, match):
  workdir = tmp_path / "run"
  with pytest.raises(ValueError, match=match):
    run.run(_config(**{"data.val": val}), workdir)
  assert not workdir.exists()


def test_num_train_subsample(tmp_path, captured):
  workdir = tmp_path / "d24"
  run.run(_config(**{"data.train": "synthetic:easy", "data.num_train": 24}), workdir)
  parts = captured["parts"][0]
  assert len(parts.train_problems) == 24
  easy = {json.loads(line)["prompt"]
          for line in (_splits_dir() / "easy.jsonl").read_text().splitlines()}
  assert {p.prompt for p in parts.train_problems} <= easy
  assert not {p.prompt for p in parts.train_problems} & {
      p.prompt for p in parts.val_problems}
  config = json.loads((workdir / "config.json").read_text())
  assert config["data"]["num_train"] == 24 and config["data"]["split_seed"] == 0
  assert [r["rollouts"] for r in run_records.records(workdir)] == [0, 16, 32, 48]
  # Three batches of 4 from a set of 24: the loader is half way through epoch 0.
  assert parts.loader.state_dict() == {"epoch": 0, "index": 12, "num_items": 24,
                                       "seed": 0}


def _splits_dir():
  return assets.ASSETS_DIR / "splits"


def test_decoupled_baseline(tmp_path, captured):
  # Bp = 4, n = 4 trained of n_est = 8 sampled: C = 96 buys M = 96 // 32 = 3.
  workdir = tmp_path / "decoupled"
  last = run.run(_config("bp=4,n=4,budget=96", **{"rl.n_est": 8}), workdir)
  config = json.loads((workdir / "config.json").read_text())
  assert config["budget"] == {"requested": 96.0, "bp": 4, "n": 4, "m": 3, "batch": 16,
                              "compute": 96, "n_est": 8}
  records = run_records.records(workdir)
  assert [r["rollouts"] for r in records] == [0, 32, 64, 96]
  assert last["rollouts"] == config["budget"]["compute"]
  # The analysis reads the run: n is the trained n, compute the sampled rollouts.
  from isojax.analysis import read_runs
  (loaded,) = read_runs(tmp_path).runs
  assert (loaded.bp, loaded.n, loaded.m) == (4, 4, 3)
  assert loaded.compute("rollouts").tolist() == [0, 32, 64, 96]
  assert loaded.compute("steps").tolist() == [0, 1, 2, 3]  # an update samples Bp * n_est
  batches = captured["batches"]
  assert len(batches) == 3
  for b in batches:
    assert b.input_ids_BxT.shape[0] == 16
    base_BpxE = np.asarray(b.baseline_rewards_B).reshape(4, 8)
    r_BpxN = np.asarray(b.rewards_B).reshape(4, 4)
    # The trained rewards are n of their prompt's n_est (a sub-multiset).
    for g in range(4):
      pool = list(base_BpxE[g])
      for x in r_BpxN[g]:
        pool.remove(x)
  # The run's step sees the baseline: a group whose trained rewards are all equal
  # but whose baseline is not is not a zero-variance group.
  for b, r in zip(batches, records[1:]):
    base_BpxE = np.asarray(b.baseline_rewards_B).reshape(4, 8)
    zero_var = np.mean(np.all(base_BpxE == base_BpxE[:, :1], axis=1))
    assert r["train/zero_var_frac"] == pytest.approx(zero_var)
    assert r["train/baseline_reward"] == pytest.approx(float(base_BpxE.mean()))
    assert r["train/reward"] == pytest.approx(float(np.mean(b.rewards_B)))


def test_n_est_below_n_is_refused(tmp_path):
  with pytest.raises(ValueError, match=r"config\.rl\.n_est=2 must be 0 \(off\) or >= n=4"):
    run.run(_config(**{"rl.n_est": 2}), tmp_path / "r")
  with pytest.raises(ValueError, match=r"Bp\*n_est = 4\*128 = 512 exceeds b_max = 256"):
    run.run(_config(**{"rl.n_est": 128}), tmp_path / "r")
  assert not (tmp_path / "r").exists()


def test_n_est_indivisible_by_the_batch_shards_is_refused_before_sampling(
    tmp_path, captured):
  # B = 2 * 4 = 8 rows split over 8 devices, but 2 * 6 = 12 baseline rewards
  # cannot be: refused at setup, not after the first batch was sampled.
  config = _config("bp=2,n=4,budget=48", **{"rl.n_est": 6, "mesh.data": 8})
  with pytest.raises(ValueError, match=r"Bp\*n_est = 2\*6 = 12 baseline rollouts per "
                     r"update are not divisible by the 8 batch shards"):
    run.run(config, tmp_path / "r")
  assert captured["batches"] == []


def test_difficulty_mixture_run(tmp_path, captured):
  c = difficulty_mix.get_config("smoke,mix=tri,bp=4,n=4,budget=48")
  c.data.num_val, c.data.num_train = 16, 40
  c.eval.num_train, c.eval_every = 0, 3
  last = run.run(c, tmp_path / "tri")
  for name in ("", "easy/", "very_easy/"):
    for m in ("avg@4", "best@4", "worst@4"):
      assert f"val/{name}{m}" in last
  parts = captured["parts"][0]
  assert [len(v) for v in parts.val_sets.values()] == [16, 16, 16]
  assert list(parts.val_sets) == ["hard", "easy", "very_easy"]
  splits = {name: {json.loads(line)["prompt"] for line in
                   (_splits_dir() / f"{name}.jsonl").read_text().splitlines()}
            for name in ("extremely_hard", "easy_pass128", "very_easy")}
  prompts = [p.prompt for p in parts.train_problems]
  assert len(prompts) == 40
  assert [sum(p in splits[s] for p in prompts) for s in splits] == [20, 10, 10]
  records = run_records.records(tmp_path / "tri")
  assert [r["rollouts"] for r in records] == [0, 16, 32, 48]


def test_decoupled_run_with_two_val_sets_resumes_exactly(tmp_path, ood_file, monkeypatch):
  # A run stopped after its step-2 checkpoint and restarted redoes step 3 as the
  # uninterrupted run did: the n-of-n_est picks and the extra set's eval seed
  # depend on (seed, step) alone.
  overrides = {"rl.n_est": 8, "data.val": f"in_domain=heldout,ood={ood_file}",
               "checkpoint_every": 2}
  run.run(_config("bp=4,n=4,budget=96", **overrides), tmp_path / "whole")
  build = run_setup.build_parts

  def build_and_stop(config, run_plan):
    parts = build(config, run_plan)
    step, calls = parts.train_step, []

    def stop_at_third(state, batch):
      calls.append(1)
      if len(calls) == 3:
        raise KeyboardInterrupt("stopped after the step-2 checkpoint")
      return step(state, batch)

    parts.train_step = stop_at_third
    return parts

  monkeypatch.setattr(run_setup, "build_parts", build_and_stop)
  with pytest.raises(KeyboardInterrupt):
    run.run(_config("bp=4,n=4,budget=96", **overrides), tmp_path / "cut")
  monkeypatch.setattr(run_setup, "build_parts", build)
  run.run(_config("bp=4,n=4,budget=96", **overrides), tmp_path / "cut")
  whole = [run_records.without_timing(r) for r in run_records.records(tmp_path / "whole")]
  assert [run_records.without_timing(r) for r in run_records.records(tmp_path / "cut")] == whole
  assert "val/ood/avg@4" in whole[-1]
