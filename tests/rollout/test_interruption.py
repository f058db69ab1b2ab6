"""Forced length interruption: a stub sampler with hand-written outputs, the config
check, and the JaxSampler on the committed tiny model against plain `generate`."""

import numpy as np
import pytest

from experiments import common
from isojax import batching
from isojax.models import Tokenizer, load_pretrained
from isojax.rollout import Rollouts, Sampler
from isojax.rollout.interruption import (InterruptingSampler, Interruption,
                                         continuation_seed, interruption_from_config)
from isojax.rollout.jax_sampler import JaxSampler
from isojax.run_setup import BASE_MODEL_DIR

PHRASE = (90, 91)
SPEC = Interruption(think_tokens=3, answer_tokens=2, phrase_ids=PHRASE)


class StubSampler:
  """Answers from `outputs[tuple(prompt)]`: n (tokens, finish) pairs per prompt,
  logprob -token/100; records every call."""

  def __init__(self, outputs, context=32, versions=None):
    self.outputs, self.context, self.calls = outputs, context, []
    self.versions = versions  # per call: the label of its tokens (None: unlabelled)

  def max_model_len(self):
    return self.context

  def update_weights(self, model, *, version=None):
    self.calls.append(("update_weights", model, version))

  def generate(self, prompt_ids, *, n, max_tokens, temperature, top_p=1.0, top_k=None,
               stop_token_ids=(), seed=0):
    self.calls.append(dict(prompts=[list(p) for p in prompt_ids], n=n,
                           max_tokens=max_tokens, temperature=temperature,
                           stop_token_ids=tuple(stop_token_ids), seed=seed))
    rows = [row for p in prompt_ids for row in self.outputs[tuple(p)][:n]]
    assert all(len(t) <= max_tokens for t, _ in rows)
    tokens = [t for t, _ in rows]
    label = None if self.versions is None else self.versions[len(self.calls) - 1]
    versions = None if label is None else [[label] * len(t) for t in tokens]
    return Rollouts.from_sequences(tokens, [[-t / 100 for t in row] for row in tokens],
                                   [f for _, f in rows], versions=versions)


OUTPUTS = {
    # Thinking (max_tokens 3): rows 0 and 2 reach the budget; row 3 stops by EOS
    # (2) exactly at it and is not continued.
    (1, 2): [([10, 11, 12], "length"), ([13, 2], "stop")],
    (3,): [([14, 15, 16], "length"), ([17, 18, 2], "stop")],
    # Answers (max_tokens 2) to prompt ++ thought ++ phrase.
    (1, 2, 10, 11, 12, 90, 91): [([20, 2], "stop")],
    (3, 14, 15, 16, 90, 91): [([21, 22], "length")],
}


def test_stub_outputs_spliced_by_hand():
  stub = StubSampler(OUTPUTS)
  sampler = InterruptingSampler(stub, SPEC)
  assert isinstance(sampler, Sampler)
  r = sampler.generate([[1, 2], [3]], n=2, max_tokens=8, temperature=0.7,
                       stop_token_ids=(2,), seed=5)
  np.testing.assert_array_equal(r.tokens_BxT, [[10, 11, 12, 90, 91, 20, 2],
                                               [13, 2, 0, 0, 0, 0, 0],
                                               [14, 15, 16, 90, 91, 21, 22],
                                               [17, 18, 2, 0, 0, 0, 0]])
  np.testing.assert_allclose(r.logprobs_BxT, [[-.10, -.11, -.12, 0, 0, -.20, -.02],
                                              [-.13, -.02, 0, 0, 0, 0, 0],
                                              [-.14, -.15, -.16, 0, 0, -.21, -.22],
                                              [-.17, -.18, -.02, 0, 0, 0, 0]], rtol=1e-6)
  np.testing.assert_array_equal(r.forced_BxT, [[0, 0, 0, 1, 1, 0, 0], [0] * 7,
                                               [0, 0, 0, 1, 1, 0, 0], [0] * 7])
  np.testing.assert_array_equal(r.lengths_B, [7, 2, 7, 3])
  assert r.finish_reason_B.tolist() == ["stop", "stop", "length", "stop"]
  assert r.interrupted_B.tolist() == [True, False, True, False]
  assert r.num_rollouts == 4 and r.num_generated_tokens == 5 + 2 + 5 + 3
  first, second = stub.calls
  assert (first["prompts"], first["n"], first["max_tokens"], first["seed"]) == (
      [[1, 2], [3]], 2, 3, 5)
  assert second["prompts"] == [[1, 2, 10, 11, 12, 90, 91], [3, 14, 15, 16, 90, 91]]
  assert (second["n"], second["max_tokens"], second["seed"]) == (1, 2, continuation_seed(5))
  assert second["temperature"] == 0.7 and second["stop_token_ids"] == (2,)


def test_answers_keep_their_call_s_labels_and_the_phrase_gets_none():
  r = InterruptingSampler(StubSampler(OUTPUTS, versions=[3, 4]), SPEC).generate(
      [[1, 2], [3]], n=2, max_tokens=8, temperature=0.7, stop_token_ids=(2,))
  np.testing.assert_array_equal(r.version_BxT, [[3, 3, 3, -1, -1, 4, 4],
                                                [3, 3, -1, -1, -1, -1, -1],
                                                [3, 3, 3, -1, -1, 4, 4],
                                                [3, 3, 3, -1, -1, -1, -1]])
  for versions in ([3, None], [None, 4]):
    r = InterruptingSampler(StubSampler(OUTPUTS, versions=versions), SPEC).generate(
        [[1, 2], [3]], n=2, max_tokens=8, temperature=0.7, stop_token_ids=(2,))
    assert r.version_BxT is None


def test_no_truncated_row_means_one_request_and_no_forced_tokens():
  stub = StubSampler({(4,): [([13, 2], "stop")] * 2})
  r = InterruptingSampler(stub, SPEC).generate([[4]], n=2, max_tokens=7, temperature=1.0)
  assert len(stub.calls) == 1 and r.sequences() == [[13, 2], [13, 2]]
  assert not r.forced_BxT.any() and r.num_generated_tokens == 4


def test_budgets_must_fit_before_any_work():
  stub = StubSampler(OUTPUTS, context=10)
  sampler = InterruptingSampler(stub, SPEC)
  with pytest.raises(ValueError, match=r"3 \+ phrase 2 \+ answer budget 2 = 7 tokens > "
                                       r"max_tokens=6"):
    sampler.generate([[1, 2]], n=1, max_tokens=6, temperature=1.0)
  # 3 + 7 = 10 fits the context of 10; 4 + 7 does not.
  with pytest.raises(ValueError, match=r"prompt_ids\[1\] has 4 tokens.* that is 11 > "
                                       r"the sampler's context of 10"):
    sampler.generate([[1, 2, 3], [1, 2, 3, 4]], n=1, max_tokens=7, temperature=1.0)
  assert stub.calls == []
  sampler.update_weights("params")
  sampler.update_weights("params", version=7)
  assert stub.calls == [("update_weights", "params", None), ("update_weights", "params", 7)]


@pytest.fixture(scope="module")
def tokenizer():
  return Tokenizer.from_pretrained(BASE_MODEL_DIR)


def _sampler_config(**fields):
  c = common.base_config().sampler
  c.update(fields)
  return c


def _never(text):
  raise AssertionError(f"the phrase {text!r} was tokenised although interruption is off")


def test_config_off_and_on(tokenizer):
  assert interruption_from_config(_sampler_config(), max_tokens=8, encode=_never) is None
  on = interruption_from_config(
      _sampler_config(interrupt_think_tokens=3, interrupt_answer_tokens=2,
                      interrupt_phrase="12"), max_tokens=8, encode=tokenizer.encode)
  assert on == Interruption(think_tokens=3, answer_tokens=2, phrase_ids=(5, 6))
  rest = interruption_from_config(
      _sampler_config(interrupt_think_tokens=3, interrupt_phrase="="), max_tokens=8,
      encode=tokenizer.encode)
  assert rest.answer_tokens == 8 - 3 - 1 and rest.completion_tokens == 8


@pytest.mark.parametrize("fields,msg", [
    (dict(interrupt_think_tokens=-1), r"config.sampler.interrupt_think_tokens=-1 must be >= 0"),
    (dict(interrupt_answer_tokens=-2), r"config.sampler.interrupt_answer_tokens=-2 must be"),
    (dict(interrupt_think_tokens=8), r"config.sampler.interrupt_think_tokens=8 must be "
                                     r"below max_tokens=8"),
    # The ScaleRL phrase has no token in the tiny model's digit-and-operator vocabulary.
    (dict(interrupt_think_tokens=3), r"config.sampler.interrupt_phrase='Okay, time is up.*"
                                     r"tokenises to no tokens"),
    (dict(interrupt_think_tokens=3, interrupt_phrase="  "), "interrupt_phrase='  '"),
    (dict(interrupt_think_tokens=3, interrupt_phrase="12", interrupt_answer_tokens=4),
     r"config.sampler.interrupt_answer_tokens=4: .* which leaves 3 for the answer"),
    (dict(interrupt_think_tokens=6, interrupt_phrase="12"),
     r"config.sampler.interrupt_answer_tokens=0: .* which leaves 0 for the answer"),
])
def test_config_errors_name_the_field(tokenizer, fields, msg):
  with pytest.raises(ValueError, match=msg):
    interruption_from_config(_sampler_config(**fields), max_tokens=8, encode=tokenizer.encode)


@pytest.fixture(scope="module")
def tiny():
  model, _ = load_pretrained(BASE_MODEL_DIR)
  return JaxSampler(model)


def test_jax_sampler_interrupts_at_the_budget_and_continues_like_plain_generate(
    tiny, tokenizer):
  # Arithmetic, reversal and sorting prompts: some answers end within 3 tokens.
  prompts = [tokenizer.encode(p) for p in ("R523000=", "S695697=", "603*9=", "532-480=")]
  spec = Interruption(think_tokens=3, answer_tokens=4,
                      phrase_ids=tuple(tokenizer.encode("R=")))
  kw = dict(temperature=1.0, stop_token_ids=(tokenizer.eos_token_id,))
  r = InterruptingSampler(tiny, spec).generate(prompts, n=2, max_tokens=9, seed=1, **kw)
  thought = tiny.generate(prompts, n=2, max_tokens=3, seed=1, **kw)
  cut = np.flatnonzero(thought.finish_reason_B == "length")
  assert 0 < len(cut) < 8
  assert r.interrupted_B.tolist() == [i in cut for i in range(8)]
  continuations = [prompts[i // 2] + thought.sequences()[i] + [18, 17] for i in cut]
  answer = tiny.generate(continuations, n=1, max_tokens=4, seed=continuation_seed(1), **kw)
  for i in range(8):
    got = r.sequences()[i]
    assert got[:len(thought.sequences()[i])] == thought.sequences()[i]
    if i not in cut:
      assert r.finish_reason_B[i] == "stop" and not r.forced_BxT[i].any()
      continue
    k = list(cut).index(i)
    assert got[3:5] == [18, 17] and r.forced_BxT[i, :5].tolist() == [0, 0, 0, 1, 1]
    assert got[5:] == answer.sequences()[k]
    np.testing.assert_array_equal(r.logprobs_BxT[i, 3:5], 0)
    np.testing.assert_allclose(r.logprobs_BxT[i, 5:r.lengths_B[i]],
                               answer.logprobs_BxT[k, :answer.lengths_B[k]])
    assert r.finish_reason_B[i] == answer.finish_reason_B[k]
  assert r.num_generated_tokens == thought.num_generated_tokens + answer.num_generated_tokens
  batch = batching.build_batch(prompts, r, np.zeros(8), n=2, prompt_width=8, max_tokens=9,
                               pad_id=0)
  phrase_cols = slice(8 + 3, 8 + 5)
  assert batch.attention_mask_BxT[cut, phrase_cols].all()
  assert not batch.loss_mask_BxT[cut, phrase_cols].any()
  assert batch.loss_mask_BxT[cut, 8:8 + 3].all()


def test_cache_layouts_bound_the_caches_of_both_calls(tiny, tokenizer):
  """The run checks memory with these layouts: the thinking call's, then the
  continuations' (every rollout continued at most, its prompt grown)."""
  from tests.rollout.test_memory import caches_on_device_0
  prompts = [tokenizer.encode(p) for p in ("R523000=", "S695697=", "603*9=")]
  spec = Interruption(think_tokens=3, answer_tokens=4, phrase_ids=(18, 17))
  sampler = InterruptingSampler(tiny, spec)
  think, answer = sampler.cache_layouts(len(prompts), 2, max(map(len, prompts)), 9)
  assert (think.completion_len, answer.completion_len, answer.n) == (4, 4, 1)
  assert answer.pairs == 8 and answer.prompt_len == 16  # 6 rollouts, prompts <= 15
  got = caches_on_device_0(tiny, lambda: sampler.generate(
      prompts, n=2, max_tokens=9, temperature=1.0, seed=1))
  cfg = tiny._cfg
  assert len(got) == 2 and got[0] == think.bytes_per_device(cfg)
  assert got[1] <= answer.bytes_per_device(cfg)


def test_jax_sampler_context_is_checked_before_any_work(tiny):
  spec = Interruption(think_tokens=3, answer_tokens=4, phrase_ids=(18, 17))
  with pytest.raises(ValueError, match=r"has 56 tokens; .* that is 65 > the sampler's "
                                       r"context of 64"):
    InterruptingSampler(tiny, spec).generate([[5] * 56], n=1, max_tokens=9,
                                             temperature=1.0)
