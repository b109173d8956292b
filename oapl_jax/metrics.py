"""Metrics: one JSON line per logged trainer step, TensorBoard events through clu, console lines.

Multi-host: process 0 alone writes them (`oapl_jax.train` opens `MetricsLog` there only; `say`
prints there only), with the metrics combined over all processes (`oapl_jax.rl.loop`)."""

from __future__ import annotations

import json
import logging
import os
import sys

from clu import metric_writers
from tqdm import auto as tqdm  # a widget in notebooks, a text bar in terminals

from oapl_jax.workdir import Layout

log = logging.getLogger(__name__)


def say(msg: str) -> None:
  """A progress line on the console that does not break the progress bar (and in the log);
  multi-host: from process 0 only (every process computes the same line)."""
  import jax  # noqa: PLC0415 (started by now: the line reports on work done)
  if jax.process_index() == 0:
    tqdm.tqdm.write(msg)
    logging.info(msg)


def write_json(path: str, obj) -> None:
  """Writes `obj` to `path` aside, then renames it: a reader never sees half a file."""
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=2)
  os.replace(tmp, path)


class MetricsLog:
  """Appends to `<workdir>/metrics.jsonl` and writes TensorBoard scalars.

  On resume, lines for steps after the restored checkpoint (written before a crash) are
  dropped so the file reads as one continuous run, and so is a line cut short by a power loss
  (with a warning naming it); every complete line ends in a newline before anything is appended.
  """

  def __init__(self, workdir: str, *, resume_step: int = 0):
    self.path = Layout(workdir).metrics
    self._truncate_after(resume_step)
    self._file = open(self.path, "a")
    self._tb = metric_writers.create_default_writer(workdir, asynchronous=False)

  def _truncate_after(self, step: int) -> None:
    if not os.path.exists(self.path):
      return
    kept = [line for row, line in _complete_lines(self.path) if row["step"] <= step]
    with open(self.path, "w") as f:
      f.writelines(line.rstrip("\n") + "\n" for line in kept)

  def write(self, step: int, metrics: dict) -> None:
    row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
    self._file.write(json.dumps(row) + "\n")
    self._file.flush()
    scalars = {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}
    self._tb.write_scalars(step, scalars)

  def close(self) -> None:
    self._file.close()
    self._tb.close()


def _plain(v):
  """numpy / jax scalars -> Python numbers; dicts pass through (e.g. histograms)."""
  if isinstance(v, dict):
    return {str(k): _plain(x) for k, x in v.items()}
  try:
    return float(v) if not isinstance(v, int) else v
  except TypeError:
    return v


def read_metrics(workdir: str) -> list[dict]:
  """The rows of `<workdir>/metrics.jsonl`, one dict per logged trainer step."""
  return [row for row, _ in _complete_lines(Layout(workdir).metrics)]


def _complete_lines(path: str) -> list[tuple[dict, str]]:
  """(row, line) of every complete row of a metrics file; a line that is not one (half-written
  when the power went) is dropped with a warning naming the file and line."""
  rows = []
  with open(path, errors="replace") as f:  # a power loss may leave bytes that are not text
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError:
        row = None
      if isinstance(row, dict) and "step" in row:
        rows.append((row, line))
      else:
        _warn(f"{path} line {number} is not a complete row (cut short?): dropped: {line.strip()[:80]!r}")
  return rows


def _warn(msg: str) -> None:
  """A warning both in the log and as a line on stderr."""
  log.warning("%s", msg)
  print(f"WARNING: {msg}", file=sys.stderr, flush=True)
