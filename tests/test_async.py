"""rl.mode = "async": the next rollout samples while the trainer trains; stale samples are used.

In this process JAX has one device, so the rollout thread shares it with the trainer (the
overlap across devices is checked in tests/test_parallel_rollout.py's two-device child).
"""

import jax
import numpy as np
import pytest

from oapl_jax import config as config_lib
from oapl_jax import train


def _async(c):
  c.rl.mode = "async"
  c.rl.lag, c.rl.groups_per_step, c.rl.groups_per_rollout = 3, 2, 3
  return c


def _same(a, b):
  return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _steps(run, n):
  return [run.step() for _ in range(n)]


def test_async_is_reproducible_and_uses_stale_samples(smoke_config, tmp_path):
  c = _async(smoke_config)
  a, b = train.Run(c, str(tmp_path / "a")), train.Run(c, str(tmp_path / "b"))
  ma, mb = _steps(a, 7), _steps(b, 7)
  assert [m["reward_mean"] for m in ma] == [m["reward_mean"] for m in mb]
  assert [m["lag_hist"] for m in ma] == [m["lag_hist"] for m in mb]
  assert _same(a.params, b.params)
  # Rollouts: 3 groups each, 2 used per step. A rollout launched before a refresh lands after it:
  # its answers are used (not dropped) at lags >= L, stamped with the old version.
  lags = sorted({int(k) for m in ma for k in m["lag_hist"]})
  assert max(lags) >= c.rl.lag, lags
  assert a.counters.version == 2
  assert ma[0]["engine_mismatch_abs"] < 1e-5  # the log-prob contract, sampled in the thread
  assert "sample_tokens_per_s" not in ma[0] and "sample_wait_seconds" in ma[0]
  a.close()
  b.close()


def test_async_resumes_exactly_with_the_rollout_in_flight(smoke_config, tmp_path):
  c = _async(smoke_config)
  straight = train.Run(c, str(tmp_path / "straight"))
  want = _steps(straight, 6)
  first = train.Run(c, str(tmp_path / "resumed"))
  _steps(first, 3)
  assert first.source.pending() is not None
  first.save()  # waits for the rollout in flight and stores it
  first.close()
  second = train.Run(c, str(tmp_path / "resumed"))
  assert second.restore_latest() and second.source.pending() is not None
  got = _steps(second, 3)
  assert [m["lag_hist"] for m in got] == [m["lag_hist"] for m in want[3:]]
  assert [m["reward_mean"] for m in got] == [m["reward_mean"] for m in want[3:]]
  assert second.counters.rollouts == straight.counters.rollouts
  assert _same(second.params, straight.params) and _same(second.snapshot, straight.snapshot)
  straight.close()
  second.close()


def test_async_full_run_writes_its_summary(smoke_config, tmp_path):
  summary = train.run(_async(smoke_config), str(tmp_path))
  assert summary["trainer_steps"] == smoke_config.train.steps
  assert summary["samples_generated"] > 0


@pytest.mark.parametrize("change", [{"loss": "grpo"}, {"old_logprobs": "snapshot"}])
def test_async_refuses_losses_that_need_the_sampling_snapshot(smoke_config, change):
  c = _async(smoke_config)
  c.rl.update(change)
  with pytest.raises(config_lib.ConfigError, match="rl.mode"):
    config_lib.validate(c)
