"""A study's finished runs read back from its folder: each run's summary, metrics and wall time
(`RunResult`, `load_runs`), and the learning-rate sweep's choice (`read_chosen`)."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from oapl_jax.metrics import read_metrics
from oapl_jax.studies import layout
from oapl_jax.studies.stats import mean_pass_at_k
from oapl_jax.workdir import Layout


@dataclasses.dataclass
class RunResult:
  method: str
  lag: int
  seed: int
  summary: dict
  metrics: list[dict]
  wall_seconds: float | None = None  # the run's wall time in the study (warm-up, evals, compiles)

  def passk(self, when: str, ks) -> np.ndarray:
    """pass@k for each k from the per-problem correct counts of eval `when` (before / after)."""
    e = self.summary[f"eval_{when}"]
    return mean_pass_at_k(e["samples_per_problem"], e["correct_per_problem"], ks)

  def eval_curve(self, key: str) -> tuple[np.ndarray, np.ndarray]:
    """(generated answers, the held-out figure `key`): before, every eval during training, after."""
    samples_at = {m["step"]: m["samples_generated"] for m in self.metrics}
    xs, ys = [0], [self.summary["eval_before"][key]]
    for e in self.summary["evals_during"]:
      xs.append(samples_at[e["step"]])
      ys.append(e[key])
    xs.append(self.summary["samples_generated"])
    ys.append(self.summary["eval_after"][key])
    return np.array(xs, float), np.array(ys, float)

  def pass1_curve(self) -> tuple[np.ndarray, np.ndarray]:
    return self.eval_curve("pass@1")

  def series(self, key: str) -> tuple[np.ndarray, np.ndarray]:
    rows = [m for m in self.metrics if key in m]
    return np.array([m["step"] for m in rows]), np.array([m[key] for m in rows], float)


def _read_json(path: str):
  with open(path) as f:
    return json.load(f)


def load_runs(out: str) -> list[RunResult]:
  """Every finished run under `<out>/runs`."""
  results = []
  root = layout.runs_root(out)
  for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
    parsed = layout.parse_run_name(name)
    path = Layout(os.path.join(root, name)).summary
    if not parsed or not os.path.isfile(path):
      continue
    wall_path = os.path.join(root, name, layout.WALL_SECONDS)
    wall = _read_json(wall_path) if os.path.isfile(wall_path) else None
    results.append(RunResult(*parsed, _read_json(path), read_metrics(os.path.join(root, name)), wall))
  return results


def read_chosen(out: str) -> dict | None:
  """The learning-rate sweep's `chosen.json` (lag, seed, pass1_after table, lr), or None if no
  sweep ran."""
  path = layout.chosen_path(out)
  return _read_json(path) if os.path.isfile(path) else None
