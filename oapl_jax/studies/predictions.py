"""The mixed-task study's registered predictions (docs/mix_study.md, "Reading": points 1', 2, 3',
4 and 5, committed 2026-12-04 before any of its runs), each checked as worded there: pure
functions of the study's finished runs (`results.RunResult`, methods "oapl_tied", "grpo_tis",
"grpo_tis_async").

A prediction is a `verdicts.Claim` of parts. Where its wording compares means over seeds, a part
is held or not held on those means (the per-seed values and, for a paired difference, the 95%
t-interval are in its text, for the reader to weigh); where it says "every seed" or "no run", a
part is held in every seed or run, not held in none, mixed otherwise (`Part.from_flags`).
"""

from __future__ import annotations

import numpy as np

from oapl_jax.studies.stats import by_run, last_evals_mean, mean_sd, paired_text, pass1_area, window_falls
from oapl_jax.studies.verdicts import HELD, NOT_HELD, Claim, Part, _lags, _runs  # the same selections

OAPL, GRPO, ASYNC = "oapl_tied", "grpo_tis", "grpo_tis_async"
NAMES = {OAPL: "OAPL (tied)", GRPO: "GRPO+IS", ASYNC: "async GRPO+TIS"}
CEILING = 0.9  # 1': no run's mean of its last three evaluations reaches this
PASSK = 64  # 3': the k of "pass@64" (less in runs with fewer samples per problem: CI-sized ones)
SHORT_LAGS = (1, 10)  # 2: where GRPO+IS leads
DROP_LAGS = (50, 200)  # 4: the lag's cost, from the first to the second
NEAR = 0.05  # 5: OAPL at L = 200 within this of its own L = 10


def _seeds(by, *keys) -> list[int]:
  """The seeds that have a run of every (method, lag) of `keys`."""
  return sorted(s for s in {k[2] for k in by} if all((*key, s) in by for key in keys))


def _on_mean(what: str, held: bool, values: str) -> Part:
  return Part(f"{what}: {values}", HELD if held else NOT_HELD)


def _fmt(xs) -> str:
  return ", ".join(f"{x:.3f}" for x in xs)


def ceiling_claim(by) -> Claim | None:
  """1': no study run ends (mean of its last three evaluations) at pass@1 `CEILING` or above."""
  parts = []
  for method in (OAPL, GRPO, ASYNC):
    rs = [by[k] for k in sorted(by) if k[0] == method]
    if rs:
      last3 = [last_evals_mean(r) for r in rs]
      parts.append(Part.from_flags(f"{NAMES[method]}, runs ending below {CEILING}", [x < CEILING for x in last3],
                                   f"all its lags and seeds; highest {max(last3):.3f}", unit="runs"))
  return Claim(f"1'. The task does not saturate in pass@1 (no run's mean of its last three "
               f"evaluations reaches {CEILING})", parts) if parts else None


def short_lag_claim(by) -> Claim | None:
  """2: at L = 1 and 10, GRPO+IS ahead of OAPL (tied) on the mean of the last three
  evaluations, paired by seed (held on the mean difference)."""
  parts = []
  for lag in SHORT_LAGS:
    if seeds := _seeds(by, (GRPO, lag), (OAPL, lag)):
      diffs = [last_evals_mean(by[(GRPO, lag, s)]) - last_evals_mean(by[(OAPL, lag, s)]) for s in seeds]
      parts.append(_on_mean(f"L={lag}, GRPO+IS - OAPL, mean of last 3 evals", np.mean(diffs) > 0,
                            paired_text(diffs, "GRPO+IS ahead")))
  return Claim("2. GRPO+IS leads at short lags (L = 1, 10)", parts) if parts else None


def _k(by) -> int:
  """PASSK, or the fewest samples per problem of any evaluation of the runs where that is less."""
  return min([PASSK] + [r.summary[f"eval_{w}"]["samples_per_problem"] for r in by.values() for w in ("before", "after")])


def _passk(r, when: str, k: int = PASSK) -> float:
  return float(r.passk(when, [k])[0])


def passk_claim(by) -> Claim | None:
  """3': at every lag, OAPL's pass@64 after training at least its base's in every seed, and at
  least GRPO+IS's at the same lag on the mean over seeds."""
  parts, k = [], _k(by)
  for lag in _lags(by, OAPL):
    rs = _runs(by, OAPL, lag)
    gaps = [_passk(r, "after", k) - _passk(r, "before", k) for r in rs]
    parts.append(Part.from_flags(f"L={lag}, OAPL pass@{k} after >= its base's", [g >= -1e-12 for g in gaps],
                                 "after - before per seed: " + ", ".join(f"{g:+.3f}" for g in gaps)))
    if gs := _runs(by, GRPO, lag):
      a, g = [_passk(r, "after", k) for r in rs], [_passk(r, "after", k) for r in gs]
      parts.append(_on_mean(f"L={lag}, OAPL pass@{k} after >= GRPO+IS's (means over seeds)",
                            np.mean(a) >= np.mean(g) - 1e-12,
                            f"{np.mean(a):.3f} ({_fmt(a)}) vs {np.mean(g):.3f} ({_fmt(g)})"))
  return Claim(f"3'. OAPL keeps pass@{k} (claim c)", parts) if parts else None


def _drop(by, method: str) -> list[float] | None:
  """Per seed, the mean of the last three evaluations at DROP_LAGS[0] minus at DROP_LAGS[1]."""
  first, last = DROP_LAGS
  seeds = _seeds(by, (method, first), (method, last))
  return [last_evals_mean(by[(method, first, s)]) - last_evals_mean(by[(method, last, s)]) for s in seeds] or None


def _falls(by, method: str) -> tuple[int, int]:
  """(windows fallen by more than stats.FALL, windows) over all the method's runs."""
  counts = [window_falls(by[k]) for k in sorted(by) if k[0] == method]
  return sum(c[0] for c in counts), sum(c[1] for c in counts)


def lag_cost_claim(by) -> Claim | None:
  """4: from L = 50 to 200 the async GRPO+TIS's mean of the last three evaluations falls by more
  than OAPL's and GRPO+IS's (means over seeds), and it has the most fallen refresh windows."""
  first, last = DROP_LAGS
  drops = {m: _drop(by, m) for m in (OAPL, GRPO, ASYNC)}
  parts = []
  if drops[ASYNC]:
    for other in (OAPL, GRPO):
      if drops[other]:
        a, o = drops[ASYNC], drops[other]
        parts.append(_on_mean(f"L={first} -> {last}, fall of the mean of last 3 evals, async GRPO+TIS > "
                              f"{NAMES[other]} (means over seeds)", np.mean(a) > np.mean(o),
                              f"{np.mean(a):+.3f} (per seed {_fmt(a)}) vs {np.mean(o):+.3f} ({_fmt(o)})"))
  # counted where a window has an evaluation at both ends; none yet: no part
  falls = {m: f for m in (OAPL, GRPO, ASYNC) if (f := _falls(by, m))[1]}
  if ASYNC in falls and len(falls) > 1:
    mine = falls[ASYNC][0]
    parts.append(_on_mean("async GRPO+TIS has the most refresh windows fallen by > 0.02 (all lags, seeds)",
                          all(mine > n for m, (n, _) in falls.items() if m != ASYNC),
                          "; ".join(f"{NAMES[m]} {n} of {w}" for m, (n, w) in falls.items())))
  return Claim("4. The lag costs the asynchronous GRPO+TIS most", parts) if parts else None


def long_lag_claim(by) -> Claim | None:
  """5: OAPL (tied) at L = 200 ends within `NEAR` of its own L = 10 run (mean of the last three
  evaluations, mean over seeds)."""
  long, short = _runs(by, OAPL, 200), _runs(by, OAPL, 10)
  if not (long and short):
    return None
  a, b = [last_evals_mean(r) for r in long], [last_evals_mean(r) for r in short]
  gap = float(np.mean(a) - np.mean(b))
  return Claim(f"5. OAPL's long lags: L = 200 within {NEAR} of L = 10", [_on_mean(
      "mean of last 3 evals, L=200 - L=10 (means over seeds)", abs(gap) <= NEAR,
      f"{gap:+.3f}: {np.mean(a):.3f} ({_fmt(a)}) vs {np.mean(b):.3f} ({_fmt(b)})")])


def claims(results) -> list[Claim]:
  """The registered predictions the runs have data for, in their order."""
  by = by_run(results)
  made = (ceiling_claim(by), short_lag_claim(by), passk_claim(by), lag_cost_claim(by), long_lag_claim(by))
  return [c for c in made if c is not None]


def _table(by) -> list[str]:
  """The figures the predictions read, a row per (method, lag): mean ± sd over its seeds."""
  k = _k(by)

  def cell(xs):
    mean, sd = mean_sd(xs)
    return f"{mean:.3f}" + (f" ± {sd:.3f}" if len(xs) > 1 else "")
  lines = [f"| method | L | seeds | final pass@1 | mean of last 3 evals | area (mean pass@1 over answers) | "
           f"windows fallen > 0.02 | pass@{k} before | pass@{k} after |", "|---|---|---|---|---|---|---|---|---|"]
  for method in (OAPL, GRPO, ASYNC):
    for lag in _lags(by, method):
      rs = _runs(by, method, lag)
      falls = [window_falls(r) for r in rs]
      windows = sum(w for _, w in falls)
      lines.append(f"| {NAMES[method]} | {lag} | {len(rs)} | {cell([r.summary['eval_after']['pass@1'] for r in rs])} | "
                   f"{cell([last_evals_mean(r) for r in rs])} | {cell([pass1_area(r) for r in rs])} | "
                   + (f"{sum(n for n, _ in falls)} of {windows}" if windows else "-")
                   + f" | {cell([_passk(r, 'before', k) for r in rs])} | {cell([_passk(r, 'after', k) for r in rs])} |")
  return lines


def section(results) -> list[str]:
  """The report's section: the figures, then each prediction with its verdict ([] without runs)."""
  made = claims(results)
  if not made:
    return []
  lines = ["## The registered predictions, checked (verdicts computed from the runs)", "",
           "Registered before any run of the study (\"Reading\" below: 1', 2, 3', 4, 5), each checked "
           "as worded there. Mean of last 3 evals: held-out pass@1 at steps 800, 900, 1000; area: "
           "pass@1 averaged over the answers generated; windows fallen: refresh windows [kL, (k+1)L] "
           "with an evaluation at both ends (L = 100, 200: every 100 steps) whose pass@1 fell by more "
           "than 0.02. A part worded on means over seeds is held or not on those means (per-seed "
           "values beside it; with 3 seeds, a reader should weigh a small gap against them); a part "
           "worded \"every seed\" or \"no run\" is held in all, not held in none, mixed otherwise.", "",
           *_table(by_run(results)), ""]
  for c in made:
    lines.append(f"**{c.name}: {c.verdict}.**")
    lines += [f"- {p.text}: {p.verdict}." for p in c.parts]
    lines.append("")
  return lines
