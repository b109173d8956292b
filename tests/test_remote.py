"""Remote mode (issue 43): a trainer and sampler jobs joined through the workdir.

The end-to-end tests run the real commands as separate processes (`python -m oapl_jax.main`
and `python -m oapl_jax.sample`) on one machine, sharing a local folder or the fake bucket
(tests/fake_bucket), and kill some of them."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import start_session
from oapl_jax import config as config_lib
from oapl_jax import storage
from oapl_jax.models.build import abstract_model, init_model
from oapl_jax.rl import remote

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAKE = os.path.join(REPO, "tests", "fake_bucket")
_spec = importlib.util.spec_from_file_location("fake_bucket", os.path.join(FAKE, "sitecustomize.py"))
fake_bucket = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fake_bucket)

COMMON = ["--config=configs/tiny.py:smoke", "--config.rl.groups_per_rollout=4", "--config.log.progress=False",
          "--config.log.every=1", "--config.rl.remote.poll_s=0.1"]


# --- the files ----------------------------------------------------------------------------------


def _config():
  c = config_lib.repo_config("tiny.py:smoke")
  c.model.dtype = "bfloat16"
  return c


def test_a_snapshot_reads_back_bit_for_bit_and_a_damaged_or_foreign_one_is_refused(tmp_path):
  c = _config()
  model_cfg, _, params = init_model(c)
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  root = str(tmp_path)
  path = remote.publish_snapshot(root, params, version=3, snapshot_step=30, model_meta=model_cfg.architecture())
  assert remote.published_versions(root) == [3]
  _, _, abstract = abstract_model(c, dtype=jnp.bfloat16)
  back, header = remote.read_snapshot(path, abstract, model_cfg.architecture())
  assert header["version"] == 3 and header["snapshot_step"] == 30
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back)):
    assert b.dtype == jnp.bfloat16 and np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
  # another model's: refused, naming the file
  other = {**model_cfg.architecture(), "num_layers": 7}
  with pytest.raises(remote.SnapshotError, match="v00000003.npz: written for another model"):
    remote.read_snapshot(path, abstract, other)
  # one flipped byte in a weight: refused by its checksum (or as unreadable, if it hit the zip's own)
  data = bytearray(open(path, "rb").read())
  data[len(data) // 2] ^= 0xFF
  open(path, "wb").write(bytes(data))
  with pytest.raises(remote.SnapshotError, match="checksum mismatch|unreadable"):
    remote.read_snapshot(path, abstract, model_cfg.architecture())
  # half a file (a copy cut short) is unreadable, and says so
  open(path, "wb").write(bytes(data[:len(data) // 3]))
  with pytest.raises(remote.SnapshotError, match="unreadable"):
    remote.read_snapshot(path, abstract, model_cfg.architecture())


def test_a_sampler_job_refuses_a_damaged_snapshot_in_one_line_and_samples_with_the_one_it_holds(tmp_path, capsys):
  from oapl_jax.rl import offline  # noqa: PLC0415
  from oapl_jax.rl.sampler_job import SamplerJob  # noqa: PLC0415
  c = config_lib.repo_config("tiny.py:smoke")
  c.rl.mode, c.rl.groups_per_rollout = "remote", c.rl.groups_per_step
  config_lib.validate(c)
  job = SamplerJob(c, str(tmp_path))
  _, _, params = init_model(c)
  for version in (0, 1):
    remote.publish_snapshot(job.root, params, version=version, snapshot_step=3 * version, model_meta=job.meta)
  assert job._load(0)
  path = remote.snapshot_path(job.root, 1)
  data = bytearray(open(path, "rb").read())
  data[len(data) // 2] ^= 0xFF
  open(path, "wb").write(bytes(data))
  capsys.readouterr()
  assert not job._load(1)
  lines = capsys.readouterr().out.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(f"sampler: snapshot {path}: ") and lines[0].endswith("; keeping version 0")
  assert job.loaded.version == 0 and job.damaged == {1}
  remote.write_status(job.root, {"next_rollout": 0, "version": 1, "step": 3, "done": False})
  out = job.serve(max_rollouts=1)  # the newest good snapshot: version 0
  assert out["rollouts"] == [0]
  written = offline.read(remote.rollout_path(job.root, 0))
  assert written.header["policy"]["version"] == 0 and written.header["rollout"] == 0 and written.groups == c.rl.groups_per_rollout


def test_the_trainer_rescores_a_samplers_first_rollout_and_refuses_other_log_probs(tmp_path):
  from oapl_jax import train  # noqa: PLC0415
  from oapl_jax.rl import offline  # noqa: PLC0415
  from oapl_jax.rl.sampler_job import SamplerJob  # noqa: PLC0415
  c = config_lib.repo_config("tiny.py:smoke")
  c.rl.mode, c.rl.groups_per_rollout, c.rl.remote.max_rejections = "remote", c.rl.groups_per_step, 1
  config_lib.validate(c)
  run = train.Run(c, str(tmp_path))
  run.source._publish()  # version 0, as the first step does
  SamplerJob(c, str(tmp_path)).serve(max_rollouts=1)
  path = remote.rollout_path(run.source.root, 0)
  good = offline.read(path)
  header = {k: v for k, v in good.header.items() if k != "format"}
  # another policy's log-probs (the tokens unchanged): a sampler job with other weights
  offline.write(path, header, {**good.arrays, "answer_logprobs": good.arrays["answer_logprobs"] - 0.5})
  with pytest.raises(offline.OfflineFileError, match=r"rollout 0 refused 1 times \(rl.remote.max_rejections\); "
                     r"the last: offline file .*r000000000.npz: its log-probs are not those of this run's pi_old"):
    run.source.next(None)
  offline.write(path, header, good.arrays)
  drawn = run.source.next(None)
  assert len(drawn.rows) == c.rl.groups_per_rollout * c.rl.group_size and run.counters.rollouts == 1
  assert run.source._checked == {(good.header["policy"]["source"], 0)}


def test_of_two_claims_one_wins_and_a_dead_samplers_claim_is_taken_over(tmp_path):
  root = str(tmp_path)
  assert remote.claim(root, 5, "a", timeout_s=60)
  assert not remote.claim(root, 5, "b", timeout_s=60)
  assert remote.claimed(root, 5, timeout_s=60)
  old = time.time() - 120
  os.utime(remote.claim_path(root, 5), (old, old))  # its sampler died two minutes ago
  assert not remote.claimed(root, 5, timeout_s=60)
  assert remote.claim(root, 5, "b", timeout_s=60)
  assert json.loads(open(remote.claim_path(root, 5)).read())["owner"] == "b"
  remote.release(root, 5)
  assert not remote.claimed(root, 5, timeout_s=60)


def test_settings_remote_mode_refuses():
  c = config_lib.repo_config("tiny.py:smoke")
  c.rl.mode, c.rl.remote.reproducible = "remote", True  # groups_per_rollout 6, per step 4
  with pytest.raises(config_lib.ConfigError, match="rl.remote.reproducible=True: needs rl.groups_per_rollout == rl.groups_per_step"):
    config_lib.validate(c)
  c.rl.groups_per_rollout = c.rl.groups_per_step
  config_lib.validate(c)
  c.rl.loss = "grpo"
  config_lib.validate(c)  # reproducible: the sync run's rollouts, so any loss
  c.rl.remote.reproducible = False
  with pytest.raises(config_lib.ConfigError, match="rl.mode='remote': remote needs rl.loss='oapl'"):
    config_lib.validate(c)


def test_a_sampler_job_of_a_run_not_in_remote_mode_is_one_line_and_exit_2(tmp_path):
  p = subprocess.run([sys.executable, "-m", "oapl_jax.sample", "--config=configs/tiny.py:smoke",
                      f"--workdir={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=120)
  assert p.returncode == 2, p.stderr
  assert p.stderr.strip().splitlines() == [
      "error: config.rl.mode='sync': a sampler job serves a trainer with rl.mode='remote' (give it the trainer's settings)"]


# --- end to end ---------------------------------------------------------------------------------


def _env(bucket=None):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  if bucket is not None:
    env |= {fake_bucket.ROOT_VAR: str(bucket), "PYTHONPATH": FAKE}
  return env


def _start(module, args, log, env):
  return start_session([sys.executable, "-m", module, *args], cwd=REPO, env=env, stdout=open(log, "w"),
                       stderr=subprocess.STDOUT)


def _losses(metrics_path):
  rows = [json.loads(line) for line in open(metrics_path)]
  return [(r["step"], r["loss"], r["reward_mean"], r["policy_version"]) for r in rows]


def _wait(proc, log, timeout=420):
  try:
    rc = proc.wait(timeout=timeout)
  except subprocess.TimeoutExpired:
    proc.kill()
    raise AssertionError(f"{log} did not end:\n" + open(log).read()[-3000:])
  assert rc == 0, open(log).read()[-3000:]


@pytest.mark.parametrize("where", ["local", "bucket"])
def test_one_reproducible_sampler_job_gives_the_sync_runs_losses_bit_for_bit(tmp_path, where):
  warm = [f"--config.warmup.cache_dir={tmp_path / 'warm'}"]
  sync = tmp_path / "sync"
  p = _start("oapl_jax.main", [*COMMON, *warm, f"--workdir={sync}"], tmp_path / "sync.log", _env())
  _wait(p, tmp_path / "sync.log")
  bucket = tmp_path / "bucket" if where == "bucket" else None
  workdir = "gs://bkt/remote" if bucket else str(tmp_path / "remote")
  args = [*COMMON, *warm, "--config.rl.mode=remote", "--config.rl.remote.reproducible=True", f"--workdir={workdir}"]
  local = ([f"--config.checkpoint.directory={tmp_path / 'ckpt'}"] if bucket else [])  # orbax: local (tests/fake_bucket)
  files = (bucket / "bkt" / "remote") if bucket else (tmp_path / "remote")
  # before any sampler: a damaged rollout 0 (someone's bad copy) and half of rollout 1 under the
  # name a writer uses before its rename (a sampler killed mid-write)
  (files / "remote" / "rollouts").mkdir(parents=True)
  (files / "remote" / "rollouts" / "r000000000.npz").write_bytes(b"PK\x03\x04 not a whole file")
  (files / "remote" / "rollouts" / "r000000001.npz.4242.tmp").write_bytes(b"PK\x03\x04 half")
  trainer = _start("oapl_jax.main", [*args, *local], tmp_path / "trainer.log", _env(bucket))
  sampler = _start("oapl_jax.sample", args, tmp_path / "sampler.log", _env(bucket))
  _wait(trainer, tmp_path / "trainer.log")
  _wait(sampler, tmp_path / "sampler.log")  # it stops by itself: the run is done
  assert "the trainer marked its run done" in open(tmp_path / "sampler.log").read()
  said = [line for line in open(tmp_path / "trainer.log") if "set aside" in line]
  assert len(said) == 1 and said[0].startswith("rollout 0 set aside, to be sampled again: offline file ")
  assert "unreadable" in said[0] and (files / "remote" / "rollouts" / "r000000000.npz.rejected").exists()
  metrics = files / "metrics.jsonl"
  assert _losses(metrics) == _losses(sync / "metrics.jsonl")  # rollout 0 sampled again, the same
  assert [v for *_, v in _losses(metrics)] == [0, 0, 0, 1, 1, 1]  # lag 3: a refresh was crossed


def test_a_trainer_of_two_processes_with_one_sampler_job_gives_the_sync_runs_losses(tmp_path):
  """launch/local_multihost.sh 2 in remote mode (each process trains on its share of every
  rollout file's groups) beside one sampler job, vs one sync process with the same two engine
  replicas: the same losses, rewards and rollouts; a damaged rollout 0 is set aside once, by
  process 0 (the processes agree on it); snapshots published once each, from process 0."""
  warm = [f"--config.warmup.cache_dir={tmp_path / 'warm'}"]
  sync = tmp_path / "sync"
  p = _start("oapl_jax.main", [*COMMON, *warm, "--config.sampling.engines=2", f"--workdir={sync}"],
             tmp_path / "sync.log", {**_env(), "JAX_NUM_CPU_DEVICES": "2"})
  _wait(p, tmp_path / "sync.log")
  workdir = tmp_path / "remote"
  args = [*COMMON, *warm, "--config.rl.mode=remote", "--config.rl.remote.reproducible=True", f"--workdir={workdir}"]
  (workdir / "remote" / "rollouts").mkdir(parents=True)
  (workdir / "remote" / "rollouts" / "r000000000.npz").write_bytes(b"PK\x03\x04 not a whole file")
  assert args[0] == "--config=configs/tiny.py:smoke"  # the launcher takes the config bare
  trainer = start_session(["bash", os.path.join(REPO, "launch", "local_multihost.sh"), "2", "configs/tiny.py:smoke",
                          *args[1:]], cwd=REPO,
                         env={**_env(), "PYTHON": sys.executable}, stdout=open(tmp_path / "trainer.log", "w"),
                         stderr=subprocess.STDOUT)
  sampler = _start("oapl_jax.sample", [*args, "--config.sampling.engines=2"], tmp_path / "sampler.log",
                   {**_env(), "JAX_NUM_CPU_DEVICES": "2"})
  _wait(trainer, tmp_path / "trainer.log")
  _wait(sampler, tmp_path / "sampler.log")
  logs = [open(workdir / "logs" / f"process_{i}.log").read() for i in range(2)]
  assert [line for line in logs[0].splitlines() if "set aside" in line] == [
      f"rollout 0 set aside, to be sampled again: offline file {workdir}/remote/rollouts/r000000000.npz: unreadable: "
      "truncated, corrupted or not an .npz file (BadZipFile: File is not a zip file)"]
  assert "set aside" not in logs[1]
  got, want = _losses(workdir / "metrics.jsonl"), _losses(sync / "metrics.jsonl")
  assert [(s, r, v) for s, _, r, v in got] == [(s, r, v) for s, _, r, v in want]
  assert max(abs(a[1] - b[1]) for a, b in zip(got, want)) <= 1e-5  # the multi-host step's tolerance (test_multihost)
  summary, ref = (json.load(open(w / "summary.json")) for w in (workdir, sync))
  assert summary["samples_generated"] == ref["samples_generated"]
  assert summary["eval_after"]["correct_per_problem"] == ref["eval_after"]["correct_per_problem"]
  assert sorted(os.listdir(workdir / "remote" / "snapshots")) == ["v00000000.npz", "v00000001.npz"]


def _claim_of(root, pid):
  """The rollout a sampler process `pid` is sampling now (its claim), or None."""
  for name in storage.listdir(os.path.join(root, "claims")):
    try:
      if f":{pid}:" in json.loads(open(os.path.join(root, "claims", name)).read())["owner"]:
        return name
    except (FileNotFoundError, json.JSONDecodeError):
      pass
  return None


@pytest.mark.parametrize("where", ["local", "bucket"])
def test_two_sampler_jobs_one_killed_mid_rollout_then_the_trainer_killed_every_group_used_once(tmp_path, where):
  c = config_lib.repo_config("tiny.py:smoke")
  steps, gps, g = 10, c.rl.groups_per_step, c.rl.group_size
  bucket = tmp_path / "bucket" if where == "bucket" else None
  workdir = (bucket / "bkt" / "run") if bucket else (tmp_path / "run")  # where its files land
  args = [*COMMON, f"--config.warmup.cache_dir={tmp_path / 'warm'}", f"--config.train.steps={steps}",
          "--config.checkpoint.every=2", "--config.rl.mode=remote", "--config.rl.remote.claim_timeout_s=5",
          "--config.rl.remote.ahead=3", f"--workdir={'gs://bkt/run' if bucket else workdir}"]
  if bucket:
    args.append(f"--config.checkpoint.directory={tmp_path / 'ckpt'}")  # orbax: local (tests/fake_bucket)
  root = str(workdir / "remote")
  trainer = _start("oapl_jax.main", args, tmp_path / "trainer1.log", _env(bucket))
  a = _start("oapl_jax.sample", args, tmp_path / "a.log", _env(bucket))
  b = _start("oapl_jax.sample", args, tmp_path / "b.log", _env(bucket))
  # b killed while it holds a claim: in the middle of a rollout (its file never appears whole)
  deadline = time.time() + 300
  while _claim_of(root, b.pid) is None or "rollout" not in open(tmp_path / "b.log").read():
    assert time.time() < deadline and b.poll() is None, open(tmp_path / "b.log").read()[-2000:]
    time.sleep(0.05)
  os.killpg(b.pid, signal.SIGKILL)
  b.wait()
  # the trainer killed (no clean stop) once it has checkpointed step 4
  metrics = workdir / "metrics.jsonl"
  while not (metrics.exists() and any(json.loads(line)["step"] >= 5 for line in open(metrics))):
    assert time.time() < deadline and trainer.poll() is None, open(tmp_path / "trainer1.log").read()[-2000:]
    time.sleep(0.1)
  os.killpg(trainer.pid, signal.SIGKILL)
  trainer.wait()
  trainer = _start("oapl_jax.main", args, tmp_path / "trainer2.log", _env(bucket))
  _wait(trainer, tmp_path / "trainer2.log")
  _wait(a, tmp_path / "a.log")
  log = open(tmp_path / "trainer2.log").read()
  assert "resumed from step" in log
  summary = json.load(open(workdir / "summary.json"))
  # every step took one rollout of gps groups x G answers: nothing read twice, nothing lost
  assert summary["trainer_steps"] == steps and summary["samples_generated"] == steps * gps * g
  rows = [json.loads(line) for line in open(metrics)]
  last = {r["step"]: r for r in rows}  # the killed start's steps after its checkpoint were redone
  assert sorted(last) == list(range(1, steps + 1))
  # step s took rollout s - 1, whichever start took it: each rollout once, in order, none skipped
  assert all(last[s]["rollouts"] == s and last[s]["samples_generated"] == s * gps * g for s in last)
  assert not [n for n in os.listdir(os.path.join(root, "rollouts")) if ".tmp" in n]  # no half file left visible


def test_a_sampler_jobs_dry_run_plans_its_engines_on_its_own_topology():
  base = [sys.executable, "-m", "oapl_jax.sample", "--config=configs/math.py", "--config.rl.mode=remote",
          "--config.rl.window_rollouts=1", "--config.mesh.topology=v6e-8", "--config.sampling.tensor=4",
          "--config.sampling.engines=2", "--dry_run"]
  fits = subprocess.run([*base, "--config.sampling.max_slots=48"], cwd=REPO, capture_output=True, text=True, timeout=120)
  assert fits.returncode == 0, fits.stderr
  assert fits.stdout.startswith("memory plan per device of a sampler job (rl.mode=remote): v6e-8 (8 devices); "
                                "2 engine(s) x tensor 4; no trainer")
  assert "master weights" not in fits.stdout and "KV cache" in fits.stdout and "fits" in fits.stdout
  full = subprocess.run(base, cwd=REPO, capture_output=True, text=True, timeout=120)  # math.py's 256 slots
  assert full.returncode == 2
  assert full.stderr.strip().splitlines() == [
      "error: the run needs 78.89 GiB per device but v6e-8 devices have 32.00 GiB (short by 46.89 GiB); the "
      "biggest item is the KV cache (76.50 GiB per device): change sampling.max_slots (or spread the cache: "
      "sampling.engines x sampling.tensor)"]
  many = subprocess.run([*base[:-3], "--config.sampling.engines=4", "--config.sampling.tensor=4", "--dry_run"],
                        cwd=REPO, capture_output=True, text=True, timeout=120)
  assert many.returncode == 2 and "16 devices, but a sampler job runs on one host and v6e-8 has 8 per host" in many.stderr


def test_a_sampler_jobs_compile_dry_run_compiles_its_prefill_and_decode_only():
  p = subprocess.run([sys.executable, "-m", "oapl_jax.sample", "--config=configs/tiny.py", "--config.rl.mode=remote",
                      "--dry_run=compile"], cwd=REPO, capture_output=True, text=True, timeout=300)
  assert p.returncode == 0, p.stderr
  programs = [line.split()[0] for line in p.stdout.splitlines()[p.stdout.splitlines().index(
      next(line for line in p.stdout.splitlines() if line.startswith("program"))) + 1:] if line.startswith(("prefill", "decode"))]
  assert programs[0] == "prefill" and all(name == "decode" for name in programs[1:]) and len(programs) >= 2
  assert "train step" not in p.stdout and "refresh" not in p.stdout
  assert "peak per device: compiled" in p.stdout
