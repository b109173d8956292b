"""The lag study: OAPL and GRPO+IS at several engine lags L, several seeds, on an embedded task.

The paper ran GRPO+IS only at lag 1 and OAPL at lag 50-100. This study runs both (and OAPL
with the paper's betas) at each L, from one shared base model per seed, with the same number
of generated answers per run, and writes a report with plots. `--study` picks the task
(`STUDIES`): "tiny" (configs/tiny.py, two-digit addition: docs/lag_study.md) or "reason"
(configs/reason.py, addition answered by a 52-53-token chain of steps, pass@k to k = 256).

    python -m oapl_jax.studies.lag_study --out=/tmp/lag_study                 # the full study
    python -m oapl_jax.studies.lag_study --out=/tmp/ls --reduced --lags 1 2 --seeds 0   # seconds
    python -m oapl_jax.studies.lag_study --study=reason --out=/tmp/rs --search \
        --results=docs/reasoning_study/results --methods oapl grpo_tis \
        --lags 1 10 50 100 --seeds 0 1 2 3 4 --budget-minutes=45          # one piece

Settings search, first: `--search` runs each method over its grid (search.py: OAPL's beta1 x
beta2 x lr, GRPO+IS's PPO clip x lr, 18 settings each) on seed `--sweep-seed` (100, not a study
seed): every setting at the first of `--sweep-lags` (100 50), then only each method's
search.SCREEN_TOP_K (6) best by their final pass@1 there at the others (48 runs, not 72);
`--sweep-lrs` searches the lr only (at L = 10). The screened setting with the best final pass@1,
averaged over those lags, is each method's for the study (`<out>/sweep/chosen.json`; the report
shows the whole grid, the screened-out cells marked). `--beyond METHOD:AXIS=VALUE` adds edge
checks after the study's runs (or once the runs left are another process's): the method's chosen
setting with that axis moved outside its grid, at the search's seed and lags (reported beside
the search; the choice stays). Runs already
finished are skipped (a `summary.json` under `--out`, or a small result committed under
`--results`) and an unfinished one resumes from its checkpoints, so a study runs in pieces:
`--budget-minutes` starts no run after that many minutes (then exit code 3 says more is left:
run the same command again; SIGTERM / SIGINT stop the run in progress with a checkpoint and exit
128 + the signal number, one line on stderr). Two processes can share one `--out`: a run whose workdir another process
holds is skipped, and a process that ends with such runs left exits with code 4 (run it again
once they finish). So does one that ends the search's first lag while the other still makes
some of its runs: the later lags' runs follow from its scores. Given the same `--seeds`, two
processes share the study's runs seed by seed, so the first seeds finish first.
`--method-lags METHOD=L,L,...` gives a method its own lags among `--lags` (a study step whose
variants run at different lags: docs/mix_study.md, "Step 2"); the runs still go seed by seed,
lag by lag in `--lags` order.
`--bases DIR` starts every run from committed bases (`<DIR>/seed<S>-<hash>`, copied into
`<out>/base_models`; a seed's base is then read, never built: `warmup.cached_only`), so a study
goes on on another machine from the bases its runs began from (a base is the warm-up's result,
and that depends on the CPU's kernels: docs/mix_study.md, "Step 2").
`--save-results` copies the finished runs' small results (results.compact: kilobytes each)
from `--out` into `--results`, to be committed.
From Python: `run_study(...)`, then `write_report(...)`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

from oapl_jax.errors import Interrupted, UserError, one_line, said_once
from oapl_jax.studies import layout, search as search_lib
from oapl_jax.studies.definitions import DEFAULT_SEEDS, METHODS, STUDIES
from oapl_jax.studies.plots import plot
from oapl_jax.studies.report import kept_notes, report_markdown
from oapl_jax.studies.results import load_compact, load_runs, read_search_plan, save_results
from oapl_jax.studies.runner import BudgetSpent, RunsElsewhere, beyond, copy_bases, run_study, search

REFERENCE = "reference.json"  # in a results folder: an earlier study's final pass@1 (report.py)


def _read(path: str) -> str:
  with open(path) as f:
    return f.read()


def _search_for_report(out: str, results: str | None) -> dict | None:
  """The search's plan and scores for the report (None if no search ran)."""
  plan = read_search_plan(out, results)
  if plan is None:
    return None
  compact = load_compact(out, layout.SWEEP, results)
  return {"plan": plan, "scores": search_lib.search_scores(plan, compact),
          "outside": search_lib.outside_scores(plan, compact)}


def write_report(out: str, report: str, *, command: str, study: str = "tiny",
                 results: str | None = None, planned: tuple | None = None,
                 launcher: str | None = None) -> str:
  """Writes `report` (markdown) and its PNGs (in `<report without .md>/`) from the runs in `out`
  and those committed in the results folder `results`; planned: the (methods, lags) of each
  seed, for the seeds-done line (None: those of the finished runs); launcher: the launch/ script
  these runs come from, named in the header (None: the study's own).

  Text between the notes markers of an existing report is kept, so a hand-written reading of
  the results survives regeneration.
  """
  runs = load_runs(out, results=results)
  found = _search_for_report(out, results)
  if not runs and not found:  # a search's plan alone shows its grid, every run to come
    raise FileNotFoundError(f"no finished runs under {out}" + (f" or {results}" if results else ""))
  paths = plot(runs, os.path.splitext(report)[0]) if runs else {}
  report_dir = os.path.dirname(os.path.abspath(report))
  old = _read(report) if os.path.isfile(report) else None
  reference_path = os.path.join(results, REFERENCE) if results else None
  reference = json.loads(_read(reference_path)) if reference_path and os.path.isfile(reference_path) else None
  text = report_markdown(runs, study=study, command=command,
                         figures={name: os.path.relpath(p, report_dir) for name, p in paths.items()},
                         notes=kept_notes(old), search=found, reference=reference,
                         planned=planned, launcher=launcher)
  os.makedirs(report_dir, exist_ok=True)
  with open(report, "w") as f:
    f.write(text)
  return report


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", required=True, help="folder for the runs (resumable)")
  p.add_argument("--report", default=None, help="markdown report to write (default: <out>/lag_study.md)")
  p.add_argument("--study", default="tiny", choices=list(STUDIES), help="the task (STUDIES)")
  p.add_argument("--methods", nargs="+", default=None, choices=list(METHODS),
                 help="default: the study's (STUDIES[...].methods)")
  p.add_argument("--lags", nargs="+", type=int, default=None, help="default: the study's")
  p.add_argument("--method-lags", nargs="+", default=[], metavar="METHOD=L,L,...",
                 help="a method's own lags, among --lags (e.g. oapl_b1=200,100,50); the others run "
                      "at every --lags; the runs still go in the order of --lags")
  p.add_argument("--seeds", nargs="+", type=int, default=list(DEFAULT_SEEDS))
  p.add_argument("--search", action="store_true",
                 help="pick each method's settings first by the joint search (search.study_grid)")
  p.add_argument("--sweep-lrs", nargs="+", type=float, default=None,
                 help="pick each method's train.lr among these first (on --sweep-seed)")
  p.add_argument("--sweep-lags", "--sweep-lag", nargs="+", type=int, default=None,
                 help="the lags of the search's runs (default: 100 50 with --search, 10 with --sweep-lrs)")
  p.add_argument("--sweep-seed", type=int, default=search_lib.SEARCH_SEED,
                 help="the search's seed (not a study seed)")
  p.add_argument("--beyond", nargs="+", default=[], metavar="METHOD:AXIS=VALUE",
                 help="edge checks, after the study: the method's chosen setting with one search axis "
                      "moved outside its grid (e.g. grpo_tis:lr=0.003), at the search's seed and lags; "
                      "reported beside the search, never chosen")
  p.add_argument("--results", default=None,
                 help="a results folder (committed): its runs count as finished and are reported")
  p.add_argument("--save-results", action="store_true",
                 help="copy the finished runs' small results from --out into --results, then stop")
  p.add_argument("--bases", default=None, metavar="DIR",
                 help="start every run from the bases committed in DIR (e.g. "
                      "docs/mix_study/paired_check/base_models): copied into <out>/base_models, "
                      "never built (a seed without one there is an error); a base depends on the "
                      "CPU that built it")
  p.add_argument("--budget-minutes", type=float, default=None,
                 help="start no run after this many minutes (exit 3: run again to go on)")
  p.add_argument("--reduced", action="store_true", help="CI-sized runs (a few steps each)")
  p.add_argument("--report-only", action="store_true", help="write the report from finished runs")
  p.add_argument("--launcher", default=None, metavar="SCRIPT",
                 help="the launch/ script these runs come from, if not the study's own (e.g. "
                      "launch/mix_step2.sh): the report's header and seeds line name it as the "
                      "script that runs the same")
  return p


def _parse(argv) -> argparse.Namespace:
  """The flags, checked (a bad one exits 2 with argparse's usage line)."""
  p = _parser()
  args = p.parse_args(argv)
  spec = STUDIES[args.study]
  args.methods = list(spec.methods) if args.methods is None else args.methods
  args.lags = list(spec.lags) if args.lags is None else args.lags
  if args.search and args.sweep_lrs:
    p.error("--search and --sweep-lrs: give one (--search already searches the lr)")
  searching = args.search or args.sweep_lrs
  if args.sweep_lags is None:
    args.sweep_lags = list(search_lib.SEARCH_LAGS) if args.search else [10]
  if any(l < 1 for l in args.lags + args.sweep_lags):
    p.error("--lags and --sweep-lags must be >= 1")
  args.method_lags = dict(_method_lags(p, args, x) for x in args.method_lags)
  if searching and args.sweep_seed in args.seeds:
    p.error(f"--sweep-seed={args.sweep_seed} is one of --seeds: the search needs a separate seed")
  if args.sweep_lrs and any(lr <= 0 for lr in args.sweep_lrs):
    p.error("--sweep-lrs must be > 0")
  if args.launcher and not os.path.isfile(args.launcher):
    p.error(f"--launcher={args.launcher}: no such file (give its path from the repository root, "
            "e.g. launch/mix_step2.sh)")
  if args.save_results and not args.results:
    p.error("--save-results needs --results (the folder to copy into)")
  if args.search:
    try:
      args.grid = search_lib.study_grid(args.methods, spec.grids, spec.search_lrs)
    except ValueError as e:
      p.error(f"--search: {e}")
  else:
    args.grid = search_lib.lr_grid(args.methods, args.sweep_lrs) if args.sweep_lrs else None
  args.beyond = [_edge_check(p, args, x) for x in args.beyond]
  return args


def _method_lags(p, args, text: str) -> tuple[str, tuple[int, ...]]:
  """A `--method-lags` METHOD=L,L,... as (method, lags), checked: a method of --methods, lags
  among --lags (a lag outside them would never run)."""
  method, _, lags = text.partition("=")
  try:
    picked = tuple(int(x) for x in lags.split(","))
  except ValueError:
    p.error(f"--method-lags {text}: expected METHOD=L,L,... with whole numbers, e.g. oapl_b1=200,100")
  if method not in args.methods:
    p.error(f"--method-lags {text}: {method!r} is not among --methods ({' '.join(args.methods)})")
  if outside := [l for l in picked if l not in args.lags]:
    p.error(f"--method-lags {text}: lags {outside} are not among --lags ({' '.join(map(str, args.lags))})")
  return method, picked


def _edge_check(p, args, text: str) -> tuple[str, str, float]:
  """A `--beyond` METHOD:AXIS=VALUE as (method, axis tag, value), checked against the grid."""
  method, _, setting = text.partition(":")
  tag, _, value = setting.partition("=")
  try:
    value = float(value)
  except ValueError:
    p.error(f"--beyond {text}: expected METHOD:AXIS=VALUE with a number, e.g. grpo_tis:lr=0.003")
  if args.grid is None or method not in args.grid:
    p.error(f"--beyond {text}: no search of {method!r} to move past its edge (needs --search or "
            f"--sweep-lrs, and the method among --methods)")
  axes = args.grid[method]
  try:
    search_lib.beyond(axes, (0,) * len(axes), tag, value)
  except ValueError as e:
    p.error(f"--beyond {text}: {e}")
  return method, tag, value


def _run_pieces(args) -> int | None:
  """The search (if asked) and the study's runs, within the budget; an exit code if they stopped
  (3: budget spent, more to run; 4: the runs left are another process's), else None."""
  deadline = (time.perf_counter() + 60 * args.budget_minutes) if args.budget_minutes is not None else None
  common = {"reduced": args.reduced, "study": args.study, "deadline": deadline, "results": args.results,
            "bases_only": args.bases is not None}
  try:
    if args.bases is not None:
      if copied := copy_bases(args.bases, args.out):
        print(f"bases: {len(copied)} files copied from {args.bases} into {layout.base_models_dir(args.out)} "
              f"({', '.join(n for n in copied if '.eval-' not in n)} and their evaluations)")
    top_k = search_lib.SCREEN_TOP_K if args.search else None  # the lr sweep runs every lr
    settings = (search(args.out, grid=args.grid, lags=args.sweep_lags, seed=args.sweep_seed, top_k=top_k,
                       **common) if args.grid else None)
    elsewhere = None
    try:
      run_study(args.out, methods=args.methods, lags=args.lags, seeds=args.seeds, settings=settings,
                method_lags=args.method_lags, **common)
    except RunsElsewhere as e:  # the edge checks need the search only: make them meanwhile
      elsewhere = e
    if args.beyond:
      beyond(args.out, grid=args.grid, lags=args.sweep_lags, seed=args.sweep_seed, checks=args.beyond,
             top_k=top_k, **common)
    if elsewhere is not None:
      raise elsewhere
  except BudgetSpent as e:
    print(e)
    return 3
  except RunsElsewhere as e:  # another process is making them: run again once it has
    print(e)
    return 4
  return None


def main(argv=None) -> int:
  with said_once():  # a lock take-over is one plain line, not also a logging record
    try:
      return _main(argv)
    except (UserError, Interrupted) as e:  # a refused setting or folder, a signal (checkpoint saved): one line
      print(f"error: {one_line(e)}", file=sys.stderr)
      return e.exit_code


def _main(argv) -> int:
  args = _parse(argv)
  if args.save_results:
    written = save_results(args.out, args.results)
    print(f"{len(written)} results written into {args.results}")
    return 0
  command = "python -m oapl_jax.studies.lag_study " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
  command_file = layout.command_path(args.out)
  if args.report_only and os.path.isfile(command_file):  # the command that ran the study
    command = _read(command_file).strip()
  if not args.report_only:
    os.makedirs(args.out, exist_ok=True)
    with open(command_file, "w") as f:
      f.write(command + "\n")
    stopped = _run_pieces(args)
    if stopped is not None:
      return stopped
  report = args.report or os.path.join(args.out, "lag_study.md")
  try:
    written = write_report(args.out, report, command=command, study=args.study, results=args.results,
                           planned=(args.methods, args.lags, args.method_lags), launcher=args.launcher)
    print(f"report: {written}")
  except FileNotFoundError as e:  # --report-only before any run finished
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
