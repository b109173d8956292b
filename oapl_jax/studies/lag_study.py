"""The lag study: OAPL and GRPO+IS at several engine lags L, several seeds, on an embedded task.

The paper ran GRPO+IS only at lag 1 and OAPL at lag 50-100. This study runs both (and OAPL
with the paper's betas) at each L, from one shared base model per seed, with the same number
of generated answers per run, and writes a report with plots. `--study` picks the task
(`STUDIES`): "tiny" (configs/tiny.py, two-digit addition: docs/lag_study.md) or "reason"
(configs/reason.py, addition answered by a 52-53-token chain of steps, pass@k to k = 256).

    python -m oapl_jax.studies.lag_study --out=/tmp/lag_study                 # the full study
    python -m oapl_jax.studies.lag_study --out=/tmp/ls --reduced --lags 1 2 --seeds 0   # seconds
    python -m oapl_jax.studies.lag_study --study=reason --out=/tmp/rs --sweep-lrs 1e-4 3e-4 1e-3 \
        --lags 1 10 50 100 --seeds 0 1 2 3 4 --budget-minutes=45             # one piece

Learning-rate sweep (`--sweep-lrs`): before the study's runs, each method is run at every lr
at lag `--sweep-lag` on seed `--sweep-seed` (not one of the study's seeds), under
`<out>/sweep/`; the lr with the best final pass@1 is each method's lr for the study
(`<out>/sweep/chosen.json`, reported). Runs already finished under `--out` (a `summary.json`)
are skipped and an unfinished one resumes from its checkpoints, so a study runs in pieces:
`--budget-minutes` starts no run after that many minutes (then exit code 3 says more is left:
run the same command again; SIGTERM / SIGINT stop the run in progress with a checkpoint and
exit 128 + the signal number, one line on stderr). From Python: `run_study(...)`, then `write_report(...)`.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

from oapl_jax.errors import UserError, one_line
from oapl_jax.studies import layout
from oapl_jax.studies.definitions import DEFAULT_LAGS, DEFAULT_SEEDS, METHODS, STUDIES
from oapl_jax.studies.plots import plot
from oapl_jax.studies.report import kept_notes, report_markdown
from oapl_jax.studies.results import load_runs, read_chosen
from oapl_jax.studies.runner import BudgetSpent, run_study, sweep


def _read(path: str) -> str:
  with open(path) as f:
    return f.read()


def write_report(out: str, report: str, *, command: str, study: str = "tiny") -> str:
  """Writes `report` (markdown) and its PNGs (in `<report without .md>/`) from the runs in `out`.

  Text between the notes markers of an existing report is kept, so a hand-written reading of
  the results survives regeneration.
  """
  results = load_runs(out)
  if not results:
    raise FileNotFoundError(f"no finished runs under {out}/runs")
  paths = plot(results, os.path.splitext(report)[0])
  report_dir = os.path.dirname(os.path.abspath(report))
  old = _read(report) if os.path.isfile(report) else None
  text = report_markdown(results, study=study, command=command,
                         figures={name: os.path.relpath(p, report_dir) for name, p in paths.items()},
                         notes=kept_notes(old), chosen=read_chosen(out))
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
  p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
  p.add_argument("--lags", nargs="+", type=int, default=list(DEFAULT_LAGS))
  p.add_argument("--seeds", nargs="+", type=int, default=list(DEFAULT_SEEDS))
  p.add_argument("--sweep-lrs", nargs="+", type=float, default=None,
                 help="pick each method's train.lr among these first (on --sweep-seed)")
  p.add_argument("--sweep-lag", type=int, default=10, help="the lag of the sweep's runs")
  p.add_argument("--sweep-seed", type=int, default=100, help="the sweep's seed (not a study seed)")
  p.add_argument("--budget-minutes", type=float, default=None,
                 help="start no run after this many minutes (exit 3: run again to go on)")
  p.add_argument("--reduced", action="store_true", help="CI-sized runs (a few steps each)")
  p.add_argument("--report-only", action="store_true", help="write the report from finished runs")
  return p


def _parse(argv) -> argparse.Namespace:
  """The flags, checked (a bad one exits 2 with argparse's usage line)."""
  p = _parser()
  args = p.parse_args(argv)
  if any(l < 1 for l in args.lags + [args.sweep_lag]):
    p.error("--lags and --sweep-lag must be >= 1")
  if args.sweep_lrs and args.sweep_seed in args.seeds:
    p.error(f"--sweep-seed={args.sweep_seed} is one of --seeds: the sweep needs a separate seed")
  if args.sweep_lrs and any(lr <= 0 for lr in args.sweep_lrs):
    p.error("--sweep-lrs must be > 0")
  return args


def _run_pieces(args) -> int | None:
  """The sweep (if asked) and the study's runs, within the budget; an exit code if they stopped
  (3: budget spent, more to run; a `UserError`'s code, with one line on stderr), else None."""
  deadline = (time.perf_counter() + 60 * args.budget_minutes) if args.budget_minutes is not None else None
  common = {"methods": args.methods, "reduced": args.reduced, "study": args.study, "deadline": deadline}
  try:
    lrs = (sweep(args.out, lrs=args.sweep_lrs, lag=args.sweep_lag, seed=args.sweep_seed, **common)
           if args.sweep_lrs else None)
    run_study(args.out, lags=args.lags, seeds=args.seeds, lrs=lrs, **common)
  except BudgetSpent as e:
    print(e)
    return 3
  except UserError as e:  # a refused setting, or a signal (checkpoint saved): one line
    print(f"error: {one_line(e)}", file=sys.stderr)
    return e.exit_code
  return None


def main(argv=None) -> int:
  args = _parse(argv)
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
    print(f"report: {write_report(args.out, report, command=command, study=args.study)}")
  except FileNotFoundError as e:  # --report-only before any run finished
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
