"""The study's statistics, pure functions of finished runs (`results.RunResult`) and plain
numbers: pass@k over problems, the mean and seed spread per (method, lag), paired per-seed
differences with a Student-t interval, and when a run first reaches a pass@1.
"""

from __future__ import annotations

import numpy as np

from oapl_jax.eval.passk import pass_at_k
from oapl_jax.studies.definitions import METHODS, method_label


def mean_pass_at_k(n: int, correct_per_problem, ks) -> np.ndarray:
  """`[len(ks)]`: the unbiased pass@k for each k, averaged over problems, from each problem's
  count of correct answers among its `n` samples."""
  counts, problems = np.unique(correct_per_problem, return_counts=True)  # each c once
  return np.array([np.dot(problems, [pass_at_k(n, c, k) for c in counts]) / problems.sum() for k in ks])


def group_runs(results) -> dict[tuple[str, int], list]:
  """(method, lag) -> its runs (one per seed), in the order of `results`."""
  groups: dict[tuple[str, int], list] = {}
  for r in results:
    groups.setdefault((r.method, r.lag), []).append(r)
  return groups


def mean_sd(values) -> tuple[float, float]:
  """(mean, sample standard deviation); the sd of a single value is 0."""
  v = np.asarray(values, float)
  return float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else 0.0


def paired_interval(diffs, level: float = 0.95) -> tuple[float, float, float]:
  """Mean of per-seed paired differences and its Student-t interval at `level` (two-sided).

  With one seed there is no spread to estimate: the interval is (nan, nan).
  """
  d = np.asarray(diffs, float)
  mean = float(d.mean())
  if len(d) < 2:
    return mean, float("nan"), float("nan")
  from scipy import stats  # a dependency of jax
  half = float(stats.t.ppf(0.5 + level / 2, len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d)))
  return mean, mean - half, mean + half


def paired_text(diffs, ahead: str) -> str:
  """Per-seed differences, their mean and t-interval, and how many are > 0 (`ahead`: the
  words before "in n of N", e.g. "OAPL higher")."""
  mean, lo, hi = paired_interval(diffs)
  interval = "no interval from one seed" if np.isnan(lo) else f"95% t-interval [{lo:+.3f}, {hi:+.3f}]"
  return (", ".join(f"{d:+.3f}" for d in diffs) + f"; mean {mean:+.3f}, {interval}"
          f" ({ahead} in {sum(d > 0 for d in diffs)} of {len(diffs)})")


def seeds_text(n: int) -> str:
  """"1 seed", "2 seeds": a count of seeds in tables and legends."""
  return f"{n} seed" if n == 1 else f"{n} seeds"


def by_run(results) -> dict[tuple[str, int, int], object]:
  """(method, lag, seed) -> its run."""
  return {(r.method, r.lag, r.seed): r for r in results}


def entropy_window(r, first: bool, n: int = 20) -> float:
  """Mean policy entropy of run `r` over its first (or last) `n` logged trainer steps."""
  _, ent = r.series("entropy")
  return float(ent[:n].mean() if first else ent[-n:].mean())


def _optional_rows(runs, n: int) -> dict[str, tuple[float, float]]:
  """Mean ± sd before and after of the held-out figures only some tasks have (maj@n, diversity,
  eval entropy), where every run has them."""
  row = {}
  for key in (f"maj@{n}", "distinct_answers", "distinct_correct_chains", "entropy_per_token"):
    if all(key in r.summary["eval_before"] and key in r.summary["eval_after"] for r in runs):
      for when in ("before", "after"):
        row[f"{key}_{when}"] = mean_sd([r.summary[f"eval_{when}"][key] for r in runs])
  return row


def _summary_row(method: str, lag: int, runs) -> dict:
  """The row of one (method, lag): see `summarise`."""
  n = min(r.summary["eval_after"]["samples_per_problem"] for r in runs)
  row = {"method": method, "lag": lag, "seeds": sorted(r.seed for r in runs),
         "label": method_label(method, runs[0].summary["config"]),
         "pass1_after_by_seed": {r.seed: r.summary["eval_after"]["pass@1"] for r in runs},
         "passn_after_by_seed": {r.seed: r.summary["eval_after"][f"pass@{n}"] for r in runs}}
  for name, values in {
      "pass1_before": [r.summary["eval_before"]["pass@1"] for r in runs],
      "pass1_after": [r.summary["eval_after"]["pass@1"] for r in runs],
      f"pass{n}_before": [r.summary["eval_before"][f"pass@{n}"] for r in runs],
      f"pass{n}_after": [r.summary["eval_after"][f"pass@{n}"] for r in runs],
      "entropy_start": [entropy_window(r, True) for r in runs],
      "entropy_end": [entropy_window(r, False) for r in runs],
      "samples": [r.summary["samples_generated"] for r in runs],
      "train_seconds": [r.summary["train_seconds"] for r in runs],
  }.items():
    row[name] = mean_sd(values)
  row.update(_optional_rows(runs, n))
  row["lr"] = sorted({r.summary["config"]["train"]["lr"] for r in runs})
  ks = np.arange(1, n + 1)
  gaps = np.mean([r.passk("after", ks) - r.passk("before", ks) for r in runs], axis=0)
  row["passk_not_up"] = [int(k) for k, g in zip(ks, gaps) if g < 0]
  row["passk_n"] = n
  return row


def summarise(results) -> list[dict]:
  """One row per (method, lag), in `METHODS` order then by lag: means and seed spread of the
  final figures, each seed's final pass@1 and pass@n, and the ks where pass@k went down."""
  groups = sorted(group_runs(results).items(), key=lambda kv: (list(METHODS).index(kv[0][0]), kv[0][1]))
  return [_summary_row(method, lag, runs) for (method, lag), runs in groups]


def pass1_at_step(r, step: int) -> float | None:
  """Run `r`'s held-out pass@1 at its evaluation after trainer step `step` (0: the base's);
  None if it had none there."""
  steps, pass1 = r.eval_curve("pass@1", "steps")
  hits = np.nonzero(steps == step)[0]
  return float(pass1[hits[0]]) if len(hits) else None


def first_reaching(r, target: float) -> float | None:
  """Answers generated when `r`'s held-out pass@1 (at its evaluations) first reaches `target`."""
  xs, ys = r.pass1_curve()
  hits = np.nonzero(ys >= target - 1e-12)[0]
  return float(xs[hits[0]]) if len(hits) else None


# --- a run's figures along its refresh windows and evaluations ---------------------------

FALL = 0.02  # a window falls when pass@1 at its end is this much below pass@1 at its start


def window_falls(r, threshold: float = FALL) -> tuple[int, int]:
  """(windows whose held-out pass@1 fell by more than `threshold`, windows): the refresh
  windows [k L, (k + 1) L] of run `r` with an evaluation at both ends (before training is step
  0, after it the last step)."""
  steps, p1 = r.eval_curve("pass@1", x="steps")
  at = dict(zip(steps.astype(int).tolist(), p1.tolist()))
  windows = [(a, a + r.lag) for a in range(0, int(steps.max()), r.lag) if a in at and a + r.lag in at]
  return sum(at[b] < at[a] - threshold for a, b in windows), len(windows)


def last_evals_mean(r, n: int = 3) -> float:
  """The mean held-out pass@1 of the run's last `n` evaluations (less sensitive than the final
  one to where a swing is at the end)."""
  return float(np.mean(r.eval_curve("pass@1", x="steps")[1][-n:]))


def pass1_area(r) -> float:
  """The area under held-out pass@1 against answers generated, divided by the answers: the mean
  pass@1 over training by the trapezoid rule (1 = solved from the first answer)."""
  x, y = r.eval_curve("pass@1", x="samples")
  return float(np.sum(np.diff(x) * (y[1:] + y[:-1]) / 2) / x[-1]) if x[-1] > 0 else float(y[-1])


def series_mean(r, key: str) -> float | None:
  """The mean of per-step metric `key` over the run, None where the run did not log it."""
  _, v = r.series(key)
  return float(np.mean(v)) if len(v) else None
