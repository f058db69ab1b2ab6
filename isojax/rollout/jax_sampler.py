"""In-process JAX sampler: prefill + KV-cache decode in one jitted loop.

All prompts x n rollouts run as one batch. Each distinct prompt is prefilled
once and its cache rows copied to its n samples. Prompts are left-padded to a
power-of-two length bucket, the prompt count is padded with dummy prompts
(their rows finished from the start, dropped on return) to a power of two and
max_tokens is bucketed likewise, so a training run compiles a handful of
shapes. The model's graph definition is static and its parameters are an
argument, so `update_weights` never recompiles.

Sampling semantics (match vLLM's and `transformers`' order of processing):
logits / temperature -> top-k -> top-p (smallest set of tokens whose
probability reaches top_p) -> sample. The returned logprob is that of the
distribution actually sampled from, i.e. log-softmax of the processed logits.
With temperature 0 (greedy) the argmax token is taken and its logprob is the
log-softmax of the unscaled logits.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from isojax import sharding
from isojax.rollout.base import (FINISH_LENGTH, FINISH_STOP, Rollouts,
                                 validate_request)

PAD_ID = 0


@dataclasses.dataclass(frozen=True)
class _Static:
  """Everything the compiled loop is specialised on besides array shapes."""
  n: int  # samples per prompt
  max_tokens: int  # power-of-two bucket; the request's own limit is an argument
  greedy: bool
  top_k: int  # 0 = no top-k filtering
  use_top_p: bool
  # With a mesh: the sharding of rollout rows (B) and of their KV cache.
  rows: Any = None
  cache_rows: Any = None


def _next_pow2(x: int) -> int:
  return 1 << max(0, int(x) - 1).bit_length()


def _bucket_prompts(num_prompts: int, n: int, row_multiple: int) -> int:
  """Power-of-two prompt count, raised so that prompts * n splits evenly over
  `row_multiple` devices."""
  q = _next_pow2(num_prompts)
  m = row_multiple // math.gcd(n, row_multiple)
  return -(-q // m) * m


def _sample_token(logits_BxV, u_B, temperature, top_p, s: _Static):
  """Draws one token per row; returns (token_B int32, logprob_B float32).

  Sampling is by inverse CDF with one uniform u_B in (0, 1] per row, which
  costs far less per step than a full-vocabulary Gumbel draw.
  """
  logits_BxV = logits_BxV.astype(jnp.float32)
  if s.greedy:
    tok_B = jnp.argmax(logits_BxV, axis=-1)
    logp_B = (jnp.take_along_axis(logits_BxV, tok_B[:, None], axis=-1)[:, 0]
              - jax.nn.logsumexp(logits_BxV, axis=-1))
    return tok_B.astype(jnp.int32), logp_B

  scaled_BxV = logits_BxV / temperature
  if s.top_k:
    # Work in the (sorted, descending) top-k space from here on: top-p then
    # needs no full-vocabulary sort.
    cand_BxK, ids_BxK = jax.lax.top_k(scaled_BxV, s.top_k)
  elif s.use_top_p:
    ids_BxK = jnp.argsort(-scaled_BxV, axis=-1)
    cand_BxK = jnp.take_along_axis(scaled_BxV, ids_BxK, axis=-1)
  else:
    cand_BxK, ids_BxK = scaled_BxV, None
  if s.use_top_p:
    probs_BxK = jax.nn.softmax(cand_BxK, axis=-1)
    mass_before_BxK = jnp.cumsum(probs_BxK, axis=-1) - probs_BxK
    # Keep the smallest prefix whose mass reaches top_p (the first token always).
    cand_BxK = jnp.where(mass_before_BxK < top_p, cand_BxK, -jnp.inf)

  lse_B = jax.nn.logsumexp(cand_BxK, axis=-1)
  probs_BxK = jnp.exp(cand_BxK - lse_B[:, None])
  cdf_BxK = jnp.cumsum(probs_BxK, axis=-1)
  # u > 0, so a zero-probability (filtered) token is never chosen.
  x_B = u_B * cdf_BxK[:, -1]
  idx_B = jnp.sum(cdf_BxK < x_B[:, None], axis=-1)
  idx_B = jnp.minimum(idx_B, cdf_BxK.shape[-1] - 1)
  logp_B = jnp.take_along_axis(cand_BxK, idx_B[:, None], axis=-1)[:, 0] - lse_B
  tok_B = idx_B if ids_BxK is None else jnp.take_along_axis(ids_BxK, idx_B[:, None], axis=-1)[:, 0]
  return tok_B.astype(jnp.int32), logp_B


class _Decoded(NamedTuple):
  """What the decode loop accumulates; done_B rows emit padding from then on."""
  tokens_BxT: jax.Array
  logp_BxT: jax.Array
  lengths_B: jax.Array
  done_B: jax.Array
  stopped_B: jax.Array  # a stop / EOS token ended the row


def _repeat_rows(cache, n: int):
  """A prefilled cache with each prompt's row repeated for its n samples."""
  return cache.replace(
      k_LxBxSxKxH=jnp.repeat(cache.k_LxBxSxKxH, n, axis=1),
      v_LxBxSxKxH=jnp.repeat(cache.v_LxBxSxKxH, n, axis=1),
      positions_B=jnp.repeat(cache.positions_B, n, axis=0),
      valid_BxS=jnp.repeat(cache.valid_BxS, n, axis=0))


def _generate(graphdef, s: _Static, state, prompt_QxL, mask_QxL, active_B, stop_V, key,
              temperature, top_p, max_tokens):
  """Prefill the Q distinct prompts once, then decode B = Q * n rows until every
  row has stopped or max_tokens is hit.

  Returns tokens_BxT, logprobs_BxT, lengths_B, stopped_B (True where a stop /
  EOS token ended the row).
  """
  model = nnx.merge(graphdef, state)
  q, l = prompt_QxL.shape
  b, t_max = q * s.n, s.max_tokens
  # All randomness up front, one uniform in (0, 1] per (row, step), keyed by row:
  # a row's samples do not depend on the batch size or on how it is sharded,
  # and the decode loop runs no random-number generator.
  keys_B = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(b))
  u_BxT = 1.0 - jax.vmap(lambda k: jax.random.uniform(k, (t_max,)))(keys_B)
  # The n samples of a prompt share its prefill: run it once per prompt, then
  # copy the cache rows (prefill costs 1/n of running it per sample).
  cache = model.init_cache(q, l + t_max)
  # Left padding: the last column is every prompt's last real token.
  logits_QxV, cache = model.prefill(prompt_QxL, mask_QxL, cache, last_only=True)
  logits_BxV = jnp.repeat(logits_QxV, s.n, axis=0)
  cache = _repeat_rows(cache, s.n)
  if s.rows is not None:  # prompts may be replicated; the rollout rows never are
    logits_BxV = jax.lax.with_sharding_constraint(logits_BxV, s.rows)
    cache = cache.replace(
        k_LxBxSxKxH=jax.lax.with_sharding_constraint(cache.k_LxBxSxKxH, s.cache_rows),
        v_LxBxSxKxH=jax.lax.with_sharding_constraint(cache.v_LxBxSxKxH, s.cache_rows),
        positions_B=jax.lax.with_sharding_constraint(cache.positions_B, s.rows),
        valid_BxS=jax.lax.with_sharding_constraint(cache.valid_BxS, s.rows))

  def emit(step, logits_BxV, out: _Decoded) -> tuple[jax.Array, _Decoded]:
    """Samples token `step` of every unfinished row and records it."""
    u_B = jax.lax.dynamic_slice_in_dim(u_BxT, step, 1, axis=1)[:, 0]
    tok_B, logp_B = _sample_token(logits_BxV, u_B, temperature, top_p, s)
    tok_B = jnp.where(out.done_B, PAD_ID, tok_B)
    logp_B = jnp.where(out.done_B, 0.0, logp_B)
    hit_B = ~out.done_B & stop_V[tok_B]
    return tok_B, _Decoded(
        tokens_BxT=jax.lax.dynamic_update_slice(out.tokens_BxT, tok_B[:, None], (0, step)),
        logp_BxT=jax.lax.dynamic_update_slice(out.logp_BxT, logp_B[:, None], (0, step)),
        lengths_B=out.lengths_B + (~out.done_B).astype(jnp.int32),
        done_B=out.done_B | hit_B,
        stopped_B=out.stopped_B | hit_B)

  empty = _Decoded(tokens_BxT=jnp.zeros((b, t_max), jnp.int32),
                   logp_BxT=jnp.zeros((b, t_max), jnp.float32),
                   lengths_B=jnp.zeros((b,), jnp.int32), done_B=~active_B,
                   stopped_B=jnp.zeros((b,), bool))
  tok_B, out = emit(0, logits_BxV, empty)

  def cond(carry):
    step, _, _, out = carry
    return (step < max_tokens) & ~jnp.all(out.done_B)

  def body(carry):
    step, prev_B, cache, out = carry
    logits_BxV, cache = model.decode_step(prev_B, cache)
    tok_B, out = emit(step, logits_BxV, out)
    return step + 1, tok_B, cache, out

  _, _, _, out = jax.lax.while_loop(cond, body, (jnp.int32(1), tok_B, cache, out))
  return out.tokens_BxT, out.logp_BxT, out.lengths_B, out.stopped_B


def _model_config(model):
  for name in ("cfg", "config"):
    cfg = getattr(model, name, None)
    if cfg is not None:
      return cfg
  raise ValueError(f"JaxSampler: model {type(model).__name__} has no .cfg/.config")


def _eos_ids(cfg) -> tuple[int, ...]:
  """EOS id(s) of the model: `cfg.eos_token_id`, else its HF config.json's."""
  eos = getattr(cfg, "eos_token_id", None)
  if eos is None and getattr(cfg, "hf_config_json", ""):
    eos = json.loads(cfg.hf_config_json).get("eos_token_id")
  if eos is None:
    return ()
  return tuple(int(e) for e in (eos if isinstance(eos, Sequence) else (eos,)))


class JaxSampler:
  """Samples rollouts from a Flax NNX `Decoder` in this process.

  Args:
    model: an `isojax.models.Decoder` (anything with init_cache / prefill /
      decode_step and a config carrying vocab_size, max_position_embeddings,
      eos_token_id).
    mesh: optional `jax.sharding.Mesh` with axes ("data", "fsdp", "tensor").
      Rollout rows are split over ("data", "fsdp"), parameters follow their
      logical axis names through `rules`.
    rules: logical -> mesh axis rules (default `isojax.sharding.DEFAULT_RULES`).
    max_len: optional cap on prompt + max_tokens (below the model's context),
      e.g. to bound KV-cache memory.
    min_prompt_bucket: smallest prompt-length bucket (fewer compilations for
      short prompts, at little cost).
  """

  def __init__(self, model, *, mesh=None, rules=None, max_len: int | None = None,
               min_prompt_bucket: int = 16):
    self._cfg = _model_config(model)
    self._mesh = mesh
    self._rules = sharding.DEFAULT_RULES if rules is None else rules
    self._min_prompt_bucket = int(min_prompt_bucket)
    self._vocab_size = int(self._cfg.vocab_size)
    context = getattr(self._cfg, "max_position_embeddings", None)
    limits = [x for x in (context, max_len) if x is not None]
    self._max_len = min(limits) if limits else None
    self._eos_ids = _eos_ids(self._cfg)
    self._graphdef, state = nnx.split(model)
    self._state_shardings = self._shardings_for(state)
    self._state = self._put_state(state)
    self._build_jit()

  # -- sharding -------------------------------------------------------------

  def _shardings_for(self, state):
    if self._mesh is None:
      return None
    return sharding.state_shardings(state, self._mesh, self._rules)

  def _put_state(self, state):
    if self._state_shardings is None:
      return jax.device_put(state)
    return jax.device_put(state, self._state_shardings)

  def _build_jit(self):
    """The one jit site: specialised on _Static settings and array shapes.

    Rollout rows are split over the mesh axes the "batch" rule names (data x
    fsdp by default); prompts are split the same way when their count divides
    evenly, else replicated (their sharding is then taken from the argument).
    """
    fn = functools.partial(_generate, self._graphdef)
    self._row_multiple, self._rows, self._cache_rows = 1, None, None
    if self._mesh is None:
      self._jit = jax.jit(fn, static_argnums=0)
      return
    mesh, P = self._mesh, jax.sharding.PartitionSpec  # pylint: disable=invalid-name
    batch_spec = sharding.logical_to_spec(("batch",), self._rules)
    batch_axes = batch_spec[0] if len(batch_spec) else None
    axes = () if batch_axes is None else (
        (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes))
    self._row_multiple = math.prod(mesh.shape[a] for a in axes)
    self._rows = jax.sharding.NamedSharding(mesh, P(batch_axes))
    self._cache_rows = jax.sharding.NamedSharding(
        mesh, P(None, batch_axes, None, P.UNCONSTRAINED, None))
    self._rep = jax.sharding.NamedSharding(mesh, P())
    rows, rep = self._rows, self._rep
    self._jit = jax.jit(
        fn, static_argnums=0,
        in_shardings=(self._state_shardings, None, None, rows, rep, rep, rep, rep, rep),
        out_shardings=(rows, rows, rows, rows))

  # -- public API -----------------------------------------------------------

  def update_weights(self, model) -> None:
    """Swaps in new parameters without recompiling.

    Args:
      model: a Decoder of the same architecture, or its `nnx.state(model)`
        (e.g. the trainer's, possibly sharded differently: it is resharded).
    """
    if isinstance(model, nnx.State):
      state = model
    else:
      graphdef, state = nnx.split(model)
      if graphdef != self._graphdef:
        raise ValueError("JaxSampler.update_weights: model structure differs from the "
                         "one the sampler was built with")
    old = jax.tree.map(lambda x: (x.shape, x.dtype), self._state)
    new = jax.tree.map(lambda x: (x.shape, x.dtype), state)
    if jax.tree.structure(old) != jax.tree.structure(new) or old != new:
      raise ValueError("JaxSampler.update_weights: parameter names/shapes/dtypes differ "
                       "from the ones the sampler was built with")
    self._state = self._put_state(state)

  def generate(self, prompt_ids: list[list[int]], *, n: int, max_tokens: int,
               temperature: float, top_p: float = 1.0, top_k: int | None = None,
               stop_token_ids: Sequence[int] = (), seed: int = 0) -> Rollouts:
    """Samples n completions per prompt (prompt-major); see `Rollouts`.

    EOS token(s) from the model config always end a sequence, as do
    `stop_token_ids`; the stopping token is part of the completion.
    `top_k` None or 0 disables top-k; temperature 0 is greedy (top_p/top_k
    are then irrelevant).
    """
    validate_request(prompt_ids, n=n, max_tokens=max_tokens, temperature=temperature,
                     top_p=top_p, top_k=top_k, stop_token_ids=stop_token_ids,
                     vocab_size=self._vocab_size, max_model_len=self._max_len)
    greedy = temperature == 0
    k = 0 if (greedy or not top_k or top_k >= self._vocab_size) else int(top_k)
    s = _Static(n=int(n), max_tokens=_next_pow2(max_tokens), greedy=greedy, top_k=k,
                use_top_p=(not greedy) and top_p < 1.0, rows=self._rows,
                cache_rows=self._cache_rows)

    b = len(prompt_ids) * n
    l_bucket = max(_next_pow2(max(len(p) for p in prompt_ids)), self._min_prompt_bucket)
    q_bucket = _bucket_prompts(len(prompt_ids), n, self._row_multiple)
    prompt_QxL = np.full((q_bucket, l_bucket), PAD_ID, np.int32)
    mask_QxL = np.zeros((q_bucket, l_bucket), np.int32)
    for i, p in enumerate(prompt_ids):
      prompt_QxL[i, l_bucket - len(p):] = np.asarray(p, np.int32)
      mask_QxL[i, l_bucket - len(p):] = 1
    # Dummy prompts repeat prompt 0 (a fully masked row would attend to nothing);
    # their rows are finished from the start and dropped.
    prompt_QxL[len(prompt_ids):] = prompt_QxL[0]
    mask_QxL[len(prompt_ids):] = mask_QxL[0]
    active_B = np.arange(q_bucket * n) < b
    stop_V = np.zeros((self._vocab_size,), bool)
    stop_V[list(self._eos_ids) + [int(t) for t in stop_token_ids]] = True
    args = (prompt_QxL, mask_QxL, active_B, stop_V, jax.random.key(seed),
            np.float32(temperature if not greedy else 1.0), np.float32(top_p),
            np.int32(max_tokens))
    if self._mesh is not None:
      prompts = self._rows if q_bucket % self._row_multiple == 0 else self._rep
      shardings = (prompts, prompts, self._rows) + (self._rep,) * 5
      args = tuple(jax.device_put(a, sh) for a, sh in zip(args, shardings))
    else:
      args = tuple(jax.device_put(a) for a in args)

    out = self._jit(s, self._state, *args)
    tokens_BxT, logp_BxT, lengths_B, stopped_B = _to_host(out)
    lengths_B = lengths_B[:b].astype(np.int32)
    return Rollouts(
        tokens_BxT=tokens_BxT[:b, :max_tokens].astype(np.int32),
        logprobs_BxT=logp_BxT[:b, :max_tokens].astype(np.float32),
        lengths_B=lengths_B,
        finish_reason_B=np.where(stopped_B[:b], FINISH_STOP, FINISH_LENGTH),
        num_rollouts=b,
        num_generated_tokens=int(lengths_B.sum()))


def _to_host(arrays) -> tuple[Any, ...]:
  """The one device->host transfer; gathers across hosts when multi-process."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    return tuple(np.asarray(multihost_utils.process_allgather(a, tiled=True))
                 for a in arrays)
  return tuple(np.asarray(a) for a in jax.device_get(arrays))
