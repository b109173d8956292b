"""The commands: every `--config.X=...` override quoted in README.md, launch/ and configs/ names a
real setting; a refused setting stops `python -m oapl_jax.main` / `oapl_jax.evaluate` in one line."""

import pathlib
import re
import subprocess
import sys

import pytest

from configs import code, math, reasoning_gym, tiny
from oapl_jax.errors import one_line

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


# --- a refused setting: one line on stderr and exit code 2, a traceback only with --verbose -----


def _command(module: str, *args, workdir) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", module, "--config=configs/tiny.py:smoke",
                         f"--workdir={workdir}", *args], capture_output=True, text=True,
                        timeout=300, cwd=ROOT)


@pytest.mark.parametrize("module,setting", [("oapl_jax.main", "train.lr"),
                                            ("oapl_jax.evaluate", "rl.beta2")])
def test_refused_setting_is_one_line(module, setting, tmp_path):
  out = _command(module, f"--config.{setting}=inf", workdir=tmp_path / "w")
  assert out.returncode == 2, out.stderr[-3000:]
  assert out.stderr.strip().splitlines() == [f"error: config.{setting}=inf: must be finite and > 0"]
  assert not (tmp_path / "w").exists()  # refused before any work


def test_verbose_shows_the_traceback(tmp_path):
  out = _command("oapl_jax.main", "--config.train.b1=1.5", "--verbose", workdir=tmp_path / "w")
  assert out.returncode == 2
  assert "Traceback" in out.stderr and "ConfigError: config.train.b1=1.5" in out.stderr


def test_a_message_of_several_lines_is_printed_as_one():
  assert one_line("checkpoint of another model:\n  config.model.a=1\n  config.model.b=2\n") == \
      "checkpoint of another model: config.model.a=1; config.model.b=2"


def _cmd_line(module: str, *args) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                        timeout=300, cwd=ROOT)


@pytest.mark.parametrize("module", ["oapl_jax.main", "oapl_jax.evaluate"])
def test_a_workdir_that_is_a_file_is_one_line(module, tmp_path):
  path = tmp_path / "not_a_folder"
  path.write_text("notes")
  out = _cmd_line(module, "--config=configs/tiny.py:smoke", f"--workdir={path}")
  assert out.returncode == 2, out.stderr[-3000:]
  assert out.stderr.strip().splitlines()[-1] == (
      f"error: --workdir={path} is a file, not a folder: give a folder (new or a run's)")
  assert path.read_text() == "notes"


@pytest.mark.parametrize("config, override, why", [
    ("configs/tiny.py:nope", None, "--config=configs/tiny.py:nope: the config file did not load: "
     "ValueError: unknown config arg 'nope' (unknown variant; known: smoke, lora, int8)"),
    ("{no_get}", None, "--config={no_get}: the config file did not load: AttributeError: "),
    ("{raises}", None, "--config={raises}: the config file did not load: RuntimeError: boom"),
    ("configs/tiny.py", "--config.rl.group_size=8x",
     "flag --config.rl.group_size=8x: invalid literal for int() with base 10: '8x'"),
])
def test_a_config_file_or_override_that_cannot_load_is_one_line(config, override, why, tmp_path):
  files = {"no_get": tmp_path / "no_get.py", "raises": tmp_path / "raises.py"}
  files["no_get"].write_text("x = 1\n")
  files["raises"].write_text("def get_config():\n  raise RuntimeError('boom')\n")
  config, why = (s.format(**files) for s in (config, why))
  out = _cmd_line("oapl_jax.main", f"--config={config}", f"--workdir={tmp_path / 'w'}",
                  *([override] if override else []))
  assert out.returncode == 2, out.stderr[-3000:]
  lines = [line for line in out.stderr.strip().splitlines() if line.startswith("error:")]
  assert len(lines) == 1 and lines[0].startswith(f"error: {why}"), out.stderr[-2000:]
  assert "Traceback" not in out.stderr


def test_none_on_the_command_line_is_none():
  """`--config.model.path=None` reaches the config as None (a random model), not the string
  'None' (a folder that does not exist); where None is not allowed it is refused in one line."""
  ok = _cmd_line("oapl_jax.main", "--config=configs/tiny.py:smoke", "--config.model.path=None",
                 "--dry_run")
  assert ok.returncode == 0, ok.stderr[-2000:]
  bad = _cmd_line("oapl_jax.main", "--config=configs/tiny.py:smoke", "--config.rl.mode=None",
                  "--dry_run")
  assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith(
      "error: config.rl.mode=None: must be one of")
