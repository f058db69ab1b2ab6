"""A value model: the decoder's trunk and a float32 scalar head per position.

    critic = init_critic_from(policy, rngs=nnx.Rngs(0))         # trunk copied, head 0
    critic = load_critic("path/to/hf_dir", rngs=nnx.Rngs(0))   # trunk from a checkpoint
    values_BxT = token_values(critic, input_ids_BxT, attention_mask_BxT)

The trunk is a ``Decoder`` built with tied embeddings, so it holds no [D, V]
unembedding (a critic never computes logits): for an untied 7B policy that is
0.5B parameters, and their optimiser moments, the critic does not carry. Only
the decoder's public API is used (construction, ``hidden_states``, nnx state).

The head is ``v = h . w + b`` in float32 on the final-norm hidden state ``h``;
``w`` carries the logical axis name ``embed`` like the decoder's parameters, so
``isojax.sharding`` places it with the rest of the model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from isojax.models.config import ModelConfig
from isojax.models.decoder import Decoder
from isojax.models.hf_io import load_pretrained

__all__ = ["Critic", "init_critic_from", "load_critic", "token_values", "critic_forward_flops"]


def _value_head(hidden_size: int, rngs: nnx.Rngs, head_std: float):
  kernel = head_std * jax.random.normal(rngs.params(), (hidden_size,), jnp.float32)
  # eager_sharding=False: logical names only (no mesh here), as in the decoder.
  return (nnx.Param(kernel, out_sharding=("embed",), eager_sharding=False),
          nnx.Param(jnp.zeros((), jnp.float32), out_sharding=(), eager_sharding=False))


class Critic(nnx.Module):
  """State values from a decoder trunk.

  Args:
    cfg: the architecture (a policy's ``ModelConfig`` works as is; the trunk
      is built from it with tied embeddings).
    rngs: initialises the trunk and the head.
    head_std: std of the head's initial weights; 0 (the default) starts every
      value at 0, so the first advantages are the plain returns.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, head_std: float = 0.0):
    if not head_std >= 0:
      raise ValueError(f"Critic head_std={head_std} must be >= 0")
    self.cfg = cfg
    self.trunk = Decoder(cfg.replace(tie_word_embeddings=True), rngs=rngs)
    self.value_kernel, self.value_bias = _value_head(cfg.hidden_size, rngs, head_std)

  def __call__(self, input_ids_BxT: jax.Array,
               attention_mask: jax.Array | None = None) -> jax.Array:
    """[B, T] float32: the value of the state after reading ``input_ids[:, :t+1]``."""
    h_BxTxD = self.trunk.hidden_states(input_ids_BxT, attention_mask=attention_mask)
    return (jnp.einsum("btd,d->bt", h_BxTxD.astype(jnp.float32), self.value_kernel[...])
            + self.value_bias[...])


def token_values(critic: Critic, input_ids_BxT, attention_mask_BxT) -> jax.Array:
  """[B, T] float32 values aligned like the batch's log-probs.

  Column t is the value of the state *before* token t (computed at position
  t - 1), the baseline of the action that emits it; column 0 has none and is 0.
  Positions outside the attention mask hold finite values of no meaning.
  """
  v_BxT = critic(input_ids_BxT, attention_mask=attention_mask_BxT)
  # A model giving more than one number per position (a Decoder's logits) would
  # otherwise be shifted along its time axis and returned as if it were values.
  if v_BxT.shape != jnp.shape(input_ids_BxT):
    raise ValueError(f"critic gave outputs of shape {v_BxT.shape} for input_ids_BxT of shape "
                     f"{jnp.shape(input_ids_BxT)}: a critic gives one value per position "
                     f"(isojax.models.critic.Critic), got a {type(critic).__name__}")
  return jnp.concatenate([jnp.zeros_like(v_BxT[:, :1]), v_BxT[:, :-1]], axis=1)


def init_critic_from(decoder: Decoder, *, rngs: nnx.Rngs, head_std: float = 0.0) -> Critic:
  """A critic whose trunk is a copy of ``decoder``'s (embeddings, layers, norm).

  The copies are new arrays with the decoder's shardings (a step that donates
  the critic's state leaves the decoder intact); no random trunk is ever
  materialised. The head is initialised as in ``Critic``.
  """
  critic = nnx.eval_shape(lambda: Critic(decoder.cfg, rngs=nnx.Rngs(0)))
  source = dict(nnx.to_flat_state(nnx.state(decoder)))
  wanted = [path for path, _ in nnx.to_flat_state(nnx.state(critic.trunk))]
  missing = [path for path in wanted if path not in source]
  if missing:
    raise ValueError(f"decoder has no {'.'.join(map(str, missing[0]))} for the critic's "
                     f"trunk ({len(missing)} missing)")
  trunk = nnx.from_flat_state([(path, source[path]) for path in wanted])
  nnx.update(critic.trunk, jax.tree.map(jnp.copy, trunk))
  critic.value_kernel, critic.value_bias = _value_head(decoder.cfg.hidden_size, rngs,
                                                       head_std)
  return critic


def load_critic(path, *, rngs: nnx.Rngs, head_std: float = 0.0, **load_kwargs) -> Critic:
  """A critic whose trunk comes from a Hugging Face checkpoint directory.

  ``load_kwargs`` go to ``isojax.models.load_pretrained`` (dtype, mesh, rules,
  compute_dtype, remat, ...); its errors name the file and tensor at fault.
  """
  decoder, _ = load_pretrained(path, **load_kwargs)
  return init_critic_from(decoder, rngs=rngs, head_std=head_std)


def critic_forward_flops(cfg: ModelConfig, attention_mask_BxT) -> int:
  """Model FLOPs of one critic forward over a batch's real tokens (host side).

  Counts the matmuls (2 per weight per token: q, k, v, o, gate, up, down and
  the value head) and the causal attention over real tokens (4 N H per
  query-key pair per layer, a length-l row having l (l + 1) / 2 pairs); norms,
  RoPE and softmax are left out, as in the usual 6N accounting. A backward
  pass costs about twice a forward.
  """
  lengths_B = np.asarray(attention_mask_BxT).astype(bool).sum(axis=1).astype(np.int64)
  D, F, H = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
  N, K, L = cfg.num_heads, cfg.num_kv_heads, cfg.num_layers
  weights_per_layer = D * N * H + 2 * D * K * H + N * H * D + 3 * D * F
  per_token = 2 * (L * weights_per_layer + D)
  pairs = int((lengths_B * (lengths_B + 1) // 2).sum())
  return per_token * int(lengths_B.sum()) + 4 * L * N * H * pairs
