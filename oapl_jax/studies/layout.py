"""Where a study's files lie under its folder `out`, and under a results folder: one place for
every path the runner writes and the report reads (inside a run's folder, its workdir:
`oapl_jax.workdir.Layout`).

    <out>/study_command.txt                      the command that ran the study (quoted by the report)
    <out>/base_models/                           each seed's warmed-up base model (and its build lock), shared by its runs
    <out>/runs/<method>_lag<L>_seed<S>/          a run's workdir (summary.json once finished)
    <out>/sweep/<method>_lag<L>_seed<S>_<point>/ a search run (<point>: search.label, "lr0.001")
    <out>/sweep/search.json                      the search's plan: its lags, seed and grids
    <out>/sweep/chosen.json                      the search's table and each method's chosen setting

A results folder (`--results`, committed in the repository: docs/reasoning_study/results) holds
each finished run's small result (results.compact: no checkpoints, no per-answer lists):

    <results>/runs/<run name>.json, <results>/sweep/<run name>.json, <results>/sweep/search.json
"""

from __future__ import annotations

import os
import re

WALL_SECONDS = "study_wall_seconds.json"  # in a run's folder: its wall time in the study
RUNS, SWEEP = "runs", "sweep"  # the two kinds of run: the study's and the search's

_RUN_NAME = re.compile(r"^(?P<method>.+?)_lag(?P<lag>\d+)_seed(?P<seed>\d+)(?:_(?P<point>.+))?$")


def run_name(method: str, lag: int, seed: int, point: str | None = None) -> str:
  """`<method>_lag<L>_seed<S>`, with `_<point>` for a search run."""
  return f"{method}_lag{lag}_seed{seed}" + (f"_{point}" if point else "")


def run_dir(out: str, method: str, lag: int, seed: int, point: str | None = None) -> str:
  """`<out>/runs/<method>_lag<L>_seed<S>`; a search run: `<out>/sweep/<...>_<point>`."""
  return os.path.join(out, SWEEP if point else RUNS, run_name(method, lag, seed, point))


def runs_root(out: str, kind: str = RUNS) -> str:
  """`<out>/runs` (the study's run folders) or `<out>/sweep` (the search's)."""
  return os.path.join(out, kind)


def parse_run_name(name: str) -> tuple[str, int, int, str | None] | None:
  """(method, lag, seed, point or None) of a run folder's name made by `run_dir`; None for any
  other name."""
  match = _RUN_NAME.match(name)
  return (match["method"], int(match["lag"]), int(match["seed"]), match["point"]) if match else None


def result_path(results: str, kind: str, name: str) -> str:
  """`<results>/<kind>/<name>.json`: a run's committed result."""
  return os.path.join(results, kind, name + ".json")


def search_plan_path(root: str) -> str:
  """`<root>/sweep/search.json` (root: a study's folder or a results folder)."""
  return os.path.join(root, SWEEP, "search.json")


def chosen_path(out: str) -> str:
  """`<out>/sweep/chosen.json`."""
  return os.path.join(out, SWEEP, "chosen.json")


def base_models_dir(out: str) -> str:
  """`<out>/base_models`: the warm-up cache shared by all runs of a seed."""
  return os.path.join(out, "base_models")


def command_path(out: str) -> str:
  """`<out>/study_command.txt`."""
  return os.path.join(out, "study_command.txt")
