"""A run survives what users and machines do to it: a second run on its workdir, non-finite
steps, stale groups in async mode, and kill -9 / SIGTERM / SIGINT in the middle of RL."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from conftest import with_default_sigint
from oapl_jax import timing
from oapl_jax import config as config_lib
from oapl_jax import train
from oapl_jax.tasks.arithmetic import AdditionTask
from oapl_jax import workdir
from oapl_jax.workdir import WorkdirBusy, WorkdirLock


def _same(a, b):
  return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# --- one run per workdir ----------------------------------------------------------------------


def test_workdir_lock_refuses_a_second_run_and_is_released(tmp_path):
  with WorkdirLock(str(tmp_path)) as lock:
    assert json.loads(open(lock.path).read())["pid"] == os.getpid()
    with pytest.raises(WorkdirBusy, match=f"in use by process {os.getpid()} on {socket.gethostname()}"):
      WorkdirLock(str(tmp_path)).acquire()
  assert not os.path.exists(lock.path)
  with WorkdirLock(str(tmp_path)):  # free again
    pass


def test_workdir_lock_of_a_dead_process_is_taken_over(tmp_path):
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  path = tmp_path / "run.lock"
  path.write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "started": "then"}))
  with WorkdirLock(str(tmp_path)) as lock:
    assert json.loads(path.read_text())["pid"] == os.getpid() and lock.held


def test_workdir_lock_of_another_host_is_refused_with_the_way_out(tmp_path):
  (tmp_path / "run.lock").write_text(json.dumps({"pid": 1, "host": "elsewhere", "started": "then"}))
  with pytest.raises(WorkdirBusy, match="process 1 on elsewhere.*not renewed .* for 300 s.*delete .*run.lock"):
    WorkdirLock(str(tmp_path)).acquire()


def test_workdir_lease_not_renewed_is_taken_over_from_any_host(tmp_path, caplog):
  """A preempted slice's lock (another host, its heartbeat older than the lease) is taken over
  with a warning naming it; a fresh one of a live-looking holder is not."""
  path = tmp_path / "run.lock"
  path.write_text(json.dumps({"pid": 1, "host": "old-slice-w0", "started": "then",
                              "heartbeat": time.time() - 301}))
  with caplog.at_level("WARNING"), WorkdirLock(str(tmp_path), lease_s=300) as lock:
    assert lock.held and json.loads(path.read_text())["host"] == socket.gethostname()
  assert "process 1 on old-slice-w0: not renewed for 301 s (the lease is 300 s)" in caplog.text
  path.write_text(json.dumps({"pid": 1, "host": "old-slice-w0", "started": "then",
                              "heartbeat": time.time() - 200}))
  with pytest.raises(WorkdirBusy, match="old-slice-w0"):
    WorkdirLock(str(tmp_path), lease_s=300).acquire()


def test_workdir_lock_naming_this_pid_is_a_restart_unless_this_process_holds_it(tmp_path):
  """After a container restart the new run can get the old one's pid back: its lock is stale.
  A lock this very process holds is still refused."""
  path = tmp_path / "run.lock"
  path.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": "then",
                              "heartbeat": time.time()}))
  with WorkdirLock(str(tmp_path)) as lock:
    assert lock.held
    with pytest.raises(WorkdirBusy, match=f"in use by process {os.getpid()}"):
      WorkdirLock(str(tmp_path)).acquire()


def test_workdir_lease_is_renewed_while_held(tmp_path):
  with WorkdirLock(str(tmp_path), lease_s=1.0) as lock:
    first = json.loads(open(lock.path).read())["heartbeat"]
    time.sleep(1.5)  # past the lease: renewed every 0.1 s, so never stale
    assert json.loads(open(lock.path).read())["heartbeat"] > first + 1.0
    with pytest.raises(WorkdirBusy):
      WorkdirLock(str(tmp_path), lease_s=1.0).acquire()
  assert not os.path.exists(lock.path) and not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_workdir_lock_waited_for_until_its_lease_runs_out(tmp_path, capsys):
  """lock_wait_s: a live-looking lock of another host (a job restarted at once by its
  scheduler) is waited for, and taken over when its lease runs out; without it, refused."""
  path = tmp_path / "run.lock"
  path.write_text(json.dumps({"pid": 1, "host": "old-pod", "started": "then", "heartbeat": time.time() - 0.5}))
  with pytest.raises(WorkdirBusy, match="old-pod"):
    WorkdirLock(str(tmp_path), lease_s=2.0).acquire()
  t0 = time.monotonic()
  with WorkdirLock(str(tmp_path), lease_s=2.0, wait_s=10.0) as lock:
    assert lock.held and 1.0 < time.monotonic() - t0 < 5.0
  err = capsys.readouterr().err
  assert "in use by process 1 on old-pod" in err and "waiting up to 10 s more" in err, err


_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A starter that takes a stale lock slowly (0.5 s between finding it stale and taking it over:
# the window in which a second starter could do the same), then holds it for 1.5 s.
_SLOW_STARTER = """
import sys, time
from oapl_jax import workdir
stale = workdir.WorkdirLock._stale
def slow_stale(self, holder):
  why = stale(self, holder)
  time.sleep(0.5)
  return why
workdir.WorkdirLock._stale = slow_stale
try:
  with workdir.WorkdirLock(sys.argv[1], lease_s=60.0):
    print("HELD", flush=True)
    time.sleep(1.5)
except workdir.WorkdirBusy:
  print("BUSY", flush=True)
"""


def test_two_starters_on_one_stale_lock_exactly_one_takes_it(tmp_path):
  (tmp_path / "run.lock").write_text(json.dumps(
      {"pid": 1, "host": "old-pod", "started": "then", "heartbeat": time.time() - 600, "token": "old"}))
  env = {**os.environ, "PYTHONPATH": _REPO}
  starters = [subprocess.Popen([sys.executable, "-c", _SLOW_STARTER, str(tmp_path)], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
  said = sorted(p.communicate(timeout=120)[0].strip() for p in starters)
  assert said == ["BUSY", "HELD"], said


# A run whose renewal stalls past its lease (a paused VM) while another run takes the workdir:
# when the renewal wakes it stops at once, exit LEASE_LOST_EXIT, and the new holder's lock stays.
_STALLED_HOLDER = """
import sys, time
from oapl_jax import workdir
renew = workdir.WorkdirLock._renew
def stalled(self):
  time.sleep(2.5)
  renew(self)
workdir.WorkdirLock._renew = stalled
with workdir.WorkdirLock(sys.argv[1], lease_s=1.0):
  print("HELD", flush=True)
  while True:  # the run's writes, until the lost lease stops it
    with open(sys.argv[2], "a") as f:
      f.write(f"{time.time()}\\n")
    time.sleep(0.05)
"""


def test_a_run_that_lost_its_lease_stops_at_once_and_writes_nothing_more(tmp_path):
  env = {**os.environ, "PYTHONPATH": _REPO}
  writes = tmp_path / "writes.txt"
  first = subprocess.Popen([sys.executable, "-c", _STALLED_HOLDER, str(tmp_path), str(writes)], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    _takes_over_from(first, tmp_path, writes)
  finally:
    first.kill()


def _takes_over_from(first, tmp_path, writes):
  assert first.stdout.readline().strip() == "HELD"
  time.sleep(1.3)  # past the 1 s lease, the first run not renewing
  with WorkdirLock(str(tmp_path), lease_s=1.0) as second:  # takes it over (the same lease)
    mine = json.loads((tmp_path / "run.lock").read_text())["token"]
    _, err = first.communicate(timeout=30)
    stopped = time.time()
    assert first.returncode == workdir.LEASE_LOST_EXIT, err
    lines = err.strip().splitlines()
    assert lines[-1].startswith(f"error: lost the lease of --workdir={tmp_path}: it is now held by "
                                f"process {os.getpid()} on {socket.gethostname()}"), err
    assert json.loads((tmp_path / "run.lock").read_text())["token"] == mine  # not overwritten
    last_write = float(writes.read_text().split()[-1])
    time.sleep(0.3)
    assert float(writes.read_text().split()[-1]) == last_write <= stopped  # nothing after it stopped
    assert second.held


# --- non-finite steps -------------------------------------------------------------------------


def _nan_rewards(monkeypatch):
  """Every answer scores NaN: V_hat, the loss and the gradients are NaN."""
  monkeypatch.setattr(AdditionTask, "score", lambda self, response, problem: float("nan"))


def test_a_nonfinite_step_is_skipped_and_counted(smoke_config, tmp_path, monkeypatch):
  r = train.Run(smoke_config, str(tmp_path))
  r.step()  # a finite step first
  params, opt_state = jax.tree.map(np.asarray, (r.params, r.opt_state))
  _nan_rewards(monkeypatch)
  r.buffer.clear()  # the next step samples (and scores) afresh
  m = r.step()
  assert not np.isfinite(m["loss"]) and m["step_skipped"] == 1.0
  assert (m["steps_skipped"], r.counters.nonfinite_in_a_row, r.counters.step) == (1, 1, 2)
  assert _same(r.params, params) and _same(r.opt_state, opt_state)  # nothing moved
  monkeypatch.undo()
  r.buffer.clear()
  m = r.step()
  assert m["step_skipped"] == 0.0 and r.counters.nonfinite_in_a_row == 0
  assert not _same(r.params, params)


def test_the_run_stops_after_max_nonfinite_steps_in_a_row(smoke_config, tmp_path, monkeypatch):
  c = smoke_config
  c.train.max_nonfinite_steps = 3
  _nan_rewards(monkeypatch)
  with pytest.raises(train.NonFiniteSteps, match=r"3 trainer steps in a row .*train.max_nonfinite_steps=3"):
    train.run(c, str(tmp_path))
  rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step_skipped"] for r in rows] == [1.0, 1.0, 1.0]
  r = train.Run(c, str(tmp_path))
  assert r.restore_latest() and r.counters.step == 2  # checkpoint.every=2, before the stop
  leaves = jax.tree.leaves(r.params)
  assert all(np.isfinite(np.asarray(x)).all() for x in leaves)
  assert not os.path.exists(tmp_path / "run.lock")  # released on the error


# --- async mode: stale groups are used, unless rl.max_lag says otherwise ----------------------


def _async(c, **rl):
  c.rl.mode = "async"
  c.rl.lag, c.rl.groups_per_step, c.rl.groups_per_rollout = 3, 2, 5  # left-overs at refreshes
  c.rl.update(rl)
  return c


def test_async_keeps_left_over_groups_across_a_refresh(smoke_config, tmp_path):
  r = train.Run(_async(smoke_config), str(tmp_path))
  for _ in range(3):
    r.step()
  assert r.counters.version == 1 and len(r.buffer) > 0  # the refresh kept the left-overs
  left = r.buffer.state()["snapshot_step"]
  assert (left < r.counters.snapshot_step).all()  # they were sampled by the previous pi_old
  m = r.step()  # ... and are used next (FIFO: before the newer rollout), at their own lag
  assert m["lag_hist"] == {"3": 2 * smoke_config.rl.group_size}  # 2 groups of snapshot step 0
  for _ in range(5):
    m = r.step()
  assert r.counters.groups_dropped == 0 and r.counters.groups_dropped_stale == 0
  r.close()


def test_async_max_lag_drops_and_counts_older_groups(smoke_config, tmp_path):
  c = _async(smoke_config, max_lag=3)
  r = train.Run(c, str(tmp_path))
  lags = set()
  for _ in range(9):
    m = r.step()
    lags |= {int(k) for k in m["lag_hist"]}
  assert max(lags) <= 3
  assert r.counters.groups_dropped_stale > 0 and m["groups_dropped_stale"] == r.counters.groups_dropped_stale
  # Every group taken from a rollout was trained on, dropped as stale or is still buffered.
  taken = r.counters.samples_generated // c.rl.group_size
  assert taken == 9 * c.rl.groups_per_step + r.counters.groups_dropped_stale + len(r.buffer)
  assert r.counters.groups_dropped == 0  # async empties nothing at a refresh
  r.close()


def test_max_lag_below_the_lag_is_refused(smoke_config):
  c = _async(smoke_config, max_lag=2)
  with pytest.raises(config_lib.ConfigError, match=r"config.rl.max_lag=2: .*>= rl.lag=3"):
    config_lib.validate(c)


# --- kill -9, SIGTERM, SIGINT in the middle of RL: the resumed run is the straight run --------

_CONFIG = ["--config=configs/tiny.py:smoke", "--config.train.steps=14", "--config.checkpoint.every=4",
           "--config.log.progress=False", "--config.eval.every=3"]
_TIMING = timing.TIMED  # wall-time metrics: the rest repeat exactly


def _main(workdir, **kw):
  """The run, started with SIGINT's default action (as from a terminal) whatever the suite's."""
  kw = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **kw}
  return subprocess.Popen(with_default_sigint([sys.executable, "-m", "oapl_jax.main", f"--workdir={workdir}",
                                               *_CONFIG]), text=True, **kw)


def _finish(proc, timeout=600):
  out, err = proc.communicate(timeout=timeout)
  return proc.returncode, out, err


def _rows(workdir):
  rows = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  return [{k: v for k, v in r.items() if k not in _TIMING} for r in rows]


def _read(path):
  return path.read_text() if path.exists() else ""


def _wait_for(condition, proc, timeout=600):
  t0 = time.time()
  while not condition():
    assert proc.poll() is None, _finish(proc)
    assert time.time() - t0 < timeout, "timed out"
    time.sleep(0.05)


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
  """The run without a stop: its metrics (less wall times), final and in-run evaluations."""
  straight = tmp_path_factory.mktemp("straight")
  rc, _, err = _finish(_main(straight))
  assert rc == 0, err[-3000:]
  summary = json.loads((straight / "summary.json").read_text())
  assert [e["step"] for e in summary["evals_during"]] == [3, 6, 9, 12]
  return _rows(straight), summary["eval_after"], summary["evals_during"]


@pytest.mark.parametrize("sig, code", [  # CI: all but SIGINT, whose stop is SIGTERM's (test_signals.py)
    (signal.SIGKILL, -9), (signal.SIGTERM, 143), pytest.param(signal.SIGINT, 130, marks=pytest.mark.slow),
    ("twice", 143)], ids=["SIGKILL", "SIGTERM", "SIGINT", "twice"])
def test_kill_sigterm_sigint_mid_rl_resume_to_the_straight_run(tmp_path, straight_run, sig, code):
  want, final, during = straight_run
  workdir = tmp_path / getattr(sig, "name", sig)
  if sig == "twice":  # SIGTERM, then again while the step or its save runs: out at once
    with open(tmp_path / "twice.err", "w") as err_file:
      proc = _main(workdir, stderr=err_file)
    _wait_for(lambda: len(_read(workdir / "metrics.jsonl").splitlines()) >= 5, proc)
    proc.send_signal(signal.SIGTERM)
    _wait_for(lambda: "stopping after this step" in _read(tmp_path / "twice.err"), proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == code
    err = _read(tmp_path / "twice.err")
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith(
        "error: stopped at once by a second SIGTERM"), err[-3000:]
    assert not (workdir / "summary.json").exists()
    rc, out, err = _finish(_main(workdir))  # the same command resumes
    assert rc == 0, err[-3000:]
    assert _rows(workdir) == want and not [  # and the abandoned save's folder is gone
        p for p in os.listdir(workdir / "checkpoints") if "tmp" in p]
    assert json.loads((workdir / "summary.json").read_text())["eval_after"] == final
    return
  proc = _main(workdir)
  if sig == signal.SIGKILL:  # a second run on the same workdir, while the first holds it
    _wait_for(lambda: (workdir / "run.lock").exists(), proc)
    busy = subprocess.run([sys.executable, "-m", "oapl_jax.main", f"--workdir={workdir}", *_CONFIG],
                          capture_output=True, text=True, timeout=300)
    assert busy.returncode == 2 and f"is in use by process {proc.pid}" in busy.stderr, busy.stderr
  _wait_for(lambda: len(_read(workdir / "metrics.jsonl").splitlines()) >= 5, proc)  # mid-RL
  proc.send_signal(sig)
  rc, out, err = _finish(proc)
  assert rc == code, (sig, rc, err[-3000:])
  if sig != signal.SIGKILL:  # a clean stop: one line, a checkpoint of the step it stopped at
    assert "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert f"stopped by {sig.name} at step" in last and "run the same command again" in last
    stopped = int(last.split("at step ")[1].split(":")[0])
    assert 5 <= stopped < 14 and str(stopped) in os.listdir(workdir / "checkpoints")
  assert not (workdir / "summary.json").exists()
  rc, out, err = _finish(_main(workdir))  # the same command resumes
  assert rc == 0, err[-3000:]
  assert _rows(workdir) == want, sig
  assert json.loads((workdir / "summary.json").read_text())["eval_after"] == final, sig
  # the evaluations before the stop come back with the resumed run (from its metrics)
  assert json.loads((workdir / "summary.json").read_text())["evals_during"] == during, sig


def test_dead_model_watch_warns_once_per_run_of_dead_steps():
  watch = train.DeadModelWatch(3, vocab_size=32)
  uniform = {"grad_norm": 0.5, "entropy": np.log(32)}
  live = {"grad_norm": 0.5, "entropy": 1.0}
  zero = {"grad_norm": 0.0, "entropy": 1.0}
  said = [watch.update(s, m) for s, m in enumerate([zero, uniform, live, zero, zero, uniform, zero, zero], 1)]
  assert [s for s, w in enumerate(said, 1) if w] == [6]  # the run of 3 starting at step 4, once
  assert "at step 6, the gradient norm has been 0 or the policy uniform" in said[5]
  assert train.DeadModelWatch(0, vocab_size=32).update(1, zero) is None  # 0: never


def test_a_run_that_stopped_learning_says_so(smoke_config, tmp_path, capsys):
  """train.lr=1e6 blows the tiny model up into a uniform policy with a zero gradient: the run
  finishes (nothing is wrong to an error check) but prints the warning."""
  smoke_config.train.lr, smoke_config.train.steps = 1e6, 6
  smoke_config.log.dead_model_steps, smoke_config.log.progress = 3, False
  train.run(smoke_config, str(tmp_path))
  assert "the weights stopped learning (is train.lr too high?)" in capsys.readouterr().out


# --- a full disk during a save ----------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
  """A 9 MiB tmpfs (the tiny model's checkpoint is ~6 MiB: the second save does not fit), made
  bigger by calling the returned function; skipped where mounting is not allowed (not root)."""
  disk = tmp_path / "disk"
  disk.mkdir()
  mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=9M", "tmpfs", str(disk)],
                           capture_output=True, text=True)
  if mounted.returncode:
    pytest.skip(f"a full disk needs a small tmpfs, and mount refused: {mounted.stderr.strip()}")
  try:
    yield disk, lambda: subprocess.run(["mount", "-o", "remount,size=64M", str(disk)], check=True)
  finally:
    subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_full_disk_during_a_save_is_one_line_and_the_run_resumes(small_disk):
  disk, grow = small_disk
  workdir = disk / "w"
  cmd = [sys.executable, "-m", "oapl_jax.main", f"--workdir={workdir}",
         "--config=configs/tiny.py:smoke", "--config.log.progress=False"]
  full = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
  assert full.returncode == 2, full.stderr[-3000:]
  lines = full.stderr.strip().splitlines()
  assert "Traceback" not in full.stderr and len(lines) <= 3, full.stderr[-3000:]  # + 2 info lines
  # the checkpoint's files fill the disk; whichever write then fails first (the checkpoint's, or
  # a metrics line that needs a new page) says so in one line naming the newest checkpoint
  assert lines[-1].startswith("error: ") and (
      "no space left on device" in lines[-1] and "(newest: step 2)" in lines[-1]), full.stderr[-3000:]
  assert "2" in os.listdir(workdir / "checkpoints")  # nothing written before is lost
  grow()
  resumed = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "resumed from step 2" in resumed.stdout + resumed.stderr
  assert json.loads((workdir / "summary.json").read_text())["trainer_steps"] == 6
  assert [r["step"] for r in _rows(workdir)] == list(range(1, 7))
