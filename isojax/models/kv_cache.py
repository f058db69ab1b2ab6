"""KVCache: a fixed-shape key/value cache that lives inside jit and lax.while_loop.

All layers are stacked into one array per k and v so the cache is five leaves
whatever the depth, and every update is a `lax.dynamic_update_slice` at a traced
write index (no shape ever depends on how many tokens were written).

Slots are written left to right for the whole batch at once. Left-padded prompts
leave invalid slots, tracked by `valid_BxS`; each sequence's RoPE position is its own
count of real tokens (`positions_B`), so padding never shifts positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
  """Keys/values of every layer plus bookkeeping.

  Attributes:
    k_LxBxSxKxH, v_LxBxSxKxH: cached keys/values (S = max_len, K = kv heads,
      H = head_dim), in the compute dtype.
    positions_B: int32, the RoPE position the next token of each sequence gets.
    valid_BxS: bool, slot s holds a real token of sequence b.
    index: int32 scalar, the next slot to write (same for the whole batch).
  """

  k_LxBxSxKxH: jax.Array
  v_LxBxSxKxH: jax.Array
  positions_B: jax.Array
  valid_BxS: jax.Array
  index: jax.Array

  @property
  def max_len(self) -> int:
    return self.k_LxBxSxKxH.shape[2]

  @classmethod
  def zeros(cls, num_layers: int, batch_size: int, max_len: int, num_kv_heads: int,
            head_dim: int, dtype) -> KVCache:
    shape = (num_layers, batch_size, max_len, num_kv_heads, head_dim)
    return cls(
        k_LxBxSxKxH=jnp.zeros(shape, dtype), v_LxBxSxKxH=jnp.zeros(shape, dtype),
        positions_B=jnp.zeros((batch_size,), jnp.int32),
        valid_BxS=jnp.zeros((batch_size, max_len), bool),
        index=jnp.zeros((), jnp.int32))

  def start(self, mask_BxT: jax.Array) -> tuple[KVCache, jax.Array, jax.Array]:
    """Book T new slots [index, index+T) for tokens whose real-ness is `mask_BxT`.

    Returns the updated bookkeeping (k/v untouched), the RoPE positions of the new
    tokens [B, T] and the attention mask of the new queries over all slots
    [B, T, S]. Writing past max_len is not checked (shapes are static inside jit):
    callers size the cache for prompt + completion.
    """
    mask_BxT = mask_BxT.astype(bool)
    _, T = mask_BxT.shape
    # Padding tokens get the position of the previous real token (clipped at the
    # first); they are never attended to, so their position only has to be finite.
    pos_BxT = self.positions_B[:, None] + jnp.cumsum(mask_BxT, axis=1, dtype=jnp.int32) - 1
    pos_BxT = jnp.maximum(pos_BxT, 0)
    valid_BxS = jax.lax.dynamic_update_slice(self.valid_BxS, mask_BxT, (0, self.index))
    slot_T = self.index + jnp.arange(T, dtype=jnp.int32)
    causal_TxS = jnp.arange(self.max_len, dtype=jnp.int32)[None, :] <= slot_T[:, None]
    attend_BxTxS = valid_BxS[:, None, :] & causal_TxS[None]
    new = self.replace(positions_B=self.positions_B + mask_BxT.sum(1, dtype=jnp.int32),
                       valid_BxS=valid_BxS, index=self.index + T)
    return new, pos_BxT, attend_BxTxS

  def write(self, layer: int, k_BxTxKxH: jax.Array, v_BxTxKxH: jax.Array,
            index: jax.Array) -> tuple[KVCache, jax.Array, jax.Array]:
    """Write one layer's new keys/values at slot `index`; return the layer's full k/v."""
    at = (layer, 0, index, 0, 0)
    k = jax.lax.dynamic_update_slice(self.k_LxBxSxKxH, k_BxTxKxH[None].astype(
        self.k_LxBxSxKxH.dtype), at)
    v = jax.lax.dynamic_update_slice(self.v_LxBxSxKxH, v_BxTxKxH[None].astype(
        self.v_LxBxSxKxH.dtype), at)
    return self.replace(k_LxBxSxKxH=k, v_LxBxSxKxH=v), k[layer], v[layer]
