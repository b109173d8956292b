"""configs/gsm8k.py: its :tiny run on CPU through the real HF checkpoint / tokenizer / math reward
path, its GSM8K-format files scored by the math reward, and the memory plan of the real config
on one device (16 GB class; the `large` variant on 40 GB)."""

import json
import os
import re
import subprocess
import sys

import pytest

from configs import gsm8k
from oapl_jax import config as config_lib
from oapl_jax import plan as plan_lib
from oapl_jax.models.build import param_count
from oapl_jax.models.tiny_hf import make_tiny_hf
from oapl_jax.rewards.math import score_math

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2**30


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
  return make_tiny_hf(str(tmp_path_factory.mktemp("hf") / "tiny_qwen3"), preset="tiny_qwen3")


def _main(*args) -> subprocess.CompletedProcess:
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "oapl_jax.main", *args], capture_output=True,
                        text=True, cwd=ROOT, env=env, timeout=600)


def _rows(path: str) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def test_tiny_runs_rl_steps_through_the_real_config_path(tiny_qwen3, tmp_path):
  out = _main("--config=configs/gsm8k.py:tiny", f"--config.model.path={tiny_qwen3}",
              f"--workdir={tmp_path}")
  assert out.returncode == 0, out.stderr[-3000:]
  s = json.loads((tmp_path / "summary.json").read_text())
  assert s["trainer_steps"] == 4 and s["policy_versions"] == 2
  assert s["samples_generated"] == 4 * 2 * 8
  assert s["eval_after"]["num_problems"] == 8 and {"pass@1", "pass@2"} <= set(s["eval_after"])
  metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert all({"reward_mean", "entropy", "lag_mean", "trainer_vs_sampler_abs"} <= set(m) for m in metrics)


def test_tiny_files_are_gsm8k_format_and_the_reward_reads_their_answers():
  """Each reference is a worked solution ending "#### N": the math reward gives 1 to a boxed N
  and 0 to every other number of the solution; no question is both train and eval."""
  train, held_out = _rows(gsm8k.TINY_TRAIN), _rows(gsm8k.TINY_EVAL)
  assert (len(train), len(held_out)) == (42, 8)
  assert not {r["question"] for r in train} & {r["question"] for r in held_out}
  for row in train + held_out:
    assert set(row) == {"question", "answer"}
    final = row["answer"].rsplit("####", 1)[1].strip()
    assert re.fullmatch(r"-?\d+(\.\d+)?", final), row
    assert score_math(f"So the answer is \\boxed{{{final}}}.", row["answer"]) == 1.0
    for other in set(re.findall(r"\d+(?:\.\d+)?", row["answer"])) - {final}:
      assert score_math(f"\\boxed{{{other}}}", row["answer"]) == 0.0, (other, row)


def _plan(arg: str, topology: str):
  c = gsm8k.get_config(arg)
  c.mesh.topology = topology
  config_lib.validate(c, dry_run=True)
  return plan_lib.make_plan(c)


def test_the_real_config_fits_16_gb_on_one_device():
  """Qwen3-0.6B on one device (h100x1 is the one-device topology the planner knows; the plan's
  bytes per device do not depend on the device's size): under 14.6 GiB, so a 16 GiB TPU v5e
  chip or a 24 GB L4 holds it with float32 master weights; `large` under 37 GiB (an A100 40 GB)."""
  c = gsm8k.get_config()
  assert c.model.preset == "qwen3_0_6b" and abs(param_count(c.model.preset) - 0.60e9) < 0.01e9
  assert c.rl.loss == "oapl" and c.task.name == "math" and c.model.path is None
  with pytest.raises(config_lib.ConfigError, match=r"task\.train_path"):
    config_lib.validate(c)  # the files (or :hub) are the user's to give
  small, large = _plan("", "h100x1"), _plan("large", "h100x1")
  assert small.devices == 1 and small.shared and small.fits
  assert small.total < 14.6 * GiB, small.format()
  assert large.total < 37 * GiB, large.format()
  print(f"\ngsm8k plan per device: {small.total / GiB:.2f} GiB; large: {large.total / GiB:.2f} GiB")


def test_the_dry_run_of_the_real_config_exits_0():
  out = _main("--config=configs/gsm8k.py", "--config.mesh.topology=h100x1", "--dry_run")
  assert out.returncode == 0, out.stderr[-2000:]
  assert "fits" in out.stdout and "DOES NOT FIT" not in out.stdout


def test_variants_and_no_hub_access_unless_asked():
  code = ("import sys; from configs import gsm8k; c = gsm8k.get_config('lag=20'); "
          "print(c.rl.lag, 'huggingface_hub' in sys.modules)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       check=True)
  assert out.stdout.split() == ["20", "False"]
  assert gsm8k.get_config().model.param_dtype == "float32"  # lr-1e-6 updates survive
  assert gsm8k.get_config("large").rl.groups_per_step == 8
  assert gsm8k.get_config("tiny").task.eval_path == gsm8k.TINY_EVAL
  with pytest.raises(ValueError, match="unknown config arg"):
    gsm8k.get_config("hub")


def test_the_fetch_without_the_hub_is_refused_in_one_line():
  env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1")  # no network
  out = subprocess.run([sys.executable, "-m", "configs.gsm8k", "--fetch"], capture_output=True,
                       text=True, cwd=ROOT, env=env, timeout=300)
  assert out.returncode == 2
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and "cannot fetch Qwen/Qwen3-0.6B" in lines[0] and "model.path" in lines[0]


def test_the_task_reads_gsm8k_parquet_files_as_the_hub_ships_them(tiny_qwen3, tmp_path):
  """openai/gsm8k's main/{train,test}-*.parquet hold string columns question and answer: the
  config's task reads such files (here the tiny rows written as Parquet) like the JSONL ones."""
  import pyarrow as pa
  import pyarrow.parquet as pq

  from oapl_jax.tasks.registry import make_task

  c = gsm8k.get_config("tiny")
  c.model.path = tiny_qwen3
  for name, rows in (("train", _rows(gsm8k.TINY_TRAIN)), ("test", _rows(gsm8k.TINY_EVAL))):
    path = tmp_path / f"{name}-00000-of-00001.parquet"
    pq.write_table(pa.table({"question": [r["question"] for r in rows],
                             "answer": [r["answer"] for r in rows]}), path)
    c.task[("eval" if name == "test" else "train") + "_path"] = str(path)
  config_lib.validate(c)
  task, _ = make_task(c)
  assert task.num_train == 42 and len(task.eval_problems()) == 8
  problem = task.eval_problems()[0]
  final = problem.answer.rsplit("####", 1)[1].strip()
  assert task.score(f"\\boxed{{{final}}}", problem) == 1.0 and task.score("\\boxed{-1}", problem) == 0.0
