"""The update's state: its type, placement on a mesh and abstract shapes.

``init_train_state`` builds a fresh state around a model's parameters;
``abstract_train_state`` gives the same tree as shapes with shardings, so a
7B step compiles (``TrainStep.lower``) before any array exists.
"""

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from isojax import sharding as shd
from isojax.rl.losses import LossConfig
from isojax.rl.optim import OptimConfig, make_optimizer

__all__ = ["TrainState", "abstract_train_state", "default_mesh", "init_train_state",
           "train_state_shardings"]


@flax.struct.dataclass
class TrainState:
  """Everything an update changes. ``ref_params`` is None unless kl_coef > 0."""

  params: Any  # nnx.State of the model's nnx.Param variables
  opt_state: Any
  step: jax.Array  # int32, number of applied (not skipped) updates
  ref_params: Any = None


def _opt_and_ref(params, tx, with_ref):
  ref = jax.tree.map(jnp.copy, params) if with_ref else None
  return TrainState(params=params, opt_state=tx.init(params),
                    step=jnp.zeros((), jnp.int32), ref_params=ref)


def train_state_shardings(model, tx, mesh, rules, *, with_ref):
  """Shardings of the ``TrainState`` tree for ``model`` and optimiser ``tx`` on ``mesh``
  (``ref_params`` included when ``with_ref``), from the parameters' logical axes."""
  params = nnx.state(model, nnx.Param)
  abstract = jax.eval_shape(lambda p: _opt_and_ref(p, tx, with_ref), params)
  return shd.state_shardings(abstract, mesh, rules)


def default_mesh(mesh: Mesh | None) -> Mesh:
  """``mesh``, or a one-device mesh when None."""
  return mesh if mesh is not None else shd.make_mesh(devices=jax.devices()[:1])


def init_train_state(model: nnx.Module, loss_cfg: LossConfig, optim_cfg: OptimConfig, *,
                     batch_size: int, mesh: Mesh | None = None,
                     rules=shd.DEFAULT_RULES) -> TrainState:
  """Fresh optimiser state around ``model``'s parameters, placed on ``mesh``.

  The state gets its own copies of the parameters (the step donates them), so
  ``model`` stays usable. ``ref_params`` (a frozen copy) only if kl_coef > 0.
  """
  mesh = default_mesh(mesh)
  tx = make_optimizer(optim_cfg, batch_size=batch_size)
  with_ref = loss_cfg.kl_coef > 0
  shardings = train_state_shardings(model, tx, mesh, rules, with_ref=with_ref)
  params = jax.device_put(nnx.state(model, nnx.Param), shardings.params, may_alias=False)
  return jax.device_put(_opt_and_ref(params, tx, with_ref), shardings, may_alias=False)


def abstract_train_state(model: nnx.Module, loss_cfg: LossConfig, optim_cfg: OptimConfig, *,
                         batch_size: int, mesh: Mesh | None = None,
                         rules=shd.DEFAULT_RULES) -> TrainState:
  """``init_train_state``'s result as ``jax.ShapeDtypeStruct`` leaves with shardings.

  No array is created, so ``model`` may come from ``nnx.eval_shape`` (a 7B
  model costs nothing); the result feeds ``TrainStep.lower``.
  """
  mesh = default_mesh(mesh)
  tx = make_optimizer(optim_cfg, batch_size=batch_size)
  with_ref = loss_cfg.kl_coef > 0
  shardings = train_state_shardings(model, tx, mesh, rules, with_ref=with_ref)
  shapes = jax.eval_shape(lambda p: _opt_and_ref(p, tx, with_ref),
                          nnx.state(model, nnx.Param))
  leaves, treedef = jax.tree.flatten(shapes)
  sh_leaves = jax.tree.leaves(shardings)
  if len(sh_leaves) != len(leaves):  # the two trees come from the same state
    raise AssertionError(f"{len(sh_leaves)} shardings for {len(leaves)} state leaves")
  return jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
                                      for x, sh in zip(leaves, sh_leaves)])
