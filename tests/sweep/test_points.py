"""Tests for isojax/sweep/points.py: what a planned sweep hands each run."""

import pytest

from isojax import sweep
from tests.test_sweep import REPO, TINY


def test_the_launchers_b_max_reaches_every_run(monkeypatch):
  monkeypatch.chdir(REPO)
  # tiny.py's b_max is 256: Bp*n = 512 is planned only with the launcher's bound,
  # and each run must hold that bound too, or it refuses the point.
  plan, config = sweep.plan_sweep(TINY, "runs/t", bp=[64], n=[8], budgets=[1024],
                                  b_max=512)
  assert config.b_max == 512 and [sp.point.batch for sp in plan.points] == [512]
  assert all("--config.b_max=512" in plan.command(sp) for sp in plan.points)
  # Without the flag the config's own bound plans the grid, and nothing is added.
  plan, _ = sweep.plan_sweep(TINY, "runs/t", bp=[8], n=[4], budgets=[1024])
  assert not any("b_max" in a for sp in plan.points for a in plan.command(sp))
  with pytest.raises(ValueError, match="'--config.b_max=128' sets b_max, which the "
                     "launcher's --b_max=512 sets"):
    sweep.plan_sweep(TINY, "runs/t", bp=[8], n=[4], budgets=[1024], b_max=512,
                     extra_args=["--config.b_max=128"])


def test_a_study_files_token_estimate_uses_the_length_its_runs_sample(monkeypatch):
  monkeypatch.chdir(REPO)
  # Study files leave sampler.max_tokens at 0, the study's length: 8 tokens on the
  # committed tiny model, 8,192 once model.path names a real model.
  study = "experiments/easy_n_vs_m.py:smoke"
  plan, config = sweep.plan_sweep(study, "runs/t", n=[4], budgets=[2048])
  assert config.sampler.max_tokens == 0 and sweep.max_tokens(config) == 8
  assert sweep.format_points(plan.points, sweep.max_tokens(config)).splitlines()[1] \
      .split()[-1] == str(2048 * 8)
  _, config = sweep.plan_sweep(study, "runs/t", n=[4], budgets=[2048],
                               extra_args=["--config.model.path=/ckpt/any"])
  assert sweep.max_tokens(config) == 8192
  _, config = sweep.plan_sweep(study, "runs/t", n=[4], budgets=[2048],
                               extra_args=["--config.sampler.max_tokens=16"])
  assert sweep.max_tokens(config) == 16


def test_an_unknown_advantage_estimator_is_named_by_its_field(monkeypatch):
  monkeypatch.chdir(REPO)
  with pytest.raises(ValueError, match=r"^config\.rl\.adv_estimator: unknown advantage "
                     r"estimator 'bogus'"):
    sweep.plan_sweep(TINY, "runs/t", bp=[8], n=[2], budgets=[1024],
                     extra_args=["--config.rl.adv_estimator=bogus"])
