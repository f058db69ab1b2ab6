"""HF checkpoint load/save: transformers interop, exact round trips, sharded loading,
and the errors bad checkpoints must raise."""

import json
import os
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.torch import load_file, save_file

from isojax.models import load_pretrained, save_pretrained
from isojax.sharding import make_mesh


def _params(model):
  return {jax.tree_util.keystr(k): np.asarray(v) for k, v in
          jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))}


@pytest.mark.parametrize("family", ["qwen2", "qwen3_tied"])
def test_save_then_transformers_load_gives_identical_model(hf_dir, torch_logits, tmp_path,
                                                          family):
  torch_model, path = hf_dir(family)
  model, cfg = load_pretrained(path)
  out = save_pretrained(model, cfg, tmp_path / "out")
  files = sorted(os.listdir(out))
  assert files == ["config.json", "model.safetensors"], files
  written = json.loads((out / "config.json").read_text())
  assert written["architectures"] == [type(torch_model).__name__]
  assert written["model_type"] == torch_model.config.model_type
  if cfg.tie_word_embeddings:
    assert "lm_head.weight" not in load_file(out / "model.safetensors")
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
  original = torch_model.state_dict()
  for name, tensor in reloaded.state_dict().items():
    assert torch.equal(tensor, original[name]), name
  ids = np.random.RandomState(0).randint(0, 128, (2, 20))
  np.testing.assert_array_equal(torch_logits(reloaded, ids), torch_logits(torch_model, ids))
  np.testing.assert_allclose(np.asarray(model(jnp.asarray(ids))), torch_logits(reloaded, ids),
                             atol=1e-4, rtol=0)


def test_load_save_load_is_bitwise_exact_also_sharded_and_bf16(hf_dir, tmp_path):
  _, path = hf_dir("llama3")
  model, cfg = load_pretrained(path)
  first = _params(model)
  # Tiny max_shard_bytes forces several files + model.safetensors.index.json.
  out = save_pretrained(model, cfg, tmp_path / "sharded", max_shard_bytes=40_000)
  assert (out / "model.safetensors.index.json").exists()
  assert len(list(out.glob("*.safetensors"))) > 2
  again, cfg2 = load_pretrained(out)
  assert cfg2 == cfg
  second = _params(again)
  assert first.keys() == second.keys()
  for k in first:
    np.testing.assert_array_equal(first[k], second[k], err_msg=k)
  # bf16 on disk: BF16 safetensors that transformers reads, and exact bf16 round trip.
  b16 = save_pretrained(model, cfg, tmp_path / "b16", dtype=jnp.bfloat16)
  assert json.loads((b16 / "config.json").read_text())["dtype"] == "bfloat16"
  assert load_file(b16 / "model.safetensors")["lm_head.weight"].dtype == torch.bfloat16
  m16, _ = load_pretrained(b16, dtype=jnp.bfloat16)
  for k, v in _params(m16).items():
    np.testing.assert_array_equal(v, first[k].astype(jnp.bfloat16), err_msg=k)


def test_save_replaces_existing_directory_atomically(hf_dir, tmp_path):
  _, path = hf_dir("qwen2")
  model, cfg = load_pretrained(path)
  target = tmp_path / "ckpt"
  save_pretrained(model, cfg, target)
  (target / "stale.txt").write_text("from the old checkpoint")
  model.embed[...] = model.embed[...] + 1.0
  save_pretrained(model, cfg, target)
  assert os.listdir(tmp_path) == ["ckpt"]  # no tmp or old dirs left behind
  assert not (target / "stale.txt").exists()
  np.testing.assert_array_equal(
      load_file(target / "model.safetensors")["model.embed_tokens.weight"].numpy(),
      np.asarray(model.embed[...]))


def test_sharded_load_on_8_devices_matches_single_device(hf_dir):
  assert jax.device_count() == 8, "tests/conftest.py sets 8 fake CPU devices"
  _, path = hf_dir("qwen3")
  single, _ = load_pretrained(path)
  mesh = make_mesh(data=2, fsdp=2, tensor=2)
  sharded, _ = load_pretrained(path, mesh=mesh)
  embed = sharded.embed[...]
  assert embed.sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")
  assert embed.addressable_shards[0].data.shape == (64, 32)  # [128, 64] over 2 x 2
  q = sharded.layers[0].attn.q_kernel[...]
  assert not q.sharding.is_fully_replicated
  ids = np.random.RandomState(0).randint(0, 128, (4, 16))
  mask = np.ones_like(ids)
  mask[1, :5] = 0
  forward = jax.jit(lambda m, i, a: m(i, attention_mask=a))
  ref = np.asarray(forward(single, ids, mask))
  out = forward(sharded, ids, mask)
  np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- bad input


def _copy(path, tmp_path):
  dst = tmp_path / "bad"
  dst.mkdir()
  for f in path.iterdir():
    (dst / f.name).write_bytes(f.read_bytes())
  return dst


def test_missing_directory_and_config(tmp_path):
  with pytest.raises(ValueError, match="does not exist"):
    load_pretrained(tmp_path / "nope")
  with pytest.raises(ValueError, match="config.json not found"):
    load_pretrained(tmp_path)


def test_unsupported_architecture(hf_dir, tmp_path):
  bad = _copy(hf_dir("qwen2")[1], tmp_path)
  cfg = json.loads((bad / "config.json").read_text())
  cfg["architectures"] = ["MixtralForCausalLM"]
  (bad / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(ValueError, match=r"MixtralForCausalLM.*Qwen2ForCausalLM"):
    load_pretrained(bad)


def test_missing_wrong_shape_and_extra_tensors(hf_dir, tmp_path):
  bad = _copy(hf_dir("qwen2")[1], tmp_path)
  good = load_file(bad / "model.safetensors")
  name = "model.layers.1.self_attn.k_proj.bias"

  def write(tensors):
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})

  write({k: v for k, v in good.items() if k != name})
  with pytest.raises(ValueError, match=f"'{name}' is missing"):
    load_pretrained(bad)
  name = "model.layers.0.mlp.down_proj.weight"
  write({**good, name: torch.zeros(64, 100)})
  with pytest.raises(ValueError, match=rf"'{name}' has shape \[64, 100\], expected \[64, 128\]"):
    load_pretrained(bad)
  write({**good, "model.layers.0.mlp.down_proj.bias": torch.zeros(64)})
  with pytest.raises(ValueError, match="unexpected tensors.*down_proj.bias"):
    load_pretrained(bad)
  write({**good, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(8)})
  with pytest.warns(UserWarning, match="inv_freq"):
    load_pretrained(bad)


def test_corrupt_safetensors_file_is_named_with_what_is_wrong(hf_dir, tmp_path):
  bad = _copy(hf_dir("qwen2")[1], tmp_path)
  st = bad / "model.safetensors"
  data = st.read_bytes()
  (n,) = struct.unpack("<Q", data[:8])
  header = json.loads(data[8:8 + n])

  st.write_bytes(data[:-100])  # truncated download
  with pytest.raises(ValueError, match=rf"{st}: tensor '.*' has bytes \[\d+, \d+\) but "
                                       rf"the file holds {len(data) - 108 - n} bytes of "
                                       r"data \(truncated\?\)"):
    load_pretrained(bad)
  st.write_bytes(np.random.default_rng(0).bytes(4096))  # random bytes
  with pytest.raises(ValueError, match=rf"{st}: not a safetensors file or truncated: its "
                                       r"header length field says \d+ bytes but the file "
                                       r"has 4088 after it"):
    load_pretrained(bad)
  st.write_bytes(struct.pack("<Q", 2**62) + data[8:])  # huge header length
  with pytest.raises(ValueError, match=rf"{st}: not a safetensors file or truncated"):
    load_pretrained(bad)
  st.write_bytes(b"\x01\x00")
  with pytest.raises(ValueError, match=rf"{st}: not a safetensors file \(2 bytes"):
    load_pretrained(bad)
  name = next(k for k in header if k != "__metadata__")
  start, end = header[name]["data_offsets"]
  header[name]["data_offsets"] = [start, end - 4]  # a byte range that lies
  raw = json.dumps(header).encode()
  st.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])
  with pytest.raises(ValueError, match=rf"{st}: tensor '{name}' of shape .* needs "
                                       rf"{end - start} bytes but has {end - start - 4}"):
    load_pretrained(bad)
