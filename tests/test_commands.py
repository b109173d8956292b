"""Every `--config.X=...` override quoted in README.md and launch/ names a real setting."""

import pathlib
import re

from configs import tiny

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_documented_overrides_exist_in_the_config():
  config = tiny.get_config()
  texts = [ROOT / "README.md", *sorted((ROOT / "launch").glob("*.sh")), ROOT / "configs" / "tiny.py"]
  found = 0
  for path in texts:
    for name in re.findall(r"--config\.([A-Za-z0-9_.]+)=", path.read_text()):
      node = config
      for part in name.split("."):
        assert part in node, f"{path.name}: --config.{name} is not a setting of configs/tiny.py"
        node = node[part]
      found += 1
  assert found >= 5
