"""Remote mode's faults (issue 59, A1-A3, A7, C): a stopped sampler job, a misconfigured one, a
SIGTERM while the trainer waits, a finished run extended, a sampler on a workdir with no trainer.

The trainer's side runs in this process where a real trainer would only add minutes (`train.Run`
builds the trainer's model and its remote source, which publishes the status and snapshots as a
running trainer does); sampler jobs, and the trainer where its signals are the point, run as the
real commands in processes of their own."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import start_session
from oapl_jax import config as config_lib
from oapl_jax import storage
from oapl_jax.rl import remote

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLER = ["--config=configs/tiny.py:smoke", "--config.rl.mode=remote", "--config.log.progress=False",
           "--config.rl.remote.poll_s=0.1"]
HOST = socket.gethostname()


def _config(**rl_remote):
  c = config_lib.repo_config("tiny.py:smoke")
  c.rl.mode = "remote"
  c.rl.remote.poll_s = 0.1
  c.rl.remote.update(rl_remote)
  config_lib.validate(c)
  return c


def _trainer(config, workdir):
  """The trainer's state as a remote-mode trainer has it at its first step: its status (the
  settings a sampler must share, train.steps) and snapshot version 0 published."""
  from oapl_jax import train  # noqa: PLC0415
  run = train.Run(config, str(workdir))
  run.source._publish()
  return run


def _start(module, args, log):
  return start_session([sys.executable, "-m", module, *args], cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"},
                       stdout=open(log, "w"), stderr=subprocess.STDOUT)


def _until(what, proc, log, timeout=300):
  """Waits until `what()` holds, failing with the log if `proc` ends first or time runs out."""
  deadline = time.time() + timeout
  while not what():
    assert proc.poll() is None, f"ended ({proc.returncode}) first:\n" + open(log).read()[-3000:]
    assert time.time() < deadline, "timed out:\n" + open(log).read()[-3000:]
    time.sleep(0.05)


def _claims_of(root, pid) -> list[str]:
  """The claims a sampler process `pid` holds now."""
  names = []
  for name in storage.listdir(os.path.join(root, "claims")):
    try:
      if f":{pid}:" in json.loads(open(os.path.join(root, "claims", name)).read())["owner"]:
        names.append(name)
    except (FileNotFoundError, IsADirectoryError, json.JSONDecodeError, KeyError):
      pass
  return names


def _write_claim(root, index, owner, age_s=0.0):
  os.makedirs(os.path.join(root, "claims"), exist_ok=True)
  path = remote.claim_path(root, index)
  open(path, "w").write(json.dumps({"owner": owner, "time": time.time() - age_s}))
  os.utime(path, (time.time() - age_s,) * 2)


def _live_process() -> subprocess.Popen:
  return start_session(["sleep", "300"])


def _dead_pid() -> int:
  p = subprocess.Popen(["true"])
  p.wait()
  return p.pid


# --- A1: a stopped sampler ----------------------------------------------------------------------


def test_a_claim_whose_process_is_gone_is_taken_over_at_once_on_its_host(tmp_path):
  root = str(tmp_path)
  live = _live_process()
  _write_claim(root, 5, f"{HOST}:{_dead_pid()}:dead")  # killed a moment ago, long before any timeout
  _write_claim(root, 6, f"{HOST}:{live.pid}:alive")
  _write_claim(root, 7, f"another-host:{_dead_pid()}:far")  # its pid means nothing here: the timeout decides
  assert not remote.claimed(root, 5, timeout_s=1800) and remote.claim(root, 5, "b", timeout_s=1800)
  assert json.loads(open(remote.claim_path(root, 5)).read())["owner"] == "b"
  assert remote.claimed(root, 6, timeout_s=1800) and not remote.claim(root, 6, "b", timeout_s=1800)
  assert remote.claimed(root, 7, timeout_s=1800) and not remote.claim(root, 7, "b", timeout_s=1800)
  # a written rollout's claim is never taken over (the file is there: nothing to sample)
  _write_claim(root, 8, f"{HOST}:{_dead_pid()}:dead")
  os.makedirs(os.path.join(root, "rollouts"))
  open(remote.rollout_path(root, 8), "wb").write(b"x")
  assert not remote.claim(root, 8, "b", timeout_s=1800)


def test_a_held_claim_is_renewed_while_sampling_and_released_however_the_sampling_ends(tmp_path):
  root, timeout = str(tmp_path), 1.0
  assert remote.claim(root, 3, "me", timeout)
  with remote.holding(root, 3, "me", timeout):
    time.sleep(3 * timeout)  # a rollout three timeouts long: renewed every timeout / 5
    assert remote.claimed(root, 3, timeout), "a live sampler's claim went stale while it sampled"
  assert not storage.exists(remote.claim_path(root, 3))
  assert remote.claim(root, 4, "me", timeout)
  with pytest.raises(KeyboardInterrupt):  # Ctrl-C (or SIGTERM's exception, or a bug) mid-rollout
    with remote.holding(root, 4, "me", timeout):
      raise KeyboardInterrupt
  assert not storage.exists(remote.claim_path(root, 4))  # given back at once
  # a claim taken over from this sampler (it was paused past the timeout) is not removed by it
  assert remote.claim(root, 5, "me", timeout)
  with remote.holding(root, 5, "me", 60):
    _write_claim(root, 5, "other")
  assert json.loads(open(remote.claim_path(root, 5)).read())["owner"] == "other"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_sampler_stopped_mid_rollout_does_not_hold_its_rollout(tmp_path, sig):
  """The claim of a sampler job stopped mid-rollout is free at once (claim_timeout_s 1800 s): a
  SIGTERM'd job releases it and exits 143 with one line; a kill -9'd one's is taken over by the
  next sampler on its host (its process is gone)."""
  c = _config(ahead=1, claim_timeout_s=1800.0)
  _trainer(c, tmp_path)
  root = str(tmp_path / "remote")
  log = tmp_path / "sampler.log"
  sampler = _start("oapl_jax.sample", [*SAMPLER, "--config.rl.remote.ahead=1",
                                       "--config.rl.remote.claim_timeout_s=1800", f"--workdir={tmp_path}"], log)
  _until(lambda: _claims_of(root, sampler.pid), sampler, log)  # claimed: loading and compiling, then sampling
  os.killpg(sampler.pid, sig)
  rc = sampler.wait(timeout=120)
  assert not storage.exists(remote.rollout_path(root, 0)), "stopped after its rollout, not mid-rollout: " + open(log).read()
  if sig == signal.SIGTERM:
    assert rc == 128 + signal.SIGTERM, open(log).read()
    assert open(log).read().strip().splitlines()[-1] == "error: stopped by SIGTERM"
    assert not storage.exists(remote.claim_path(root, 0))
  assert not remote.claimed(root, 0, timeout_s=1800)
  assert remote.claim(root, 0, "the next sampler", timeout_s=1800)


def test_the_waiting_trainer_names_the_claim_it_waits_on_and_whether_samplers_are_at_work(tmp_path):
  root, timeout = str(tmp_path), 1800.0
  said = remote.waiting_on(root, 4, timeout)
  assert said == ("not claimed by any sampler job; no live sampler job seen: start them with oapl_jax.sample, "
                  "this run's config and workdir (docs/remote.md)")
  live = _live_process()
  _write_claim(root, 4, f"{HOST}:{live.pid}:x", age_s=40)
  said = remote.waiting_on(root, 4, timeout)
  head = f"claimed by sampler {HOST} pid {live.pid}, renewed "
  assert said.startswith(head), said
  age = int(re.match(r"(\d+)s ago", said[len(head):]).group(1))
  assert 40 <= age < 1800, said  # 40 s and however long a loaded machine took since, below the timeout
  assert "taken over if not renewed for 1800s (rl.remote.claim_timeout_s)" in said and "start them" not in said
  # its sampler killed while others sample ahead: said so, and that the samplers are alive
  gone = _dead_pid()
  _write_claim(root, 4, f"{HOST}:{gone}:x")
  _write_claim(root, 7, f"{HOST}:{live.pid}:y")
  os.makedirs(os.path.join(root, "rollouts"))
  for i in (5, 6):
    open(remote.rollout_path(root, i), "wb").write(b"x")
  said = remote.waiting_on(root, 4, timeout)
  assert said == (f"claimed by sampler {HOST} pid {gone}, renewed 0s ago; its process {gone} on this host is "
                  "gone: the next sampler job to look takes it over; sampler jobs are at work (rollouts 5-6 (2) "
                  "written, 7 being sampled)")


def test_a_sampler_ahead_of_the_trainer_says_so_once(tmp_path, capsys):
  from oapl_jax.rl.sampler_job import SamplerJob  # noqa: PLC0415
  c = _config(ahead=2)
  run = _trainer(c, tmp_path)
  root = run.source.root
  os.makedirs(os.path.join(root, "rollouts"), exist_ok=True)
  for i in (0, 1):  # written by other samplers; the trainer has not taken them yet
    open(remote.rollout_path(root, i), "wb").write(b"x")
  job = SamplerJob(c, str(tmp_path))
  capsys.readouterr()
  out = job.serve(max_idle_s=2.0)  # about 20 looks at the queue
  assert out["rollouts"] == [] and "--max_idle_s" in out["stopped"]
  lines = [line for line in capsys.readouterr().out.splitlines() if "rl.remote.ahead" in line]
  assert lines == ["sampler: rollouts 0-1 are all written or being sampled (rl.remote.ahead=2): waiting for the "
                   "trainer to take them (said once; the samplers are ahead of the trainer)"]


# --- A2: a sampler whose settings cannot serve the trainer --------------------------------------


def test_a_sampler_with_other_settings_is_refused_at_its_start_in_one_line(tmp_path):
  c = _config()
  _trainer(c, tmp_path)
  root = tmp_path / "remote"
  runs = {"seed": [*SAMPLER, "--config.seed=3"],
          "task": ["--config=configs/reason.py:smoke", *SAMPLER[1:]]}
  procs = {k: start_session([sys.executable, "-m", "oapl_jax.sample", *args, f"--workdir={tmp_path}"], cwd=REPO,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for k, args in runs.items()}
  out = {k: (p.communicate(timeout=300), p.returncode) for k, p in procs.items()}
  for k, ((_, err), rc) in out.items():
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, (k, rc, err)
    assert lines[0].startswith(f"error: this sampler job cannot serve the trainer in {root}: its settings differ: ")
    assert lines[0].endswith("; give it the trainer's config and overrides (docs/remote.md)")
  assert "seed=3 (trainer: 0)" in out["seed"][0][1] and "task" not in out["seed"][0][1].split("differ:")[1]
  assert "task.name='chain_addition' (trainer: 'addition')" in out["task"][0][1]
  assert "sampling.max_new_tokens=" in out["task"][0][1]  # its answers are longer too
  for folder in (root / "rollouts", root / "claims"):  # the refused samplers wrote nothing, claimed nothing
    assert not folder.exists() or not os.listdir(folder)


def test_settings_a_sampler_may_choose_for_itself_are_not_refused(tmp_path):
  from oapl_jax.rl.sampler_job import SamplerJob  # noqa: PLC0415
  _trainer(_config(), tmp_path)
  own = _config(ahead=8)  # its own queue, engines, logging, and the run's length (changed at a resume)
  own.sampling.max_slots, own.sampling.engines, own.log.every, own.train.steps = 16, 1, 7, 99
  SamplerJob(own, str(tmp_path))
  other = _config()
  other.sampling.temperature = 0.5
  with pytest.raises(remote.SettingsDiffer, match=r"its settings differ: sampling.temperature=0.5 \(trainer: 1.0\);"):
    SamplerJob(other, str(tmp_path))


# --- A3: one SIGTERM stops the trainer waiting for rollouts ------------------------------------


def test_one_sigterm_stops_a_remote_trainer_waiting_for_rollouts(tmp_path):
  """No sampler writes rollout 0; a live process (this test) holds its claim. The trainer says
  whose claim it waits on, and one SIGTERM stops it with a checkpoint and exit code 143."""
  root = str(tmp_path / "run" / "remote")
  _write_claim(root, 0, f"{HOST}:{os.getpid()}:test")
  log = tmp_path / "trainer.log"
  trainer = _start("oapl_jax.main", [*SAMPLER, "--config.warmup.steps=0", "--config.warmup.noisy_steps=0",
                                     "--config.rl.remote.claim_timeout_s=3600",
                                     f"--workdir={tmp_path / 'run'}"], log)
  _until(lambda: "waiting for rollout 0" in open(log).read(), trainer, log)
  line = next(x for x in open(log).read().splitlines() if "waiting for rollout 0" in x)
  assert line.startswith("step 1: waiting for rollout 0 (0s): claimed by sampler ")
  assert f"{HOST} pid {os.getpid()}, renewed" in line and "start them" not in line
  os.killpg(trainer.pid, signal.SIGTERM)  # one signal, as a scheduler sends before its SIGKILL
  try:
    rc = trainer.wait(timeout=120)
  except subprocess.TimeoutExpired:
    raise AssertionError("one SIGTERM did not stop the waiting trainer:\n" + open(log).read()[-3000:])
  assert rc == 128 + signal.SIGTERM, open(log).read()[-3000:]
  last = open(log).read().strip().splitlines()[-1]
  assert last.startswith("error: stopped by SIGTERM at step 0, waiting for rollout 0 from the sampler jobs: "
                         "checkpoint saved in ")
  assert os.path.isdir(tmp_path / "run" / "checkpoints" / "0")
  assert not os.path.exists(tmp_path / "run" / "run.lock")  # the workdir is free for the resume


# --- A7: a finished run extended ---------------------------------------------------------------


def test_a_sampler_beside_a_finished_run_being_extended_keeps_sampling(tmp_path):
  c2 = _config()
  c2.train.steps = 2
  run = _trainer(c2, tmp_path)
  run.counters.step = run.counters.rollouts = 2
  run.source.close()  # the run finished: done
  _trainer(c2, tmp_path)  # the same run started again without more steps: still done
  assert remote.read_status(run.source.root)["done"] is True
  log = tmp_path / "sampler.log"
  sampler = _start("oapl_jax.sample", [*SAMPLER, "--config.train.steps=4", f"--workdir={tmp_path}"], log)
  _until(lambda: "waiting for the trainer to resume and extend it" in open(log).read(), sampler, log)
  c4 = _config()
  c4.train.steps = 4
  resumed = _trainer(c4, tmp_path)  # the trainer resumed with train.steps raised: `done` cleared at its start
  status = remote.read_status(resumed.source.root)
  assert status["done"] is False and status["steps"] == 4 and status["next_rollout"] == 2
  _until(lambda: storage.exists(remote.rollout_path(resumed.source.root, 2)), sampler, log)
  resumed.counters.step = 4
  resumed.source.close()
  assert sampler.wait(timeout=120) == 0, open(log).read()[-3000:]
  assert "sampler: stopping: the trainer marked its run done" in open(log).read()


# --- C: a sampler on a workdir where no trainer runs -------------------------------------------


def test_a_sampler_on_a_workdir_with_no_trainer_says_so_at_once_and_exits_2(tmp_path):
  typo = tmp_path / "oapl_remtoe"
  p = subprocess.run([sys.executable, "-m", "oapl_jax.sample", *SAMPLER, f"--workdir={typo}",
                      "--wait_for_trainer_s=3"], cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"},
                     capture_output=True, text=True, timeout=300)
  assert p.returncode == 2, p.stderr
  assert f"sampler: no trainer in --workdir={typo} yet (no run.lock, remote/trainer.json or snapshot): waiting " \
         "up to 3s for one to start (--wait_for_trainer_s)" in p.stdout
  assert p.stderr.strip().splitlines() == [
      f"error: no trainer in --workdir={typo} after 3s (no run.lock, remote/trainer.json or snapshot; "
      "--wait_for_trainer_s): give the trainer's --workdir, and start the trainer"]
