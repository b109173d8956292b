"""The lagged loop: exact refresh every L steps, buffer emptied, reproducible, exact resume."""

import fcntl
import os
import threading
import time

import jax
import numpy as np

from oapl_jax import train


def _leaves_equal(a, b):
  return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_snapshot_refreshes_exactly_every_lag_steps(smoke_config, tmp_path):
  c = smoke_config
  c.rl.lag, c.train.steps = 3, 7
  c.rl.groups_per_step, c.rl.groups_per_rollout = 2, 5  # leftovers stay in the buffer
  r = train.Run(c, str(tmp_path))
  versions, lags = [], []
  for step in range(1, 8):
    before = len(r.buffer)
    m = r.step()
    versions.append(r.counters.version)
    lags.append(m["lag_mean"])
    assert set(int(k) for k in m["lag_hist"]) <= set(range(c.rl.lag))
    if step % 3 == 0:
      assert len(r.buffer) == 0  # emptied at the refresh
      assert r.counters.snapshot_step == step
      assert _leaves_equal(r.snapshot, r.params)  # pi_old <- pi_theta
    else:
      assert not _leaves_equal(r.snapshot, r.params)
  assert versions == [0, 0, 1, 1, 1, 2, 2]
  assert lags == [0, 1, 2, 0, 1, 2, 0]
  assert r.counters.groups_dropped > 0  # leftovers of a window were dropped, not reused later


def test_same_seed_same_run(smoke_config, tmp_path):
  def three_steps(d):
    r = train.Run(smoke_config, str(d))
    rewards = [r.step()["reward_mean"] for _ in range(3)]
    return rewards, r.params

  (ra, pa), (rb, pb) = three_steps(tmp_path / "a"), three_steps(tmp_path / "b")
  assert ra == rb
  assert _leaves_equal(pa, pb)


def test_resume_continues_the_same_run(smoke_config, tmp_path):
  c = smoke_config
  c.rl.lag = 4
  c.rl.groups_per_step, c.rl.groups_per_rollout = 2, 5
  straight = train.Run(c, str(tmp_path / "straight"))
  for _ in range(6):
    straight.step()

  first = train.Run(c, str(tmp_path / "resumed"))
  for _ in range(3):
    first.step()
  assert len(first.buffer) > 0  # the checkpoint must carry a non-empty buffer
  first.save()
  second = train.Run(c, str(tmp_path / "resumed"))
  assert second.restore_latest()
  assert second.counters.step == 3
  for _ in range(3):
    second.step()
  assert second.counters == straight.counters.__class__(**{
      **straight.counters.__dict__, "train_seconds": second.counters.train_seconds})
  assert _leaves_equal(second.params, straight.params)
  assert _leaves_equal(second.snapshot, straight.snapshot)


def test_checkpoint_of_another_model_is_refused(smoke_config, tmp_path):
  r = train.Run(smoke_config, str(tmp_path))
  r.save()
  other = smoke_config
  other.model.hidden_size = 64
  r2 = train.Run(other, str(tmp_path))
  try:
    r2.restore_latest()
  except ValueError as e:
    assert "another model" in str(e) and "hidden_size" in str(e)
    # the differing fields are named, not two whole records printed
    assert "config.model.hidden_size=64 (the checkpoint's: 128)" in str(e), str(e)
    assert "num_layers" not in str(e) and "\n" not in str(e)
  else:
    raise AssertionError("restoring a checkpoint of another architecture did not fail")


def test_warmup_cache_shares_one_base_model(smoke_config, tmp_path, capsys):
  """Runs that differ only in RL settings read the same warmed-up base, and its eval before,
  from the cache; the cached evaluation is what a fresh one of that base gives."""
  c = smoke_config
  c.warmup.cache_dir = str(tmp_path / "cache")
  c.train.steps = 1
  first = train.run(c, str(tmp_path / "a"))
  evals = list((tmp_path / "cache").glob("*.eval-*.json"))
  assert len(evals) == 1
  evals[0].unlink()  # the next run evaluates the cached base afresh (and caches it again)
  c.rl.loss = "grpo"  # an RL setting: same base
  second = train.run(c, str(tmp_path / "b"))
  assert "cached" not in first["warmup"] and second["warmup"]["cached"].startswith(str(tmp_path))
  assert first["eval_before"] == second["eval_before"]
  capsys.readouterr()
  c.rl.lag = 1  # another RL setting: the evaluation is read
  assert train.run(c, str(tmp_path / "b2"))["eval_before"] == first["eval_before"]
  assert "eval before: read from" in capsys.readouterr().out
  c.eval.samples_per_problem *= 2  # an eval setting: same base, evaluated again
  assert "eval before: read from" not in (train.run(c, str(tmp_path / "b3")), capsys.readouterr().out)[1]
  c.warmup.digit_noise = 0.1  # a warm-up setting: another base
  third = train.run(c, str(tmp_path / "c"))
  assert "cached" not in third["warmup"]
  assert len([p for p in (tmp_path / "cache").iterdir() if p.is_dir()]) == 2
  assert len(list((tmp_path / "cache").glob("*.eval-*.json"))) == 3


def test_a_run_waits_for_another_building_the_same_base_and_reads_it(smoke_config, tmp_path, capsys):
  """Two runs that need the same uncached base at once (a study's two halves) build it once: the
  second waits on the builder's `<cache>.lock` and then reads the cache instead of building too."""
  c = smoke_config
  c.warmup.cache_dir = str(tmp_path / "cache")
  c.train.steps = 1
  train.run(c, str(tmp_path / "a"))  # makes the cache, then hides it: a base "being built"
  (base,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
  os.rename(base, f"{base}.aside")
  fd = os.open(f"{base}.lock", os.O_RDWR | os.O_CREAT)
  fcntl.flock(fd, fcntl.LOCK_EX)  # this test is the builder
  capsys.readouterr()
  out, second = [], {}
  t = threading.Thread(target=lambda: second.update(train.run(c, str(tmp_path / "b"))))
  t.start()
  deadline = time.monotonic() + 120
  while not any("waiting for it" in o for o in out) and t.is_alive() and time.monotonic() < deadline:
    time.sleep(0.2)
    out.append(capsys.readouterr().out)
  assert t.is_alive() and any("another run is building this base" in o for o in out), out
  os.rename(f"{base}.aside", base)  # the builder's cache lands, then it lets go
  os.close(fd)
  t.join(timeout=300)
  assert second["warmup"]["cached"] == str(base)
