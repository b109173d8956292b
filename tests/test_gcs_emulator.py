"""`gs://` workdirs through the real Cloud Storage clients, against a local emulator (issue 45).

The emulator is `gcp-storage-emulator` (a test extra: pure Python, started here on a free port,
in memory) with the generation preconditions of Cloud Storage that it lacks added
(tests/gcs_emulator.py says which and why). Pointed at it by their own settings, the clients a
run uses on a pod:
* etils.epath -> fsspec -> gcsfs (`EPATH_USE_TF=false`, `STORAGE_EMULATOR_HOST`): the workdir's
  files (`oapl_jax.storage`: lock, metrics, summary, evaluations, TensorBoard events);
* orbax -> tensorstore (`TENSORSTORE_GCS_HTTP_URL`, `GOOGLE_AUTH_TOKEN_FOR_TESTING`): the
  checkpoints.
What cannot be pointed at it: TensorFlow's own GCS client (tf.io.gfile, which etils uses when
TensorFlow is installed and `EPATH_USE_TF` is not false) has its endpoint compiled in
(docs/scaling.md "Buckets").
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from oapl_jax import timing

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUCKET = "bkt"


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
  """(environment for a process whose gs:// goes to the emulator, its URL)."""
  log = tmp_path_factory.mktemp("emulator") / "emulator.log"  # it logs every request: not a pipe that fills
  port = _free_port()
  url = f"http://127.0.0.1:{port}"
  proc = subprocess.Popen([sys.executable, os.path.join(REPO, "tests", "gcs_emulator.py"), "start", "--host=127.0.0.1",
                           f"--port={port}", "--in-memory", f"--default-bucket={BUCKET}"],
                          stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
  deadline = time.time() + 60
  while True:
    try:
      socket.create_connection(("127.0.0.1", port), timeout=1).close()
      break
    except OSError:
      assert proc.poll() is None and time.time() < deadline, (
          "the emulator (gcp-storage-emulator, a test extra) did not start: " + log.read_text()[-2000:])
      time.sleep(0.2)
  env = {"EPATH_USE_TF": "false", "STORAGE_EMULATOR_HOST": url, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
         "TENSORSTORE_GCS_HTTP_URL": url, "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator", "NO_GCE_CHECK": "true"}
  yield {**os.environ, "JAX_PLATFORMS": "cpu", **env}, url
  os.killpg(proc.pid, signal.SIGKILL)
  proc.wait()


def _bucket(url):
  from gcsfs.core import GCSFileSystem  # noqa: PLC0415 (the plain client: no storage-control probe)
  return GCSFileSystem(endpoint_url=url, token="anon", skip_instance_cache=True)


def test_the_workdir_files_go_through_gcsfs_to_the_emulator(emulator, tmp_path):
  """oapl_jax.storage on gs:// in a process set up as above: written, read, listed, removed;
  the objects are in the emulator (read back by a separate client)."""
  env, url = emulator
  script = (
      "from oapl_jax import storage\n"
      "r = 'gs://bkt/io'\n"
      "storage.write_text(r + '/a.json', '{\"x\": 1}')\n"
      "storage.write_bytes(r + '/sub/b.bin', bytes(range(256)))\n"
      "assert storage.read_text(r + '/a.json') == '{\"x\": 1}'\n"
      "assert storage.exists(r + '/sub/b.bin') and not storage.exists(r + '/nothing')\n"
      "print(sorted(storage.listdir(r)))\n"
      "storage.remove(r + '/a.json')\n"
      "print(storage.exists(r + '/a.json'))\n")
  out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=120)
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.split("\n")[:2] == ["['a.json', 'sub']", "False"], out.stdout
  assert _bucket(url).cat(f"{BUCKET}/io/sub/b.bin") == bytes(range(256))


_SAVE = """
import sys, jax, jax.numpy as jnp
from oapl_jax.checkpoint import Checkpointer
state = {"params": {"w": jnp.arange(32.0).reshape(8, 4), "b": jnp.ones(4, jnp.bfloat16)}}
ck = Checkpointer(sys.argv[1], keep=2)
for step in (1, 2, 3):
  ck.save(step, jax.tree.map(lambda x: x * step, state), {"counters": {"step": step}, "model": {"name": "m"}}, wait=True)
"""
_RESTORE = """
import sys, jax, jax.numpy as jnp, numpy as np
from oapl_jax.checkpoint import Checkpointer
target = {"params": {"w": jnp.zeros((8, 4)), "b": jnp.zeros(4, jnp.bfloat16)}}
step, state, meta = Checkpointer(sys.argv[1], keep=2).restore_latest(target, {"name": "m"})
print(step, meta["counters"], float(state["params"]["w"].sum()), state["params"]["b"].dtype, float(state["params"]["b"][0]))
"""


def test_a_checkpoint_saved_in_the_emulated_bucket_restores_in_another_process(emulator):
  """checkpoint.Checkpointer on gs:// (orbax -> tensorstore -> the emulator): three saves with
  keep=2, then a new process restores the newest, bit for bit, bfloat16 included."""
  env, url = emulator
  where = f"gs://{BUCKET}/ckpt_unit"
  for script in (_SAVE, _RESTORE):
    out = subprocess.run([sys.executable, "-c", script, where], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.split() == ["3", "{'step':", "3}", str(float(3 * sum(range(32)))), "bfloat16", "3.0"]
  assert sorted(n.rsplit("/", 1)[-1] for n in _bucket(url).ls(f"{BUCKET}/ckpt_unit")) == ["2", "3"]


_CONFIG = ["--config=configs/tiny.py:smoke", "--config.train.steps=6", "--config.checkpoint.every=2",
           "--config.log.progress=False", "--config.eval.every=3"]


def _rows(text):
  rows = [json.loads(line) for line in text.splitlines()]
  return [{k: v for k, v in r.items() if k not in timing.TIMED} for r in rows]


def test_a_run_in_the_emulated_bucket_is_killed_resumes_and_is_the_straight_run(emulator, tmp_path):
  """Workdir and checkpoints in gs:// (orbax through tensorstore, the rest through gcsfs):
  kill -9 after step 3, the lock made another host's stale lease, the same command resumes from
  the step-2 checkpoint read back from the bucket and writes the straight local run's metrics,
  summary and TensorBoard events there."""
  env, url = emulator
  warm = f"--config.warmup.cache_dir={tmp_path / 'warm'}"
  straight = subprocess.run([sys.executable, "-m", "oapl_jax.main", f"--workdir={tmp_path / 'straight'}", *_CONFIG,
                             warm], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert straight.returncode == 0, straight.stderr[-3000:]
  want = _rows((tmp_path / "straight" / "metrics.jsonl").read_text())
  fs, run = _bucket(url), f"{BUCKET}/runs/e2e"
  cmd = [sys.executable, "-m", "oapl_jax.main", f"--workdir=gs://{run}", *_CONFIG, warm]
  proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  t0 = time.time()
  while not (fs.exists(f"{run}/metrics.jsonl") and len(fs.cat(f"{run}/metrics.jsonl").splitlines()) >= 3):
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    assert time.time() - t0 < 600
    time.sleep(0.2)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert not fs.exists(f"{run}/summary.json")
  assert fs.exists(f"{run}/checkpoints/2/state")  # written by tensorstore, into the emulator
  lock = json.loads(fs.cat(f"{run}/run.lock"))
  fs.pipe(f"{run}/run.lock", json.dumps({**lock, "host": "old-slice-w0", "heartbeat": time.time() - 400}).encode())
  resumed = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "resumed from step" in resumed.stdout + resumed.stderr
  fs.invalidate_cache()
  assert _rows(fs.cat(f"{run}/metrics.jsonl").decode()) == want
  summary = json.loads(fs.cat(f"{run}/summary.json"))
  ref = json.loads((tmp_path / "straight" / "summary.json").read_text())
  assert summary["eval_after"] == ref["eval_after"] and summary["evals_during"] == ref["evals_during"]
  assert sorted(n.rsplit("/", 1)[-1] for n in fs.ls(f"{run}/checkpoints")) == ["4", "6"]  # checkpoint.keep
  events = [n for n in fs.ls(run) if "events.out.tfevents" in n]
  assert len(events) == 2 and all(fs.size(n) > 0 for n in events)  # one per start (TensorBoard)
  assert not fs.exists(f"{run}/run.lock")


# --- the workdir lock's races on gs:// (its writes conditional on the lock's generation) --------

# A run that holds the lock; in `slow` mode every lock write of its own (claim or renewal) waits
# `delay` seconds after it decided to write: the window in which another run may act.
_LOCKER = """
import sys, threading, time
from oapl_jax import storage, workdir
mode, delay, hold = sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
def slowed(real, renewals_only):
  def write(*args, **kwargs):
    if not renewals_only or threading.current_thread().name == "workdir-lease":
      time.sleep(delay)
    return real(*args, **kwargs)
  return write
if mode != "plain":
  for name in ("write_text", "write_if_generation"):
    setattr(storage, name, slowed(getattr(storage, name), renewals_only=mode == "slow_renewal"))
print("STARTED", flush=True)
try:
  with workdir.WorkdirLock(sys.argv[1], lease_s=float(sys.argv[5])) as lock:
    print("HELD", flush=True)
    time.sleep(hold)
    print("STILL HELD", lock.held, flush=True)
except workdir.WorkdirBusy:
  print("BUSY", flush=True)
"""


def _locker(env, url, mode, delay, hold, lease):
  return subprocess.Popen([sys.executable, "-c", _LOCKER, url, mode, str(delay), str(hold), str(lease)], cwd=REPO,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_of_two_runs_starting_on_a_gs_workdir_exactly_one_holds_it(emulator, tmp_path):
  """The second starter found no lock, then waits 8 s before writing its own (the first has
  claimed it meanwhile): its create is conditional on there being none, so it is refused and
  the first keeps the workdir. (A write then a read-back, as before, gave the workdir to
  whichever wrote last, overwriting the first's claim, or to both when the late write landed
  after the first's read-back.)"""
  env, url = emulator
  where = f"gs://{BUCKET}/lockrace/{tmp_path.name}"
  slow = _locker(env, where, "slow_claim", 8.0, 6.0, 60.0)
  assert slow.stdout.readline().strip() == "STARTED"
  time.sleep(1.0)  # past its check for a lock
  fast = _locker(env, where, "plain", 0.0, 12.0, 60.0)  # holds past the slow write (~9 s)
  said = [p.communicate(timeout=120)[0].split() for p in (slow, fast)]
  assert said == [["BUSY"], ["STARTED", "HELD", "STILL", "HELD", "True"]], said  # the slow one's STARTED read above


def test_a_gs_run_whose_renewal_was_slowed_past_its_lease_loses_it_and_the_new_holder_keeps_it(emulator, tmp_path):
  """A holder decides to renew, then stalls 10 s (a paused VM) past its 1 s lease; another run
  takes the workdir over. The renewal, conditional on the generation it last wrote, fails: the
  stalled run stops with one line and LEASE_LOST_EXIT, and the new holder keeps the lock. (An
  unconditional renewal overwrote the new holder's lock, which then stopped instead.)"""
  from oapl_jax import workdir  # noqa: PLC0415
  env, url = emulator
  where = f"gs://{BUCKET}/lockrace/{tmp_path.name}"
  stalled = _locker(env, where, "slow_renewal", 10.0, 30.0, 1.0)
  assert stalled.stdout.readline().strip() == "STARTED" and stalled.stdout.readline().strip() == "HELD"
  time.sleep(1.5)  # past its lease: it has not renewed
  taker = _locker(env, where, "plain", 0.0, 14.0, 1.0)  # holds past the stalled write (~10 s)
  out, err = taker.communicate(timeout=120)
  assert taker.returncode == 0 and out.split() == ["STARTED", "HELD", "STILL", "HELD", "True"], out + err
  _, err = stalled.communicate(timeout=60)
  assert stalled.returncode == workdir.LEASE_LOST_EXIT, err[-3000:]
  assert err.strip().splitlines()[-1].startswith(f"error: lost the lease of --workdir={where}: it is now held by "), err


_CLAIMS = """
import json, sys, time
from oapl_jax import storage
from oapl_jax.rl import remote
root = sys.argv[1]
said = [remote.claim(root, 5, "a", timeout_s=60), remote.claim(root, 5, "b", timeout_s=60),
        remote.claimed(root, 5, timeout_s=60)]
path = remote.claim_path(root, 5)
record = json.loads(storage.read_text(path))
storage.write_text(path, json.dumps({**record, "time": time.time() - 120}))  # its sampler died 2 min ago
data, generation = storage.read_generation(path)
said.append(remote.claim(root, 5, "b", timeout_s=60))
said.append(json.loads(storage.read_text(path))["owner"])
said.append(storage.write_if_generation(path, data, generation) is None)  # a second taker, on what it read
remote.release(root, 5)
said.append(storage.exists(path))
print(json.dumps(said))
"""


def test_rollout_claims_in_gs_are_conditional_writes(emulator):
  """remote.claim on gs://: of two samplers one wins; a dead sampler's claim is taken over once
  (a second taker conditional on the record it read is refused); release removes it."""
  env, _ = emulator
  out = subprocess.run([sys.executable, "-c", _CLAIMS, f"gs://{BUCKET}/claims/remote"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-3000:]
  assert json.loads(out.stdout.strip().splitlines()[-1]) == [True, False, True, True, "b", True, False]
