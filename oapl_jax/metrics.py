"""Metrics: one JSON line per logged trainer step, TensorBoard scalars, console lines.

TensorBoard: `EventsFile` writes the events file with tensorboard's own protos and record
framing, so neither training nor sampling imports TensorFlow (clu's writer is `tf.summary`).

Multi-host: process 0 alone writes them (`oapl_jax.train` opens `MetricsLog` there only; `say`
prints there only), with the metrics combined over all processes (`oapl_jax.rl.loop`)."""

from __future__ import annotations

import io
import json
import logging
import math
import socket
import sys
import time

from tqdm import auto as tqdm  # a widget in notebooks, a text bar in terminals

from oapl_jax import storage
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
  """Writes `obj` to `path` (a local path or a URL) at once: a reader never sees half a file."""
  storage.write_text(path, json.dumps(obj, indent=2))


def read_json(path: str):
  return json.loads(storage.read_text(path))


class MetricsLog:
  """Appends to `<workdir>/metrics.jsonl` and (with `tensorboard`) writes TensorBoard scalars.

  On resume, lines for steps after the restored checkpoint (written before a crash) are
  dropped so the file reads as one continuous run, and so is a line cut short by a power loss
  (with a warning naming it); every complete line ends in a newline before anything is appended.
  In a bucket (object storage has no append) the whole file is uploaded again at each write.
  """

  def __init__(self, workdir: str, *, resume_step: int = 0, tensorboard: bool = True):
    self.path = Layout(workdir).metrics
    lines = self._truncate_after(resume_step)
    self._lines = lines if storage.is_remote(self.path) else None  # a bucket's whole file
    self._file = None if storage.is_remote(self.path) else open(self.path, "a")
    self._tb = EventsFile(workdir) if tensorboard else None

  def _truncate_after(self, step: int) -> list[str]:
    """Keeps the complete lines of steps <= `step`; returns them."""
    if not storage.exists(self.path):
      return []
    kept = [line.rstrip("\n") + "\n" for row, line in _complete_lines(self.path) if row["step"] <= step]
    storage.write_text(self.path, "".join(kept))
    return kept

  def write(self, step: int, metrics: dict) -> None:
    row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
    line = json.dumps(row) + "\n"
    if self._file is not None:
      self._file.write(line)
      self._file.flush()
    else:
      self._lines.append(line)
      storage.write_text(self.path, "".join(self._lines))
    if self._tb is not None:
      scalars = {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}
      self._tb.write_scalars(step, scalars)

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
    if self._tb is not None:
      self._tb.close()


class EventsFile:
  """TensorBoard scalars in `<logdir>/events.out.tfevents.<time>.<host>`, without TensorFlow:
  a TFRecord file of `Event` protos (tensorboard's `event_pb2` and `RecordWriter`), the format
  `tf.summary` writes and TensorBoard reads.

  Locally the file is appended to and flushed at every write; at a URL (object storage has no
  append) the whole file is uploaded again at every write, as `metrics.jsonl` is.
  """

  def __init__(self, logdir: str):
    from tensorboard.compat.proto import event_pb2, summary_pb2  # noqa: PLC0415 (only with TensorBoard on)
    from tensorboard.summary.writer.record_writer import RecordWriter  # noqa: PLC0415
    self._event, self._summary = event_pb2.Event, summary_pb2.Summary
    self.path = storage.join(logdir, f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}")
    self._bytes = io.BytesIO() if storage.is_remote(self.path) else None  # a bucket's whole file
    self._records = RecordWriter(self._bytes if self._bytes is not None else open(self.path, "ab"))
    self._write(self._event(wall_time=time.time(), file_version="brain.Event:2"))

  def write_scalars(self, step: int, scalars: dict) -> None:
    values = [self._summary.Value(tag=k, simple_value=float(v)) for k, v in scalars.items()]
    self._write(self._event(wall_time=time.time(), step=step, summary=self._summary(value=values)))

  def _write(self, event) -> None:
    self._records.write(event.SerializeToString())
    if self._bytes is None:
      self._records.flush()
    else:
      from etils import epath  # noqa: PLC0415 (URLs only)
      epath.Path(self.path).write_bytes(self._bytes.getvalue())

  def close(self) -> None:
    if self._bytes is None:
      self._records.close()


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
  for number, line in enumerate(io.StringIO(storage.read_text(path)), 1):  # split at "\n" only
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
  """A warning as one line on stderr, and in the log (not printed again by absl's handler)."""
  print(f"WARNING: {msg}", file=sys.stderr, flush=True)
  log.warning("%s", msg, extra={"said": True})


class DeadModelWatch:
  """Counts trainer steps in a row whose gradient norm is 0 or whose policy is uniform (entropy
  ln V): a model that stopped learning, which no error would stop. `update` returns a warning
  line once the count reaches `steps` (again only after a step that breaks the run of them)."""

  def __init__(self, steps: int, vocab_size: int):
    self.steps, self.uniform, self.count = steps, math.log(vocab_size), 0

  def update(self, step: int, m: dict) -> str | None:
    dead = float(m["grad_norm"]) == 0.0 or abs(float(m["entropy"]) - self.uniform) < 1e-3
    self.count = self.count + 1 if dead else 0
    if self.steps and self.count == self.steps:
      return (f"WARNING: at step {step}, the gradient norm has been 0 or the policy uniform (entropy "
              f"{float(m['entropy']):.3f}, ln V = {self.uniform:.3f}) for {self.steps} steps in a row: "
              f"the weights stopped learning (is train.lr too high?)")
    return None


class ConsoleNotes:
  """The console lines of what a step did that metrics.jsonl alone would hide: a skipped step
  (its loss or gradient norm was not finite: no update), groups dropped as stale (realised lag
  above rl.max_lag; the first drop at once, then at most one line per `every_s` seconds with the
  count since the last line), and a model that stopped learning (`DeadModelWatch`)."""

  def __init__(self, config, dropped_stale: int = 0, every_s: float = 30.0):
    self.dead = DeadModelWatch(config.log.dead_model_steps, config.model.vocab_size)
    self.max_lag, self.max_nonfinite = config.rl.max_lag, config.train.max_nonfinite_steps
    self.dropped, self.unsaid, self.every_s, self.last = int(dropped_stale), 0, every_s, None

  def update(self, step: int, m: dict) -> list[str]:
    lines = []
    if bool(m.get("step_skipped", False)):
      lines.append(f"step {step}: skipped, its loss or gradient norm was not finite (no update; "
                   f"{int(m['steps_skipped'])} skipped in all; train.max_nonfinite_steps="
                   f"{self.max_nonfinite} in a row stop the run)")
    dropped = int(m.get("groups_dropped_stale", self.dropped))
    self.unsaid += dropped - self.dropped
    self.dropped = dropped
    now = time.monotonic()
    if self.unsaid and (self.last is None or now - self.last >= self.every_s):
      lines.append(f"step {step}: {self.unsaid} group(s) dropped unused, older than rl.max_lag="
                   f"{self.max_lag} steps ({dropped} dropped in all)")
      self.unsaid, self.last = 0, now
    warning = self.dead.update(step, m)
    return lines + ([warning] if warning else [])
