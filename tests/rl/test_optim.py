"""Learning-rate rules, warmup and AdamW against hand-written updates."""

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
import pytest

from isojax.rl.optim import OptimConfig, learning_rate, lr_schedule, make_optimizer


@pytest.mark.parametrize("rule, b, expected", [
    ("sqrt", 1024, 1e-6), ("sqrt", 4096, 2e-6), ("sqrt", 256, 0.5e-6),
    ("sqrt", 8192, 1e-6 * math.sqrt(8)),
    ("linear", 4096, 4e-6), ("linear", 512, 0.5e-6),
    ("constant", 8192, 1e-6), ("constant", 8, 1e-6),
])
def test_lr_rules(rule, b, expected):
  cfg = OptimConfig(lr_rule=rule)
  assert learning_rate(cfg, b) == pytest.approx(expected, rel=1e-12)


def test_custom_base():
  cfg = OptimConfig(lr_base=3e-5, batch_base=64, lr_rule="sqrt")
  assert learning_rate(cfg, 16) == pytest.approx(1.5e-5)


def test_warmup_then_constant():
  sched = lr_schedule(OptimConfig(lr_rule="constant", lr_base=1.0, warmup_steps=4), 1024)
  got = [float(sched(k)) for k in range(7)]
  np.testing.assert_allclose(got, [0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0])
  sched0 = lr_schedule(OptimConfig(lr_base=2.0, warmup_steps=0, lr_rule="constant"), 1)
  assert float(sched0(0)) == 2.0


def test_config_is_not_mutated_and_frozen():
  cfg = OptimConfig()
  before = dataclasses.asdict(cfg)
  make_optimizer(cfg, batch_size=8192)
  assert dataclasses.asdict(cfg) == before
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.lr_base = 1.0


def np_adamw(p, grads, lrs, b1=0.9, b2=0.999, eps=1e-8, wd=0.01, clip=None):
  """Reference AdamW (Loshchilov & Hutter, torch/optax convention), per step."""
  m = np.zeros_like(p)
  v = np.zeros_like(p)
  for k, (g, lr) in enumerate(zip(grads, lrs), start=1):
    if clip is not None:
      norm = np.sqrt((g ** 2).sum())
      g = g * min(1.0, clip / norm)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g ** 2
    mhat, vhat = m / (1 - b1 ** k), v / (1 - b2 ** k)
    p = p - lr * (mhat / (np.sqrt(vhat) + eps) + wd * p)
  return p


@pytest.mark.parametrize("clip", [None, 0.5])
def test_adamw_matches_reference(clip):
  cfg = OptimConfig(lr_base=1e-2, batch_base=16, lr_rule="sqrt", warmup_steps=3,
                    weight_decay=0.1, max_grad_norm=clip)
  tx = make_optimizer(cfg, batch_size=64)  # peak lr 2e-2
  rng = np.random.default_rng(0)
  p0 = rng.normal(size=(5,)).astype(np.float32)
  grads = [rng.normal(size=(5,)).astype(np.float32) for _ in range(5)]
  params = {"w": jnp.asarray(p0)}
  state = tx.init(params)
  for g in grads:
    upd, state = tx.update({"w": jnp.asarray(g)}, state, params)
    params = {"w": params["w"] + upd["w"]}
  lrs = [2e-2 * min((k + 1) / 3, 1.0) for k in range(5)]
  expected = np_adamw(p0.astype(np.float64), [g.astype(np.float64) for g in grads], lrs,
                      wd=0.1, clip=clip)
  np.testing.assert_allclose(np.asarray(params["w"]), expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kw, match", [
    (dict(lr_rule="cubic"), "lr_rule"),
    (dict(lr_base=0.0), "lr_base"),
    (dict(warmup_steps=-1), "warmup_steps"),
    (dict(max_grad_norm=0.0), "max_grad_norm"),
    (dict(weight_decay=-0.1), r"weight_decay=-0.1 must be >= 0"),
    (dict(b1=1.0), r"b1=1.0 must be in \[0, 1\)"),
    (dict(b2=1.5), r"b2=1.5 must be in \[0, 1\)"),
    (dict(eps=0.0), r"eps=0.0 must be > 0"),
    # Accepted before, then every update was skipped (non-finite rate) or the rate was 0.
    (dict(lr_base=float("inf")), r"lr_base=inf must be > 0 and finite"),
    (dict(batch_base=float("inf")), r"batch_base=inf must be > 0 and finite"),
    (dict(warmup_steps=float("nan")), r"warmup_steps=nan must be an integer >= 0"),
    (dict(warmup_steps=2.5), r"warmup_steps=2.5 must be an integer"),
    (dict(weight_decay=float("inf")), r"weight_decay=inf must be >= 0 and finite"),
    (dict(eps=float("inf")), r"eps=inf must be > 0 and finite"),
])
def test_bad_config(kw, match):
  with pytest.raises(ValueError, match=match):
    OptimConfig(**kw)


def test_bad_batch_size():
  with pytest.raises(ValueError, match="batch_size"):
    learning_rate(OptimConfig(), 0)


def test_the_lower_ends_of_the_ranges_are_valid_settings():
  """No weight decay, no first moment (RMSProp-like), no warmup and no clipping are
  settings a study may choose; each is accepted and acts as written."""
  cfg = OptimConfig(weight_decay=0.0, b1=0.0, warmup_steps=0, max_grad_norm=None,
                    lr_base=0.1, lr_rule="constant")
  tx = make_optimizer(cfg, batch_size=1)
  p0, g = np.array([1.0, -2.0], np.float32), np.array([3.0, 0.5], np.float32)
  params = {"w": jnp.asarray(p0)}
  upd, _ = tx.update({"w": jnp.asarray(g)}, tx.init(params), params)
  want = np_adamw(p0.astype(np.float64), [g.astype(np.float64)], [0.1], b1=0.0, wd=0.0)
  np.testing.assert_allclose(np.asarray(params["w"] + upd["w"]), want, rtol=1e-6)
