"""A local fake of a Cloud Storage bucket, for tests: `gs://BUCKET/path` is the file
`$OAPL_FAKE_BUCKET/BUCKET/path`.

Python runs this file at start-up in a process whose PYTHONPATH names this folder
(`tests/test_bucket_workdir.py` starts its runs so); `install()` does the same in the test's own
process. etils.epath then sends gs:// paths to fsspec (instead of tf.io.gfile), and fsspec's
"gs" protocol to `FakeBucket`: a local file system that refuses what object storage lacks and a
local disk has (appending to an object, renaming), so a workdir that leans on them fails here as
it would on a bucket; an object appears whole when its writer closes it, never half-written (as
an upload does: written under $OAPL_FAKE_BUCKET/.partial, outside every bucket, then moved in with
os.replace); and it keeps generations for the workdir lock's conditional writes (below). What it does not fake: Cloud Storage's own clients (tf.io.gfile, gcsfs,
google-cloud-storage) and orbax's writes to gs:// (tensorstore); the tests keep
`checkpoint.directory` on local disk. tests/test_gcs_emulator.py runs the real clients against
an emulator.
"""

import os
import sys
import tempfile

from etils.epath import gpath
import fsspec
from fsspec.implementations.local import LocalFileOpener, LocalFileSystem, get_umask

ROOT_VAR = "OAPL_FAKE_BUCKET"
PARTIAL = ".partial"  # $OAPL_FAKE_BUCKET/.partial: objects being written (no bucket's name starts with ".")


class _Upload(LocalFileOpener):
  """An object opened for writing: written to a file in $OAPL_FAKE_BUCKET/.partial (the same
  file system, outside every bucket: no listing or folder check sees it), moved to its name by
  os.replace when closed, so a reader sees the previous object or the whole new one (a writer
  killed before its close leaves the previous one)."""

  def __init__(self, path, mode, fs):
    super().__init__(path, mode, autocommit=False, fs=fs)

  def _open(self):
    if self.f is None:
      partial = os.path.join(os.environ[ROOT_VAR], PARTIAL)
      os.makedirs(partial, exist_ok=True)
      fd, self.temp = tempfile.mkstemp(dir=partial, prefix=os.path.basename(self.path) + ".")
      os.chmod(self.temp, 0o666 & ~get_umask())  # as open() makes files (mkstemp: 0o600)
      self.f = os.fdopen(fd, self.mode)

  def close(self):
    if not self.f.closed:
      self.f.close()
      os.replace(self.temp, self.path)

  def __exit__(self, *exc):
    self._incontext = False
    self.close()


class FakeBucket(LocalFileSystem):
  protocol = ("gs", "gcs")

  def __init__(self, *args, **kwargs):
    del args, kwargs  # gcsfs's options (epath passes finalize_on_close)
    super().__init__(auto_mkdir=True)  # an object's "folders" are only its name

  @classmethod
  def _strip_protocol(cls, path):
    path = str(path)
    for prefix in ("gs://", "gcs://"):
      if path.startswith(prefix):
        path = os.path.join(os.environ[ROOT_VAR], path[len(prefix):])
    return super()._strip_protocol(path)

  def _open(self, path, mode="rb", **kwargs):
    if "a" in mode or "+" in mode:
      raise OSError(f"fake bucket: objects cannot be appended to or updated ({path}, mode {mode!r})")
    if "w" in mode:
      path = self._strip_protocol(path)
      self.makedirs(self._parent(path), exist_ok=True)  # the folders only: the object comes at close
      return _Upload(path, mode, self)
    return super()._open(path, mode, **kwargs)

  def mv(self, *args, **kwargs):
    raise OSError("fake bucket: object storage has no rename")

  rename = move = mv


# Cloud Storage's generations (`oapl_jax.storage.read_generation` and the conditional writes,
# which the real code sends through google-cloud-storage): an object's generation here is its
# file's inode and modification time, and each check with the write it guards is made under one
# flock of the fake bucket, so of two processes conditional on one generation one wins, as there.


def _local(path: str) -> str:
  return FakeBucket._strip_protocol(path)


def _generation_of(local: str) -> int:
  st = os.stat(local)
  return st.st_mtime_ns * 1_000_003 + st.st_ino


class _Guard:
  def __enter__(self):
    import fcntl  # noqa: PLC0415
    os.makedirs(os.environ[ROOT_VAR], exist_ok=True)
    self._fd = os.open(os.path.join(os.environ[ROOT_VAR], ".generations.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(self._fd, fcntl.LOCK_EX)

  def __exit__(self, *exc):
    os.close(self._fd)


def _read_generation(path):
  local = _local(path)
  with _Guard():
    if not os.path.exists(local):
      return None
    with open(local, "rb") as f:
      return f.read(), _generation_of(local)


def _write_if_generation(path, data, generation):
  local = _local(path)
  with _Guard():
    have = _generation_of(local) if os.path.exists(local) else 0
    if have != generation:
      return None
    os.makedirs(os.path.dirname(local), exist_ok=True)
    tmp = f"{local}.{os.getpid()}.gen"
    with open(tmp, "wb") as f:
      f.write(data)
    os.replace(tmp, local)  # a new inode: a new generation
    return _generation_of(local)


def _remove_if_generation(path, generation):
  local = _local(path)
  with _Guard():
    if not os.path.exists(local) or _generation_of(local) != generation:
      return False
    os.remove(local)
    return True


def install() -> None:
  gpath._is_tf_installed = lambda: False  # gs:// through fsspec, not TensorFlow's GCS client
  fsspec.register_implementation("gs", FakeBucket, clobber=True)
  fsspec.register_implementation("gcs", FakeBucket, clobber=True)
  from oapl_jax import storage  # noqa: PLC0415 (imports no JAX)
  storage.read_generation = _read_generation
  storage.write_if_generation = _write_if_generation
  storage.remove_if_generation = _remove_if_generation


if os.environ.get(ROOT_VAR):
  # At start-up, before `python -m` puts the working directory on sys.path: install() imports
  # oapl_jax, which must be this checkout's (the one whose tests/ holds this file), not the one
  # an editable install elsewhere names (a clone's tests then ran the other tree's code).
  _REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  if _REPO not in sys.path:
    sys.path.insert(0, _REPO)
  install()
