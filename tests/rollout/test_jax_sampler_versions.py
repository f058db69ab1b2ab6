"""JaxSampler with weights that change while it generates: decode chunks that leave
the rollouts unchanged, and version labels that say which weights sampled each token."""

import threading

import jax
import numpy as np
import pytest

from isojax.rollout.jax_sampler import JaxSampler
from tests.rollout.test_jax_sampler import PROMPTS, _model, _stop_token


@pytest.fixture(scope="module")
def model():
  return _model()


@pytest.fixture(scope="module")
def other():
  return _model(seed=2)


def _spy_calls(sampler, after_call=None):
  """Records the (rows, pairs) admitted before each decode call of the sampler
  (none: the call only resumed decoding or widened the extent); runs
  `after_call(k)` after the k-th decode call."""
  calls, admitted = [], []
  real_admit, real_decode = sampler._jit_admit, sampler._jit_decode

  def spy_admit(*args):
    dest, pair, active = (np.asarray(a) for a in args[7:10])
    admitted.append((dest[active].tolist(), pair[active].tolist()))
    return real_admit(*args)

  def spy_decode(*args):
    result = real_decode(*args)
    calls.append(admitted.pop() if admitted else ([], []))
    if after_call is not None:
      after_call(len(calls))
    return result

  sampler._jit_admit, sampler._jit_decode = spy_admit, spy_decode
  return calls


# 24 one-sample prompts of 2..12 random tokens.
MANY_PROMPTS = [np.random.default_rng(i).integers(1, 32, 2 + i % 11).tolist()
                for i in range(24)]


@pytest.mark.parametrize("prompts,n,max_rows,seed", [
    (PROMPTS[:2], 4, None, 6),  # a row per rollout
    (PROMPTS[:2], 4, 3, 6),  # a freed row is refilled at once
    # Refilled once 16 / 8 = 2 rows are free; with seed 0 a chunk ends with one
    # row free, which must not be refilled yet.
    (MANY_PROMPTS, 1, 16, 0),
])
def test_decode_chunks_give_the_same_rollouts_labelled_0(model, prompts, n, max_rows, seed):
  kw = dict(n=n, max_tokens=10, temperature=1.0, seed=seed, top_p=0.9)
  whole = JaxSampler(model, max_rows=max_rows)
  stop = _stop_token(whole.generate(prompts, **kw), len(prompts) * n)
  kw["stop_token_ids"] = (stop,)
  whole_calls = _spy_calls(whole)
  ref = whole.generate(prompts, **kw)
  assert (ref.lengths_B < 10).any() and (ref.lengths_B == 10).any()
  chunked = JaxSampler(model, max_rows=max_rows, decode_chunk=1)
  jitted = chunked._jit_admit, chunked._jit_decode
  calls = _spy_calls(chunked)
  real_BxT = np.arange(10)[None, :] < ref.lengths_B[:, None]
  np.testing.assert_array_equal(ref.version_BxT, np.where(real_BxT, 0, -1))
  for chunk in (1, 3, 8):
    chunked._decode_chunk = chunk  # an argument of the jitted call: no recompilation
    calls.clear()
    got = chunked.generate(prompts, **kw)
    np.testing.assert_array_equal(got.tokens_BxT, ref.tokens_BxT)
    np.testing.assert_array_equal(got.logprobs_BxT, ref.logprobs_BxT)
    np.testing.assert_array_equal(got.lengths_B, ref.lengths_B)
    np.testing.assert_array_equal(got.finish_reason_B, ref.finish_reason_B)
    np.testing.assert_array_equal(got.version_BxT, np.where(real_BxT, 0, -1))
    # More calls, but the same admissions: a call that stopped after `chunk`
    # steps is followed by one that admits nothing.
    assert len(calls) > len(whole_calls)
    assert [c for c in calls if c[0]] == [c for c in whole_calls if c[0]]
    if chunk == 1:
      compiled = [j._cache_size() for j in jitted]
  assert [j._cache_size() for j in jitted] == compiled


def test_weights_swapped_between_chunks_label_the_tokens_after_the_swap(model, other):
  kw = dict(n=2, max_tokens=10, temperature=1.0, seed=3)
  ref = JaxSampler(model).generate(PROMPTS, **kw)
  sampler = JaxSampler(model, decode_chunk=3)

  def swap(k):
    if k == 1:
      sampler.update_weights(other, version=5)

  _spy_calls(sampler, swap)
  got = sampler.generate(PROMPTS, **kw)
  # The first call emits the admitted token and 3 decode steps' tokens.
  assert (got.lengths_B == 10).all()
  np.testing.assert_array_equal(got.version_BxT, np.repeat([[0] * 4 + [5] * 6], 6, axis=0))
  np.testing.assert_array_equal(got.tokens_BxT[:, :4], ref.tokens_BxT[:, :4])
  np.testing.assert_array_equal(got.logprobs_BxT[:, :4], ref.logprobs_BxT[:, :4])
  assert (got.tokens_BxT[:, 4:] != ref.tokens_BxT[:, 4:]).any()
  assert not np.allclose(got.logprobs_BxT[:, 4:], ref.logprobs_BxT[:, 4:], atol=1e-2)
  # Later requests sample from the new weights, labelled 5 throughout.
  again = sampler.generate(PROMPTS, **kw)
  assert (again.version_BxT == 5).all()


def test_update_from_another_thread_while_generating(model, other):
  sampler = JaxSampler(model, decode_chunk=1)
  started, errors = threading.Event(), []
  _spy_calls(sampler, lambda k: started.set())

  def update():
    started.wait(timeout=60)
    try:
      sampler.update_weights(other, version=7)
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  updater = threading.Thread(target=update)
  updater.start()
  got = sampler.generate(PROMPTS, n=2, max_tokens=30, temperature=1.0, seed=1)
  updater.join(timeout=60)
  assert not updater.is_alive() and not errors
  for i, length in enumerate(got.lengths_B):
    labels = got.version_BxT[i, :length]
    assert set(labels.tolist()) <= {0, 7}
    assert (np.diff(labels) >= 0).all()
    assert (got.version_BxT[i, length:] == -1).all()
  # Once the update has returned, the next request is all version 7; an update
  # without a version counts on from the current label.
  assert (sampler.generate(PROMPTS, n=1, max_tokens=4, temperature=0.0).version_BxT
          == 7).all()
  sampler.update_weights(model)
  assert (sampler.generate(PROMPTS, n=1, max_tokens=4, temperature=0.0).version_BxT
          == 8).all()


def test_decode_chunk_and_version_are_checked(model):
  with pytest.raises(ValueError, match="decode_chunk=0"):
    JaxSampler(model, decode_chunk=0)
  with pytest.raises(ValueError, match="version=-1"):
    JaxSampler(model).update_weights(model, version=-1)


@pytest.mark.parametrize("prompts,n,max_rows,kw", [
    (PROMPTS[:2], 4, None, {}),  # a row per rollout: one decode call, in lockstep
    (PROMPTS[:2], 4, 3, dict(cache_block=4)),  # refills, and extents widened twice
    (MANY_PROMPTS, 1, 16, dict(decode_chunk=5)),  # refills at 2 free rows, 5-step chunks
])
def test_steps_per_sync_gives_the_same_rollouts(model, prompts, n, max_rows, kw):
  """Several decode steps per check of the loop's condition: the rollouts of one
  step per check, whatever stopped a call (stops, refills, extents, chunks)."""
  gen = dict(n=n, max_tokens=10, temperature=1.0, seed=6, top_p=0.9)
  one = JaxSampler(model, max_rows=max_rows, steps_per_sync=1, **kw)
  gen["stop_token_ids"] = (_stop_token(one.generate(prompts, **gen), len(prompts) * n),)
  ref, one_loops = _generate_counting_loops(one, prompts, gen)
  assert (ref.lengths_B < 10).any() and (ref.lengths_B == 10).any()
  got, loops = _generate_counting_loops(
      JaxSampler(model, max_rows=max_rows, steps_per_sync=3, **kw), prompts, gen)
  np.testing.assert_array_equal(got.tokens_BxT, ref.tokens_BxT)
  np.testing.assert_allclose(got.logprobs_BxT, ref.logprobs_BxT, atol=1e-6)
  np.testing.assert_array_equal(got.lengths_B, ref.lengths_B)
  np.testing.assert_array_equal(got.finish_reason_B, ref.finish_reason_B)
  # The grouped loop (an outer loop around a 3-step loop) precedes the one-step
  # loop; one step per check compiles that loop alone.
  assert (loops, one_loops) == (3, 1)


def _generate_counting_loops(sampler, prompts, gen):
  """(rollouts, while loops in the program of the request's first decode call)."""
  calls = []
  real = sampler._jit_decode
  abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.Array) else x
  sampler._jit_decode = lambda *a: (calls.append(jax.tree.map(abstract, a)), real(*a))[1]
  try:
    rollouts = sampler.generate(prompts, **gen)
  finally:
    sampler._jit_decode = real
  return rollouts, real.lower(*calls[0]).as_text().count("stablehlo.while")


def test_steps_per_sync_defaults_to_several_on_a_gpu_only(model, monkeypatch):
  from isojax.rollout import decode
  assert JaxSampler(model).steps_per_sync == 1
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert JaxSampler(model).steps_per_sync == decode.GPU_STEPS_PER_SYNC > 1
  assert JaxSampler(model, steps_per_sync=1).steps_per_sync == 1
