"""Tokenizer: a thin wrapper over transformers.AutoTokenizer from a local directory."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence


class Tokenizer:
  """Token ids in and out as plain Python lists; the HF tokenizer is `.hf`."""

  def __init__(self, hf_tokenizer):
    self.hf = hf_tokenizer

  @classmethod
  def from_pretrained(cls, path) -> Tokenizer:
    """Load from a local HF directory (never the hub)."""
    # Here, not at the top: transformers (and the torch it loads) takes ~4 s to import,
    # which every `import isojax.models` would pay, tokenizer or not.
    from transformers import AutoTokenizer  # pylint: disable=g-import-not-at-top

    path = Path(path)
    if path.is_file():  # e.g. its tokenizer.json
      raise ValueError(f"{path} is a file; pass the tokenizer directory that holds it")
    if not path.is_dir():
      raise ValueError(f"tokenizer directory {path} does not exist")
    try:
      hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
      raise ValueError(f"{path}: cannot load a tokenizer ({e})") from e
    return cls(hf)

  def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
    """Ids of `text`. No BOS/EOS unless asked: callers usually concatenate pieces
    or go through the chat template, which adds its own special tokens."""
    return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

  def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
    return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

  def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                          **kwargs) -> list[int]:
    """Ids of the chat-templated conversation (the template's own special tokens)."""
    if not getattr(self.hf, "chat_template", None):
      raise ValueError("tokenizer has no chat_template")
    text = self.hf.apply_chat_template(messages, tokenize=False,
                                       add_generation_prompt=add_generation_prompt, **kwargs)
    # The template already wrote BOS etc. as text; do not add them twice.
    return self.encode(text, add_special_tokens=False)

  @property
  def eos_token_id(self) -> int | None:
    return self.hf.eos_token_id

  @property
  def bos_token_id(self) -> int | None:
    return self.hf.bos_token_id

  @property
  def pad_token_id(self) -> int | None:
    """The pad id, falling back to EOS (many chat models define no pad token)."""
    pad = self.hf.pad_token_id
    return self.hf.eos_token_id if pad is None else pad

  @property
  def vocab_size(self) -> int:
    """Number of ids the tokenizer can emit (added tokens included)."""
    return len(self.hf)

  def save_pretrained(self, path) -> None:
    self.hf.save_pretrained(str(path))
