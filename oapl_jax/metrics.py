"""Metrics: one JSON line per logged trainer step, plus TensorBoard events through clu."""

from __future__ import annotations

import json
import os

from clu import metric_writers


class MetricsLog:
  """Appends to `<workdir>/metrics.jsonl` and writes TensorBoard scalars.

  On resume, lines for steps after the restored checkpoint (written before a crash) are
  dropped so the file reads as one continuous run.
  """

  def __init__(self, workdir: str, *, resume_step: int = 0):
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._truncate_after(resume_step)
    self._file = open(self.path, "a")
    self._tb = metric_writers.create_default_writer(workdir, asynchronous=False)

  def _truncate_after(self, step: int) -> None:
    if not os.path.exists(self.path):
      return
    with open(self.path) as f:
      lines = [l for l in f if l.strip() and json.loads(l)["step"] <= step]
    with open(self.path, "w") as f:
      f.writelines(lines)

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
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]
