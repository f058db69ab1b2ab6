"""Problem sources (isojax/data/sources.py): JSONL, Parquet, datasets on disk."""

import json

import pytest

from isojax.data import (Problem, encode_prompts, load_jsonl, load_problems,
                         problems_digest, write_jsonl)
from isojax.data.sources import Fields

ROWS = [{"question": "1+1=", "solution": 2, "uid": "a"},
        {"question": "2+2=", "solution": "4", "uid": "b"}]


def _write_jsonl(path, rows, extra_lines=()):
  with open(path, "w") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")
    for line in extra_lines:
      f.write(line + "\n")


def test_jsonl_fields_and_blank_lines(tmp_path):
  path = tmp_path / "p.jsonl"
  _write_jsonl(path, ROWS, extra_lines=["", "   "])
  got = load_problems(path, prompt_field="question", answer_field="solution",
                      id_field="uid")
  assert got == [Problem("a", "1+1=", "2"), Problem("b", "2+2=", "4")]
  # Default ids are row numbers.
  got = load_jsonl(path, Fields(prompt="question", answer="solution"))
  assert [p.id for p in got] == ["0", "1"]


def test_malformed_jsonl_names_file_and_line(tmp_path):
  path = tmp_path / "bad.jsonl"
  path.write_text(json.dumps(ROWS[0]) + "\n\n" + '{"question": "3+3=", "solution": \n')
  with pytest.raises(ValueError) as e:
    load_problems(path, prompt_field="question", answer_field="solution")
  assert f"{path}:3" in str(e.value)
  assert "malformed JSON" in str(e.value)


def test_missing_field_names_line_and_keys(tmp_path):
  path = tmp_path / "p.jsonl"
  _write_jsonl(path, [ROWS[0], {"question": "x"}])
  with pytest.raises(ValueError) as e:
    load_problems(path, prompt_field="question", answer_field="solution")
  msg = str(e.value)
  assert f"{path}:2" in msg and "'solution'" in msg and "question" in msg


def test_duplicate_ids_rejected(tmp_path):
  path = tmp_path / "p.jsonl"
  _write_jsonl(path, [ROWS[0], ROWS[0]])
  with pytest.raises(ValueError, match="duplicate problem id 'a'"):
    load_problems(path, prompt_field="question", answer_field="solution",
                  id_field="uid")


def test_parquet_nested_fields_and_chat_prompt(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq

  # verl-style layout: chat-message prompt, answer nested under reward_model.
  table = pa.Table.from_pylist([
      {"prompt": [{"role": "system", "content": "be brief"},
                  {"role": "user", "content": "What is 1/2?"}],
       "reward_model": {"ground_truth": "\\frac{1}{2}", "style": "rule"}},
      {"prompt": [{"role": "user", "content": "What is 3?"}],
       "reward_model": {"ground_truth": "3", "style": "rule"}},
  ])
  path = tmp_path / "train.parquet"
  pq.write_table(table, path)
  got = load_problems(path, answer_field="reward_model.ground_truth")
  # The system message leads the prompt: a Problem has one prompt string.
  assert got == [Problem("0", "be brief\n\nWhat is 1/2?", "\\frac{1}{2}"),
                 Problem("1", "What is 3?", "3")]
  with pytest.raises(ValueError, match="row 0.*'answer'"):
    load_problems(path)


def test_datasets_on_disk(tmp_path):
  import datasets

  ds = datasets.Dataset.from_list([r | {"solution": str(r["solution"])} for r in ROWS])
  ds.save_to_disk(str(tmp_path / "single"))
  got = load_problems(tmp_path / "single", prompt_field="question",
                      answer_field="solution", id_field="uid")
  assert got == [Problem("a", "1+1=", "2"), Problem("b", "2+2=", "4")]

  dd = datasets.DatasetDict({"train": ds, "test": ds.select([1])})
  dd.save_to_disk(str(tmp_path / "dict"))
  got = load_problems(tmp_path / "dict", prompt_field="question", answer_field="solution",
                      split="test")
  assert [p.prompt for p in got] == ["2+2="]
  with pytest.raises(ValueError, match="split"):
    load_problems(tmp_path / "dict", prompt_field="question", answer_field="solution")


def test_bad_paths(tmp_path):
  with pytest.raises(ValueError, match="does not exist"):
    load_problems(tmp_path / "nope.jsonl")
  (tmp_path / "x.csv").write_text("a,b\n")
  with pytest.raises(ValueError, match="unknown problem source"):
    load_problems(tmp_path / "x.csv")
  (tmp_path / "d").mkdir()
  with pytest.raises(ValueError, match="datasets"):
    load_problems(tmp_path / "d")


def test_write_jsonl_round_trip(tmp_path):
  probs = [Problem("a", "1+1=", "2"), Problem("b", "S31=", "13")]
  path = tmp_path / "sub" / "out.jsonl"
  write_jsonl(probs, path, extra=[{"avg@16": 0.5}, {"avg@16": 0.0}])
  assert load_problems(path, id_field="id") == probs
  assert json.loads(path.read_text().splitlines()[0])["avg@16"] == 0.5
  # A failed write leaves the file as it was and no temporary beside it.
  with pytest.raises(TypeError, match="not JSON serializable"):
    write_jsonl(probs, path, extra=[{"x": object()}, {}])
  assert load_problems(path, id_field="id") == probs
  assert sorted(p.name for p in path.parent.iterdir()) == ["out.jsonl"]


class _Tok:
  def encode(self, text, add_special_tokens=False):
    return ([7] if add_special_tokens else []) + [ord(c) for c in text]

  def apply_chat_template(self, messages, add_generation_prompt=True):
    assert add_generation_prompt
    text = "|".join(f"{m['role']}:{m['content']}" for m in messages) + "|assistant:"
    return [ord(c) for c in text]


def test_encode_prompts_plain_and_chat():
  probs = [Problem("a", "1+1=", "2")]
  assert encode_prompts(_Tok(), probs) == [[7] + [ord(c) for c in "1+1="]]
  ids = encode_prompts(_Tok(), probs, chat_template=True, system_prompt="sys",
                       prompt_template="{prompt} Put it in \\boxed{}.")
  text = "".join(chr(i) for i in ids[0])
  assert text == "system:sys|user:1+1= Put it in \\boxed{}.|assistant:"


def test_non_utf8_line_names_file_and_line(tmp_path):
  path = tmp_path / "bad.jsonl"
  path.write_bytes(b'{"prompt": "a", "answer": "1"}\n\n'
                   b'{"prompt": "caf\xe9", "answer": "2"}\n')
  with pytest.raises(ValueError, match=rf"{path}:3: not UTF-8 text \(byte 0xe9 at "
                                       r"column 16\)"):
    load_jsonl(path)


def test_a_byte_order_mark_before_the_first_line_is_read_past(tmp_path):
  path = tmp_path / "bom.jsonl"
  path.write_bytes(b'\xef\xbb\xbf{"prompt": "a", "answer": "1"}\r\n'
                   b'{"prompt": "b", "answer": "2"}\r\n')
  assert load_jsonl(path) == [Problem("0", "a", "1"), Problem("1", "b", "2")]
  # Elsewhere it is a character of the line, which JSON refuses.
  path.write_bytes(b'{"prompt": "a", "answer": "1"}\n\xef\xbb\xbf{"prompt": "b"}\n')
  with pytest.raises(ValueError, match=rf"{path}:2: malformed JSON"):
    load_jsonl(path)


def test_numeric_answers_are_written_out_not_in_exponent_notation(tmp_path):
  # str(1e-05) is "1e-05", which the math reward's LaTeX parser reads as e - 5.
  path = tmp_path / "p.jsonl"
  _write_jsonl(path, [{"prompt": f"q{i}", "answer": a}
                      for i, a in enumerate([1e-05, 1e20, 2.0, 0.1, -1.5e-7, 7])])
  got = [p.answer for p in load_jsonl(path, Fields())]
  assert got == ["0.00001", "100000000000000000000", "2", "0.1", "-0.00000015", "7"]


def test_problems_digest_follows_content_and_order_not_where_read():
  a, b = Problem("0", "1+1=", "2", where="x.jsonl:1"), Problem("1", "2+2=", "4")
  digest = problems_digest([a, b])
  assert digest["problems"] == 2 and len(digest["sha256"]) == 64
  assert problems_digest([Problem("0", "1+1=", "2"), b]) == digest  # `where` is no content
  assert problems_digest([b, a]) != digest  # the loader draws by position
  assert problems_digest([a, Problem("1", "2+2=", "5")]) != digest


@pytest.mark.parametrize("bad,message", [
    ('{"prompt": "q", "answer": ""}', "answer is empty"),
    ('{"prompt": "q", "answer": " \\n"}', "answer is empty"),
    ('{"prompt": "q", "answer": [""]}', "answer is empty"),
    ('{"prompt": "q", "answer": NaN}', "answer must be a finite number, got nan"),
    ('{"prompt": "q", "answer": -Infinity}', "answer must be a finite number, got -inf"),
    ('{"prompt": "  ", "answer": "1"}', "prompt .* is empty"),
    ('{"prompt": [{"role": "user", "content": ""}], "answer": "1"}', "prompt .* is empty"),
])
def test_unsolvable_or_empty_problems_rejected_naming_file_and_line(tmp_path, bad,
                                                                    message):
  # An empty answer is matched by an empty response: the reward for saying nothing.
  path = tmp_path / "p.jsonl"
  _write_jsonl(path, [{"prompt": "1+1=", "answer": 2}], extra_lines=[bad])
  with pytest.raises(ValueError, match=rf"{path}:2: {message}"):
    load_jsonl(path, Fields())


def test_chat_prompts_keep_text_parts_and_system_messages_and_refuse_the_rest(tmp_path):
  rows = [
      {"prompt": [{"role": "system", "content": "Answer in \\boxed{}."},
                  {"role": "user", "content": [{"type": "text", "text": "What is"},
                                               {"type": "text", "text": "1+1?"}]}],
       "answer": "2"},
      # Earlier turns' user messages are not the question; the last one is.
      {"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "?"},
                  {"role": "user", "content": "3+3?"}], "answer": "6"},
  ]
  path = tmp_path / "p.jsonl"
  _write_jsonl(path, rows)
  got = [p.prompt for p in load_jsonl(path, Fields())]
  assert got == ["Answer in \\boxed{}.\n\nWhat is\n1+1?", "3+3?"]
  for bad, message in [
      ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
       "chat message 0 has content .*image_url.*; a prompt takes a string or a list "
       "of text parts"),
      ([{"role": "user", "content": 7}], "chat message 0 has content 7"),
      ([{"role": "system", "content": "be brief"}, {"role": "assistant", "content": "4"}],
       r"chat prompt has no user message \(roles \['system', 'assistant'\]\)"),
  ]:
    _write_jsonl(path, rows + [{"prompt": bad, "answer": "1"}])
    with pytest.raises(ValueError, match=rf"{path}:3: {message}"):
      load_jsonl(path, Fields())


def test_repeated_prompts_are_counted_in_a_warning(tmp_path, caplog):
  path = tmp_path / "p.jsonl"
  rows = [{"prompt": "What is 2+2?", "answer": "4"}, {"prompt": "q", "answer": "1"},
          {"prompt": "What is  2+2?\n", "answer": "4"}, {"prompt": "q", "answer": "2"}]
  _write_jsonl(path, rows)
  caplog.set_level("WARNING")
  assert len(load_problems(path)) == 4  # kept: whether they are intended is the user's
  assert (f"{path}: 2 problems repeat an earlier problem's prompt (e.g. {path}:3 "
          f"repeats {path}:1)") in caplog.text


def test_parquet_float_answers_are_the_numbers_stored(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq

  # float32 0.1 widens to 0.10000000149011612; an integer column with a null is
  # stored as floats (12.0); nested float32 leaves too.
  table = pa.table({
      "prompt": ["a", "b", "c", "d"],
      "answer": pa.array([0.1, 2.5, 12.0, 1e-5], type=pa.float32()),
      "nested": pa.array([{"x": [0.3]}] * 4,
                         type=pa.struct([("x", pa.list_(pa.float32()))])),
      "f64": pa.array([12.0, None, 3.25, 7.0], type=pa.float64())})
  path = tmp_path / "f.parquet"
  pq.write_table(table, path)
  assert [p.answer for p in load_problems(path)] == ["0.1", "2.5", "12", "0.00001"]
  assert [p.answer for p in load_problems(path, answer_field="nested.x")] == ["0.3"] * 4
  with pytest.raises(ValueError, match="row 1: answer must be a scalar, got None"):
    load_problems(path, answer_field="f64")


def test_a_key_twice_in_a_jsonl_object_is_refused_naming_file_and_line(tmp_path):
  path = tmp_path / "p.jsonl"
  path.write_text('{"prompt": "q", "answer": "1"}\n'
                  '{"prompt": "q2", "answer": "1", "answer": "2"}\n')
  with pytest.raises(ValueError, match=rf"{path}:2: key 'answer' appears twice"):
    load_jsonl(path)
