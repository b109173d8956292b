"""Remote mode's guarantees, each checked where only that guarantee can catch its loss (issue 59 B):

* a snapshot whose weights were edited and whose zip is whole again (valid CRCs) is refused by
  its sha256 alone;
* a claim in gs:// (Cloud Storage, through the emulator) whose sampler is alive is not taken
  over, a dead one is, and of two samplers taking the same dead claim over only one wins (the
  take-over is a write conditional on the generation read);
* in free mode (`rl.remote.reproducible=False`) a rollout file's rows carry the stamps of the
  snapshot that sampled them, and groups older than `rl.max_lag` are dropped and counted;
* a trainer of two processes beside a sampler job gives the sync run's rewards and losses on a
  base that earns rewards (tiny.py:smoke's own base never does, so rewards written as 0, or a
  process training on the other's share of a file, were invisible or within float noise).
"""

import io
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import start_session
from oapl_jax import config as config_lib
from oapl_jax.models.build import abstract_model, init_model
from oapl_jax.rl import remote
from test_gcs_emulator import BUCKET, REPO, emulator  # noqa: F401 (the emulator fixture, shared)


# --- snapshots: the sha256 ------------------------------------------------------------------------


def _rezip(path: str, edit) -> None:
  """Rewrites the snapshot at `path` as a whole, valid .npz (np.savez: every CRC right) whose
  members are `edit(members)`: only the snapshot's own sha256 can tell it was changed."""
  with np.load(path, allow_pickle=False) as z:
    members = {name: z[name] for name in z.files}
  members = edit(members)
  buf = io.BytesIO()
  np.savez(buf, **members)
  open(path, "wb").write(buf.getvalue())
  with np.load(path, allow_pickle=False) as z:  # the zip itself is sound
    assert sorted(z.files) == sorted(members) and all(np.array_equal(z[k], members[k]) for k in z.files)


def test_a_snapshot_with_edited_weights_in_a_sound_zip_is_refused_by_its_sha256(tmp_path):
  c = config_lib.repo_config("tiny.py:smoke")
  model_cfg, _, params = init_model(c)
  meta = model_cfg.architecture()
  _, _, abstract = abstract_model(c, dtype=jnp.float32)
  path = remote.publish_snapshot(str(tmp_path), params, version=2, snapshot_step=6, model_meta=meta)
  back, _ = remote.read_snapshot(path, abstract, meta)  # as published: read
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back)))

  def one_weight_changed(members):
    leaf = members["leaf0"].copy()
    leaf.flat[0] ^= 1  # the lowest bit of one weight: a value a model could hold
    return {**members, "leaf0": leaf}

  _rezip(path, one_weight_changed)
  with pytest.raises(remote.SnapshotError, match=r"v00000002\.npz: checksum mismatch: the file is damaged"):
    remote.read_snapshot(path, abstract, meta)

  # the header edited instead (another trainer step named), its weights untouched: refused too
  remote.publish_snapshot(str(tmp_path), params, version=2, snapshot_step=6, model_meta=meta)
  _rezip(path, lambda m: {**m, "header": np.array(str(m["header"]).replace('"snapshot_step": 6', '"snapshot_step": 9'))})
  with pytest.raises(remote.SnapshotError, match=r"v00000002\.npz: checksum mismatch: the file is damaged"):
    remote.read_snapshot(path, abstract, meta)


# --- claims in Cloud Storage ----------------------------------------------------------------------

# One sampler's view of rollout 5's claim in gs://, in a process whose gs:// is the emulator.
# A claim record names its owner as remote.owner_id() does (host:pid:nonce).
_CLAIMS = """
import json, socket, subprocess, sys, time
from oapl_jax import storage
from oapl_jax.rl import remote
root, index = sys.argv[1], 5
path = remote.claim_path(root, index)
host = socket.gethostname()
dead = subprocess.Popen([sys.executable, "-c", "pass"]); dead.wait()  # a pid that is gone
said = {}

def put(owner, age):
  storage.remove(path)
  storage.write_text(path, json.dumps({"owner": owner, "time": time.time() - age}))

def owner():
  return json.loads(storage.read_text(path))["owner"]

# a live sampler's fresh claim (this very process): never taken over
put(remote.owner_id(), 1.0)
said["live"] = [remote.claim(root, index, "b", timeout_s=60), owner() != "b"]
# a dead sampler's claim (its pid gone, its record 2 minutes old): taken over, once
put(f"{host}:{dead.pid}:0dead", 120.0)
said["dead"] = [remote.claim(root, index, "b", timeout_s=60), owner()]
said["again"] = remote.claim(root, index, "c", timeout_s=60)  # b's claim is fresh now
# a dead sampler's claim whose rollout is written: nothing left to sample, not claimed
put(f"{host}:{dead.pid}:0dead", 120.0)
storage.write_bytes(remote.rollout_path(root, index), b"written")
said["written"] = [remote.claim(root, index, "b", timeout_s=60), owner()]
storage.remove(remote.rollout_path(root, index))

# two samplers take the same dead claim over: "late" reads it, then "early" takes it over before
# late writes; late's write, conditional on the generation it read, must fail
put(f"{host}:{dead.pid}:0dead", 120.0)
read_generation, raced = storage.read_generation, []
def racing_read(p):
  got = read_generation(p)
  if not raced:
    raced.append(None)  # once: early's own read is a plain one
    raced[0] = remote.claim(root, index, "early", timeout_s=60)
  return got
storage.read_generation = racing_read
said["race"] = [remote.claim(root, index, "late", timeout_s=60), raced, owner()]
print(json.dumps(said))
"""


def test_a_gs_claim_is_taken_over_only_from_a_dead_sampler_and_by_one_taker(emulator, tmp_path):  # noqa: F811
  env, _ = emulator
  root = f"gs://{BUCKET}/claim_guards/{tmp_path.name}/remote"
  out = subprocess.run([sys.executable, "-c", _CLAIMS, root], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=120)
  assert out.returncode == 0, out.stderr[-3000:]
  said = json.loads(out.stdout.strip().splitlines()[-1])
  assert said["live"] == [False, True], said  # alive: refused, its record kept
  assert said["dead"] == [True, "b"], said
  assert said["again"] is False, said
  assert said["written"][0] is False and said["written"][1].endswith(":0dead"), said
  assert said["race"] == [False, [True], "early"], said  # one taker wins, the other is told no


# --- free mode: a rollout's stamps, and rl.max_lag ----------------------------------------------


def test_free_mode_rows_carry_their_files_stamps_and_groups_past_max_lag_are_dropped(tmp_path):
  """Rollouts 0-3 sampled by snapshot version 0 (trainer step 0) before the trainer starts, then
  4-5 by version 1 (published at step 2, lag 2). Each step's lag is the trainer's step minus the
  snapshot step its file names: 0, 1, 2; at step 4 rollout 3 (lag 3 > rl.max_lag=2) is dropped,
  its 4 groups counted, and rollout 4 (lag 1) trained on."""
  from oapl_jax import train  # noqa: PLC0415
  from oapl_jax.rl.sampler_job import SamplerJob  # noqa: PLC0415
  c = config_lib.repo_config("tiny.py:smoke")
  c.warmup.steps = c.warmup.noisy_steps = 0  # the stamps, not the rewards, are what is checked
  c.rl.mode, c.rl.remote.reproducible = "remote", False
  c.rl.lag, c.rl.max_lag, c.rl.groups_per_rollout = 2, 2, c.rl.groups_per_step
  c.rl.remote.poll_s = 0.05
  config_lib.validate(c)
  run = train.Run(c, str(tmp_path))
  run.source._publish()  # version 0, as the first step does
  job = SamplerJob(c, str(tmp_path))
  assert job.serve(max_rollouts=4)["rollouts"] == [0, 1, 2, 3]
  metrics = [run.step() for _ in range(3)]
  assert run.counters.version == 1 and remote.published_versions(job.root) == [0, 1]
  assert job.serve(max_rollouts=2)["rollouts"] == [4, 5]  # the trainer's next is 2: 2 and 3 are written
  metrics.append(run.step())
  g = c.rl.groups_per_step
  got = [(m["lag_mean"], m["groups_dropped_stale"], m["rollouts"]) for m in metrics]
  assert got == [(0.0, 0, 1), (1.0, 0, 2), (2.0, 0, 3), (1.0, g, 5)], got
  assert metrics[-1]["samples_generated"] == 5 * g * c.rl.group_size  # the dropped rollout was taken, then dropped


# --- end to end, on a base that earns rewards ---------------------------------------------------

# tiny.py:smoke on one-digit sums, with a longer warm-up: its base solves about half the problems
# (reward means 0.4-0.7 a step), where smoke's own base solves none (every reward 0).
EARNS = ["--config.task.min_digits=1", "--config.task.max_digits=1", "--config.warmup.steps=100",
         "--config.warmup.noisy_steps=10"]
COMMON = ["--config=configs/tiny.py:smoke", *EARNS, "--config.rl.groups_per_rollout=4", "--config.log.progress=False",
          "--config.log.every=1", "--config.rl.remote.poll_s=0.1"]
def _start(argv, log, env):
  return start_session(argv, cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu", **env}, stdout=open(log, "w"),
                       stderr=subprocess.STDOUT)


def _wait(proc, log, timeout=1200):  # a safety net only: 11 min at a load of 30 on 2 cores
  try:
    rc = proc.wait(timeout=timeout)
  except subprocess.TimeoutExpired:
    raise AssertionError(f"{log} did not end:\n" + open(log).read()[-3000:]) from None
  assert rc == 0, open(log).read()[-3000:]


def _steps(metrics_path):
  return [(r["step"], r["reward_mean"], r["loss"], r["policy_version"])
          for r in map(json.loads, open(metrics_path))]


def test_a_two_process_trainer_beside_a_sampler_job_gives_the_sync_runs_rewards_and_losses(tmp_path):
  """launch/local_multihost.sh 2 in remote mode (each process trains on its share of every
  rollout file's groups) beside one sampler job, vs one sync process with the same two engine
  replicas, from a base that earns rewards: every step's reward mean is the sync run's, exactly
  (so rewards written as 0, or a process's share taken twice, show at once), and every loss
  within 1e-4 of it, relatively (the multi-host step's float differences are about 1e-7)."""
  warm = [f"--config.warmup.cache_dir={tmp_path / 'warm'}"]
  two = {"JAX_NUM_CPU_DEVICES": "2"}
  sync = tmp_path / "sync"
  _wait(_start([sys.executable, "-m", "oapl_jax.main", *COMMON, *warm, "--config.sampling.engines=2",
                f"--workdir={sync}"], tmp_path / "sync.log", two), tmp_path / "sync.log")
  want = _steps(sync / "metrics.jsonl")
  assert all(0.2 <= r <= 0.9 for _, r, _, _ in want), want  # the base earns rewards, and not every one
  workdir = tmp_path / "remote"
  args = [*COMMON[1:], *warm, "--config.rl.mode=remote", "--config.rl.remote.reproducible=True",
          f"--workdir={workdir}"]
  trainer = _start(["bash", os.path.join(REPO, "launch", "local_multihost.sh"), "2", "configs/tiny.py:smoke", *args],
                   tmp_path / "trainer.log", {"PYTHON": sys.executable})
  sampler = _start([sys.executable, "-m", "oapl_jax.sample", COMMON[0], *args, "--config.sampling.engines=2"],
                   tmp_path / "sampler.log", two)
  _wait(trainer, tmp_path / "trainer.log")
  _wait(sampler, tmp_path / "sampler.log")
  got = _steps(workdir / "metrics.jsonl")
  assert [(s, r, v) for s, r, _, v in got] == [(s, r, v) for s, r, _, v in want], (got, want)
  worst = max(abs(a[2] - b[2]) / max(abs(b[2]), 1e-3) for a, b in zip(got, want))
  assert worst <= 1e-4, (worst, got, want)
  summary, ref = (json.load(open(w / "summary.json")) for w in (workdir, sync))
  assert summary["eval_after"]["correct_per_problem"] == ref["eval_after"]["correct_per_problem"]
