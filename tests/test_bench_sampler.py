"""bench/sampler.py: every call it times passes the samplers' request checks."""

import pytest

from bench import sampler as bench_sampler
from isojax.rollout import base


def test_time_runs_gives_every_call_a_seed_the_samplers_accept():
  seeds = []

  def fn(seed):
    base.validate_request([[1, 2]], n=1, max_tokens=1, temperature=1.0, seed=seed)
    seeds.append(seed)
    return 1

  best, median, tokens = bench_sampler.time_runs(fn, repeats=3)
  assert seeds == [bench_sampler.WARMUP_SEED, 1, 2, 3] and tokens == 1
  assert 0 <= best <= median
  seeds.clear()
  bench_sampler.time_runs(fn, repeats=2, warmup=False)
  assert seeds == [1, 2]
  with pytest.raises(ValueError, match="seed=-1"):  # what a negative seed would meet
    fn(-1)
