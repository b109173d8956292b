"""Tests for oapl_jax.rewards.code: correct scoring, and containment of hostile programs.

The sandbox tests need bubblewrap: without it they skip, or fail where CI / OAPL_REQUIRE_SANDBOX=1
is set (`requires_sandbox`, tests/conftest.py). The tests of the refusal to run unsandboxed run
everywhere. Each hostile program must
score 0, leave no process (found by a marker string in its command line, or by the run
directory in bwrap's) and no run directory behind, and leave the caller and a canary process
alive.
"""

import base64
import functools
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import time
import uuid
import zlib

import pytest

from oapl_jax.rewards import code, sandbox

# The sandbox's limits have no defaults (a run takes them from configs/code.py's task section):
# these tests run under 6 s and 512 MB unless a test sets its own.
LIMITS = dict(timeout_s=6.0, memory_mb=512)
score = functools.partial(code.score, **LIMITS)
run_program = functools.partial(code.run_program, **LIMITS)
score_batch = functools.partial(code.score_batch, **LIMITS)

ADD = "a, b = map(int, input().split())\nprint(a + b)\n"
ADD_TESTS = {"inputs": ["1 2\n", "10 -3\n", "0 0\n"], "outputs": ["3\n", "7", "0\n\n"]}


@pytest.fixture
def runs_dir(tmp_path):
  """The parent of every per-run directory of a test: must be empty afterwards."""
  d = tmp_path / "runs"
  d.mkdir()
  return str(d)


@pytest.fixture
def marker():
  return f"oapl_marker_{uuid.uuid4().hex}"


def _procs_with(needle: str) -> list[int]:
  found = []
  for pid in os.listdir("/proc"):
    if not pid.isdigit() or int(pid) == os.getpid():
      continue
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        cmdline = f.read()
    except OSError:
      continue
    if needle.encode() in cmdline:
      found.append(int(pid))
  return found


def _assert_clean(marker: str, runs_dir: str) -> None:
  deadline = time.monotonic() + 5.0
  while (_procs_with(marker) or _procs_with(runs_dir)) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert _procs_with(marker) == [], "a process of the program survived"
  assert _procs_with(runs_dir) == [], "a bwrap process survived"
  assert os.listdir(runs_dir) == [], "a run directory was left behind"


def _marked(body: str, marker: str) -> str:
  """`body`, re-executed first with `marker` in its command line (so leftovers can be found)."""
  head = (f"import os, sys\nif sys.argv[-1] != {marker!r}:\n"
          f"  os.execv(sys.executable, [sys.executable, '-I', sys.argv[0], {marker!r}])\n")
  return head + body


NEVER = {"inputs": [""], "outputs": ["this output is never printed"]}


# --------------------------------------------------------------------------------------------
# Correct and wrong programs
# --------------------------------------------------------------------------------------------


def test_stdin_correct_and_wrong(requires_sandbox, runs_dir):
  trailing = "a, b = map(int, input().split())\nprint(str(a + b) + '   ')\nprint()\n"
  assert score(ADD, ADD_TESTS, tmp_dir=runs_dir) == 1.0
  assert score(trailing, ADD_TESTS, tmp_dir=runs_dir) == 1.0  # whitespace normalised
  assert score(ADD.replace("+", "-"), ADD_TESTS, tmp_dir=runs_dir) == 0.0
  assert score("print(' 3')", {"inputs": [""], "outputs": ["3"]}, tmp_dir=runs_dir) == 0.0
  assert score("raise SystemExit(1)", {"inputs": [""], "outputs": [""]},
               tmp_dir=runs_dir) == 0.0  # nonzero exit
  assert score("exit()", {"inputs": [""], "outputs": [""]}, tmp_dir=runs_dir) == 1.0
  assert score(ADD, json.dumps(ADD_TESTS), tmp_dir=runs_dir) == 1.0  # APPS JSON string
  assert os.listdir(runs_dir) == []


def test_fraction(requires_sandbox, runs_dir):
  two_of_three = "a, b = map(int, input().split())\nprint(a + b if a else 99)\n"
  assert score(two_of_three, ADD_TESTS, fraction=True, tmp_dir=runs_dir) == \
      pytest.approx(2 / 3)
  assert score(two_of_three, ADD_TESTS, tmp_dir=runs_dir) == 0.0
  assert score("print(", ADD_TESTS, fraction=True, tmp_dir=runs_dir) == 0.0


def test_call_based(requires_sandbox, runs_dir):
  tests = {"inputs": [[[1, 2, 3]], [[]], [[5]]], "outputs": [[6], [0], 5], "fn_name": "total"}
  func = "def total(xs):\n  print('debug output goes to stderr')\n  return sum(xs)\n"
  leetcode = ("class Solution:\n  def total(self, xs: List[int]) -> int:\n"
              "    return sum(Counter(xs).elements())\n")
  assert score(func, tests, tmp_dir=runs_dir) == 1.0
  assert score(leetcode, tests, tmp_dir=runs_dir) == 1.0
  assert score("def total(xs):\n  return sum(xs) + 1\n", tests, tmp_dir=runs_dir) == 0.0
  assert score("def other(xs):\n  return 0\n", tests, tmp_dir=runs_dir) == 0.0
  pair = {"inputs": [[2, 3]], "outputs": [[[3, 2]]], "fn_name": "swap"}
  assert score("def swap(a, b):\n  return (b, a)\n", pair, tmp_dir=runs_dir) == 1.0
  boolean = {"inputs": [[4]], "outputs": [True], "fn_name": "even"}
  assert score("def even(n):\n  return n % 2 == 0\n", boolean, tmp_dir=runs_dir) == 1.0
  assert score("def even(n):\n  return 1\n", boolean, tmp_dir=runs_dir) == 0.0
  assert os.listdir(runs_dir) == []


def test_always_equal_object_cannot_pass(requires_sandbox, runs_dir):
  tests = {"inputs": [[1]], "outputs": [[5]], "fn_name": "f"}
  for cls in ("object", "int", "list", "str"):
    prog = (f"class E({cls}):\n  def __eq__(self, other):\n    return True\n"
            f"  def __ne__(self, other):\n    return False\n  __hash__ = None\n"
            f"def f(x):\n  return E()\n")
    assert score(prog, tests, tmp_dir=runs_dir) == 0.0, cls
  # Printing a guess of the driver's output does not help either.
  assert score("import sys\nprint(5)\ndef f(x):\n  sys.exit(0)\n", tests,
               tmp_dir=runs_dir) == 0.0
  assert os.listdir(runs_dir) == []


def test_score_batch_two_workers(requires_sandbox, runs_dir):
  spawner = ("import subprocess, sys\nn = input()\nprint(subprocess.run([sys.executable, '-c', "
             "'print(int(input()) * 2)'], input=n, capture_output=True, text=True).stdout)\n")
  flood = ("import os, time\nfor _ in range(10000):\n  try:\n    if os.fork() == 0:\n"
           "      time.sleep(20)\n      os._exit(0)\n  except OSError:\n    pass\n")
  double = {"inputs": ["21\n"], "outputs": ["42"]}
  programs = [ADD, ADD.replace("+", "*"), flood, spawner, spawner, "def total(xs): return sum(xs)"]
  tests = [ADD_TESTS, ADD_TESTS, NEVER, double, double,
           {"inputs": [[[1, 2]]], "outputs": [3], "fn_name": "total"}]
  start = time.monotonic()
  got = score_batch(programs, tests, workers=2, max_processes=16, tmp_dir=runs_dir)
  assert got == [1.0, 0.0, 0.0, 1.0, 1.0, 1.0]  # a neighbour's flood does not starve a spawner
  assert time.monotonic() - start < 30
  with pytest.raises(ValueError):
    score_batch([ADD], [], workers=2)
  assert os.listdir(runs_dir) == []


# --------------------------------------------------------------------------------------------
# Containment
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("body", ["while True:\n  pass\n", "import time\ntime.sleep(100)\n"],
                         ids=["infinite_loop", "sleep"])
def test_timeout(requires_sandbox, runs_dir, marker, body):
  start = time.monotonic()
  assert score(_marked(body, marker), NEVER, timeout_s=1.0, tmp_dir=runs_dir) == 0.0
  assert time.monotonic() - start < 6.0
  _assert_clean(marker, runs_dir)
  r = run_program(_marked(body, marker), timeout_s=1.0, tmp_dir=runs_dir)
  assert r.status == "timeout"
  _assert_clean(marker, runs_dir)


def test_memory_bomb(requires_sandbox, runs_dir, marker):
  body = "chunks = []\nwhile True:\n  chunks.append(bytearray(32 << 20))\n"
  assert score(_marked(body, marker), NEVER, memory_mb=256, tmp_dir=runs_dir) == 0.0
  r = run_program(_marked(body, marker), memory_mb=256, tmp_dir=runs_dir)
  assert r.status == "error" and b"MemoryError" in r.stderr
  _assert_clean(marker, runs_dir)


def test_process_flood(requires_sandbox, runs_dir, marker):
  # Tries for 10000 live processes; each child sleeps, so without a limit they would pile up.
  body = ("import time\nn = 0\nfor _ in range(10000):\n  try:\n    pid = os.fork()\n"
          "  except OSError:\n    continue\n  if pid == 0:\n    time.sleep(60)\n    os._exit(0)\n"
          "  n += 1\nprint('spawned', n, flush=True)\ntime.sleep(60)\n")
  r = run_program(_marked(body, marker), max_processes=16, timeout_s=1.5, tmp_dir=runs_dir)
  assert r.status == "timeout"
  spawned = int(r.stdout.split()[1])
  assert spawned < 16, r.stdout
  _assert_clean(marker, runs_dir)
  assert score(_marked(body, marker), NEVER, max_processes=16, timeout_s=1.5,
               tmp_dir=runs_dir) == 0.0
  _assert_clean(marker, runs_dir)


def test_no_network(requires_sandbox, runs_dir, marker):
  listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
  listener.bind(("127.0.0.1", 0))
  listener.listen(8)
  listener.setblocking(False)
  port = listener.getsockname()[1]
  body = (f"import socket\ntry:\n  socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
          f"  print('connected')\nexcept OSError as e:\n  print('refused', e)\n")
  try:
    tests = {"inputs": [""], "outputs": ["connected"]}
    assert score(_marked(body, marker), tests, tmp_dir=runs_dir) == 0.0
    r = run_program(_marked(body, marker), tmp_dir=runs_dir)
    assert b"refused" in r.stdout
    with pytest.raises(BlockingIOError):
      listener.accept()  # nobody ever connected
  finally:
    listener.close()
  _assert_clean(marker, runs_dir)


def test_cannot_write_outside(requires_sandbox, runs_dir, marker, tmp_path):
  targets = [str(tmp_path / "outside.txt"), f"/root/{marker}.txt", f"/tmp/{marker}.txt",
             f"/work/{marker}.txt", os.path.join(runs_dir, f"{marker}.txt"),
             os.path.join(os.getcwd(), f"{marker}.txt")]
  body = (f"for path in {targets!r} + ['/box/prog.py', 'relative.txt']:\n  try:\n"
          f"    with open(path, 'w') as f:\n      f.write('pwned')\n    print('wrote', path)\n"
          f"  except OSError:\n    pass\n")
  try:
    assert score(_marked(body, marker), NEVER, tmp_dir=runs_dir) == 0.0
    r = run_program(_marked(body, marker), tmp_dir=runs_dir)
    assert r.status == "ok"
    for path in targets:
      assert not os.path.exists(path), path
    # Only the sandbox's private /tmp (also the working directory) is writable.
    assert set(r.stdout.decode().split("\n")) <= {"", f"wrote /tmp/{marker}.txt",
                                                  "wrote relative.txt"}
  finally:
    for path in targets:
      if os.path.exists(path):
        os.remove(path)
  _assert_clean(marker, runs_dir)


def test_cannot_read_outside(requires_sandbox, runs_dir, marker, tmp_path):
  secret = uuid.uuid4().hex
  path = tmp_path / "secret.txt"
  path.write_text(secret)
  body = (f"for p in [{str(path)!r}, '/proc/1/root' + {str(path)!r}, '/root/.bash_history']:\n"
          f"  try:\n    print(open(p).read())\n  except OSError:\n    pass\n")
  assert score(_marked(body, marker), {"inputs": [""], "outputs": [secret]},
               tmp_dir=runs_dir) == 0.0
  r = run_program(_marked(body, marker), tmp_dir=runs_dir)
  assert secret.encode() not in r.stdout
  _assert_clean(marker, runs_dir)


def test_endless_output(requires_sandbox, runs_dir, marker):
  body = "while True:\n  sys.stdout.write('y' * 65536)\n"
  r = run_program(_marked(body, marker), max_output_bytes=1 << 16, timeout_s=20,
                  tmp_dir=runs_dir)
  assert r.status == "output_limit"
  assert r.seconds < 10  # stopped by the cap, not by the timeout
  assert len(r.stdout) <= (1 << 16) + (1 << 16)
  assert score(_marked(body, marker), NEVER, max_output_bytes=1 << 16, timeout_s=20,
               tmp_dir=runs_dir) == 0.0
  _assert_clean(marker, runs_dir)


def test_cannot_kill_parent_or_others(requires_sandbox, runs_dir, marker):
  canary = subprocess.Popen(["sleep", "60"])
  try:
    body = (f"import signal\nfor pid in (os.getppid(), {os.getpid()}, {canary.pid}, "
            f"1, -1):\n  try:\n    os.kill(pid, signal.SIGKILL)\n"
            f"  except OSError:\n    pass\nos.system('kill -9 -1')\nprint('still here')\n")
    assert score(_marked(body, marker), NEVER, tmp_dir=runs_dir) == 0.0
    assert score(_marked(body, marker), NEVER, tmp_dir=runs_dir) == 0.0
    assert canary.poll() is None, "the canary process was killed"
  finally:
    canary.kill()
    canary.wait()
  _assert_clean(marker, runs_dir)
  assert score(ADD, ADD_TESTS, tmp_dir=runs_dir) == 1.0  # and scoring still works


def test_no_user_namespaces_or_privileges(requires_sandbox, runs_dir, marker):
  body = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
          "print('unshare', libc.unshare(0x10000000))\n"  # CLONE_NEWUSER
          "st = open('/proc/self/status').read().splitlines()\n"
          "print(*[l for l in st if l.startswith(('CapEff', 'CapPrm', 'NoNewPrivs', 'Uid'))],"
          " sep='\\n')\n")
  r = run_program(_marked(body, marker), tmp_dir=runs_dir)
  out = r.stdout.decode()
  assert r.status == "ok", r.stderr
  assert "unshare -1" in out
  assert "CapEff:\t0000000000000000" in out and "CapPrm:\t0000000000000000" in out
  assert "NoNewPrivs:\t1" in out
  if os.geteuid() == 0:
    uid = int(next(l for l in out.splitlines() if l.startswith("Uid")).split()[1])
    assert uid >= 1 << 30  # the program does not run as root
  _assert_clean(marker, runs_dir)


def test_user_namespace_mode(requires_sandbox, runs_dir, marker, tmp_path, monkeypatch):
  """The path taken by non-root callers (bwrap makes a user namespace), exercised as root too."""
  monkeypatch.setattr(sandbox, "_is_root", lambda: False)
  assert score(ADD, ADD_TESTS, tmp_dir=runs_dir) == 1.0
  assert score("def f(x): return x * 2", {"inputs": [[2]], "outputs": [4], "fn_name": "f"},
               tmp_dir=runs_dir) == 1.0
  secret = uuid.uuid4().hex
  (tmp_path / "secret.txt").write_text(secret)
  body = (f"try:\n  print(open({str(tmp_path / 'secret.txt')!r}).read())\nexcept OSError:\n"
          f"  pass\nopen('/tmp/x', 'w').write('ok')\nfor p in ('/x', '/dev/x', '/box/x'):\n"
          f"  try:\n    open(p, 'w')\n    print('wrote', p)\n  except OSError:\n    pass\n")
  r = run_program(_marked(body, marker), tmp_dir=runs_dir)
  assert r.status == "ok", r.stderr
  assert r.stdout == b""
  _assert_clean(marker, runs_dir)


# --------------------------------------------------------------------------------------------
# Without bwrap
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("env, outcome", [
    ({}, "skip"), ({"CI": "false"}, "skip"), ({"CI": "0"}, "skip"), ({"CI": ""}, "skip"),
    ({"OAPL_REQUIRE_SANDBOX": "0"}, "skip"), ({"CI": "true"}, "fail"), ({"CI": "1"}, "fail"),
    ({"OAPL_REQUIRE_SANDBOX": "1"}, "fail"), ({"CI": "false", "OAPL_REQUIRE_SANDBOX": "1"}, "fail"),
])
def test_sandbox_tests_skip_without_bwrap_unless_required(monkeypatch, request, env, outcome):
  """`requires_sandbox` (tests/conftest.py): a fresh machine's `pytest` passes, CI's fails."""
  monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
  for name in ("CI", "OAPL_REQUIRE_SANDBOX"):
    monkeypatch.delenv(name, raising=False)
  for name, value in env.items():
    monkeypatch.setenv(name, value)
  kind = pytest.skip.Exception if outcome == "skip" else pytest.fail.Exception
  with pytest.raises(kind) as e:
    request.getfixturevalue("requires_sandbox")
  assert "bubblewrap (bwrap) not installed: apt-get install bubblewrap" in str(e.value)
  if outcome == "skip":
    assert "set CI=true or OAPL_REQUIRE_SANDBOX=1 to make this a failure" in str(e.value)


def test_sandbox_tests_run_with_bwrap_even_in_ci(monkeypatch, request):
  monkeypatch.setattr(shutil, "which", lambda name, *a, **k: "/usr/bin/bwrap")
  monkeypatch.setenv("CI", "true")
  assert request.getfixturevalue("requires_sandbox") is None  # neither skipped nor failed


def test_refuses_to_run_unsandboxed(monkeypatch, runs_dir):
  monkeypatch.setattr(sandbox, "_bwrap", lambda: None)
  with pytest.raises(RuntimeError, match="bubblewrap"):
    score(ADD, ADD_TESTS, tmp_dir=runs_dir)
  with pytest.raises(RuntimeError, match="bubblewrap"):
    score_batch([ADD, ADD], [ADD_TESTS, ADD_TESTS], workers=2, tmp_dir=runs_dir)
  assert os.listdir(runs_dir) == []


def test_unsandboxed_when_allowed_warns(monkeypatch, runs_dir):
  monkeypatch.setattr(sandbox, "_bwrap", lambda: None)
  with pytest.warns(RuntimeWarning, match="WITHOUT a sandbox"):
    assert score(ADD, ADD_TESTS, allow_unsandboxed=True, tmp_dir=runs_dir) == 1.0
  with pytest.warns(RuntimeWarning):
    assert score(ADD.replace("+", "-"), ADD_TESTS, allow_unsandboxed=True,
                 tmp_dir=runs_dir) == 0.0
  with pytest.warns(RuntimeWarning):
    assert score("def f(x): return [x]", {"inputs": [[1]], "outputs": [[1]],
                                           "fn_name": "f"},
                 allow_unsandboxed=True, tmp_dir=runs_dir) == 1.0
  with pytest.warns(RuntimeWarning):
    r = run_program("import time\ntime.sleep(30)", timeout_s=0.5, allow_unsandboxed=True,
                    tmp_dir=runs_dir)
  assert r.status == "timeout"
  assert os.listdir(runs_dir) == []


def test_the_group_is_killed_before_its_leader_is_reaped(monkeypatch, runs_dir):
  """The program's process group is killed while its leader is unreaped (a zombie or alive: its
  pid, the group's id, still taken), never after: a group kill after the reap could reach a
  process that reused the pid. Unsandboxed, so it runs everywhere."""
  seen, real_killpg = [], os.killpg

  def killpg(pgid, sig):
    try:
      exited = os.waitid(os.P_PID, pgid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None
      seen.append("exited, unreaped" if exited else "running")
    except ChildProcessError:
      seen.append("reaped")
    real_killpg(pgid, sig)

  monkeypatch.setattr(sandbox, "_bwrap", lambda: None)
  monkeypatch.setattr(os, "killpg", killpg)
  with pytest.warns(RuntimeWarning):
    r = run_program("print(1)", allow_unsandboxed=True, tmp_dir=runs_dir)
  assert (r.status, r.returncode, r.stdout) == ("ok", 0, b"1\n")
  with pytest.warns(RuntimeWarning):
    r = run_program("import time\ntime.sleep(30)", timeout_s=0.5, allow_unsandboxed=True,
                    tmp_dir=runs_dir)
  assert r.status == "timeout"
  assert seen == ["exited, unreaped", "running"]


# --------------------------------------------------------------------------------------------
# LiveCodeBench
# --------------------------------------------------------------------------------------------


def _compressed(tests):
  return base64.b64encode(zlib.compress(pickle.dumps(json.dumps(tests)))).decode()


def test_from_livecodebench_stdin():
  public = [{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]
  private = [{"input": "5 5\n", "output": "10\n", "testtype": "stdin"}]
  want = {"inputs": ["1 2\n", "5 5\n"], "outputs": ["3\n", "10\n"]}
  assert code.from_livecodebench(public, private) == want
  assert code.from_livecodebench(json.dumps(public), _compressed(private)) == want
  assert code.from_livecodebench(public) == {"inputs": ["1 2\n"], "outputs": ["3\n"]}


def test_from_livecodebench_functional_and_errors():
  public = [{"input": "[1, 2, 3]\n2", "output": "[3, 1, 2]", "testtype": "functional"}]
  private = [{"input": '"ab"\n0', "output": '"ab"', "testtype": "functional"}]
  got = code.from_livecodebench(public, _compressed(private), fn_name="rotate")
  assert got == {"inputs": [[[1, 2, 3], 2], ["ab", 0]], "outputs": [[3, 1, 2], "ab"],
                 "fn_name": "rotate"}
  with pytest.raises(ValueError, match="fn_name"):
    code.from_livecodebench(public, private)
  with pytest.raises(ValueError, match="mixed"):
    code.from_livecodebench(public, [{"input": "1", "output": "1", "testtype": "stdin"}],
                            fn_name="rotate")
  evil = base64.b64encode(zlib.compress(pickle.dumps(os.getcwd))).decode()  # not plain data
  with pytest.raises(pickle.UnpicklingError):
    code.from_livecodebench(public, evil, fn_name="rotate")


def test_from_livecodebench_scores(requires_sandbox, runs_dir):
  public = [{"input": "[1, 2, 3]\n1", "output": "[3, 1, 2]", "testtype": "functional"}]
  private = [{"input": "[4, 5]\n2", "output": "[4, 5]", "testtype": "functional"}]
  tests = code.from_livecodebench(public, private, fn_name="rotate")
  sol = ("class Solution:\n  def rotate(self, nums: List[int], k: int) -> List[int]:\n"
         "    k %= len(nums)\n    return nums[-k:] + nums[:-k]\n")
  assert score(sol, tests, tmp_dir=runs_dir) == 1.0
  assert score(sol.replace("-k:", "k:"), tests, fraction=True, tmp_dir=runs_dir) == 0.5
