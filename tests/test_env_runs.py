"""Runs that sample multi-turn trajectories (config.env): the trainer takes them as answers,
window rollouts give the one-rollout run bit for bit, a run resumed inside a window carries on
as the straight one, and a sampler job (remote mode) gives the sync run's losses (issue 61).
The environment is scripted (tests/scripted_env): a random tiny model never writes a
well-formed tool call, and these tests are about the run, not the tool;
tests/test_trajectories.py checks the calculator behind the same interface."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from configs import math as math_config
from oapl_jax import config as config_lib
from oapl_jax import train
from oapl_jax.envs import registry
from oapl_jax.models.tiny_hf import make_tiny_hf

STEPS, LAG = 6, 4
EOS = 2  # the tiny checkpoint's <|im_end|>
SCRIPTED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripted_env")
_spec = importlib.util.spec_from_file_location("scripted_env", os.path.join(SCRIPTED, "sitecustomize.py"))


@pytest.fixture
def scripted_env(monkeypatch):
  """"scripted" in the environment registry for the test (removed after it)."""
  monkeypatch.setitem(registry.ENVS, "scripted", None)  # undone at teardown
  _spec.loader.exec_module(importlib.util.module_from_spec(_spec))  # registers it


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


def test_a_sampler_job_samples_trajectories_as_the_sync_run_does(tiny_qwen3, tmp_path):
  """Remote mode: a reproducible trainer and one sampler job (separate processes, the scripted
  environment registered in both by tests/scripted_env/sitecustomize.py) give the sync run's
  losses and rewards; the rollout files carry the model's-token flags (answer_model)."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": SCRIPTED}
  common = ["--config=configs/math.py:tiny", f"--config.model.path={tiny_qwen3}", "--config.env.name=scripted",
            "--config.sampling.max_new_tokens=48", "--config.log.every=1", "--config.log.progress=False",
            "--config.rl.remote.poll_s=0.1"]

  def run(module, args, name):
    return subprocess.Popen([sys.executable, "-m", module, *common, *args], env=env,
                            stdout=open(tmp_path / f"{name}.log", "w"), stderr=subprocess.STDOUT)

  def wait(proc, name):
    assert proc.wait(timeout=600) == 0, open(tmp_path / f"{name}.log").read()[-3000:]

  wait(run("oapl_jax.main", [f"--workdir={tmp_path / 'sync'}"], "sync"), "sync")
  remote = ["--config.rl.mode=remote", "--config.rl.remote.reproducible=True", f"--workdir={tmp_path / 'remote'}"]
  trainer, sampler = run("oapl_jax.main", remote, "trainer"), run("oapl_jax.sample", remote, "sampler")
  try:
    wait(trainer, "trainer")
    wait(sampler, "sampler")
  finally:  # a failed trainer leaves its sampler waiting for it: not past the test
    for proc in (trainer, sampler):
      if proc.poll() is None:
        proc.kill()
        proc.wait()

  def losses(workdir):
    rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    return [(r["step"], r["loss"], r["reward_mean"]) for r in rows if "loss" in r]
  sync = losses(tmp_path / "sync")
  assert sync and losses(tmp_path / "remote") == sync
  rollout = np.load(sorted((tmp_path / "remote" / "remote" / "rollouts").glob("r*.npz"))[0])
  flags = rollout["answer_model"]
  assert len(flags) == len(rollout["answer_tokens"]) and 0 < flags.sum() < len(flags)


def test_offline_rounds_of_trajectories_are_sampled_checked_and_trained(scripted_env, tiny_qwen3, tmp_path):
  """Offline mode with an environment: the run samples each round's trajectories (round 1 from
  the base, round 2 from round 1's policy), writes them with their model's-token flags and the
  environment in the header, rescores them under those flags (a flag counted wrong fails the
  check), and trains; a round file of single answers is refused for an environment's run."""
  from oapl_jax.rl import offline
  c = _config(tiny_qwen3, 1)
  c.rl.mode = "offline"
  c.rl.offline.update(problems=4, epochs=1, rounds=2, check_rows=8)
  c.rl.lag = 2
  c.train.steps = 4
  config_lib.validate(c)
  summary = train.run(c, str(tmp_path / "run"))
  assert summary["trainer_steps"] == 4
  for r in (1, 2):
    data = offline.read(str(tmp_path / "run" / "offline" / f"round_{r}.npz"))
    flags = data.arrays["answer_model"]
    assert 0 < flags.sum() < len(flags)
    assert data.header["env"]["name"] == "scripted"
  header = dict(data.header)
  del header["env"]
  single = offline.OfflineData(data.path, header, data.arrays)
  with pytest.raises(offline.OfflineFileError, match="sampled without an environment"):
    offline.check_matches(single, c, data.header["model"])
  offline.check_matches(data, c, data.header["model"])


def test_the_bases_cached_evaluation_is_keyed_by_the_environment():
  """A base's "eval before" is cached beside it: with an environment its key holds the
  environment's settings (another turn limit is another evaluation); without one the key is what
  it was before environments existed (the studies' cached evaluations stay valid)."""
  import hashlib

  from oapl_jax import warmup
  from oapl_jax.sampling.rollout import SAMPLING_KEYS
  c = config_lib.repo_config("tools.py:smoke")
  c.warmup.cache_dir = "/tmp/cache"
  paths = {warmup.eval_cache_path(c, 64)}
  c.env.max_turns += 1
  paths.add(warmup.eval_cache_path(c, 64))
  assert len(paths) == 2
  plain = config_lib.repo_config("mix.py:smoke")
  plain.warmup.cache_dir = "/tmp/cache"
  sampling = {k: v for k, v in plain.sampling.to_dict().items()  # a later setting, at its neutral value
              if k != "release_weights"}
  old_key = {"eval": plain.eval.to_dict(), "sampling": sampling, "keys": SAMPLING_KEYS}
  digest = hashlib.sha256(json.dumps(old_key, sort_keys=True, default=str).encode()).hexdigest()[:16]
  assert warmup.eval_cache_path(plain, 64).endswith(f".eval-{digest}.json")
