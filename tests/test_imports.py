"""isojax's modules import one way: the module graph has no cycle, and the JAX-free
parts (the analysis, the vLLM server launcher) load no JAX.

The graph is read from source with `ast`: every `import` and `from ... import` in a
module, at top level or inside a function (a deferred import is still a dependency),
gives an edge to the isojax module it names. `from pkg import name` points at
`pkg.name` when that is a module, else at `pkg`. The implicit import of a parent
package's `__init__` is not an edge: every submodule has it, and an `__init__` that
re-exports its submodules is the package's own business.
"""

import ast
import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _modules(root: str, package: str) -> dict[str, str]:
  """Dotted module name -> file, for every module of `package` under `root`."""
  out = {}
  for folder, dirs, files in os.walk(os.path.join(root, package)):
    dirs[:] = sorted(d for d in dirs if os.path.exists(os.path.join(folder, d, "__init__.py")))
    for f in sorted(files):
      if f.endswith(".py"):
        parts = os.path.relpath(os.path.join(folder, f), root)[:-3].split(os.sep)
        if parts[-1] == "__init__":
          parts = parts[:-1]
        out[".".join(parts)] = os.path.join(folder, f)
  return out


def _imports(name: str, path: str, modules: dict[str, str]) -> set[str]:
  """The modules among `modules` that module `name` (in file `path`) imports."""
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read(), path)
  named = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      named.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:  # relative: strip the module (or package) and level - 1 parents
        parts = name.split(".") if path.endswith("__init__.py") else name.split(".")[:-1]
        parts = parts[:len(parts) - node.level + 1]
        base = ".".join(parts + ([node.module] if node.module else []))
      for alias in node.names:
        sub = f"{base}.{alias.name}"
        named.add(sub if sub in modules else base)
  out = set()
  for dep in named:
    while dep and dep not in modules:  # `import a.b.Thing`-style names: the module
      dep = dep.rpartition(".")[0]
    if dep and dep != name:
      out.add(dep)
  return out


def _graph(root: str, package: str) -> dict[str, set[str]]:
  modules = _modules(root, package)
  return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components with more than one module (Tarjan)."""
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while not component or component[-1] != v:
        component.append(stack.pop())
        on_stack.discard(component[-1])
      if len(component) > 1:
        out.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def _describe(graph, component):
  return "; ".join(f"{m} -> {sorted(graph[m] & set(component))}" for m in component)


def test_isojax_imports_have_no_cycle():
  graph = _graph(REPO, "isojax")
  assert len(graph) > 50 and "isojax.rollout.base" in graph["isojax.rollout.vllm_client"]
  cycles = _cycles(graph)
  assert not cycles, "import cycles: " + " | ".join(_describe(graph, c) for c in cycles)


def test_the_cycle_finder_sees_deferred_relative_and_from_imports(tmp_path):
  """A planted package whose only cycles go through the forms the test must read."""
  files = {
      "pkg/__init__.py": "from pkg.a import A\n",
      "pkg/a.py": "import os\nfrom pkg import b\nA = 1\n",
      "pkg/b.py": "def f():\n  from .sub.c import C\n  return C\n",
      "pkg/sub/__init__.py": "",
      "pkg/sub/c.py": "import pkg.a\nC = 2\n",
      "pkg/d.py": "from pkg.sub import c\n",  # imports into the cycle, not part of it
      "pkg/e.py": "from . import f\n",
      "pkg/f.py": "from pkg.e import thing\n",
  }
  for rel, text in files.items():
    (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / rel).write_text(text)
  graph = _graph(str(tmp_path), "pkg")
  assert graph["pkg"] == {"pkg.a"} and graph["pkg.b"] == {"pkg.sub.c"}
  assert _cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c"], ["pkg.e", "pkg.f"]]


@pytest.mark.parametrize("module", ["isojax.analysis", "isojax.rollout.vllm_server"])
def test_module_imports_without_jax(module):
  """The analysis runs in a notebook without the JAX stack, and the vLLM server
  launcher only starts a subprocess: neither may load JAX or Flax."""
  code = textwrap.dedent(f"""
      import sys
      import {module}
      print(sorted(m for m in ("jax", "flax", "optax") if m in sys.modules))
  """)
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, PYTHONPATH=REPO))
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == "[]", f"importing {module} loaded {out.stdout.strip()}"


def test_step_memory_report_imports_without_tensorboard():
  """--dry_run and bench/gpu_step.py build the step through run_setup; only a run
  that writes events needs tensorboardX (a bench machine may not have it)."""
  code = textwrap.dedent("""
      import sys
      sys.modules["tensorboardX"] = None  # any import of it fails
      import isojax.memory, isojax.main
      print("ok")
  """)
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, PYTHONPATH=REPO))
  assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
