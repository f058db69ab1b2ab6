"""What a sampler's `update_weights` accepts: parameters laid out as the ones it
was built with (the same leaves, shapes and dtypes), so that new weights reuse
the compiled programs instead of failing inside them or recompiling them."""

from __future__ import annotations

import jax
from flax import nnx


def state_of(model, graphdef, *, where: str) -> nnx.State:
  """The parameters of `model`, a Decoder of the graph `graphdef` or its
  `nnx.State`; ValueError naming `where` for anything else."""
  if isinstance(model, nnx.State):
    return model
  if not isinstance(model, nnx.Module):
    raise ValueError(f"{where}: got a {type(model).__name__}; pass a Decoder or its "
                     f"nnx.state(model) (a plain dict of arrays carries no layout)")
  other, state = nnx.split(model)
  if other != graphdef:
    raise ValueError(f"{where}: model structure differs from the one the sampler was "
                     f"built with")
  return state


def _layout(state) -> dict:
  """keystr path -> "dtype[shape]" per leaf."""
  return {jax.tree_util.keystr(path): f"{x.dtype}{list(x.shape)}"
          for path, x in jax.tree_util.tree_leaves_with_path(state)}


def check_same_layout(held, new, *, where: str) -> None:
  """Raises ValueError naming the first leaf of `new` that `held` lacks, or that
  `held` has and `new` lacks, or whose shape or dtype differs."""
  held_leaves, held_def = jax.tree.flatten(held)
  new_leaves, new_def = jax.tree.flatten(new)
  if held_def == new_def and all(
      (x.shape, x.dtype) == (y.shape, y.dtype) for x, y in zip(held_leaves, new_leaves)):
    return  # every update: the paths are only built to name a difference
  want, got = _layout(held), _layout(new)
  missing = [k for k in want if k not in got]
  extra = [k for k in got if k not in want]
  wrong = [k for k in want if k in got and got[k] != want[k]]
  if missing:
    what = f"lack {missing[0]} ({len(missing)} of the sampler's {len(want)} leaves missing)"
  elif extra:
    what = f"have {extra[0]}, which the sampler's model does not ({len(extra)} such leaves)"
  else:
    what = (f"have {wrong[0]} of {got[wrong[0]]} where the sampler holds "
            f"{want[wrong[0]]} ({len(wrong)} leaves differ)")
  raise ValueError(f"{where}: the new parameters {what}; pass parameters of the "
                   f"architecture, shapes and dtypes the sampler was built with")
