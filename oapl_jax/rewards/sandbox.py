"""A sandbox for untrusted Python programs: bubblewrap, rlimits, a wall-clock timeout and an
output cap. It runs a program and reports what happened (`RunResult`); what the output means
is the caller's business.

    s = settings(timeout_s=2, memory_mb=512, max_output_bytes=1 << 20, max_processes=32,
                 allow_unsandboxed=False, python=None, tmp_dir=None, tmpfs_mb=64)
    if s.sandboxed:
      check(s)                                     # once per configuration: the sandbox works
    workdir = make_workdir({"prog.py": program}, s.tmp_dir)
    result = run_in(workdir, ["prog.py"], [], stdin_bytes, s)   # a fresh sandbox per run
    shutil.rmtree(workdir, ignore_errors=True)

Each run is one fresh sandbox:

* ``bwrap`` with new mount, PID, network (loopback only, not the host's), IPC, UTS and cgroup
  namespaces, ``--die-with-parent``, ``--new-session``, ``--clearenv`` plus a minimal
  environment. The file system is a read-only root holding only read-only binds of ``/usr``
  (``/bin``, ``/lib``, ``/lib64`` ... as on the host), the interpreter's prefix(es), a fresh
  per-run directory from ``tempfile.mkdtemp`` at ``/box`` (read-only: the files the caller put
  there; removed afterwards), a new ``/proc`` and a minimal ``/dev``, both read-only but for the
  device nodes, and a private, size-capped tmpfs at ``/tmp`` (``tmpfs_mb``), the only writable
  place and the working directory. Nothing is written to the host disk, so nothing is left
  behind, and a program cannot fill the disk with many files under the per-file cap.
* The interpreter is the real binary behind ``python`` (a venv resolves to its base
  interpreter) started with ``-I``: no environment, no script directory on ``sys.path``, no
  trainer (venv) site-packages; ``site`` still runs, so ``exit()`` works and only the base
  interpreter's own site-packages are importable.
* A seccomp filter (x86_64, aarch64) refuses new user namespaces (``clone``/``unshare``),
  ``mount``, ``ptrace``, ``bpf``, ``keyctl``, ``io_uring``, ``userfaultfd``,
  ``perf_event_open`` and module/kexec calls; ``clone3`` answers ENOSYS so libc falls back to
  ``clone``. bwrap also sets no_new_privs and mounts everything nosuid.
* A trusted launcher (``python -I -S -c``, inside the sandbox, before the program) sets
  ``RLIMIT_CPU`` (about ``timeout_s``), ``RLIMIT_AS`` (``memory_mb``), ``RLIMIT_FSIZE``,
  ``RLIMIT_CORE`` = 0 and ``RLIMIT_NPROC`` (``max_processes``), then execs the program. The
  trusted side enforces the wall-clock ``timeout_s`` and reads at most ``max_output_bytes`` of
  stdout; past either it SIGKILLs bwrap, whose PID-1 then dies (``--die-with-parent``), and the
  kernel kills everything left in the PID namespace.

How the process limit works. ``RLIMIT_NPROC`` is checked at fork against the number of tasks
(processes and threads) of the caller's real uid, counted per user namespace (Linux >= 5.14),
and is never enforced when that uid is the host's uid 0. A root caller's bwrap with a user
namespace maps the sandbox uid to host uid 0, so there the limit would do nothing. Hence:

* As **root**, bwrap runs privileged without a user namespace and keeps only
  ``CAP_SETUID``/``CAP_SETGID``; the launcher sets the limits, then drops to a random unused
  uid/gid in ``[2**30, 2**30 + 2**24)`` (no supplementary groups; its permitted and effective
  capability sets become empty) before the exec. The count starts at 1 for that fresh uid, so
  each sandbox gets its own ``max_processes`` and a fork bomb stops there.
* As a **normal user**, bwrap makes a user namespace (uid 65534 inside, mapped to the caller);
  the launcher sets ``RLIMIT_NPROC`` after the namespace exists, and the kernel then counts the
  tasks of that namespace (bwrap's PID-1 included), again per sandbox. Setting the limit before
  bwrap starts would instead cap it by every process the user runs on the host.

Without ``bwrap``, :func:`settings` raises ``RuntimeError`` unless ``allow_unsandboxed=True``:
then the program runs directly under the launcher's rlimits only, with a loud warning. That is
NOT safe for untrusted code (it can read and write the caller's files, use the network, kill the
caller; as root ``RLIMIT_NPROC`` does nothing).
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import io
import json
import logging
import os
import platform
import secrets
import selectors
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from typing import Mapping, Sequence

_log = logging.getLogger(__name__)

INSTALL_HINT = "install bubblewrap (Debian/Ubuntu: apt-get install -y bubblewrap)"

_STDERR_KEEP = 8192  # bytes of the program's stderr kept for debugging
_DRAIN_S = 1.0  # after a kill, how long to wait for the sandbox's pipes to close
_ROOT_UID_BASE = 1 << 30  # as root, programs run as a random uid in [base, base + span)
_ROOT_UID_SPAN = 1 << 24
_USERNS_UID = 65534  # uid/gid inside the sandbox's user namespace (non-root callers)
_BOX = "/box"  # where the per-run directory appears inside the sandbox
_PATH = "/usr/local/bin:/usr/bin:/bin"

# Runs inside the sandbox before the program (trusted: nothing untrusted has run yet).
# argv: uid cpu_s mem_bytes fsize_bytes nproc  then the interpreter arguments to exec.
_LAUNCHER = """\
import os, resource, sys
uid, cpu, mem, fsize, nproc = (int(a) for a in sys.argv[1:6])
for k, v in ((resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_AS, (mem, mem)),
             (resource.RLIMIT_FSIZE, (fsize, fsize)), (resource.RLIMIT_CORE, (0, 0)),
             (resource.RLIMIT_NPROC, (nproc, nproc))):
  resource.setrlimit(k, v)
if uid >= 0:
  os.setgroups([])
  os.setresgid(uid, uid, uid)
  os.setresuid(uid, uid, uid)
os.umask(0o077)
os.execv(sys.executable, [sys.executable, "-I", *sys.argv[6:]])
"""


@dataclasses.dataclass
class RunResult:
  """One execution. status: ok | error (nonzero exit) | timeout | output_limit | sandbox_error."""
  status: str
  returncode: int | None
  stdout: bytes
  stderr: bytes
  seconds: float


def _bwrap() -> str | None:
  return shutil.which("bwrap")


def _is_root() -> bool:
  return os.geteuid() == 0


@functools.lru_cache(maxsize=8)
def _interpreter(python: str) -> tuple[str, tuple[str, ...]]:
  """(real interpreter binary, real prefix directories it needs) for `python`."""
  exe = os.path.realpath(shutil.which(python) or python)
  if exe == os.path.realpath(sys.executable):
    prefixes = [sys.base_prefix, sys.base_exec_prefix]
  else:
    probe = "import json, sys; print(json.dumps([sys.base_prefix, sys.base_exec_prefix]))"
    out = subprocess.run([exe, "-I", "-c", probe], capture_output=True, check=True, timeout=60)
    prefixes = json.loads(out.stdout)
  prefixes.append(os.path.dirname(os.path.dirname(exe)))
  return exe, tuple(sorted({os.path.realpath(p) for p in prefixes}))


@functools.lru_cache(maxsize=4)
def _bwrap_options(bwrap: str) -> frozenset[str]:
  try:
    out = subprocess.run([bwrap, "--help"], capture_output=True, timeout=30)
  except (OSError, subprocess.SubprocessError):
    return frozenset()
  return frozenset(w for w in (out.stdout + out.stderr).decode(errors="replace").split()
                   if w.startswith("--"))


def _under(path: str, dirs) -> bool:
  return any(path == d or path.startswith(d.rstrip("/") + "/") for d in dirs)


@functools.lru_cache(maxsize=8)
def _filesystem_args(prefixes: tuple[str, ...]) -> tuple[str, ...]:
  """Read-only binds of /usr, the top-level lib/bin dirs and the interpreter prefixes."""
  args = ["--ro-bind", "/usr", "/usr"]
  covered = ["/usr"]
  for d in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
    if os.path.islink(d):
      args += ["--symlink", os.readlink(d), d]
    elif os.path.isdir(d):
      args += ["--ro-bind", d, d]
      covered.append(d)
  if os.path.exists("/etc/ld.so.cache"):
    args += ["--perms", "0755", "--dir", "/etc", "--ro-bind", "/etc/ld.so.cache",
             "/etc/ld.so.cache"]
  made = {"/", "/etc"}
  for p in prefixes:
    if p == "/" or _under(p, covered):
      continue
    parts = p.strip("/").split("/")
    for i in range(1, len(parts)):
      parent = "/" + "/".join(parts[:i])
      if parent not in made and not _under(parent, covered):
        # bwrap would create missing parents 0700: the dropped uid could not traverse them.
        args += ["--perms", "0755", "--dir", parent]
        made.add(parent)
    args += ["--ro-bind", p, p]
    covered.append(p)
  return tuple(args)


# seccomp (classic BPF), see the module docstring.
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_CLONE_NEWUSER = 0x10000000
_SYSCALLS = {  # name: (x86_64, aarch64)
    "clone": (56, 220), "clone3": (435, 435), "unshare": (272, 97), "setns": (308, 268),
    "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41), "chroot": (161, 51),
    "ptrace": (101, 117), "keyctl": (250, 219), "add_key": (248, 217),
    "request_key": (249, 218), "bpf": (321, 280), "perf_event_open": (298, 241),
    "userfaultfd": (323, 282), "io_uring_setup": (425, 425), "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427), "kexec_load": (246, 104), "kexec_file_load": (320, 294),
    "init_module": (175, 105), "finit_module": (313, 273), "delete_module": (176, 106),
    "name_to_handle_at": (303, 264), "open_by_handle_at": (304, 265), "open_tree": (428, 428),
    "move_mount": (429, 429), "fsopen": (430, 430), "fsconfig": (431, 431),
    "fsmount": (432, 432), "fspick": (433, 433), "mount_setattr": (442, 442),
}
_DENIED = tuple(n for n in _SYSCALLS if n not in ("clone", "clone3"))


@functools.lru_cache(maxsize=1)
def _seccomp_filter() -> bytes | None:
  """The filter as bwrap's --seccomp wants it (struct sock_filter[]), or None on other arches."""
  machine = platform.machine()
  if machine not in _AUDIT_ARCH:
    return None
  col = 0 if machine == "x86_64" else 1
  nr = {name: nums[col] for name, nums in _SYSCALLS.items()}
  ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
  allow, deny, nosys = 0x7FFF0000, 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS
  prog: list[tuple] = []  # (code, jt, jf, k); jt/jf may be label names, resolved below

  def emit(code, k, jt=0, jf=0):
    prog.append((code, jt, jf, k))

  emit(ld, 4)  # seccomp_data.arch
  emit(jeq, _AUDIT_ARCH[machine], 0, "nosys")  # other ABIs (i386, arm32): nothing works
  emit(ld, 0)  # seccomp_data.nr
  if machine == "x86_64":
    emit(jge, 0x40000000, "nosys", 0)  # the x32 ABI
  emit(jeq, nr["clone3"], "nosys", 0)  # flags in memory: answer ENOSYS, libc falls back
  for name in _DENIED:
    emit(jeq, nr[name], "deny", 0)
  emit(jeq, nr["clone"], 0, "allow")
  emit(ld, 16)  # low half of args[0] (little-endian): the clone flags
  emit(jset, _CLONE_NEWUSER, "deny", "allow")
  labels = {"allow": len(prog), "deny": len(prog) + 1, "nosys": len(prog) + 2}
  emit(ret, allow)
  emit(ret, deny)
  emit(ret, nosys)
  out = io.BytesIO()
  for i, (code, jt, jf, k) in enumerate(prog):
    jt = labels[jt] - i - 1 if isinstance(jt, str) else jt
    jf = labels[jf] - i - 1 if isinstance(jf, str) else jf
    out.write(struct.pack("=HBBI", code, jt, jf, k))
  return out.getvalue()


def _sandbox_argv(bwrap: str, exe: str, prefixes: tuple[str, ...], workdir: str, tmpfs_mb: int,
                  seccomp_fd: int | None, root: bool) -> list[str]:
  opts = _bwrap_options(bwrap)
  argv = [bwrap]
  if root:  # no user namespace: the launcher drops to an unprivileged uid itself
    argv += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
             "--unshare-cgroup-try", "--cap-drop", "ALL", "--cap-add", "CAP_SETUID",
             "--cap-add", "CAP_SETGID"]
  else:
    argv += ["--unshare-all", "--unshare-user", "--uid", str(_USERNS_UID), "--gid",
             str(_USERNS_UID)]
    if "--disable-userns" in opts:
      argv.append("--disable-userns")
  argv += ["--die-with-parent", "--new-session", "--hostname", "sandbox"]
  argv += _filesystem_args(prefixes)
  argv += ["--ro-bind", workdir, _BOX, "--proc", "/proc", "--dev", "/dev"]
  if "--size" in opts:
    argv += ["--size", str(tmpfs_mb << 20)]
  argv += ["--perms", "1777", "--tmpfs", "/tmp", "--remount-ro", "/dev", "--remount-ro", "/"]
  if seccomp_fd is not None:
    argv += ["--seccomp", str(seccomp_fd)]
  argv += ["--chdir", "/tmp", "--clearenv", "--setenv", "PATH", _PATH, "--setenv", "HOME",
           "/tmp", "--setenv", "LC_ALL", "C.UTF-8", "--"]
  return argv


@dataclasses.dataclass(frozen=True)
class Settings:
  """The limits of a run and where it runs (made by :func:`settings`). sandboxed: bwrap is
  used (False only when it is missing and `allow_unsandboxed` was given)."""
  timeout_s: float
  memory_mb: int
  max_output_bytes: int
  max_processes: int
  python: str
  tmp_dir: str | None
  tmpfs_mb: int
  sandboxed: bool


def _launcher_args(s: Settings, uid: int) -> list[str]:
  cpu = max(1, int(s.timeout_s + 0.999)) + 1
  return ["-I", "-S", "-c", _LAUNCHER, str(uid), str(cpu), str(s.memory_mb << 20),
          str(s.tmpfs_mb << 20), str(s.max_processes)]


def _exited(proc: subprocess.Popen, timeout_s: float) -> bool:
  """Whether `proc` exits within `timeout_s`, waited for without reaping it: until `_kill` reaps
  it, its pid (its group's id) stays taken, so no other process can come to own that group."""
  end = time.monotonic() + timeout_s
  while True:
    try:
      if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None:
        return True
    except ChildProcessError:  # reaped outside this module (SIGCHLD ignored): gone too
      return True
    if time.monotonic() >= end:
      return False
    time.sleep(0.002)


def _kill(proc: subprocess.Popen) -> None:
  """SIGKILLs the program's process group (bwrap's when sandboxed; unsandboxed, the program and
  any children it left), then reaps the leader. The leader is never reaped before this (`_exited`),
  so the group kill cannot reach a process that reused its pid."""
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except OSError:
    pass
  proc.kill()  # the leader itself, if its group could not be signalled
  proc.wait()


def _execute(argv: list[str], *, cwd: str, env: dict | None, stdin, pass_fds: tuple[int, ...],
             s: Settings) -> RunResult:
  start = time.monotonic()
  try:
    proc = subprocess.Popen(argv, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=cwd, env=env, close_fds=True, pass_fds=pass_fds,
                            start_new_session=True)
  except OSError as e:
    return RunResult("sandbox_error", None, b"", str(e).encode(), time.monotonic() - start)
  out, err = bytearray(), bytearray()
  status = None
  deadline = start + s.timeout_s
  sel = selectors.DefaultSelector()
  try:
    sel.register(proc.stdout, selectors.EVENT_READ)
    sel.register(proc.stderr, selectors.EVENT_READ)
    while status is None and sel.get_map():
      remaining = deadline - time.monotonic()
      if remaining <= 0:
        status = "timeout"
        break
      for key, _ in sel.select(remaining):
        chunk = os.read(key.fd, 1 << 16)
        if not chunk:
          sel.unregister(key.fileobj)
        elif key.fileobj is proc.stdout:
          out += chunk
          if len(out) > s.max_output_bytes:
            status = "output_limit"
            break
        elif len(err) < _STDERR_KEEP:
          err += chunk[:_STDERR_KEEP - len(err)]
    if status is None and not _exited(proc, max(0.0, deadline - time.monotonic())):
      status = "timeout"
  finally:
    _kill(proc)
    # Wait (bounded) for every holder of the pipes, i.e. the whole sandbox, to be gone.
    drain_end = time.monotonic() + _DRAIN_S
    while sel.get_map() and time.monotonic() < drain_end:
      for key, _ in sel.select(max(0.0, drain_end - time.monotonic())):
        if not os.read(key.fd, 1 << 16):
          sel.unregister(key.fileobj)
    sel.close()
    proc.stdout.close()
    proc.stderr.close()
  if status is None:
    status = "ok" if proc.returncode == 0 else "error"
    if s.sandboxed and proc.returncode != 0 and bytes(err).startswith(b"bwrap: "):
      status = "sandbox_error"
  return RunResult(status, proc.returncode, bytes(out), bytes(err), time.monotonic() - start)


def run_in(workdir: str, files: Sequence[str], args: Sequence[str], stdin_data: bytes,
           s: Settings) -> RunResult:
  """Runs `python -I files[0] files[1:]... args...` on `stdin_data` in a fresh sandbox.

  files: names of files in `workdir` (made by :func:`make_workdir`), passed as their paths as
  the program sees them (``/box/<name>`` inside the sandbox); args: passed verbatim.
  """
  exe, prefixes = _interpreter(s.python)
  with tempfile.TemporaryFile(dir=workdir) as stdin:  # unnamed: not visible in the sandbox
    stdin.write(stdin_data)
    stdin.seek(0)
    if not s.sandboxed:
      argv = [exe, *_launcher_args(s, -1), *[os.path.join(workdir, f) for f in files], *args]
      env = {"PATH": _PATH, "HOME": workdir, "LC_ALL": "C.UTF-8"}
      return _execute(argv, cwd=workdir, env=env, stdin=stdin, pass_fds=(), s=s)
    root = _is_root()
    uid = _ROOT_UID_BASE + secrets.randbelow(_ROOT_UID_SPAN) if root else -1
    filt = _seccomp_filter()
    fd = None
    try:
      if filt is not None:
        fd = os.memfd_create("oapl_seccomp", os.MFD_CLOEXEC)
        os.write(fd, filt)
        os.lseek(fd, 0, os.SEEK_SET)
      argv = _sandbox_argv(_bwrap(), exe, prefixes, workdir, s.tmpfs_mb, fd, root)
      argv += [exe, *_launcher_args(s, uid), *[f"{_BOX}/{f}" for f in files], *args]
      return _execute(argv, cwd="/", env=None, stdin=stdin, pass_fds=() if fd is None else (fd,),
                      s=s)
    finally:
      if fd is not None:
        os.close(fd)


def make_workdir(files: Mapping[str, str], tmp_dir: str | None) -> str:
  """A fresh per-run directory (under `tmp_dir`; default: tempfile's) holding `files`
  {name: text}, readable by the sandbox's unprivileged uid. The caller removes it."""
  workdir = tempfile.mkdtemp(prefix="oapl_code_", dir=tmp_dir)
  os.chmod(workdir, 0o755)  # the sandbox's unprivileged uid reads it through the bind
  for name, text in files.items():
    path = os.path.join(workdir, name)
    with open(path, "w", encoding="utf-8", errors="surrogatepass") as f:
      f.write(text)
    os.chmod(path, 0o644)
  return workdir


_warned_unsandboxed = False
_check_lock = threading.Lock()
_checked: set = set()


def settings(timeout_s, memory_mb, max_output_bytes, max_processes, allow_unsandboxed, python,
             tmp_dir, tmpfs_mb) -> Settings:
  """The :class:`Settings` of these limits.

  timeout_s: wall-clock limit per run (CPU limit: the same, rounded up, plus 1 s).
  memory_mb: address-space limit of the program. max_output_bytes: stdout cap per run.
  max_processes: task limit (processes + threads) per sandbox. python: the interpreter to run
  programs with (None: this one's base interpreter). tmp_dir: where the per-run directories
  are made (None: tempfile's). tmpfs_mb: size of the sandbox's writable /tmp.
  Raises RuntimeError if bwrap is missing, unless `allow_unsandboxed` (then a RuntimeWarning
  at the caller's caller, and programs run with the launcher's rlimits only)."""
  global _warned_unsandboxed
  sandboxed = _bwrap() is not None
  if not sandboxed:
    if not allow_unsandboxed:
      raise RuntimeError(
          "sandbox: bubblewrap (`bwrap`) was not found on PATH, and untrusted programs are "
          f"only run inside its sandbox: {INSTALL_HINT}. (allow_unsandboxed=True runs them with "
          "rlimits only, which is NOT safe.)")
    msg = ("sandbox: bwrap not found, running generated programs WITHOUT a sandbox "
           "(rlimits only): they can read/write your files, use the network and kill processes. "
           f"{INSTALL_HINT}.")
    warnings.warn(msg, RuntimeWarning, stacklevel=3)
    if not _warned_unsandboxed:
      _warned_unsandboxed = True
      _log.warning(msg)
  return Settings(float(timeout_s), int(memory_mb), int(max_output_bytes), int(max_processes),
                  python or sys.executable, tmp_dir, int(tmpfs_mb), sandboxed)


def check(s: Settings) -> None:
  """Once per configuration: a trivial program must run, else the sandbox is misconfigured
  (e.g. user namespaces disabled) and every run would silently fail (RuntimeError)."""
  key = (_bwrap(), s.python, _is_root())
  with _check_lock:
    if key in _checked:
      return
  probe = Settings(30.0, max(s.memory_mb, 256), 1 << 16, max(s.max_processes, 8), s.python,
                   s.tmp_dir, s.tmpfs_mb, True)
  workdir = make_workdir({"prog.py": "print('ok')\n"}, s.tmp_dir)
  try:
    r = run_in(workdir, ["prog.py"], [], b"", probe)
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  if r.status != "ok" or r.stdout.strip() != b"ok":
    raise RuntimeError(
        f"sandbox: the bwrap sandbox does not work here ({r.status}, exit {r.returncode}): "
        f"{r.stderr.decode(errors='replace').strip()[:2000]}")
  with _check_lock:
    _checked.add(key)


__all__ = ["INSTALL_HINT", "RunResult", "Settings", "check", "make_workdir", "run_in", "settings"]
