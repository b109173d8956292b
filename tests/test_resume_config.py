"""A resume is compared with the run's saved config (oapl_jax/run_config.py, issue 59 A4): a
change of what the run is (task, model, base, loss and its settings) is refused in one line
naming each setting with both values, and nothing in the workdir is touched; what may change
(train.steps, lr, lag, logging, ...) is said, one line each. `evaluate` on a workdir of another
task or model is refused the same way; `export --out=<a file>` is refused before any work."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from configs import tiny
from oapl_jax import run_config
from oapl_jax.run_config import RULES, ConfigChanged

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


def _finished_run(workdir: pathlib.Path, config) -> dict[str, bytes]:
  """A workdir as a finished run leaves it (config.json, summary.json, eval_before.json); its
  files' bytes."""
  workdir.mkdir(parents=True)
  run_config.save(config, str(workdir))
  (workdir / "summary.json").write_text(json.dumps({"eval_after": {"pass@1": 0.914}, "config": config.to_dict()}))
  (workdir / "eval_before.json").write_text(json.dumps({"eval": {"pass@1": 0.2}, "warmup": {}}))
  return {p.name: p.read_bytes() for p in workdir.iterdir()}


def test_every_section_of_the_settings_has_a_rule():
  sections = set(tiny.get_config().keys())
  assert sections <= set(RULES), sections - set(RULES)


def test_what_changes_the_run_is_refused_and_what_may_change_is_said(tmp_path):
  run = tiny.get_config("smoke")
  _finished_run(tmp_path / "w", run)
  same = tiny.get_config("smoke")
  assert run_config.check(same, str(tmp_path / "w")) == []
  for setting, value in (("rl.beta2", 0.5), ("rl.loss", "grpo"), ("rl.beta1", 2.0), ("rl.group_size", 4),
                         ("seed", 3), ("model.hidden_size", 64), ("sampling.temperature", 0.7)):
    other = tiny.get_config("smoke")
    section, _, name = setting.rpartition(".")
    (other[section] if section else other)[name] = value
    with pytest.raises(ConfigChanged) as e:
      run_config.check(other, str(tmp_path / "w"))
    was = (run[section] if section else run)[name]
    assert f"config.{setting}={value!r} (the run's: {was!r})" in str(e.value), str(e.value)
    assert "\n" not in str(e.value)
  extended = tiny.get_config("smoke")
  extended.train.steps, extended.train.lr, extended.rl.lag, extended.log.every = 12, 1e-3, 2, 5
  said = run_config.check(extended, str(tmp_path / "w"))
  assert [line.split(" (")[0] for line in said] == [
      "config.rl.lag=2", "config.train.steps=12", "config.train.lr=0.001", "config.log.every=5"], said
  assert all("changed at this resume" in line for line in said)
  evaluating = tiny.get_config("smoke")
  evaluating.rl.beta2, evaluating.eval.samples_per_problem = 0.5, 64  # an evaluation may
  assert run_config.check(evaluating, str(tmp_path / "w"), command="evaluate") == []


def _cmd(module, *args):
  return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                        timeout=600, cwd=ROOT, env=ENV)


def test_a_resume_on_a_finished_run_of_another_task_is_refused_and_overwrites_nothing(tmp_path):
  """The issue's case: configs/reason.py:smoke on a finished tiny run's workdir exited 0 and
  overwrote summary.json (its eval_after lost)."""
  workdir = tmp_path / "w"
  before = _finished_run(workdir, tiny.get_config("smoke"))
  for module in ("oapl_jax.main", "oapl_jax.evaluate"):
    out = _cmd(module, "--config=configs/reason.py:smoke", f"--workdir={workdir}")
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, out.stderr
    assert "config.task.name='chain_addition' (the run's: 'addition')" in errors[0], errors[0]
    assert {p.name: p.read_bytes() for p in workdir.iterdir()} == before  # nothing written
  changed_loss = _cmd("oapl_jax.main", "--config=configs/tiny.py:smoke", f"--workdir={workdir}",
                      "--config.rl.beta2=0.5")
  assert changed_loss.returncode == 2 and "config.rl.beta2=0.5 (the run's: 0.1)" in changed_loss.stderr
  assert {p.name: p.read_bytes() for p in workdir.iterdir()} == before


def test_export_out_an_existing_file_is_one_line_before_any_work(tmp_path):
  workdir = tmp_path / "w"
  _finished_run(workdir, tiny.get_config("smoke"))
  (workdir / "checkpoints" / "6").mkdir(parents=True)  # a checkpoint is there: the out is checked first
  target = tmp_path / "model"
  target.write_text("notes")
  out = _cmd("oapl_jax.export", "--config=configs/tiny.py:smoke", f"--workdir={workdir}", f"--out={target}")
  assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
  assert out.stderr.strip().splitlines()[-1] == (
      f"error: --out={target} is a file, not a folder: give a folder to write into")
  assert target.read_text() == "notes"

