"""The registered experiment of issue 41: OAPL at long lags with targets it can reach.

The reasoning study (docs/reasoning_study.md) ran OAPL with beta1 = 5, beta2 = 1e-2 on 52-token
answers: a correct answer's target (R - V_hat) / beta2 is tens of nats, out of reach of any
policy, and OAPL swung or stalled at L = 100. This experiment runs OAPL with targets it can
reach (`rl.beta2_rule`, docs/algorithm.md "Reachable targets"), at the lags where it failed:

    settings  "oapl_tied"      beta1 = beta2 = 0.1 (rule "tied": targets reachable by construction)
              "oapl_per_token" beta1 = 1, beta2 = 16.384 / 54 = 0.303 (rule "per_token": the
                               paper's 1e-3 at its 16,384-token cap, matched per token)
    x lr      3e-5, 1e-4, 3e-4 (1e-4, the searched OAPL's, runs first)
    x L       100, 50
    x seeds   0, 1, 2 (seed by seed: a seed's 12 runs before the next seed's)

on configs/reason.py with the reasoning study's settings (1000 trainer steps, 16 groups per
step, every run the same 128,000 answers), evaluated every 50 steps (64 samples per problem on
the 64 held-out problems: a refresh window of L = 100 has an evaluation at its start, middle and
end), against the study's committed OAPL and GRPO+IS runs. Its prediction was committed in
docs/reachable_targets.md before any of its runs.

    python -m oapl_jax.studies.reachable --out=/tmp/reach --results=docs/reachable_targets/results
    python -m oapl_jax.studies.reachable --out=/tmp/reach --reduced --seeds 0   # CI-sized, a minute

Runs are the study runner's (`runner._run_all`: resumable, `--budget-minutes`, two processes
may share `--out`); `--save-results` copies the finished runs' small results into `--results`
and `--report-only` writes the report (the figures of every run: `window_falls`, the mean of
the last three evaluations, the area under pass@1 against answers, the mean out-of-reach
fraction and |residual|).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from oapl_jax.errors import Interrupted, UserError, one_line, said_once
from oapl_jax.studies import layout, stats
from oapl_jax.studies.report import NO_NOTES, NOTES_BEGIN, NOTES_END, kept_notes
from oapl_jax.studies.results import load_runs, save_results
from oapl_jax.studies.runner import BudgetSpent, Run, RunsElsewhere, _run_all
# the figures of one run (moved to stats, where the mixed-task study's predictions use them too)
from oapl_jax.studies.stats import FALL, last_evals_mean, pass1_area, series_mean, window_falls

SETTINGS = ("oapl_tied", "oapl_per_token")  # METHODS (definitions.py) with reachable targets
LRS = (1e-4, 3e-4, 3e-5)  # in run order: the searched OAPL's lr first
LAGS = (100, 50)
SEEDS = (0, 1, 2)
# On top of the reasoning study's runs (definitions.REASON_FULL): an evaluation every 50 steps
# with 64 samples per problem, so each window of L = 100 and of L = 50 starts and ends on one.
EVAL = {"eval.every": 50, "eval.samples_per_problem": 64}
REFERENCE_RESULTS = "docs/reasoning_study/results"  # the study's committed runs (the comparison)
PREDICTION_BEGIN = "<!-- prediction: registered before the runs; kept when the report is regenerated -->"
PREDICTION_END = "<!-- end prediction -->"


def point(lr: float) -> str:
  """A run's point label: "lr0.0001"."""
  return f"lr{lr:g}"


# The asynchronous GRPO+TIS baseline beside it (`rl.grpo.prox="previous_step"`; registered in
# the addendum of the prediction, before its runs): the reasoning study's searched GRPO+IS
# settings (clip 0.8/1.12, lr 3e-4) with pi_prox the trainer's previous step, at each lag.
BASELINE = ("grpo_tis_async", 3e-4, {"rl.grpo.eps_low": 0.8, "rl.grpo.eps_high": 1.12})


def runs(seeds=SEEDS, lags=LAGS, lrs=LRS, settings=SETTINGS, baseline: bool = True) -> list[Run]:
  """Every run of the experiment in run order: seed by seed, L = 100 before L = 50, at each lr
  both settings; (`baseline`) the asynchronous GRPO+TIS run of a lag after its first two lrs'
  (the predictions' runs first: the third lr, 3e-5, is the grid's edge)."""
  method, base_lr, overrides = BASELINE
  out = []
  for seed in seeds:
    for lag in lags:
      oapl = [Run(seed, lag, m, {**EVAL, "train.lr": lr}, point(lr)) for lr in lrs for m in settings]
      first = 2 * len(settings)
      out += oapl[:first]
      if baseline:
        out.append(Run(seed, lag, method, {**EVAL, **overrides, "train.lr": base_lr}, point(base_lr)))
      out += oapl[first:]
  return out


def row(r) -> dict:
  """The experiment's figures of run `r`."""
  falls, windows = window_falls(r)
  return {"final": r.summary["eval_after"]["pass@1"], "last3": last_evals_mean(r),
          "area": pass1_area(r), "falls": falls, "windows": windows,
          "out_of_reach": series_mean(r, "target_out_of_reach"),
          "residual": series_mean(r, "residual_abs_mean"), "wall": r.wall_seconds}


# --- the report -----------------------------------------------------------------------------

def _cell(values, digits=3) -> str:
  values = [v for v in values if v is not None]
  if not values:
    return "-"
  mean, sd = stats.mean_sd(values)
  return f"{mean:.{digits}f}" + (f" ± {sd:.{digits}f}" if len(values) > 1 else "")


def _falls(rows) -> str:
  """"n of N" windows fallen; "-" where no window has an evaluation at both ends."""
  windows = sum(x["windows"] for x in rows)
  return f"{sum(x['falls'] for x in rows)} of {windows}" if windows else "-"


def _label(r) -> str:
  """What a run was: its setting (with the betas its config resolved) and lr."""
  from oapl_jax.rl.names import beta2_of  # JAX-free
  c = r.summary["config"]
  rl = c["rl"]
  if rl["loss"] == "oapl":
    return f"OAPL beta1={rl['beta1']:g} beta2={beta2_of(c):.3g}"
  g = rl["grpo"]
  name = "async GRPO+TIS" if g.get("prox") == "previous_step" else "GRPO+IS"
  return f"{name} clip {g['eps_low']:g}/{g['eps_high']:g}"


def table(groups: dict) -> list[str]:
  """One line per (label, lag, lr): the figures over its seeds, mean ± sd."""
  out = ["| run | L | lr | seeds | final pass@1 | mean of last 3 evals | area (mean pass@1 over answers) "
         "| windows fallen > 0.02 | out-of-reach targets | mean abs residual |",
         "|---|---|---|---|---|---|---|---|---|---|"]
  for (label, lag, lr), rs in groups.items():
    rows = [row(r) for r in rs]
    out.append(f"| {label} | {lag} | {lr:g} | {len(rs)} | {_cell([x['final'] for x in rows])} | "
               f"{_cell([x['last3'] for x in rows])} | {_cell([x['area'] for x in rows])} | "
               f"{_falls(rows)} | "
               f"{_cell([x['out_of_reach'] for x in rows])} | {_cell([x['residual'] for x in rows])} |")
  return out


def _grouped(results) -> dict:
  groups: dict = {}
  for r in sorted(results, key=lambda r: (r.method, -r.lag, r.summary["config"]["train"]["lr"], r.seed)):
    groups.setdefault((_label(r), r.lag, r.summary["config"]["train"]["lr"]), []).append(r)
  return groups


def report_markdown(results, reference, baseline=(), *, prediction: str, notes: str) -> str:
  """The report: the registered prediction (kept as committed), the status, the experiment's
  table, the study's committed runs at the same lags (and L = 1) beside it, the notes."""
  done = len(results)
  total = len(runs(baseline=False))
  seeds = sorted({r.seed for r in results})
  minutes = sum(r.wall_seconds or 0 for r in results) / 60
  ref = [r for r in reference if r.lag in (1,) + LAGS]
  lines = [
      "# Reachable targets: OAPL at long lags in its own regime (issue 41)", "",
      "The registered experiment of `oapl_jax/studies/reachable.py` (its docstring has the grid "
      "and the commands). Generated by `python -m oapl_jax.studies.reachable --report-only`; the "
      "prediction and the notes are hand-written and kept.", "",
      "## Prediction (registered before the runs)", "", PREDICTION_BEGIN, prediction.strip(),
      PREDICTION_END, "",
      "## Status", "",
      f"{done} of {total} runs finished (seeds {', '.join(map(str, seeds)) or 'none'}); "
      f"{minutes:.0f} min of wall time summed over them (one run per core of a 2-core CPU).", "",
      "## Results", "",
      "Each cell: mean ± sd over the seeds finished. Final pass@1: the held-out pass@1 after "
      "1000 steps; mean of last 3 evals: steps 900, 950, 1000 for this experiment (evaluations "
      "every 50 steps, 64 samples per problem), 800, 900, 1000 for the study's runs (every 100, "
      "256 samples); area: pass@1 averaged over the answers generated (trapezoids between "
      "evaluations); windows fallen: refresh windows [kL, (k+1)L] whose pass@1 at the end is "
      f"more than {FALL} below its start, over all seeds; out-of-reach targets: the fraction of "
      "answers whose target A/beta2 exceeds -log pi_old(answer), averaged over the steps "
      "(`target_out_of_reach`); mean abs residual: |beta2 ell - A| averaged over the steps.", "",
      *(table(_grouped(results)) if results else ["_(no runs finished yet)_"]), "",
      "The reasoning study's committed runs (docs/reasoning_study.md: OAPL beta1 5, beta2 1e-2, "
      "lr 1e-4; GRPO+IS clip 0.8/1.12, lr 3e-4), the same figures (their runs did not log the "
      "out-of-reach fraction or the residual):", "",
      *(table(_grouped(ref)) if ref else ["_(not found)_"]), "",
      "The asynchronous GRPO+TIS baseline (`rl.grpo.prox=\"previous_step\"`, the study's "
      "GRPO+IS settings otherwise; evaluated as this experiment's runs):", "",
      *(table(_grouped(baseline)) if baseline else ["_(no runs finished yet)_"]), "",
      "## Notes", "", NOTES_BEGIN, notes, NOTES_END, ""]
  return "\n".join(lines)


def kept_prediction(old: str | None) -> str | None:
  if old and PREDICTION_BEGIN in old and PREDICTION_END in old:
    return old.split(PREDICTION_BEGIN, 1)[1].split(PREDICTION_END, 1)[0].strip()
  return None


def write_report(out: str | None, results: str | None, report: str,
                 reference: str = REFERENCE_RESULTS) -> str:
  """Writes `report` from the finished runs under `out` and `results` (their point runs), with
  the prediction and notes of the report already there. Raises UserError without a prediction:
  the experiment's report is written only once its prediction is registered."""
  old = open(report).read() if os.path.isfile(report) else None
  prediction = kept_prediction(old)
  if prediction is None:
    raise UserError(f"{report} has no registered prediction (between {PREDICTION_BEGIN!r} and "
                    f"{PREDICTION_END!r}): write and commit it before the runs")
  mine = [r for r in load_runs(out, layout.SWEEP, results) if r.method in SETTINGS]
  baseline = [r for r in load_runs(out, layout.SWEEP, results) if r.method == BASELINE[0]]
  ref = [r for r in load_runs(None, layout.RUNS, reference) if r.method in ("oapl", "grpo_tis")]
  text = report_markdown(mine, ref, baseline, prediction=prediction, notes=kept_notes(old))
  with open(report, "w") as f:
    f.write(text)
  return report


def main(argv=None) -> int:
  with said_once():  # a lock take-over is one plain line, not also a logging record
    return _main(argv)


def _main(argv) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", required=True, help="folder for the runs (resumable)")
  p.add_argument("--results", default=None, help="committed results: their runs count as finished")
  p.add_argument("--report", default="docs/reachable_targets.md")
  p.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
  p.add_argument("--lags", nargs="+", type=int, default=list(LAGS))
  p.add_argument("--lrs", nargs="+", type=float, default=list(LRS))
  p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
  p.add_argument("--budget-minutes", type=float, default=None,
                 help="start no run after this many minutes (exit 3: run again to go on)")
  p.add_argument("--reduced", action="store_true", help="CI-sized runs (reason.py:smoke)")
  p.add_argument("--save-results", action="store_true", help="copy finished results into --results, then stop")
  p.add_argument("--report-only", action="store_true", help="write the report from finished runs")
  args = p.parse_args(argv)
  if args.save_results:
    if not args.results:
      p.error("--save-results needs --results")
    print(f"{len(save_results(args.out, args.results))} results written into {args.results}")
    return 0
  if not args.report_only:
    deadline = time.perf_counter() + 60 * args.budget_minutes if args.budget_minutes else None
    todo = runs(args.seeds, args.lags, args.lrs, args.settings)
    if args.reduced:  # the smoke config's lags are a few steps: L = 2, evaluations every 2
      todo = [Run(r.seed, 2, r.method, {"train.lr": r.overrides["train.lr"]}, r.point) for r in todo
              if r.lag == args.lags[0]]
    try:
      _run_all(args.out, todo, reduced=args.reduced, study="reason", deadline=deadline, echo=print,
               results=args.results)
    except BudgetSpent as e:
      print(e)
      return 3
    except RunsElsewhere as e:
      print(e)
      return 4
    except (UserError, Interrupted) as e:
      print(f"error: {one_line(e)}", file=sys.stderr)
      return e.exit_code
  try:
    print(f"report: {write_report(args.out, args.results, args.report)}")
  except (UserError, Interrupted) as e:
    print(f"error: {one_line(e)}", file=sys.stderr)
    return e.exit_code
  return 0


if __name__ == "__main__":
  sys.exit(main())
