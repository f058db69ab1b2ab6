"""One Flax NNX decoder for the Llama, Qwen2 and Qwen3 families.

Differences between the families are config switches: q/k/v bias (Qwen2),
per-head q/k RMSNorm (Qwen3), Llama-3 RoPE scaling, tied embeddings, head_dim.

Dense projections run on activations flattened to 2-D [P, D], P = B*T positions
(N is the number of query heads, K of key/value heads, H the head size): on XLA:CPU the
weight-gradient matmuls of 3-D `btd,df->btf` contractions measured ~3x slower.
Parameters are stored in `param_dtype` and cast to the compute `dtype` at use.
Every parameter carries logical axis names (`out_sharding` metadata, never applied
eagerly); `isojax.sharding` maps them to mesh axes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from isojax.models.attention import attention
from isojax.models.config import ModelConfig, rope_inv_freq
from isojax.models.kv_cache import KVCache
from isojax.sharding import constrain_batch

_INIT_STD = 0.02


def _param(rngs: nnx.Rngs | None, shape, names, cfg: ModelConfig, init: str) -> nnx.Param:
  if init == "normal":
    value = _INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)
  elif init == "ones":
    value = jnp.ones(shape, jnp.float32)
  else:
    value = jnp.zeros(shape, jnp.float32)
  # eager_sharding=False: the names are logical (no mesh here); sharding.py maps them.
  return nnx.Param(value.astype(cfg.param_dtype), out_sharding=names, eager_sharding=False)


def _dense(x_PxI: jax.Array, w: nnx.Param, in_dims: int, dtype) -> jax.Array:
  """x [P, I] @ w, with w's first `in_dims` axes flattened into I and the rest into O."""
  w = w[...]
  in_size = 1
  for d in w.shape[:in_dims]:
    in_size *= d
  return x_PxI @ w.astype(dtype).reshape(in_size, -1)


class RMSNorm(nnx.Module):
  """RMSNorm over the last axis, statistics in float32 (as transformers does)."""

  def __init__(self, dim: int, cfg: ModelConfig):
    self.eps = cfg.rms_norm_eps
    self.scale = _param(None, (dim,), ("norm",), cfg, "ones")

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return self.scale[...].astype(x.dtype) * y.astype(x.dtype)


def _rotate(x_BxTxNxH: jax.Array, cos_BxTxH: jax.Array, sin_BxTxH: jax.Array) -> jax.Array:
  """RoPE in transformers' rotate_half layout (first half / second half pairs)."""
  x1, x2 = jnp.split(x_BxTxNxH, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return x_BxTxNxH * cos_BxTxH[:, :, None] + rotated * sin_BxTxH[:, :, None]


class Attention(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    D, N, K, H = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.q_kernel = _param(rngs, (D, N, H), ("embed", "heads", "head_dim"), cfg, "normal")
    self.k_kernel = _param(rngs, (D, K, H), ("embed", "kv_heads", "head_dim"), cfg, "normal")
    self.v_kernel = _param(rngs, (D, K, H), ("embed", "kv_heads", "head_dim"), cfg, "normal")
    self.o_kernel = _param(rngs, (N, H, D), ("heads", "head_dim", "embed"), cfg, "normal")
    if cfg.attention_bias:
      self.q_bias = _param(None, (N, H), ("heads", "head_dim"), cfg, "zeros")
      self.k_bias = _param(None, (K, H), ("kv_heads", "head_dim"), cfg, "zeros")
      self.v_bias = _param(None, (K, H), ("kv_heads", "head_dim"), cfg, "zeros")
    if cfg.qk_norm:
      self.q_norm = RMSNorm(H, cfg)
      self.k_norm = RMSNorm(H, cfg)

  def project(self, x_BxTxD, cos_BxTxH, sin_BxTxH):
    """Queries [B, T, N, H] and keys, values [B, T, K, H], RoPE applied."""
    cfg, dt = self.cfg, self.cfg.dtype
    B, T, D = x_BxTxD.shape
    N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    x_PxD = x_BxTxD.reshape(B * T, D)
    q = _dense(x_PxD, self.q_kernel, 1, dt).reshape(B, T, N, H)
    k = _dense(x_PxD, self.k_kernel, 1, dt).reshape(B, T, K, H)
    v = _dense(x_PxD, self.v_kernel, 1, dt).reshape(B, T, K, H)
    if cfg.attention_bias:
      q = q + self.q_bias[...].astype(dt)
      k = k + self.k_bias[...].astype(dt)
      v = v + self.v_bias[...].astype(dt)
    if cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    return _rotate(q, cos_BxTxH, sin_BxTxH), _rotate(k, cos_BxTxH, sin_BxTxH), v

  def output(self, o_BxTxNxH):
    """The output projection of the attention result [B, T, N, H] -> [B, T, D]."""
    B, T, N, H = o_BxTxNxH.shape
    out = _dense(o_BxTxNxH.reshape(B * T, N * H), self.o_kernel, 2, self.cfg.dtype)
    return out.reshape(B, T, -1)

  def __call__(self, x_BxTxD, cos_BxTxH, sin_BxTxH, kv_valid_BxS, cache=None, layer=0,
               first_B=None):
    """Self-attention; with a cache, keys are its slots and row b's queries go to
    slots first_B[b], first_B[b] + 1, ... (`KVCache.start`)."""
    q, k, v = self.project(x_BxTxD, cos_BxTxH, sin_BxTxH)
    if cache is not None:  # attends over the cache's filled blocks only
      cache, o_PxNH = cache.attend(layer, q, k, v, first_B, self.cfg.head_dim ** -0.5)
      o_BxTxNxH = o_PxNH.reshape(q.shape)
    else:
      o_BxTxNxH = attention(q, k, v, kv_valid_BxS, implementation=self.cfg.attention)
    return self.output(o_BxTxNxH), cache


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    D, F = cfg.hidden_size, cfg.intermediate_size
    self.gate_kernel = _param(rngs, (D, F), ("embed", "mlp"), cfg, "normal")
    self.up_kernel = _param(rngs, (D, F), ("embed", "mlp"), cfg, "normal")
    self.down_kernel = _param(rngs, (F, D), ("mlp", "embed"), cfg, "normal")

  def __call__(self, x_BxTxD):
    dt = self.cfg.dtype
    B, T, D = x_BxTxD.shape
    x_PxD = x_BxTxD.reshape(B * T, D)
    h_PxF = jax.nn.silu(_dense(x_PxD, self.gate_kernel, 1, dt)) * _dense(
        x_PxD, self.up_kernel, 1, dt)
    return _dense(h_PxF, self.down_kernel, 1, dt).reshape(B, T, D)


class DecoderLayer(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.input_norm = RMSNorm(cfg.hidden_size, cfg)
    self.attn = Attention(cfg, rngs)
    self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg)
    self.mlp = MLP(cfg, rngs)

  def __call__(self, x_BxTxD, cos, sin, kv_valid_BxS, cache=None, layer=0, first_B=None):
    a, cache = self.attn(self.input_norm(x_BxTxD), cos, sin, kv_valid_BxS, cache, layer,
                         first_B)
    return self.after_attention(x_BxTxD, a), cache

  def after_attention(self, x_BxTxD, a_BxTxD):
    """The layer's output from its input and its attention's (projected) output."""
    h = x_BxTxD + a_BxTxD
    return h + self.mlp(self.post_attn_norm(h))


# What a rematerialised layer keeps for the backward pass besides its input.
# "dots" saves the dense projections' outputs (2-D matmuls, no batch dims); the
# attention einsums have batch dims and are recomputed, as is all elementwise work.
_REMAT_POLICIES = {"full": jax.checkpoint_policies.nothing_saveable,
                   "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def _rematted_layer(graphdef: nnx.GraphDef, policy: str, attention_impl: str):
  """A layer as a pure function of (its state, activations) under jax.checkpoint.

  The module is rebuilt from its state inside the checkpointed function, so no
  Variable crosses a trace level (nnx.remat over a module captured from the
  outside fails inside a jitted, scanned value_and_grad).

  "attention" checkpoints the layer in two parts, before and after the
  attention kernel, which runs outside both: its backward keeps what the
  kernel's own VJP saves (a fused kernel's queries, keys, values, output and
  softmax statistics; the einsum path's [T, T] probabilities), so the backward
  pass reruns the projections and the MLP but never the attention forward.
  """
  if policy != "attention":
    def forward(state, x, cos, sin, kv_valid):
      return nnx.merge(graphdef, state)(x, cos, sin, kv_valid)[0]
    return jax.checkpoint(forward, policy=_REMAT_POLICIES[policy])

  @jax.checkpoint
  def project(state, x, cos, sin):
    layer = nnx.merge(graphdef, state)
    return layer.attn.project(layer.input_norm(x), cos, sin)

  @jax.checkpoint
  def finish(state, x, o):
    layer = nnx.merge(graphdef, state)
    return layer.after_attention(x, layer.attn.output(o))

  def split_forward(state, x, cos, sin, kv_valid):
    q, k, v = project(state, x, cos, sin)
    return finish(state, x, attention(q, k, v, kv_valid, implementation=attention_impl))
  return split_forward


def _scan_rematted_layers(layers, cfg: ModelConfig, x, cos, sin, kv_valid):
  """All layers under one lax.scan over their stacked states, each rematerialised.

  jax.checkpoint alone says what to keep, not when to recompute: in an unrolled
  loop XLA may schedule every layer's recomputation early in the backward pass,
  so all layers' activations are alive at once again (on XLA:CPU remat "full"
  then used more memory than "none"). Inside a scan the backward is a loop
  that recomputes one layer per iteration. The states are stacked at trace
  time (the parameters stay one module per layer, as in the checkpoints), cast
  to the compute dtype first: every layer parameter is used in that dtype, and
  the stacked copy is half the size for bf16.
  """
  graphdef = nnx.graphdef(layers[0])
  states = [nnx.state(layer) for layer in layers]
  stacked = jax.tree.map(lambda *ps: jnp.stack([p.astype(cfg.dtype) for p in ps]), *states)
  layer = _rematted_layer(graphdef, cfg.remat, cfg.attention)

  def body(x, state):
    return constrain_batch(layer(state, x, cos, sin, kv_valid)), None

  return jax.lax.scan(body, x, stacked)[0]


def _check_token_ids(method: str, ids, mask=None, rank: int = 2) -> None:
  """A ValueError naming the argument for token ids that are not integers of
  `rank` axes, or a mask of another shape (it broadcast against the ids: a
  [2, T] mask turned one row into two, silently). Shapes and dtypes are static:
  under jit this runs once per trace, never per step."""
  what = "[batch, length]" if rank == 2 else "[batch]"
  if jnp.ndim(ids) != rank or not jnp.issubdtype(jnp.result_type(ids), jnp.integer):
    raise ValueError(f"Decoder.{method}: token ids must be integers of shape {what}; got "
                     f"{jnp.result_type(ids)} of shape {jnp.shape(ids)}")
  if mask is not None and jnp.shape(mask) != jnp.shape(ids):
    raise ValueError(f"Decoder.{method}: attention_mask has shape {jnp.shape(mask)}, the "
                     f"token ids {jnp.shape(ids)}; pass one mask entry per token")


class Decoder(nnx.Module):
  """Decoder-only LM. See `isojax.models` for the call API.

  Positions come from the attention mask (count of real tokens so far), so a
  left-padded batch gives each sequence the logits it would get unpadded.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    V, D = cfg.vocab_size, cfg.hidden_size
    self.embed = _param(rngs, (V, D), ("vocab", "embed"), cfg, "normal")
    self.layers = nnx.List([DecoderLayer(cfg, rngs) for _ in range(cfg.num_layers)])
    self.norm = RMSNorm(D, cfg)
    if not cfg.tie_word_embeddings:
      self.unembed = _param(rngs, (D, V), ("embed", "vocab"), cfg, "normal")

  def _embed_and_rope(self, ids_BxT, pos_BxT, mask_BxT):
    # Padding may hold any id (-100, vocab_size): jnp.take gives an out-of-range id
    # a NaN row, and a NaN value, though never attended, makes 0 * NaN = NaN in the
    # probability-value product of every query of its row.
    ids_BxT = jnp.where(mask_BxT, ids_BxT, 0)
    x = jnp.take(self.embed[...], ids_BxT, axis=0).astype(self.cfg.dtype)
    freqs_BxTxH2 = pos_BxT[..., None].astype(jnp.float32) * rope_inv_freq(self.cfg)
    emb = jnp.concatenate([freqs_BxTxH2, freqs_BxTxH2], axis=-1)
    return x, jnp.cos(emb).astype(self.cfg.dtype), jnp.sin(emb).astype(self.cfg.dtype)

  def hidden_states(self, input_ids_BxT: jax.Array,
                    attention_mask: jax.Array | None = None) -> jax.Array:
    """Final-norm hidden states [B, T, D] in the compute dtype (no cache)."""
    _check_token_ids("hidden_states", input_ids_BxT, attention_mask)
    B, T = input_ids_BxT.shape
    mask_BxT = (jnp.ones((B, T), bool) if attention_mask is None
                else attention_mask.astype(bool))
    pos_BxT = jnp.maximum(jnp.cumsum(mask_BxT, axis=1, dtype=jnp.int32) - 1, 0)
    x, cos, sin = self._embed_and_rope(input_ids_BxT, pos_BxT, mask_BxT)
    # Under FSDP the weights are split along their model dimensions; pinning the
    # hidden state's batch axis keeps XLA from splitting activations that way too
    # (every row computed on every device). A no-op outside the step's mesh.
    x = constrain_batch(x)
    # Causal over padded rows = causal by column among the mask's real tokens.
    if self.cfg.remat == "none":
      for layer in self.layers:
        x = constrain_batch(layer(x, cos, sin, mask_BxT)[0])
    else:
      x = _scan_rematted_layers(list(self.layers), self.cfg, x, cos, sin, mask_BxT)
    return self.norm(x)

  def lm_head_weight(self) -> tuple[jax.Array, int, object]:
    """(weight, its vocab axis, head dtype): what `lm_head` multiplies by.

    The weight is the stored parameter: the tied embedding [V, D] (vocab axis 0)
    or the unembedding [D, V] (vocab axis 1); the head computes in float32 when
    cfg.lm_head_fp32, else the compute dtype. For callers that recompute logits
    chunk by chunk (`isojax.rl.logprobs`).
    """
    cfg = self.cfg
    dt = jnp.float32 if cfg.lm_head_fp32 else cfg.dtype
    if cfg.tie_word_embeddings:
      return self.embed[...], 0, dt
    return self.unembed[...], 1, dt

  def lm_head(self, h_BxTxD: jax.Array) -> jax.Array:
    """Logits [..., V]; float32 when cfg.lm_head_fp32, else the compute dtype."""
    w, vocab_axis, dt = self.lm_head_weight()
    h_PxD = h_BxTxD.reshape(-1, self.cfg.hidden_size).astype(dt)
    if vocab_axis == 0:
      logits = jnp.einsum("pd,vd->pv", h_PxD, w.astype(dt))
    else:
      logits = h_PxD @ w.astype(dt)
    return logits.reshape(*h_BxTxD.shape[:-1], self.cfg.vocab_size)

  def __call__(self, input_ids_BxT: jax.Array,
               attention_mask: jax.Array | None = None) -> jax.Array:
    """Logits [B, T, V] of a full (uncached) forward pass."""
    return self.lm_head(self.hidden_states(input_ids_BxT, attention_mask))

  def init_cache(self, batch_size: int, max_len: int) -> KVCache:
    """An empty cache for `max_len` slots (prompt padding included)."""
    cfg = self.cfg
    return KVCache.zeros(cfg.num_layers, batch_size, max_len, cfg.num_kv_heads,
                         cfg.head_dim, cfg.dtype)

  def _cached_hidden(self, ids_BxT, mask_BxT, cache: KVCache):
    cache, pos_BxT, first_B = cache.start(mask_BxT)
    x, cos, sin = self._embed_and_rope(ids_BxT, pos_BxT, mask_BxT.astype(bool))
    for i, layer in enumerate(self.layers):
      x, cache = layer(x, cos, sin, None, cache, i, first_B)
    return self.norm(x), cache

  def prefill(self, input_ids_BxT: jax.Array, attention_mask_BxT: jax.Array,
              cache: KVCache, *, last_only: bool = False):
    """Run left-padded prompts through the model, filling the cache.

    Returns (logits [B, T, V], cache), or (logits [B, V] of the last column,
    cache) with `last_only=True` (what a sampler needs; saves a [B, T, V] array).
    """
    _check_token_ids("prefill", input_ids_BxT, attention_mask_BxT)
    h, cache = self._cached_hidden(input_ids_BxT, attention_mask_BxT, cache)
    return self.lm_head(h[:, -1] if last_only else h), cache

  def decode_step(self, token_B: jax.Array, cache: KVCache):
    """Feed one new token per sequence; returns (logits [B, V], cache)."""
    _check_token_ids("decode_step", token_B, rank=1)
    ids_Bx1 = token_B[:, None]
    h, cache = self._cached_hidden(ids_Bx1, jnp.ones_like(ids_Bx1, bool), cache)
    return self.lm_head(h[:, 0]), cache
