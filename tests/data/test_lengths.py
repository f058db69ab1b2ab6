"""Prompts that cannot fit the model's context are found when the data is loaded."""

import json

import pytest

from isojax.data import Fields, Problem, encode_prompts, load_jsonl
from isojax.data.lengths import PREFIX_CHARS_PER_TOKEN, fit_prompts
from isojax.models import Tokenizer
from isojax.run_setup import BASE_MODEL_DIR


@pytest.fixture(scope="module")
def tokenizer():
  return Tokenizer.from_pretrained(BASE_MODEL_DIR)


class CountingTokenizer:
  """Records the longest text it was asked to encode."""

  def __init__(self, inner):
    self.inner, self.longest = inner, 0

  def encode(self, text, add_special_tokens=True):
    self.longest = max(self.longest, len(text))
    return self.inner.encode(text, add_special_tokens=add_special_tokens)


def _write(path, prompts):
  path.write_text("".join(json.dumps({"id": f"q{i}", "prompt": p, "answer": "1"}) + "\n"
                          for i, p in enumerate(prompts)))
  return load_jsonl(path, fields=Fields(id="id"))


def test_too_long_prompt_names_file_line_id_length_and_limit(tokenizer, tmp_path):
  problems = _write(tmp_path / "train.jsonl", ["1+2=", "12+34=" * 20, "3*4="])
  n_long = len(encode_prompts(tokenizer, [problems[1]])[0])  # independent count
  context, max_tokens = 64, 8
  assert n_long > context - max_tokens >= len(encode_prompts(tokenizer, [problems[0]])[0])
  with pytest.raises(ValueError) as info:
    fit_prompts(tokenizer, problems, context=context, max_tokens=max_tokens,
                what="training problem")
  msg = str(info.value)
  assert msg.startswith("1 training problem(s) of 3 do not fit the model's context: "
                        f"{tmp_path / 'train.jsonl'}:2: problem 'q1' has a prompt of "
                        f"{n_long} tokens > the limit of 56.")
  assert "config.sampler.max_tokens=8" in msg and "config.data.drop_too_long" in msg


def test_drop_keeps_the_problems_that_fit_with_their_ids(tokenizer, tmp_path):
  problems = _write(tmp_path / "train.jsonl", ["1+2=", "12+34=" * 20, "3*4="])
  kept, ids, out = fit_prompts(tokenizer, problems, context=64, max_tokens=8, drop=True)
  assert [p.id for p in kept] == ["q0", "q2"]
  assert ids == encode_prompts(tokenizer, kept)
  assert [t.problem.id for t in out] == ["q1"] and not out[0].at_least


def test_huge_prompt_is_rejected_without_tokenising_it_whole(tokenizer):
  counting = CountingTokenizer(tokenizer)
  huge = Problem(id="big", prompt="1+2=" * 2_500_000, answer="3")  # 10 MB
  with pytest.raises(ValueError, match=r"problem 'big' has a prompt of more than \d+ "
                                       r"tokens > the limit of 56"):
    fit_prompts(counting, [huge], context=64, max_tokens=8)
  assert counting.longest == PREFIX_CHARS_PER_TOKEN * 56


def test_max_tokens_alone_over_the_context(tokenizer):
  with pytest.raises(ValueError, match="max_tokens=64 leaves no room for a prompt"):
    fit_prompts(tokenizer, [Problem("a", "1+1=", "2")], context=64, max_tokens=64)
