"""The package's rooms import downward only: the loop's parts never import the driver."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "oapl_jax"
# room -> modules above it, which it must not import
ABOVE = {
    "eval": ("oapl_jax.train", "oapl_jax.main", "oapl_jax.rl", "oapl_jax.studies"),
    "rl": ("oapl_jax.train", "oapl_jax.main", "oapl_jax.studies"),
    "sampling": ("oapl_jax.train", "oapl_jax.main", "oapl_jax.rl", "oapl_jax.eval"),
    "models": ("oapl_jax.train", "oapl_jax.main", "oapl_jax.rl", "oapl_jax.eval", "oapl_jax.sampling"),
    "tasks": ("oapl_jax.train", "oapl_jax.main", "oapl_jax.rl", "oapl_jax.eval", "oapl_jax.sampling"),
    "data": ("oapl_jax.train", "oapl_jax.main", "oapl_jax.rl", "oapl_jax.eval", "oapl_jax.sampling"),
    "rewards": ("oapl_jax.train", "oapl_jax.main", "oapl_jax.rl", "oapl_jax.eval", "oapl_jax.sampling"),
}


def _imports(path: pathlib.Path) -> set[str]:
  """Every module a file imports, at the top or inside a function."""
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module:  # `from a import b`: a, and a.b
      names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
  return names


@pytest.mark.parametrize("room", sorted(ABOVE))
def test_rooms_import_nothing_above_them(room):
  bad = [(str(path.relative_to(ROOT)), name) for path in sorted((ROOT / room).rglob("*.py"))
         for name in _imports(path) if name.startswith(ABOVE[room])]
  assert not bad, f"{room}/ imports upward: {bad}"


def test_train_py_is_the_thin_driver():
  assert len((ROOT / "train.py").read_text().splitlines()) < 200
