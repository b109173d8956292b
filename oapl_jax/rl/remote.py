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
its claim. A claim older than `rl.remote.claim_timeout_s` with no file is a dead sampler's and
is taken over (a slow sampler's rollout may then be sampled twice; the trainer reads one).

Every file is written whole and made visible at once (written aside and renamed; in a bucket,
one upload), with a sha256 of its contents: a sampler killed mid-file leaves nothing a reader
takes; a damaged snapshot is refused (`SnapshotError`) and the sampler keeps the one it has; a
damaged rollout file is set aside by the trainer (renamed `.rejected`) and sampled again.
"""

from __future__ import annotations

import io
import json
import os
import re
import socket
import time
import uuid
import zipfile

import jax
import numpy as np

from oapl_jax import storage
from oapl_jax.errors import UserError
from oapl_jax.rl import offline

SNAPSHOT_FORMAT = "oapl_jax.snapshot/1"
_SNAPSHOT = re.compile(r"^v(\d{8})\.npz$")
_ROLLOUT = re.compile(r"^r(\d{9})\.npz$")


class SnapshotError(UserError):
  """A published snapshot that cannot be loaded: unreadable, damaged, or another model's."""


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
  at once (a reader never sees half of it). Returns its path."""
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


def remove_old_snapshots(root: str, keep_from: int) -> None:
  """Removes snapshots older than version `keep_from`."""
  for v in published_versions(root):
    if v < keep_from:
      storage.remove(snapshot_path(root, v))


# --- claims and the trainer's status ------------------------------------------------------------


def owner_id() -> str:
  return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def claim(root: str, index: int, owner: str, timeout_s: float) -> bool:
  """Claims rollout `index` for `owner`: True if this sampler may sample it now.

  Local: an exclusive create (of two samplers, one wins); a claim older than `timeout_s`
  whose rollout is not written is a dead sampler's and is replaced. In Cloud Storage the same,
  by writes conditional on the claim's generation (a create only if there is none; a dead
  claim replaced only as it was read: of two samplers taking it over, one wins). Other object
  stores: written, then read back after a moment, as the workdir lock does there."""
  path = claim_path(root, index)
  text = json.dumps({"owner": owner, "time": time.time()})
  if storage.has_generations(path):
    if storage.write_if_generation(path, text.encode(), 0) is not None:
      return True
    got = storage.read_generation(path)
    if got is None:  # released between the two calls: taken next time
      return False
    try:
      since = float(json.loads(got[0]).get("time", 0.0))
    except (ValueError, AttributeError):
      since = 0.0  # not a claim record: as old as can be
    if time.time() - since < timeout_s or storage.exists(rollout_path(root, index)):
      return False
    return storage.write_if_generation(path, text.encode(), got[1]) is not None
  if not storage.is_remote(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if storage.create_exclusive(path, text):
      return True
    if time.time() - storage.mtime(path) < timeout_s or storage.exists(rollout_path(root, index)):
      return False
    storage.write_text(path, text)  # a dead sampler's claim, taken over
    return True
  if storage.exists(path) and time.time() - storage.mtime(path) < timeout_s:
    return False
  storage.write_text(path, text)
  time.sleep(1.0)
  try:
    return json.loads(storage.read_text(path)).get("owner") == owner
  except (FileNotFoundError, json.JSONDecodeError):
    return False


def claimed(root: str, index: int, timeout_s: float) -> bool:
  """Whether rollout `index` has a live claim."""
  path = claim_path(root, index)
  return storage.exists(path) and time.time() - storage.mtime(path) < timeout_s


def release(root: str, index: int) -> None:
  storage.remove(claim_path(root, index))


def write_status(root: str, status: dict) -> None:
  storage.write_text(status_path(root), json.dumps(status, sort_keys=True))


def read_status(root: str) -> dict | None:
  """The trainer's status, or None before its first write (or while a write is replaced)."""
  try:
    return json.loads(storage.read_text(status_path(root)))
  except (FileNotFoundError, json.JSONDecodeError):
    return None
