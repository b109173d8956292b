"""Where a study's files lie under its folder `out`: one place for every path the runner writes
and the report reads (inside a run's folder, its workdir: `oapl_jax.workdir.Layout`).

    <out>/study_command.txt                      the command that ran the study (quoted by the report)
    <out>/base_models/                           each seed's warmed-up base model, shared by its runs
    <out>/runs/<method>_lag<L>_seed<S>/          a run's workdir (summary.json once finished)
    <out>/sweep/<method>_lag<L>_seed<S>_lr<lr>/  a learning-rate sweep run
    <out>/sweep/chosen.json                      the sweep's table and each method's chosen lr
"""

from __future__ import annotations

import os
import re

WALL_SECONDS = "study_wall_seconds.json"  # in a run's folder: its wall time in the study

_RUN_NAME = re.compile(r"^(?P<method>.+)_lag(?P<lag>\d+)_seed(?P<seed>\d+)$")


def run_dir(out: str, method: str, lag: int, seed: int, lr: float | None = None) -> str:
  """`<out>/runs/<method>_lag<L>_seed<S>`; a sweep run: `<out>/sweep/<...>_lr<lr>`."""
  if lr is None:
    return os.path.join(out, "runs", f"{method}_lag{lag}_seed{seed}")
  return os.path.join(out, "sweep", f"{method}_lag{lag}_seed{seed}_lr{lr:g}")


def runs_root(out: str) -> str:
  """`<out>/runs`: the study's run folders."""
  return os.path.join(out, "runs")


def parse_run_name(name: str) -> tuple[str, int, int] | None:
  """(method, lag, seed) of a run folder's name made by `run_dir`; None for any other name."""
  match = _RUN_NAME.match(name)
  return (match["method"], int(match["lag"]), int(match["seed"])) if match else None


def chosen_path(out: str) -> str:
  """`<out>/sweep/chosen.json`."""
  return os.path.join(out, "sweep", "chosen.json")


def base_models_dir(out: str) -> str:
  """`<out>/base_models`: the warm-up cache shared by all runs of a seed."""
  return os.path.join(out, "base_models")


def command_path(out: str) -> str:
  """`<out>/study_command.txt`."""
  return os.path.join(out, "study_command.txt")
