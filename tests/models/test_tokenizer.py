"""Tokenizer wrapper on a word-level tokenizer built here (no hub)."""

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from isojax.models import Tokenizer

VOCAB = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "what", "is", "2", "+", "?",
         "4", "<unk>"]
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} "
                 "{{ eos_token }} {% endfor %}{% if add_generation_prompt %}<|assistant|>"
                 "{% endif %}")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
  raw = RawTokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
  raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  fast = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
                                 pad_token="<pad>", unk_token="<unk>",
                                 additional_special_tokens=["<|user|>", "<|assistant|>"])
  fast.chat_template = CHAT_TEMPLATE
  path = tmp_path_factory.mktemp("tok")
  fast.save_pretrained(path)
  return path


def test_encode_decode_and_special_ids(tok_dir):
  tok = Tokenizer.from_pretrained(tok_dir)
  ids = tok.encode("what is 2 + 2 ?")
  assert ids == [5, 6, 7, 8, 7, 9]
  assert tok.decode(ids) == "what is 2 + 2 ?"
  assert tok.encode("what banana") == [5, 11]  # unknown word -> <unk>
  assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 0)
  assert tok.vocab_size == len(VOCAB)
  assert tok.decode([5, 2], skip_special_tokens=True) == "what"


def test_chat_template_gives_ids(tok_dir):
  tok = Tokenizer.from_pretrained(tok_dir)
  messages = [{"role": "user", "content": "what is 2 + 2 ?"}]
  ids = tok.apply_chat_template(messages)
  # <s> <|user|> what is 2 + 2 ? </s> <|assistant|>   (BOS once, from the template)
  assert ids == [1, 3, 5, 6, 7, 8, 7, 9, 2, 4]
  assert tok.apply_chat_template(messages, add_generation_prompt=False) == ids[:-1]


def test_pad_falls_back_to_eos_and_errors(tok_dir, tmp_path):
  tok = Tokenizer.from_pretrained(tok_dir)
  tok.hf.pad_token = None
  assert tok.pad_token_id == tok.eos_token_id == 2
  with pytest.raises(ValueError, match="does not exist"):
    Tokenizer.from_pretrained(tmp_path / "missing")
  with pytest.raises(ValueError, match=r"tokenizer\.json is a file; pass the tokenizer "
                                       r"directory that holds it"):
    Tokenizer.from_pretrained(tok_dir / "tokenizer.json")  # was: "does not exist"
  tok.hf.chat_template = None
  with pytest.raises(ValueError, match="chat_template"):
    tok.apply_chat_template([{"role": "user", "content": "what"}])
