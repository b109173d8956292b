"""The study's runs, budgeted and resumable: the settings search (search.py: every point at the
first lag, the screened ones at the later lags), then every (seed, lag, method) with the chosen
settings, seed by seed. A run already finished (its `summary.json` under `out`, or its result
committed under `results`) is skipped; one left unfinished resumes from its checkpoints; past
the deadline no run starts (`BudgetSpent`), so a study runs in pieces.
"""

from __future__ import annotations

import dataclasses
import filecmp
import json
import os
import re
import shutil
import time

from oapl_jax.errors import UserError
from oapl_jax.studies import layout, search as search_lib
from oapl_jax.studies.definitions import DEFAULT_LAGS, DEFAULT_METHODS, DEFAULT_SEEDS, study_config
from oapl_jax.studies.results import finished, load_compact
from oapl_jax.studies.search import plan_json, search_scores


class BudgetSpent(Exception):
  """`--budget-minutes` ran out with runs left (the study resumes where it stopped)."""


class RunsElsewhere(Exception):
  """Runs skipped because another process holds their workdir (two processes share a search or
  a study: each makes the runs the other has not taken); the same command, run again once they
  have finished, goes on."""


@dataclasses.dataclass(frozen=True)
class Run:
  """One run to make: a study run (point None) or a search run (point: its search.label)."""
  seed: int
  lag: int
  method: str
  overrides: dict
  point: str | None = None

  @property
  def kind(self) -> str:
    return layout.SWEEP if self.point else layout.RUNS

  @property
  def name(self) -> str:
    return layout.run_name(self.method, self.lag, self.seed, self.point)


def copy_bases(src: str, out: str) -> list[str]:
  """Puts the bases committed in `src` (`<src>/seed<S>-<hash>` folders and their
  `.eval-<hash>.json` "eval before" files, as `warmup.cache_path` names them) into
  `<out>/base_models`; returns the names copied. One already there is kept if it equals the
  committed one byte for byte, else `UserError` (a base built here, from this machine's
  kernels: runs would start from it, not from the committed one)."""
  if not os.path.isdir(src):
    raise UserError(f"--bases={src}: no such folder")
  names = sorted(n for n in os.listdir(src) if _BASE_NAME.match(n))
  if not names:
    raise UserError(f"--bases={src}: no base models in it (folders named seed<S>-<hash>)")
  dest, copied = layout.base_models_dir(out), []
  os.makedirs(dest, exist_ok=True)
  for name in names:
    a, b = os.path.join(src, name), os.path.join(dest, name)
    if os.path.exists(b):
      if not _same_tree(a, b):
        raise UserError(f"--bases={src}: {b} is there and differs from {a} (a base built or copied "
                        f"before): remove it, or give another --out")
      continue
    tmp = f"{b}.copying{os.getpid()}"  # copied aside, then renamed: a killed copy leaves no half base
    shutil.rmtree(tmp, ignore_errors=True)
    (shutil.copytree if os.path.isdir(a) else shutil.copyfile)(a, tmp)
    os.rename(tmp, b)
    copied.append(name)
  return copied


_BASE_NAME = re.compile(r"^seed\d+-[0-9a-f]+(\.eval-[0-9a-f]+\.json)?$")


def _same_tree(a: str, b: str) -> bool:
  """Whether file or folder `a` equals `b`: the same files, byte for byte."""
  if os.path.isfile(a) or os.path.isfile(b):
    return os.path.isfile(a) and os.path.isfile(b) and filecmp.cmp(a, b, shallow=False)
  files = lambda root: sorted(os.path.relpath(os.path.join(d, f), root)
                              for d, _, fs in os.walk(root) for f in fs)
  names = files(a)
  return names == files(b) and all(filecmp.cmp(os.path.join(a, f), os.path.join(b, f), shallow=False)
                                   for f in names)


def _add_wall_seconds(d: str, seconds: float) -> None:
  """Adds a piece's wall time to run `d`'s total (pieces of a resumed run add up)."""
  wall_path = os.path.join(d, layout.WALL_SECONDS)
  with open(wall_path + ".part", "a") as f:
    f.write(f"{seconds}\n")
  with open(wall_path + ".part") as f:
    total = sum(float(x) for x in f)
  with open(wall_path, "w") as f:
    json.dump(total, f)


def _run_all(out: str, todo: list[Run], *, reduced: bool, study: str, deadline: float | None,
             echo, results: str | None = None, bases_only: bool = False) -> list[str]:
  """Makes each run of `todo` not finished yet (under `out` or committed under `results`); a
  run left unfinished by an earlier piece resumes from its checkpoints. Raises `BudgetSpent`
  past `deadline`, and `RunsElsewhere` at the end if another process held some runs' workdirs.
  bases_only: the runs read their seed's base from `<out>/base_models` and never build one
  (`warmup.cached_only`; `copy_bases` put the committed ones there)."""
  from oapl_jax import train  # heavy import, only when running
  from oapl_jax.workdir import Interrupted, WorkdirBusy
  dirs, elsewhere = [], []
  for i, run in enumerate(todo, 1):
    d = layout.run_dir(out, run.method, run.lag, run.seed, run.point)
    dirs.append(d)
    if finished(out, run.kind, run.name, results):
      echo(f"[{i}/{len(todo)}] {run.name}: done already")
      continue
    if deadline is not None and time.perf_counter() > deadline:
      raise BudgetSpent(f"budget spent: {len(todo) - i + 1} of {len(todo)} runs left "
                        f"(next: {run.name}); run the same command again to go on")
    t0 = time.perf_counter()
    config = study_config(run.method, run.lag, run.seed, reduced=reduced, study=study,
                          overrides=run.overrides, cache_dir=layout.base_models_dir(out),
                          search=run.point is not None)
    config.warmup.cached_only = bases_only
    try:
      s = train.run(config, d)
    except WorkdirBusy:  # another process is making this run: go on with the next
      echo(f"[{i}/{len(todo)}] {run.name}: running in another process, skipped")
      elsewhere.append(run.name)
      continue
    except Interrupted:  # stopped by a signal with a checkpoint: the sitting's time counts too
      _add_wall_seconds(d, time.perf_counter() - t0)
      raise
    _add_wall_seconds(d, time.perf_counter() - t0)
    echo(f"[{i}/{len(todo)}] {run.name}: pass@1 {s['eval_before']['pass@1']:.3f} -> "
         f"{s['eval_after']['pass@1']:.3f} ({time.perf_counter() - t0:.0f}s)")
  if elsewhere:
    raise RunsElsewhere(f"{len(elsewhere)} runs are being made by another process "
                        f"({', '.join(elsewhere)}); run the same command again once they finish")
  return dirs


def search(out: str, *, grid: dict, lags, seed: int, top_k: int | None = None, reduced: bool = False,
           study: str = "tiny", deadline: float | None = None, echo=print,
           results: str | None = None, bases_only: bool = False) -> dict[str, dict]:
  """Every point of each method's grid at the first lag on seed `seed`, then its `top_k` best
  (`search.screened`; None: all) at each later lag, in `search.run_order`; returns each method's
  chosen overrides (`search.choose`) and writes them with the scores to `<out>/sweep/chosen.json`.
  The plan is written first (`<out>/sweep/search.json`).

  The later lags' runs are known only once every first-lag run has finished: a process that
  ends the first lag while another still makes some of its runs raises `RunsElsewhere` (run it
  again once they finish), as for any run left to another process."""
  plan = plan_json(grid, lags, seed, top_k)
  os.makedirs(layout.runs_root(out, layout.SWEEP), exist_ok=True)
  with open(layout.search_plan_path(out), "w") as f:
    json.dump(plan, f, indent=1)

  def scores():
    return search_scores(plan, load_compact(out, layout.SWEEP, results))
  done: set = set()
  while True:  # twice at most: the first lag, then (its scores known) the later lags' runs
    new = [x for x in search_lib.run_order(grid, lags, scores(), top_k) if x not in done]
    if not new:
      break
    _run_all(out, [Run(seed, lag, m, search_lib.overrides(grid[m], idx), search_lib.label(grid[m], idx))
                   for lag, m, idx in new],
             reduced=reduced, study=study, deadline=deadline, echo=echo, results=results,
             bases_only=bases_only)
    done.update(new)
  final = scores()
  picked = search_lib.choose(grid, lags, final, top_k)
  if picked is None:  # not reached: every run above finished
    raise RuntimeError("search runs missing after the search")
  chosen = {m: search_lib.overrides(grid[m], idx) for m, idx in picked.items()}
  kept = search_lib.screened(grid, lags, final, top_k)
  with open(layout.chosen_path(out), "w") as f:
    json.dump({"lags": list(lags), "seed": seed, "screen_top_k": top_k, "chosen": chosen,
               "points": {m: search_lib.label(grid[m], idx) for m, idx in picked.items()},
               "screened": {m: [search_lib.label(grid[m], idx) for idx in kept[m]] for m in grid}},
              f, indent=1)
  echo("search: " + "; ".join(f"{m} {search_lib.describe(grid[m], idx)}" for m, idx in picked.items()))
  return chosen


def beyond(out: str, *, grid: dict, lags, seed: int, checks, top_k: int | None = None, reduced: bool = False,
           study: str = "tiny", deadline: float | None = None, echo=print,
           results: str | None = None, bases_only: bool = False) -> list[str]:
  """The edge checks, after the study: for each (method, axis tag, value) of `checks`, the
  method's chosen search point with that axis moved to `value` (`search.beyond`), on the search's
  seed at each of its lags, as search runs named as a grid point would be. They are reported
  beside the search (`search.outside_scores`) and never change its choice."""
  plan = plan_json(grid, lags, seed, top_k)
  picked = search_lib.choose(grid, lags, search_scores(plan, load_compact(out, layout.SWEEP, results)), top_k)
  if picked is None:
    raise RuntimeError("edge checks asked before the search has chosen")
  todo = []
  for method, tag, value in checks:
    axes, idx = search_lib.beyond(grid[method], picked[method], tag, value)
    todo += [Run(seed, lag, method, search_lib.overrides(axes, idx), search_lib.label(axes, idx)) for lag in lags]
  return _run_all(out, todo, reduced=reduced, study=study, deadline=deadline, echo=echo, results=results,
                  bases_only=bases_only)


def sweep(out: str, *, methods, lrs, lag: int, seed: int, **kwargs) -> dict[str, float]:
  """The learning-rate sweep: `search` over lr only at one lag; returns each method's lr."""
  chosen = search(out, grid=search_lib.lr_grid(methods, lrs), lags=(lag,), seed=seed, **kwargs)
  return {m: o["train.lr"] for m, o in chosen.items()}


def run_study(out: str, *, methods=DEFAULT_METHODS, lags=DEFAULT_LAGS, seeds=DEFAULT_SEEDS,
              reduced: bool = False, overrides: dict | None = None, echo=print,
              study: str = "tiny", settings: dict[str, dict] | None = None,
              deadline: float | None = None, results: str | None = None,
              method_lags: dict | None = None, bases_only: bool = False) -> list[str]:
  """Runs every (seed, lag, method) not finished yet; returns the run folders.

  Seeds outermost, so a study stopped early has every method and lag for its first seeds.
  All runs of a seed share one warmed-up base model (`<out>/base_models`). settings: a method's
  overrides chosen by `search` (others keep the config's); overrides: every run's;
  method_lags: a method's own lags ({method: lags}; a method not in it runs at every lag of
  `lags`), run in the order of `lags`.
  """
  todo = [Run(s, l, m, {**(overrides or {}), **(settings or {}).get(m, {})})
          for s in seeds for l in lags for m in methods if l in (method_lags or {}).get(m, lags)]
  return _run_all(out, todo, reduced=reduced, study=study, deadline=deadline, echo=echo,
                  results=results, bases_only=bases_only)
