"""The mixed-task study's registered predictions (oapl_jax/studies/predictions.py), checked on
runs made up in memory: each verdict follows the figures it reads, and flips when they do."""

import numpy as np
import pytest

from oapl_jax.studies import predictions, results
from oapl_jax.studies.predictions import ASYNC, GRPO, OAPL
from oapl_jax.studies.report import report_markdown
from oapl_jax.studies.verdicts import HELD, MIXED, NOT_HELD

N = 64  # samples per held-out problem: pass@64 is the fraction of problems with a correct one


def _eval(correct, n=N):
  return {"samples_per_problem": n, "correct_per_problem": list(correct),
          "pass@1": sum(correct) / (n * len(correct)), f"pass@{n}": sum(c > 0 for c in correct) / len(correct)}


def _run(method, lag, seed, last3=0.8, drop=0.0, after=(1, 1, 1, 0), before=(1, 1, 0, 0), zigzag=False, n=N):
  """A 1000-step run evaluated every 100 steps: pass@1 rising to `last3` - `drop` at steps
  800-1000 (`zigzag`: every other evaluation 0.1 lower, so each window of L = 100 falls or
  climbs); 4 held-out problems with correct counts `before` / `after`."""
  level = last3 - drop
  curve = [0.3 + (level - 0.3) * min(i, 8) / 8 for i in range(11)]
  if zigzag:
    curve = [c - 0.1 * (i % 2) for i, c in enumerate(curve)]
  summary = {"config": {"train": {"steps": 1000, "lr": 1e-4}},
             "eval_before": {**_eval(before, n), "pass@1": curve[0]},
             "eval_after": {**_eval(after, n), "pass@1": curve[-1]},
             "evals_during": [{"step": 100 * i, "pass@1": curve[i], "samples_generated": 12800 * i} for i in range(1, 10)],
             "samples_generated": 128000, "trainer_steps": 1000}
  metrics = [{"step": t, "entropy": 1.0} for t in range(1, 1001)]
  return results.RunResult(method, lag, seed, summary, metrics, wall_seconds=60.0)


def _study(changes=None):
  """Every (method, lag, seed) of the study, the predictions held unless `changes` says
  otherwise: {(method, lag): `_run` keyword arguments}."""
  changes = changes or {}
  base = {OAPL: {"last3": 0.80}, GRPO: {"last3": 0.85}, ASYNC: {"last3": 0.84}}
  runs = []
  for method in (OAPL, GRPO, ASYNC):
    for lag in (1, 10, 50, 100, 200):
      kw = dict(base[method])
      if method == ASYNC and lag == 200:
        kw.update(drop=0.1)  # 4: the lag costs it most
      if method == ASYNC and lag == 100:
        kw.update(zigzag=True)  # 4: the most fallen windows
      kw.update(changes.get((method, lag), {}))
      runs += [_run(method, lag, seed, **kw) for seed in range(3)]
  return runs


def _verdicts(runs):
  return {c.name.split(".")[0]: c.verdict for c in predictions.claims(runs)}


def test_a_study_where_every_prediction_holds():
  assert _verdicts(_study()) == {"1'": HELD, "2": HELD, "3'": HELD, "4": HELD, "5": HELD}


@pytest.mark.parametrize("changes, name, verdict", [
    ({(GRPO, 1): {"last3": 0.92}}, "1'", MIXED),  # one method's runs reach the ceiling
    ({(GRPO, 10): {"last3": 0.75}}, "2", MIXED),  # GRPO+IS behind at L = 10, ahead at L = 1
    ({(GRPO, 1): {"last3": 0.75}, (GRPO, 10): {"last3": 0.75}}, "2", NOT_HELD),
    ({(OAPL, 50): {"after": (1, 0, 0, 0)}}, "3'", MIXED),  # OAPL's pass@64 below its base's
    # ... and only that: still at least GRPO+IS's
    ({(OAPL, 50): {"after": (1, 1, 0, 0), "before": (1, 1, 1, 0)}, (GRPO, 50): {"after": (1, 0, 0, 0)}}, "3'", MIXED),
    ({(OAPL, 50): {"after": (1, 1, 0, 0)}}, "3'", MIXED),  # below GRPO+IS's, at its base's
    ({(OAPL, 200): {"drop": 0.2}}, "4", MIXED),  # OAPL loses more than async from 50 to 200
    ({(OAPL, 200): {"drop": 0.06}}, "5", NOT_HELD),  # L = 200 more than 0.05 below L = 10
])
def test_a_verdict_flips_with_its_figures(changes, name, verdict):
  assert _verdicts(_study(changes))[name] == verdict


def test_the_figures_the_predictions_read():
  r = _run(ASYNC, 100, 0, last3=0.8, zigzag=True)
  assert predictions.last_evals_mean(r) == pytest.approx((0.8 + 0.7 + 0.8) / 3)
  assert predictions.window_falls(r)[1] == 10 and predictions.window_falls(r)[0] == 5
  assert predictions._passk(r, "after") == pytest.approx(0.75) and predictions._passk(r, "before") == 0.5


def test_runs_with_fewer_samples_than_64_read_pass_at_their_samples():
  runs = [_run(OAPL, lag, 0, n=8) for lag in (10, 200)]  # CI-sized runs: 8 samples per problem
  assert [c.name for c in predictions.claims(runs)][1] == "3'. OAPL keeps pass@8 (claim c)"
  assert "| pass@8 before | pass@8 after |" in "\n".join(predictions.section(runs))


def test_no_prediction_without_its_runs():
  assert predictions.claims([]) == []
  only_oapl = [r for r in _study() if r.method == OAPL]
  assert [c.name.split(".")[0] for c in predictions.claims(only_oapl)] == ["1'", "3'", "5"]
  short = [r for r in _study() if r.lag < 100]  # no refresh window with an evaluation at both ends
  assert [c.name.split(".")[0] for c in predictions.claims(short)] == ["1'", "2", "3'"]


def test_the_mix_report_carries_the_predictions_and_other_studies_do_not():
  runs = _study()
  for r in runs:  # what report_markdown's tables read besides the predictions' figures
    r.summary["config"].update(rl={"groups_per_step": 16, "group_size": 8}, task={"num_eval": 4},
                               eval={"samples_per_problem": N})
    r.summary["train_seconds"] = 5.0
  mix = report_markdown(runs, study="mix", command="bash launch/mix_study.sh", figures={})
  assert "## The registered predictions, checked" in mix and "**5. OAPL's long lags" in mix
  assert "| async GRPO+TIS | 100 | 3 |" in mix and "15 of 30 |" in mix  # its zig-zag windows
  other = report_markdown([r for r in runs if r.method != ASYNC], study="reason", command="x", figures={})
  assert "registered predictions" not in other


# --- step 2 (issue 62; oapl_jax/studies/step2.py) ------------------------------------------------

from oapl_jax.studies import step2  # noqa: E402
from oapl_jax.studies.step2 import ASYNC as S2_ASYNC, B1, B1_3E4, B1_LEN, GRPO_3E4, TIED  # noqa: E402

OPS = ("*", "+", "*", "-")  # the made-up runs' held-out problems: two of them "*"


def _run2(method, lag, seed, last3=0.8, star=0.1, rise=0.3, zigzag=0.0, dips=()):
  """A 1000-step run evaluated every 100 steps, pass@1 from 0.3 to `last3` at step 800 (`rise`:
  the share of that climb made by step 100, so the area grows with it; `zigzag`: the evaluations
  at steps 300, 500, 700, 900 that much lower; `dips`: the evaluations at these steps 0.2 lower);
  at step 100 the "*" problems solved at `star`."""
  curve = [0.3] + [0.3 + (last3 - 0.3) * (rise + (1 - rise) * min(i - 1, 7) / 7) for i in range(1, 11)]
  curve = [c - zigzag * (i % 2) * (i > 1) - 0.2 * (100 * i in dips) for i, c in enumerate(curve)]
  k = round(star * N)

  def ev(i):
    correct = [k, 10, k, 10] if i == 1 else [5, 5, 5, 5]
    return {**_eval(correct), "pass@1": curve[i]}
  summary = {"config": {"train": {"steps": 1000, "lr": 1e-4}, "seed": seed},
             "eval_before": ev(0), "eval_after": ev(10),
             "evals_during": [{"step": 100 * i, **ev(i), "samples_generated": 12800 * i} for i in range(1, 10)],
             "samples_generated": 128000, "trainer_steps": 1000}
  return results.RunResult(method, lag, seed, summary, [{"step": t, "entropy": 1.0} for t in range(1, 1001)], 60.0)


def _step2(changes=None):
  """The study's committed methods and step 2's variants, every step-2 prediction held unless
  `changes` ({(method, lag): `_run2` keyword arguments}) says otherwise."""
  changes = changes or {}
  base = {TIED: {"last3": 0.76, "star": 0.12}, B1: {"last3": 0.82, "star": 0.5, "rise": 0.6},
          B1_LEN: {"last3": 0.77, "star": 0.15}, GRPO: {"last3": 0.78, "rise": 0.1},
          GRPO_3E4: {"last3": 0.84, "rise": 0.5}, S2_ASYNC: {"last3": 0.85, "rise": 0.5},
          B1_3E4: {"last3": 0.80, "rise": 0.4}}
  lags = {TIED: (50, 100, 200), B1: (50, 100, 200), B1_LEN: (50, 100, 200), GRPO: (10, 50, 100, 200),
          GRPO_3E4: (10, 50, 100, 200), S2_ASYNC: (10, 50, 100, 200), B1_3E4: (100,)}
  return [_run2(m, lag, s, **{**base[m], **changes.get((m, lag), {})}) for m in base for lag in lags[m] for s in range(3)]


@pytest.fixture
def made_up_tasks(monkeypatch):
  monkeypatch.setattr(step2, "held_out_operations", lambda config: OPS)


def _verdicts2(runs):
  return {c.name.split(".")[0]: c.verdict for c in step2.claims(runs)}


def test_step2_where_every_prediction_holds(made_up_tasks):
  assert _verdicts2(_step2()) == {f"S2-{i}": HELD for i in range(1, 8)}


@pytest.mark.parametrize("changes, name, verdict", [
    ({(B1, 200): {"star": 0.3}}, "S2-1", MIXED),  # the rare skill not learnt in the first window
    ({(B1, lag): {"rise": 0.3, "star": 0.3, "last3": 0.76} for lag in (50, 100, 200)}, "S2-1", NOT_HELD),  # as tied
    ({(B1, 200): {"last3": 0.79}}, "S2-2", NOT_HELD),
    ({(B1, 200): {"dips": (200, 600, 1000)}}, "S2-3", NOT_HELD),  # 2 windows of each run fall: a trade-off
    ({(B1_LEN, 200): {"last3": 0.80}}, "S2-4", MIXED),  # the control ends 0.04 above tied
    ({(GRPO_3E4, 100): {"last3": 0.80}}, "S2-5", MIXED),  # the anchor matters at L = 100
    ({(GRPO_3E4, lag): {"rise": 0.05, "last3": 0.78} for lag in (100, 200)}, "S2-6", NOT_HELD),  # no faster
    ({(B1_3E4, 100): {"rise": 0.7, "last3": 0.84},  # 0.037 more area at lr 3e-4, still behind GRPO+IS
      (GRPO_3E4, 100): {"rise": 0.8, "last3": 0.88}}, "S2-7", MIXED),
    ({(B1_3E4, 100): {"rise": 0.9, "last3": 0.86}}, "S2-7", NOT_HELD),  # faster and past GRPO+IS
])
def test_a_step2_verdict_flips_with_its_figures(made_up_tasks, changes, name, verdict):
  assert _verdicts2(_step2(changes))[name] == verdict


def test_step2_counts_falls_both_ways_and_three_fallen_windows_are_mixed(made_up_tasks):
  r = _run2(B1, 200, 0, zigzag=0.1)  # evaluations 300, 500, 700, 900 0.1 lower
  assert step2.window_falls(r) == (0, 5)  # window ends (0, 200, ..., 1000) never fall
  assert step2.eval_falls(r) == (4, 10)  # 200 -> 300, 400 -> 500, ...: 4 of the 10 pairs inside windows
  r100 = _run2(B1, 100, 0, zigzag=0.1)
  assert step2.eval_falls(r100) == step2.window_falls(r100) == (4, 10)  # at L = 100 the two coincide
  assert step2.eval_falls(_run2(B1, 50, 0, zigzag=0.1))[1] == 0  # no two evaluations inside one window
  # 3 fallen windows over the seeds: between "at most 2" and "more than 3"
  runs = [r for r in _step2() if (r.method, r.lag) != (B1, 200)]
  falls = [_run2(B1, 200, s, last3=0.82, star=0.5, rise=0.6) for s in range(3)]
  for r in falls:  # one window (400 -> 600) falls in each seed
    for e in r.summary["evals_during"]:
      if e["step"] == 600:
        e["pass@1"] -= 0.2
  claim = {c.name.split(".")[0]: c for c in step2.claims(runs + falls)}["S2-3"]
  assert [p.verdict for p in claim.parts] == [MIXED, HELD] and "3 of 15" in claim.parts[0].text


def test_step2_reads_the_multiply_by_a_digit_problems_of_the_committed_runs():
  """The held-out operations come from the run's task settings and seed: the issue's figures for
  tied OAPL at L = 200, seed 0 ("*" 0.018 at the base, 0.081 at step 100)."""
  import os
  committed = os.path.join(os.path.dirname(__file__), "..", "docs", "mix_study", "results")
  r = next(x for x in results.load_runs(None, results=committed) if (x.method, x.lag, x.seed) == (TIED, 200, 0))
  ops = step2.held_out_operations(r.summary["config"])
  assert len(ops) == 64 and {op: ops.count(op) for op in "+-*x"} == {"+": 13, "-": 14, "*": 19, "x": 18}
  assert round(step2.op_pass1(r, 0), 3) == 0.018 and round(step2.op_pass1(r, 100), 3) == 0.081
  assert step2.op_pass1(r, 150) is None


def test_step2_has_no_section_without_its_runs_and_the_mix_report_carries_it(made_up_tasks):
  study_only = [r for r in _step2() if r.method in (TIED, GRPO, S2_ASYNC)]
  assert step2.section(study_only) == [] and step2.claims(study_only) == []
  runs = _step2()
  for r in runs:  # what report_markdown's tables read besides the predictions' figures
    r.summary["config"].update(rl={"groups_per_step": 16, "group_size": 8}, task={"num_eval": 4},
                               eval={"samples_per_problem": N})
    r.summary["train_seconds"] = 5.0
  text = report_markdown(runs, study="mix", command="cmd", figures={})
  assert "## Step 2's registered predictions, checked" in text and "**S2-6. " in text
  assert "| OAPL (beta1 = 1, beta2 = 0.1) | 200 | 3 |" in text
  assert "| GRPO+IS (lr 3e-4) | 10 | 3 |" in text and "| async GRPO+TIS (lr 3e-4) | 10 | 3 |" in text


def test_step2_tables_each_method_by_lag(made_up_tasks):
  """The README's table: a row per method, a column per lag, last three / area over the seeds
  (a cell with fewer seeds says how many; a lag a method did not run: "-")."""
  runs = [r for r in _step2() if not (r.method == B1 and r.lag == 50 and r.seed > 0)]
  by = step2.by_run(runs)
  lines = step2._by_lag_table(by)
  assert "| method | L = 10 | L = 50 | L = 100 | L = 200 |" in lines
  row = {line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in lines if line.startswith("| ") and " ± " in line}
  b1_200 = [r for r in runs if (r.method, r.lag) == (B1, 200)]
  assert row[step2.NAMES[B1]][0] == "-" and row[step2.NAMES[B1]][1].endswith("(1 seed)")
  assert row[step2.NAMES[B1]][3].startswith(f"{np.mean([step2.last_evals_mean(r) for r in b1_200]):.3f} ± ")
  assert list(row) == [step2.NAMES[m] for m in step2.BY_LAG_METHODS]


def test_step2_tabulates_each_operation_through_the_first_window(made_up_tasks):
  """Per operation and method, pass@1 at each evaluation of the first window at L = 200 (steps
  0, 100, 200), mean over seeds; a method without runs at that lag has no row."""
  runs = [r for r in _step2({(TIED, 200): {"star": 0.25}}) if (r.method, r.lag) != (B1_LEN, 200)]
  lines = step2._first_window_table(step2.by_run(runs))
  assert "| operation | method | seeds | step 0 | step 100 | step 200 |" in lines
  star = [line for line in lines if line.startswith('| x a digit ("*") |')]
  assert star == [f'| x a digit ("*") | {step2.NAMES[m]} | 3 | 0.078 | {s} | 0.078 |'
                  for m, s in ((TIED, "0.250"), (B1, "0.500"), (S2_ASYNC, "0.094"), (GRPO_3E4, "0.094"))]
  plus = [line for line in lines if line.startswith("| + |")]
  assert len(plus) == 4 and all(line.endswith("| 0.078 | 0.156 | 0.078 |") for line in plus)
  assert not any(step2.NAMES[B1_LEN] in line for line in lines)
  assert step2._first_window_table(step2.by_run([r for r in runs if r.lag != 200])) == []


def test_step2_compares_a_cell_with_fewer_seeds_to_tied_on_the_same_seeds(made_up_tasks):
  runs = [r for r in _step2({(TIED, 200): {"last3": 0.9}}) if not (r.method == B1 and r.seed > 0)]
  runs = [r for r in runs if not (r.method == TIED and r.lag == 200 and r.seed == 0)]
  runs.append(_run2(TIED, 200, 0, last3=0.5, star=0.12))  # tied's seed 0 far lower than its others
  claims = {c.name.split(".")[0]: c for c in step2.claims(runs)}
  text = claims["S2-2"].parts[0].text
  assert "(seed 0: 0.820); tied 0.500 (0.500)" in text  # not tied's mean over its 3 seeds
  assert "(seed 0;" in claims["S2-3"].name


def test_the_committed_step2_report_is_what_the_committed_runs_give():
  """docs/mix_study/step2.md, step 2's report (`bash launch/mix_step2.sh` writes it), regenerates
  from the committed results alone: all 60 runs (the design's 57: the 18 at L = 200 and step 2's
  39; S2-7's 3) are in docs/mix_study/paired_check, and the verdicts and tables computed from
  them now are the committed report's, word for word."""
  import os
  docs = os.path.join(os.path.dirname(__file__), "..", "docs", "mix_study")
  runs = results.load_runs(None, results=os.path.join(docs, "paired_check"))
  cells = {(r.method, r.lag) for r in runs}
  assert len(runs) == 60 and len(cells) == 20 and all(len({r.seed for r in runs if (r.method, r.lag) == c}) == 3
                                                      for c in cells)
  section = "\n".join(step2.section(runs))
  with open(os.path.join(docs, "step2.md")) as f:
    assert section in f.read()
