"""The loop, async mode and the command line with temperature != 1, top-k and top-p all on.

The log-prob contract (docs/algorithm.md) says the trainer scores tokens under the distribution the
engine sampled from; with processed logits a mismatch would show as a non-zero
`engine_mismatch_abs` at lag-0 steps, where pi_theta == pi_old.
"""

import json
import subprocess
import sys

import pytest

from oapl_jax import train

PROCESSED = {"temperature": 0.7, "top_k": 5, "top_p": 0.9}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_loop_with_processed_sampling_keeps_the_contract_and_reproduces(smoke_config, tmp_path, mode):
  c = smoke_config
  c.sampling.update(PROCESSED)
  c.rl.mode, c.rl.lag, c.rl.groups_per_step, c.rl.groups_per_rollout = mode, 2, 2, 3
  runs = [train.Run(c, str(tmp_path / name)) for name in ("a", "b")]
  metrics = [[r.step() for _ in range(4)] for r in runs]
  for r in runs:
    r.close()
  lag0 = [m for m in metrics[0] if "engine_mismatch_abs" in m]
  assert lag0 and all(m["engine_mismatch_abs"] < 1e-5 for m in lag0)
  assert [m["reward_mean"] for m in metrics[0]] == [m["reward_mean"] for m in metrics[1]]
  assert [m["loss"] for m in metrics[0]] == [m["loss"] for m in metrics[1]]


def test_command_line_run_with_processed_sampling(tmp_path):
  overrides = [f"--config.sampling.{k}={v}" for k, v in PROCESSED.items()]
  out = subprocess.run([sys.executable, "-m", "oapl_jax.main", "--config=configs/tiny.py:smoke",
                        f"--workdir={tmp_path}", "--config.log.progress=False", *overrides],
                       capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stderr[-3000:]
  rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert len(rows) == 6 and all(r["step_skipped"] == 0.0 for r in rows)
  assert all(r["engine_mismatch_abs"] < 1e-4 for r in rows if "engine_mismatch_abs" in r)
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["config"]["sampling"]["top_k"] == 5
