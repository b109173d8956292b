"""Every `--config.X=...` override quoted in README.md, launch/ and configs/ names a real setting."""

import pathlib
import re

from configs import code, math, reasoning_gym, tiny

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _has(config, dotted: str) -> bool:
  node = config
  for part in dotted.split("."):
    if part not in node:
      return False
    node = node[part]
  return True


def test_documented_overrides_exist_in_a_config():
  configs = [tiny.get_config(), math.get_config(), code.get_config(), reasoning_gym.get_config()]
  texts = [ROOT / "README.md", *sorted((ROOT / "launch").glob("*")), *sorted((ROOT / "configs").glob("*.py"))]
  found = 0
  for path in texts:
    for name in re.findall(r"--config\.([A-Za-z0-9_.]+)=", path.read_text()):
      assert any(_has(c, name) for c in configs), f"{path.name}: --config.{name} is not a setting"
      found += 1
  assert found >= 8
