"""A run's workdir: what it holds (`Layout`), one run at a time (`WorkdirLock`), and a clean stop
on SIGTERM / SIGINT (`StopSignals`).

`Layout(workdir)` names every file and folder a run writes there; no other module spells them:

    run.lock          the lock (below), while a run holds the workdir
    run.lock.mutex    on a local disk: the file whose flock guards every change of run.lock
    checkpoints/      orbax step folders (`checkpoint.Checkpointer`), written by every process
    metrics.jsonl     one JSON line per logged step (`metrics.MetricsLog`), process 0
    events.out.*      TensorBoard scalars of the same steps (metrics.EventsFile, in the workdir itself)
    eval_before.json  the base's evaluation and warm-up record, before the first checkpoint
    config.json       the run's config (every setting), written with it and at each resume: a
                      resume or an evaluation is compared with it (oapl_jax/run_config.py)
    warmup_cache/     the warmed-up base (and its eval before) when warmup.cache_dir is unset:
                      a LoRA run's evaluate and export read it instead of warming up again
    summary.json      the finished run (`train.run`): evaluations, counters, config
    offline/          offline mode's round files (`rl.sources.OfflineSource`)
    remote/           remote mode's snapshots, rollout files, claims (oapl_jax/rl/remote.py)
    eval_step<N>.json an evaluation of checkpoint N (`python -m oapl_jax.evaluate`)

The workdir is a local folder or a bucket URL (`gs://bucket/run`): every file here goes through
`oapl_jax.storage`, which uses only what object storage has (whole-object reads and writes).

`WorkdirLock(workdir, lease_s)` creates `<workdir>/run.lock` (pid, host, start time, heartbeat)
atomically (in Cloud Storage a conditional create: `WorkdirLock._claim`), renews its heartbeat
every lease_s / 10 seconds from a background thread, and removes it on release; a second run on the same workdir is refused with a message naming the
holder. The lock is a lease: one not renewed for `lease_s` seconds is taken over from any host,
with a warning line (a preempted TPU slice, re-created with new host names, resumes on its
own). Sooner, on this host: a lock whose process is gone (kill -9), or that names this very
process (a restarted container that got the same pid back).

A run whose renewal finds the lock taken over (it was paused past its lease, and another run
took the workdir) stops at once: one line naming the new holder on stderr and exit code
`LEASE_LOST_EXIT`, from the renewing thread, so nothing more is written (a checkpoint being
written is abandoned; the new holder's restore removes its tmp folder). On a local disk every
change of the lock (claim, take-over of a stale one, renewal) is made under an exclusive
`flock` of `run.lock.mutex`, so of two runs that find the same stale lock exactly one takes it,
and a renewal never overwrites a lock another run has just taken. In Cloud Storage (gs://) each
change is conditional on the lock object's generation (`storage.write_if_generation`): a claim
creates it only if there is none, a take-over deletes only the stale record it read, a renewal
rewrites only its own last write, with the same guarantees. Other object stores have no
conditional writes here: the read-back of `_claim` only.

`StopSignals` turns SIGTERM (what a TPU VM or a scheduler sends before preemption) and SIGINT
into a request the training loop reads between steps (`requested`), so the run finishes its
step, saves a checkpoint and exits with one line. Outside `deferring()` (warm-up, evaluation:
nothing new to save) the stop is immediate: `Interrupted` is raised. A second signal inside it
(the user or a scheduler in a hurry; the step or its save is still running) exits the process
at once with one line and 128 + the signal number, as a kill would: the save in flight is
abandoned (its tmp folder is removed when the run resumes), the checkpoints before it are kept.
Multi-host runs stop every process at the same step: `oapl_jax.train` asks, after each step,
whether any process has `requested` set (`distributed.any_process`); process 0 alone holds the
lock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid

from oapl_jax import storage
from oapl_jax.errors import Interrupted, UserError  # noqa: F401 (Interrupted: imported from here too)

LOCK_NAME = "run.lock"
LEASE_LOST_EXIT = 76  # the run lost its workdir lease to another run (75: a lost process)
SETTLE_S = 2.0  # object storage: seconds between writing the lock and reading it back (WorkdirLock._claim)


@contextlib.contextmanager
def exclusive_flock(path: str, on_wait=None):
  """An exclusive flock of the local file `path` (made if missing) while the block runs, released
  when it ends or the process dies; `on_wait()` first if another process holds it."""
  import fcntl  # noqa: PLC0415 (POSIX; local files only)
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      if on_wait:
        on_wait()
      fcntl.flock(fd, fcntl.LOCK_EX)
    yield
  finally:
    os.close(fd)  # releases the flock


@dataclasses.dataclass(frozen=True)
class Layout:
  """The paths of a run's files in `root` (the module docstring says what each holds)."""

  root: str

  def _path(self, name: str) -> str:
    return storage.join(self.root, name)

  @property
  def lock(self) -> str:
    return self._path(LOCK_NAME)

  @property
  def checkpoints(self) -> str:
    return self._path("checkpoints")

  @property
  def metrics(self) -> str:
    return self._path("metrics.jsonl")

  @property
  def eval_before(self) -> str:
    return self._path("eval_before.json")

  @property
  def config(self) -> str:
    return self._path("config.json")

  @property
  def warmup_cache(self) -> str:
    return self._path("warmup_cache")

  @property
  def summary(self) -> str:
    return self._path("summary.json")

  @property
  def offline(self) -> str:
    return self._path("offline")

  @property
  def remote(self) -> str:
    return self._path("remote")

  def eval_step(self, step: int) -> str:
    return self._path(f"eval_step{step}.json")


def check_usable(workdir: str) -> None:
  """Refuses (one line) a local --workdir that exists and is not a folder."""
  if not storage.is_remote(workdir) and os.path.exists(workdir) and not os.path.isdir(workdir):
    raise UserError(f"--workdir={workdir} is a file, not a folder: give a folder (new or a run's)")


def check_writable(workdir: str) -> None:
  """Refuses (one line) a local --workdir this process cannot write in (a read-only disk, an
  immutable folder, no permission), before any work: a file is created and removed there."""
  if not storage.is_remote(workdir):
    _check_can_write("workdir", workdir, workdir)


def check_output_file(flag: str, path: str) -> None:
  """Refuses (one line) `--<flag>=path` for a file a command will write, before the work that
  fills it: a folder is there, or its folder refuses writes (a local path; a bucket is not checked)."""
  if storage.is_remote(path):
    return
  if os.path.isdir(path):
    raise UserError(f"--{flag}={path} is a folder, not a file: give the file to write (e.g. {path.rstrip('/')}.npz)")
  _check_can_write(flag, path, os.path.dirname(os.path.abspath(path)))


def check_output_folder(flag: str, path: str) -> None:
  """The same for `--<flag>=path`, a folder a command will write its files into: a file is there,
  or the folder cannot be made or written in."""
  if storage.is_remote(path):
    return
  if os.path.exists(path) and not os.path.isdir(path):
    raise UserError(f"--{flag}={path} is a file, not a folder: give a folder to write into")
  _check_can_write(flag, path, path)


def _check_can_write(flag: str, path: str, folder: str) -> None:
  """A file is made and removed in `folder`, or, where it does not exist yet, in the nearest
  folder above it that does (whoever writes first makes it): nothing is left behind, so a run
  refused later (its memory plan, another run's config) has not touched its workdir."""
  existing = os.path.abspath(folder)
  while not os.path.exists(existing) and os.path.dirname(existing) != existing:
    existing = os.path.dirname(existing)
  probe = os.path.join(existing, f".write_check.{os.getpid()}")
  try:
    if not os.path.isdir(existing):
      raise NotADirectoryError(20, "not a folder", existing)
    with open(probe, "w"):
      pass
    os.remove(probe)
  except OSError as e:
    raise UserError(f"--{flag}={path}: cannot write there ({e.strerror or e}: {folder})") from e


class WorkdirBusy(UserError):
  """Another run holds the workdir."""


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # exists, owned by someone else
    return True
  return True


_HELD_HERE: set[str] = set()  # lock paths this process holds now (a second run in it is refused)


def _record(text: str) -> dict:
  """A lock file's record; {} if it does not parse (half-written by a holder that died)."""
  try:
    record = json.loads(text)
  except ValueError:
    return {}
  return record if isinstance(record, dict) else {}


class WorkdirLock:
  """`with WorkdirLock(workdir, lease_s):` holds `<workdir>/run.lock` for the block, renewing
  its heartbeat every `lease_s / 10` seconds (module docstring). `wait_s`: how long a lock that
  looks alive is waited for (its lease may run out: a scheduler that restarts a preempted job
  at once) before the run is refused; 0 refuses at once."""

  def __init__(self, workdir: str, lease_s: float = 300.0, wait_s: float = 0.0):
    self.path = Layout(storage.absolute(workdir)).lock
    self.lease_s = float(lease_s)
    self.wait_s = float(wait_s)
    self.held = False
    self._conditional = storage.has_generations(self.path)  # Cloud Storage: writes conditional on generations
    self._generation: int | None = None  # there: the generation of our lock object
    self._me: dict = {}
    self._stop = threading.Event()
    self._renewer: threading.Thread | None = None

  @contextlib.contextmanager
  def _mutex(self):
    """Local disk: an exclusive flock of `run.lock.mutex` for a read-decide-write of the lock
    (released when the block ends, or when the process dies). In a bucket: nothing."""
    if storage.is_remote(self.path):
      yield
      return
    with exclusive_flock(self.path + ".mutex"):
      yield

  def holder(self) -> dict | None:
    """The lock file's contents (pid, host, started, heartbeat, token), {} if unreadable, None
    if there is none."""
    try:
      return _record(storage.read_text(self.path))
    except FileNotFoundError:
      return None
    except OSError:
      return {}

  def _read(self) -> tuple[dict | None, int | None]:
    """(`holder()`, the lock object's generation): in Cloud Storage read together, so a change
    conditional on it fails if the lock changed since; elsewhere the generation is None."""
    if not self._conditional:
      return self.holder(), None
    got = storage.read_generation(self.path)
    return (None, None) if got is None else (_record(got[0].decode(errors="replace")), got[1])

  def acquire(self) -> None:
    deadline = time.monotonic() + self.wait_s
    while True:
      try:
        return self._acquire_once()
      except WorkdirBusy as busy:
        left = deadline - time.monotonic()
        if left <= 0:
          raise
        print(f"{busy} -- waiting up to {left:.0f} s more for it to be released or its lease to "
              "run out", file=sys.stderr, flush=True)
        time.sleep(min(max(self.lease_s / 10, 0.05), 30.0, left))

  def _acquire_once(self) -> None:
    storage.makedirs(storage.dirname(self.path))
    self._me = {"pid": os.getpid(), "host": socket.gethostname(),
                "started": datetime.datetime.now().isoformat(timespec="seconds"),
                "heartbeat": time.time(), "token": uuid.uuid4().hex}
    with self._mutex():  # one starter at a time decides and claims (local disk)
      for _ in range(2):  # a second try after removing a stale lock
        if not self._claim():
          holder, generation = self._read()
          if holder is None:
            continue  # released between our two calls
          why = self._stale(holder)
          if why is None:
            raise WorkdirBusy(self._busy_message(holder)) from None
          note = (f"workdir lock {self.path} of process {holder.get('pid')} on "
                  f"{holder.get('host')}: {why}; taking it over")
          print(note, file=sys.stderr, flush=True)  # a normal event: one plain line, once
          logging.warning("%s", note, extra={"said": True})  # not printed again by absl's handler
          if generation is None:
            storage.remove(self.path)
          else:  # only the record we read: if another starter took it over since, the claim finds it
            storage.remove_if_generation(self.path, generation)
          continue
        self.held = True
        _HELD_HERE.add(self.path)
        self._start_renewing()
        return
    raise WorkdirBusy(f"could not take the workdir lock {self.path}: another run is starting there")

  def _claim(self) -> bool:
    """Writes our record if there is no lock; True if we then hold it. Locally an exclusive
    create; in Cloud Storage a create conditional on there being no object (generation 0).
    Other object stores have neither: the record is written if no lock is there, and read back
    after `SETTLE_S` seconds; of two runs that wrote at once, the last write stands and the
    other run sees its record and is refused (two runs started on one such workdir within a
    second of each other are not told apart)."""
    text = json.dumps(self._me)
    if self._conditional:
      self._generation = storage.write_if_generation(self.path, text.encode(), 0)
      return self._generation is not None
    if not storage.is_remote(self.path):
      return storage.create_exclusive(self.path, text)
    if storage.exists(self.path):
      return False
    storage.write_text(self.path, text)
    time.sleep(SETTLE_S)
    return (self.holder() or {}).get("token") == self._me["token"]

  def _heartbeat(self, holder: dict) -> float:
    """When `holder` last renewed the lock: its heartbeat, else (an older lock file) its mtime."""
    if "heartbeat" in holder:
      return float(holder["heartbeat"])
    return storage.mtime(self.path)

  def _stale(self, holder: dict) -> str | None:
    """Why the lock of `holder` may be taken over, or None if its run may be alive."""
    if not holder:
      return "unreadable for over a minute" if time.time() - self._heartbeat({}) > 60 else None
    age = time.time() - self._heartbeat(holder)
    if age > self.lease_s:
      return f"not renewed for {age:.0f} s (the lease is {self.lease_s:g} s)"
    if holder.get("host") != socket.gethostname():
      return None
    pid = int(holder.get("pid", -1))
    if pid == os.getpid():
      return None if self.path in _HELD_HERE else "it names this process (a restart that got the same pid back)"
    return None if _alive(pid) else "that process is gone"

  @staticmethod
  def _who(holder: dict, nobody: str) -> str:
    """The run a lock record names, `nobody` for an empty one."""
    return (f"process {holder.get('pid')} on {holder.get('host')} (started {holder.get('started')})"
            if holder else nobody)

  def _busy_message(self, holder: dict) -> str:
    who = self._who(holder, "a run that is starting")
    workdir = storage.dirname(self.path)
    return (f"--workdir={workdir} is in use by {who}; use another --workdir, or stop that run "
            f"(a run that is gone is taken over once it has not renewed the lock for "
            f"{self.lease_s:g} s; or delete {self.path})")

  def _start_renewing(self) -> None:
    self._stop.clear()
    self._renewer = threading.Thread(target=self._renew, name="workdir-lease", daemon=True)
    self._renewer.start()

  def _renew(self) -> None:
    """Rewrites the heartbeat every lease_s / 10 seconds while the lock is ours (written aside,
    then renamed: a reader never sees half a file); if it is not ours any more, `_lost`."""
    while not self._stop.wait(max(self.lease_s / 10, 0.05)):
      with self._mutex():
        if self._stop.is_set():
          return
        if self._conditional:  # rewritten only if no one wrote it since our last write
          self._me["heartbeat"] = time.time()
          renewed = storage.write_if_generation(self.path, json.dumps(self._me).encode(), self._generation)
          if renewed is None:
            return self._lost(self.holder() or {})
          self._generation = renewed
          continue
        holder = self.holder() or {}
        if holder.get("token") != self._me["token"]:
          return self._lost(holder)
        self._me["heartbeat"] = time.time()
        storage.write_text(self.path, json.dumps(self._me))

  def _lost(self, holder: dict) -> None:
    """The lock was taken over: one line and out now (`LEASE_LOST_EXIT`), writing nothing more."""
    who = self._who(holder, "nobody (the lock was removed)")
    print(f"error: lost the lease of --workdir={storage.dirname(self.path)}: it is now held by "
          f"{who}; stopping at once without writing anything more", file=sys.stderr, flush=True)
    self.on_lost()

  @staticmethod
  def on_lost() -> None:
    """What a lost lease does after its line (tests replace it): exit now, as a kill would."""
    os._exit(LEASE_LOST_EXIT)

  def release(self) -> None:
    if self.held:
      self.held = False
      _HELD_HERE.discard(self.path)
      self._stop.set()
      if self._renewer is not None:
        self._renewer.join()
      with self._mutex():
        if self._conditional:
          storage.remove_if_generation(self.path, self._generation)  # not another run's
        elif (self.holder() or {}).get("token") == self._me["token"]:  # not another run's
          storage.remove(self.path)

  def __enter__(self) -> "WorkdirLock":
    self.acquire()
    return self

  def __exit__(self, *exc) -> None:
    self.release()


class StopSignals:
  """`with StopSignals() as stop:` catches SIGTERM / SIGINT for the block (main thread only); a
  signal the process was started ignoring (SIGINT in a job a script started with `&`) stays ignored.

  Outside `deferring` a signal raises `Interrupted` wherever the main thread is. Where Python
  cannot raise (a garbage-collector callback, JAX registers one; a `__del__`; a weakref
  callback) the exception is printed as "Exception ignored in ..." and dropped, and the command
  would go on; such a dropped `Interrupted` sends the signal again to the main thread a moment
  later (`sys.unraisablehook`), until it lands where it stops the command."""

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self.requested: int | None = None  # the signal number asked for, once one arrived
    self._deferring = False
    self._previous = {}
    self._previous_hook = None

  def _unraisable(self, unraisable) -> None:
    """`sys.unraisablehook`: a dropped `Interrupted` is sent again (quietly); anything else as before."""
    if isinstance(unraisable.exc_value, Interrupted):
      resend = threading.Timer(0.05, signal.pthread_kill,
                               (threading.main_thread().ident, unraisable.exc_value.signum))
      resend.daemon = True
      resend.start()
      return
    self._previous_hook(unraisable)

  def _handle(self, signum, frame) -> None:
    del frame
    name = signal.Signals(signum).name
    if self._deferring and self.requested is None:
      self.requested = signum
      print(f"{name}: stopping after this step (a checkpoint is saved); "
            "send it again to stop at once", file=sys.stderr, flush=True)
      return
    if self._deferring:  # a second signal: out now, mid-step or mid-save, without tracebacks
      print(f"error: stopped at once by a second {name}, without a checkpoint of this step; the "
            "checkpoints before it are kept: run the same command again to resume",
            file=sys.stderr, flush=True)
      os._exit(128 + signum)  # as a kill would: a half-written save is removed on resume
    raise Interrupted(signum, f"stopped by {name}")

  @contextlib.contextmanager
  def deferring(self):
    """Inside, a first signal only sets `requested`; the caller stops at its next check."""
    self._deferring = True
    try:
      yield self
    finally:
      self._deferring = False

  def __enter__(self) -> "StopSignals":
    if threading.current_thread() is threading.main_thread():
      for s in self.SIGNALS:
        if signal.getsignal(s) is not signal.SIG_IGN:  # one ignored at start (a background job's
          self._previous[s] = signal.signal(s, self._handle)  # SIGINT) stays ignored, as Python leaves it
      self._previous_hook, sys.unraisablehook = sys.unraisablehook, self._unraisable
    return self

  def __exit__(self, *exc) -> None:
    for s, handler in self._previous.items():
      signal.signal(s, handler)
    if self._previous_hook is not None:
      sys.unraisablehook, self._previous_hook = self._previous_hook, None
    self._previous = {}
