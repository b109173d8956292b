"""gcp-storage-emulator (a test extra) with Cloud Storage's generation preconditions added.

    python tests/gcs_emulator.py start --host=127.0.0.1 --port=PORT --in-memory --default-bucket=bkt

The emulator serves the JSON API that gcsfs, google-cloud-storage and tensorstore speak, but
ignores `ifGenerationMatch` / `ifGenerationNotMatch` and sends no `x-goog-generation` header with
an object's bytes. Real Cloud Storage does both, and two things here depend on them:
tensorstore's OCDBT checkpoints (orbax) re-read their manifest with `ifGenerationNotMatch` and
read the generation from that header ("Malformed StorageGeneration" without it), and a
conditional create (`ifGenerationMatch=0`: only if there is no such object) is how one of two
writers wins. This wraps the emulator's object handlers, before its server is built, with what
https://cloud.google.com/storage/docs/request-preconditions documents: a request whose
`ifGenerationMatch` is not the object's generation (0: no object) fails with 412; a read whose
`ifGenerationNotMatch` is the object's generation gets 304; every read of an object says its
generation. Each check and the write it guards happen under one lock, as one step.
"""

import sys
import threading
from http import HTTPStatus

from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects

_LOCK = threading.RLock()  # get(alt=media) calls download: both wrapped


def _generation(storage, bucket: str, name: str) -> int:
  """The object's generation; 0 if there is none (the API's meaning of 0)."""
  try:
    return int(storage.get_file_obj(bucket, name)["generation"])
  except NotFound:
    return 0


def _query_int(request, key: str):
  values = request.query.get(key)
  return int(values[0]) if values else None


def _upload_name(request):
  """The object an upload writes: `name` in the query, else (multipart, resumable) its metadata."""
  if "name" in request.query:
    return request.query["name"][0]
  data = request.data if isinstance(request.data, dict) else {}
  return (data.get("meta") or data).get("name")


def _guarded(handler, name_of, *, read: bool):
  def guarded(request, response, storage, *args, **kwargs):
    with _LOCK:
      name = name_of(request)
      if name is None or "upload_id" in request.query:  # a resumable upload's later chunks: checked at its start
        return handler(request, response, storage, *args, **kwargs)
      have = _generation(storage, request.params["bucket_name"], name)
      match, not_match = _query_int(request, "ifGenerationMatch"), _query_int(request, "ifGenerationNotMatch")
      if match is not None and match != have:
        response.status = HTTPStatus.PRECONDITION_FAILED
        response.json({"error": {"code": 412, "message": f"ifGenerationMatch={match}: the generation is {have}"}})
        return None
      if not_match is not None and not_match == have:
        response.status = HTTPStatus.NOT_MODIFIED if read else HTTPStatus.PRECONDITION_FAILED
        return None
      if read and have:
        response["x-goog-generation"] = str(have)
      return handler(request, response, storage, *args, **kwargs)
  return guarded


def install() -> None:
  """Wraps the object handlers; before `gcp_storage_emulator.server` is imported (it builds its
  routes from them)."""
  by_path = lambda request: request.params.get("object_id")  # noqa: E731
  objects.insert = _guarded(objects.insert, _upload_name, read=False)
  objects.xml_upload = _guarded(objects.xml_upload, by_path, read=False)
  objects.download = _guarded(objects.download, by_path, read=True)
  objects.get = _guarded(objects.get, by_path, read=True)
  objects.delete = _guarded(objects.delete, by_path, read=False)


if __name__ == "__main__":
  install()
  from gcp_storage_emulator.__main__ import main  # noqa: E402 (after install)
  main(sys.argv[1:])
