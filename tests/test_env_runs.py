"""Runs that sample multi-turn trajectories (config.env): the trainer takes them as answers,
window rollouts give the one-rollout run bit for bit, and a run resumed inside a window carries
on as the straight one (issue 61). The environment is scripted (registered for the test): a
random tiny model never writes a well-formed tool call, and these tests are about the run, not
the tool; tests/test_trajectories.py checks the calculator behind the same interface."""

import numpy as np
import pytest

from configs import math as math_config
from oapl_jax import config as config_lib
from oapl_jax import train
from oapl_jax.envs import registry
from oapl_jax.envs.base import EnvMetrics, Turn
from oapl_jax.models.tiny_hf import make_tiny_hf

STEPS, LAG = 6, 4
EOS = 2  # the tiny checkpoint's <|im_end|>


class _Episode:
  """Answers the first model turn with a tool message, ends at the second; the score is the
  parity of the final turn's length (rewards that differ within a group)."""

  def __init__(self):
    self.metrics, self.done, self.last = EnvMetrics(), False, ""

  def step(self, text):
    self.metrics.turns += 1
    self.last = text
    if self.metrics.turns == 1:
      self.metrics.tool_calls += 1
      self.metrics.tool_ok += 1
      return Turn([{"role": "tool", "content": "42"}], False)
    self.done = True
    return Turn([], True)

  def score(self):
    return float(len(self.last) % 2)


class _Env:
  tools = []

  def start(self, problem):
    return _Episode()


@pytest.fixture
def scripted_env(monkeypatch):
  monkeypatch.setitem(registry.ENVS, "scripted", lambda env_config, task: _Env())


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
  """The tiny random Qwen3 checkpoint made to end turns within a few tokens (the random
  model's would rarely end one within the budget): every embedding row (tied: the output rows
  too) gets one large shared coordinate, which the hidden states then carry, and the
  end-of-turn token's is larger, so its logit is higher than the others' (turns of ~10 tokens)."""
  from safetensors.numpy import load_file, save_file
  path = make_tiny_hf(str(tmp_path_factory.mktemp("hf") / "tiny_qwen3"), preset="tiny_qwen3")
  weights = load_file(f"{path}/model.safetensors")
  embed = weights["model.embed_tokens.weight"]
  embed[:, 0] = 10.0
  embed[EOS, 0] += 1.0
  save_file(weights, f"{path}/model.safetensors", metadata={"format": "pt"})
  return path


def _config(model_path, k):
  c = math_config.get_config("tiny")
  c.model.path = model_path
  c.env.name = "scripted"
  c.rl.lag, c.rl.window_rollouts = LAG, k
  c.rl.groups_per_step = c.rl.groups_per_rollout = 2
  c.train.steps = STEPS
  c.sampling.max_new_tokens = 48
  config_lib.validate(c)
  return c


def _run(c, workdir) -> train.Run:
  r = train.Run(c, str(workdir))
  if c.warmup.steps:
    r.warm_up()
  r.start_from(r.params)
  return r


def _steps(run, n):
  counts, losses, metrics = [], [], []
  take = run.buffer.take

  def recording_take(num_groups):
    rows = take(num_groups)
    counts.append(rows.rewards.reshape(num_groups, -1).sum(axis=1))
    return rows

  run.buffer.take = recording_take
  for _ in range(n):
    m = run.step()
    losses.append(m["loss"])
    metrics.append(m)
  run.buffer.take = take
  return counts, losses, metrics


def test_window_rollouts_of_trajectories_give_the_one_rollout_run(scripted_env, tiny_qwen3, tmp_path):
  runs = {k: _run(_config(tiny_qwen3, k), tmp_path / f"k{k}") for k in (1, LAG)}
  (c1, l1, m1), (c4, l4, m4) = (_steps(runs[k], STEPS) for k in (1, LAG))
  sampled = [m for m in m1 if "env_episodes" in m]
  assert sampled and all(m["env_tool_calls"] > 0 for m in sampled)
  assert sum(m["env_turns"] for m in sampled) > sum(m["env_episodes_done"] for m in sampled)  # 2 turns each
  assert any(0 < c.sum() < 2 * runs[1].config.rl.group_size for c in c1)
  assert l4 == l1
  for a, b in zip(c1, c4):
    np.testing.assert_array_equal(a, b)
  assert all(np.isfinite(l1))


def test_a_trajectory_run_resumed_inside_a_window_carries_on(scripted_env, tiny_qwen3, tmp_path):
  c = _config(tiny_qwen3, LAG)
  counts, losses, _ = _steps(_run(c, tmp_path / "straight"), STEPS)
  first = _run(c, tmp_path / "resumed")
  _steps(first, 2)
  assert len(first.buffer) == 2 * 2  # the window's two other steps wait on the host
  first.save()
  second = train.Run(c, str(tmp_path / "resumed"))
  assert second.restore_latest()
  more_counts, more_losses, _ = _steps(second, STEPS - 2)
  assert more_losses == losses[2:]
  for a, b in zip(counts[2:], more_counts):
    np.testing.assert_array_equal(a, b)
