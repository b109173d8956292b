"""configs/math.py (and its :tiny variant) through the real HF checkpoint / tokenizer path."""

import json
import subprocess
import sys

import pytest

from configs import math as math_config
from oapl_jax.config import ConfigError, validate
from oapl_jax.models.build import param_count
from oapl_jax.models.tiny_hf import make_tiny_hf


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
  return make_tiny_hf(str(tmp_path_factory.mktemp("hf") / "tiny_qwen3"), preset="tiny_qwen3")


def _main(*args):
  return subprocess.run([sys.executable, "-m", "oapl_jax.main", *args], capture_output=True,
                        text=True, timeout=600)


def test_math_tiny_runs_rl_steps(tiny_qwen3, tmp_path):
  out = _main("--config=configs/math.py:tiny", f"--config.model.path={tiny_qwen3}",
              f"--workdir={tmp_path}")
  assert out.returncode == 0, out.stderr[-3000:]
  s = json.loads((tmp_path / "summary.json").read_text())
  assert s["trainer_steps"] == 4 and s["policy_versions"] == 2
  assert s["samples_generated"] == 4 * 2 * 8
  assert {"pass@1", "pass@2"} <= set(s["eval_after"])


def test_checkpoint_of_another_architecture_is_refused(tiny_qwen3, tmp_path):
  out = _main("--config=configs/math.py:tiny", f"--config.model.path={tiny_qwen3}",
              "--config.model.hidden_size=128", f"--workdir={tmp_path}")
  assert out.returncode != 0
  assert "config.model.hidden_size=128" in out.stderr and "has 64" in out.stderr


def test_full_math_config_needs_its_files():
  c = math_config.get_config()
  with pytest.raises(ConfigError, match=r"task\.train_path"):
    validate(c)
  assert c.rl.lag == 50 and c.rl.group_size == 8 and c.rl.beta1 == 1.0 and c.rl.beta2 == 1e-3
  assert c.train.lr == 1e-6 and c.train.eps == 1e-10 and c.train.b2 == 0.95
  assert math_config.get_config("lag=100").rl.lag == 100
  assert abs(param_count(c.model.preset) - 4.02e9) / 4.02e9 < 0.01
  with pytest.raises(ValueError, match="unknown config arg"):
    math_config.get_config("huge")


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
  return make_tiny_hf(str(tmp_path_factory.mktemp("hf") / "tiny_qwen2"), preset="tiny_qwen2")


def test_code_tiny_runs_rl_steps(tiny_qwen2, tmp_path, requires_sandbox):
  out = _main("--config=configs/code.py:tiny", f"--config.model.path={tiny_qwen2}",
              f"--workdir={tmp_path}")
  assert out.returncode == 0, out.stderr[-3000:]
  assert json.loads((tmp_path / "summary.json").read_text())["trainer_steps"] == 4


def test_code_task_scores_answers_in_the_sandbox(tiny_qwen2, requires_sandbox):
  from configs import code as code_config
  from oapl_jax.tasks import make_task
  c = code_config.get_config("tiny")
  c.model.path = tiny_qwen2
  task, tokenizer = make_task(c)
  product, double = task.eval_problems()[:2]
  assert "standard input" in product.prompt and "double" in double.prompt
  assert "2 3" not in product.prompt  # tests never enter the prompt
  good = "Here it is:\n```python\na, b = map(int, input().split())\nprint(a * b)\n```"
  wrong = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
  call = "```python\ndef double(x):\n    return 2 * x\n```"
  assert task.score_batch([good, wrong, "no code here", call], [product, product, product, double]) \
      == [1.0, 0.0, 0.0, 1.0]
