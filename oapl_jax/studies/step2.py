"""The mixed-task study's step 2 (issue 62; docs/mix_study.md, "Step 2"): its registered
predictions, each checked as worded there, as pure functions of the study's finished runs
(`results.RunResult`): the step's variants ("oapl_b1", "oapl_b1_len", "grpo_tis_lr3e-4",
`definitions.MIX_STEP2_LAGS`; "oapl_b1_lr3e-4" at L = 100, S2-7's) against the study's methods
rerun ("oapl_tied", "grpo_tis", "grpo_tis_async").

The figures it reads, beside `stats`' (mean of the last three evaluations, area under the pass@1
curve, refresh windows fallen):

* `op_pass1`: held-out pass@1 on the problems of one operation ("*": times a digit), from an
  evaluation's per-problem correct counts and the held-out problems, which the run's task
  settings and seed fix (`held_out_operations`).
* `eval_falls`: falls counted between consecutive evaluations inside a refresh window (a pair of
  evaluations at steps a < b with k L <= a < b <= (k + 1) L for some k), beside `stats.window_falls`'
  falls between a window's two ends. At L = 100 the two coincide; at L = 200 (evaluations every
  100 steps) each window holds two such pairs; at L = 50 none.

A part worded on means over seeds is held or not on those means (per-seed values beside it);
the verdict machinery is `verdicts`' (a claim is held when every part is, not held when none is
held or mixed).
"""

from __future__ import annotations

import functools

import numpy as np

from oapl_jax.studies.stats import by_run, last_evals_mean, pass1_area, paired_text, window_falls
from oapl_jax.studies.verdicts import HELD, MIXED, NOT_HELD, Claim, Part, _runs

TIED, GRPO, ASYNC = "oapl_tied", "grpo_tis", "grpo_tis_async"  # the study's, committed
B1, B1_LEN, GRPO_3E4 = "oapl_b1", "oapl_b1_len", "grpo_tis_lr3e-4"  # step 2's
B1_3E4 = "oapl_b1_lr3e-4"  # S2-7's: the follow-up S2-1's reading called for
NAMES = {TIED: "OAPL (tied, beta1 = beta2 = 0.1)", B1: "OAPL (beta1 = 1, beta2 = 0.1)",
         B1_LEN: "OAPL (beta1 = 1, beta2 = 0.356)", GRPO: "GRPO+IS (lr 1e-3)",
         GRPO_3E4: "GRPO+IS (lr 3e-4)", ASYNC: "async GRPO+TIS (lr 3e-4)",
         B1_3E4: "OAPL (beta1 = 1, beta2 = 0.1, lr 3e-4)"}
STEP2_METHODS = (B1, B1_LEN, GRPO_3E4, B1_3E4)  # step 2's own variants (the rest are the study's)
FALL = 0.02  # a fall: pass@1 down by more than this (stats.FALL)

# S2-1, the mechanism: OAPL at beta1 = 1, beta2 = 0.1 learns the rare skill within the first
# window at L = 200 (tied there: 0.081, 0.082, 0.195; async GRPO+TIS 0.741, 0.511, 0.705).
SKILL_OP, SKILL_STEP, SKILL_AT_LEAST = "*", 100, 0.35
SPEED_LAGS = (50, 100, 200)  # S2-1: its area above tied's at each
LONG = 200  # S2-2, S2-3, S2-4: the lag the prediction is read at
END_AT_LEAST = 0.80  # S2-2: its mean of the last three evaluations at L = 200 (tied: 0.758)
WINDOW_FALLS_AT_MOST = 2  # S2-3: of its 15 windows at L = 200 (3 seeds x 5)
TRADE_OFF_ABOVE = 3  # S2-3: more than this many fallen windows reads as a speed-stability trade-off
EVAL_FALLS_AT_MOST = 3  # S2-3: of its 30 consecutive-evaluation pairs at L = 200
CONTROL_NEAR = 0.03  # S2-4: the control's mean of the last three evaluations within this of tied's
CONTROL_SKILL_AT_MOST = 0.25  # S2-4: the control's "*" pass@1 at step 100, about tied's
GRPO_LAGS = (10, 50, 100, 200)  # S2-5, S2-6
ANCHOR_NEAR = {10: 0.03, 50: 0.03, 100: 0.03, 200: 0.05}  # S2-5: |GRPO+IS lr 3e-4 - async|, last 3 evals
AREA_NEAR = {10: 0.05, 50: 0.05, 100: 0.05, 200: 0.08}  # S2-5: the same, area under the pass@1 curve
LR_AREA_LAGS = (100, 200)  # S2-6: lr 3e-4's area above lr 1e-3's
# S2-7 (registered after S2-1's reading, before its runs): `oapl_b1` at lr 3e-4 instead of 1e-4,
# at L = 100 on the committed bases (the search seed's base does not rebuild here)
FOLLOWUP_LAG = 100
LR_GAIN_AT_MOST = 0.02  # its area minus `oapl_b1`'s (lr 1e-4), paired mean: at most this


@functools.lru_cache(maxsize=None)
def _operations(seed: int, min_digits: int, max_digits: int, num_eval: int, operations: str,
                noisy_operations: str | None) -> tuple[str, ...]:
  from oapl_jax.tasks.chain_mix import ChainMixTask, parse  # the task's own held-out draw
  task = ChainMixTask(min_digits, max_digits, num_eval, seed, operations, noisy_operations)
  return tuple(parse(p)[1] for p in task.eval_problems())


def held_out_operations(config: dict) -> tuple[str, ...]:
  """The operation of each held-out problem of a run (`config`: its summary's), in the order of
  its evaluations' `correct_per_problem`."""
  t = config["task"]
  return _operations(config["seed"], t["min_digits"], t["max_digits"], t["num_eval"], t["operations"],
                     t.get("noisy_operations"))


def _eval_at(r, step: int) -> dict | None:
  if step == 0:
    return r.summary["eval_before"]
  if step == r.summary["trainer_steps"]:
    return r.summary["eval_after"]
  return next((e for e in r.summary["evals_during"] if e["step"] == step), None)


def op_pass1(r, step: int, op: str = SKILL_OP) -> float | None:
  """Run `r`'s held-out pass@1 on the problems of operation `op` at its evaluation after trainer
  step `step` (0: the base's); None where it has no evaluation there or no such problem."""
  e = _eval_at(r, step)
  if e is None:
    return None
  ops = held_out_operations(r.summary["config"])
  correct = [c for c, o in zip(e["correct_per_problem"], ops) if o == op]
  return float(np.mean(correct) / e["samples_per_problem"]) if correct else None


def eval_falls(r, threshold: float = FALL) -> tuple[int, int]:
  """(pairs of consecutive evaluations inside one refresh window whose pass@1 fell by more than
  `threshold`, such pairs) of run `r`: evaluations at steps a < b, consecutive, with
  k L <= a < b <= (k + 1) L for some k."""
  steps, p1 = r.eval_curve("pass@1", x="steps")
  pairs = [(i, i + 1) for i in range(len(steps) - 1)
           if int(steps[i]) // r.lag == (int(steps[i + 1]) - 1) // r.lag]
  return sum(p1[b] < p1[a] - threshold for a, b in pairs), len(pairs)


def _fmt(xs) -> str:
  return ", ".join(f"{x:.3f}" for x in xs)


def _on_mean(what: str, held: bool, values: str) -> Part:
  return Part(f"{what}: {values}", HELD if held else NOT_HELD)


def _mean_of(rs, f) -> tuple[float, list[float]]:
  xs = [f(r) for r in rs]
  return float(np.mean(xs)), xs


def _count(rs, f) -> tuple[int, int]:
  counts = [f(r) for r in rs]
  return sum(n for n, _ in counts), sum(w for _, w in counts)


def speed_claim(by) -> Claim | None:
  """S2-1: at L = 200 OAPL (beta1 = 1, beta2 = 0.1) reaches `SKILL_AT_LEAST` on the "*" problems
  at step 100 (mean over seeds), and its area under the pass@1 curve is above tied's at each of
  L = 50, 100, 200 (means over seeds)."""
  parts = []
  if rs := _runs(by, B1, LONG):
    mean, xs = _mean_of(rs, lambda r: op_pass1(r, SKILL_STEP))
    tied = [op_pass1(r, SKILL_STEP) for r in _beside(by, TIED, LONG, rs)]
    parts.append(_on_mean(f"\"{SKILL_OP}\" pass@1 at step {SKILL_STEP}, L={LONG}, >= {SKILL_AT_LEAST} (mean over seeds)",
                          mean >= SKILL_AT_LEAST, f"{mean:.3f} ({_seeds_of(rs)}: {_fmt(xs)})"
                          + (f"; tied {np.mean(tied):.3f} ({_fmt(tied)})" if tied else "")))
  for lag in SPEED_LAGS:
    if (rs := _runs(by, B1, lag)) and (ts := _beside(by, TIED, lag, rs)):
      (a, xa), (t, xt) = _mean_of(rs, pass1_area), _mean_of(ts, pass1_area)
      parts.append(_on_mean(f"area under pass@1, L={lag}, above tied's on the same seeds (means over seeds)", a > t,
                            f"{a:.3f} ({_seeds_of(rs)}: {_fmt(xa)}) vs {t:.3f} ({_fmt(xt)})"))
  return Claim("S2-1. With beta1 = 1, beta2 = 0.1 OAPL learns faster per refresh than tied", parts) if parts else None


def end_claim(by) -> Claim | None:
  """S2-2: at L = 200 its mean of the last three evaluations is at least `END_AT_LEAST` (mean
  over seeds)."""
  if not (rs := _runs(by, B1, LONG)):
    return None
  mean, xs = _mean_of(rs, last_evals_mean)
  tied = [last_evals_mean(r) for r in _beside(by, TIED, LONG, rs)]
  return Claim(f"S2-2. OAPL (beta1 = 1, beta2 = 0.1) ends at L = {LONG} at pass@1 >= {END_AT_LEAST}", [_on_mean(
      f"mean of last 3 evals, L={LONG} (mean over seeds)", mean >= END_AT_LEAST,
      f"{mean:.3f} ({_seeds_of(rs)}: {_fmt(xs)})" + (f"; tied {np.mean(tied):.3f} ({_fmt(tied)})" if tied else ""))])


def stability_claim(by) -> Claim | None:
  """S2-3: at L = 200, at most `WINDOW_FALLS_AT_MOST` of its refresh windows fall by more than
  0.02 and at most `EVAL_FALLS_AT_MOST` of its consecutive-evaluation pairs inside a window
  (counted over its runs). More than `TRADE_OFF_ABOVE` fallen windows: the window part is not
  held; 3 exactly (between the two): mixed."""
  if not (rs := _runs(by, B1, LONG)):
    return None
  n, w = _count(rs, window_falls)
  m, p = _count(rs, eval_falls)
  tied = _beside(by, TIED, LONG, rs)
  tied_w, tied_p = _count(tied, window_falls), _count(tied, eval_falls)
  window = HELD if n <= WINDOW_FALLS_AT_MOST else NOT_HELD if n > TRADE_OFF_ABOVE else MIXED
  parts = [Part(f"refresh windows fallen > {FALL}, L={LONG}, at most {WINDOW_FALLS_AT_MOST} "
                f"(more than {TRADE_OFF_ABOVE}: a trade-off): {n} of {w}; tied {tied_w[0]} of {tied_w[1]}", window),
           Part(f"consecutive evaluations inside a window fallen > {FALL}, L={LONG}, at most {EVAL_FALLS_AT_MOST}: "
                f"{m} of {p}; tied {tied_p[0]} of {tied_p[1]}", HELD if m <= EVAL_FALLS_AT_MOST else NOT_HELD)]
  return Claim(f"S2-3. OAPL (beta1 = 1, beta2 = 0.1) at L = {LONG} stays stable ({_seeds_of(rs)}; "
               "the counts are registered for 3 seeds)", parts)


def control_claim(by) -> Claim | None:
  """S2-4: the control (beta1 = 1, beta2 = 0.356) at L = 200 ends within `CONTROL_NEAR` of tied
  (means over seeds of the mean of the last three evaluations), and its "*" pass@1 at step 100
  is at most `CONTROL_SKILL_AT_MOST` (mean over seeds)."""
  if not (rs := _runs(by, B1_LEN, LONG)):
    return None
  parts = []
  if ts := _beside(by, TIED, LONG, rs):
    (c, xc), (t, xt) = _mean_of(rs, last_evals_mean), _mean_of(ts, last_evals_mean)
    parts.append(_on_mean(f"mean of last 3 evals, L={LONG}, within {CONTROL_NEAR} of tied's on the same seeds "
                          "(means over seeds)", abs(c - t) <= CONTROL_NEAR + 1e-12,
                          f"{c - t:+.3f}: {c:.3f} ({_seeds_of(rs)}: {_fmt(xc)}) vs {t:.3f} ({_fmt(xt)})"))
  mean, xs = _mean_of(rs, lambda r: op_pass1(r, SKILL_STEP))
  parts.append(_on_mean(f"\"{SKILL_OP}\" pass@1 at step {SKILL_STEP}, L={LONG}, at most {CONTROL_SKILL_AT_MOST} "
                        "(mean over seeds)", mean <= CONTROL_SKILL_AT_MOST, f"{mean:.3f} ({_seeds_of(rs)}: {_fmt(xs)})"))
  return Claim("S2-4. The control with tied's step per refresh (beta1 = 1, beta2 = 0.356) runs as tied", parts)


def _seeds_of(rs) -> str:
  return "seed " + ", ".join(str(r.seed) for r in rs) if len(rs) == 1 else "seeds " + ", ".join(str(r.seed) for r in rs)


def _beside(by, method: str, lag: int, rs) -> list:
  """`method`'s runs at `lag` on the seeds of runs `rs` (a comparison on the same seeds while a
  step-2 cell has fewer seeds than the study's)."""
  return [by[(method, lag, r.seed)] for r in rs if (method, lag, r.seed) in by]


def _paired(by, a: str, b: str, lag: int, f) -> list[float]:
  seeds = sorted(s for (m, l, s) in by if (m, l) == (a, lag) and (b, lag, s) in by)
  return [f(by[(a, lag, s)]) - f(by[(b, lag, s)]) for s in seeds]


def anchor_claim(by) -> Claim | None:
  """S2-5: at matched lr (3e-4) GRPO+IS anchored on the snapshot is within `ANCHOR_NEAR` of the
  asynchronous GRPO+TIS at each lag on the mean of the last three evaluations, and within
  `AREA_NEAR` on the area under the pass@1 curve (means over seeds of the paired differences)."""
  parts = []
  for lag in GRPO_LAGS:
    for what, f, near in (("mean of last 3 evals", last_evals_mean, ANCHOR_NEAR[lag]),
                          ("area under pass@1", pass1_area, AREA_NEAR[lag])):
      if diffs := _paired(by, GRPO_3E4, ASYNC, lag, f):
        parts.append(_on_mean(f"L={lag}, GRPO+IS (lr 3e-4) - async GRPO+TIS, {what}, within {near}",
                              abs(float(np.mean(diffs))) <= near + 1e-12, paired_text(diffs, "GRPO+IS ahead")))
  return Claim("S2-5. At matched lr the anchor changes little: GRPO+IS (lr 3e-4) runs as async GRPO+TIS",
               parts) if parts else None


def lr_claim(by) -> Claim | None:
  """S2-6: GRPO+IS's area under the pass@1 curve is larger at lr 3e-4 than at its chosen 1e-3,
  at L = 100 and 200 (mean over seeds of the paired difference)."""
  parts = []
  for lag in LR_AREA_LAGS:
    if diffs := _paired(by, GRPO_3E4, GRPO, lag, pass1_area):
      parts.append(_on_mean(f"L={lag}, area under pass@1, GRPO+IS lr 3e-4 - lr 1e-3, > 0",
                            float(np.mean(diffs)) > 0, paired_text(diffs, "lr 3e-4 ahead")))
  return Claim("S2-6. GRPO+IS's lr 1e-3 costs it speed at long lags: lr 3e-4 has the larger area",
               parts) if parts else None


def oapl_lr_claim(by) -> Claim | None:
  """S2-7: at L = `FOLLOWUP_LAG`, OAPL (beta1 = 1, beta2 = 0.1) at lr 3e-4 has an area under the
  pass@1 curve at most `LR_GAIN_AT_MOST` above its own at lr 1e-4, and GRPO+IS at lr 3e-4 has a
  larger one than it (means over seeds of the paired differences)."""
  parts = []
  if diffs := _paired(by, B1_3E4, B1, FOLLOWUP_LAG, pass1_area):
    parts.append(_on_mean(f"L={FOLLOWUP_LAG}, area under pass@1, OAPL beta1 = 1 lr 3e-4 - lr 1e-4, at most "
                          f"+{LR_GAIN_AT_MOST}", float(np.mean(diffs)) <= LR_GAIN_AT_MOST + 1e-12,
                          paired_text(diffs, "lr 3e-4 ahead")))
  if diffs := _paired(by, GRPO_3E4, B1_3E4, FOLLOWUP_LAG, pass1_area):
    parts.append(_on_mean(f"L={FOLLOWUP_LAG}, area under pass@1, GRPO+IS (lr 3e-4) - OAPL beta1 = 1 (lr 3e-4), > 0",
                          float(np.mean(diffs)) > 0, paired_text(diffs, "GRPO+IS ahead")))
  return Claim("S2-7. OAPL's gap to GRPO at beta1 = 1 is not its lr: at lr 3e-4 it is no faster and still "
               "behind GRPO+IS", parts) if parts else None


def claims(results) -> list[Claim]:
  """Step 2's registered predictions the runs have data for, in their order."""
  by = by_run(results)
  made = (speed_claim(by), end_claim(by), stability_claim(by), control_claim(by), anchor_claim(by), lr_claim(by),
          oapl_lr_claim(by))
  return [c for c in made if c is not None]


def _cell(xs) -> str:
  """`xs`' mean ± sd over seeds (None left out; one value: its mean alone; none: "-")."""
  xs = [x for x in xs if x is not None]
  if not xs:
    return "-"
  return f"{np.mean(xs):.3f}" + (f" ± {np.std(xs, ddof=1):.3f}" if len(xs) > 1 else "")


def _table(by) -> list[str]:
  """The figures the predictions read, a row per (method, lag) of the methods they compare."""
  lines = ["| method | L | seeds | mean of last 3 evals | area (mean pass@1 over answers) | "
           f"\"{SKILL_OP}\" pass@1 at step {SKILL_STEP} | windows fallen > {FALL} | "
           f"consecutive evaluations fallen > {FALL} |", "|---|---|---|---|---|---|---|---|"]
  for method in (B1, B1_3E4, B1_LEN, TIED, GRPO_3E4, GRPO, ASYNC):
    for lag in sorted({l for (m, l, _) in by if m == method}):
      if method in (TIED, GRPO, ASYNC) and not any(m in STEP2_METHODS and l == lag for (m, l, _) in by):
        continue  # the study's rows only beside a step-2 run at that lag
      rs = _runs(by, method, lag)
      wf, ef = _count(rs, window_falls), _count(rs, eval_falls)
      lines.append(f"| {NAMES[method]} | {lag} | {len(rs)} | {_cell([last_evals_mean(r) for r in rs])} | "
                   f"{_cell([pass1_area(r) for r in rs])} | {_cell([op_pass1(r, SKILL_STEP) for r in rs])} | "
                   + (f"{wf[0]} of {wf[1]}" if wf[1] else "-") + " | "
                   + (f"{ef[0]} of {ef[1]}" if ef[1] else "-") + " |")
  return lines


BY_LAG_METHODS = (ASYNC, GRPO_3E4, GRPO, B1_3E4, B1, TIED, B1_LEN)  # the results table's rows, in order


def _by_lag_table(by) -> list[str]:
  """Mean of the last three evaluations / area under the pass@1 curve, mean ± sd over seeds, a
  row per method and a column per lag (issue 62: the README's table is to come from it); a cell
  with fewer than 3 seeds says how many."""
  lags = sorted({l for (m, l, _) in by if m in BY_LAG_METHODS}, key=int)
  def cell(rs):
    if not rs:
      return "-"
    parts = [_cell([f(r) for r in rs]) for f in (last_evals_mean, pass1_area)]
    return " / ".join(parts) + (f" ({len(rs)} seed{'s' * (len(rs) > 1)})" if len(rs) < 3 else "")
  lines = ["Mean of the last three evaluations / area under the pass@1 curve (mean ± sd over seeds), "
           "by lag:", "", "| method | " + " | ".join(f"L = {l}" for l in lags) + " |",
           "|---|" + "---|" * len(lags)]
  for m in BY_LAG_METHODS:
    if any(k[0] == m for k in by):
      lines.append(f"| {NAMES[m]} | " + " | ".join(cell(_runs(by, m, l)) for l in lags) + " |")
  return lines + [""]


OP_NAMES = {"+": "+", "-": "-", "*": "x a digit (\"*\")", "x": "x two digits"}  # chain_mix.OPERATIONS
FIRST_WINDOW_METHODS = (TIED, B1, B1_LEN, ASYNC, GRPO_3E4)


def _first_window_table(by, lag: int = LONG) -> list[str]:
  """Held-out pass@1 per operation at each evaluation of the first refresh window [0, `lag`]
  (step 0: the base), mean over seeds, a row per (operation, method) of `FIRST_WINDOW_METHODS`
  that ran at `lag`: how fast each learns each skill from the base's own samples."""
  methods = [m for m in FIRST_WINDOW_METHODS if _runs(by, m, lag)]
  if not methods:
    return []
  first = _runs(by, methods[0], lag)[0]
  steps = [0] + [e["step"] for e in first.summary["evals_during"] if e["step"] <= lag]
  present = set(held_out_operations(first.summary["config"]))
  ops = [op for op in OP_NAMES if op in present]
  lines = [f"Held-out pass@1 per operation in the first refresh window at L = {lag} (steps 0-{lag}: "
           "the base's samples only; mean over seeds; each operation's problems of the 64 held out):", "",
           "| operation | method | seeds | " + " | ".join(f"step {t}" for t in steps) + " |",
           "|---|---|---|" + "---|" * len(steps)]
  for op in ops:
    for m in methods:
      rs = _runs(by, m, lag)
      cells = []
      for t in steps:
        xs = [x for x in (op_pass1(r, t, op) for r in rs) if x is not None]
        cells.append(f"{np.mean(xs):.3f}" if xs else "-")
      lines.append(f"| {OP_NAMES[op]} | {NAMES[m]} | {len(rs)} | " + " | ".join(cells) + " |")
  return lines + [""]


def section(results) -> list[str]:
  """The report's section on step 2: the figures, then each prediction with its verdict ([]
  without a step-2 run)."""
  by = by_run(results)
  if not any(m in STEP2_METHODS for (m, _, _) in by):
    return []
  lines = ["## Step 2's registered predictions, checked (issue 62; verdicts computed from the runs)", "",
           "Registered before any run of step 2 (\"Step 2\" in the notes below: S2-1 to S2-6; S2-7 after "
           "S2-1's reading, before its runs), each checked "
           "as worded there, on the seeds finished so far. \"*\" pass@1: held-out pass@1 on the "
           "multiply-by-a-digit problems; windows fallen: refresh windows [kL, (k+1)L] with an evaluation "
           f"at both ends whose pass@1 fell by more than {FALL}; consecutive evaluations fallen: pairs of "
           f"consecutive evaluations inside one window whose pass@1 fell by more than {FALL}.", "",
           *_table(by), "", *_by_lag_table(by), *_first_window_table(by)]
  for c in claims(results):
    lines.append(f"**{c.name}: {c.verdict}.**")
    lines += [f"- {p.text}: {p.verdict}." for p in c.parts]
    lines.append("")
  return lines
