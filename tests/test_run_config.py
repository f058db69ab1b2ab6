"""A rerun against the config.json of the run in its workdir.

* every field added to the schema since the first config.json is declared in
  ADDED_FIELDS, with the schema's type and, where the code reads it with a
  fallback, that fallback;
* a config.json that lacks added fields resumes when they hold the declared
  values, from its checkpoint, and is then rewritten whole; any other value, and
  any other difference, is refused naming the fields (and the resuming value),
  except another requested budget that gives the same point;
* a finished run from before the fields is not rerun and keeps its file.
"""

import json

import pytest

from experiments import common, tiny
from isojax import run, run_plan
from isojax.run_config import ADDED_FIELDS, check_saved_config, flat_config
from isojax.rundir import RUNTIME_FIELDS
from tests import run_records
from tests.test_run_failures import small_config

# The fields of the first config.json isojax wrote: any later one needs an entry in
# ADDED_FIELDS, or no run started before it can resume.
FIRST_CONFIG_FIELDS = frozenset([
    "seed", "bp", "n", "budget", "b_max", "eval_every", "checkpoint_every",
    "keep_checkpoints", "max_consecutive_skips",
    "model.path", "model.dtype", "model.param_dtype", "model.remat",
    "mesh.data", "mesh.fsdp", "mesh.tensor",
    "data.train", "data.val", "data.num_val", "data.num_train", "data.split_seed",
    "data.chat_template", "data.reward",
    "sampler.backend", "sampler.temperature", "sampler.top_p", "sampler.top_k",
    "sampler.max_tokens", "sampler.vllm_url",
    "rl.adv_estimator", "rl.adv_std_eps", "rl.kind", "rl.clip_low", "rl.clip_high",
    "rl.clip_dual", "rl.agg", "rl.tis_cap", "rl.kl_coef", "rl.kl_estimator",
    "rl.entropy_coef", "rl.zero_var_filter", "rl.lr_rule", "rl.lr_base", "rl.batch_base",
    "rl.warmup_steps", "rl.weight_decay", "rl.max_grad_norm", "rl.micro_batch",
    "eval.k", "eval.temperature", "eval.num_train", "eval.batch_problems",
    "sweep.study", "sweep.split", "sweep.bp_values", "sweep.n_values", "sweep.budgets",
    "sweep.batch",
])
# Added fields whose reader (of config.rl) falls back to a value when they are absent.
READERS = {"rl.off_policy_k": run_plan.check_off_policy_k,
           "rl.pipeline.max_lag": run_plan.check_max_lag}


def _schema() -> dict:
  return json.loads(json.dumps(common.base_config().to_dict()))


def test_every_field_since_the_first_config_json_is_declared():
  fields = flat_config(_schema())
  assert sorted(fields.keys() - FIRST_CONFIG_FIELDS - ADDED_FIELDS.keys()) == [], (
      "a field added to experiments/common.py needs an entry in "
      "isojax.run_config.ADDED_FIELDS")
  assert sorted(ADDED_FIELDS.keys() - fields.keys()) == []  # no stale entry
  assert not ADDED_FIELDS.keys() & FIRST_CONFIG_FIELDS
  for key, value in ADDED_FIELDS.items():  # the schema's JSON type, or its None
    default = json.loads(fields[key])
    assert default is None or type(json.loads(json.dumps(value))) is type(default), key


def test_declared_values_are_the_readers_fallbacks():
  for key, read in READERS.items():
    rl = common.base_config().rl
    del rl[key.split(".")[1]]  # off_policy_k; pipeline, which came with max_lag
    assert read(rl) == ADDED_FIELDS[key], key
  # Read as `config.sampler.get(name) or None`: none of them caps anything.
  for key in ("sampler.max_rows", "sampler.kv_budget_gib", "sampler.decode_chunk"):
    assert not ADDED_FIELDS[key], key


def _saved(tmp_path, config: dict):
  path = tmp_path / "config.json"
  path.write_text(json.dumps(config))
  return path


def test_only_added_fields_at_their_declared_values_may_be_absent(tmp_path):
  new = _schema()
  old = _schema()
  del old["rl"]["pipeline"], old["critic"]
  lacking = sorted(k for k in ADDED_FIELDS if k.startswith(("rl.pipeline", "critic.")))
  assert check_saved_config(_saved(tmp_path, old), new) == lacking
  assert check_saved_config(_saved(tmp_path, new), new) == []
  new["critic"]["lam"] = 0.95
  new["sampler"]["interrupt_phrase"] = "time's up"
  del old["sampler"]["interrupt_phrase"]
  with pytest.raises(ValueError, match=(
      r"differs in \['critic\.lam', 'sampler\.interrupt_phrase'\]\); it resumes with "
      r"--config\.critic\.lam=1\.0 --config\.sampler\.interrupt_phrase='Okay, time is "
      r"up\. [^']*' \(for a field it predates, what its absence means\)")):
    check_saved_config(_saved(tmp_path, old), new)
  # An undeclared field the saved config lacks is a difference no flag undoes.
  del old["rl"]["kl_coef"], new["sampler"]["interrupt_phrase"]
  with pytest.raises(ValueError, match=r"differs in \['critic\.lam', 'rl\.kl_coef'\]\); "
                                       r"use a fresh"):
    check_saved_config(_saved(tmp_path, old), new)
  # So is a field the new config lacks (declared or not).
  old = _schema()
  del new["rl"]["pipeline"]
  with pytest.raises(ValueError, match=r"differs in \['critic\.lam', 'rl\.pipeline\.max_lag', "
                                       r"'sampler\.interrupt_phrase'\]\); use a fresh"):
    check_saved_config(_saved(tmp_path, old), new)
  # A changed field resumes at its saved value (with the added ones beside it); a
  # derived one (the budget point) has no flag.
  old, new = _schema(), _schema()
  del old["critic"]
  old["eval_every"], old["eval_steps"], new["critic"]["lam"] = 10, [1, 2], 0.95
  with pytest.raises(ValueError, match=r"it resumes with --config\.critic\.lam=1\.0 "
                     r"--config\.eval_every=10 --config\.eval_steps='\[1, 2\]' \(the saved "
                     r"values; for a field it predates"):
    check_saved_config(_saved(tmp_path, old), new)
  new["m"] = 7
  with pytest.raises(ValueError, match=r"differs in \[.*'m'\]\); use a fresh"):
    check_saved_config(_saved(tmp_path, old), new)


def test_another_budget_with_the_same_point_is_the_same_run(tmp_path):
  def resolved(budget):  # B = 8: budgets 24 and 31 both give M = 3
    config = tiny.get_config("bp=4,n=2,budget=24")
    config.budget = budget  # --config.budget, as a sweep passes each point's compute
    return json.loads(json.dumps(run_plan.resolved_config(config, run_plan.plan_run(config))))

  path = _saved(tmp_path, resolved(24))
  assert check_saved_config(path, resolved(31)) == []
  with pytest.raises(ValueError, match=r"differs in \['budget\.compute', 'budget\.m', "
                                       r"'budget\.requested', 'm'\]\)"):
    check_saved_config(path, resolved(32))


def _strip_fields(workdir) -> bytes:
  """Takes rl.pipeline.max_lag and sampler.decode_chunk out of `workdir`'s
  config.json, as a run started before either existed wrote it; returns the file."""
  path = workdir / "config.json"
  saved = json.loads(path.read_text())
  del saved["rl"]["pipeline"], saved["sampler"]["decode_chunk"]
  path.write_text(json.dumps(saved, indent=1, sort_keys=True) + "\n")
  return path.read_bytes()


def test_a_run_from_before_two_fields_resumes_with_their_values(tmp_path, monkeypatch):
  workdir = tmp_path / "run"
  run_records.stop_before_update(monkeypatch, 3)  # checkpoint 2 is the last
  with pytest.raises(KeyboardInterrupt):
    run.run(small_config(), workdir)
  monkeypatch.undo()
  old = _strip_fields(workdir)

  with pytest.raises(ValueError, match=(
      r"differs in \['rl\.pipeline\.max_lag'\]\); it resumes with "
      r"--config\.rl\.pipeline\.max_lag=0 \(for a field it predates")):
    run.run(small_config(**{"rl.pipeline.max_lag": 2}), workdir)
  with pytest.raises(ValueError, match=r"differs in \['rl\.kl_coef'\]\); it resumes with "
                     r"--config\.rl\.kl_coef=0\.001 \(the saved values\)"):
    run.run(small_config(**{"rl.kl_coef": 0.5}), workdir)
  assert (workdir / "config.json").read_bytes() == old  # refusals write nothing

  updates, update_on = [], run.update_on

  def counted(parts, state, sampled, **kw):
    updates.append(sampled.step)
    return update_on(parts, state, sampled, **kw)

  monkeypatch.setattr(run, "update_on", counted)
  # Where the services are may change too (a requeued task's vLLM port).
  runtime = {"sampler.vllm_url": "http://127.0.0.1:8123", "keep_checkpoints": 3}
  last = run.run(small_config(**runtime), workdir)
  assert updates == [3, 4] and last["step"] == 4  # continued from checkpoint 2
  assert [r["step"] for r in run_records.records(workdir)] == [0, 1, 2, 3, 4]
  config = small_config(**runtime)
  assert json.loads((workdir / "config.json").read_text()) == run_plan.resolved_config(
      config, run_plan.plan_run(config))
  assert not list(workdir.glob("*.tmp"))

  # Finished: a rerun does nothing and leaves an older config.json as it is.
  old = _strip_fields(workdir)
  assert run.run(small_config(), workdir) == last and updates == [3, 4]
  assert (workdir / "config.json").read_bytes() == old


def test_a_rerun_may_change_where_its_services_are_not_what_it_computes(tmp_path):
  old = _schema()
  new = _schema()
  new["sampler"]["vllm_url"] = "http://10.0.0.2:8001"
  new["sampler"]["vllm_request_timeout_s"] = 1200.0
  new["keep_checkpoints"] += 1
  new["sweep"]["budgets"] = [1e6, 2e6]  # the study's grid grew
  assert RUNTIME_FIELDS <= flat_config(new).keys()
  assert check_saved_config(_saved(tmp_path, old), new) == [
      "keep_checkpoints", "sampler.vllm_request_timeout_s", "sampler.vllm_url",
      "sweep.budgets"]
  new["sampler"]["temperature"] = 0.7
  with pytest.raises(ValueError, match=r"differs in \['sampler\.temperature'\]\); it "
                     r"resumes with --config\.sampler\.temperature=0\.6 \(the saved"):
    check_saved_config(_saved(tmp_path, old), new)
