"""The workdir lock in Cloud Storage (gs://, through the emulator of tests/test_gcs_emulator.py):
a lock whose run may be alive is never taken over, a stale one is, and of two starters that find
the same stale lock only one takes it: the take-over deletes only the record it read
(`storage.remove_if_generation`), so a starter that read the stale lock before the other took
it over cannot delete the other's (issue 59 B4; the local race is test_layout's)."""

import json
import subprocess
import sys

from test_gcs_emulator import BUCKET, REPO, emulator  # noqa: F401 (the emulator fixture, shared)

# Starters of one gs:// workdir in a process whose gs:// is the emulator; each case prints what
# the starter got ("held" / "busy") and whose token the lock object holds after.
_LOCKS = """
import json, os, socket, subprocess, sys, time
from oapl_jax import storage, workdir
root = sys.argv[1]
path = workdir.Layout(root).lock
host = socket.gethostname()
dead = subprocess.Popen([sys.executable, "-c", "pass"]); dead.wait()  # a pid that is gone
said, lost = {}, []

def put(**record):
  storage.remove(path)
  storage.write_text(path, json.dumps({"pid": 1, "host": "another-host", "started": "2026-01-01T00:00:00",
                                       "heartbeat": time.time(), "token": "theirs", **record}))

def starter():
  lock = workdir.WorkdirLock(root, lease_s=300)  # no renewal within the test (every 30 s)
  lock.on_lost = lambda: lost.append(lock._me["token"])  # not os._exit: say it
  return lock

def start(lock):
  try:
    lock.acquire()
    return "held"
  except workdir.WorkdirBusy:
    return "busy"

def token():
  return json.loads(storage.read_text(path))["token"]

def case(name, **record):
  put(**record)
  lock = starter()
  said[name] = [start(lock), token() == lock._me.get("token") if lock.held else token()]
  lock.release()

case("other host, renewed now", )
case("this host, its process alive", host=host, pid=os.getppid())
case("this host, its process gone", host=host, pid=dead.pid)
case("other host, not renewed for 1000 s", heartbeat=time.time() - 1000)

# two starters find the same stale lock: b reads it, then a takes it over before b deletes it
put(heartbeat=time.time() - 1000)
a, b = starter(), starter()
read = b._read
def racing_read():
  got = read()
  if not a.held:
    said["a"] = start(a)
  return got
b._read = racing_read
said["b"] = start(b)
said["race"] = [a.held, b.held, token() == a._me["token"]]
a.release(); b.release()
said["lost"] = lost
print(json.dumps(said))
"""


def test_a_gs_workdir_lock_is_taken_over_only_when_stale_and_by_one_starter(emulator, tmp_path):  # noqa: F811
  env, _ = emulator
  out = subprocess.run([sys.executable, "-c", _LOCKS, f"gs://{BUCKET}/lock_guards/{tmp_path.name}"], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-3000:]
  said = json.loads(out.stdout.strip().splitlines()[-1])
  assert said == {
      "other host, renewed now": ["busy", "theirs"],
      "this host, its process alive": ["busy", "theirs"],
      "this host, its process gone": ["held", True],
      "other host, not renewed for 1000 s": ["held", True],
      "a": "held", "b": "busy", "race": [True, False, True],  # a keeps it; b is refused, deleting nothing
      "lost": []}, said
