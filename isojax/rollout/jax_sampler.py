"""In-process JAX sampler: prefill + KV-cache decode in jitted loops.

Rollouts are (prompt, sample) pairs decoded in a fixed set of cache rows. By
default there is a row per pair and everything runs in one admission and one
decode loop, in lockstep: each prompt is prefilled once and its cache is the
shared prefix of its n samples' rows (stored and read once, not copied). With
`max_rows` (or a KV budget in GiB) at most that many rows decode at once: rows
that finish are refilled with waiting pairs between chunks of decode steps, so
the cache is bounded whatever the number of rollouts (continuous batching);
each distinct prompt of an admission is prefilled once and its cache copied to
its samples' rows. Either way attention reads only the filled blocks of the
cache (`isojax.models.KVCache`).

Prompts are left-padded to a power-of-two length bucket, the prompt count is
padded with dummy prompts to a power of two (their pairs are never decoded)
and max_tokens is bucketed likewise, so a training run compiles a handful of
shapes. The model's graph definition is static and its parameters are an
argument, so `update_weights` never recompiles.

Weights may change while `generate` runs (`update_weights` from another
thread): each admission and the chunk of decode steps after it (or a chunk
alone) read the current (version label, parameters) once and sample with them,
and the tokens they emitted carry that label in `Rollouts.version_BxT`.
`decode_chunk` bounds the decode steps of a call, so new weights are picked up
within that many tokens. The KV cache of the tokens before a swap is kept as the
old weights computed it (not recomputed, unlike `VLLMSampler(in_flight=True)`).

Sampling semantics (match vLLM's and `transformers`' order of processing):
logits / temperature -> top-k -> top-p (smallest set of tokens whose
probability reaches top_p) -> sample. The returned logprob is that of the
distribution actually sampled from, i.e. log-softmax of the processed logits.
With temperature 0 (greedy) the argmax token is taken and its logprob is the
log-softmax of the unscaled logits. Randomness is keyed by (seed, pair), each
seed in [0, 2**64) its own stream, so a rollout does not depend on which row or
chunk decoded it, nor on max_rows (up to float rounding: the shared-prefix and
copied layouts sum attention in a different order).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from isojax import sharding
from isojax.rollout import decode
from isojax.rollout.base import (FINISH_LENGTH, FINISH_STOP, Rollouts, VersionLabels,
                                 check_count, is_number, next_version, validate_request)
from isojax.rollout.memory import CacheLayout, cache_layout, rows_at_once
from isojax.rollout.param_layout import check_same_layout, state_of

PAD_ID = 0  # what left-pads prompts (masked: any id would do)
_REFILL_FRACTION = 8  # with pairs waiting, decoding pauses to refill once R/8 rows are free
_NO_STEP_LIMIT = np.iinfo(np.int32).max  # decode_chunk None: a call decodes until it must stop


def _read_len(cache, need: int) -> int:
  """Slots attention reads in the next chunk: a power-of-two number of blocks
  holding `need` (capped at the cache), so a long generation compiles a few
  extents and reads under twice what it must."""
  blocks = decode.next_pow2(-(-need // cache.block))
  return min(blocks * cache.block, cache.max_len)


def _left_pad(prompt_ids: Sequence[Sequence[int]], width: int
              ) -> tuple[np.ndarray, np.ndarray]:
  """(prompt_QxL, mask_QxL): the prompts left-padded with PAD_ID to `width`."""
  prompt_QxL = np.full((len(prompt_ids), width), PAD_ID, np.int32)
  mask_QxL = np.zeros((len(prompt_ids), width), np.int32)
  for i, p in enumerate(prompt_ids):
    prompt_QxL[i, width - len(p):] = np.asarray(p, np.int32)
    mask_QxL[i, width - len(p):] = 1
  return prompt_QxL, mask_QxL


def _stopped_at_step_limit(done_R, lengths_R, min_free: int, read_len: int) -> bool:
  """Whether a decode call that left rows live stopped at its `max_steps` only:
  neither `min_free` rows were done nor did a live row reach the read extent
  (`decode.decode_steps`' other reasons to stop)."""
  return bool(done_R.sum() < min_free and lengths_R[~done_R].max(initial=0) < read_len)


def _seed_key(seed: int):
  """The key of a seed in [0, 2**64). `jax.random.key` keeps only a seed's low 32
  bits (without x64), so the high ones are folded in: distinct seeds give
  distinct streams, and a seed below 2**32 the key it has always had."""
  key = jax.random.key(seed & 0xFFFFFFFF)
  return key if seed >> 32 == 0 else jax.random.fold_in(key, seed >> 32)


def _eos_ids(cfg) -> tuple[int, ...]:
  """The model's EOS id(s), `cfg.eos_token_ids` (config.json's eos_token_id)."""
  ids = tuple(getattr(cfg, "eos_token_ids", ()))
  if not all(0 <= e < cfg.vocab_size for e in ids):
    raise ValueError(f"JaxSampler: the model's eos_token_id {list(ids)} is not a token id "
                     f"in [0, vocab_size={cfg.vocab_size})")
  return ids


class JaxSampler:
  """Samples rollouts from a Flax NNX `Decoder` in this process.

  Args:
    model: an `isojax.models.Decoder` (anything with prefill / decode_step and a
      config carrying vocab_size, max_position_embeddings, eos_token_ids and the
      cache dimensions). The sampler holds the caller's parameter arrays
      (`jax.device_put` does not copy arrays already placed as it needs): a
      caller whose update donates them must pass a copy, or call
      `update_weights` after every donating step.
    mesh: optional `jax.sharding.Mesh` with axes ("data", "fsdp", "tensor").
      Rollout rows are split over ("data", "fsdp"), parameters follow their
      logical axis names through `rules`.
    rules: logical -> mesh axis rules (default `isojax.sharding.DEFAULT_RULES`).
    max_len: optional cap on prompt + max_tokens (below the model's context).
    min_prompt_bucket: smallest prompt-length bucket (fewer compilations for
      short prompts, at little cost).
    max_rows: decode at most this many rollouts at once (None: all of a
      request's); finished rows are refilled with waiting ones.
    kv_budget_gib: cap the KV cache at this many GiB (all the devices its
      rows are split across together): every rollout of a request at once
      when their lockstep cache fits (each prompt held once, or on every
      device when the prompts do not split evenly,
      `isojax.rollout.memory.lockstep_cache_bytes`), else the rows of the
      request's cache length that fit (`rows_for_budget`), fewer than its
      rollouts; together with max_rows the smaller.
    cache_block: slots per KV-cache block. Attention reads a power-of-two number
      of blocks covering the fullest row, widened between chunks of decode
      steps as rows grow (one compilation of the decode loop per extent).
    decode_chunk: a jitted call decodes at most this many steps before the host
      calls again (with the same rows and extent, and the weights published by
      then); None: a call decodes until rows must be refilled or the extent
      widened. Tokens do not depend on it while the weights stay the same.
      A chunk that only resumes decoding admits nothing (no prefill); each
      costs a host round trip (a small transfer).
    steps_per_sync: decode steps run between two checks of the decode loop's
      stopping condition (`decode.decode_steps`). None:
      `decode.default_steps_per_sync()`, several on a GPU, where XLA checks a
      loop's condition on the host, waiting for the device each time; 1
      elsewhere. Tokens do not depend on it; a decode call may run up to
      steps_per_sync - 1 steps past the one it could stop after (rows that
      finished meanwhile idle).
  """

  def __init__(self, model, *, mesh=None, rules=None, max_len: int | None = None,
               min_prompt_bucket: int = 16, max_rows: int | None = None,
               kv_budget_gib: float | None = None, cache_block: int = decode.DEFAULT_BLOCK,
               decode_chunk: int | None = None, steps_per_sync: int | None = None):
    self._cfg = model.cfg
    self._mesh = mesh
    self._rules = sharding.DEFAULT_RULES if rules is None else rules
    # Every setting is checked before any work: a bool is not a count (True
    # would silently mean 1), and a float would be cut to an int unseen.
    check_count("JaxSampler", "max_len", max_len, minimum=2,
                none="the model's context")  # a prompt token and a completion token
    check_count("JaxSampler", "min_prompt_bucket", min_prompt_bucket, minimum=1)
    check_count("JaxSampler", "max_rows", max_rows, minimum=1, none="no cap")
    check_count("JaxSampler", "cache_block", cache_block, minimum=1)
    check_count("JaxSampler", "decode_chunk", decode_chunk, minimum=1, none="no bound")
    check_count("JaxSampler", "steps_per_sync", steps_per_sync, minimum=1,
                none="the backend's default")
    if kv_budget_gib is not None and not (
        is_number(kv_budget_gib) and 0 < kv_budget_gib < math.inf):
      raise ValueError(f"JaxSampler: kv_budget_gib={kv_budget_gib!r}; expected a finite "
                       f"number > 0 (or None: no budget)")
    self._min_prompt_bucket = int(min_prompt_bucket)
    self._vocab_size = int(self._cfg.vocab_size)
    context = getattr(self._cfg, "max_position_embeddings", None)
    limits = [int(x) for x in (context, max_len) if x is not None]
    self._max_len = min(limits) if limits else None
    self._decode_chunk = None if decode_chunk is None else int(decode_chunk)
    self._steps_per_sync = int(steps_per_sync or decode.default_steps_per_sync())
    self._max_rows = None if max_rows is None else int(max_rows)
    self._kv_budget_gib = kv_budget_gib
    self._cache_block = int(cache_block)
    self._eos_ids = _eos_ids(self._cfg)
    self._graphdef, state = nnx.split(model)
    self._state_shardings = self._shardings_for(state)
    # (version label, parameters), always replaced whole by one assignment: a
    # generate on another thread reads both together, never a label without
    # its parameters.
    self._weights = (0, self._put_state(state))
    self._build_jit()

  @property
  def steps_per_sync(self) -> int:
    """Decode steps per loop-condition check: the argument or the backend's default."""
    return self._steps_per_sync

  def _shardings_for(self, state):
    if self._mesh is None:
      return None
    return sharding.state_shardings(state, self._mesh, self._rules)

  def _put_state(self, state):
    if self._state_shardings is None:
      return jax.device_put(state)
    return jax.device_put(state, self._state_shardings)

  def _build_jit(self):
    """The jit sites, specialised on `decode.Static` settings and array shapes.

    Rollout rows are split over the mesh axes the "batch" rule names (data x
    fsdp by default); prompts are split the same way when their count divides
    evenly, else replicated (their sharding is taken from the argument). The
    decode state is donated: the cache is updated in place across calls.
    """
    self._row_multiple, self._rows, self._cache_rows = 1, None, None
    if self._mesh is not None:
      mesh, P = self._mesh, jax.sharding.PartitionSpec  # pylint: disable=invalid-name
      batch_spec = sharding.logical_to_spec(("batch",), self._rules)
      batch_axes = batch_spec[0] if len(batch_spec) else None
      axes = () if batch_axes is None else (
          (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes))
      self._row_multiple = math.prod(mesh.shape[a] for a in axes)
      self._rows = jax.sharding.NamedSharding(mesh, P(batch_axes))
      self._cache_rows = jax.sharding.NamedSharding(
          mesh, P(batch_axes, P.UNCONSTRAINED, None, None))
      self._rep = jax.sharding.NamedSharding(mesh, P())
    self._jit_empty = jax.jit(decode.empty, static_argnums=(0, 1, 2, 3, 4, 5, 6))
    # Two programs (see `isojax.rollout.decode`): a wider read extent recompiles
    # the decode loop only, a different prompt count the admission only.
    self._jit_admit = jax.jit(functools.partial(decode.admit, self._graphdef),
                              static_argnums=0, donate_argnums=(2, 3))
    self._jit_decode = jax.jit(functools.partial(decode.decode_steps, self._graphdef),
                               static_argnums=0, donate_argnums=(2, 3))

  def num_rows(self, num_rollouts: int, cache_len: int, *, n: int = 1,
               prompt_len: int = 0) -> int:
    """Rows decoded at once for `num_rollouts` pairs (n per prompt) with
    `cache_len` positions each, `prompt_len` of them the prompt's
    (`isojax.rollout.memory.rows_at_once` under this sampler's caps)."""
    return rows_at_once(self._cfg, num_rollouts, cache_len, n=n, prompt_len=prompt_len,
                        max_rows=self._max_rows, kv_budget_gib=self._kv_budget_gib,
                        row_multiple=self._row_multiple, block=self._cache_block)

  def cache_layouts(self, num_prompts: int, n: int, longest_prompt: int,
                    max_tokens: int) -> tuple[CacheLayout, ...]:
    """The KV cache of each generate call (one after another) that a request of
    `num_prompts` prompts, the longest `longest_prompt` tokens, makes: its
    buckets, rows at once and their split over the mesh (what the run checks
    against the device's memory)."""
    return (cache_layout(self._cfg, num_prompts, n, longest_prompt, max_tokens,
                         min_prompt_bucket=self._min_prompt_bucket, max_rows=self._max_rows,
                         kv_budget_gib=self._kv_budget_gib,
                         row_multiple=self._row_multiple, block=self._cache_block),)


  def max_model_len(self) -> int | None:
    """The most prompt + max_tokens positions a request may use (the model's
    context, or the `max_len` cap below it); None when neither is known."""
    return self._max_len

  def update_weights(self, model, *, version: int | None = None) -> None:
    """Swaps in new parameters without recompiling.

    Safe to call from another thread while `generate` runs: its next jitted
    call (within `decode_chunk` tokens) samples with these parameters, and
    the tokens carry `version` in `Rollouts.version_BxT`.

    Args:
      model: a Decoder of the same architecture, or its `nnx.state(model)`
        (e.g. the trainer's, possibly sharded differently: it is resharded).
        Its arrays are held, not copied, where already placed as the sampler
        needs (`jax.device_put`): a caller whose update donates them must pass
        a copy, or call this after every donating step.
      version: the label of these weights (>= 0); None: the current label + 1
        (the weights the sampler was built with are 0).
    """
    where = "JaxSampler.update_weights"
    state = state_of(model, self._graphdef, where=where)
    label, current = self._weights
    check_same_layout(current, state, where=where)
    label = next_version(label, version, where="JaxSampler.update_weights")
    self._weights = (label, self._put_state(state))

  def generate(self, prompt_ids: list[list[int]], *, n: int, max_tokens: int,
               temperature: float, top_p: float = 1.0, top_k: int | None = None,
               stop_token_ids: Sequence[int] = (), seed: int = 0) -> Rollouts:
    """Samples n completions per prompt (prompt-major); see `Rollouts`.

    EOS token(s) from the model config always end a sequence, as do
    `stop_token_ids`; the stopping token is part of the completion.
    `top_k` None or 0 disables top-k; temperature 0 is greedy (top_p/top_k
    are then irrelevant). Every token is labelled with the version of the
    weights that sampled it (see the module doc).
    """
    validate_request(prompt_ids, n=n, max_tokens=max_tokens, temperature=temperature,
                     top_p=top_p, top_k=top_k, stop_token_ids=stop_token_ids, seed=seed,
                     vocab_size=self._vocab_size, max_model_len=self._max_len)
    greedy = temperature == 0
    k = 0 if (greedy or not top_k or top_k >= self._vocab_size) else int(top_k)
    (layout,) = self.cache_layouts(len(prompt_ids), n, max(len(p) for p in prompt_ids),
                                   max_tokens)
    l_bucket, cache_len = layout.prompt_len, layout.cache_len
    num_pairs, num_rows = layout.pairs, layout.rows
    s = decode.Static(max_tokens=layout.completion_len, greedy=greedy, top_k=k,
                      use_top_p=(not greedy) and top_p < 1.0,
                      cache_block=self._cache_block, steps_per_sync=self._steps_per_sync,
                      rows=self._rows, cache_rows=self._cache_rows)

    b = len(prompt_ids) * n
    prompt_QxL, mask_QxL = _left_pad(prompt_ids, l_bucket)
    stop_V = np.zeros((self._vocab_size,), bool)
    stop_V[list(self._eos_ids) + [int(t) for t in stop_token_ids]] = True
    key, *consts = self._put(_seed_key(int(seed)),
                             np.float32(temperature if not greedy else 1.0),
                             np.float32(top_p), np.int32(max_tokens))
    stop_V = self._put(stop_V)[0]

    # Every pair has a row: one admission, the rows decode in lockstep after
    # their prompt's cache, shared by its n rows. Else rows are refilled.
    lockstep = layout.lockstep
    if lockstep:
      rows, out = self._jit_empty(self._cfg, s, num_rows, layout.completion_len, num_pairs,
                                  num_pairs // n, l_bucket)
    else:
      rows, out = self._jit_empty(self._cfg, s, num_rows, cache_len, num_pairs)
    labels = VersionLabels(num_pairs, s.max_tokens)
    max_steps = np.int32(self._decode_chunk or _NO_STEP_LIMIT)
    # Whole prompts are admitted together (one prefill for their n samples)
    # unless a prompt's n samples do not fit in the rows at all.
    unit = n if num_rows >= n else 1
    # A row's own slots start after its prompt (lockstep: in the shared prefix).
    first_slot = 0 if lockstep else l_bucket
    free_R, start, need = np.arange(num_rows), 0, first_slot + 1
    while True:
      take = min(b - start, len(free_R) // unit * unit)
      pair_A = np.arange(start, start + take)
      start += take
      left = b - start
      min_free = (min(left, max(unit, num_rows // _REFILL_FRACTION)) if left
                  else num_rows + 1)
      # Once per admission and the decode chunk after it: the weights their tokens
      # come from.
      label, state = self._weights
      if take:  # else only the read extent grows, or a chunk resumes
        prompts_Q, src_A = np.unique(pair_A // n, return_inverse=True)
        q = num_pairs // n if lockstep else decode.next_pow2(len(prompts_Q))
        prompts_Q = np.concatenate([prompts_Q, np.full(q - len(prompts_Q), 0)]).astype(int)
        a = decode.admission_size(num_rows)
        pad = lambda x, v: np.concatenate([x, np.full(a - take, v, x.dtype)]).astype(np.int32)
        prompts = self._put(prompt_QxL[prompts_Q], mask_QxL[prompts_Q], prompts=True)
        admit = self._put(pad(src_A, 0), pad(free_R[:take], num_rows), pad(pair_A, 0),
                          np.arange(a) < take)
        rows = rows._replace(cache=rows.cache.with_read_len(None))  # not compiled in
        rows, out = self._jit_admit(s, state, rows, out, *prompts, *admit, stop_V, key,
                                    *consts)
      read_len = _read_len(rows.cache, need)
      rows = rows._replace(cache=rows.cache.with_read_len(read_len))
      rows, out = self._jit_decode(s, state, rows, out, stop_V, *consts, np.int32(min_free),
                                   max_steps)
      done_R, lengths_R, emitted_P = _to_host((rows.done_R, rows.cache.lengths_B,
                                               out.lengths_P))
      labels.add(emitted_P, label)
      if done_R.all() and not left:
        break
      if _stopped_at_step_limit(done_R, lengths_R, min_free, read_len):
        # Go on as if the call had not stopped: admit nothing, same extent, so
        # the rows decode what they would have (with the weights of now).
        free_R = free_R[:0]
        continue
      # The next step writes slot lengths_R: attention must read one past it.
      need = max(int(lengths_R[~done_R].max(initial=0)) + 1, first_slot + 1)
      free_R = np.flatnonzero(done_R)

    tokens_BxT, logp_BxT, lengths_B, stopped_B = _to_host(out)
    lengths_B = lengths_B[:b].astype(np.int32)
    return Rollouts(
        tokens_BxT=tokens_BxT[:b, :max_tokens].astype(np.int32),
        logprobs_BxT=logp_BxT[:b, :max_tokens].astype(np.float32),
        lengths_B=lengths_B,
        finish_reason_B=np.where(stopped_B[:b], FINISH_STOP, FINISH_LENGTH),
        num_rollouts=b,
        num_generated_tokens=int(lengths_B.sum()),
        version_BxT=labels.version_PxT[:b, :max_tokens])

  def _put(self, *arrays, prompts: bool = False) -> tuple[Any, ...]:
    """Host -> device: replicated over the mesh (prompt arrays split over the
    rows' axes when their count divides evenly)."""
    if self._mesh is None:
      return tuple(jax.device_put(a) for a in arrays)
    split = prompts and arrays[0].shape[0] % self._row_multiple == 0
    return tuple(sharding.put_host_array(a, self._rows if split else self._rep)
                 for a in arrays)


def _to_host(arrays) -> tuple[Any, ...]:
  """Device -> host for the sampler's loop; gathers across hosts when multi-process."""
  if jax.process_count() > 1:
    return tuple(np.asarray(multihost_utils.process_allgather(a, tiled=True))
                 for a in arrays)
  return tuple(np.asarray(a) for a in jax.device_get(arrays))
