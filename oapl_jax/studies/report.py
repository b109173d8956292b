"""The study's report as markdown, a pure function of its results: `report_markdown` takes the
finished runs, the figures' paths, the kept notes and the sweep's choice, and returns the text;
`findings`, `paper_setting_findings` and `efficiency_findings` are its sentences on the paper's
findings, `verdicts.restated` their verdicts, `predictions.section` a study's registered
predictions checked (the mixed-task study's). Reading and writing files is the command's
(`lag_study.write_report`).
"""

from __future__ import annotations

import dataclasses

from oapl_jax.studies import predictions, step2
from oapl_jax.studies import search as search_lib
from oapl_jax.studies.definitions import METHODS, STUDIES
from oapl_jax.studies.stats import (
  by_run,
  first_reaching,
  group_runs,
  mean_sd,
  paired_text,
  pass1_at_step,
  seeds_text,
  summarise,
)
from oapl_jax.studies.verdicts import restated

# A study's registered predictions, checked (a function of its results -> the report's lines)
PREDICTIONS = {"mix": lambda results: [*predictions.section(results), *step2.section(results)]}
NOTES_BEGIN, NOTES_END = "<!-- notes: kept when the report is regenerated -->", "<!-- end notes -->"
NO_NOTES = "_(no notes yet)_"


def kept_notes(old_report: str | None) -> str:
  """The hand-written text between the notes markers of an earlier report (None: no report)."""
  if old_report and NOTES_BEGIN in old_report and NOTES_END in old_report:
    return old_report.split(NOTES_BEGIN, 1)[1].split(NOTES_END, 1)[0].strip()
  return NO_NOTES


def _fmt(ms, digits=3) -> str:
  m, s = ms
  return f"{m:.{digits}f} ± {s:.{digits}f}"


def _ranges(ks) -> str:
  """[1, 2, 3, 5] -> "1-3, 5"."""
  parts, start = [], ks[0]
  for prev, k in zip(ks, ks[1:] + [None]):
    if k != prev + 1:
      parts.append(str(start) if start == prev else f"{start}-{prev}")
      start = k
  return ", ".join(parts)


def _paired_text(diffs) -> str:
  return paired_text(diffs, "OAPL higher")


def _comparison_findings(rows) -> list[str]:
  """Each OAPL variant vs GRPO+IS at each lag: final pass@1 and pass@n, paired by seed."""
  by = {(r["method"], r["lag"]): r for r in rows}
  lags = sorted({r["lag"] for r in rows})
  out = []
  for oapl_name in ("oapl", "oapl_paper_betas"):
    for lag in lags:
      a, g = by.get((oapl_name, lag)), by.get(("grpo_tis", lag))
      if not (a and g):
        continue
      (ma, _), (mg, _) = a["pass1_after"], g["pass1_after"]
      diff = ma - mg
      verdict = ("OAPL higher" if diff > 0 else "GRPO+IS higher" if diff < 0 else "equal")
      # paired by seed: both runs of a seed start from the same base and see the same prompts
      seeds = sorted(set(a["pass1_after_by_seed"]) & set(g["pass1_after_by_seed"]))
      paired = [a["pass1_after_by_seed"][s] - g["pass1_after_by_seed"][s] for s in seeds]
      out.append(f"* pass@1 after, L={lag}: {a['label']} {ma:.3f} vs GRPO+IS {mg:.3f} -> "
                 f"{verdict} by {abs(diff):.3f}; per seed (OAPL - GRPO+IS, same base): "
                 + _paired_text(paired) + ".")
      n = a["passk_n"]
      if n > 1 and g["passk_n"] == n:
        paired = [a["passn_after_by_seed"][s] - g["passn_after_by_seed"][s] for s in seeds]
        out.append(f"* pass@{n} after, L={lag}: {a['label']} {a[f'pass{n}_after'][0]:.3f} vs "
                   f"GRPO+IS {g[f'pass{n}_after'][0]:.3f}; per seed: " + _paired_text(paired) + ".")
  return out


def _entropy_findings(rows) -> list[str]:
  """Each row's policy entropy, first vs last 20 steps."""
  out = []
  for r in rows:
    (e0, _), (e1, _) = r["entropy_start"], r["entropy_end"]
    change = (e1 - e0) / e0 if e0 else float("nan")
    out.append(f"* entropy, {r['label']}, L={r['lag']}: {e0:.3f} -> {e1:.3f} nats/token "
               f"({change:+.0%}, first vs last 20 steps).")
  return out


def _passk_findings(rows) -> list[str]:
  """Whether each row's pass@k after is at least its pass@k before, for every k."""
  out = []
  for r in rows:
    bad = r["passk_not_up"]
    out.append(f"* pass@k after >= before for every k = 1..{r['passk_n']}, {r['label']}, "
               f"L={r['lag']}: " + ("yes." if not bad else f"no, lower at k = {_ranges(bad)}."))
  return out


def findings(rows) -> list[str]:
  """Plain sentences on the paper's three findings, computed from the rows (`stats.summarise`)."""
  return _comparison_findings(rows) + _entropy_findings(rows) + _passk_findings(rows)


def paper_setting_findings(results, ks=(1, 2, 4, 8)) -> list[str]:
  """The paper's own comparison: OAPL at a long lag (each L > 1 run) vs GRPO+IS at L = 1,
  pass@k for k = 1..8 (its math table), paired by seed."""
  by = by_run(results)
  out = []
  for lag in sorted({r.lag for r in results if r.method == "oapl" and r.lag > 1}):
    seeds = sorted(s for (m, l, s) in by if m == "oapl" and l == lag and ("grpo_tis", 1, s) in by)
    if not seeds:
      continue
    pairs = [(by[("oapl", lag, s)], by[("grpo_tis", 1, s)]) for s in seeds]
    n = min(r.summary["eval_after"]["samples_per_problem"] for pair in pairs for r in pair)
    parts = []
    for k in (k for k in ks if k <= n):
      diffs = [float(a.passk("after", [k])[0] - g.passk("after", [k])[0]) for a, g in pairs]
      parts.append(f"pass@{k} " + _paired_text(diffs))
    out.append(f"* the paper's setting, OAPL at L={lag} vs GRPO+IS at L=1 (per seed, OAPL - GRPO+IS): "
               + "; ".join(parts) + ".")
  return out


def _answers(x: float | None) -> str:
  return "never" if x is None else f"{x:.0f} answers"


def efficiency_findings(results) -> list[str]:
  """Sample efficiency, per lag and seed: answers until OAPL reaches GRPO+IS's final pass@1,
  and until GRPO+IS reaches OAPL's (at the evaluation points; None: never)."""
  by = by_run(results)
  out = []
  for lag in sorted({r.lag for r in results}):
    parts, total = [], None
    for seed in sorted({r.seed for r in results}):
      a, g = by.get(("oapl", lag, seed)), by.get(("grpo_tis", lag, seed))
      if not (a and g):
        continue
      fa, fg = a.summary["eval_after"]["pass@1"], g.summary["eval_after"]["pass@1"]
      na, ng = first_reaching(a, fg), first_reaching(g, fa)
      total = a.summary["samples_generated"]
      parts.append(f"seed {seed}: OAPL to GRPO+IS's final {fg:.3f}: {_answers(na)}, "
                   f"GRPO+IS to OAPL's final {fa:.3f}: {_answers(ng)}")
    if parts:
      out.append(f"* sample efficiency, L={lag} (answers generated, read at the evaluations; "
                 f"{total} per run): " + "; ".join(parts) + ".")
  return out


def _runs_line(results, spec) -> str:
  """What the study's runs were: methods, lags, seeds, steps, answers, lr, evaluation."""
  first = results[0].summary["config"]
  walls = [r.wall_seconds for r in results if r.wall_seconds]
  wall_seconds = sum(walls) if len(walls) == len(results) else None
  train_minutes = sum(r.summary["train_seconds"] for r in results) / 60
  return (f"{len(results)} runs: methods {', '.join(sorted({r.method for r in results}))}; "
          f"L = {', '.join(map(str, sorted({r.lag for r in results})))}; "
          f"seeds {', '.join(map(str, sorted({r.seed for r in results})))}. "
          f"Each run: {spec.about}, "
          f"{first['train']['steps']} trainer steps of {first['rl']['groups_per_step']} groups x "
          f"G={first['rl']['group_size']} fresh answers, lr "
          f"{', '.join(sorted({format(r.summary['config']['train']['lr'], 'g') for r in results}))}, "
          f"pass@k on {first['task']['num_eval']} held-out problems with "
          f"{first['eval']['samples_per_problem']} samples each (unbiased estimator)."
          + f" Summed over the runs: {train_minutes:.0f} min of training"
          + (f", {wall_seconds / 60:.0f} min of wall time with warm-ups and evaluations" if wall_seconds else "")
          + ", one run per core of a 2-core CPU"
          + (" (a sitting killed without a checkpoint is not counted)." if wall_seconds else "."))


def _seeds_line(results, spec, planned=None, launcher=None) -> str:
  """How many of the study's seeds are done, named as those `launcher` runs (None: the study's
  own, `spec.launcher`, whose seed-by-seed order the line states): a seed is done once it has a
  finished run of every (method, lag) the command plans (`planned`: (methods, lags) or (methods,
  lags, {method: its own lags}); None: every (method, lag) that any finished run has); the seeds
  in progress with their runs."""
  found = {(r.method, r.lag) for r in results}
  own = planned[2] if planned and len(planned) > 2 else {}
  pairs = {(m, lag) for m in planned[0] for lag in own.get(m, planned[1])} if planned else found
  by_seed: dict[int, set] = {}
  for r in results:
    if (r.method, r.lag) in pairs:
      by_seed.setdefault(r.seed, set()).add((r.method, r.lag))
  launcher = launcher or spec.launcher
  done = sorted(s for s, p in by_seed.items() if p == pairs)
  going = sorted(s for s in by_seed if s not in done)
  return (f"**Seeds done: {len(done)} of the {len(spec.seeds)} that `{launcher}` runs** "
          f"({', '.join(map(str, done)) or 'none'}: a seed is done when it has all {len(pairs)} "
          "(method, L) runs)"
          + ("; in progress: " + ", ".join(f"seed {s} ({len(by_seed[s])} of {len(pairs)} runs)" for s in going)
             + ", whose finished runs are in the tables too, so rows can have different seeds" if going else "")
          + (". The launcher starts every method and lag of a seed before any run of the next seed"
             if launcher == spec.launcher else "") + ".")


def _header(results, *, study: str, command: str, planned=None, launcher=None) -> list[str]:
  """Title, the command that made the report, and what the runs were; launcher: the launch/
  script whose runs these are (None: the study's own)."""
  spec = STUDIES[study]
  launcher = launcher or spec.launcher
  return [
      f"# {spec.title}",
      "",
      "Produced by (from the repository root"
      + ("):" if command.startswith("bash ") else f"; `bash {launcher}` runs the same):"),
      "",
      f"    {command}",
      "",
      *([_runs_line(results, spec), "", _seeds_line(results, spec, planned, launcher)] if results
        else ["No study run has finished yet."]),
      "",
  ]


def _final_table(rows) -> list[str]:
  """Mean ± sd over seeds of the final figures, a row per (method, lag)."""
  n = rows[0]["passk_n"]
  lines = [
      "## Final numbers (mean ± sd over seeds)",
      "",
      f"| method | L | pass@1 before | pass@1 after | pass@{n} before | pass@{n} after | entropy first 20 steps | entropy last 20 steps | answers generated | train s |",
      "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    lines.append(
        f"| {r['label']} | {r['lag']} | {_fmt(r['pass1_before'])} | {_fmt(r['pass1_after'])} | "
        f"{_fmt(r[f'pass{n}_before'])} | {_fmt(r[f'pass{n}_after'])} | {_fmt(r['entropy_start'])} | "
        f"{_fmt(r['entropy_end'])} | {r['samples'][0]:.0f} | {r['train_seconds'][0]:.0f} |")
  return lines + [""]


SCREENED_OUT = "screened out"  # a later-lag cell of a point not among its method's screened ones


def _search_cell(scores, method, lag, idx, chosen, screened_out) -> str:
  v = scores.get((method, lag, idx))
  text = (SCREENED_OUT if screened_out else "—") if v is None else f"{v:.3f}"
  return f"**{text}**" if chosen == idx else text


def _search_method_table(method, axes, lags, scores, chosen, kept) -> list[str]:
  """One method's grid: a row per setting of its non-lr axes, a column per (lag, lr). kept: the
  method's points screened in for the later lags (None: not known yet)."""
  lr_at = next((i for i, a in enumerate(axes) if a.tag == "lr"), None)
  lr_values = range(len(axes[lr_at].values)) if lr_at is not None else [None]
  rows = []
  for idx in search_lib.points(axes):
    key = tuple(i for j, i in enumerate(idx) if j != lr_at)
    if key not in rows:
      rows.append(key)

  def full(key, li):
    key = list(key)
    if li is not None:
      key.insert(lr_at, li)
    return tuple(key)

  def cell(lag, idx):
    return _search_cell(scores, method, lag, idx, chosen,
                        screened_out=lag != lags[0] and kept is not None and idx not in kept)
  cols = [(lag, li) for lag in lags for li in lr_values]
  head = " | ".join(f"L={lag}" + (f", lr {axes[lr_at].values[li][0]:g}" if li is not None else "")
                    for lag, li in cols)
  lines = [f"| {METHODS[method][0].split(' (')[0]} setting | {head} |", "|---|" + "---|" * len(cols)]
  for key in rows:
    name = search_lib.describe(axes, full(key, 0 if lr_at is not None else None), skip=("lr",)) or "lr only"
    lines.append(f"| {name} | " + " | ".join(cell(lag, full(key, li)) for lag, li in cols) + " |")
  return lines + [""]


def _search_counts(plan: dict, scores: dict) -> tuple[dict, dict]:
  """Each method's ({method: runs planned}, {method: those finished}): every point at the first
  lag, the screened ones at the later lags (a later-lag run of a point screened out, made
  before the screening existed, is shown in the grid but not counted)."""
  grid, lags, top_k = search_lib.grid_from_plan(plan), plan["lags"], search_lib.plan_top_k(plan)
  kept = search_lib.screened(grid, lags, scores, top_k)
  total = {m: search_lib.planned_runs(axes, lags, top_k) for m, axes in grid.items()}
  done = {m: sum(1 for (m2, lag, p) in scores if m2 == m and (lag == lags[0] or kept is None or p in kept[m]))
          for m in grid}
  return total, done


def _screening_text(plan: dict, grid: dict) -> str:
  """The screening rule, for the search section ("" without one, or where it keeps every point)."""
  lags, top_k = plan["lags"], search_lib.plan_top_k(plan)
  if top_k is None or len(lags) < 2 or all(top_k >= len(search_lib.points(a)) for a in grid.values()):
    return ""
  later = ", ".join(f"L = {lag}" for lag in lags[1:])
  return (f" Screening: every setting runs at L = {lags[0]}; at {later} only each method's {top_k} best "
          f"by their final pass@1 at L = {lags[0]} run (ties: the one that ran first), the same number for "
          f"every method, and the choice is among those {top_k}. \"{SCREENED_OUT}\": a setting not among "
          "them, not run at that lag.")


def _search_section(search: dict | None) -> list[str]:
  """The settings search: every point's final pass@1 at each lag (— : not run yet; screened out:
  not run at that lag by the screening), the runs per method, and each method's choice ([] if no
  search ran).

  search: {"plan": search.json's plan, "scores": search.search_scores, "outside" (optional):
  search.outside_scores, the edge checks}."""
  if not search:
    return []
  plan, scores = search["plan"], search["scores"]
  grid, lags, top_k = search_lib.grid_from_plan(plan), plan["lags"], search_lib.plan_top_k(plan)
  picked = search_lib.choose(grid, lags, scores, top_k) or {}
  kept = search_lib.screened(grid, lags, scores, top_k)
  total, done = _search_counts(plan, scores)
  lines = ["## Settings search", "",
           (f"Final held-out pass@1 of each setting at L = {', '.join(map(str, lags))}, seed {plan['seed']} "
            "(not a study seed). Each method's setting with the best pass@1 averaged over these lags "
            "(ties: the one nearer the configs' current setting) is used by every study run; it is in bold "
            "once the method's grid is complete. — : not run yet." + _screening_text(plan, grid)), "",
           "Runs per method (the same budget for each): " + ", ".join(
               f"{METHODS[m][0].split(' (')[0]} {done[m]} of {total[m]}" for m in grid) + ".", ""]
  for method, axes in grid.items():
    lines += _search_method_table(method, axes, lags, scores, picked.get(method),
                                  None if kept is None else kept[method])
  for method, axes in grid.items():
    lines.append(f"* chosen, {METHODS[method][0].split(' (')[0]}: "
                 + (search_lib.describe(axes, picked[method]) if method in picked else
                    f"not yet ({total[method] - done[method]} of its {total[method]} runs left)") + ".")
  return lines + [""] + _outside_table(lags, scores, picked, search.get("outside") or {})


def _point_text(label: str) -> str:
  """A search point's run label for people: "clip-0.8_lr-0.003" -> "clip=0.8, lr=0.003"."""
  return ", ".join("=".join(part.split("-", 1)) for part in label.split("_"))


def _outside_table(lags, scores, picked, outside) -> list[str]:
  """The edge checks (`--beyond`): each setting outside the grid, its final pass@1 at each of the
  search's lags and their mean beside the chosen setting's ([] without any)."""
  if not outside:
    return []
  lines = ["Edge checks, run after the study (`--beyond`: a chosen setting with one axis moved outside "
           "its grid, on the search's seed and lags): beside the choice, never replacing it.", "",
           "| method | setting | " + " | ".join(f"L={lag}" for lag in lags) + " | mean | chosen's mean |",
           "|---|---|" + "---|" * (len(lags) + 2)]
  for method, point in sorted({(m, p) for m, _, p in outside}):
    vals = [outside.get((method, lag, point)) for lag in lags]
    mean = sum(vals) / len(vals) if None not in vals else None
    chosen = ([scores.get((method, lag, picked[method])) for lag in lags] if method in picked else [None])
    chosen_mean = sum(chosen) / len(chosen) if None not in chosen else None
    lines.append(f"| {METHODS[method][0].split(' (')[0]} | {_point_text(point)} | "
                 + " | ".join("—" if v is None else f"{v:.3f}" for v in vals)
                 + f" | {'—' if mean is None else f'{mean:.3f}'} | "
                 + f"{'—' if chosen_mean is None else f'{chosen_mean:.3f}'} |")
  return lines + [""]


def _search_status(search: dict | None) -> list[str]:
  """A line at the top while the search is incomplete ([] once it is complete, or without one)."""
  if not search:
    return []
  total, done = (sum(d.values()) for d in _search_counts(search["plan"], search["scores"]))
  if done >= total:
    return []
  return [f"**Partial: the settings search has finished {done} of its {total} runs, so no setting "
          "is chosen yet and the study's runs, which use the chosen settings, have not started.** "
          'What is done and what is not: "Reading" below.', ""]


def _at_step(runs, step: int) -> tuple[float, float] | None:
  """Mean ± sd over `runs` of pass@1 at trainer step `step` (None unless every run has it)."""
  values = [pass1_at_step(r, step) for r in runs]
  return None if any(v is None for v in values) else mean_sd(values)


def _reference_section(reference: dict | None, rows, results=()) -> list[str]:
  """Final pass@1 per method and lag: the earlier study's row (`reference`) beside this study's
  at the earlier study's length (its "steps", where given) and at its end ([] without a reference)."""
  if not reference:
    return []
  lags = sorted({int(l) for table in reference["pass1_after"].values() for l in table})
  by = {(r["method"], r["lag"]): r for r in rows}
  groups = group_runs(results)
  steps = reference.get("steps")
  lines = ["## Against the short runs", "",
           reference["about"], "",
           "| method | runs | " + " | ".join(f"L={l}" for l in lags) + " |", "|---|---|" + "---|" * len(lags)]
  for method, table in reference["pass1_after"].items():
    name = METHODS[method][0].split(" (")[0]
    lines.append(f"| {name} | {reference['label']} | "
                 + " | ".join(_fmt(table[str(l)]) if str(l) in table else "—" for l in lags) + " |")
    if steps:
      at = [_at_step(groups[(method, l)], steps) if (method, l) in groups else None for l in lags]
      lines.append(f"| {name} | this study at step {steps} | " + " | ".join(
          f"{_fmt(ms)} ({seeds_text(len(groups[(method, l)]))})" if ms else "—" for l, ms in zip(lags, at)) + " |")
    lines.append(f"| {name} | this study | " + " | ".join(
        f"{_fmt(by[(method, l)]['pass1_after'])} ({seeds_text(len(by[(method, l)]['seeds']))})" if (method, l) in by
        else "—" for l in lags) + " |")
  if steps:
    lines += ["", (f"\"At step {steps}\": this study's runs evaluated after {steps} of their trainer steps, "
                   "as many answers as a short run; with the searched settings, but not the same as a "
                   f"{steps}-step run: the lr's cosine decay spans the whole run, so at step {steps} the lr is "
                   "still high where a short run's had decayed to its floor.")]
  return lines + [""]


def _along_table(rows, results, steps) -> list[str]:
  """Mean ± sd over seeds of pass@1 at each of trainer steps `steps` that every run evaluated
  at, a row per (method, lag) of `rows` (`summarise`'s) ([] without such steps)."""
  groups = group_runs(results)
  cells = {s: [_at_step(groups[(r["method"], r["lag"])], s) for r in rows] for s in steps}
  steps = [s for s in steps if cells[s] and all(cells[s])]
  if not steps:
    return []
  first = results[0].summary
  per_step = first["samples_generated"] // max(first["trainer_steps"], 1)
  longest = max(r["lag"] for r in rows)
  lines = ["## Held-out pass@1 along the run (mean ± sd over seeds)", "",
           f"At trainer step s a run has generated s x {per_step} answers and its engine has had s // L "
           f"refreshes (at L = {longest}: " + ", ".join(f"{s // longest} by step {s}" for s in steps) + ").", "",
           "| method | L | " + " | ".join(f"step {s} ({s * per_step:,} answers)" for s in steps) + " |",
           "|---|---|" + "---|" * len(steps)]
  for i, r in enumerate(rows):
    lines.append(f"| {r['label']} | {r['lag']} | " + " | ".join(_fmt(cells[s][i]) for s in steps) + " |")
  return lines + [""]


def _votes_table(rows) -> list[str]:
  """maj@k, diversity and eval entropy before -> after ([] unless the task has final answers)."""
  n = rows[0]["passk_n"] if rows else 0
  keys = [k for k in (f"maj@{n}", "distinct_answers", "distinct_correct_chains", "entropy_per_token")
          if all(f"{k}_before" in r for r in rows)]
  if not (rows and f"maj@{n}" in keys):  # tasks with final answers (chain_addition) only
    return []
  lines = ["## Held-out votes, diversity and entropy (mean ± sd over seeds; before -> after)", "",
           "| method | L | lr | " + " | ".join(keys) + " |", "|---|---|---|" + "---|" * len(keys)]
  for r in rows:
    lines.append(f"| {r['label']} | {r['lag']} | {', '.join(f'{x:g}' for x in r['lr'])} | "
                 + " | ".join(f"{_fmt(r[f'{k}_before'], 2)} -> {_fmt(r[f'{k}_after'], 2)}" for k in keys) + " |")
  return lines + ["", ("maj@k: majority vote over k answers' final answers; distinct_answers / "
                       "distinct_correct_chains: per problem among its samples; entropy_per_token: "
                       "mean -log pi_theta of its own sampled tokens."), ""]


_PLOTS = (("pass1", "pass@1 vs generated answers"), ("pass1_refreshes", "pass@1 vs engine refreshes"),
          ("entropy", "entropy vs trainer step"),
          ("passk", "pass@k before and after"))
_OPTIONAL_PLOTS = (("diversity", "held-out diversity vs generated answers"),
                   ("eval_entropy", "held-out entropy vs generated answers"))


def _plots_section(figures: dict[str, str]) -> list[str]:
  """The figures (name -> path relative to the report; the optional ones where present)."""
  if not figures:
    return []
  lines = ["## Plots", ""]
  for name, alt in tuple(p for p in _PLOTS + _OPTIONAL_PLOTS if p[0] in figures):
    lines += [f"![{alt}]({figures[name]})", ""]
  return lines


PAIRED = ("oapl", "oapl_paper_betas", "grpo_tis")  # the methods the lag studies' findings compare


def _covered(pairs) -> set[str]:
  """The methods the findings of a study with method pairs `pairs` speak of."""
  return set(PAIRED) if tuple(pairs) == (("oapl", "grpo_tis"),) else {m for pair in pairs for m in pair}


def _unpaired_line(results, pairs) -> list[str]:
  """A line naming the runs' methods that the findings and verdicts leave out ([] if none)."""
  other = sorted({r.method for r in results} - _covered(pairs))
  if not other:
    return []
  return [f"**Not in the findings below: {', '.join(other)}** (they compare the study's method pairs "
          f"only: {', '.join(f'{a} vs {b}' for a, b in pairs)}). The tables above have every run.", ""]


def _findings_sections(results) -> list[str]:
  """The verdicts and the paper's findings on runs of methods "oapl" and "grpo_tis" (and the
  lag studies' "oapl_paper_betas")."""
  return [*restated(results), "## The paper's findings, checked (computed from the runs)", "",
          *findings(summarise(results)), *paper_setting_findings(results), *efficiency_findings(results), ""]


def _paired_sections(results, pairs) -> list[str]:
  """The findings of each (OAPL, GRPO) method pair: the lag studies' own pair as it always was;
  another pair's runs renamed to "oapl" / "grpo_tis" for the same functions, under a heading
  saying which runs those names stand for."""
  if tuple(pairs) == (("oapl", "grpo_tis"),):
    return _findings_sections(results)
  lines = []
  for a, b in pairs:
    view = [dataclasses.replace(r, method={a: "oapl", b: "grpo_tis"}[r.method]) for r in results
            if r.method in (a, b)]
    if not {r.method for r in view} == {"oapl", "grpo_tis"}:
      continue
    lines += [f"# {a} vs {b}", "", f"In this part \"OAPL\" is the runs of `{a}` and \"GRPO+IS\" those of "
              f"`{b}` ({METHODS[a][0]}; {METHODS[b][0]}).", "", *_findings_sections(view)]
  return lines


def report_markdown(results, *, study: str, command: str, figures: dict[str, str],
                    notes: str = NO_NOTES, search: dict | None = None,
                    reference: dict | None = None, planned: tuple | None = None,
                    launcher: str | None = None) -> str:
  """The report on finished runs `results` (`results.RunResult`; may be empty while only the
  search has runs) of study `study`.

  command: the command that made it (quoted); figures: `plots.plot`'s {name: path}, the paths
  relative to the report's folder; notes: the hand-written reading (`kept_notes`); search: the
  settings search's plan and scores (`_search_section`; None: no search); reference: an earlier
  study's final pass@1 per method and lag (`_reference_section`; None: none); planned: the
  (methods, lags) the command runs for each seed (None: those of the finished runs); launcher:
  the launch/ script these runs come from, if not the study's own (e.g. launch/mix_step2.sh).
  """
  rows = summarise(results)
  lines = [*_header(results, study=study, command=command, planned=planned, launcher=launcher),
           *_search_status(search)]
  if rows:
    lines += [*_final_table(rows), *_along_table(rows, results, STUDIES[study].along)]
  lines += [*_reference_section(reference, rows, results), *_search_section(search)]
  if rows:
    lines += [
        *_votes_table(rows),
        *_plots_section(figures),
        *(PREDICTIONS[study](results) if study in PREDICTIONS else []),
        *_unpaired_line(results, STUDIES[study].pairs),
        *_paired_sections(results, STUDIES[study].pairs),
    ]
  lines += ["## Reading", "", NOTES_BEGIN, notes, NOTES_END, ""]
  return "\n".join(lines)
