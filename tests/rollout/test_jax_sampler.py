"""JaxSampler against independent references: the model's full (uncached) forward
re-run in NumPy-side loops, the trainer's recomputed logprobs, and the target
sampling distribution written from the formulas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from flax import nnx

from isojax.models import Decoder, ModelConfig
from isojax.rollout import Rollouts, Sampler
from isojax.rollout.jax_sampler import JaxSampler
from isojax.sharding import make_mesh

VOCAB = 32
CONTEXT = 64


def _hf(**kw):
  hf = dict(architectures=["Qwen2ForCausalLM"], vocab_size=VOCAB, hidden_size=64,
            intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=32, max_position_embeddings=CONTEXT,
            tie_word_embeddings=False, rope_theta=10000.0)
  hf.update(kw)
  return hf


def _model(seed=0, sharpen=10.0, **kw):
  """Tiny Qwen2; the final-norm gain is raised so logits are far from uniform
  (std ~1.5), which gives the distribution tests power to see a wrong temperature.
  Embeddings are untied: with tied random ones greedy decoding just repeats the
  last prompt token, which would make the greedy tests weak."""
  model = Decoder(ModelConfig.from_hf_dict(_hf(**kw)), rngs=nnx.Rngs(seed))
  model.norm.scale[...] = model.norm.scale[...] * sharpen
  return model


@pytest.fixture(scope="module")
def model():
  return _model()


@pytest.fixture(scope="module")
def sampler(model):
  return JaxSampler(model)


@nnx.jit
def _forward(model, ids_BxT, mask_BxT):
  return model(ids_BxT, attention_mask=mask_BxT)


def _logits_np(model, ids_BxT, mask_BxT=None, width=32):
  """Full uncached forward. Rows are right-padded to `width` (one compilation);
  with causal attention, trailing padding cannot change the real positions."""
  ids_BxT = np.asarray(ids_BxT, np.int32)
  mask_BxT = np.ones_like(ids_BxT) if mask_BxT is None else np.asarray(mask_BxT, np.int32)
  b, t = ids_BxT.shape
  width = max(width, t)
  ids = np.zeros((b, width), np.int32)
  mask = np.zeros((b, width), np.int32)
  ids[:, :t], mask[:, :t] = ids_BxT, mask_BxT
  return np.asarray(_forward(model, jnp.asarray(ids), jnp.asarray(mask)), np.float64)[:, :t]


def _log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _greedy_reference(model, prompt, max_tokens, stop=()):
  """Argmax decoding by re-running the full forward on prompt + prefix each step."""
  seq, toks, logps = list(prompt), [], []
  for _ in range(max_tokens):
    logp_V = _log_softmax(_logits_np(model, [seq])[0, -1])
    tok = int(np.argmax(logp_V))
    toks.append(tok)
    logps.append(logp_V[tok])
    seq.append(tok)
    if tok in stop:
      break
  return toks, np.array(logps)


PROMPTS = [[1, 2, 3], [5, 9, 17, 2, 30, 4, 4, 8, 11, 6, 7], [12] * 20]


def test_greedy_equals_full_forward_argmax(model, sampler):
  r = sampler.generate(PROMPTS, n=2, max_tokens=6, temperature=0.0)
  assert isinstance(r, Rollouts) and r.num_rollouts == 6
  for i, prompt in enumerate(PROMPTS):
    toks, logps = _greedy_reference(model, prompt, 6)
    for row in (2 * i, 2 * i + 1):  # prompt-major: prompt i's n rows are contiguous
      np.testing.assert_array_equal(r.tokens_BxT[row], toks)
      np.testing.assert_allclose(r.logprobs_BxT[row], logps, atol=1e-4)
  np.testing.assert_array_equal(r.lengths_B, 6)
  assert r.finish_reason_B.tolist() == ["length"] * 6
  assert r.num_generated_tokens == 36


def test_left_padded_batch_equals_each_prompt_alone(sampler):
  # In the batch all prompts are padded to the 32 bucket (the 20-token one sets
  # it); alone, the 3- and 11-token prompts are padded to 16 only.
  batch = sampler.generate(PROMPTS, n=2, max_tokens=6, temperature=0.0)
  for i, prompt in enumerate(PROMPTS[:2]):
    alone = sampler.generate([prompt], n=2, max_tokens=6, temperature=0.0)
    np.testing.assert_array_equal(batch.tokens_BxT[2 * i:2 * i + 2], alone.tokens_BxT)
    np.testing.assert_allclose(batch.logprobs_BxT[2 * i:2 * i + 2], alone.logprobs_BxT,
                               atol=1e-5)


def _recomputed_logprobs(model, prompts, r: Rollouts, n, temperature):
  """What the trainer does: one full forward over left-padded prompt ++ right-padded
  completion, log_softmax(logits / temperature), gathered at the completion tokens."""
  rows = [p for p in prompts for _ in range(n)]
  p_max, t = max(map(len, prompts)), r.tokens_BxT.shape[1]
  ids = np.zeros((len(rows), p_max + t), np.int32)
  mask = np.zeros_like(ids)
  for b, p in enumerate(rows):
    ids[b, p_max - len(p):p_max] = p
    mask[b, p_max - len(p):p_max] = 1
    ids[b, p_max:p_max + r.lengths_B[b]] = r.tokens_BxT[b, :r.lengths_B[b]]
    mask[b, p_max:p_max + r.lengths_B[b]] = 1
  logp = _log_softmax(_logits_np(model, ids, mask) / (temperature or 1.0))
  # logits at position s predict token s + 1.
  out = np.take_along_axis(logp[:, p_max - 1:-1], ids[:, p_max:, None], -1)[..., 0]
  return np.where(np.arange(t)[None] < r.lengths_B[:, None], out, 0.0)


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_logprobs_equal_trainer_recomputed(model, sampler, temperature):
  # (Greedy logprobs, under the unscaled logits, are checked in the greedy test.)
  prompts = PROMPTS[:2]
  r = sampler.generate(prompts, n=4, max_tokens=10, temperature=temperature, seed=3)
  ref = _recomputed_logprobs(model, prompts, r, 4, temperature)
  np.testing.assert_allclose(r.logprobs_BxT, ref, atol=1e-4)
  assert np.all(r.logprobs_BxT[:, 0] < 0)


def test_same_seed_same_rollouts_different_seed_different(sampler):
  kw = dict(n=4, max_tokens=10, temperature=1.0)
  a = sampler.generate(PROMPTS[:2], seed=7, **kw)
  b = sampler.generate(PROMPTS[:2], seed=7, **kw)
  c = sampler.generate(PROMPTS[:2], seed=8, **kw)
  np.testing.assert_array_equal(a.tokens_BxT, b.tokens_BxT)
  np.testing.assert_array_equal(a.logprobs_BxT, b.logprobs_BxT)
  assert not np.array_equal(a.tokens_BxT, c.tokens_BxT)
  # The n samples of one prompt are not copies of each other.
  assert len({tuple(x) for x in a.tokens_BxT[:4]}) > 1


def test_64_bit_seeds_give_distinct_rollouts_32_bit_ones_as_before(sampler, monkeypatch):
  """jax.random.key keeps a seed's low 32 bits: 2**40 would sample seed 0's
  rollouts. Seeds below 2**32 keep the key they had (jax.random.key(seed))."""
  kw = dict(n=4, max_tokens=10, temperature=1.0)
  got = {s: sampler.generate(PROMPTS[:2], seed=s, **kw).tokens_BxT
         for s in (0, 5, 2**32 - 1, 2**40, 2**40 + 5, 2**64 - 1)}
  assert len({x.tobytes() for x in got.values()}) == len(got)
  from isojax.rollout import jax_sampler
  monkeypatch.setattr(jax_sampler, "_seed_key", jax.random.key)  # the key of old
  for s in (5, 2**32 - 1):
    np.testing.assert_array_equal(sampler.generate(PROMPTS[:2], seed=s, **kw).tokens_BxT,
                                  got[s])


@pytest.mark.parametrize("seed", [2**64, -1, 1.5, None, True, "3"])
def test_bad_seed_is_refused_naming_it(sampler, seed):
  with pytest.raises(ValueError, match=rf"seed={seed!r} must be an int in \[0, 2\*\*64\)"):
    sampler.generate(PROMPTS[:1], n=1, max_tokens=2, temperature=1.0, seed=seed)


def _target_probs(logits_V, temperature, top_p, top_k):
  """temperature -> top-k -> top-p (smallest prefix reaching top_p), from the formulas."""
  z = logits_V / temperature
  order = np.argsort(-z, kind="stable")
  keep = np.zeros_like(z, bool)
  keep[order[:top_k or len(z)]] = True
  p = np.where(keep, np.exp(z - z.max()), 0.0)
  p /= p.sum()
  mass_before = np.cumsum(p[order]) - p[order]
  keep_p = np.zeros_like(keep)
  keep_p[order[mass_before < top_p]] = True
  p = np.where(keep & keep_p, p, 0.0)
  return p / p.sum()


def _chisquare_p(counts, probs, num):
  """Pearson chi-square p-value; bins with expected count < 5 are pooled."""
  exp = probs * num
  big = exp >= 5
  counts, exp, big = counts[probs > 0], exp[probs > 0], big[probs > 0]
  obs_b, exp_b = list(counts[big]), list(exp[big])
  if (~big).any():
    obs_b.append(counts[~big].sum())
    exp_b.append(exp[~big].sum())
  exp_b = np.array(exp_b) * (sum(obs_b) / np.sum(exp_b))
  return scipy.stats.chisquare(obs_b, exp_b).pvalue


@pytest.mark.parametrize("temperature,top_p,top_k", [
    (0.7, 1.0, None), (1.5, 0.8, None), (1.0, 1.0, 6), (0.9, 0.6, 10)])
def test_first_token_distribution_chisquare(model, sampler, temperature, top_p, top_k):
  prompt, num = [1, 2, 3], 4096
  r = sampler.generate([prompt], n=num, max_tokens=1, temperature=temperature, top_p=top_p,
                       top_k=top_k, seed=11)
  logits_V = _logits_np(model, [prompt])[0, -1]
  probs = _target_probs(logits_V, temperature, top_p, top_k)
  first = r.tokens_BxT[:, 0]
  counts = np.bincount(first, minlength=VOCAB)
  assert counts[probs == 0].sum() == 0, "sampled a token outside the top-p/top-k set"
  assert _chisquare_p(counts, probs, num) > 1e-3
  # Power: the untransformed softmax is clearly rejected by the same test.
  plain = _target_probs(logits_V, 1.0, 1.0, None)
  if not np.allclose(plain, probs, atol=0.02):
    assert _chisquare_p(counts, plain, num) < 1e-6
  # Logprobs are those of the truncated, renormalised distribution.
  np.testing.assert_allclose(r.logprobs_BxT[:, 0], np.log(probs[first]), atol=1e-4)


def test_stop_tokens_and_eos_end_sequences(model, sampler):
  kw = dict(n=4, max_tokens=10, temperature=1.0, seed=5)
  free = sampler.generate(PROMPTS[:2], **kw)
  assert (free.lengths_B == 10).all() and set(free.finish_reason_B) == {"length"}
  # The stop token: one that occurs in about half of the 8 rows.
  rows_with = np.array([(free.tokens_BxT == v).any(1).sum() for v in range(VOCAB)])
  stop = int(np.argmin(np.abs(rows_with - 4)))
  assert 0 < rows_with[stop] < 8

  def expect(r):
    # Same seed: identical up to the first stop token (included), then padding.
    for b in range(8):
      row = free.tokens_BxT[b].tolist()
      end = row.index(stop) + 1 if stop in row else 10
      assert r.lengths_B[b] == end
      assert r.finish_reason_B[b] == ("stop" if stop in row else "length")
      np.testing.assert_array_equal(r.tokens_BxT[b, :end], row[:end])
      np.testing.assert_allclose(r.logprobs_BxT[b, :end], free.logprobs_BxT[b, :end],
                                 atol=1e-6)
      assert (r.tokens_BxT[b, end:] == 0).all() and (r.logprobs_BxT[b, end:] == 0).all()
    assert r.num_generated_tokens == int(r.lengths_B.sum()) < 80

  expect(sampler.generate(PROMPTS[:2], stop_token_ids=(stop,), **kw))
  # EOS from the model config (same weights) stops sequences the same way.
  with_eos = Decoder(ModelConfig.from_hf_dict(_hf(eos_token_id=[stop])), rngs=nnx.Rngs(9))
  nnx.update(with_eos, nnx.state(model))
  expect(JaxSampler(with_eos).generate(PROMPTS[:2], **kw))
  # Its config differs from the EOS-less model's, so nnx.jit's graph cache, which
  # hands a model an equal model's config, cannot lose the EOS.
  forward = nnx.jit(lambda m, ids: m(ids))
  for m in (model, with_eos):
    forward(m, jnp.ones((1, 4), jnp.int32))
  assert with_eos.cfg.eos_token_ids == (stop,) and model.cfg.eos_token_ids == ()
  expect(JaxSampler(with_eos).generate(PROMPTS[:2], **kw))
  # An EOS id the model cannot emit is a bad config, named when the sampler is built.
  outside = Decoder(ModelConfig.from_hf_dict(_hf(eos_token_id=[stop, VOCAB])),
                    rngs=nnx.Rngs(9))
  with pytest.raises(ValueError, match=rf"eos_token_id \[{stop}, {VOCAB}\] is not a "
                                       rf"token id in \[0, vocab_size={VOCAB}\)"):
    JaxSampler(outside)


def _compiled(sampler) -> int:
  """Programs the sampler has compiled (admissions and decode loops)."""
  return sampler._jit_admit._cache_size() + sampler._jit_decode._cache_size()


def test_prompt_too_long_fails_before_any_work(model, sampler):
  def boom(*a, **k):
    raise AssertionError("compiled/ran despite a bad request")

  real = sampler._jit_admit, sampler._jit_decode
  sampler._jit_admit = sampler._jit_decode = boom
  try:
    with pytest.raises(ValueError, match=r"prompt_ids\[1\] has 60 tokens.*context of 64"):
      sampler.generate([[1, 2], [3] * 60], n=1, max_tokens=8, temperature=1.0)
    with pytest.raises(ValueError, match=r"prompt_ids\[0\] has token ids outside \[0, 32\)"):
      sampler.generate([[1, 99]], n=1, max_tokens=8, temperature=1.0)
    with pytest.raises(ValueError, match=r"prompt_ids\[0\] must be a flat list of ints"):
      sampler.generate([[[1, 2]]], n=1, max_tokens=8, temperature=1.0)
    for stop in (5, None):
      with pytest.raises(ValueError, match=rf"stop_token_ids must be a list .* got {stop}"):
        sampler.generate([[1, 2]], n=1, max_tokens=8, temperature=1.0, stop_token_ids=stop)
  finally:
    sampler._jit_admit, sampler._jit_decode = real
  # A cap below the model's context is the sampler's context, named as such.
  capped = JaxSampler(model, max_len=16)
  assert capped.max_model_len() == 16
  assert JaxSampler(model, max_len=1000).max_model_len() == CONTEXT
  with pytest.raises(ValueError, match=r"prompt_ids\[0\] has 10 tokens; with max_tokens=8 "
                     r"that is 18 > the sampler's context of 16 tokens"):
    capped.generate([[1] * 10], n=1, max_tokens=8, temperature=0.0)


def test_update_weights_swaps_params_without_recompiling(model, sampler):
  new = _model(seed=2)
  kw = dict(n=2, max_tokens=6, temperature=0.0)
  a = sampler.generate(PROMPTS, **kw)
  compiled = _compiled(sampler)
  try:
    sampler.update_weights(new)
    b = sampler.generate(PROMPTS, **kw)
    assert _compiled(sampler) == compiled
  finally:
    sampler.update_weights(model)
  for i, prompt in enumerate(PROMPTS):
    toks, logps = _greedy_reference(new, prompt, 6)
    np.testing.assert_array_equal(b.tokens_BxT[2 * i], toks)
    np.testing.assert_allclose(b.logprobs_BxT[2 * i], logps, atol=1e-4)
  assert not np.allclose(a.logprobs_BxT, b.logprobs_BxT, atol=1e-2)
  np.testing.assert_array_equal(sampler.generate(PROMPTS, **kw).tokens_BxT, a.tokens_BxT)
  # A bare nnx.State (what a trainer holds) works too.
  try:
    sampler.update_weights(nnx.state(new))
    np.testing.assert_array_equal(sampler.generate(PROMPTS, **kw).tokens_BxT, b.tokens_BxT)
  finally:
    sampler.update_weights(model)
  other = Decoder(ModelConfig.from_hf_dict(_hf(num_hidden_layers=1)), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="structure differs"):
    sampler.update_weights(other)
  with pytest.raises(ValueError, match=r"lack \['layers'\]\[1\].* \(12 of the sampler's "
                     r"27 leaves missing\)"):
    sampler.update_weights(nnx.state(other))
  assert isinstance(sampler, Sampler)


def test_update_weights_names_the_leaf_whose_shape_or_dtype_differs(model, sampler):
  label = sampler._weights[0]
  bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(model))
  with pytest.raises(ValueError, match=r"^JaxSampler.update_weights: the new parameters "
                     r"have \['embed'\]\.value of bfloat16\[32, 64\] where the sampler "
                     r"holds float32\[32, 64\] \(27 leaves differ\)"):
    sampler.update_weights(bf16)
  wide = Decoder(ModelConfig.from_hf_dict(_hf(num_hidden_layers=3)), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"have \['layers'\]\[2\].*, which the sampler's "
                     r"model does not \(12 such leaves\)"):
    sampler.update_weights(nnx.state(wide))
  with pytest.raises(ValueError, match=r"got a dict; pass a Decoder or its nnx.state"):
    sampler.update_weights(nnx.to_pure_dict(nnx.state(model)))
  assert sampler._weights[0] == label  # nothing refused was swapped in


def test_batch_prompt_and_length_buckets_share_one_compilation(sampler):
  # 3 or 4 prompts -> 4 rows, longest prompt 17..32 -> 32, max_tokens 5..8 -> 8.
  sampler.generate([[1] * 17] * 3, n=2, max_tokens=5, temperature=0.0)
  compiled = _compiled(sampler)
  sampler.generate([[4] * 32] * 4, n=2, max_tokens=8, temperature=0.0)
  r = sampler.generate([[4] * 25, [5] * 2, [6]], n=2, max_tokens=7, temperature=0.0)
  assert _compiled(sampler) == compiled
  assert r.tokens_BxT.shape == (6, 7) and r.num_rollouts == 6


@pytest.mark.parametrize("steps_per_sync", [1, 3])
def test_mesh_of_8_devices_matches_one_device(model, sampler, steps_per_sync):
  assert len(jax.devices()) >= 8
  mesh = make_mesh(data=2, fsdp=2, tensor=2)
  sharded = JaxSampler(model, mesh=mesh, steps_per_sync=steps_per_sync)
  # 3 prompts -> 4, split over data x fsdp = 4; 2 prompts x n=4 -> prompts
  # replicated (2 does not split 4 ways), their 8 rows split.
  for prompts, kw in ((PROMPTS, dict(n=2, max_tokens=6, temperature=0.0)),
                      (PROMPTS[:2], dict(n=4, max_tokens=10, temperature=1.0, seed=4))):
    ref = sampler.generate(prompts, **kw)
    got = sharded.generate(prompts, **kw)
    np.testing.assert_array_equal(got.tokens_BxT, ref.tokens_BxT)
    np.testing.assert_allclose(got.logprobs_BxT, ref.logprobs_BxT, atol=1e-5)
  # Parameters really are split over the mesh.
  emb = sharded._weights[1]["embed"][...]
  assert emb.sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")


def _stop_token(free, rows):
  """A token that ends about half of `free`'s rows early (a short completion)."""
  rows_with = np.array([(free.tokens_BxT == v).any(1).sum() for v in range(VOCAB)])
  stop = int(np.argmin(np.abs(rows_with - rows // 2)))
  assert 0 < rows_with[stop] < rows
  return stop


@pytest.mark.parametrize("max_rows", [3, 4])
def test_refilled_rows_equal_a_row_per_rollout(model, sampler, max_rows):
  """max_rows < rollouts: rows freed by short (stopped) completions are refilled
  with waiting rollouts; every rollout equals the one decoded in its own row."""
  kw = dict(n=4, max_tokens=10, temperature=1.0, seed=6, top_p=0.9)
  stop = _stop_token(sampler.generate(PROMPTS[:2], **kw), 8)
  ref = sampler.generate(PROMPTS[:2], stop_token_ids=(stop,), **kw)
  assert (ref.lengths_B < 10).any() and (ref.lengths_B == 10).any()

  bounded = JaxSampler(model, max_rows=max_rows)
  admitted = []  # (rows, pairs) of every admission
  real = bounded._jit_admit

  def spy(s, state, rows, out, prompt, mask, src, dest, pair, active, *rest):
    live = np.asarray(active)
    admitted.append((np.asarray(dest)[live], np.asarray(pair)[live]))
    return real(s, state, rows, out, prompt, mask, src, dest, pair, active, *rest)

  bounded._jit_admit = spy
  got = bounded.generate(PROMPTS[:2], stop_token_ids=(stop,), **kw)
  np.testing.assert_array_equal(got.tokens_BxT, ref.tokens_BxT)
  np.testing.assert_allclose(got.logprobs_BxT, ref.logprobs_BxT, atol=1e-5)
  np.testing.assert_array_equal(got.lengths_B, ref.lengths_B)
  np.testing.assert_array_equal(got.finish_reason_B, ref.finish_reason_B)
  # Never more than max_rows at once, every rollout admitted exactly once, and
  # some row that held a stopped (short) rollout was reused by a later one.
  rows_used = np.concatenate([d for d, _ in admitted])
  assert rows_used.max() < max_rows and len(admitted) > 1
  np.testing.assert_array_equal(np.sort(np.concatenate([p for _, p in admitted])),
                                np.arange(8))
  holder, reused_short = {}, False
  for dest, pairs in admitted:
    for d, p in zip(dest, pairs):
      if d in holder and ref.lengths_B[holder[d]] < 10:
        reused_short = True
      holder[d] = p
  assert reused_short
  # Whole prompts are admitted together (one prefill for their n samples) when
  # max_rows holds n rows.
  if max_rows >= 4:
    assert all(len(np.unique(p // 4)) * 4 == len(p) for _, p in admitted)


def test_kv_budget_sets_the_rows(model):
  from isojax.rollout import memory
  cfg = model.cfg
  # A request of <= 16-token prompts and 8 new tokens: 24 cache positions a row,
  # 2 layers x 1 kv head x 32 dims x (k, v) x 4 bytes + 1 valid byte per position.
  per_row = 24 * (2 * 2 * 1 * 32 * 4 + 1)
  assert memory.kv_bytes_per_row(cfg, 24) == per_row
  budget = 5.5 * per_row / memory.GIB
  s = JaxSampler(model, kv_budget_gib=budget)
  assert s.num_rows(64, 24) == 5 and s.num_rows(3, 24) == 3
  assert JaxSampler(model, kv_budget_gib=budget, max_rows=2).num_rows(64, 24) == 2
  with pytest.raises(ValueError, match=r"kv_budget_gib=1e-07 holds no cache row of 24 "
                     r"positions \(0\.000 GiB per row: 2 layers x 1 kv heads"):
    JaxSampler(model, kv_budget_gib=1e-7).generate([[1, 2]], n=2, max_tokens=8,
                                                   temperature=0.0)
  with pytest.raises(ValueError, match="max_rows=0"):
    JaxSampler(model, max_rows=0)
  with pytest.raises(ValueError, match="cache_block=0"):
    JaxSampler(model, cache_block=0)


def test_kv_budget_holding_the_lockstep_cache_decodes_every_rollout_at_once(model, sampler):
  """8 rollouts of 2 prompts (n=4), a 16-position prompt bucket and 8 new tokens:
  in lockstep each prompt's positions are held once (2 x 16 + 8 x 8 positions), a
  third less than 8 rows of 24. A budget of exactly that decodes all 8 at once
  (the rows of 24 it holds would be 4), with the same rollouts."""
  from isojax.rollout import memory
  lockstep = memory.lockstep_cache_bytes(model.cfg, 8, 4, 16, 8)
  assert lockstep == 2 * memory.kv_bytes_per_row(model.cfg, 16) + 8 * memory.kv_bytes_per_row(
      model.cfg, 8)
  budgeted = JaxSampler(model, kv_budget_gib=lockstep / memory.GIB)
  assert budgeted.num_rows(8, 24, n=4, prompt_len=16) == 8
  assert budgeted.num_rows(8, 24) == 4 and budgeted.num_rows(8, 24, n=4, prompt_len=8) == 4
  kw = dict(n=4, max_tokens=8, temperature=1.0, seed=3)
  ref = sampler.generate(PROMPTS[:2], **kw)
  got = budgeted.generate(PROMPTS[:2], **kw)
  np.testing.assert_array_equal(got.tokens_BxT, ref.tokens_BxT)
  np.testing.assert_array_equal(got.logprobs_BxT, ref.logprobs_BxT)


def test_read_extent_grows_between_chunks(model, sampler):
  """With 4-slot cache blocks, attention reads 32 slots (8 blocks) while every live
  row fits, then the whole 48-slot cache: decoding pauses, the extent is widened and
  decoding resumes (rows are refilled meanwhile). Same rollouts as one extent."""
  kw = dict(n=2, max_tokens=30, temperature=1.0, seed=1)
  ref = sampler.generate(PROMPTS[:2], **kw)
  small = JaxSampler(model, cache_block=4, max_rows=3)
  got = small.generate(PROMPTS[:2], **kw)
  np.testing.assert_array_equal(got.tokens_BxT, ref.tokens_BxT)
  np.testing.assert_allclose(got.logprobs_BxT, ref.logprobs_BxT, atol=1e-5)
  # Two read extents (32 and 48 slots) compile the decode loop twice; every
  # admission has one prompt (a whole prompt's 2 rows), and compiles once.
  assert small._jit_decode._cache_size() == 2
  assert small._jit_admit._cache_size() == 1


def test_admissions_and_read_extents_compile_apart(model):
  """A request whose admissions hold different numbers of prompts while the read
  extent widens compiles one decode loop per extent and one admission per prompt
  count, never one program per (extent, prompt count) met; the rollouts are
  those of a row per rollout."""
  prompts = [[1 + i, 2 + i, 3] for i in range(10)]
  kw = dict(n=1, max_tokens=30, temperature=1.0, seed=2, top_p=0.95)
  ref = JaxSampler(model).generate(prompts, **kw)
  bounded = JaxSampler(model, cache_block=4, max_rows=4)
  counts, extents = set(), set()
  admit, decode_steps = bounded._jit_admit, bounded._jit_decode

  def spy_admit(s, state, rows, out, prompt_QxL, *rest):
    counts.add(prompt_QxL.shape[0])
    return admit(s, state, rows, out, prompt_QxL, *rest)

  def spy_decode(s, state, rows, *rest):
    extents.add(rows.cache.read_len)
    return decode_steps(s, state, rows, *rest)

  bounded._jit_admit, bounded._jit_decode = spy_admit, spy_decode
  got = bounded.generate(prompts, **kw)
  np.testing.assert_array_equal(got.tokens_BxT, ref.tokens_BxT)
  np.testing.assert_allclose(got.logprobs_BxT, ref.logprobs_BxT, atol=1e-5)
  assert len(counts) >= 2 and len(extents) >= 2, (counts, extents)
  assert admit._cache_size() == len(counts) and decode_steps._cache_size() == len(extents)
