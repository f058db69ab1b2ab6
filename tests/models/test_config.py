"""ModelConfig <-> config.json: what transformers makes of a config is what isojax
loads (checked on logits), and what isojax writes transformers reads back."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from isojax.models import Decoder, ModelConfig, load_pretrained, save_pretrained

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0}
IDS_BxT = np.random.RandomState(1).randint(0, 128, (2, 48))


def _edited(path, tmp_path, name="edited", **changes):
  """A copy of the HF directory `path` with config.json's top-level keys changed."""
  dst = tmp_path / name
  dst.mkdir()
  for f in path.iterdir():
    (dst / f.name).write_bytes(f.read_bytes())
  cfg = json.loads((dst / "config.json").read_text())
  (dst / "config.json").write_text(json.dumps({**cfg, **changes}))
  return dst


def _transformers_logits(path, torch_logits):
  model = transformers.AutoModelForCausalLM.from_pretrained(path).float().eval()
  return torch_logits(model, IDS_BxT)


def _assert_isojax_matches_transformers(path, torch_logits):
  model, cfg = load_pretrained(path)
  ref = _transformers_logits(path, torch_logits)
  np.testing.assert_allclose(np.asarray(model(IDS_BxT)), ref, atol=1e-4, rtol=0)
  return cfg, ref


# ----------------------------------------------------------------------------- RoPE


def test_rope_scaling_replaces_rope_parameters_as_in_transformers(hf_dir, torch_logits,
                                                                  tmp_path):
  """transformers 5 writes a default rope_parameters into every config; a rope_scaling
  beside it (a long-context recipe) replaces it whole, theta included."""
  torch_model, path = hf_dir("llama")
  edited = _edited(path, tmp_path, rope_parameters={"rope_type": "default",
                                                    "rope_theta": 500000.0},
                   rope_scaling={**LLAMA3, "original_max_position_embeddings": 16})
  cfg, ref = _assert_isojax_matches_transformers(edited, torch_logits)
  assert (cfg.rope_type, cfg.rope_theta, cfg.rope_original_max_position) == \
      ("llama3", 10000.0, 16)
  # The scaling changes the logits, so plain RoPE could not pass the check above.
  assert np.abs(ref - torch_logits(torch_model, IDS_BxT)).max() > 1e-2
  # Written back, rope_parameters alone carries it: a stale rope_scaling would win.
  model, _ = load_pretrained(edited)
  out = save_pretrained(model, cfg, tmp_path / "saved")
  written = json.loads((out / "config.json").read_text())
  assert "rope_scaling" not in written
  assert written["rope_parameters"]["rope_type"] == "llama3"
  np.testing.assert_allclose(_transformers_logits(out, torch_logits), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family,scaling", [
    ("qwen3", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}),
    ("llama", {"type": "linear", "factor": 4.0}),
])
def test_an_unimplemented_rope_scaling_is_refused_naming_the_field(hf_dir, torch_logits,
                                                                   tmp_path, family, scaling):
  edited = _edited(hf_dir(family)[1], tmp_path, rope_scaling=scaling)
  kind = scaling.get("rope_type", scaling.get("type"))
  with pytest.raises(ValueError, match=rf"config.json: unsupported rope_scaling rope_type "
                                       rf"'{kind}'"):
    load_pretrained(edited)


def test_a_top_level_pretraining_length_is_honoured_only_where_unambiguous(
    hf_dir, torch_logits, tmp_path):
  """transformers' standardisation means a top-level original_max_position_embeddings
  to win, but for these models reads the rope dict's (else max_position_embeddings)."""
  _, path = hf_dir("llama")
  l3 = {**LLAMA3, "rope_theta": 10000.0}
  # No length in the dict: max_position_embeddings (64), as transformers.
  cfg, _ = _assert_isojax_matches_transformers(
      _edited(path, tmp_path, "absent", rope_parameters=l3), torch_logits)
  assert cfg.rope_original_max_position == 64
  # A top-level length equal to the dict's is the same model.
  cfg, _ = _assert_isojax_matches_transformers(
      _edited(path, tmp_path, "equal", original_max_position_embeddings=16,
              rope_parameters={**l3, "original_max_position_embeddings": 16}), torch_logits)
  assert cfg.rope_original_max_position == 16
  for name, rope in (("differs", {**l3, "original_max_position_embeddings": 16}),
                     ("only_top", l3)):
    edited = _edited(path, tmp_path, name, original_max_position_embeddings=32,
                     rope_parameters=rope)
    with pytest.raises(ValueError, match=r"config.json: original_max_position_embeddings=32 "
                                         r"disagrees with rope_parameters's pretraining "
                                         r"length (16|64)"):
      load_pretrained(edited)


# ----------------------------------------------------------------------------- families


SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
             num_heads=4, num_kv_heads=2, head_dim=16)


@pytest.mark.parametrize("arch,bias,qk_norm", [("LlamaForCausalLM", False, False),
                                               ("Qwen2ForCausalLM", True, False),
                                               ("Qwen3ForCausalLM", False, True)])
def test_a_hand_built_config_is_its_family_and_saves_as_it(torch_logits, tmp_path, arch,
                                                           bias, qk_norm):
  """Left unset, bias and q/k norm are the architecture's, and the saved model is what
  transformers builds for that architecture; a contradicting value is refused."""
  cfg = ModelConfig(architecture=arch, **SHAPE)
  assert (cfg.attention_bias, cfg.qk_norm) == (bias, qk_norm)
  model = Decoder(cfg, rngs=nnx.Rngs(0))
  if bias:  # zero biases would hide a dropped one
    for layer in model.layers:
      layer.attn.q_bias[...] = jnp.full_like(layer.attn.q_bias[...], 0.5)
  out = save_pretrained(model, cfg, tmp_path / "saved")
  np.testing.assert_allclose(np.asarray(model(IDS_BxT)),
                             _transformers_logits(out, torch_logits), atol=1e-4, rtol=0)
  assert load_pretrained(out)[1] == cfg
  for name, value in (("attention_bias", not bias), ("qk_norm", not qk_norm)):
    with pytest.raises(ValueError, match=rf"ModelConfig.{name}={value} contradicts {arch}, "
                                         rf"which has {name}={not value}"):
      ModelConfig(architecture=arch, **SHAPE, **{name: value})


def test_a_model_saved_with_fewer_layers_loads_in_transformers(torch_logits, hf_dir,
                                                               tmp_path):
  _, path = hf_dir("qwen3")
  assert len(json.loads((path / "config.json").read_text())["layer_types"]) == 2
  _, cfg = load_pretrained(path)
  small = cfg.replace(num_layers=1)
  model = Decoder(small, rngs=nnx.Rngs(0))
  out = save_pretrained(model, small, tmp_path / "small")
  assert json.loads((out / "config.json").read_text())["layer_types"] == ["full_attention"]
  np.testing.assert_allclose(np.asarray(model(IDS_BxT)),
                             _transformers_logits(out, torch_logits), atol=1e-4, rtol=0)


HF_LLAMA = dict(architectures=["LlamaForCausalLM"], vocab_size=16, hidden_size=16,
                intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)


@pytest.mark.parametrize("changes,match", [
    # was ZeroDivisionError (num_heads % 0)
    (dict(num_kv_heads=0), r"num_kv_heads=0 must be a positive integer"),
    (dict(num_layers=-1), r"num_layers=-1 must be a positive integer"),
    (dict(hidden_size=16.0), r"hidden_size=16.0 must be a positive integer"),
    # was accepted, then "array split does not result in an equal division" in RoPE
    (dict(head_dim=7), r"head_dim=7 must be even"),
    # were accepted, then every logit was NaN
    (dict(rms_norm_eps=-1e-6), r"rms_norm_eps=-1e-06 must be a finite number >= 0"),
    (dict(rope_theta=0.0), r"rope_theta=0.0 must be a finite number > 0"),
    (dict(rope_type="llama3", rope_factor=0.0), r"rope_factor=0.0 must be a finite number > 0"),
    # was accepted, then "unsupported operand type(s) for +" inside the traced RMSNorm
    (dict(rms_norm_eps="1e-6"), r"rms_norm_eps='1e-6' must be a finite number"),
    # were accepted as true: a tied model (no lm_head), an fp32 head
    (dict(tie_word_embeddings="false"), r"tie_word_embeddings='false' must be True or False"),
    (dict(lm_head_fp32="false"), r"lm_head_fp32='false' must be True or False"),
    # were KeyError('int32') / KeyError('float64')
    (dict(dtype=jnp.int32), r"ModelConfig.dtype: unsupported dtype .*int32.*; expected one "
                            r"of \['bfloat16', 'float16', 'float32'\]"),
    (dict(param_dtype=np.float64), r"ModelConfig.param_dtype: unsupported dtype .*float64"),
    (dict(eos_token_ids=["</s>"]), r"eos_token_ids=\['</s>'\] must be token ids"),
])
def test_bad_values_are_refused_naming_the_field(changes, match):
  base = dict(architecture="LlamaForCausalLM", vocab_size=16, hidden_size=16,
              intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=8)
  ModelConfig(**base)
  with pytest.raises(ValueError, match=match):
    ModelConfig(**{**base, **changes})


def test_llama3_rope_without_its_factors_is_refused_naming_them():
  """Was a bare KeyError('low_freq_factor') from inside the parser."""
  hf = dict(HF_LLAMA, rope_scaling={"rope_type": "llama3", "factor": 8.0})
  with pytest.raises(ValueError, match=r"rope_scaling rope_type 'llama3' lacks "
                                       r"\['low_freq_factor', 'high_freq_factor'\]"):
    ModelConfig.from_hf_dict(hf)
  assert ModelConfig.from_hf_dict(dict(HF_LLAMA, rope_scaling=LLAMA3)).rope_factor == 8.0


def test_dtypes_and_eos_ids_are_normalised(hf_dir):
  """A torch dtype was a TypeError, an eos list left the config unhashable, and
  load_pretrained(dtype=jnp.int32) reported "config.json: no 'int32'"."""
  base = dict(architecture="LlamaForCausalLM", vocab_size=16, hidden_size=16,
              intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=8)
  cfg = ModelConfig(**base, dtype=torch.bfloat16, eos_token_ids=[2, np.int64(7)])
  assert cfg.dtype == jnp.bfloat16 and cfg.eos_token_ids == (2, 7)
  assert hash(cfg) == hash(ModelConfig(**base, dtype="bfloat16", eos_token_ids=(2, 7)))
  path = hf_dir("llama")[1]
  for name, value in (("dtype", jnp.int32), ("compute_dtype", "bf16")):
    with pytest.raises(ValueError, match=rf"^load_pretrained\({name}=...\): unsupported "
                                         r"dtype"):
      load_pretrained(path, **{name: value})
