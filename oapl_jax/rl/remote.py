"""Remote mode (`rl.mode="remote"`): sampler jobs beside the trainer, joined through the workdir.

pi_old changes only every `rl.lag` steps, so a trainer and any number of sampler jobs (each
its own JAX job on its own devices: `python -m oapl_jax.sample`) need no shared runtime: they
exchange files in `<workdir>/remote/` (a local or shared folder, or a bucket URL; every file
goes through `oapl_jax.storage`):

    snapshots/v<version>.npz   pi_old of each refresh (model.dtype), published by the trainer
    rollouts/r<index>.npz      rollout <index>: rl.groups_per_rollout groups x G answers, in
                               the offline file format (`offline.read` and its checks), stamped
                               with the snapshot version that sampled it
    claims/r<index>            a sampler's claim on a rollout it is sampling
    trainer.json               the trainer's progress: the next rollout it takes, its version,
                               step, and `done` once the run has finished

Rollout <index> answers the problems, with the sampling keys, that a sync run's rollout
<index> answers (`loop.rollout_problems`). The trainer takes rollouts in index order, each
once (`counters.rollouts` is the next; a checkpoint holds it), and waits, saying so, while the
next is not written. A sampler claims the lowest rollout from the trainer's next on that has
no file and no live claim, at most `rl.remote.ahead` ahead, samples it with the newest
snapshot (with `rl.remote.reproducible`: with the snapshot a sync run would use, version
index // rl.lag, so one sampler gives the sync run's losses bit for bit), writes it and drops
its claim. A sampler renews its claim while it samples and drops it however it stops
(`holding`); a claim with no file whose process is gone (on the claim's own host) or that was not
renewed for `rl.remote.claim_timeout_s` is a dead sampler's and is taken over (a paused sampler's
rollout may then be sampled twice; the trainer reads one). The trainer publishes in its status
the settings a sampler must share with it (`served_settings`); a sampler that differs is refused
at its start (`check_serves`).

Every file is written whole and made visible at once (written aside and renamed; in a bucket,
one upload), with a sha256 of its contents: a sampler killed mid-file leaves nothing a reader
takes; a damaged snapshot is refused (`SnapshotError`) and the sampler keeps the one it has; a
damaged rollout file is set aside by the trainer (renamed `.rejected`) and sampled again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import socket
import threading
import time
import uuid
import zipfile

import jax
import numpy as np

from oapl_jax import storage
from oapl_jax.errors import UserError
from oapl_jax.metrics import say
from oapl_jax.rl import offline
from oapl_jax.workdir import exclusive_flock

SNAPSHOT_FORMAT = "oapl_jax.snapshot/1"
_SNAPSHOT = re.compile(r"^v(\d{8})\.npz$")
_ROLLOUT = re.compile(r"^r(\d{9})\.npz$")
_CLAIM = re.compile(r"^r(\d{9})$")


class SnapshotError(UserError):
  """A published snapshot that cannot be loaded: unreadable, damaged, or another model's."""


class OtherBase(UserError):
  """A LoRA run's snapshot (its adapters) trained on another frozen base than the sampler job's:
  no snapshot of that trainer will ever do, so the job stops (not a `SnapshotError`, which a job
  outlives by keeping the snapshot it holds)."""


# --- where things are ---------------------------------------------------------------------------


def snapshot_path(root: str, version: int) -> str:
  return storage.join(root, "snapshots", f"v{version:08d}.npz")


def rollout_path(root: str, index: int) -> str:
  return storage.join(root, "rollouts", f"r{index:09d}.npz")


def claim_path(root: str, index: int) -> str:
  return storage.join(root, "claims", f"r{index:09d}")


def status_path(root: str) -> str:
  return storage.join(root, "trainer.json")


def published_versions(root: str) -> list[int]:
  """Versions of the complete snapshots in `root` (a file half-written has another name)."""
  return [int(m.group(1)) for m in map(_SNAPSHOT.match, storage.listdir(storage.join(root, "snapshots"))) if m]


def written_rollouts(root: str) -> list[int]:
  return [int(m.group(1)) for m in map(_ROLLOUT.match, storage.listdir(storage.join(root, "rollouts"))) if m]


def version_of(index: int, lag: int) -> int:
  """The snapshot version a sync run samples rollout `index` with (one rollout per step)."""
  return index // lag


# --- snapshots ----------------------------------------------------------------------------------


def _as_stored(x: np.ndarray) -> np.ndarray:
  """A weight's bytes as unsigned integers of its width: npz keeps those for every dtype
  (bfloat16 included); the header names the dtype to view them as."""
  return np.ascontiguousarray(x).view(f"u{x.itemsize}")


def publish_snapshot(root: str, params, *, version: int, snapshot_step: int, model_meta: dict) -> str:
  """Writes pi_old `params` (an nnx.State on this process's devices) as snapshot `version`,
  at once (a reader never sees half of it). Returns its path. Under model.lora `params` are the
  adapters alone and `model_meta` holds the adapters' settings (`lora`) and the frozen base's
  identity (`base`: model.path and sha256), which a sampler job checks its own base against."""
  flat, _ = jax.tree_util.tree_flatten_with_path(params)
  names = [jax.tree_util.keystr(path) for path, _ in flat]
  values = [np.asarray(jax.device_get(x)) for _, x in flat]
  stored = [_as_stored(v) for v in values]
  header = {"format": SNAPSHOT_FORMAT, "version": int(version), "snapshot_step": int(snapshot_step),
            "model": model_meta,
            "leaves": [{"name": n, "dtype": v.dtype.name, "shape": list(v.shape)} for n, v in zip(names, values)]}
  text = json.dumps(header, sort_keys=True)
  leaves = {f"leaf{i}": a for i, a in enumerate(stored)}
  buf = io.BytesIO()
  np.savez(buf, header=np.array(text), sha256=np.array(offline.digest(text, leaves)), **leaves)
  path = snapshot_path(root, version)
  storage.write_bytes(path, buf.getvalue())
  return path


def read_snapshot(path: str, abstract, model_meta: dict):
  """(params shaped as `abstract` (an nnx.State of ShapeDtypeStructs), header) of the snapshot
  at `path`; `SnapshotError` naming it if it does not open, its digest fails or it is another
  model's."""
  def fail(why: str):
    raise SnapshotError(f"snapshot {path}: {why}")

  try:
    with np.load(io.BytesIO(storage.read_bytes(path)), allow_pickle=False) as z:
      members = {name: z[name] for name in z.files}
  except FileNotFoundError:
    fail("no such file (removed by the trainer: a newer one is published)")
  except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
    fail(f"unreadable: truncated or corrupted ({type(e).__name__}: {e})")
  if "header" not in members or "sha256" not in members:
    fail("not a snapshot (no header or sha256)")
  text = str(members["header"])
  leaves = {name: a for name, a in members.items() if name not in ("header", "sha256")}
  stored = [leaves.get(f"leaf{i}") for i in range(len(leaves))]
  if any(a is None for a in stored) or offline.digest(text, leaves) != str(members["sha256"]):
    fail("checksum mismatch: the file is damaged")
  header = json.loads(text)
  if header.get("format") != SNAPSHOT_FORMAT:
    fail(f"format {header.get('format')!r}, expected {SNAPSHOT_FORMAT!r}")
  check_base(path, (header.get("model") or {}).get("base"), model_meta.get("base"))
  if header.get("model") != model_meta:
    fail("written for another model (its architecture differs from config.model's)")
  flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
  leaves = header["leaves"]
  if [jax.tree_util.keystr(p) for p, _ in flat] != [leaf["name"] for leaf in leaves]:
    fail("its weights are not this model's (names differ)")
  values = []
  for (_, want), leaf, a in zip(flat, leaves, stored):
    value = a.view(jax.numpy.dtype(leaf["dtype"]))  # bfloat16 too (ml_dtypes)
    if tuple(value.shape) != tuple(want.shape):
      fail(f"weight {leaf['name']} has shape {value.shape}, this model's {want.shape}")
    values.append(value)
  return jax.tree_util.tree_unflatten(treedef, values), header


def check_base(path: str, theirs: dict | None, mine: dict | None) -> None:
  """model.lora: refuses (`OtherBase`, one line) the adapters at `path` if the base they were
  trained on (`theirs`, the snapshot header's {path, sha256}) is not the sampler job's (`mine`)."""
  if theirs is None or mine is None or theirs == mine:
    return

  def said(base: dict) -> str:
    return f"model.path={base.get('path')!r}, sha256 {str(base.get('sha256'))[:16]}..."

  raise OtherBase(f"snapshot {path}: its adapters were trained on another base ({said(theirs)}) than this "
                  f"sampler job's ({said(mine)}): give it the trainer's model.path and warm-up settings "
                  "(docs/remote.md)")


def remove_old_snapshots(root: str, keep_from: int) -> None:
  """Removes snapshots older than version `keep_from`."""
  for v in published_versions(root):
    if v < keep_from:
      storage.remove(snapshot_path(root, v))


# --- claims -------------------------------------------------------------------------------------


def owner_id() -> str:
  """A sampler job's name in its claims: host, pid and a random tag (a restarted process that got
  the same pid back is another owner)."""
  return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _alive(pid: int) -> bool:
  """Whether process `pid` of this host exists (as the workdir lock asks: oapl_jax/workdir.py)."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except (PermissionError, OverflowError, ValueError):  # another user's process; or no pid at all
    return True
  return True


@dataclasses.dataclass(frozen=True)
class Claim:
  """A claim's record: its owner (`owner_id`) and when it was made or last renewed."""

  owner: str
  since: float  # seconds since the epoch

  @property
  def host(self) -> str:
    return self.owner.split(":")[0]

  @property
  def pid(self) -> int:
    try:
      return int(self.owner.split(":")[1])
    except (IndexError, ValueError):
      return -1

  def stale(self, timeout_s: float) -> str | None:
    """Why this claim's sampler is taken for dead (its claim may be taken over), or None.
    On the claim's own host a process that is gone is dead at once (as run.lock's holder is);
    elsewhere, a claim not renewed for `timeout_s` (a live sampler renews it: `holding`)."""
    if self.host == socket.gethostname() and self.pid not in (-1, os.getpid()) and not _alive(self.pid):
      return f"its process {self.pid} on this host is gone"
    age = time.time() - self.since
    if age > timeout_s:
      return f"not renewed for {age:.0f}s (rl.remote.claim_timeout_s={timeout_s:g})"
    return None

  def describe(self) -> str:
    return f"sampler {self.host} pid {self.pid}, renewed {max(time.time() - self.since, 0):.0f}s ago"


def read_claim(root: str, index: int) -> Claim | None:
  """Rollout `index`'s claim, or None if there is none."""
  path = claim_path(root, index)
  try:
    text = storage.read_text(path)
  except FileNotFoundError:
    return None
  return _parse_claim(text, None if storage.has_generations(path) else storage.mtime(path))


def _parse_claim(text, mtime: float | None) -> Claim:
  """A claim from its text. Its age: the file's mtime on a disk or a plain object store (each
  renewal rewrites it), the record's time in Cloud Storage (as it has always been read there).
  A record that does not parse (an exclusive create fills the file just after making it) is
  as old as the file, owned by no one we can name."""
  try:
    record = json.loads(text)
    owner, since = str(record["owner"]), float(record["time"])
  except (ValueError, KeyError, TypeError):
    owner, since = "?:-1", 0.0 if mtime is None else mtime
  return Claim(owner, since if mtime is None else mtime)


def claim(root: str, index: int, owner: str, timeout_s: float) -> bool:
  """Claims rollout `index` for `owner`: True if this sampler may sample it now.

  Local: an exclusive create (of two samplers, one wins); a stale claim (`Claim.stale`: its
  process gone on this host, or not renewed for `timeout_s`) whose rollout is not written is a
  dead sampler's and is taken over, under a flock of `claims/.mutex` (of two samplers taking it
  over, one does). In Cloud Storage the same, by writes conditional on the claim's generation
  (a create only if there is none; a dead claim replaced only as it was read). Other object
  stores: written, then read back after a moment, as the workdir lock does there."""
  path = claim_path(root, index)
  text = json.dumps({"owner": owner, "time": time.time()})
  if storage.has_generations(path):
    if storage.write_if_generation(path, text.encode(), 0) is not None:
      return True
    got = storage.read_generation(path)
    if got is None:  # released between the two calls: taken next time
      return False
    if not _take_over(root, index, _parse_claim(got[0].decode(errors="replace"), None), owner, timeout_s):
      return False
    return storage.write_if_generation(path, text.encode(), got[1]) is not None
  if not storage.is_remote(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if storage.create_exclusive(path, text):
      return True
    with exclusive_flock(storage.join(root, "claims", ".mutex")):
      held = read_claim(root, index)
      if held is None or not _take_over(root, index, held, owner, timeout_s):
        return False
      storage.write_text(path, text)
      return True
  held = read_claim(root, index)
  if held is not None and not _take_over(root, index, held, owner, timeout_s):
    return False
  storage.write_text(path, text)
  time.sleep(1.0)
  try:
    return json.loads(storage.read_text(path)).get("owner") == owner
  except (FileNotFoundError, json.JSONDecodeError):
    return False


def _take_over(root: str, index: int, held: Claim, owner: str, timeout_s: float) -> bool:
  """Whether `held`, rollout `index`'s claim, is a dead sampler's with no file written: then one
  line says who takes it over from whom, and why."""
  why = held.stale(timeout_s)
  if why is None or storage.exists(rollout_path(root, index)):
    return False
  say(f"sampler {owner}: taking over rollout {index} from {held.describe()}: {why}")
  return True


def claimed(root: str, index: int, timeout_s: float) -> bool:
  """Whether rollout `index` has a live claim (one that is not `Claim.stale`)."""
  held = read_claim(root, index)
  return held is not None and held.stale(timeout_s) is None


def live_claims(root: str, timeout_s: float) -> dict[int, Claim]:
  """Every rollout's live claim, by index."""
  out = {}
  for name in storage.listdir(storage.join(root, "claims")):
    m = _CLAIM.match(name)
    held = read_claim(root, int(m.group(1))) if m else None
    if held is not None and held.stale(timeout_s) is None:
      out[int(m.group(1))] = held
  return out


def renew(root: str, index: int, owner: str) -> bool:
  """Rewrites `owner`'s claim on rollout `index` with the time now; False (nothing written) if
  the claim is no longer `owner`'s (taken over after a pause past the timeout, or released)."""
  path = claim_path(root, index)
  text = json.dumps({"owner": owner, "time": time.time()})
  if storage.has_generations(path):
    got = storage.read_generation(path)
    if got is None or _parse_claim(got[0].decode(errors="replace"), None).owner != owner:
      return False
    return storage.write_if_generation(path, text.encode(), got[1]) is not None
  held = read_claim(root, index)
  if held is None or held.owner != owner:
    return False
  storage.write_text(path, text)
  return True


def release(root: str, index: int, owner: str | None = None) -> None:
  """Removes rollout `index`'s claim (with `owner`: only if it is still that sampler's)."""
  if owner is not None and (held := read_claim(root, index)) is not None and held.owner != owner:
    return
  storage.remove(claim_path(root, index))


@contextlib.contextmanager
def holding(root: str, index: int, owner: str, timeout_s: float):
  """While the block runs, `owner`'s claim on rollout `index` is renewed every `timeout_s / 5`
  seconds from a background thread (so `timeout_s` bounds how long a dead sampler's rollout
  waits, not how long a rollout may take to sample); when it ends, however it ends (the file
  written, an error, SIGTERM or Ctrl-C: the sampler command turns both into exceptions), the
  claim is released, so a stopping sampler gives its rollout back at once."""
  done = threading.Event()

  def keep():
    while not done.wait(timeout_s / 5):
      try:
        renew(root, index, owner)
      except OSError:  # a storage hiccup: the next renewal tries again
        pass

  keeper = threading.Thread(target=keep, name=f"claim-r{index}", daemon=True)
  keeper.start()
  try:
    yield
  finally:
    done.set()
    keeper.join()
    release(root, index, owner)


def waiting_on(root: str, index: int, timeout_s: float) -> str:
  """What the trainer, waiting for rollout `index`, can say of it: who holds its claim and
  since when (and whether that sampler is dead), and whether sampler jobs are at work at all
  (rollouts written beyond it, other live claims)."""
  held = read_claim(root, index)
  if held is None:
    parts = ["not claimed by any sampler job"]
  else:
    why = held.stale(timeout_s)
    parts = [f"claimed by {held.describe()}" + (
        f"; {why}: the next sampler job to look takes it over" if why else
        f"; taken over if not renewed for {timeout_s:g}s (rl.remote.claim_timeout_s)")]
  ahead = sorted(i for i in written_rollouts(root) if i > index)
  others = sorted(i for i in live_claims(root, timeout_s) if i != index)
  if ahead or others:
    seen = ([f"rollouts {_span(ahead)} written"] if ahead else []) + (
        [f"{_span(others)} being sampled"] if others else [])
    parts.append("sampler jobs are at work (" + ", ".join(seen) + ")")
  elif held is None or held.stale(timeout_s):
    parts.append("no live sampler job seen: start them with oapl_jax.sample, this run's config and "
                 "workdir (docs/remote.md)")
  return "; ".join(parts)


def _span(indices: list[int]) -> str:
  return str(indices[0]) if len(indices) == 1 else f"{indices[0]}-{indices[-1]} ({len(indices)})"


# --- the trainer's status -----------------------------------------------------------------------


def write_status(root: str, status: dict) -> None:
  storage.write_text(status_path(root), json.dumps(status, sort_keys=True))


def read_status(root: str) -> dict | None:
  """The trainer's status, or None before its first write (or while a write is replaced)."""
  try:
    return json.loads(storage.read_text(status_path(root)))
  except (FileNotFoundError, json.JSONDecodeError):
    return None


def served_settings(config, model_meta: dict) -> dict:
  """The settings a sampler job must share with the trainer it samples for, by their config
  names: what the trainer checks a rollout file against (`offline.expected_header`: the model's
  architecture, its dtype included; the task; the sampling settings; rl.group_size), what fixes
  rollout i's problems and keys (seed, rl.groups_per_rollout), what picks the snapshot
  (rl.remote.reproducible; with it, rl.lag), and under model.lora what its adapters are
  (model.lora.rank, alpha, targets). The trainer publishes them in its status; a sampler
  whose own differ is refused at its start (`check_serves`). Everything else may differ: a
  sampler's own engines (sampling.engines, tensor, max_slots, ...), logging, train.steps."""
  h = offline.expected_header(config, model_meta)
  out = {"seed": int(config.seed), "rl.group_size": h["group_size"],
         "rl.groups_per_rollout": int(config.rl.groups_per_rollout),
         "rl.remote.reproducible": bool(config.rl.remote.reproducible)}
  if config.rl.remote.reproducible:
    out["rl.lag"] = int(config.rl.lag)
  lora = config.model.get("lora")
  if lora is not None and lora.rank:  # snapshots are adapters of these settings (their base: `check_base`)
    out |= {"model.lora.rank": int(lora.rank), "model.lora.alpha": float(lora.alpha),
            "model.lora.targets": list(lora.targets)}
  for section in ("model", "task", "sampling"):
    out |= _flat(h[section], section)
  return json.loads(json.dumps(out))  # as read back from the status (tuples as lists)


def _flat(d: dict, prefix: str) -> dict:
  out = {}
  for k, v in d.items():
    out |= _flat(v, f"{prefix}.{k}") if isinstance(v, dict) else {f"{prefix}.{k}": v}
  return out


class SettingsDiffer(UserError):
  """A sampler job whose settings cannot serve the trainer of its workdir."""


def check_serves(root: str, mine: dict, status: dict | None) -> None:
  """Refuses (`SettingsDiffer`, one line naming each differing setting) a sampler job whose
  `served_settings` are not those the trainer published in its status (none published yet, or
  a trainer of before they were: nothing to check)."""
  theirs = (status or {}).get("settings")
  if not isinstance(theirs, dict):
    return
  names = sorted(set(mine) | set(theirs))
  diff = [f"{k}={mine.get(k)!r} (trainer: {theirs.get(k)!r})" for k in names if mine.get(k) != theirs.get(k)]
  if diff:
    raise SettingsDiffer(f"this sampler job cannot serve the trainer in {root}: its settings differ: "
                         f"{', '.join(diff)}; give it the trainer's config and overrides (docs/remote.md)")
