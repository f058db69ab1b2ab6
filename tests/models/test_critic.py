"""The critic: head against NumPy on the trunk's hidden states, init from a policy or
a checkpoint, padding, alignment, sharding, FLOPs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from isojax import sharding as shd
from isojax.models import Decoder, ModelConfig, save_pretrained
from isojax.models.critic import Critic, critic_forward_flops, init_critic_from, load_critic
from isojax.models.critic import token_values

CFG = ModelConfig(architecture="Qwen2ForCausalLM", vocab_size=64, hidden_size=32,
                  intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                  attention_bias=True)

# one compile per function; the module is an argument
_values = jax.jit(lambda c, ids, mask: token_values(c, ids, mask))
_hidden = jax.jit(lambda m, ids, mask: m.hidden_states(ids, attention_mask=mask))


@pytest.fixture(scope="module")
def policy():
  return Decoder(CFG, rngs=nnx.Rngs(0))


def with_random_head(critic, seed=1):
  rng = np.random.default_rng(seed)
  critic.value_kernel[...] = jnp.asarray(rng.normal(size=CFG.hidden_size), jnp.float32)
  critic.value_bias[...] = jnp.asarray(0.3, jnp.float32)
  return critic


def left_padded(seed, lengths, T):
  rng = np.random.default_rng(seed)
  ids = rng.integers(1, CFG.vocab_size, (len(lengths), T)).astype(np.int32)
  mask = np.zeros((len(lengths), T), np.int32)
  for b, n in enumerate(lengths):
    mask[b, T - n:] = 1
  return np.where(mask > 0, ids, 0).astype(np.int32), mask


def flat(module):
  return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(module))}


def test_head_matches_numpy_on_the_trunks_hidden_states(policy):
  critic = with_random_head(init_critic_from(policy, rngs=nnx.Rngs(1)))
  ids, mask = left_padded(2, [9, 6, 9], 9)
  h = np.asarray(_hidden(critic.trunk, ids, mask), np.float64)
  v = h @ np.asarray(critic.value_kernel[...], np.float64) + 0.3
  out = np.asarray(_values(critic, ids, mask))
  assert out.shape == ids.shape and out.dtype == np.float32
  assert np.all(out[:, 0] == 0)
  np.testing.assert_allclose(out[:, 1:], v[:, :-1], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(critic(ids, mask)), v, rtol=1e-5, atol=1e-5)
  assert np.abs(v).max() > 0.5  # the head is not trivially zero


def test_init_from_policy_copies_the_trunk_and_starts_at_zero(policy):
  critic = init_critic_from(policy, rngs=nnx.Rngs(1))
  pol, trunk = flat(policy), flat(critic.trunk)
  assert set(pol) - set(trunk) == {("unembed",)}  # a critic holds no lm head
  for path, value in trunk.items():
    np.testing.assert_array_equal(value, pol[path], err_msg=str(path))
    assert value.dtype == pol[path].dtype
  leaf = nnx.state(critic.trunk)["embed"].get_value()
  assert leaf.unsafe_buffer_pointer() != policy.embed.get_value().unsafe_buffer_pointer()
  ids, mask = left_padded(3, [7, 4], 7)
  np.testing.assert_array_equal(np.asarray(_hidden(critic.trunk, ids, mask)),
                                np.asarray(_hidden(policy, ids, mask)))
  assert np.all(np.asarray(_values(critic, ids, mask)) == 0)
  assert critic.value_kernel[...].dtype == jnp.float32


def test_small_random_head_and_bf16_trunk_give_float32_values():
  cfg = CFG.replace(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  critic = Critic(cfg, rngs=nnx.Rngs(0), head_std=0.02)
  assert critic.value_kernel[...].dtype == jnp.float32
  assert np.std(np.asarray(critic.value_kernel[...])) == pytest.approx(0.02, rel=0.5)
  ids, mask = left_padded(4, [5, 3], 5)
  out = _values(critic, ids, mask)
  assert out.dtype == jnp.float32 and np.all(np.isfinite(np.asarray(out)))
  assert np.any(np.asarray(out)[:, 1:] != 0)


def test_padding_does_not_change_real_positions(policy):
  critic = with_random_head(init_critic_from(policy, rngs=nnx.Rngs(1)))
  ids, mask = left_padded(5, [10, 4, 7], 12)
  out = np.asarray(_values(critic, ids, mask))
  # Column t is computed at t - 1: meaningful where both are real tokens (the
  # first real token is a prompt token, never trained on).
  real = np.zeros_like(mask, bool)
  real[:, 1:] = (mask[:, 1:] > 0) & (mask[:, :-1] > 0)
  noisy = np.where(mask > 0, ids, np.arange(ids.size).reshape(ids.shape) % CFG.vocab_size)
  np.testing.assert_allclose(np.asarray(_values(critic, noisy.astype(np.int32), mask))[real],
                             out[real], rtol=1e-5, atol=1e-6)
  # each row alone, unpadded: the same values on its real tokens
  for b, n in enumerate([10, 4, 7]):
    alone = np.asarray(_values(critic, ids[b:b + 1, -n:], mask[b:b + 1, -n:]))[0]
    np.testing.assert_allclose(out[b, -n + 1:], alone[1:], rtol=1e-5, atol=1e-5)


def test_a_model_giving_more_than_one_number_per_position_is_no_critic(policy):
  # The policy's [B, T, V] logits, shifted along time, would pass for values.
  ids, mask = left_padded(6, [5, 3], 6)
  with pytest.raises(ValueError, match=r"critic gave outputs of shape \(2, 6, 64\) .*Decoder"):
    token_values(policy, ids, mask)


def test_load_critic_from_a_checkpoint(policy, tmp_path):
  other = Decoder(CFG, rngs=nnx.Rngs(7))
  save_pretrained(other, CFG, tmp_path)
  critic = load_critic(tmp_path, rngs=nnx.Rngs(1))
  src = flat(other)
  for path, value in flat(critic.trunk).items():
    np.testing.assert_array_equal(value, src[path], err_msg=str(path))
  with pytest.raises(ValueError, match="does not exist"):
    load_critic(tmp_path / "missing", rngs=nnx.Rngs(1))


def test_sharded_on_8_devices_equals_one_device(policy):
  critic = with_random_head(init_critic_from(policy, rngs=nnx.Rngs(1)))
  ids, mask = left_padded(6, [8, 3, 5, 8, 1, 6, 2, 7], 8)
  ref = np.asarray(_values(critic, ids, mask))
  mesh = shd.make_mesh(data=2, fsdp=2, tensor=2)
  graphdef, state = nnx.split(critic)
  shardings = shd.state_shardings(state, mesh)
  assert shardings["value_kernel"].spec == jax.sharding.PartitionSpec("fsdp")
  state = jax.device_put(state, shardings)
  batch = shd.batch_sharding(mesh)
  out = jax.jit(lambda s, i, m: token_values(nnx.merge(graphdef, s), i, m))(
      state, jax.device_put(ids, batch), jax.device_put(mask, batch))
  np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)


def test_forward_flops_count_every_kernel_and_causal_pair():
  critic = Critic(CFG, rngs=nnx.Rngs(0))
  kernels = sum(v.get_value().size for p, v in nnx.to_flat_state(nnx.state(critic))
                if str(p[-1]).endswith("kernel"))
  mask = np.zeros((3, 9), np.int32)
  mask[0, 4:] = 1  # 5 tokens: 15 causal pairs
  mask[2, :] = 1   # 9 tokens: 45 pairs
  attention = 4 * CFG.num_layers * CFG.num_heads * CFG.head_dim * (15 + 45)
  assert critic_forward_flops(CFG, mask) == 2 * kernels * 14 + attention
