"""A run's config.json against the config of a rerun in the same run directory.

A rerun resumes only the run its workdir holds: every field of the saved
config.json must equal the new resolved config's, or the rerun is refused,
naming the fields. Two kinds of difference are not a different run:
  * a field added to the run schema (`experiments/common.py`) after a run started
    is absent from that run's config.json. `ADDED_FIELDS` declares, for each such
    field, the value that does what isojax did before the field existed; a saved
    config that lacks the field resumes when the new config holds exactly that
    value;
  * `rundir.RUNTIME_FIELDS` say where the run's services are and how long to
    wait for them, and the `sweep.` fields which study the run is a point of, not
    what it computes: a rerun may change them (a requeued SLURM task's vLLM
    server listens on another port; a study's grid may grow).
config.json is then rewritten with the new config.
"""

from __future__ import annotations

import json
import pathlib
import shlex
from typing import Any

from absl import logging

from isojax.rollout.interruption import DEFAULT_PHRASE
from isojax.rundir import CHECKPOINT_DIR, CONFIG_FILE, is_runtime_field, read_json_object

# Fields of the run schema added after isojax wrote its first config.json, each
# with the value its absence means: what the code did before the field existed.
# ADDING A FIELD TO experiments/common.py MEANS ADDING IT HERE, with that value
# (not necessarily the new default), or no run started before it can resume.
# A field read as `config.x.get(name, fallback)` declares its fallback.
ADDED_FIELDS: dict[str, Any] = {
  "eval_steps": (),  # evaluations at eval_every (and the end) only
  "evals_per_doubling": 0,  # no log-spaced evaluations
  # The one implementation before the field ("auto", its default, is cuDNN on GPU).
  "model.attention": "xla",
  "model.lm_head_fp32": True,  # load_pretrained's default when no field passed it
  "data.drop_too_long": False,  # no problem left out (one too long fails at load)
  "data.drop_solved_above": 0.0,  # no prompt retired
  # The record layout the loader read before these were fields.
  "data.prompt_field": "prompt",
  "data.answer_field": "answer",
  "data.dataset_split": "",
  "sampler.vllm_weights_dir": "",  # weight snapshots in a temp dir of this host
  # The vLLM client's built-in timeouts, before they were fields.
  "sampler.vllm_connect_timeout_s": 5.0,
  "sampler.vllm_probe_timeout_s": 30.0,
  "sampler.vllm_request_timeout_s": 600.0,
  "sampler.max_rows": 0,  # every rollout of a batch decoded at once (.get(...) or None)
  "sampler.kv_budget_gib": 0.0,  # no KV-cache budget (.get(...) or None)
  "sampler.decode_chunk": 0,  # one decode call per batch (.get(...) or None)
  "sampler.server_devices": 0,  # device-hours count the trainer's devices only
  # No forced length interruption (think_tokens 0); the other two are then unread.
  "sampler.interrupt_think_tokens": 0,
  "sampler.interrupt_answer_tokens": 0,
  "sampler.interrupt_phrase": DEFAULT_PHRASE,
  "rl.n_est": 0,  # the baseline over the n trained rollouts
  "rl.logits_chunk": None,  # the lm head over all positions at once
  "rl.off_policy_k": 1,  # on-policy (run_plan.check_off_policy_k's fallback)
  "rl.pipeline.max_lag": 0,  # the synchronous loop (run_plan.check_max_lag's fallback)
  # The critic is read only with rl.adv_estimator = "gae", which came with it: a run
  # without these fields never read them; their defaults are declared.
  "critic.path": "",
  "critic.lr_base": 1e-5,
  "critic.warmup_steps": 0,
  "critic.gamma": 1.0,
  "critic.lam": 1.0,
  "critic.whiten": True,
  "critic.cliprange_value": 0.5,
  "critic.value_coef": 1.0,
}


def check_run_dir(workdir: pathlib.Path, resolved: dict, *, resumable: bool = True
                  ) -> list[str]:
  """`check_saved_config` of the run directory's config.json, if it has one.

  Checkpoints without a config.json are refused: their run's config is unknown,
  and resuming them under another would mix two runs in one record. A run that
  is not `resumable` (it never completed a checkpoint: it died in its first
  steps, say out of memory) starts afresh and empties its metrics, so a config
  that differs from its config.json is not held against it: the differences are
  logged and the whole file is rewritten (the returned list says so).
  """
  if (workdir / CONFIG_FILE).exists():
    try:
      return check_saved_config(workdir / CONFIG_FILE, resolved)
    except ValueError as e:
      if resumable:
        raise
      logging.warning("%s; nothing in %s was checkpointed, so the run starts afresh "
                      "with this config", e, workdir)
      return ["every field (a fresh start)"]
  ckpts = workdir / CHECKPOINT_DIR
  if ckpts.is_dir() and any(ckpts.iterdir()):
    raise ValueError(f"{workdir} holds checkpoints ({ckpts}) but no {CONFIG_FILE}: the "
                     f"run they belong to is unknown, so they are not resumed; restore "
                     f"its {CONFIG_FILE}, or use a fresh --workdir")
  return []


def check_saved_config(path: pathlib.Path, resolved: dict) -> list[str]:
  """Checks that `resolved` is the config of the run whose config.json is `path`.

  Args:
    path: the run directory's config.json.
    resolved: the new run's resolved config (`run_plan.resolved_config`).

  Returns:
    the fields config.json should be rewritten for (sorted; empty when the two
    configs are equal): the `ADDED_FIELDS` that the saved config lacks and
    `resolved` holds at their declared value, and the runtime fields that
    changed (`rundir.is_runtime_field`). The caller rewrites config.json with
    `resolved` once the run has started, so that the next rerun compares like
    with like.

  Raises:
    ValueError: naming the fields that differ (a field either lacks counts,
      unless it is one of the above); when flags can set every one back (the
      saved value, or for an added field the saved config lacks, what its
      absence means), the message gives them.
  """
  saved, new = flat_config(read_json_object(path)), flat_config(resolved)
  lacking, diff, hints, predated = [], [], [], 0
  for key in sorted(saved.keys() | new.keys()):
    if saved.get(key) == new.get(key):
      continue
    if is_runtime_field(key) and key in new:
      lacking.append(key)
      continue
    if key == "budget.requested" and all(
        saved.get(k) == new.get(k) for k in ("budget.bp", "budget.n", "budget.m")):
      continue  # another budget with the same point (M is floored): the same run
    if key not in saved and key in new and key in ADDED_FIELDS:
      if new[key] == json.dumps(ADDED_FIELDS[key]):
        lacking.append(key)
        continue
      hints.append(f"--config.{key}={_flag_text(ADDED_FIELDS[key])}")
      predated += 1
    elif key in saved and key in new and not _derived(key):
      hints.append(f"--config.{key}={_flag_text(json.loads(saved[key]))}")
    diff.append(key)
  if diff:
    hint = ""
    if len(hints) == len(diff):  # every difference can be set back by a flag
      why = [w for w, n in (("the saved values", len(hints) - predated),
                            ("for a field it predates, what its absence means", predated))
             if n]
      hint = f"; it resumes with {' '.join(hints)} ({'; '.join(why)})"
    raise ValueError(f"{path} was written by a run with a different config (differs in "
                     f"{diff[:8]}){hint}; use a fresh --workdir or the same config")
  return lacking


def check_saved_data(path: pathlib.Path, digests: dict, data_config) -> None:
  """Refuses a rerun whose problems differ from those its run started with.

  Args:
    path: the run directory's data.json (absent: a run from before it existed;
      nothing to compare).
    digests: {"train" | "val/NAME": `isojax.data.problems_digest`} of the rerun's
      problems, as kept for the model's context.
    data_config: config.data, for the message.

  Raises:
    ValueError: naming the sets that differ (the config names the same sources,
      but what they load changed: the files, or which prompts fit the model's
      context), or a damaged data.json: the loader's position and the
      validation curve would continue on other problems.
  """
  if not path.exists():
    return
  saved = read_json_object(path)
  if not all(isinstance(v, dict) and {"problems", "sha256"} <= v.keys()
             for v in saved.values()):
    raise ValueError(f"{path} is not what a run writes ({{set: {{problems, sha256}}}}): "
                     f"restore it, or use a fresh --workdir")
  changed = [name for name in sorted(saved.keys() | digests.keys())
             if saved.get(name) != digests.get(name)]
  if changed:
    counts = "; ".join(f"{name}: {_count(saved.get(name))} then, {_count(digests.get(name))} "
                       f"now" for name in changed)
    raise ValueError(
        f"the problems of {changed} are not those this run started with ({counts}; "
        f"data.train={data_config.train!r}, data.val={data_config.val!r}; digests in "
        f"{path}): resuming would continue it on other problems; restore the data (and "
        f"the model's tokenizer and context), or use a fresh --workdir")


def _count(digest) -> str:
  return "absent" if digest is None else f"{digest.get('problems')} problems"


def flat_config(config: dict, prefix: str = "") -> dict[str, str]:
  """{dotted field: its value as JSON text} over the leaves of a nested config dict."""
  out = {}
  for k, v in config.items():
    if isinstance(v, dict):
      out.update(flat_config(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = json.dumps(v)
  return out


def _derived(key: str) -> bool:
  """Whether a config.json field is one `run_plan.resolved_config` derives (the budget
  point, the peak learning rate, the length cap): no flag sets it."""
  return key in ("m", "lr", "max_tokens") or key.startswith("budget.")


def _flag_text(value) -> str:
  """`value` as a shell command line writes it after `--config.FIELD=` (quoted when
  it holds spaces, as a list's text does)."""
  return shlex.quote(value if isinstance(value, str) else repr(value))


def check_none_override(config, path: str) -> None:
  """After `--config.PATH=None` set it: raises ValueError unless the field may be
  None. Optional fields are declared in the experiment file with a type
  (`ml_collections.config_dict.placeholder(float)`, `FieldReference(2.0,
  field_type=float)`: rl.clip_dual, rl.tis_cap, rl.max_grad_norm,
  rl.logits_chunk), which None keeps; a plain number's type becomes NoneType."""
  *parents, leaf = path.split(".")
  node = config
  for part in parents:
    node = node[part]
  if node.get_type(leaf) is type(None):
    raise ValueError(f"--config.{path}=None: {path} is not an optional field (only "
                     f"fields the experiment file declares with a type, such as "
                     f"rl.tis_cap or rl.clip_dual, may be None)")
