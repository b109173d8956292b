"""A workdir's small files (lock, metrics, summary, evaluations) on a local disk or in a bucket.

A local path uses the OS: a file is written aside and renamed into place (a reader never sees
half of it), appended to, created exclusively (`O_EXCL`).

A URL (`gs://bucket/run`, any scheme etils.epath knows) goes through `etils.epath` (on gs://,
tf.io.gfile when TensorFlow is installed, else fsspec's gcsfs) and uses only what object
storage has: an object is read whole and written whole (a write replaces it at once, as a GCS
upload does), never appended to, renamed or created exclusively. Callers that need those
(`metrics.MetricsLog`, `workdir.WorkdirLock`) ask `is_remote` and do without them there.

This module imports no JAX; etils is imported only for a URL.
"""

from __future__ import annotations

import functools
import os


def is_remote(path: str) -> bool:
  """True for a URL (object storage), False for a local path."""
  return "://" in str(path)


def _epath(path: str):
  from etils import epath  # noqa: PLC0415 (only URLs need it)
  return epath.Path(path)


def absolute(path: str) -> str:
  """A local path made absolute; a URL as given (without a trailing slash)."""
  return str(path).rstrip("/") if is_remote(path) else os.path.abspath(path)


def join(root: str, *names: str) -> str:
  if is_remote(root):
    return "/".join([str(root).rstrip("/"), *names])
  return os.path.join(root, *names)


def dirname(path: str) -> str:
  return str(path).rsplit("/", 1)[0] if is_remote(path) else os.path.dirname(path)


def exists(path: str) -> bool:
  return _epath(path).exists() if is_remote(path) else os.path.exists(path)


def makedirs(path: str) -> None:
  """A local folder and its parents; nothing to do in a bucket (folders are name prefixes)."""
  if not is_remote(path):
    os.makedirs(path, exist_ok=True)


def read_text(path: str) -> str:
  """The whole file; FileNotFoundError if there is none."""
  return read_bytes(path).decode(errors="replace")  # a power loss may leave bytes that are not text


def write_text(path: str, text: str) -> None:
  """Replaces the file with `text` at once (`write_bytes`)."""
  write_bytes(path, text.encode())


def read_bytes(path: str) -> bytes:
  """The whole file's bytes; FileNotFoundError if there is none."""
  if is_remote(path):
    p = _epath(path)
    if not p.exists():
      raise FileNotFoundError(path)
    return p.read_bytes()
  with open(path, "rb") as f:
    return f.read()


def write_bytes(path: str, data: bytes) -> None:
  """Replaces the file with `data` at once: locally written aside, then renamed; in a bucket, one
  upload (an object is never seen half-written)."""
  if is_remote(path):
    _epath(path).write_bytes(data)
    return
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = f"{path}.{os.getpid()}.tmp"
  with open(tmp, "wb") as f:
    f.write(data)
  os.replace(tmp, path)


def listdir(path: str) -> list[str]:
  """The names in a folder (a bucket prefix), sorted; [] if there is none."""
  try:
    names = [p.name for p in _epath(path).iterdir()] if is_remote(path) else os.listdir(path)
  except FileNotFoundError:
    return []
  return sorted(names)


def upload(local_path: str, path: str) -> None:
  """Copies the local file `local_path` (bytes) to `path` (a URL: one upload; local: a copy)."""
  with open(local_path, "rb") as f:
    write_bytes(path, f.read())


def remove(path: str) -> None:
  """Removes the file if it is there."""
  try:
    if is_remote(path):
      _epath(path).unlink(missing_ok=True)
    else:
      os.remove(path)
  except FileNotFoundError:
    pass


def mtime(path: str) -> float:
  """When the file was last written (seconds since the epoch); 0 if it is gone."""
  try:
    return float(_epath(path).stat().mtime) if is_remote(path) else os.path.getmtime(path)
  except FileNotFoundError:
    return 0.0


def create_exclusive(path: str, text: str) -> bool:
  """Local only: creates the file holding `text` if there is none (True), else False."""
  assert not is_remote(path), "object storage has no exclusive create"
  try:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
  except FileExistsError:
    return False
  with os.fdopen(fd, "w") as f:
    f.write(text)
  return True


# --- Cloud Storage generations: conditional writes (the workdir lock) ----------------------------
#
# Every object in Cloud Storage has a generation that each write changes, and a write or delete
# may be made conditional on it (https://cloud.google.com/storage/docs/request-preconditions):
# generation 0 means "no such object", so a create conditional on 0 is an exclusive create. Of
# two writers conditional on the same generation exactly one succeeds. These go through
# google-cloud-storage (gcsfs's dependency; its own credentials, `STORAGE_EMULATOR_HOST` for an
# emulator); other URL schemes have none of this (`has_generations`).


def has_generations(path: str) -> bool:
  """Whether `path` is in Cloud Storage, where writes can be conditional on generations."""
  return str(path).startswith("gs://")


def _blob(path: str):
  try:
    from google.cloud import storage as gcs  # noqa: PLC0415 (only gs:// needs it)
  except ImportError as e:
    from oapl_jax.errors import UserError  # noqa: PLC0415
    raise UserError(f"{path}: a gs:// workdir's lock needs google-cloud-storage "
                    f"(pip install google-cloud-storage; it comes with gcsfs)") from e
  bucket, _, name = str(path)[len("gs://"):].partition("/")
  return _client(gcs).bucket(bucket).blob(name)


@functools.cache
def _client(gcs):
  return gcs.Client()


def read_generation(path: str) -> tuple[bytes, int] | None:
  """(the object's bytes, its generation), read together; None if there is no object."""
  from google.api_core import exceptions  # noqa: PLC0415
  blob = _blob(path)
  try:
    data = blob.download_as_bytes()  # sets blob.generation to the generation read
  except exceptions.NotFound:
    return None
  return data, int(blob.generation)


def write_if_generation(path: str, data: bytes, generation: int) -> int | None:
  """Writes `data` if the object's generation is `generation` (0: if there is none); the new
  generation, or None if the object had another (someone else wrote or removed it)."""
  from google.api_core import exceptions  # noqa: PLC0415
  blob = _blob(path)
  try:
    blob.upload_from_string(data, if_generation_match=generation)
  except exceptions.PreconditionFailed:
    return None
  return int(blob.generation)


def remove_if_generation(path: str, generation: int) -> bool:
  """Removes the object if its generation is `generation`; False if it had another or was gone."""
  from google.api_core import exceptions  # noqa: PLC0415
  try:
    _blob(path).delete(if_generation_match=generation)
  except (exceptions.PreconditionFailed, exceptions.NotFound):
    return False
  return True

