"""Tiny random transformers (PyTorch) models saved as HF directories, the reference."""

import numpy as np
import pytest
import torch
import transformers

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6)

# Llama with plain RoPE; Llama with Llama-3 rope scaling (original context 16 so
# positions < 64 are affected); Qwen2 (q/k/v bias); Qwen3 (q/k norm, head_dim 24 !=
# 64/4); Qwen3 with tied embeddings.
FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**COMMON, max_position_embeddings=64),
    "llama3": lambda: transformers.LlamaConfig(
        **COMMON, max_position_embeddings=256, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, rope_theta=1000000.0),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=24),
    "qwen3_tied": lambda: transformers.Qwen3Config(**COMMON, head_dim=24,
                                                   tie_word_embeddings=True),
}


def make_torch_model(family: str, seed: int = 0):
  """A float32 transformers model whose norms and biases are random too (not 1/0),
  so a swapped or ignored norm/bias tensor changes the logits."""
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(FAMILIES[family]()).float().eval()
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.05 * torch.randn_like(p))
  return model


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory):
  """family -> (torch model, directory it was saved to with save_pretrained)."""
  made = {}

  def get(family):
    if family not in made:
      model = make_torch_model(family)
      path = tmp_path_factory.mktemp(family)
      model.save_pretrained(path)
      made[family] = (model, path)
    return made[family]

  return get


def _torch_logits(model, ids_BxT) -> np.ndarray:
  with torch.no_grad():
    return model(torch.as_tensor(np.asarray(ids_BxT), dtype=torch.long)).logits.numpy()


@pytest.fixture(scope="session")
def torch_logits():
  """(torch model, ids [B, T]) -> float32 logits [B, T, V] as numpy."""
  return _torch_logits


@pytest.fixture(scope="session")
def hf_config():
  """family -> a fresh transformers config object."""
  return lambda family: FAMILIES[family]()
