"""The package's imports flow one way: down the layers below, with no cycle.

Every import counts, at the top of a file or inside a function (a lazy import is still a
dependency). A module may import modules of its own layer and of the layers before it;
`oapl_jax.config` is imported only by the layers from its own up (the driver and the commands),
never by the library under it. A new module must be given a layer here.
"""

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "oapl_jax"

# Lowest first. A module's layer is that of the longest name here it is or lies under.
LAYERS = (
    ("oapl_jax", "oapl_jax.errors"),
    # JAX-free facts a config is checked against, and the run and the planner read
    ("oapl_jax.topology", "oapl_jax.placement", "oapl_jax.storage", "oapl_jax.workdir", "oapl_jax.run_config",
     "oapl_jax.models.presets",
     "oapl_jax.models.names", "oapl_jax.rl.names", "oapl_jax.tasks.base", "oapl_jax.tasks.limits"),
    ("oapl_jax.distributed", "oapl_jax.metrics", "oapl_jax.timing"),
    ("oapl_jax.data",),
    ("oapl_jax.rewards",),
    ("oapl_jax.models", "oapl_jax.sharding"),
    ("oapl_jax.tasks", "oapl_jax.envs"),
    ("oapl_jax.sampling", "oapl_jax.checkpoint"),
    ("oapl_jax.eval",),
    ("oapl_jax.rl", "oapl_jax.warmup", "oapl_jax.policies"),
    ("oapl_jax.plan", "oapl_jax.aot"),  # the memory plan and the compiled programs (--dry_run)
    ("oapl_jax.config",),
    ("oapl_jax.train",),
    # the commands
    ("oapl_jax.main", "oapl_jax.generate", "oapl_jax.evaluate", "oapl_jax.export", "oapl_jax.sample",
     "oapl_jax.import_traces",
     "oapl_jax.studies"),
)
CONFIG = "oapl_jax.config"


def _modules(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
  """{dotted module name: file} of the package ("oapl_jax.tasks" for tasks/__init__.py)."""
  out = {}
  for path in sorted(root.rglob("*.py")):
    parts = ("oapl_jax",) + path.relative_to(root).with_suffix("").parts
    out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return out


def import_graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
  """{module: the package's modules it imports}; `from a import b` counts as a.b when that is
  a module, else as a (a name defined in a)."""
  modules = _modules(root)

  def resolve(name: str) -> str | None:
    while name and name not in modules:
      name = name.rpartition(".")[0]
    return name or None

  graph = {}
  for module, path in modules.items():
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        found |= {resolve(a.name) for a in node.names if a.name.startswith("oapl_jax")}
      elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("oapl_jax"):
        found |= {resolve(f"{node.module}.{a.name}") for a in node.names}
    package = path.name == "__init__.py"
    graph[module] = {m for m in found - {None, module} if not (package and m.startswith(module + "."))}
  return graph


def layer_of(module: str) -> int:
  """The index in LAYERS of `module` (the longest name it is or lies under); KeyError if none."""
  best = max(((len(name), i) for i, names in enumerate(LAYERS) for name in names
              if module == name or module.startswith(name + ".")), default=None)
  if best is None:
    raise KeyError(f"{module} has no layer in tests/test_layout.py LAYERS")
  return best[1]


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
  """(importer, imported) pairs whose imported module sits in a higher layer, and imports of
  oapl_jax.config from below its layer."""
  bad = []
  for module, imported in sorted(graph.items()):
    for other in sorted(imported):
      if layer_of(other) > layer_of(module) or (other == CONFIG and layer_of(module) < layer_of(CONFIG)):
        bad.append((module, other))
  return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph.get(v, ())):
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


def test_every_module_has_a_layer():
  for module in import_graph():
    layer_of(module)


def test_imports_flow_down_the_layers():
  bad = upward_imports(import_graph())
  assert not bad, f"imports up the layers (or of {CONFIG} from the library): {bad}"


def test_the_import_graph_has_no_cycle():
  assert cycles(import_graph()) == []


def _copy_with(tmp_path, relative: str, line: str) -> pathlib.Path:
  """A copy of the package with `line` added after `relative`'s `from __future__` import."""
  import shutil  # noqa: PLC0415
  copy = tmp_path / "oapl_jax"
  shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))
  path = copy / relative
  text = path.read_text()
  first = text.index("\n", text.index("from __future__ import annotations")) + 1
  path.write_text(text[:first] + line + "\n" + text[first:])
  return copy


def test_the_checks_catch_a_config_import_put_back_into_sharding(tmp_path):
  copy = _copy_with(tmp_path, "sharding.py", "from oapl_jax.config import validate")
  graph = import_graph(copy)
  assert ("oapl_jax.sharding", CONFIG) in upward_imports(graph)


def test_the_checks_catch_a_cycle_within_a_layer(tmp_path):
  copy = _copy_with(tmp_path, "rl/buffer.py", "from oapl_jax.rl.loop import Run")
  graph = import_graph(copy)
  assert any("oapl_jax.rl.buffer" in c and "oapl_jax.rl.loop" in c for c in cycles(graph))


@pytest.mark.parametrize("module", ["oapl_jax.config", "oapl_jax.placement", "oapl_jax.topology",
                                    "oapl_jax.tasks.registry", "oapl_jax.models.presets",
                                    "oapl_jax.models.names", "oapl_jax.rl.names", "oapl_jax.workdir"])
def test_leaves_a_config_is_checked_against_import_no_jax(module):
  """Config files, launchers and --dry_run's refusals read these without starting JAX; a config
  is validated without it too."""
  code = (f"import sys, {module}; "
          "from oapl_jax import config; config.validate(config.repo_config('tiny.py')); "
          "print(sorted({m.split('.')[0] for m in sys.modules} & {'jax', 'flax', 'tensorflow'}))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       cwd=ROOT.parent)
  assert out.stdout.strip() == "[]", out.stdout


def test_train_py_is_the_thin_driver():
  assert len((ROOT / "train.py").read_text().splitlines()) < 200
