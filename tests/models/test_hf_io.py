"""HF checkpoint load/save: transformers interop, exact round trips, sharded loading,
and the errors bad checkpoints must raise."""

import json
import os
import re
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file as save_npfile
from safetensors.torch import load_file, save_file

from isojax.models import hf_io, load_pretrained, save_pretrained
from tests.models.conftest import make_torch_model
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


def test_sharded_checkpoint_written_with_safetensors_loads(hf_dir, torch_logits, tmp_path):
  """Three files and an index, each layer's tensors spread over the files; a file
  the index does not name is not read."""
  torch_model, path = hf_dir("qwen2")
  state = {k: v.contiguous() for k, v in torch_model.state_dict().items()}
  names = sorted(state)
  out = tmp_path / "sharded"
  out.mkdir()
  (out / "config.json").write_bytes((path / "config.json").read_bytes())
  weight_map = {}
  for i in range(3):
    fname = f"model-{i + 1:05d}-of-00003.safetensors"
    save_file({k: state[k] for k in names[i::3]}, out / fname, metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(names[i::3], fname))
  (out / "model.safetensors.index.json").write_text(
      json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
  (out / "unlisted.safetensors").write_bytes(b"not read")
  model, _ = load_pretrained(out)
  ids = np.random.RandomState(0).randint(0, 128, (2, 12))
  np.testing.assert_allclose(np.asarray(model(jnp.asarray(ids))),
                             torch_logits(torch_model, ids), atol=1e-4, rtol=0)
  single = _params(load_pretrained(path)[0])
  for k, v in _params(model).items():
    np.testing.assert_array_equal(v, single[k], err_msg=k)
  (out / "model-00002-of-00003.safetensors").unlink()
  with pytest.raises(ValueError, match=r"index.json lists files that do not exist: "
                                       r"\[.*model-00002-of-00003.safetensors'\]"):
    load_pretrained(out)
  (out / "model.safetensors.index.json").write_text("{}")
  with pytest.raises(ValueError, match=r"index.json: not a safetensors index with a "
                                       r"'weight_map' object"):
    load_pretrained(out)


@pytest.mark.parametrize("param_shape,groups,transposed", [
    ((6, 4, 3), (1, 2), True),   # q_kernel [D, N, H] <- [N*H, D]
    ((4, 3, 6), (2, 1), True),   # o_kernel [N, H, D] <- [D, N*H]
    ((4, 3), (2,), False),       # a bias [N, H] <- [N*H]
    ((5, 6), (1, 1), False),     # the embedding, as stored
])
def test_each_block_read_equals_that_block_of_the_whole_tensor(tmp_path, param_shape,
                                                               groups, transposed):
  """What a device reads of its shard is what slicing the fully read parameter gives,
  also for cuts through an axis that shares an HF axis with another."""
  whole = np.arange(np.prod(param_shape), dtype=np.float32).reshape(param_shape)
  dims, at = [], 0
  for n in groups:
    dims.append(int(np.prod(param_shape[at:at + n])))
    at += n
  hf = whole.reshape(dims).T if transposed else whole.reshape(dims)
  save_npfile({"t": np.ascontiguousarray(hf)}, tmp_path / "t.safetensors")
  rng = np.random.default_rng(0)
  with safe_open(str(tmp_path / "t.safetensors"), framework="numpy") as f:
    for _ in range(20):
      index = []
      for d in param_shape:
        lo = int(rng.integers(0, d))
        index.append(slice(lo, int(rng.integers(lo + 1, d + 1))))
      index[int(rng.integers(0, len(index)))] = slice(None)
      block = hf_io._read_block(f.get_slice("t"), param_shape, groups, transposed,
                                tuple(index))
      np.testing.assert_array_equal(block, whole[tuple(index)], err_msg=str(index))


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
  (tmp_path / "config.json").write_text("{}")
  with pytest.raises(ValueError, match=rf"^{tmp_path / 'config.json'} is a file; pass the "
                                       r"checkpoint directory that holds it$"):
    load_pretrained(tmp_path / "config.json")  # was: "... does not exist"
  (tmp_path / "config.json").write_text('[{"model_type": "llama"}]')
  with pytest.raises(ValueError, match=r"config\.json: expected a JSON object, got a list"):
    load_pretrained(tmp_path)  # was: AttributeError: 'list' object has no attribute 'get'


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
  name = next(k for k in header if k != "__metadata__")
  start, end = header[name]["data_offsets"]
  header[name]["data_offsets"] = [start, end - 4]  # a byte range that lies
  raw = json.dumps(header).encode()
  cases = {  # what the file is -> (its bytes, what the error must say is wrong)
      "a truncated download": (data[:-100], "file not fully covered"),
      "random bytes": (np.random.default_rng(0).bytes(4096), "header too large"),
      "a huge header length": (struct.pack("<Q", 2**62) + data[8:], "header too large"),
      "two bytes": (b"\x01\x00", "header too small"),
      "a lying byte range": (struct.pack("<Q", len(raw)) + raw + data[8 + n:],
                             "invalid shape, data type, or offset for tensor"),
  }
  for what, (blob, reason) in cases.items():
    st.write_bytes(blob)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(st))}: not a valid safetensors "
                                         rf"file \({len(blob)} bytes; .*\): .*{reason}"):
      load_pretrained(bad)
      pytest.fail(f"{what} loaded")


def test_tensors_that_would_load_silently_wrong_are_refused(hf_dir, tmp_path):
  bad = _copy(hf_dir("qwen2")[1], tmp_path)
  good = load_file(bad / "model.safetensors")
  name = "model.layers.0.mlp.down_proj.weight"
  for dtype in (torch.int8, torch.int32, torch.bool):  # a quantised export: cast, wrong
    save_file({**good, name: good[name].to(dtype)}, bad / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"model.safetensors: tensor '{name}' \[64, 128\] "
                                         rf"has dtype (I8|I32|BOOL); expected one of"):
      load_pretrained(bad)
  save_file(good, bad / "model.safetensors", metadata={"format": "pt"})
  save_file({name: torch.zeros_like(good[name])}, bad / "zz-extra.safetensors",
            metadata={"format": "pt"})
  with pytest.raises(ValueError, match=rf"'{name}' is in both model.safetensors and "
                                       r"zz-extra.safetensors"):
    load_pretrained(bad)
  (bad / "zz-extra.safetensors").unlink()
  cfg = json.loads((bad / "config.json").read_text())
  (bad / "config.json").write_text(json.dumps({k: v for k, v in cfg.items()
                                               if k != "hidden_size"}))
  with pytest.raises(ValueError, match=r"config.json: no 'hidden_size'"):
    load_pretrained(bad)


def test_a_tied_config_takes_lm_head_only_as_a_copy_of_the_embedding(hf_dir, tmp_path):
  bad = _copy(hf_dir("qwen3_tied")[1], tmp_path)
  good = load_file(bad / "model.safetensors")
  embed = good["model.embed_tokens.weight"]
  save_file({**good, "lm_head.weight": embed.clone()}, bad / "model.safetensors",
            metadata={"format": "pt"})
  with pytest.warns(UserWarning, match="lm_head.weight"):
    load_pretrained(bad)
  # transformers 5 would untie and use it, vLLM the embedding: ambiguous, refused.
  head = embed.clone()
  head[-1] += 1.0
  save_file({**good, "lm_head.weight": head}, bad / "model.safetensors",
            metadata={"format": "pt"})
  with pytest.raises(ValueError, match=r"ties word embeddings, but lm_head.weight "
                                       r"\(model.safetensors\) differs"):
    load_pretrained(bad)


def test_llama_attention_bias_is_refused_by_name(hf_dir, tmp_path):
  bad = _copy(hf_dir("llama3")[1], tmp_path)
  cfg = json.loads((bad / "config.json").read_text())
  (bad / "config.json").write_text(json.dumps({**cfg, "attention_bias": True}))
  with pytest.raises(ValueError, match=r"unsupported attention_bias=true for "
                                       r"LlamaForCausalLM \(its o_proj bias"):
    load_pretrained(bad)


def test_save_refuses_a_link_a_file_and_a_config_that_is_not_the_models(hf_dir, tmp_path):
  model, cfg = load_pretrained(hf_dir("qwen2")[1])
  real = tmp_path / "real"
  real.mkdir()
  (tmp_path / "link").symlink_to(real)
  (tmp_path / "afile").write_text("notes\n")
  for name, what in (("link", f"a link to {real}"), ("afile", "a file")):
    with pytest.raises(ValueError, match=rf"{tmp_path / name} is {what}; it replaces a "
                                         r"directory only"):
      save_pretrained(model, cfg, tmp_path / name)
  assert (tmp_path / "afile").read_text() == "notes\n" and not os.listdir(real)
  for wrong, key in ((dict(vocab_size=100), "vocab_size"),
                     (dict(num_layers=1), "num_hidden_layers"),
                     (dict(tie_word_embeddings=True), "tie_word_embeddings")):
    # (layer_types follows num_hidden_layers.)
    with pytest.raises(ValueError, match=r"cfg differs from the model's own config in "
                                         rf"\[(.*, )?'{key}'\]; pass model.cfg"):
      save_pretrained(model, cfg.replace(**wrong), tmp_path / "out")
  assert sorted(os.listdir(tmp_path)) == ["afile", "link", "real"]
  out = save_pretrained(model, cfg, tmp_path / "out")
  # Readable by a vLLM server running as another user.
  assert {oct(os.stat(f).st_mode & 0o777) for f in out.iterdir()} == {"0o644"}


def test_save_refuses_to_delete_a_directory_that_is_not_a_checkpoint(hf_dir, tmp_path,
                                                                    monkeypatch):
  model, cfg = load_pretrained(hf_dir("qwen2")[1])
  run = tmp_path / "run"
  (run / "logs").mkdir(parents=True)
  (run / "metrics.jsonl").write_text("{}\n")
  with pytest.raises(ValueError, match=rf"{run} holds subdirectories \['logs'\], which "
                                       r"replacing it whole would delete"):
    save_pretrained(model, cfg, run)
  notebooks = tmp_path / "notebooks"
  notebooks.mkdir()
  (notebooks / "explore.ipynb").write_text("{}")
  monkeypatch.chdir(notebooks)
  for where in (".", notebooks, tmp_path, notebooks / "sub" / ".."):
    with pytest.raises(ValueError, match=r"is the working directory or holds it"):
      save_pretrained(model, cfg, where)
  assert sorted(os.listdir(tmp_path)) == ["notebooks", "run"]
  assert os.listdir(notebooks) == ["explore.ipynb"] and (run / "metrics.jsonl").exists()
  save_pretrained(model, cfg, "ckpt")  # a new directory below the working one is fine
  assert load_pretrained(notebooks / "ckpt")[1] == cfg


def test_model_safetensors_wins_over_a_stale_index_as_in_transformers(tmp_path,
                                                                       torch_logits):
  """A single-file save over a sharded checkpoint leaves the old index and shards."""
  old, new = make_torch_model("llama", seed=0), make_torch_model("llama", seed=1)
  old.save_pretrained(tmp_path, max_shard_size="100KB")
  assert (tmp_path / hf_io.INDEX_FILE).exists()
  new.save_pretrained(tmp_path)
  assert (tmp_path / hf_io.INDEX_FILE).exists() and (tmp_path / "model.safetensors").exists()
  ids = np.random.RandomState(0).randint(0, 128, (2, 12))
  ref = torch_logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval(), ids)
  np.testing.assert_array_equal(ref, torch_logits(new, ids))
  with pytest.warns(UserWarning, match=r"both model.safetensors and "
                                       r"model.safetensors.index.json; reading model"):
    model, _ = load_pretrained(tmp_path)
  np.testing.assert_allclose(np.asarray(model(jnp.asarray(ids))), ref, atol=1e-4, rtol=0)


def test_a_missing_or_unexpected_tensor_names_its_shard(hf_dir, tmp_path):
  model, cfg = load_pretrained(hf_dir("qwen2")[1])
  out = save_pretrained(model, cfg, tmp_path / "sharded", max_shard_bytes=40_000)
  weight_map = json.loads((out / hf_io.INDEX_FILE).read_text())["weight_map"]
  name = "model.layers.1.self_attn.k_proj.bias"
  shard = out / weight_map[name]
  good = load_file(shard)
  save_file({**good, "model.layers.1.mlp.down_proj.bias": torch.zeros(64)}, shard,
            metadata={"format": "pt"})
  with pytest.raises(ValueError, match=rf"unexpected tensors .*\['model.layers.1.mlp."
                                       rf"down_proj.bias \({shard.name}\)'\]"):
    load_pretrained(out)
  save_file({k: v for k, v in good.items() if k != name}, shard, metadata={"format": "pt"})
  with pytest.raises(ValueError, match=rf"'{name}' is missing from {shard.name}, where "
                                       r"model.safetensors.index.json puts it"):
    load_pretrained(out)
