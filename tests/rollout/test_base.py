"""Tests for the rollout interface: Rollouts container and request validation."""

import numpy as np
import pytest

from isojax.rollout.base import Rollouts, Sampler, validate_request


def test_from_sequences_right_pads_and_counts():
  r = Rollouts.from_sequences([[5, 6, 7], [8], [9, 10]],
                              [[-0.5, -1.0, -1.5], [-2.0], [-0.1, -0.2]],
                              ["stop", "length", "stop"])
  np.testing.assert_array_equal(r.tokens_BxT, [[5, 6, 7], [8, 0, 0], [9, 10, 0]])
  np.testing.assert_allclose(r.logprobs_BxT,
                             [[-0.5, -1.0, -1.5], [-2.0, 0, 0], [-0.1, -0.2, 0]])
  assert r.tokens_BxT.dtype == np.int32 and r.logprobs_BxT.dtype == np.float32
  np.testing.assert_array_equal(r.lengths_B, [3, 1, 2])
  assert r.finish_reason_B.tolist() == ["stop", "length", "stop"]
  assert r.num_rollouts == 3 and r.num_generated_tokens == 6
  assert r.sequences() == [[5, 6, 7], [8], [9, 10]]


def test_forced_tokens_are_marked_and_not_counted_as_generated():
  r = Rollouts.from_sequences([[5, 6, 3, 7], [8]], [[-0.5, -1.0, 0.0, -0.2], [-2.0]],
                              ["stop", "stop"], forced=[[0, 0, 1, 0], [0]])
  np.testing.assert_array_equal(r.forced_BxT, [[0, 0, 1, 0], [0, 0, 0, 0]])
  assert r.interrupted_B.tolist() == [True, False]
  assert r.num_generated_tokens == 4  # 5 tokens, of which 1 appended
  plain = Rollouts.from_sequences([[5, 6]], [[-0.5, -1.0]], ["stop"])
  assert plain.forced_BxT.tolist() == [[0, 0]] and not plain.interrupted_B.any()


def test_rollouts_is_frozen():
  r = Rollouts.from_sequences([[1]], [[-1.0]], ["length"])
  with pytest.raises(Exception):
    r.num_rollouts = 2  # type: ignore[misc]


def test_from_sequences_rejects_ragged_mismatch():
  with pytest.raises(ValueError, match="rollout 1 has 2 tokens but 1 logprobs"):
    Rollouts.from_sequences([[1], [2, 3]], [[-1.0], [-1.0]], ["stop", "stop"])
  with pytest.raises(ValueError, match="2 token lists, 1 logprob lists"):
    Rollouts.from_sequences([[1], [2]], [[-1.0]], ["stop", "stop"])


def test_version_labels_from_sequences():
  r = Rollouts.from_sequences([[5, 6, 3, 7], [8]], [[-0.5, -1.0, 0.0, -0.2], [-2.0]],
                              ["stop", "stop"], forced=[[0, 0, 1, 0], [0]],
                              versions=[[0, 1, -1, 2], [4]])
  assert r.version_BxT.dtype == np.int32
  np.testing.assert_array_equal(r.version_BxT, [[0, 1, -1, 2], [4, -1, -1, -1]])
  assert Rollouts.from_sequences([[5]], [[-0.5]], ["stop"]).version_BxT is None
  with pytest.raises(ValueError, match="rollout 1 has 1 tokens but 2 version labels"):
    Rollouts.from_sequences([[5], [6]], [[-0.5], [-0.5]], ["stop"] * 2,
                            versions=[[0], [0, 0]])
  with pytest.raises(ValueError, match="2 token lists and 1 version lists"):
    Rollouts.from_sequences([[5], [6]], [[-0.5], [-0.5]], ["stop"] * 2, versions=[[0]])


@pytest.mark.parametrize("version,msg", [
    (np.zeros((2, 4), np.int32), "version_BxT shape"),
    (np.zeros((2, 3), np.float32), "version_BxT must hold integers"),
    (np.array([[0, 0, -1], [0, 1, -1]]), "version_BxT must be >= 0 on sampled"),
    (np.array([[0, 0, 0], [0, -1, 3]]), "version_BxT must be -1 on padding"),
    (np.array([[0, 2, 0], [0, -1, -1]]), "version_BxT must be -1 on padding and forced"),
])
def test_version_labels_are_validated(version, msg):
  # Row 0: three sampled tokens of which the middle one is forced; row 1: one token.
  kw = dict(tokens_BxT=np.ones((2, 3), np.int32), logprobs_BxT=np.zeros((2, 3), np.float32),
            lengths_B=np.array([3, 1], np.int32), finish_reason_B=np.array(["stop"] * 2),
            num_rollouts=2, num_generated_tokens=3,
            forced_BxT=np.array([[0, 1, 0], [0, 0, 0]], np.int32))
  Rollouts(**kw, version_BxT=np.array([[0, -1, 1], [0, -1, -1]]))
  with pytest.raises(ValueError, match=msg):
    Rollouts(**kw, version_BxT=version)


def _arrays(b=2, t=3):
  return dict(tokens_BxT=np.zeros((b, t), np.int32), logprobs_BxT=np.zeros((b, t), np.float32),
              lengths_B=np.full((b,), t, np.int32),
              finish_reason_B=np.array(["length"] * b), num_rollouts=b,
              num_generated_tokens=b * t)


@pytest.mark.parametrize("field,value,msg", [
    ("logprobs_BxT", np.zeros((2, 4), np.float32), "logprobs_BxT shape"),
    ("lengths_B", np.full((3,), 3, np.int32), "lengths_B"),
    ("lengths_B", np.array([3, 4], np.int32), "exceeds tokens_BxT width"),
    ("finish_reason_B", np.array(["length", "eos"]), "unknown values"),
    ("num_generated_tokens", 5, "num_generated_tokens=5"),
    ("num_rollouts", 3, "num_rollouts=3"),
    ("forced_BxT", np.zeros((2, 4), np.int32), "forced_BxT shape"),
    ("forced_BxT", np.full((2, 3), 2, np.int32), "only 0 and 1"),
])
def test_rollouts_validates_fields(field, value, msg):
  kw = _arrays()
  kw[field] = value
  with pytest.raises(ValueError, match=msg):
    Rollouts(**kw)


def test_forced_tokens_must_be_real_unsampled_tokens():
  kw = _arrays()
  kw.update(lengths_B=np.array([3, 1], np.int32), num_generated_tokens=3)
  kw["forced_BxT"] = np.array([[0, 0, 0], [0, 1, 0]], np.int32)
  with pytest.raises(ValueError, match="marks padding"):
    Rollouts(**kw)
  kw["forced_BxT"] = np.array([[0, 1, 0], [0, 0, 0]], np.int32)
  kw["logprobs_BxT"] = np.full((2, 3), -0.5, np.float32)
  with pytest.raises(ValueError, match="must be 0 on forced tokens"):
    Rollouts(**kw)
  kw["logprobs_BxT"] = np.zeros((2, 3), np.float32)
  kw["num_generated_tokens"] = 4
  with pytest.raises(ValueError, match="sum.lengths_B. - forced tokens = 3"):
    Rollouts(**kw)


def test_validate_request_accepts_good_request():
  validate_request([[1, 2], [3]], n=4, max_tokens=8, temperature=1.0, top_p=0.9, top_k=5,
                   stop_token_ids=(7,), seed=2**64 - 1, vocab_size=10, max_model_len=10)
  validate_request((np.array([1, 2]),), n=np.int64(1), max_tokens=1, temperature=0,
                   stop_token_ids=np.array([7, 8]))


@pytest.mark.parametrize("kwargs,msg", [
    (dict(prompt_ids=[]), "prompt_ids is empty"),
    (dict(prompt_ids="abc"), "prompt_ids must be a list"),
    (dict(prompt_ids=[[1], []]), r"prompt_ids\[1\] is empty"),
    (dict(prompt_ids=[[1], "ab"]), r"prompt_ids\[1\] must be a list"),
    (dict(prompt_ids=[[1, 10]]), r"prompt_ids\[0\] has token ids outside \[0, 10\)"),
    (dict(prompt_ids=[[1, -1]]), r"prompt_ids\[0\] has token ids outside"),
    (dict(prompt_ids=[[1.5]]), "non-integer"),
    (dict(prompt_ids=[[[1, 2]]]), r"prompt_ids\[0\] must be a flat list of ints, got "
     r"nested lists \(shape \(1, 2\)\)"),
    (dict(prompt_ids=[[1, [2]]]), r"prompt_ids\[0\] has non-integer entries"),
    (dict(prompt_ids=[[True, False]]), r"prompt_ids\[0\] has non-integer entries"),
    (dict(prompt_ids=[[[1, 2]]], vocab_size=None), r"prompt_ids\[0\] must be a flat list"),
    (dict(n=0), "n must be a positive int"),
    (dict(n=True), "n must be a positive int, got True"),
    (dict(max_tokens=0), "max_tokens must be a positive int"),
    (dict(max_tokens=True), "max_tokens must be a positive int, got True"),
    (dict(stop_token_ids=5), r"stop_token_ids must be a list of token ids \(\(\) for "
     r"none\), got 5"),
    (dict(stop_token_ids=None), "stop_token_ids must be a list of token ids"),
    (dict(stop_token_ids=(True,)), "stop_token_ids entry True"),
    (dict(temperature=-0.1), r"temperature=-0.1 must be a number >= 0"),
    (dict(temperature=float("nan")), "temperature=nan must be a number >= 0"),
    (dict(temperature="1"), "temperature='1' must be a number"),
    # logits / 1e-10 overflow float32's precision: wrong tokens, infinite log-probs.
    (dict(temperature=1e-10), r"temperature=1e-10 is below 0.01: .*use 0 for greedy"),
    (dict(top_p="0.9"), r"top_p='0.9' must be in \(0, 1\]"),
    (dict(top_p=0.0), r"top_p=0.0 must be in \(0, 1\] \(1 = off\)"),
    (dict(top_p=1.5), "top_p=1.5 must be in"),
    (dict(top_k=-1), r"top_k=-1 must be None or an int >= 0"),
    (dict(top_k=True), "top_k=True must be None or an int"),
    (dict(stop_token_ids=(10,)), "stop_token_ids entry 10"),
    (dict(seed=2**64), r"seed=18446744073709551616 must be an int in \[0, 2\*\*64\)"),
    (dict(seed=-1), r"seed=-1 must be an int"),
    (dict(seed=1.5), r"seed=1.5 must be an int"),
    (dict(seed=None), r"seed=None must be an int"),
    (dict(seed=True), r"seed=True must be an int"),
    # 7 prompt tokens + 4 new tokens > context of 10.
    (dict(prompt_ids=[[1], [1] * 7]),
     r"prompt_ids\[1\] has 7 tokens.*11 > the sampler's context of 10"),
])
def test_validate_request_rejects_bad_input(kwargs, msg):
  req = dict(prompt_ids=[[1, 2]], n=2, max_tokens=4, temperature=1.0, vocab_size=10,
             max_model_len=10)
  req.update(kwargs)
  with pytest.raises(ValueError, match=msg):
    validate_request(**req)


def test_sampler_protocol_is_structural():

  class Fake:

    def generate(self, prompt_ids, *, n, max_tokens, temperature, top_p=1.0, top_k=None,
                 stop_token_ids=(), seed=0):
      return Rollouts.from_sequences([[1]] * (len(prompt_ids) * n),
                                     [[0.0]] * (len(prompt_ids) * n),
                                     ["length"] * (len(prompt_ids) * n))

    def update_weights(self, model, *, version=None):
      pass

  assert isinstance(Fake(), Sampler)
  assert not isinstance(object(), Sampler)
