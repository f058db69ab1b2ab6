"""JaxSampler's settings are refused, naming the argument and its value, before
any work: the model stand-in has a config and no parameters to split or place."""

import math
import types

import pytest

from isojax.models import ModelConfig
from isojax.rollout.jax_sampler import JaxSampler
from tests.rollout.test_jax_sampler import _hf


@pytest.fixture(scope="module")
def model():
  return types.SimpleNamespace(cfg=ModelConfig.from_hf_dict(_hf()))


@pytest.mark.parametrize("name,value", [
    ("min_prompt_bucket", 0), ("min_prompt_bucket", -3), ("min_prompt_bucket", True),
    ("min_prompt_bucket", 2.5), ("min_prompt_bucket", None),
    ("max_rows", True), ("max_rows", 0), ("max_rows", 2.5), ("max_rows", "4"),
    ("max_len", 0), ("max_len", 1), ("max_len", True), ("max_len", math.inf),
    ("cache_block", True), ("cache_block", 0), ("cache_block", 8.0),
    ("decode_chunk", True), ("decode_chunk", 0), ("decode_chunk", math.inf),
    ("steps_per_sync", True), ("steps_per_sync", 0), ("steps_per_sync", 4.0),
    ("kv_budget_gib", True), ("kv_budget_gib", 0.0), ("kv_budget_gib", math.inf),
    ("kv_budget_gib", math.nan), ("kv_budget_gib", "1"),
])
def test_bad_setting_is_refused_naming_it(model, name, value):
  # A bool would have meant 1 (max_rows=True: one row at a time), a float been cut
  # to an int, and a min_prompt_bucket or max_len <= 0 been taken as given.
  with pytest.raises(ValueError, match=rf"^JaxSampler: {name}={value!r}; expected "):
    JaxSampler(model, **{name: value})

