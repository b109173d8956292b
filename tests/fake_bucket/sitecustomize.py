"""A local fake of a Cloud Storage bucket, for tests: `gs://BUCKET/path` is the file
`$OAPL_FAKE_BUCKET/BUCKET/path`.

Python runs this file at start-up in a process whose PYTHONPATH names this folder
(`tests/test_bucket_workdir.py` starts its runs so); `install()` does the same in the test's own
process. etils.epath then sends gs:// paths to fsspec (instead of tf.io.gfile), and fsspec's
"gs" protocol to `FakeBucket`: a local file system that refuses what object storage lacks and a
local disk has (appending to an object, renaming), so a workdir that leans on them fails here as
it would on a bucket. What it does not fake: Cloud Storage's own client (tf.io.gfile or gcsfs)
and orbax's writes to gs:// (tensorstore); the tests keep `checkpoint.directory` on local disk.
"""

import os

from etils.epath import gpath
import fsspec
from fsspec.implementations.local import LocalFileSystem

ROOT_VAR = "OAPL_FAKE_BUCKET"


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
    return super()._open(path, mode, **kwargs)

  def mv(self, *args, **kwargs):
    raise OSError("fake bucket: object storage has no rename")

  rename = move = mv


def install() -> None:
  gpath._is_tf_installed = lambda: False  # gs:// through fsspec, not TensorFlow's GCS client
  fsspec.register_implementation("gs", FakeBucket, clobber=True)
  fsspec.register_implementation("gcs", FakeBucket, clobber=True)


if os.environ.get(ROOT_VAR):
  install()
