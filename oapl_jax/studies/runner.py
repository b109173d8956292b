"""The study's runs, budgeted and resumable: the learning-rate sweep, then every (seed, lag,
method). A run already finished (its `summary.json`) is skipped; one left unfinished resumes from
its checkpoints; past the deadline no run starts (`BudgetSpent`), so a study runs in pieces.
"""

from __future__ import annotations

import json
import os
import time

from oapl_jax.studies import layout
from oapl_jax.studies.definitions import DEFAULT_LAGS, DEFAULT_SEEDS, METHODS, study_config
from oapl_jax.workdir import Layout


class BudgetSpent(Exception):
  """`--budget-minutes` ran out with runs left (the study resumes where it stopped)."""


def _add_wall_seconds(d: str, seconds: float) -> None:
  """Adds a piece's wall time to run `d`'s total (pieces of a resumed run add up)."""
  wall_path = os.path.join(d, layout.WALL_SECONDS)
  with open(wall_path + ".part", "a") as f:
    f.write(f"{seconds}\n")
  with open(wall_path + ".part") as f:
    total = sum(float(x) for x in f)
  with open(wall_path, "w") as f:
    json.dump(total, f)


def _run_all(out: str, todo: list, *, reduced: bool, overrides: dict | None, study: str,
             deadline: float | None, echo, in_sweep: bool = False) -> list[str]:
  """Runs each (seed, lag, method, lr) of `todo` not finished yet; a run left unfinished by an
  earlier piece resumes from its checkpoints. Raises `BudgetSpent` past `deadline`."""
  from oapl_jax import train  # heavy import, only when running
  dirs = []
  for i, (seed, lag, method, lr) in enumerate(todo, 1):
    d = layout.run_dir(out, method, lag, seed, lr if in_sweep else None)
    dirs.append(d)
    if os.path.isfile(Layout(d).summary):
      echo(f"[{i}/{len(todo)}] {os.path.basename(d)}: done already")
      continue
    if deadline is not None and time.perf_counter() > deadline:
      raise BudgetSpent(f"budget spent: {len(todo) - i + 1} of {len(todo)} runs left "
                        f"(next: {os.path.basename(d)}); run the same command again to go on")
    t0 = time.perf_counter()
    config = study_config(method, lag, seed, reduced=reduced, study=study,
                          overrides={**(overrides or {}), **({"train.lr": lr} if lr else {})},
                          cache_dir=layout.base_models_dir(out))
    s = train.run(config, d)
    _add_wall_seconds(d, time.perf_counter() - t0)
    echo(f"[{i}/{len(todo)}] {os.path.basename(d)}: pass@1 {s['eval_before']['pass@1']:.3f} -> "
         f"{s['eval_after']['pass@1']:.3f} ({time.perf_counter() - t0:.0f}s)")
  return dirs


def sweep(out: str, *, methods, lrs, lag: int, seed: int, reduced: bool = False,
          overrides: dict | None = None, study: str = "tiny", deadline: float | None = None,
          echo=print) -> dict[str, float]:
  """Each method at each lr (lag `lag`, seed `seed`); returns and writes `<out>/sweep/chosen.json`:
  per method the lr of the best final pass@1 (ties: the smaller lr)."""
  todo = [(seed, lag, m, float(lr)) for m in methods for lr in lrs]
  _run_all(out, todo, reduced=reduced, overrides=overrides, study=study, deadline=deadline,
           echo=echo, in_sweep=True)
  chosen, table = {}, {}
  for method in methods:
    scores = []
    for lr in sorted(float(x) for x in lrs):
      with open(Layout(layout.run_dir(out, method, lag, seed, lr)).summary) as f:
        scores.append((json.load(f)["eval_after"]["pass@1"], -lr, lr))
    table[method] = {f"{lr:g}": p for p, _, lr in scores}
    chosen[method] = max(scores)[2]
  with open(layout.chosen_path(out), "w") as f:
    json.dump({"lag": lag, "seed": seed, "pass1_after": table, "lr": chosen}, f, indent=1)
  echo("sweep: " + ", ".join(f"{m} lr={lr:g}" for m, lr in chosen.items()))
  return chosen


def run_study(out: str, *, methods=tuple(METHODS), lags=DEFAULT_LAGS, seeds=DEFAULT_SEEDS,
              reduced: bool = False, overrides: dict | None = None, echo=print,
              study: str = "tiny", lrs: dict[str, float] | None = None,
              deadline: float | None = None) -> list[str]:
  """Runs every (seed, lag, method) not finished yet; returns the run folders.

  Seeds outermost, so a study stopped early has every method and lag for its first seeds.
  All runs of a seed share one warmed-up base model (`<out>/base_models`). lrs: a method's
  train.lr (from `sweep`); others keep the config's.
  """
  todo = [(s, l, m, (lrs or {}).get(m)) for s in seeds for l in lags for m in methods]
  return _run_all(out, todo, reduced=reduced, overrides=overrides, study=study,
                  deadline=deadline, echo=echo)
