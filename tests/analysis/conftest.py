"""Fixtures: synthetic sweeps written as run directories (see fake_runs.py)."""

import pytest

from . import fake_runs


@pytest.fixture(scope="module")
def clean_sweep(tmp_path_factory):
  """Bp = 8, n in {4..64}, one run each, rewards exactly on the true sigmoids."""
  root = tmp_path_factory.mktemp("clean")
  fake_runs.make_sweep(root, configs=fake_runs.bp8_configs(), budget=8 * 64 * 2000,
                       n_evals=60)
  return root


@pytest.fixture(scope="module")
def noisy_sweep(tmp_path_factory):
  """Same truth, 3 seeds per n, per-run offsets and AR(1) noise along each run."""
  root = tmp_path_factory.mktemp("noisy")
  fake_runs.make_sweep(root, configs=fake_runs.bp8_configs(), budget=8 * 64 * 2000,
                       seeds=(0, 1, 2), noise=0.008, run_sigma=0.006, rho=0.5,
                       n_evals=60, rng_seed=3)
  return root


@pytest.fixture(scope="module")
def recipe_runs(tmp_path_factory):
  """Three recipes (fake_runs.RECIPES), 3 seeds each, per-run offsets and AR(1)
  noise, logging device-hours."""
  root = tmp_path_factory.mktemp("recipes")
  fake_runs.make_recipes(root, fake_runs.RECIPES, budget=8 * 16 * 4000, noise=0.008,
                         run_sigma=0.005, rho=0.5, n_evals=40, rng_seed=1)
  return root
