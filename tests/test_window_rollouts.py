"""Window rollouts (`rl.window_rollouts` = k): k steps' rollouts sampled in one continuous batch
give the run of k = 1 bit for bit (per-problem counts, losses, weights), with pi_old's
log-probs from the engine (the default) or from the trainer's snapshot, on the tiny and the
reasoning task; a run resumed inside a window carries on as the straight one."""

import jax
import numpy as np
import pytest

from oapl_jax import config as config_lib
from oapl_jax import train, warmup
from oapl_jax.errors import ConfigError
from oapl_jax.placement import seq_len

STEPS, LAG = 8, 4
WARMUP = {"tiny.py:smoke": 300, "reason.py:smoke": 300}  # steps: a base that solves some problems, not all


def _config(name: str, k: int, old_logprobs: str = "snapshot"):
  c = config_lib.repo_config(name)
  c.rl.old_logprobs = old_logprobs
  c.rl.lag, c.rl.window_rollouts = LAG, k
  c.rl.groups_per_step = c.rl.groups_per_rollout = 4
  c.train.steps = STEPS
  c.warmup.steps = WARMUP[name]
  return c


def _run(c, workdir) -> train.Run:
  """A run from the config's warmed-up base (made once per cache_dir), as `train.run` starts one."""
  r = train.Run(c, str(workdir))
  params, _ = warmup.base_model(c, r.graphdef, r.params, r.sampler.task, r.sampler.tokenizer,
                                seq_len=seq_len(c))
  r.start_from(params)
  return r


def _steps(run, n: int) -> tuple[list, list, list]:
  """n steps: each step's per-problem correct counts (its groups' rewards summed), loss, and
  whether it sampled."""
  counts, losses, sampled = [], [], []
  take = run.buffer.take

  def recording_take(num_groups):
    rows = take(num_groups)
    counts.append(rows.rewards.reshape(num_groups, -1).sum(axis=1))
    return rows

  run.buffer.take = recording_take
  for _ in range(n):
    m = run.step()
    losses.append(m["loss"])
    sampled.append("sample_wait_seconds" in m)
  run.buffer.take = take
  return counts, losses, sampled


def _same_tree(a, b) -> bool:
  return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.fixture(scope="module")
def base_dirs(tmp_path_factory):
  return tmp_path_factory.mktemp("bases")  # one warmed-up base per task, shared by the runs


@pytest.mark.parametrize("name, old_logprobs", [  # CI: the tiny task's both ways
    ("tiny.py:smoke", "sampler"), pytest.param("reason.py:smoke", "sampler", marks=pytest.mark.slow),
    ("tiny.py:smoke", "snapshot")])
def test_window_rollouts_give_the_one_rollout_run(name, old_logprobs, tmp_path, base_dirs):
  runs = {}
  for k in (1, 2, LAG):
    c = _config(name, k, old_logprobs)
    c.warmup.cache_dir = str(base_dirs / name.split(".")[0])
    r = _run(c, tmp_path / f"k{k}")
    runs[k] = (r, *_steps(r, STEPS))
  ref, counts, losses, _ = runs[1]
  assert any(c.sum() > 0 for c in counts) and any(c.sum() < 4 * ref.config.rl.group_size for c in counts)
  for k in (2, LAG):
    r, k_counts, k_losses, sampled = runs[k]
    assert sampled == [s % k == 0 for s in range(STEPS)]  # one sampling call per window
    for a, b in zip(counts, k_counts):
      np.testing.assert_array_equal(a, b)
    assert k_losses == losses, (k, k_losses, losses)
    assert _same_tree(r.params, ref.params) and _same_tree(r.snapshot, ref.snapshot)
    assert r.counters.samples_generated == ref.counters.samples_generated
    assert r.counters.groups_dropped == ref.counters.groups_dropped == 0


def test_a_run_resumed_inside_a_window_carries_on(tmp_path):
  c = _config("tiny.py:smoke", LAG)
  c.warmup.cache_dir = str(tmp_path / "base")
  straight = _run(c, tmp_path / "straight")
  counts, losses, _ = _steps(straight, 6)
  first = _run(c, tmp_path / "resumed")
  _steps(first, 2)
  assert len(first.buffer) == 2 * 4  # the window's two other steps wait on the host
  first.save()
  second = train.Run(c, str(tmp_path / "resumed"))
  assert second.restore_latest()
  more_counts, more_losses, sampled = _steps(second, 4)
  assert sampled == [False, False, True, False]  # the rest of the window, then the next one
  assert more_losses == losses[2:]
  for a, b in zip(counts[2:], more_counts):
    np.testing.assert_array_equal(a, b)
  assert _same_tree(second.params, straight.params)


@pytest.mark.parametrize("setting, value, message", [
    ("rl.lag", 6, "must divide rl.lag=6"),
    ("rl.groups_per_rollout", 8, "needs rl.groups_per_rollout == rl.groups_per_step"),
    ("rl.mode", "async", "sync mode only"),
])
def test_window_settings_that_cannot_work_are_refused(setting, value, message):
  c = _config("tiny.py:smoke", LAG)
  if setting == "rl.mode":
    c.rl.old_logprobs = "sampler"
  section, field = setting.split(".")
  c[section][field] = value
  with pytest.raises(ConfigError, match=message):
    config_lib.validate(c)
