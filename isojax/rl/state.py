"""The update's state: its type, placement on a mesh and abstract shapes.

``init_train_state`` builds a fresh state around a model's parameters;
``abstract_train_state`` gives the same tree as shapes with shardings, so a
7B step compiles (``TrainStep.lower``) before any array exists.
"""

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from isojax import sharding as shd
from isojax.rl.losses import LossConfig
from isojax.rl.optim import OptimConfig, make_optimizer

__all__ = ["TrainState", "abstract_train_state", "check_state", "default_mesh",
           "init_train_state", "train_state_shardings"]


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
  """(shapes, shardings) of the ``TrainState`` tree for ``model`` and optimiser ``tx``
  on ``mesh`` (``ref_params`` included when ``with_ref``), from the parameters'
  logical axes."""
  params = nnx.state(model, nnx.Param)
  abstract = jax.eval_shape(lambda p: _opt_and_ref(p, tx, with_ref), params)
  return abstract, shd.state_shardings(abstract, mesh, rules)


def _leaf_specs(tree) -> dict:
  """keystr path -> (shape, dtype) per leaf, as jit sees them: nnx Variables count
  as their value (in_shardings is a prefix tree), dtypes canonical (int64 is
  int32 without x64)."""
  is_var = lambda x: isinstance(x, nnx.Variable)
  specs = {}
  for path, x in jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_var):
    x = x.get_value() if is_var(x) else x
    if not hasattr(x, "dtype"):  # a Python scalar
      x = np.asarray(x)
    specs[jax.tree_util.keystr(path)] = (tuple(x.shape),
                                         jax.dtypes.canonicalize_dtype(x.dtype))
  return specs


def check_state(state, expected, *, expected_flat=None) -> None:
  """ValueError naming where ``state`` differs from the state a step was built
  for (``expected``: its shapes): a leaf missing or extra, or a shape or dtype.

  Without it a state from another model, LossConfig or OptimConfig fails inside
  jit, as a pytree-prefix mismatch or a shape error deep in the model. A step
  passes ``expected_flat`` (``jax.tree.flatten(expected)``, computed once): a
  7B state has ~1400 leaves, and flattening it takes milliseconds per update.
  """
  want_leaves, want_def = expected_flat or jax.tree.flatten(expected)
  leaves, treedef = jax.tree.flatten(state)
  if treedef == want_def and all(
      getattr(x, "shape", None) == w.shape and getattr(x, "dtype", None) == w.dtype
      for x, w in zip(leaves, want_leaves)):
    return  # the usual case, without naming every leaf
  got, want = _leaf_specs(state), _leaf_specs(expected)
  missing = [k for k in want if k not in got]
  # A step without KL passes a state's ref_params through untouched.
  expects_ref = any(k.startswith(".ref_params") for k in want)
  extra = [k for k in got if k not in want
           and (expects_ref or not k.startswith(".ref_params"))]
  wrong = [k for k in want if k in got and got[k] != want[k]]
  if not (missing or extra or wrong):
    return
  if missing:
    what = (f"lacks state{missing[0]} ({len(missing)} of the step's {len(want)} leaves "
            f"missing)")
  elif extra:
    what = f"has state{extra[0]}, which the step does not ({len(extra)} such leaves)"
  else:
    (shape, dtype), (want_shape, want_dtype) = got[wrong[0]], want[wrong[0]]
    what = (f"has state{wrong[0]} of {dtype}{list(shape)} where the step expects "
            f"{want_dtype}{list(want_shape)}")
  hint = ""
  if (missing or extra) and all(k.startswith(".ref_params") for k in missing + extra):
    hint = "; ref_params exist only when LossConfig.kl_coef > 0"
  raise ValueError(f"the state ({type(state).__name__}) does not match the step: it {what}."
                   f" Build both from the same model, LossConfig and OptimConfig "
                   f"(init_train_state / init_ppo_train_state){hint}")


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
  _, shardings = train_state_shardings(model, tx, mesh, rules, with_ref=with_ref)
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
  shapes, shardings = train_state_shardings(model, tx, mesh, rules, with_ref=with_ref)
  leaves, treedef = jax.tree.flatten(shapes)
  sh_leaves = jax.tree.leaves(shardings)
  if len(sh_leaves) != len(leaves):  # the two trees come from the same state
    raise AssertionError(f"{len(sh_leaves)} shardings for {len(leaves)} state leaves")
  return jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
                                      for x, sh in zip(leaves, sh_leaves)])
