"""Each install extra carries what its modules import.

setup.py's lists (ANALYSIS, TRAIN, VLLM) are expanded to every distribution they
pull in; a subprocess then imports a set of isojax modules with every *other*
installed distribution blocked, so a module that starts importing a package its
extra does not install fails here rather than in a user's fresh notebook.
"""

import ast
import importlib.metadata as metadata
import os
import pkgutil
import re
import subprocess
import sys
import textwrap

import pytest
from packaging.requirements import Requirement

import isojax

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _setup_lists() -> dict[str, list[str]]:
  tree = ast.parse(open(os.path.join(REPO, "setup.py"), encoding="utf-8").read())
  return {node.targets[0].id: ast.literal_eval(node.value) for node in tree.body
          if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
          and node.targets[0].id.isupper()}


def _norm(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def _closure(requirements: list[str]) -> set[str]:
  """The distributions `requirements` install, transitively (extras not taken)."""
  todo, seen = [Requirement(r).name for r in requirements], set()
  while todo:
    name = _norm(todo.pop())
    if name in seen:
      continue
    seen.add(name)
    try:
      requires = metadata.requires(name) or []
    except metadata.PackageNotFoundError:
      continue  # an optional platform dependency not installed here
    for spec in requires:
      req = Requirement(spec)
      if req.marker is None or req.marker.evaluate({"extra": ""}):
        todo.append(req.name)
  return seen


def _blocked(allowed: set[str]) -> list[str]:
  """Top-level modules of installed distributions outside `allowed`."""
  blocked = set()
  for module, dists in metadata.packages_distributions().items():
    if module.startswith("_") or module == "isojax":
      continue
    if not any(_norm(d) in allowed for d in dists):
      blocked.add(module)
  return sorted(blocked)


def _modules(package, skip=()) -> list[str]:
  names = [package.__name__]
  for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
    if not any(info.name.startswith(s) for s in skip):
      names.append(info.name)
  return names


def _import_with_only(requirements: list[str], modules: list[str]):
  blocked = _blocked(_closure(requirements))
  code = textwrap.dedent(f"""
      import importlib, importlib.util, sys
      BLOCKED = set({blocked!r})
      class Block:
        def find_spec(self, name, path=None, target=None):
          if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"{{name}} is not installed by this extra")
      sys.meta_path.insert(0, Block())
      find_spec = importlib.util.find_spec  # libraries probe optional packages with it
      importlib.util.find_spec = lambda name, *a: (
          None if name.partition(".")[0] in BLOCKED else find_spec(name, *a))
      for module in {modules!r}:
        importlib.import_module(module)
      """)
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  return blocked


def test_the_base_install_runs_the_analysis_without_jax():
  lists = _setup_lists()
  import isojax.analysis  # pylint: disable=import-outside-toplevel
  blocked = _import_with_only(lists["ANALYSIS"], _modules(isojax.analysis))
  assert {"jax", "flax", "torch"} <= set(blocked)  # the block really excluded them


def test_the_train_extra_runs_the_trainer_sweeps_and_launchers():
  lists = _setup_lists()
  train = lists["ANALYSIS"] + lists["TRAIN"]
  modules = _modules(isojax, skip=("isojax.rollout.vllm_", "isojax.rollout.weight_sync",
                                   "isojax.main"))
  # The packages the trainer imports lazily (in the function that uses them) too.
  lazy = ["tensorboardX", "pyarrow.parquet", "datasets", "math_verify", "orbax.checkpoint"]
  blocked = _import_with_only(train, modules + lazy + ["experiments.common",
                                                       "launch.difficulty_splits",
                                                       "launch.make_base_model"])
  assert "torch" in blocked and "pytest" in blocked
  for entry_point in ("isojax.main", "launch.sweep", "launch.demo"):  # each defines --config
    _import_with_only(train, [entry_point])


def test_the_vllm_extra_runs_the_client_and_the_server_launcher():
  lists = _setup_lists()
  modules = ["isojax.rollout.vllm_client", "isojax.rollout.weight_sync",
             "isojax.rollout.vllm_server", "launch.vllm_server"]
  blocked = _import_with_only(lists["ANALYSIS"] + lists["TRAIN"] + lists["VLLM"], modules)
  assert "torch" in blocked


@pytest.mark.parametrize("where", ["README.md", "notebooks/isocompute_quickstart.ipynb"])
def test_documented_installs_name_extras_that_exist(where):
  text = open(os.path.join(REPO, where), encoding="utf-8").read()
  extras = [group for line in text.splitlines() if "install" in line
            for group in re.findall(r"(?:\.|isojax)\[([a-z,]+)\]", line)]
  assert extras, f"{where} shows no pip install with an extra"
  known = {"analysis", "train", "vllm", "test"}
  for group in extras:
    assert set(group.split(",")) <= known, (where, group)
