"""Decoder forward against transformers (PyTorch, fp32) on tiny random models."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from isojax.models import Decoder, ModelConfig, load_pretrained

# jit: one compile beats hundreds of eagerly dispatched small ops on a shared CPU.
_forward = jax.jit(lambda model, ids, mask: model(ids, attention_mask=mask))

LOGICAL_NAMES = {"vocab", "embed", "mlp", "heads", "kv_heads", "head_dim", "norm"}


@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3", "qwen3_tied"])
def test_logits_match_transformers(hf_dir, torch_logits, family):
  torch_model, path = hf_dir(family)
  model, cfg = load_pretrained(path)
  ids_BxT = np.random.RandomState(1).randint(0, 128, (2, 48))
  ref = torch_logits(torch_model, ids_BxT)
  out = np.asarray(_forward(model, ids_BxT, None))
  assert out.dtype == np.float32 and out.shape == ref.shape
  np.testing.assert_allclose(out, ref, atol=1e-4, rtol=0)
  # The reference is not trivially small: a wrong rope/norm would be far off.
  assert np.abs(ref).max() > 0.5


@pytest.mark.parametrize("family", ["llama3", "qwen3_tied"])
def test_left_padded_batch_equals_each_sequence_alone(hf_dir, torch_logits, family):
  torch_model, path = hf_dir(family)
  model, _ = load_pretrained(path)
  rng = np.random.RandomState(2)
  lengths, T = [30, 17, 5], 30
  ids_BxT = np.zeros((3, T), np.int32)
  mask_BxT = np.zeros((3, T), np.int32)
  seqs = [rng.randint(0, 128, n) for n in lengths]
  for b, s in enumerate(seqs):
    ids_BxT[b, T - len(s):] = s
    mask_BxT[b, T - len(s):] = 1
  out = np.asarray(_forward(model, ids_BxT, mask_BxT))
  assert np.isfinite(out).all()  # pad rows too: they must not poison gradients with NaN
  for b, s in enumerate(seqs):
    ref = torch_logits(torch_model, s[None])[0]
    np.testing.assert_allclose(out[b, T - len(s):], ref, atol=1e-4, rtol=0)


def test_hidden_states_and_lm_head_compose(hf_dir):
  _, path = hf_dir("qwen2")
  model, cfg = load_pretrained(path)
  ids = jnp.asarray(np.random.RandomState(3).randint(0, 128, (2, 9)))
  h, split, full = jax.jit(lambda m: (m.hidden_states(ids), m.lm_head(m.hidden_states(ids)),
                                      m(ids)))(model)
  assert h.shape == (2, 9, cfg.hidden_size)
  np.testing.assert_array_equal(np.asarray(split), np.asarray(full))


def test_bf16_compute_with_fp32_head_is_close_to_fp32(hf_dir, torch_logits):
  torch_model, path = hf_dir("qwen3")
  ids = np.random.RandomState(4).randint(0, 128, (2, 32))
  ref = torch_logits(torch_model, ids)
  for dtype, compute in [(jnp.bfloat16, None), (jnp.float32, jnp.bfloat16)]:
    model, cfg = load_pretrained(path, dtype=dtype, compute_dtype=compute,
                                 lm_head_fp32=True)
    assert cfg.dtype == jnp.bfloat16
    out = _forward(model, ids, None)
    assert out.dtype == jnp.float32
    err = np.abs(np.asarray(out) - ref).max()
    assert 1e-4 < err < 0.05 * np.abs(ref).max(), err  # bf16, but not garbage
  model, _ = load_pretrained(path, dtype=jnp.bfloat16, lm_head_fp32=False)
  assert _forward(model, ids, None).dtype == jnp.bfloat16


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_gives_identical_logits_and_gradients(hf_dir, remat):
  _, path = hf_dir("llama3")
  plain, _ = load_pretrained(path)
  rematted, cfg = load_pretrained(path, remat=remat)
  assert cfg.remat == remat
  ids = jnp.asarray(np.random.RandomState(5).randint(0, 128, (2, 16)))
  mask = jnp.ones_like(ids).at[0, :4].set(0)

  def loss(model):
    logp = jax.nn.log_softmax(model(ids, attention_mask=mask))
    return jnp.mean(jnp.take_along_axis(logp[:, :-1], ids[:, 1:, None], -1))

  l0, g0 = jax.jit(nnx.value_and_grad(loss))(plain)
  l1, g1 = jax.jit(nnx.value_and_grad(loss))(rematted)
  np.testing.assert_allclose(l0, l1, rtol=1e-6)
  leaves0, leaves1 = jax.tree.leaves(g0), jax.tree.leaves(g1)
  assert len(leaves0) == len(leaves1) > 0
  for a, b in zip(leaves0, leaves1):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-5)
  assert max(float(jnp.abs(a).max()) for a in leaves0) > 0


def test_every_param_has_logical_axis_names(hf_config):
  hf = hf_config("qwen2").to_dict()
  hf["architectures"] = ["Qwen2ForCausalLM"]
  cfg = ModelConfig.from_hf_dict(hf)
  model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
  params = jax.tree.leaves(nnx.state(model, nnx.Param),
                           is_leaf=lambda x: isinstance(x, nnx.Variable))
  assert len(params) == 3 + cfg.num_layers * 12
  for p in params:
    names = p.get_metadata()["out_sharding"]
    assert len(names) == p.get_value().ndim and set(names) <= LOGICAL_NAMES, names


def test_config_round_trips_and_reads_legacy_rope():
  hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "torch_dtype": "bfloat16", "bos_token_id": 1}
  cfg = ModelConfig.from_hf_dict(hf)
  assert (cfg.rope_type, cfg.rope_theta, cfg.rope_factor, cfg.head_dim) == (
      "llama3", 500000.0, 32.0, 16)
  out = cfg.to_hf_dict()
  assert out["bos_token_id"] == 1 and out["architectures"] == ["LlamaForCausalLM"]
  assert out["torch_dtype"] == out["dtype"] == "float32"
  assert ModelConfig.from_hf_dict(out) == cfg
  # EOS: an id, a list of ids, or none; models that differ only in it differ.
  one, two = (ModelConfig.from_hf_dict({**hf, "eos_token_id": e}) for e in (2, [2, 7]))
  assert (cfg.eos_token_ids, one.eos_token_ids, two.eos_token_ids) == ((), (2,), (2, 7))
  assert one != cfg and one != two
  assert one.to_hf_dict()["eos_token_id"] == 2 and two.to_hf_dict()["eos_token_id"] == [2, 7]
  assert ModelConfig.from_hf_dict(two.to_hf_dict()) == two
  with pytest.raises(ValueError, match=r"eos_token_id='</s>' is not a token id"):
    ModelConfig.from_hf_dict({**hf, "eos_token_id": "</s>"})
  with pytest.raises(ValueError, match="MistralForCausalLM.*supported.*LlamaForCausalLM"):
    ModelConfig.from_hf_dict({**hf, "architectures": ["MistralForCausalLM"]})
  with pytest.raises(ValueError, match="yarn"):
    ModelConfig.from_hf_dict({**hf, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_token_ids_and_masks_of_the_wrong_shape_or_dtype_are_refused():
  """A [2, T] mask with [1, T] ids broadcast to two rows of logits, silently; other
  shapes failed deep in RoPE or attention."""
  cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=32, hidden_size=16,
                    intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                    head_dim=8)
  model = Decoder(cfg, rngs=nnx.Rngs(0))
  ids_1x4 = jnp.arange(4, dtype=jnp.int32)[None]
  cases = [(ids_1x4, jnp.ones((2, 4)), r"attention_mask has shape \(2, 4\), the token ids "
                                       r"\(1, 4\); pass one mask entry per token"),
           (ids_1x4, jnp.ones((1, 5)), r"attention_mask has shape \(1, 5\)"),
           (ids_1x4[0], None, r"integers of shape \[batch, length\]; got int32 of shape \(4,\)"),
           (ids_1x4.astype(jnp.float32), None, r"got float32 of shape \(1, 4\)")]
  for ids, mask, match in cases:
    with pytest.raises(ValueError, match=r"Decoder.hidden_states: .*" + match):
      _forward(model, ids, mask)
  with pytest.raises(ValueError, match=r"Decoder.prefill: attention_mask has shape \(2, 4\)"):
    model.prefill(ids_1x4, jnp.ones((2, 4)), model.init_cache(1, 8))
  with pytest.raises(ValueError, match=r"Decoder.decode_step: .* shape \[batch\]; got int32 "
                                       r"of shape \(1, 4\)"):
    model.decode_step(ids_1x4, model.init_cache(1, 8))


def test_padding_ids_outside_the_vocabulary_change_no_real_logit():
  """A masked pad id >= vocab_size (or <= -vocab_size) embedded as NaN, and its
  row's every logit became NaN, with and without the KV cache."""
  cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=32, hidden_size=16,
                    intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                    head_dim=8)
  model = Decoder(cfg, rngs=nnx.Rngs(0))
  mask_BxT = jnp.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], jnp.int32)
  ids_BxT = jnp.array([[0, 0, 3, 4, 5], [6, 7, 8, 9, 10]], jnp.int32)
  want = np.asarray(_forward(model, ids_BxT, mask_BxT))[mask_BxT == 1]
  want_cached = np.asarray(model.prefill(ids_BxT, mask_BxT, model.init_cache(2, 8))[0])
  for pad in (cfg.vocab_size, -100):
    padded_BxT = ids_BxT.at[0, :2].set(pad)
    got = np.asarray(_forward(model, padded_BxT, mask_BxT))[mask_BxT == 1]
    np.testing.assert_array_equal(got, want, err_msg=f"pad id {pad}")
    cached = np.asarray(model.prefill(padded_BxT, mask_BxT, model.init_cache(2, 8))[0])
    np.testing.assert_array_equal(cached[mask_BxT == 1], want_cached[mask_BxT == 1])
