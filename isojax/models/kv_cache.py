"""KVCache: a fixed-shape key/value cache that lives inside jit and lax.while_loop.

Each layer has its own key and value arrays, laid out as attention's matmuls
read them (keys [B, K, H, S], values [B, K, S, H]), so a decode step reads a
layer's cache in place: on XLA:CPU a layer slice of one stacked [L, ...] array,
or keys/values in [B, S, K, H], cost a copy (a transpose) of the layer's whole
cache per step, about half of the decode time of a small model.

Each row has its own fill level (`lengths_B`, the next slot it writes): rows of
one batch may hold sequences of different lengths, and a row can be emptied and
refilled with a new sequence while the others go on (continuous batching). New
keys/values are scattered at each row's own slots.

Attention reads only what was written, not all `max_len` slots. The slots are
grouped in blocks of `block` positions; by default `attend` loops
(lax.fori_loop with a traced trip count) over the blocks up to the fullest row
with an online softmax. A caller that knows a bound on the fill (a sampler
between jitted chunks of decode steps) sets a static `read_len` instead, and
attention reads exactly those slots with no control flow.

Left-padded prompts leave invalid slots, tracked by `valid_BxS`; each sequence's
RoPE position is its own count of real tokens (`positions_B`), so padding never
shifts positions.

A cache may also hold a shared prefix (`with_prefix`): Q prefixes (prompts), each
attended by a group of B / Q consecutive rows (its n samples) before the rows'
own slots. A prefix is stored and read once for its group, not copied to every
row, and its group's queries meet its keys in one matmul. Such a cache decodes
in lockstep: every row writes the same slot (one contiguous update instead of a
per-row scatter).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

# Largest block of slots one attention iteration reads. Larger blocks mean fewer
# loop iterations (launch overhead on GPUs), smaller ones less over-read past
# the fill level.
DEFAULT_BLOCK = 256


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def block_size(max_len: int, block: int = DEFAULT_BLOCK) -> int:
  """The block a cache of `max_len` slots uses: `block`, or the whole (8-rounded)
  length when that is shorter (a short cache is one block)."""
  return min(int(block), _round_up(max(int(max_len), 1), 8))


def _storage(dtype):
  """How keys/values of `dtype` are stored: 16-bit floats as their uint16 bits.

  XLA:CPU widens a 16-bit float scatter or dynamic slice of the cache to float32
  over the whole array (full-size temporaries per layer and step); on integer
  bits it updates and slices in place. Accelerators are indifferent."""
  return jnp.uint16 if jnp.dtype(dtype).itemsize == 2 else jnp.dtype(dtype)


def _to_storage(x: jax.Array, dtype) -> jax.Array:
  x = x.astype(dtype)
  return jax.lax.bitcast_convert_type(x, jnp.uint16) if _storage(dtype) == jnp.uint16 else x


def _from_storage(x: jax.Array, dtype) -> jax.Array:
  return jax.lax.bitcast_convert_type(x, dtype) if x.dtype == jnp.uint16 else x


def _online_softmax_step(q_BxKxGxTxH, k_BxKxHxC, v_BxKxCxH, ok_BxTxC, scale, m_BxKxGxT,
                         l_BxKxGxT, acc_BxKxGxTxH):
  """Folds C more key slots into a running softmax: (max m, normaliser l,
  unnormalised output acc) -> the same after them; `ok` says which slots each
  query sees. Scores (scaled in float32, as the uncached path does: a 16-bit
  q * scale rounds q again, and doubled the bf16 error against float64) and the
  carry are float32; p meets v in v's dtype. A
  carry of None is the empty one (the first block): the same values with
  fewer operations (a decode step reads one block per layer)."""
  s = jnp.einsum("bkgth,bkhc->bkgtc", q_BxKxGxTxH, k_BxKxHxC,
                 preferred_element_type=jnp.float32) * scale
  ok = ok_BxTxC[:, None, None]
  m_new = jnp.max(jnp.where(ok, s, -jnp.inf), axis=-1)
  if m_BxKxGxT is not None:
    m_new = jnp.maximum(m_BxKxGxT, m_new)
  # Rows with nothing valid yet keep m = -inf; shift by 0 there (p is 0 anyway).
  shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
  p = jnp.where(ok, jnp.exp(s - shift[..., None]), 0.0)
  pv = jnp.einsum("bkgtc,bkch->bkgth", p.astype(v_BxKxCxH.dtype), v_BxKxCxH,
                  preferred_element_type=jnp.float32)
  if m_BxKxGxT is None:
    return m_new, p.sum(-1), pv
  corr = jnp.exp(m_BxKxGxT - shift)
  l_new = l_BxKxGxT * corr + p.sum(-1)
  return m_new, l_new, acc_BxKxGxTxH * corr[..., None] + pv


@struct.dataclass
class KVCache:
  """Keys/values of every layer plus per-row bookkeeping.

  Attributes:
    k_BxKxHxS, v_BxKxSxH: per layer, cached keys/values (S = max_len rounded
      up to a whole number of blocks, K = kv heads, H = head_dim); values of
      `dtype`, stored as raw uint16 bits when `dtype` is a 16-bit float.
    positions_B: int32, the RoPE position the next token of each row gets.
    valid_BxS: bool, slot s holds a real token of row b.
    lengths_B: int32, the next slot each row writes (slots [0, lengths_B) are
      filled, padding included).
    prefix_k_QxKxHxL, prefix_v_QxKxLxH, prefix_valid_QxL: the shared prefixes
      (empty / None: none), stored like k/v; row b attends prefix b // (B / Q)
      before its own slots, and all rows write the same slots (lockstep).
    block: static, slots per attention block (S is a multiple of it).
    dtype: static, the dtype of keys/values (the model's compute dtype).
    read_len: static; None: attention loops over the blocks up to the fullest
      row (a traced trip count). A whole number of blocks: attention reads
      exactly slots [0, read_len), with no loop; the caller keeps every row's
      fill (after the write) within it, e.g. stepping it up between jitted
      chunks of decode steps (`with_read_len`).
  """

  k_BxKxHxS: tuple[jax.Array, ...]
  v_BxKxSxH: tuple[jax.Array, ...]
  positions_B: jax.Array
  valid_BxS: jax.Array
  lengths_B: jax.Array
  prefix_k_QxKxHxL: tuple[jax.Array, ...] = ()
  prefix_v_QxKxLxH: tuple[jax.Array, ...] = ()
  prefix_valid_QxL: jax.Array | None = None
  block: int = struct.field(pytree_node=False, default=DEFAULT_BLOCK)
  dtype: Any = struct.field(pytree_node=False, default=jnp.float32)
  read_len: int | None = struct.field(pytree_node=False, default=None)

  @property
  def max_len(self) -> int:
    return self.v_BxKxSxH[0].shape[2]

  @property
  def shared_prefix(self) -> bool:
    """Whether rows attend shared prefixes (and decode in lockstep)."""
    return self.prefix_valid_QxL is not None

  @classmethod
  def zeros(cls, num_layers: int, batch_size: int, max_len: int, num_kv_heads: int,
            head_dim: int, dtype, block: int = DEFAULT_BLOCK, num_prefixes: int = 0,
            prefix_len: int = 0) -> KVCache:
    """An empty cache of `max_len` slots per row; with `num_prefixes`, also that
    many empty shared prefixes of `prefix_len` slots. A sampler that decodes in
    lockstep starts from such a cache so that its loop state has the
    shared-prefix structure from the first step; admitting prompts then replaces
    the placeholders with their prefill (`with_prefix`)."""
    blk = block_size(max_len, block)
    slots = _round_up(max_len, blk)
    layers = range(num_layers)
    cache = cls(
        k_BxKxHxS=tuple(jnp.zeros((batch_size, num_kv_heads, head_dim, slots),
                                  _storage(dtype)) for _ in layers),
        v_BxKxSxH=tuple(jnp.zeros((batch_size, num_kv_heads, slots, head_dim),
                                  _storage(dtype)) for _ in layers),
        positions_B=jnp.zeros((batch_size,), jnp.int32),
        valid_BxS=jnp.zeros((batch_size, slots), bool),
        lengths_B=jnp.zeros((batch_size,), jnp.int32), block=blk, dtype=dtype)
    if num_prefixes:
      cache = cache.with_prefix(cls.zeros(num_layers, num_prefixes, prefix_len, num_kv_heads,
                                          head_dim, dtype, block))
    return cache

  def _check_rows_fit(self, other: KVCache, what: str) -> None:
    """A ValueError unless `other`'s rows are stored like this cache's: a float32
    row set into uint16 (bf16) storage would be cast to integers, and a cache
    with fewer layers would be zipped short, both silently."""
    def layout(c):
      return (len(c.k_BxKxHxS), jnp.dtype(c.dtype).name,
              tuple(c.k_BxKxHxS[0].shape[1:3]) if c.k_BxKxHxS else ())
    if layout(other) != layout(self):
      raise ValueError(f"KVCache.{what}: source (layers, dtype, (kv heads, head_dim)) "
                       f"{layout(other)} differ from this cache's {layout(self)}")

  def with_prefix(self, prefix: KVCache) -> KVCache:
    """This cache's rows, emptied, attending the rows of `prefix` (e.g. a
    prefill of Q prompts) as shared prefixes: row b attends prefix row
    b // (B / Q) first and continues its RoPE positions."""
    batch, num_prefixes = self.lengths_B.shape[0], prefix.lengths_B.shape[0]
    if prefix.shared_prefix or batch % num_prefixes:
      raise ValueError(f"KVCache.with_prefix: {num_prefixes} prefixes for {batch} rows; "
                       f"expected a cache without prefixes whose rows divide {batch}")
    self._check_rows_fit(prefix, "with_prefix")
    group = batch // num_prefixes
    return self.replace(
        prefix_k_QxKxHxL=prefix.k_BxKxHxS, prefix_v_QxKxLxH=prefix.v_BxKxSxH,
        prefix_valid_QxL=prefix.valid_BxS,
        positions_B=jnp.repeat(prefix.positions_B, group),
        valid_BxS=jnp.zeros_like(self.valid_BxS), lengths_B=jnp.zeros_like(self.lengths_B))

  def with_read_len(self, read_len: int | None) -> KVCache:
    """This cache with attention reading slots [0, read_len) (see read_len)."""
    if read_len is not None and (read_len % self.block or not 0 < read_len <= self.max_len):
      raise ValueError(f"KVCache.with_read_len: {read_len} is not a whole number of "
                       f"{self.block}-slot blocks within {self.max_len} slots")
    return self.replace(read_len=read_len)

  @staticmethod
  def bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int, dtype) -> int:
    """Bytes one row's keys + values take per cached position (all layers)."""
    return 2 * num_layers * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize

  def start(self, mask_BxT: jax.Array) -> tuple[KVCache, jax.Array, jax.Array]:
    """Book T new slots [lengths_B, lengths_B + T) per row for tokens whose
    real-ness is `mask_BxT`.

    Returns the updated bookkeeping (k/v untouched), the RoPE positions of the
    new tokens [B, T] and each row's first new slot [B] (what `attend` takes).
    More tokens than max_len at once are refused (a static shape); writing past
    max_len over several calls is not checked (the fill is traced; such writes
    are dropped): callers size the cache for prompt + completion.
    """
    mask_BxT = mask_BxT.astype(bool)
    B, T = mask_BxT.shape
    if T > self.max_len:  # its last T - max_len keys would be dropped: wrong logits
      raise ValueError(f"KVCache: {T} tokens do not fit its {self.max_len} slots; make "
                       f"the cache (Decoder.init_cache's max_len) at least prompt + "
                       f"completion long")
    # Padding tokens get the position of the previous real token (clipped at the
    # first); they are never attended to, so their position only has to be finite.
    pos_BxT = self.positions_B[:, None] + jnp.cumsum(mask_BxT, axis=1, dtype=jnp.int32) - 1
    pos_BxT = jnp.maximum(pos_BxT, 0)
    slot_BxT = self.lengths_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
    valid_BxS = self.valid_BxS.at[jnp.arange(B)[:, None], slot_BxT].set(mask_BxT)
    new = self.replace(positions_B=self.positions_B + mask_BxT.sum(1, dtype=jnp.int32),
                       valid_BxS=valid_BxS, lengths_B=self.lengths_B + T)
    return new, pos_BxT, self.lengths_B

  def insert(self, dest_A: jax.Array, src: KVCache, src_A: jax.Array) -> KVCache:
    """Replaces rows dest_A with rows src_A of `src` (e.g. a prefill's cache with
    fewer slots): its slots go first, the rest become invalid. Rows whose dest is
    out of range (>= B) are skipped, so padding entries write nothing."""
    s_src = src.max_len
    if s_src > self.max_len:
      raise ValueError(f"KVCache.insert: source rows have {s_src} slots, more than "
                       f"this cache's {self.max_len}")
    self._check_rows_fit(src, "insert")
    valid_AxS = jnp.zeros((src_A.shape[0], self.max_len), bool).at[:, :s_src].set(
        src.valid_BxS[src_A])
    return self.replace(
        k_BxKxHxS=tuple(k.at[dest_A, :, :, :s_src].set(k_src[src_A], mode="drop")
                        for k, k_src in zip(self.k_BxKxHxS, src.k_BxKxHxS)),
        v_BxKxSxH=tuple(v.at[dest_A, :, :s_src].set(v_src[src_A], mode="drop")
                        for v, v_src in zip(self.v_BxKxSxH, src.v_BxKxSxH)),
        positions_B=self.positions_B.at[dest_A].set(src.positions_B[src_A], mode="drop"),
        valid_BxS=self.valid_BxS.at[dest_A].set(valid_AxS, mode="drop"),
        lengths_B=self.lengths_B.at[dest_A].set(src.lengths_B[src_A], mode="drop"))

  def _attend_prefix(self, layer: int, q_BxKxGxTxH: jax.Array, scale: float):
    """The online-softmax state (m, l, acc) of every row's queries after its
    shared prefix. The queries of a prefix's rows are stacked, so that they
    meet its keys and values in one matmul each (the prefix is read once)."""
    B, K, G, T, H = q_BxKxGxTxH.shape
    Q, L = self.prefix_valid_QxL.shape
    n = B // Q  # M = n * G: the query groups of a prefix's n rows, stacked
    q_QxKxMxTxH = (q_BxKxGxTxH.reshape(Q, n, K, G, T, H).transpose(0, 2, 1, 3, 4, 5)
                   .reshape(Q, K, n * G, T, H))
    ok_QxTxL = jnp.broadcast_to(self.prefix_valid_QxL[:, None, :], (Q, T, L))
    state = _online_softmax_step(q_QxKxMxTxH,
                                 _from_storage(self.prefix_k_QxKxHxL[layer], self.dtype),
                                 _from_storage(self.prefix_v_QxKxLxH[layer], self.dtype),
                                 ok_QxTxL, scale, None, None, None)

    def per_row(x):  # [Q, K, n*G, T, ...] -> [B, K, G, T, ...]
      x = x.reshape(Q, K, n, G, *x.shape[3:])
      return jnp.moveaxis(x, 2, 1).reshape(B, K, G, *x.shape[4:])
    return tuple(per_row(x) for x in state)

  def attend(self, layer: int, q_BxTxNxH: jax.Array, k_BxTxKxH: jax.Array,
             v_BxTxKxH: jax.Array, first_B: jax.Array, scale: float
             ) -> tuple[KVCache, jax.Array]:
    """Writes one layer's new keys/values at slots [first_B, first_B + T) and
    attends the new queries over the row's shared prefix, if any, then the
    filled blocks (causal, valid slots only).

    Grouped-query: query head n uses kv head n // (N/K). Returns the cache and
    the attention output [B*T, N*H] in the compute dtype. A query with nothing
    to attend to (a left-pad token) gets zeros.
    """
    B, T, N, H = q_BxTxNxH.shape
    K = k_BxTxKxH.shape[2]
    G = N // K
    dt = self.dtype
    slot_BxT = first_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
    if self.shared_prefix:
      # Lockstep: one slot range for all rows, a contiguous update (a scatter
      # costs ~10x more per step on XLA:CPU). The caller keeps it inside max_len
      # (an update past the end would be moved back onto the last slots).
      first = jnp.max(first_B)
      k_all = jax.lax.dynamic_update_slice_in_dim(
          self.k_BxKxHxS[layer], _to_storage(k_BxTxKxH.transpose(0, 2, 3, 1), dt), first, 3)
      v_all = jax.lax.dynamic_update_slice_in_dim(
          self.v_BxKxSxH[layer], _to_storage(v_BxTxKxH.transpose(0, 2, 1, 3), dt), first, 2)
    else:
      row_Bx1 = jnp.arange(B)[:, None]
      # Advanced indices split by slices: the indexed [B, T] dims come first.
      k_all = self.k_BxKxHxS[layer].at[row_Bx1, :, :, slot_BxT].set(_to_storage(k_BxTxKxH, dt))
      v_all = self.v_BxKxSxH[layer].at[row_Bx1, :, slot_BxT].set(_to_storage(v_BxTxKxH, dt))

    blk = self.block
    q_BxKxGxTxH = q_BxTxNxH.reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4)
    num_blocks = jnp.minimum(-(-jnp.max(first_B + T) // blk), self.max_len // blk)

    def read(start, size, carry):
      """Online-softmax update with slots [start, start + size)."""
      m_BxKxGxT, l_BxKxGxT, acc_BxKxGxTxH, k_all, v_all = carry
      k_BxKxHxC = _from_storage(jax.lax.dynamic_slice_in_dim(k_all, start, size, axis=3), dt)
      v_BxKxCxH = _from_storage(jax.lax.dynamic_slice_in_dim(v_all, start, size, axis=2), dt)
      valid_BxC = jax.lax.dynamic_slice_in_dim(self.valid_BxS, start, size, axis=1)
      slot_C = start + jnp.arange(size, dtype=jnp.int32)
      ok_BxTxC = valid_BxC[:, None, :] & (slot_C[None, None, :] <= slot_BxT[:, :, None])
      m, l, acc = _online_softmax_step(q_BxKxGxTxH, k_BxKxHxC, v_BxKxCxH, ok_BxTxC, scale,
                                       m_BxKxGxT, l_BxKxGxT, acc_BxKxGxTxH)
      return m, l, acc, k_all, v_all

    # The running softmax starts from the shared prefix, if any (None: empty).
    start = (self._attend_prefix(layer, q_BxKxGxTxH, scale) if self.shared_prefix
             else (None, None, None))
    if self.read_len is not None or self.max_len == blk:
      # A static extent: plain attention over it, no control flow (a loop costs a
      # device->host sync per iteration on some backends, and dominates short caches).
      _, l_BxKxGxT, acc, k_all, v_all = read(0, self.read_len or blk, (*start, k_all, v_all))
    else:
      if start[0] is None:
        start = (jnp.full((B, K, G, T), -jnp.inf, jnp.float32),
                 jnp.zeros((B, K, G, T), jnp.float32),
                 jnp.zeros((B, K, G, T, H), jnp.float32))
      # The cache arrays ride through the loop carry: closed over while also
      # live after the loop, XLA would copy them (the whole cache, per layer).
      _, l_BxKxGxT, acc, k_all, v_all = jax.lax.fori_loop(
          0, num_blocks, lambda j, c: read(j * blk, blk, c), (*start, k_all, v_all))
    o_BxKxGxTxH = acc / jnp.maximum(l_BxKxGxT, 1e-30)[..., None]
    o = o_BxKxGxTxH.transpose(0, 3, 1, 2, 4).reshape(B * T, N * H).astype(q_BxTxNxH.dtype)
    swap = lambda layers, x: (*layers[:layer], x, *layers[layer + 1:])
    return self.replace(k_BxKxHxS=swap(self.k_BxKxHxS, k_all),
                        v_BxKxSxH=swap(self.v_BxKxSxH, v_all)), o
