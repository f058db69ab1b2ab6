"""Problem sources: JSONL, Parquet and `datasets` saved to disk; prompt encoding.

Every source yields `Problem(id, prompt, answer)` with string fields. Field names are
configurable and may be dotted paths into nested records (verl-style Parquet keeps the
answer at "reward_model.ground_truth"). A prompt stored as a list of chat messages is
reduced to the content of its last user message, led by the content of any system
messages before it (a Problem has one prompt string, which becomes one user message,
and a system message often carries the answer format the reward checks); content as
a list of parts keeps the text parts. The chat template is applied later, at
encoding time, by the tokenizer (`encode_prompts(..., chat_template=True)`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import decimal
import hashlib
import json
import math
import os
import unicodedata
from collections.abc import Iterable, Sequence

import numpy as np
from absl import logging


@dataclasses.dataclass(frozen=True)
class Problem:
  """A prompt with a verifiable answer.

  `where` says where it was read ("file.jsonl:12", "file.parquet: row 3"; "" for
  generated problems), for messages about it; it is not part of its identity.
  """

  id: str
  prompt: str
  answer: str
  where: str = dataclasses.field(default="", compare=False, repr=False)

  def to_dict(self) -> dict:
    return {"id": self.id, "prompt": self.prompt, "answer": self.answer}


def problems_digest(problems: Sequence[Problem]) -> dict:
  """{"problems": count, "sha256": hex digest} of the problems in order (ids,
  prompts, answers): two loads that train alike give the same digest."""
  text = json.dumps([p.to_dict() for p in problems])  # ASCII: lone surrogates too
  return {"problems": len(problems), "sha256": hashlib.sha256(text.encode()).hexdigest()}


def prompt_key(prompt: str) -> str:
  """A prompt as compared for sameness: Unicode NFKC, whitespace runs collapsed to
  one space, ends stripped. Two files rarely agree on trailing newlines, doubled
  spaces or full-width digits, and the model is asked the same question either way."""
  return " ".join(unicodedata.normalize("NFKC", prompt).split())


@dataclasses.dataclass(frozen=True)
class Fields:
  """Which record fields hold the prompt, answer and (optional) id."""

  prompt: str = "prompt"
  answer: str = "answer"
  id: str | None = None


def _lookup(record: dict, path: str):
  value = record
  for part in path.split("."):
    if not isinstance(value, dict) or part not in value:
      raise KeyError(path)
    value = value[part]
  return value


def _content_text(content, i: int) -> str:
  """A chat message's content as text: a string, or the text of its parts
  ([{"type": "text", "text": ...}, ...], OpenAI style) joined by newlines."""
  if isinstance(content, str):
    return content
  if isinstance(content, (list, tuple)) and all(
          isinstance(part, dict) and part.get("type") == "text"
          and isinstance(part.get("text"), str) for part in content):
    return "\n".join(part["text"] for part in content)
  raise TypeError(f"chat message {i} has content {content!r:.80}; a prompt takes a "
                  f"string or a list of text parts")


def _prompt_text(value) -> str:
  if isinstance(value, str):
    return value
  # A chat-format prompt: [{"role": ..., "content": ...}, ...].
  if isinstance(value, (list, tuple)) and value and all(
          isinstance(m, dict) and "content" in m for m in value):
    roles = [m.get("role", "user") for m in value]
    if "user" not in roles:
      raise TypeError(f"chat prompt has no user message (roles {roles})")
    last = len(roles) - 1 - roles[::-1].index("user")
    texts = [_content_text(value[i]["content"], i) for i in range(last + 1)
             if roles[i] == "system"] + [_content_text(value[last]["content"], last)]
    return "\n\n".join(texts)
  raise TypeError(f"prompt must be a string or a list of chat messages, "
                  f"got {type(value).__name__}")


def _answer_text(value) -> str:
  if isinstance(value, (list, tuple)) and len(value) == 1:
    value = value[0]
  if isinstance(value, (dict, list, tuple)) or value is None:
    raise TypeError(f"answer must be a scalar, got {value!r:.80}")
  if isinstance(value, (float, np.floating)):
    if not math.isfinite(value):
      # No response can equal NaN or infinity: the problem could never be solved.
      raise ValueError(f"answer must be a finite number, got {value!r}")
    if value == int(value):
      # 12.0 is 12 (an integer column with nulls is stored as floats).
      return str(int(value))
  # str of an np.float32 is its shortest repr ("0.1", not 0.10000000149011612).
  text = str(value)
  if not text.strip():
    # An empty response would equal it, and earn the reward for saying nothing.
    raise ValueError("answer is empty")
  if isinstance(value, (float, np.floating)) and "e" in text:
    # str(1e-05) is "1e-05", which LaTeX parsing reads as e - 5: write it out.
    text = format(decimal.Decimal(text), "f")
  return text


class MissingFieldError(ValueError):
  """A record lacks the prompt, answer or id field it is read with."""


def record_to_problem(record: dict, fields: Fields, *, where: str, index: int) -> Problem:
  """One record -> Problem; errors name `where` (file and line/row) and the field."""
  if not isinstance(record, dict):
    raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
  try:
    prompt = _prompt_text(_lookup(record, fields.prompt))
    answer = _answer_text(_lookup(record, fields.answer))
    pid = str(_lookup(record, fields.id)) if fields.id else str(index)
    if not prompt.strip():
      raise ValueError(f"prompt ({fields.prompt!r}) is empty")
  except KeyError as e:
    raise MissingFieldError(f"{where}: missing field {e.args[0]!r}; record has keys "
                     f"{sorted(record)}") from None
  except (TypeError, ValueError) as e:
    raise ValueError(f"{where}: {e}") from None
  return Problem(id=pid, prompt=prompt, answer=answer, where=where)


class _DuplicateKeyError(Exception):
  pass


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
  out = {}
  for key, value in pairs:
    if key in out:
      raise _DuplicateKeyError(key)
    out[key] = value
  return out


def _numpy_float32(values: list, arrow_type) -> list:
  """Python values of an Arrow column with its float32 leaves as np.float32, whose
  text is the number stored (0.1), not its float64 widening (0.10000000149011612)."""
  import pyarrow as pa

  if pa.types.is_float32(arrow_type):
    return [None if v is None else np.float32(v) for v in values]
  if pa.types.is_struct(arrow_type):
    fields = {arrow_type.field(i).name: arrow_type.field(i).type
              for i in range(arrow_type.num_fields)}
    return [None if v is None else
            {k: _numpy_float32([x], fields[k])[0] for k, x in v.items()} for v in values]
  if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):
    return [None if v is None else _numpy_float32(v, arrow_type.value_type)
            for v in values]
  return values


def load_jsonl(path: str | os.PathLike, fields: Fields = Fields()) -> list[Problem]:
  """Problems from a JSON-lines file (blank lines are skipped).

  Raises:
    ValueError: naming the file and 1-based line number of a malformed line (bad
      JSON or not UTF-8) or a record that lacks a field.
  """
  path = os.fspath(path)
  problems = []
  # Bytes, decoded line by line: a text-mode file decodes in chunks, and its
  # UnicodeDecodeError could not say which line is broken.
  with open(path, "rb") as f:
    for lineno, raw in enumerate(f, start=1):
      where = f"{path}:{lineno}"
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not UTF-8 text (byte {raw[e.start]:#04x} at "
                         f"column {e.start + 1}); JSON lines files must be UTF-8"
                         ) from None
      if lineno == 1:
        # A byte-order mark (Windows editors, Excel's "UTF-8" export) marks the
        # encoding; it is no part of the first record.
        line = line.removeprefix("\ufeff")
      if not line.strip():
        continue
      try:
        record = json.loads(line, object_pairs_hook=_unique_keys)
      except json.JSONDecodeError as e:
        raise ValueError(f"{where}: malformed JSON ({e.msg} at column "
                         f"{e.colno})") from None
      except _DuplicateKeyError as e:
        raise ValueError(f"{where}: key {e.args[0]!r} appears twice in one object "
                         f"(JSON keeps only the last; which was meant?)") from None
      problems.append(record_to_problem(record, fields, where=where,
                                        index=len(problems)))
  return _check_ids(problems, path)


def load_parquet(path: str | os.PathLike, fields: Fields = Fields()) -> list[Problem]:
  """Problems from a Parquet file (nested struct columns allowed)."""
  import pyarrow.parquet as pq

  path = os.fspath(path)
  try:
    table = pq.read_table(path)
  except Exception as e:  # pyarrow raises several types for a bad file
    raise ValueError(f"{path}: cannot read Parquet ({e})") from e
  columns = {name: _numpy_float32(table.column(name).to_pylist(),
                                 table.schema.field(name).type)
             for name in table.column_names}
  rows = [dict(zip(columns, values)) for values in zip(*columns.values())]
  problems = [record_to_problem(r, fields, where=f"{path}: row {i}", index=i)
              for i, r in enumerate(rows)]
  return _check_ids(problems, path)


def load_datasets_dir(path: str | os.PathLike, fields: Fields = Fields(),
                      split: str | None = None) -> list[Problem]:
  """Problems from a `datasets` dataset saved with `save_to_disk`.

  Args:
    split: required when the directory holds a DatasetDict with several splits.
  """
  import datasets

  path = os.fspath(path)
  ds = datasets.load_from_disk(path)
  if isinstance(ds, datasets.DatasetDict):
    if split is None:
      if len(ds) != 1:
        raise ValueError(f"{path}: a DatasetDict with splits {list(ds)}; "
                         f"choose one with split=")
      split = next(iter(ds))
    if split not in ds:
      raise ValueError(f"{path}: no split {split!r}; available {list(ds)}")
    ds = ds[split]
  problems = [record_to_problem(r, fields, where=f"{path}: row {i}", index=i)
              for i, r in enumerate(ds)]
  return _check_ids(problems, path)


def load_problems(path: str | os.PathLike, *, prompt_field: str = "prompt",
                  answer_field: str = "answer", id_field: str | None = None,
                  split: str | None = None) -> list[Problem]:
  """Problems from a path, dispatching on its form.

  *.jsonl / *.json (JSON lines) -> `load_jsonl`; *.parquet -> `load_parquet`;
  a directory written by `datasets.save_to_disk` -> `load_datasets_dir`.
  """
  problems = _load_problems(os.fspath(path), Fields(prompt_field, answer_field, id_field),
                            split)
  _warn_duplicates(problems, os.fspath(path))
  return problems


def _warn_duplicates(problems: Sequence[Problem], path: str) -> None:
  """Logs how many problems repeat an earlier one's prompt: a repeated problem is
  trained on more often than the rest, which is rarely intended."""
  seen: dict[str, Problem] = {}
  repeats = []
  for p in problems:
    key = prompt_key(p.prompt)
    if key in seen:
      repeats.append((seen[key], p))
    else:
      seen[key] = p
  if repeats:
    first, again = repeats[0]
    logging.warning("%s: %d problems repeat an earlier problem's prompt (e.g. %s "
                    "repeats %s)", path, len(repeats), again.where or again.id,
                    first.where or first.id)


def _load_problems(path: str, fields: Fields, split: str | None) -> list[Problem]:
  if not os.path.exists(path):
    raise ValueError(f"problem source {path!r} does not exist")
  if os.path.isdir(path):
    markers = ("dataset_info.json", "state.json", "dataset_dict.json")
    if not any(os.path.exists(os.path.join(path, m)) for m in markers):
      raise ValueError(f"{path}: a directory but not a `datasets` save_to_disk "
                       f"directory (none of {markers} found)")
    return load_datasets_dir(path, fields, split)
  if path.endswith((".jsonl", ".json")):
    return load_jsonl(path, fields)
  if path.endswith(".parquet"):
    return load_parquet(path, fields)
  raise ValueError(f"{path}: unknown problem source type; expected .jsonl, .json, "
                   f".parquet or a datasets directory")


def write_jsonl(problems: Iterable[Problem], path: str | os.PathLike,
                extra: Sequence[dict] | None = None) -> None:
  """Write problems (plus optional per-problem extra fields) as JSON lines, atomically."""
  path = os.fspath(path)
  problems = list(problems)
  if extra is not None and len(extra) != len(problems):
    raise ValueError(f"extra has {len(extra)} rows for {len(problems)} problems")
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = f"{path}.tmp{os.getpid()}"
  try:
    with open(tmp, "w", encoding="utf-8") as f:
      for i, p in enumerate(problems):
        record = p.to_dict() | (dict(extra[i]) if extra is not None else {})
        f.write(json.dumps(record) + "\n")
    os.replace(tmp, path)
  except BaseException:  # a full disk, or a record json cannot write: no stray tmp
    with contextlib.suppress(OSError):
      os.unlink(tmp)
    raise


def _check_ids(problems: list[Problem], where: str) -> list[Problem]:
  seen = set()
  for p in problems:
    if p.id in seen:
      raise ValueError(f"{where}: duplicate problem id {p.id!r}")
    seen.add(p.id)
  return problems


def encode_prompts(tokenizer, problems: Sequence[Problem] | Sequence[str], *,
                   chat_template: bool = False, system_prompt: str | None = None,
                   prompt_template: str = "{prompt}") -> list[list[int]]:
  """Token ids for each prompt.

  Args:
    tokenizer: isojax.models.Tokenizer (or anything with `encode` and
      `apply_chat_template(messages, add_generation_prompt=True) -> list[int]`).
    chat_template: wrap the prompt as a user message and apply the tokenizer's chat
      template (instruct models); otherwise encode the text with the tokenizer's
      default special tokens (e.g. BOS).
    system_prompt: optional system message (chat template only).
    prompt_template: text in which "{prompt}" is replaced by the prompt, e.g. to
      append an instruction such as "... within \\boxed{}".
  """
  out = []
  for p in problems:
    # str.replace, not str.format: templates often contain literal braces (\boxed{}).
    prompt = p.prompt if isinstance(p, Problem) else p
    text = prompt_template.replace("{prompt}", prompt)
    if chat_template:
      messages = ([{"role": "system", "content": system_prompt}]
                  if system_prompt else []) + [{"role": "user", "content": text}]
      ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
      if hasattr(ids, "keys"):  # a raw transformers tokenizer returns an encoding
        ids = ids["input_ids"]
    else:
      # Raw text gets the tokenizer's own special tokens (BOS for Llama and the
      # synthetic vocabulary, nothing for Qwen), as transformers would add them.
      try:
        ids = tokenizer.encode(text, add_special_tokens=True)
      except TypeError:  # a minimal tokenizer without the keyword
        ids = tokenizer.encode(text)
    out.append([int(t) for t in ids])
  return out
