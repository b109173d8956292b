"""Rows of a dataset from a local JSONL / JSON / Parquet file or a prepared TFDS dataset.

:func:`read_rows` is the one reader every task uses. A *source* is

* a path ending in ``.jsonl`` (one JSON object per line; blank lines ignored; a bad row is
  named ``file:LINE``, lines counted from 1),
* a path ending in ``.json`` (one top-level JSON array of objects; ``file:row N``, N from 0),
* a path ending in ``.parquet`` (read with pyarrow; ``file:row N``, N from 0 as in pandas),
* ``tfds:NAME[/CONFIG][:VERSION]`` with a ``split`` (``train``, ``test[:100]``, ...): a TFDS
  dataset already prepared under ``data_dir`` (TFDS's default folder if None). Nothing is
  downloaded (``download=False``); bytes are decoded to ``str`` and numpy values become plain
  Python values (``tfds:NAME/split:row N``, N from 0).

``required`` maps field -> type (or tuple of types, as for ``isinstance``). A row is malformed
if it is not an object, misses a required field, holds a value of the wrong type (``bool``
never passes for ``int``/``float``), holds an empty list where a list is required, has text
that is not valid UTF-8, or if ``convert(row)`` raises ``ValueError`` (the tasks' converters
also refuse a row whose prompt is longer than ``sampling.max_prompt_len``). A malformed row is
fatal (:class:`BadRowError`, a ``ValueError`` naming the file and line/row, which the commands
print as one line) unless ``skip_bad_rows``: then it is skipped and counted in the
:class:`RowReport`, which keeps the first few reasons.

:func:`select` shuffles rows deterministically from a seed and shards them across hosts;
:func:`dedup` drops rows whose normalised text (:func:`normalize_text`) was already seen.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable

import numpy as np

from oapl_jax.errors import UserError

MAX_REASONS = 5  # reasons for skipped rows kept in a RowReport (the rest are only counted)
TFDS_PREFIX = "tfds:"
_TYPE_NAMES = {str: "a string", int: "an int", float: "a number", list: "a list", dict: "an object",
               bool: "a bool"}


class BadRowError(UserError, ValueError):
  """A malformed row read without ``skip_bad_rows``: ``"file:line: why"``."""


@dataclasses.dataclass
class RowReport:
  """What :func:`read_rows` read: ``total`` rows seen, ``skipped`` of them malformed."""

  path: str
  total: int = 0
  skipped: int = 0
  reasons: list[str] = dataclasses.field(default_factory=list)  # first MAX_REASONS, "where: why"

  @property
  def kept(self) -> int:
    return self.total - self.skipped

  def summary(self) -> str:
    """One line for the log, e.g. ``"a.jsonl: 98 rows kept, 2 skipped (a.jsonl:7: ...; ...)"``."""
    line = f"{self.path}: {self.kept} rows kept, {self.skipped} skipped"
    if self.reasons:
      more = "; ..." if self.skipped > len(self.reasons) else ""
      line += f" ({'; '.join(self.reasons)}{more})"
    return line


def is_tfds(source: str) -> bool:
  """Whether ``source`` names a TFDS dataset (``tfds:NAME[/CONFIG]``)."""
  return isinstance(source, str) and source.startswith(TFDS_PREFIX)


def normalize_text(text: str) -> str:
  """Text for de-duplication: lower-cased, whitespace runs collapsed to one space."""
  return " ".join(str(text).split()).lower()


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def _type_name(kind) -> str:
  kinds = kind if isinstance(kind, tuple) else (kind,)
  return " or ".join(_TYPE_NAMES.get(k, k.__name__) for k in kinds)


def _is_instance(value, kind) -> bool:
  kinds = kind if isinstance(kind, tuple) else (kind,)
  if isinstance(value, bool) and bool not in kinds:
    return False  # True is not an int answer, nor a number
  if float in kinds and isinstance(value, int):
    return True
  return isinstance(value, kinds)


def check_row(row, required: dict[str, Any] | None) -> str | None:
  """Why ``row`` is malformed for ``required`` (field -> type), or None if it is fine."""
  if not isinstance(row, dict):
    return f"expected a JSON object, got {type(row).__name__}"
  for field, kind in (required or {}).items():
    if field not in row:
      return f"missing field {field!r}"
    value = row[field]
    if not _is_instance(value, kind):
      return f"field {field!r} must be {_type_name(kind)}, got {type(value).__name__}"
    if isinstance(value, (list, dict)) and not value:
      return f"field {field!r} is empty"
  return None


class _Collector:
  """Keeps good rows, and counts (or raises on) bad ones."""

  def __init__(self, path, required, convert, skip_bad_rows):
    self.report = RowReport(path=path)
    self.rows: list[dict] = []
    self.required, self.convert, self.skip = required, convert, skip_bad_rows

  def bad(self, where: str, why: str) -> None:
    self.report.total += 1
    message = f"{where}: {why}"
    if not self.skip:
      raise BadRowError(message)
    self.report.skipped += 1
    if len(self.report.reasons) < MAX_REASONS:
      self.report.reasons.append(message)

  def add(self, where: str, row) -> None:
    why = check_row(row, self.required)
    if why is None and self.convert is not None:
      try:
        row = self.convert(row)
      except ValueError as e:
        why = str(e) or type(e).__name__
    if why is not None:
      self.bad(where, why)
      return
    self.report.total += 1
    self.rows.append(row)


# --------------------------------------------------------------------------------------------
# Readers
# --------------------------------------------------------------------------------------------


def _read_jsonl(path: str, out: _Collector) -> None:
  with open(path, "rb") as f:
    for lineno, raw in enumerate(f, start=1):
      where = f"{path}:{lineno}"
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        out.bad(where, f"not valid UTF-8 text (byte {e.start})")
        continue
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        out.bad(where, f"malformed JSON ({e.msg} at column {e.colno})")
        continue
      out.add(where, row)


def _read_json(path: str, out: _Collector) -> None:
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except UnicodeDecodeError as e:
    raise ValueError(f"{path}: not valid UTF-8 text (byte {e.start})") from None
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}:{e.lineno}: malformed JSON ({e.msg} at column {e.colno})") from None
  if not isinstance(data, list):
    raise ValueError(f"{path}: expected a JSON array of objects, got {type(data).__name__} "
                     "(use .jsonl for one object per line)")
  for i, row in enumerate(data):
    out.add(f"{path}:row {i}", row)


def _plain(value):
  """A pyarrow / numpy value as plain Python (bytes decoded as UTF-8: UnicodeDecodeError)."""
  if isinstance(value, bytes):
    return value.decode("utf-8")
  if isinstance(value, np.ndarray):
    return [_plain(v) for v in value.tolist()] if value.dtype != object else \
        [_plain(v) for v in value]
  if isinstance(value, np.generic):
    return _plain(value.item())
  if isinstance(value, dict):
    return {k: _plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_plain(v) for v in value]
  return value


def _read_parquet(path: str, out: _Collector) -> None:
  import pyarrow.parquet as pq  # noqa: PLC0415 (only parquet sources need it)

  try:
    pf = pq.ParquetFile(path)
  except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds; name the file
    raise ValueError(f"{path}: not a readable Parquet file ({e})") from None
  i = 0
  for batch in pf.iter_batches(batch_size=1024):
    for raw in batch.to_pylist():
      _add_decoded(out, f"{path}:row {i}", raw)
      i += 1


def _add_decoded(out: _Collector, where: str, raw) -> None:
  """Adds a Parquet/TFDS row with bytes decoded to text; undecodable text is a bad row."""
  try:
    row = _plain(raw)
  except UnicodeDecodeError as e:
    out.bad(where, f"not valid UTF-8 text (byte {e.start})")
    return
  out.add(where, row)


def _read_tfds(source: str, split: str | None, data_dir: str | None, out: _Collector) -> None:
  if not split:
    raise ValueError(f"{source}: a TFDS source needs a split (e.g. 'train')")
  name = source[len(TFDS_PREFIX):]
  if not name:
    raise ValueError(f"{source!r}: expected tfds:NAME[/CONFIG]")
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  import tensorflow_datasets as tfds  # noqa: PLC0415 (slow import; only TFDS sources need it)

  try:
    ds = tfds.load(name, split=split, data_dir=data_dir, download=False, shuffle_files=False)
  except Exception as e:  # noqa: BLE001 - TFDS raises assertion/value/not-found errors
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    raise ValueError(
        f"{source} (split {split!r}, data_dir={data_dir!r}): cannot load it ({first}). Nothing "
        f"is downloaded: prepare it first (e.g. `tfds build {name.split('/')[0]} "
        f"--data_dir=...`) or copy a prepared folder there.") from None
  for i, raw in enumerate(tfds.as_numpy(ds)):
    _add_decoded(out, f"{source}/{split}:row {i}", raw)


def read_rows(source: str, *, split: str | None = None, data_dir: str | None = None,
              skip_bad_rows: bool = False, required: dict[str, Any] | None = None,
              convert: Callable[[dict], dict] | None = None) -> tuple[list[dict], RowReport]:
  """``(rows, report)`` of ``source`` (see the module docstring for the kinds of source).

  Args:
    source: a ``.jsonl`` / ``.json`` / ``.parquet`` path, or ``tfds:NAME[/CONFIG]``.
    split: TFDS split (required for TFDS sources; ignored for files).
    data_dir: TFDS data folder (None: TFDS's default).
    skip_bad_rows: skip and count malformed rows instead of raising.
    required: field -> type (or tuple of types) every row must have.
    convert: called on each row that passed ``required``; returns the row to keep; a
      ``ValueError`` it raises marks the row malformed with its message as the reason.

  Raises:
    FileNotFoundError: a local source that does not exist.
    ValueError: an unknown kind of source, an unreadable file, or (unless ``skip_bad_rows``)
      the first malformed row, as ``"file:line: why"`` / ``"file:row N: why"``.
  """
  source = os.fspath(source)
  if is_tfds(source):
    out = _Collector(f"{source}/{split}", required, convert, skip_bad_rows)
    _read_tfds(source, split, data_dir, out)
    return out.rows, out.report
  ext = os.path.splitext(source)[1].lower()
  if ext not in _READERS:
    raise ValueError(f"{source!r}: unknown kind of data source; expected a .jsonl, .json or "
                     ".parquet file, or tfds:NAME[/CONFIG]")
  return read_file(source, ext[1:], skip_bad_rows=skip_bad_rows, required=required,
                   convert=convert)


_READERS = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet}


def read_file(path: str, fmt: str, *, skip_bad_rows: bool = False,
              required: dict[str, Any] | None = None,
              convert: Callable[[dict], dict] | None = None) -> tuple[list[dict], RowReport]:
  """:func:`read_rows` of a local file in format ``fmt`` ("jsonl", "json" or "parquet"),
  whatever its name ends with."""
  path = os.fspath(path)
  if "." + fmt not in _READERS:
    raise ValueError(f"unknown file format {fmt!r}; expected one of jsonl, json, parquet")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no such file: {path!r}")
  out = _Collector(path, required, convert, skip_bad_rows)
  _READERS["." + fmt](path, out)
  return out.rows, out.report


# --------------------------------------------------------------------------------------------
# Order, shards, duplicates
# --------------------------------------------------------------------------------------------


def select(rows: list, *, seed: int | None, num_shards: int = 1, shard_index: int = 0) -> list:
  """``rows`` shuffled by ``seed`` (None: kept in order), then this host's shard.

  Row ``i`` of the shuffled list goes to shard ``i % num_shards``, so shards differ in size by
  at most one and together hold every row exactly once. Same arguments -> same result.
  """
  if num_shards < 1 or not 0 <= shard_index < num_shards:
    raise ValueError(f"shard_index={shard_index}, num_shards={num_shards}: need "
                     "0 <= shard_index < num_shards")
  order = (np.arange(len(rows)) if seed is None
           else np.random.default_rng(seed).permutation(len(rows)))
  return [rows[int(i)] for i in order[shard_index::num_shards]]


def dedup(rows: list, key: str | Callable[[Any], str]) -> list:
  """``rows`` without those whose ``normalize_text(key)`` already occurred (first one kept).

  ``key`` is a field name or a function of the row.
  """
  get = key if callable(key) else (lambda r: r[key])
  seen: set[str] = set()
  out = []
  for row in rows:
    k = normalize_text(get(row))
    if k not in seen:
      seen.add(k)
      out.append(row)
  return out


def host_shard(rows: list) -> list:
  """This JAX process's share of `rows` (`select` without shuffling): on a pod, each host
  samples prompts from its own disjoint shard; on one host, all rows."""
  import jax  # noqa: PLC0415 (keep this module importable without initialising JAX)
  return select(rows, seed=None, num_shards=jax.process_count(), shard_index=jax.process_index())
