"""Config: invalid values are refused naming the setting; overrides parse; typos fail."""

import subprocess
import sys

import pytest

from configs import tiny
from oapl_jax.config import ConfigError, validate


@pytest.mark.parametrize("setting,value", [
    ("rl.beta1", 0.0), ("rl.beta2", -1e-3), ("rl.lag", 0), ("rl.group_size", 1),
    ("rl.loss", "ppo"), ("rl.old_logprobs", "trainer"), ("sampling.temperature", 0.0),
    ("sampling.top_p", 1.5), ("train.grad_accum", 3), ("seed", -1), ("sampling.engines", 0),
    ("rl.mode", "offline"),
])
def test_invalid_values_are_refused_by_name(setting, value):
  c = tiny.get_config()
  section, _, field = setting.rpartition(".")
  (c[section] if section else c)[field] = value
  with pytest.raises(ConfigError, match=setting.replace(".", r"\.")):
    validate(c)


def test_default_and_smoke_configs_are_valid():
  validate(tiny.get_config())
  validate(tiny.get_config("smoke"))
  with pytest.raises(ValueError, match="unknown variant"):
    tiny.get_config("nope")


def _main(*args, workdir):
  return subprocess.run([sys.executable, "-m", "oapl_jax.main", *args, f"--workdir={workdir}"],
                        capture_output=True, text=True, timeout=300)


def test_bad_override_fails_before_any_work(tmp_path):
  out = _main("--config=configs/tiny.py", "--config.rl.lag=0", workdir=tmp_path / "w")
  assert out.returncode != 0
  assert "config.rl.lag=0" in out.stderr
  assert not (tmp_path / "w" / "checkpoints").exists()


def test_mistyped_override_fails(tmp_path):
  out = _main("--config=configs/tiny.py", "--config.rl.lagg=3", workdir=tmp_path / "w")
  assert out.returncode != 0
  assert "lagg" in out.stderr


def test_missing_config_file_fails(tmp_path):
  out = _main("--config=configs/nope.py", workdir=tmp_path / "w")
  assert out.returncode != 0
  assert "nope.py" in out.stderr
