"""Tests for isojax/sweep/run_args.py: run arguments read as the run reads them."""

import pytest

from isojax import sweep
from tests.test_sweep import TINY, _launch


def _apply(*args):
  return sweep.apply_overrides(sweep.load_experiment(TINY, ""), args)


def test_structured_fields_take_literals_as_the_run_does():
  assert _apply("--config.eval_steps=(1,2,4)").eval_steps == (1, 2, 4)
  assert _apply("--config.eval_steps=[1, 2]").eval_steps == (1, 2)
  assert _apply("--config.eval_steps=3").eval_steps == (3,)  # one element
  # A repeated tuple flag adds up in the run's parser: the same here.
  assert _apply("--config.eval_steps=1", "--config.eval_steps=2").eval_steps == (1, 2)
  assert _apply("--config.sweep.budgets=[1e3, 2e3]").sweep.budgets == [1e3, 2e3]
  with pytest.raises(ValueError, match=r"run argument '--config.sweep.budgets=x'"):
    _apply("--config.sweep.budgets=x")


def test_a_value_may_follow_its_flag_as_the_next_argument():
  config = _apply("--config.eval_every", "4", "--config.data.chat_template",
                  "--config.eval_steps", "(2, 3)")
  assert (config.eval_every, config.data.chat_template) == (4, True)
  assert config.eval_steps == (2, 3)
  with pytest.raises(ValueError, match=r"'--config.eval_every x': invalid literal"):
    _apply("--config.eval_every", "x")
  with pytest.raises(ValueError, match=r"'--config.eval_every' has no value"):
    _apply("--config.eval_every")


def test_the_launcher_plans_with_both_spellings(tmp_path):
  proc = _launch(f"--config={TINY}", f"--root={tmp_path}/x", "--bp=4", "--n=2",
                 "--budget=64", "--dry_run", "--", "--config.eval_steps=(1,2,4)",
                 "--config.sampler.max_tokens", "5")
  assert "bp4_n2_m8_s0" in proc.stdout and " 320\n" in proc.stdout  # C * max_tokens
