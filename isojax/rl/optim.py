"""AdamW with linear warmup, batch-size learning-rate scaling and norm clipping.

The learning rate is derived from the batch size B = Bp * n by a named rule
(playbook §3, Fig. 4: ``sqrt`` is the paper's default, eta = eta_base *
sqrt(B / B_base), eta_base = 1e-6 at B_base = 1024). The derived peak rate is
computed once into the optax transformation; ``OptimConfig`` is frozen and never
mutated.
"""

import dataclasses
import math
from typing import Callable

import jax.numpy as jnp
import optax

__all__ = ["LR_RULES", "OptimConfig", "learning_rate", "lr_schedule", "make_optimizer"]

# name -> multiplier of lr_base as a function of B / B_base.
LR_RULES: dict[str, Callable[[float], float]] = {
    "sqrt": math.sqrt,
    "linear": lambda ratio: ratio,
    "constant": lambda ratio: 1.0,
}


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """Optimiser hyperparameters (playbook App. A defaults).

  Attributes:
    lr_base: learning rate at ``batch_base`` rollouts per update.
    batch_base: the batch size at which ``lr_base`` was tuned.
    lr_rule: "sqrt" | "linear" | "constant" scaling of the rate with B.
    warmup_steps: linear warmup length; update k (0-based) uses
      peak * min((k + 1) / warmup_steps, 1), so the first update is not wasted
      at rate 0. Constant afterwards.
    weight_decay: AdamW decoupled weight decay (verl's default 0.01).
    b1, b2, eps: Adam moments.
    max_grad_norm: global-norm gradient clipping; None disables it.
  """

  lr_base: float = 1e-6
  batch_base: int = 1024
  lr_rule: str = "sqrt"
  warmup_steps: int = 10
  weight_decay: float = 0.01
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  max_grad_norm: float | None = 1.0

  def __post_init__(self):
    if self.lr_rule not in LR_RULES:
      raise ValueError(f"OptimConfig.lr_rule={self.lr_rule!r}; choose from {sorted(LR_RULES)}")
    # Finite too: an infinite or NaN rate (or warmup) skips every update as
    # non-finite, an infinite batch_base makes the rate 0: the run would not train.
    for field in ("lr_base", "batch_base"):
      if not 0 < getattr(self, field) < math.inf:
        raise ValueError(f"OptimConfig.{field}={getattr(self, field)} must be > 0 and finite")
    if not (0 <= self.warmup_steps < math.inf and self.warmup_steps == int(self.warmup_steps)):
      raise ValueError(f"OptimConfig.warmup_steps={self.warmup_steps} must be an integer >= 0")
    if self.max_grad_norm is not None and not self.max_grad_norm > 0:
      raise ValueError(f"OptimConfig.max_grad_norm={self.max_grad_norm} must be > 0")
    if not 0 <= self.weight_decay < math.inf:  # negative decay grows the weights every step
      raise ValueError(f"OptimConfig.weight_decay={self.weight_decay} must be >= 0 and finite")
    # b = 1 divides Adam's bias correction by zero (every update NaN, so skipped);
    # eps = 0 gives 0 / 0 wherever a gradient is exactly 0 (an unseen token's row).
    for field in ("b1", "b2"):
      if not 0 <= getattr(self, field) < 1:
        raise ValueError(f"OptimConfig.{field}={getattr(self, field)} must be in [0, 1)")
    if not 0 < self.eps < math.inf:  # inf: every Adam step is 0, only the decay acts
      raise ValueError(f"OptimConfig.eps={self.eps} must be > 0 and finite")


def learning_rate(cfg: OptimConfig, batch_size: int) -> float:
  """Peak (post-warmup) learning rate for ``batch_size`` rollouts per update."""
  if not batch_size > 0:
    raise ValueError(f"batch_size={batch_size} must be > 0")
  return cfg.lr_base * LR_RULES[cfg.lr_rule](batch_size / cfg.batch_base)


def lr_schedule(cfg: OptimConfig, batch_size: int) -> optax.Schedule:
  """Update count (0-based) -> learning rate: linear warmup, then constant."""
  peak = learning_rate(cfg, batch_size)
  if cfg.warmup_steps == 0:
    return optax.constant_schedule(peak)
  warmup = float(cfg.warmup_steps)

  def schedule(count):
    return peak * jnp.minimum((count + 1) / warmup, 1.0)

  return schedule


def make_optimizer(cfg: OptimConfig, *, batch_size: int) -> optax.GradientTransformation:
  """Clip-by-global-norm then AdamW with the batch-size-scaled schedule."""
  adamw = optax.adamw(lr_schedule(cfg, batch_size), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                      weight_decay=cfg.weight_decay)
  if cfg.max_grad_norm is None:
    return adamw
  return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), adamw)
