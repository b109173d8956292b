"""End to end through `python -m oapl_jax.main`: a reduced tiny run in CI, the full one by hand."""

import json
import os
import subprocess
import sys

import pytest

from oapl_jax import config as config_lib
from oapl_jax import timing
from oapl_jax.aot import model_flops


def _run(workdir, *overrides, config="configs/tiny.py:smoke", timeout=900):
  out = subprocess.run([sys.executable, "-m", "oapl_jax.main", f"--config={config}",
                        f"--workdir={workdir}", *overrides],
                       capture_output=True, text=True, timeout=timeout)
  assert out.returncode == 0, out.stderr[-3000:]
  return out


def test_smoke_run_writes_everything_and_resumes(tmp_path):
  workdir = tmp_path / "run"
  first = _run(workdir, "--config.log.profile_steps=2:3", "--config.eval.every=4")
  summary = json.loads((workdir / "summary.json").read_text())
  for key in ("eval_before", "eval_after"):
    assert {"pass@1", "pass@2", "pass@4"} <= set(summary[key])
    assert all(0 <= summary[key][k] <= 1 for k in ("pass@1", "pass@2", "pass@4"))
  assert summary["trainer_steps"] == 6
  assert summary["samples_generated"] > 0 and summary["train_seconds"] > 0
  assert summary["config"]["rl"]["lag"] == 3
  assert [e["step"] for e in summary["evals_during"]] == [4]
  rows = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == list(range(1, 7))
  for key in ("loss", "reward_mean", "entropy", "answer_length", "ell_abs_mean", "residual_abs_mean",
              "lag_mean", "lag_hist", "samples_generated", "sample_tokens_per_s"):
    assert key in rows[0], key
  assert "engine_mismatch_abs" in rows[0] and rows[0]["engine_mismatch_abs"] < 1e-4
  # where each step's time went (oapl_jax/timing.py): its parts add up to the step
  for r in rows:
    parts = sum(r[k] for k in timing.PARTS)
    # (bookkeeping between the parts: milliseconds, more on a loaded machine)
    assert r["step_seconds"] - max(0.1 * r["step_seconds"], 0.03) <= parts <= r["step_seconds"], (
        r["step"], parts, r["step_seconds"])
    assert all(r[k] >= 0 for k in timing.PARTS) and r["seconds_training"] > 0
    # a CPU has no published peak: its achieved FLOP/s, never an MFU (timing.device_peak)
    assert "mfu" not in r and r["flops_per_s_per_device"] > 0 and r["train_tokens_per_s_per_device"] > 0
    # both rates are the same step's time: FLOPs / positions is the step's (aot.model_flops)
    per_position = r["flops_per_s_per_device"] / r["train_tokens_per_s_per_device"]
    assert per_position == pytest.approx(model_flops(config_lib.repo_config("tiny.py:smoke"))["useful"]
                                         / (4 * 8 * 13), rel=1e-9)
  # the refreshes (lag 3: after steps 3 and 6) and the evaluation (eval.every 4) take time, and
  # are counted where they happen (a zero here is a part lost from the breakdown)
  assert rows[2]["seconds_refreshing"] > 0 and rows[5]["seconds_refreshing"] > 0
  assert "eval" in rows[3] and rows[3]["seconds_evaluating"] > 0
  assert not any("eval" in r for r in rows[:3] + rows[4:])
  took = [r for r in rows if "slot_utilisation" in r]  # the steps that took a rollout
  assert took and all(0 < r["slot_utilisation"] <= 1 and r["answer_tokens_per_s_per_device"] > 0
                      and r["seconds_sampling"] > 0 for r in took)
  assert rows[2]["seconds_profiling"] > 1e-3 > max(rows[0]["seconds_profiling"], rows[3]["seconds_profiling"])
  # the trace of steps 2..3, one file per host, where TensorBoard's profile plugin looks
  traces = list((workdir / "profile" / "plugins" / "profile").glob("*/*.xplane.pb"))
  assert len(traces) == 1 and traces[0].stat().st_size > 0
  assert "profile of steps 2:3" in first.stdout + first.stderr
  assert any(f.startswith("events.out.tfevents") for f in os.listdir(workdir))
  assert sorted(os.listdir(workdir / "checkpoints")) == ["4", "6"]

  again = _run(workdir)  # same workdir: resumes at the last checkpoint, nothing left to train
  assert "resumed from step 6" in again.stdout + again.stderr
  summary2 = json.loads((workdir / "summary.json").read_text())
  assert summary2["trainer_steps"] == 6
  assert summary2["eval_before"] == summary["eval_before"]
  assert len((workdir / "metrics.jsonl").read_text().splitlines()) == 6

  ev = subprocess.run([sys.executable, "-m", "oapl_jax.evaluate", "--config=configs/tiny.py:smoke",
                       f"--workdir={workdir}"], capture_output=True, text=True, timeout=300)
  assert ev.returncode == 0, ev.stderr[-3000:]
  assert json.loads((workdir / "eval_step6.json").read_text()) == {
      "step": 6, "policy": "theta", **summary["eval_after"]}  # same key, same weights: same draws


def test_snapshot_logprob_source_runs(tmp_path):
  _run(tmp_path / "snap", "--config.rl.old_logprobs=snapshot", "--config.train.grad_accum=2")
  rows = [json.loads(l) for l in (tmp_path / "snap" / "metrics.jsonl").read_text().splitlines()]
  assert all(r["snapshot_vs_sampler_abs"] < 1e-4 for r in rows)


def test_a_short_tiny_run_learns(tmp_path):
  """CI's acceptance run, the reduced form of the next test: configs/tiny.py (its warm-up: the
  base at held-out pass@1 ~0.2-0.3) cut to 60 trainer steps (7,680 answers at L = 10). Measured
  (2026-12-06, on 2 cores shared with other work): pass@1 0.310 -> 0.651 (seed 0), 0.270 -> 0.620
  (seed 1, 821 s of wall time, the warm-up 662 s of it); and
  docs/lag_study.md's curves (seeds 0-2) are at 0.5-0.75 by 6,400 answers at L = 10. A trainer
  that does not learn stays within the evaluation's noise (~0.02: 128 problems x 16 answers) of
  its base. The margin, 0.15, lies between."""
  workdir = tmp_path / "run"
  _run(workdir, "--config.train.steps=60", "--config.log.progress=False", config="configs/tiny.py",
       timeout=1800)
  s = json.loads((workdir / "summary.json").read_text())
  before, after = s["eval_before"]["pass@1"], s["eval_after"]["pass@1"]
  assert after >= before + 0.15, (before, after)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_full_tiny_run_improves_pass_at_k(tmp_path, seed):
  """The issue's acceptance run: configs/tiny.py, by hand with `pytest -m slow` (minutes each)."""
  workdir = tmp_path / f"seed{seed}"
  _run(workdir, f"--config.seed={seed}", config="configs/tiny.py", timeout=1800)
  s = json.loads((workdir / "summary.json").read_text())
  before, after = s["eval_before"], s["eval_after"]
  assert after["pass@1"] >= before["pass@1"] + 0.15, (before, after)
  for k in before:
    if k.startswith("pass@"):
      assert after[k] >= before[k], (k, before, after)
  assert s["train_seconds"] <= 600
