"""Orbax checkpoints of the whole run state: pi_theta, optimizer, snapshot (pi_old), buffer.

Each step directory holds two items: `state` (a pytree: params, opt_state, snapshot, the
buffer's rows and, in async mode, the rows of the rollout in flight) and `meta` (JSON:
counters, the shapes of those rows, the model architecture, and `checksums`: a sha256 of
every saved array, keyed by its tree path, and one of the rest of `meta`).

`Checkpointer.restore_latest` reads the newest step that loads and verifies: a step whose
files do not load (truncated, deleted, unreadable JSON) or whose arrays do not match their
checksums (flipped bytes) is skipped with a warning naming it and why, and left on disk; at
the next save it is renamed `<step>.damaged`, out of the way of orbax (which would otherwise
count it among the `keep` newest, or refuse to save its step again). A checkpoint of another
model is refused (`OtherModelError`: a wrong --workdir), not skipped; when every step is
damaged, `CheckpointError` lists them. A checkpoint saved before checksums existed restores
unverified, with one INFO line.

Multi-host (oapl_jax/distributed.py): every process calls `save` and `restore_latest`. The host
rows (buffer, rollout in flight) differ per process: they are saved as global arrays split over
the processes (`distributed.rows_to_global`; orbax would write numpy leaves from process 0
only), and each process restores its own. Each process hashes the shards it holds; `meta`
keeps every process's checksums (`by_process`), and a step damaged on any process is skipped
by all.

The training loop's saves are asynchronous (`save(..., wait=False)`): `save` takes the
checksums and lets orbax copy the arrays to the host (the trainer may then donate its buffers
to the next step), and orbax writes the files in the background while training goes on; the
next `save`, `restore_latest` and `wait` wait for it, and so does the run at its end and before
it stops on a signal (`rl.loop.Run.close`).

A save killed half-way leaves `<step>.orbax-checkpoint-tmp`, which orbax never takes for a
checkpoint; the next save removes it. A process killed after orbax renamed a new step into
place but before it deleted the oldest leaves `keep + 1` steps; the next restore (or save:
orbax is reloaded from disk before every save, so it counts every step there) is back to `keep`.
"""

from __future__ import annotations

import concurrent.futures
import errno
import hashlib
import json
import logging
import os
import re
import sys
import warnings
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from oapl_jax import distributed, storage
from oapl_jax.errors import UserError
from oapl_jax.workdir import Layout, check_usable

ROWS = ("buffer", "inflight")  # host row dicts of a run state (names of `state` entries)
CHECKSUMS = "checksums"  # meta key: {"meta": sha256 of the rest of meta, "state": {path: sha256}}
DAMAGED = ".damaged"  # suffix of a damaged step directory moved aside at a save
_TMP = re.compile(r"^\d+\.orbax-checkpoint-tmp")  # a save that never finished (orbax 0.12 name)

log = logging.getLogger(__name__)


class CheckpointError(UserError):
  """There are checkpoints, and not one of them loads and verifies."""


class OtherModelError(UserError, ValueError):
  """The checkpoint is of another model architecture (most likely a wrong --workdir)."""


class SaveFailed(UserError):
  """A checkpoint could not be written because of the storage (a full disk, a quota, a
  read-only or forbidden folder); the steps saved before it are kept."""


# What a storage failure says, in tensorstore's words or the OS's (errno, strerror).
_STORAGE_ERRORS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
                   errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
                   errno.EPERM: "operation not permitted"}


def storage_failure(e: BaseException) -> str | None:
  """"no space left on device" (etc., `_STORAGE_ERRORS`) if `e` or an error in its chain is
  that storage failure (an OSError's errno, or tensorstore's `[os_error_code='28']`); None if not."""
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    code = e.errno if isinstance(e, OSError) else None
    found = re.search(r"os_error_code='(\d+)'", str(e))
    code = code if code in _STORAGE_ERRORS else int(found[1]) if found else None
    if code in _STORAGE_ERRORS:
      return _STORAGE_ERRORS[code]
    e = e.__cause__ or e.__context__
  return None


class DamagedStep(Exception):
  """One step directory does not load or verify; the message says which file or leaf."""


def warn(msg: str) -> None:
  """A normal event worth a look (a damaged step skipped or moved aside): one plain line on
  stderr, and a warning in the log that the commands' absl handler does not print again."""
  print(msg, file=sys.stderr, flush=True)
  log.warning("%s", msg, extra={"said": True})


# checksums

def _digest(x) -> str:
  """sha256 of one array's dtype, shape and bytes (multi-host, of an array split over the
  processes: of the shards this process holds)."""
  if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
    return _local_digest(x)
  a = np.ascontiguousarray(np.asarray(x))
  h = hashlib.sha256(f"{a.dtype}{list(a.shape)}".encode())
  h.update(a.reshape(-1).view(np.uint8))  # bytes of any dtype (bfloat16 has no buffer format)
  return h.hexdigest()


def _local_digest(x: jax.Array) -> str:
  """sha256 of a global array's dtype, shape and the distinct shards this process holds."""
  h = hashlib.sha256(f"{x.dtype}{list(x.shape)}".encode())
  seen = set()
  for shard in sorted(x.addressable_shards, key=lambda s: str(s.index)):
    if str(shard.index) in seen:
      continue
    seen.add(str(shard.index))
    h.update(str(shard.index).encode())
    h.update(np.ascontiguousarray(np.asarray(shard.data)).reshape(-1).view(np.uint8))
  return h.hexdigest()


def _all_processes(digests: dict[str, str]) -> list[dict[str, str]]:
  """Every process's `leaf_digests` (same paths everywhere), in process order."""
  paths = sorted(digests)
  raw = np.array([np.frombuffer(bytes.fromhex(digests[p]), np.uint8) for p in paths]).reshape(-1, 32)
  return [dict(zip(paths, (bytes(r).hex() for r in mine))) for mine in distributed.allgather(raw)]


def leaf_digests(state) -> dict[str, str]:
  """{tree path (`jax.tree_util.keystr`): sha256} of every array in `state`, hashed in threads
  (hashlib lets go of the GIL), each array copied to the host on its own."""
  leaves = jax.tree_util.tree_flatten_with_path(state)[0]
  with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
    digests = list(pool.map(lambda kv: _digest(kv[1]), leaves))
  return {jax.tree_util.keystr(path): d for (path, _), d in zip(leaves, digests)}


def base_record(config, base) -> dict:
  """What a LoRA run's checkpoints record of their frozen base: model.path and a sha256."""
  return {"path": config.model.path, "sha256": tree_digest(base)}


def tree_digest(state) -> str:
  """One sha256 of every array of `state` (a LoRA run's frozen base: what its checkpoints were
  trained on). Multi-host, of every process's shards, so it is the same in every process (and
  depends on the layout: resume on the same mesh)."""
  digests = leaf_digests(state)
  table = _all_processes(digests) if distributed.process_count() > 1 else digests
  return hashlib.sha256(json.dumps(table, sort_keys=True).encode()).hexdigest()


def _meta_digest(meta: dict) -> str:
  """sha256 of `meta` without its checksums, as it reads back from JSON."""
  rest = {k: v for k, v in meta.items() if k != CHECKSUMS}
  text = json.dumps(json.loads(json.dumps(rest)), sort_keys=True)
  return hashlib.sha256(text.encode()).hexdigest()


def _verify(state, sums: dict[str, str]) -> None:
  """Raises DamagedStep naming the leaves whose bytes differ from the saved checksums."""
  bad = [path for path, d in leaf_digests(state).items() if sums.get(path) != d]
  if bad:
    more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
    raise DamagedStep(f"checksum mismatch in {', '.join(bad[:3])}{more}")


# errors from orbax / tensorstore / json

def _describe(e: BaseException) -> str:
  """The innermost error of a chain (tensorstore's names the array and file), on one short line."""
  while e.__cause__ is not None or (e.__context__ is not None and not e.__suppress_context__):
    e = e.__cause__ or e.__context__
  text = str(e).split(" [tensorstore_spec")[0].split(" See full TensorStore details")[0]
  text = " ".join(text.split())
  return f"{type(e).__name__}: {text[:300]}"


def _is_read_noise(exc) -> bool:
  """An after-effect of a failed orbax read: an error of one of its other reads (tensorstore's
  messages carry a TensorStore spec), or a late callback into its closed event loop."""
  text = str(exc)
  return text == "Event loop is closed" or "tensorstore_spec" in text or "TensorStore" in text


class _DropReadNoise(logging.Filter):
  """Drops asyncio's 'Task exception was never retrieved' for the other reads of a failed restore."""

  def filter(self, record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    return not (exc is not None and _is_read_noise(exc)
                and record.getMessage().startswith("Task exception was never retrieved"))


class _DropStorageFailure(logging.Filter):
  """Drops orbax's and asyncio's error records (each with a traceback) of a write the storage
  refused: `Checkpointer.wait` raises that failure as one line."""

  def filter(self, record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    return not (record.levelno >= logging.ERROR and (
        storage_failure(exc) if exc is not None else
        any(f"os_error_code='{c}'" in record.getMessage() for c in _STORAGE_ERRORS)))


def _quiet_storage_failure() -> None:
  """A save the storage refuses makes orbax log the error of each of its writes (with a
  traceback, from its background threads, while the next steps train) and tensorstore report
  its late callbacks' "Event loop is closed" to `sys.unraisablehook`: screens of tracebacks
  before `Checkpointer.wait` raises the failure as one line. From the first Checkpointer on,
  those are dropped; every other record and error still reaches the log and the hook. So is
  the "coroutine ... was never awaited" RuntimeWarning that a write cut short can leave to the
  interpreter's exit, after the run's one error line (seen once in CI, on a loaded machine)."""
  warnings.filterwarnings("ignore", message=r"coroutine .* was never awaited", category=RuntimeWarning)
  for name in ("absl", "asyncio"):  # orbax's records; asyncio's "exception was never retrieved"
    logger = logging.getLogger(name)
    if not any(isinstance(f, _DropStorageFailure) for f in logger.filters):
      logger.addFilter(_DropStorageFailure())
  _quiet_failed_read_noise()


def _quiet_failed_read_noise() -> None:
  """A failed orbax read leaves its other reads' errors to asyncio's log and to
  `sys.unraisablehook`: dozens of tracebacks on stderr, some after the error itself was raised
  (and reported by `restore_latest`). From the first restore on, those are dropped; anything
  else still reaches the log and the previous hook."""
  previous = sys.unraisablehook
  if getattr(previous, "_drops_read_noise", False):
    return

  def hook(unraisable):
    if not _is_read_noise(unraisable.exc_value):
      previous(unraisable)

  hook._drops_read_noise = True
  sys.unraisablehook = hook
  asyncio_log = logging.getLogger("asyncio")
  if not any(isinstance(f, _DropReadNoise) for f in asyncio_log.filters):
    asyncio_log.addFilter(_DropReadNoise())


def directory_of(config, workdir: str) -> str:
  """Where a run's checkpoints go: `checkpoint.directory` (a local folder or a gs:// URL), else
  `<workdir>/checkpoints`."""
  return config.checkpoint.directory or Layout(workdir).checkpoints


def newest_step(directory: str) -> int | None:
  """The newest finished checkpoint's step under `directory` (its step-named folders; orbax's
  unfinished `<step>.orbax-checkpoint-tmp` ones are not), None if there is none."""
  p = epath.Path(directory)
  steps = [int(c.name) for c in p.iterdir() if c.name.isdigit()] if p.exists() else []
  return max(steps, default=None)


class Checkpointer:
  """Saves and restores run states under `directory`: a local folder, or a URL orbax writes
  through its own storage layer (gs://): every path operation here goes through etils.epath."""

  def __init__(self, directory: str, *, keep: int):
    self.directory = directory if "://" in directory else os.path.abspath(directory)
    self._mgr = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))
    self._keep = keep
    _quiet_storage_failure()  # a failed save is one line (`wait`), not screens of tracebacks
    self._skipped: list[int] = []  # damaged steps passed over by the last restore_latest

  def latest_step(self) -> int | None:
    return self._mgr.latest_step()

  def step_dir(self, step: int) -> str:
    return str(epath.Path(self.directory) / str(step))

  # saving

  def save(self, step: int, state: dict[str, Any], meta: dict[str, Any], *, wait: bool = True) -> None:
    """Saves `state` as step `step`: pytrees of device arrays, plus host row dicts (`ROWS`)
    whose shapes vary. `wait=False` returns once the checksums are taken and orbax holds its
    own copy of every array, the files written in the background (`wait()`: until they are
    and the step is in place)."""
    self.wait()  # the previous save is in place before a new one starts
    meta = {**meta, **{f"{name}_shapes": {k: [list(v.shape), str(v.dtype)] for k, v in state[name].items()}
                       for name in ROWS if name in state}}
    if distributed.process_count() > 1:
      state = {k: ({n: distributed.rows_to_global(a) for n, a in v.items()} if k in ROWS else v)
               for k, v in state.items()}
      meta = {**meta, **{f"{name}_shapes": {k: [list(v.shape), str(v.dtype)] for k, v in state[name].items()}
                         for name in ROWS if name in state}}
      sums = _all_processes(leaf_digests(state))
      meta[CHECKSUMS] = {"meta": _meta_digest(meta), "state": sums[0], "by_process": sums}
    else:
      meta[CHECKSUMS] = {"meta": _meta_digest(meta), "state": leaf_digests(state)}
    if distributed.is_writer():
      self._move_damaged_aside()
    distributed.barrier(f"checkpoint-{step}-aside")
    self._mgr.reload()  # count every step on disk (a kill may have left keep + 1)
    self._mgr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
    if wait:
      self.wait()

  def wait(self) -> None:
    """Until the save in flight (if any) is written and in place; then removes what saves that
    never finished left behind. A save the storage refused (a full disk, ...) raises SaveFailed,
    one line naming the folder and the newest step that is in place."""
    try:
      self._mgr.wait_until_finished()
    except Exception as e:  # noqa: BLE001  orbax re-raises its background thread's error
      why = storage_failure(e)
      if why is None:
        raise
      self._mgr.reload()
      kept = self._mgr.latest_step()
      raise SaveFailed(
          f"a checkpoint could not be written to {self.directory}: {why}; the checkpoints "
          f"written before it are kept (newest: step {kept}); fix the storage and run the same "
          f"command again to resume from there (--verbose: the storage's own error)") from e
    if distributed.is_writer():
      self._remove_dead_saves()

  def _move_damaged_aside(self) -> None:
    """Renames the steps the last restore skipped to `<step>.damaged[-n]` (kept for a look)."""
    for step in self._skipped:
      src = self.step_dir(step)
      if not epath.Path(src).is_dir():
        continue
      dst, n = src + DAMAGED, 1
      while epath.Path(dst).exists():
        n += 1
        dst = f"{src}{DAMAGED}-{n}"
      epath.Path(src).rename(dst)
      warn(f"damaged checkpoint {src} moved aside to {dst} (delete it when no longer needed)")
    self._skipped = []

  def _remove_beyond_keep(self, restored: int) -> None:
    """Removes the steps older than the `keep - 1` newest before `restored`: what a kill
    between orbax's rename of a new step and its removal of the oldest left (keep + 1 steps,
    which a run that then has nothing more to save would otherwise keep)."""
    older = sorted((s for s in self._mgr.all_steps() if s < restored), reverse=True)
    for step in older[max(self._keep - 1, 0):]:
      log.info("removing checkpoint %s: more than checkpoint.keep=%d steps", self.step_dir(step), self._keep)
      epath.Path(self.step_dir(step)).rmtree(missing_ok=True)

  def _remove_dead_saves(self) -> None:
    """Removes orbax tmp directories left by saves that never finished (a killed process)."""
    for name in storage.listdir(self.directory):  # none yet: [] (a bucket has no empty folders)
      if _TMP.match(name):
        path = epath.Path(self.directory) / name
        log.info("removing %s, left by a save that never finished", path)
        path.rmtree(missing_ok=True)

  # restoring

  def restore_latest(self, target: dict[str, Any], model_meta: dict[str, Any], *, partial: bool = False,
                     tidy: bool = False):
    """(step, state, meta) of the newest step that loads and verifies; None if there is no step.

    partial: restore only the entries of `target` (e.g. `{"params": ...}` for evaluation); the
    rest of the run state is not read.
    tidy: the run resuming (not a command that only reads): steps beyond `keep` older than the
    restored one are removed (`_remove_beyond_keep`).

    Damaged steps are skipped with a warning and left in place. Raises OtherModelError for a
    checkpoint of another model, CheckpointError when every step is damaged.
    """
    self._mgr.wait_until_finished()  # a save of this Checkpointer in flight
    self._mgr.reload()
    reasons = {}
    for step in sorted(self._mgr.all_steps(), reverse=True):
      try:
        state, meta = self.restore(step, target, model_meta, partial=partial)
        damaged = None
      except DamagedStep as e:
        damaged = e
      if distributed.any_process(damaged is not None) and damaged is None:  # multi-host: skipped by all
        damaged = DamagedStep("damaged on another process (see its warning)")
      if damaged is not None:
        reasons[step] = str(damaged)
        warn(f"checkpoint {self.step_dir(step)} is damaged and skipped ({damaged}); it is left in place")
        continue
      self._skipped = list(reasons)
      if tidy and distributed.is_writer():
        self._remove_beyond_keep(step)
      return step, state, meta
    if reasons:
      listed = "; ".join(f"step {s}: {r}" for s, r in reasons.items())
      raise CheckpointError(
          f"no checkpoint in {self.directory} loads and verifies ({listed}). Move the damaged "
          "step directories away to start over there, or use another --workdir.")
    return None

  def restore(self, step: int, target: dict[str, Any], model_meta: dict[str, Any], *,
              partial: bool = False):
    """(state, meta) of one step. `target` gives the structure of params/opt_state/snapshot
    (arrays or `jax.ShapeDtypeStruct`s); with `partial`, of the entries to read, no more.

    Raises DamagedStep when a file does not load or the data does not match its checksums,
    OtherModelError for a checkpoint of another model.
    """
    meta = self._read(step, "meta", ocp.args.JsonRestore())
    if not isinstance(meta, dict):
      raise DamagedStep(f"{self.step_dir(step)}/meta/metadata holds a {type(meta).__name__}, not an object")
    sums = meta.get(CHECKSUMS)
    if sums is not None and (not isinstance(sums, dict) or sums.get("meta") != _meta_digest(meta)):
      raise DamagedStep(f"checksum mismatch in {self.step_dir(step)}/meta/metadata")
    if meta.get("model") != model_meta:
      raise OtherModelError(f"checkpoint {self.step_dir(step)} is of another model: "
                            f"{_model_differences(meta.get('model'), model_meta)}; use another "
                            "--workdir or the matching config.model")
    if partial:
      abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
      state = self._read(step, "state", ocp.args.PyTreeRestore(
          abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
          partial_restore=True))
    else:
      state = self._read(step, "state", ocp.args.StandardRestore(self._abstract_state(step, target, meta)))
    if sums is None:
      log.info("checkpoint %s was saved without checksums: restored unverified", self.step_dir(step))
    elif distributed.process_count() > 1:
      by_process = sums.get("by_process") or []
      if len(by_process) != distributed.process_count():
        raise DamagedStep(f"{self.step_dir(step)} was saved by {len(by_process) or 1} process(es), "
                          f"this run has {distributed.process_count()}")
      _verify(state, by_process[distributed.process_index()])
    else:
      _verify(state, sums.get("state", {}))
    if distributed.process_count() > 1:  # this process's own rows
      state = {k: ({n: distributed.rows_to_local(a) for n, a in v.items()} if k in ROWS else v)
               for k, v in state.items()}
    return state, meta

  def _abstract_state(self, step: int, target: dict[str, Any], meta: dict) -> dict:
    """The whole state's structure: `target`'s trees plus the host rows, shaped as saved."""
    try:
      rows = {name: {k: _row_target(shape, dtype) for k, (shape, dtype) in meta[f"{name}_shapes"].items()}
              for name in ROWS if f"{name}_shapes" in meta}
    except (TypeError, ValueError, KeyError) as e:
      raise DamagedStep(f"{self.step_dir(step)}/meta/metadata: bad row shapes: {_describe(e)}") from e
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, {**target, **rows})

  def _read(self, step: int, item: str, args):
    """One item (`meta` or `state`) of a step; any failure to load is a DamagedStep naming it."""
    _quiet_failed_read_noise()  # before: some of that noise comes while orbax is still failing
    try:
      return getattr(self._mgr.restore(step, args=ocp.args.Composite(**{item: args})), item)
    except Exception as e:  # orbax, tensorstore and json raise many kinds
      where = f"{self.step_dir(step)}/{item}" + ("/metadata" if item == "meta" else "")
      raise DamagedStep(f"{where} does not load: {_describe(e)}") from e


def _model_differences(saved, config: dict) -> str:
  """The architecture fields on which a checkpoint's model and the config's differ, named:
  "config.model.hidden_size=64 (the checkpoint's: 128)"."""
  if not isinstance(saved, dict):
    return f"its model record is {saved!r}"
  fields = sorted(k for k in set(saved) | set(config) if saved.get(k) != config.get(k))
  return ", ".join(f"config.model.{k}={config.get(k)!r} (the checkpoint's: {saved.get(k)!r})"
                   for k in fields)


def _row_target(shape, dtype):
  """The restore target of one saved row array: numpy on one process; multi-host, a global
  array split over the processes (`distributed.rows_sharding`)."""
  if distributed.process_count() == 1:
    return np.zeros(shape, dtype)
  return jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype), sharding=distributed.rows_sharding())


def restore_tree(config, workdir: str, name: str, abstract, model_meta: dict):
  """(step, tree `name`, meta) of the newest good checkpoint under `workdir/checkpoints`, read
  alone (`partial`: not the optimizer or the buffer) into `abstract`, checked against
  `model_meta`; a UserError if there is no checkpoint (`policies.restore_policy` uses it)."""
  ckpt = Checkpointer(checkpoints_of(config, workdir), keep=config.checkpoint.keep)
  found = ckpt.restore_latest({name: abstract}, model_meta, partial=True)
  if found is None:
    raise UserError(f"no checkpoint under {ckpt.directory}")
  step, state, meta = found
  return step, state[name], meta


def checkpoints_of(config, workdir: str) -> str:
  """The run's checkpoint directory; a UserError if there is none (nothing created there)."""
  check_usable(workdir)
  directory = directory_of(config, workdir)
  if not epath.Path(directory).is_dir():  # a mistyped workdir
    raise UserError(f"no checkpoint under {directory} (--workdir={workdir}: is it the run's?)")
  return directory
