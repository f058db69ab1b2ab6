"""PPO's train state: the policy's and the critic's parameters and optimiser states.

``init_ppo_train_state`` builds a fresh state around both models' parameters;
``abstract_ppo_train_state`` gives the same tree as shapes with shardings (as
``isojax.rl.state`` does for the critic-free step), so the joint step compiles
before any array exists. The step itself is ``isojax.rl.ppo``.
"""

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from isojax import sharding as shd
from isojax.models.critic import Critic
from isojax.rl.losses import LossConfig
from isojax.rl.optim import OptimConfig, make_optimizer
from isojax.rl.state import default_mesh

__all__ = ["PPOTrainState", "abstract_ppo_train_state", "init_ppo_train_state",
           "ppo_state_shardings"]


@flax.struct.dataclass
class PPOTrainState:
  """Everything a PPO update changes. ``ref_params`` is None unless kl_coef > 0.

  ``step`` counts applied (not skipped) updates, critic warm-up included.
  """

  params: Any  # the policy's nnx.Param state
  opt_state: Any
  critic_params: Any  # the critic's nnx.Param state (trunk + value head)
  critic_opt_state: Any
  step: jax.Array  # int32
  ref_params: Any = None


def _fresh_state(params, critic_params, tx, critic_tx, with_ref):
  return PPOTrainState(params=params, opt_state=tx.init(params), critic_params=critic_params,
                       critic_opt_state=critic_tx.init(critic_params),
                       step=jnp.zeros((), jnp.int32),
                       ref_params=jax.tree.map(jnp.copy, params) if with_ref else None)


def ppo_state_shardings(policy, critic, loss_cfg, optim_cfg, critic_optim, batch_size,
                          mesh, rules):
  tx = make_optimizer(optim_cfg, batch_size=batch_size)
  critic_tx = make_optimizer(critic_optim, batch_size=batch_size)
  with_ref = loss_cfg.kl_coef > 0
  shapes = jax.eval_shape(lambda p, c: _fresh_state(p, c, tx, critic_tx, with_ref),
                          nnx.state(policy, nnx.Param), nnx.state(critic, nnx.Param))
  return shapes, shd.state_shardings(shapes, mesh, rules), (tx, critic_tx, with_ref)


def init_ppo_train_state(policy: nnx.Module, critic: Critic, loss_cfg: LossConfig,
                         optim_cfg: OptimConfig, critic_optim: OptimConfig, *,
                         batch_size: int, mesh: Mesh | None = None,
                         rules=shd.DEFAULT_RULES) -> PPOTrainState:
  """Fresh optimiser states around copies of both models' parameters, on ``mesh``.

  The models stay usable (the step donates the state's copies).
  """
  mesh = default_mesh(mesh)
  _, shardings, (tx, critic_tx, with_ref) = ppo_state_shardings(
      policy, critic, loss_cfg, optim_cfg, critic_optim, batch_size, mesh, rules)
  params = jax.device_put(nnx.state(policy, nnx.Param), shardings.params, may_alias=False)
  critic_params = jax.device_put(nnx.state(critic, nnx.Param), shardings.critic_params,
                                 may_alias=False)
  return jax.device_put(_fresh_state(params, critic_params, tx, critic_tx, with_ref),
                        shardings, may_alias=False)


def abstract_ppo_train_state(policy: nnx.Module, critic: Critic, loss_cfg: LossConfig,
                             optim_cfg: OptimConfig, critic_optim: OptimConfig, *,
                             batch_size: int, mesh: Mesh | None = None,
                             rules=shd.DEFAULT_RULES) -> PPOTrainState:
  """``init_ppo_train_state``'s result as sharded ``jax.ShapeDtypeStruct`` leaves.

  Both models may come from ``nnx.eval_shape``; the result feeds ``TrainStep.lower``.
  """
  shapes, shardings, _ = ppo_state_shardings(
      policy, critic, loss_cfg, optim_cfg, critic_optim, batch_size,
      default_mesh(mesh), rules)
  # Flat leaves: the shapes hold nnx Variables where the shardings hold NamedShardings.
  leaves, treedef = jax.tree.flatten(shapes)
  return jax.tree.unflatten(treedef, [
      jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
      for x, sh in zip(leaves, jax.tree.leaves(shardings), strict=True)])
