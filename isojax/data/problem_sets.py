"""A run's problem sets from its data config: the training set and its validation sets.

    train, val_sets = load_problem_sets(config.data, split_dir)
    val_sets["in_domain"]                 # problems of one named validation set

Training sources (`data.train`):
  "synthetic"                 data.num_train generated problems (0: 4096)
  "synthetic:NAME"            a difficulty split of the synthetic task
                              (`split_dir/NAME.jsonl`, written by launch/difficulty_splits.py)
  "mix:NAME:W,NAME:W,..."     a mixture of those splits (§5.3, Fig. 14): data.num_train
                              problems in all, round(W * num_train) from each split
  a JSONL/Parquet/`datasets` path

`data.num_train` > 0 subsamples any other source to that many problems (§5.2's data
size study), with a permutation of `data.split_seed` alone, so every run of a sweep
trains on the same subset; 0 keeps them all.

A path's records hold the prompt and answer under data.prompt_field and
data.answer_field ("prompt", "answer"; dotted paths reach nested fields), and
data.dataset_split names the split of a `datasets` directory with several; the same
layout is read from every path of data.train and data.val.

Validation sets (`data.val`), each evaluated at every eval:
  ""                          data.num_val problems held out of the training source
  "PATH"                      one validation file
  "NAME=SOURCE,NAME=SOURCE"   several named sets, the FIRST is primary
A SOURCE is "heldout" (the held-out set above), "synthetic:NAME" (data.num_val problems
drawn from that split with data.split_seed) or a path (used whole). The primary set
logs val/avg@k, best@k, worst@k as a single set always did; every other set logs
val/NAME/avg@k etc. The mapping is a string, not a ConfigDict: a ConfigDict sorts its
keys, so "the first is primary" could not be read from one, and a string is one
`--config.data.val=...` override on a locked config.

No validation problem is trained on: every training problem whose prompt appears in a
validation set is removed from the training set (before mixing or subsampling), the
prompts compared as `prompt_key` writes them (NFKC, whitespace collapsed), so a
trailing newline does not let one through; the log counts the removed per set.

Errors are raised before any work by `check_data_config` (which `isojax.run_plan.plan_run`
calls): a malformed mapping, a duplicate name or a source that does not exist, each
naming the config field and the key.
"""

from __future__ import annotations

import os
import pathlib
import re
import numpy as np
from absl import logging

from isojax.data.sources import MissingFieldError, Problem, load_problems, prompt_key
from isojax.data.splits import mixture_indices, parse_mix
from isojax.data.synthetic import synthetic_splits

SYNTHETIC = "synthetic"
SPLIT_PREFIX = SYNTHETIC + ":"
MIX_PREFIX = "mix:"
HELDOUT = "heldout"
PRIMARY_NAME = "val"  # the name of the one set of the "" and "PATH" forms
DEFAULT_SYNTHETIC_PROBLEMS = 4096
# A set's name becomes part of its metric keys (val/NAME/avg@4).
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
# Salt of the num_train subsample's permutation: another stream than the held-out
# split's permutation of the same split_seed.
_SUBSAMPLE_STREAM = 1


def parse_val_spec(spec: str) -> list[tuple[str, str]]:
  """config.data.val -> [(name, source)], the primary set first.

  Raises:
    ValueError: naming config.data.val and the offending item, for an item without
      "=", an empty or malformed name (letters, digits, _ . - only), an empty source
      or a duplicate name.
  """
  spec = (spec or "").strip()
  if not spec:
    return [(PRIMARY_NAME, HELDOUT)]
  if "=" not in spec:
    return [(PRIMARY_NAME, spec)]
  out: list[tuple[str, str]] = []
  for item in spec.split(","):
    name, sep, source = (s.strip() for s in item.partition("="))
    if not sep:
      raise ValueError(f"config.data.val={spec!r}: item {item.strip()!r} is not "
                       f"NAME=SOURCE (the mapping form is NAME=SOURCE,NAME=SOURCE)")
    if not _NAME_RE.match(name):
      raise ValueError(f"config.data.val={spec!r}: set name {name!r} must be letters, "
                       f"digits, '_', '.' or '-' (it becomes the metric key "
                       f"val/{name}/avg@k)")
    if not source:
      raise ValueError(f"config.data.val={spec!r}: set {name!r} has an empty source")
    if name in dict(out):
      raise ValueError(f"config.data.val={spec!r}: set name {name!r} appears twice")
    out.append((name, source))
  return out


def metric_prefix(index: int, name: str) -> str:
  """Metric key prefix of the index-th validation set: "val/" for the primary."""
  return "val/" if index == 0 else f"val/{name}/"


def split_file(split_dir: str | os.PathLike, name: str) -> pathlib.Path:
  return pathlib.Path(split_dir) / f"{name}.jsonl"


def _missing_split(field: str, source: str, path: pathlib.Path) -> ValueError:
  return ValueError(
      f"{field}={source!r}: no split file {path}; write the splits of the base model "
      f"with `python launch/difficulty_splits.py --num 4096 --extreme_samples 128 --out "
      f"{path.parent}`, or use data.train='synthetic' or a problem file")


def _mix_weights(train: str) -> dict[str, float]:
  return parse_mix("mix=" + train[len(MIX_PREFIX):])[1]


def check_data_config(d, split_dir: str | os.PathLike) -> list[tuple[str, str]]:
  """Validates config.data without loading a problem; returns `parse_val_spec(d.val)`.

  Raises:
    ValueError: naming the field (and the set's key for data.val) for a malformed
      mapping, a source that does not exist, a mixture that is not one, or a
      num_train/num_val that cannot be.
  """
  specs = parse_val_spec(d.val)
  if d.num_train < 0 or d.num_val < 0:
    raise ValueError(f"config.data.num_train={d.num_train} and config.data.num_val="
                     f"{d.num_val} must be >= 0")
  if d.train.startswith(MIX_PREFIX):
    weights = _mix_weights(d.train)
    if abs(sum(weights.values()) - 1.0) > 1e-6 or min(weights.values()) <= 0:
      raise ValueError(f"config.data.train={d.train!r}: mixture weights must be > 0 "
                       f"and sum to 1")
    for name in weights:
      if not split_file(split_dir, name).exists():
        raise _missing_split("config.data.train", d.train, split_file(split_dir, name))
    if d.num_train < 1:
      raise ValueError(f"config.data.train={d.train!r} needs config.data.num_train > 0 "
                       f"(the mixture's size)")
    held = [name for name, source in specs if source == HELDOUT]
    if held:
      raise ValueError(f"config.data.val={d.val!r}: set {held[0]!r} is held out, but a "
                       f"mixture has no single source to hold out of; name its "
                       f"validation sets, e.g. hard=synthetic:hard")
  elif d.train.startswith(SPLIT_PREFIX):
    path = split_file(split_dir, d.train[len(SPLIT_PREFIX):])
    if not path.exists():
      raise _missing_split("config.data.train", d.train, path)
  # A training file is not looked for here: a launcher may plan a sweep before it
  # writes the file (loading it names the path).
  for name, source in specs:
    field = "config.data.val" + ("" if name == PRIMARY_NAME and len(specs) == 1
                                 else f"[{name!r}]")
    if source == HELDOUT:
      if d.num_val < 1:
        raise ValueError(f"{field} is held out of the training set but "
                         f"config.data.num_val={d.num_val}")
    elif source.startswith(SPLIT_PREFIX):
      path = split_file(split_dir, source[len(SPLIT_PREFIX):])
      if not path.exists():
        raise _missing_split(field, source, path)
      if d.num_val < 1:
        raise ValueError(f"{field}={source!r} draws config.data.num_val problems, but "
                         f"it is {d.num_val}")
    elif not os.path.exists(source):
      raise ValueError(f"{field}: validation source {source!r} does not exist")
  return specs


def _load_split(split_dir, name: str, field: str, source: str) -> list[Problem]:
  path = split_file(split_dir, name)
  if not path.exists():
    raise _missing_split(field, source, path)
  # Split files carry their problems' ids; a mixture of two files needs them.
  return load_problems(path, id_field="id")


def _load_file(d, path: str) -> list[Problem]:
  """A user's problem file (training or validation) with its record layout from the
  config: data.prompt_field / data.answer_field (dotted paths into a record, e.g.
  "reward_model.ground_truth" for veRL-style parquet) and data.dataset_split (the
  split of a `datasets` directory; "" where it holds one)."""
  prompt, answer = d.get("prompt_field", "prompt"), d.get("answer_field", "answer")
  try:
    return load_problems(path, prompt_field=prompt, answer_field=answer,
                         split=d.get("dataset_split", "") or None)
  except MissingFieldError as e:
    raise MissingFieldError(f"{e}; config.data.prompt_field={prompt!r} and "
                            f"config.data.answer_field={answer!r} name the fields "
                            f"read") from None


def _first(problems: list[Problem], count: int, seed: int) -> list[Problem]:
  """`count` problems by a fixed permutation of `seed`, in their original order."""
  order = np.random.default_rng(seed).permutation(len(problems))
  return [problems[i] for i in np.sort(order[:count])]


def _training_source(d, split_dir, hold_out: bool, exclude: set[str]
                     ) -> tuple[list[Problem], list[Problem] | None]:
  """(training problems, the held-out set or None) before any val removal.

  Generated problems are drawn around `exclude` (the named validation sets' prompt
  keys), so that data.num_train of them remain; a generated prompt is its own key."""
  if d.train == SYNTHETIC:
    return synthetic_splits(d.num_train or DEFAULT_SYNTHETIC_PROBLEMS, d.num_val,
                            seed=d.split_seed, exclude=sorted(exclude))
  if d.train.startswith(SPLIT_PREFIX):
    train = _load_split(split_dir, d.train[len(SPLIT_PREFIX):], "config.data.train",
                        d.train)
  else:
    train = _load_file(d, d.train)
  if not train:  # said here, not later as "no training problems left after removing..."
    raise ValueError(f"config.data.train={d.train!r} holds no problems")
  if not hold_out:  # no set asks for it: nothing is taken from training
    return train, None
  if len(train) <= d.num_val:
    raise ValueError(f"{d.train}: {len(train)} problems cannot give data.num_val="
                     f"{d.num_val} held-out problems and a training set")
  order = np.random.default_rng(d.split_seed).permutation(len(train))
  return ([train[i] for i in np.sort(order[d.num_val:])],
          [train[i] for i in order[:d.num_val]])


def _mixture(d, split_dir, val_sets: dict[str, list[Problem]]) -> list[Problem]:
  weights = _mix_weights(d.train)
  pools, flat, owner = {}, [], {}
  for name in sorted(weights):
    probs = _without_val(_load_split(split_dir, name, "config.data.train", d.train),
                         val_sets)
    shared = [p.prompt for p in probs if prompt_key(p.prompt) in owner]
    if shared:
      raise ValueError(f"config.data.train={d.train!r}: splits "
                       f"{owner[prompt_key(shared[0])]!r} and {name!r} share "
                       f"{len(shared)} problems (e.g. {shared[0]!r}); a mixture's "
                       f"weights need disjoint splits")
    owner.update((prompt_key(p.prompt), name) for p in probs)
    pools[name] = np.arange(len(flat), len(flat) + len(probs))
    flat += probs
  try:
    idx = mixture_indices(pools, weights, d.num_train, seed=d.split_seed)
  except ValueError as e:
    raise ValueError(f"config.data.train={d.train!r} with config.data.num_train="
                     f"{d.num_train} (validation problems removed first): {e}") from None
  return [flat[i] for i in idx]


def _without_val(train: list[Problem], val_sets: dict[str, list[Problem]]
                 ) -> list[Problem]:
  """`train` without the validation sets' problems (by `prompt_key`); logs how many
  training problems each set takes out."""
  train_keys = [prompt_key(p.prompt) for p in train]
  exclude: set[str] = set()
  for name, probs in val_sets.items():
    val_keys = {prompt_key(p.prompt) for p in probs}
    removed = sum(k in val_keys for k in train_keys)
    if removed:
      logging.info("config.data.val[%r]: removed %d training problems that are its "
                   "validation problems", name, removed)
    exclude |= val_keys
  return [p for p, k in zip(train, train_keys) if k not in exclude]


def load_problem_sets(d, split_dir: str | os.PathLike
                      ) -> tuple[list[Problem], dict[str, list[Problem]]]:
  """(training problems, {set name: validation problems}, primary set first).

  Args:
    d: config.data (train, val, num_train, num_val, split_seed).
    split_dir: where "synthetic:NAME" split files live.
  """
  specs = check_data_config(d, split_dir)
  mix = d.train.startswith(MIX_PREFIX)
  hold_out = any(source == HELDOUT for _, source in specs)
  named: dict[str, list[Problem]] = {}  # the sets that are not held out of training
  for name, source in specs:
    if source.startswith(SPLIT_PREFIX):
      pool = _load_split(split_dir, source[len(SPLIT_PREFIX):],
                         f"config.data.val[{name!r}]", source)
      named[name] = _first(pool, d.num_val, d.split_seed)
    elif source != HELDOUT:
      named[name] = _load_file(d, source)
  named_keys = {prompt_key(p.prompt) for probs in named.values() for p in probs}
  train, held = (([], None) if mix
                 else _training_source(d, split_dir, hold_out, named_keys))
  val_sets = {name: held if source == HELDOUT else named[name] for name, source in specs}
  for name, source in specs:
    if not val_sets[name]:
      raise ValueError(f"config.data.val[{name!r}]={source!r} holds no problems")
  if mix:
    return _mixture(d, split_dir, val_sets), val_sets
  train = _without_val(train, val_sets)
  if d.num_train and d.train != SYNTHETIC:
    if d.num_train > len(train):
      raise ValueError(f"config.data.num_train={d.num_train} exceeds the {len(train)} "
                       f"training problems of {d.train!r} (after removing validation "
                       f"problems)")
    train = _first(train, d.num_train, [d.split_seed, _SUBSAMPLE_STREAM])
  if not train:
    raise ValueError(f"config.data.train={d.train!r}: no training problems left after "
                     f"removing the validation sets' problems")
  return train, val_sets
