"""The mixed-task study's registered predictions (oapl_jax/studies/predictions.py), checked on
runs made up in memory: each verdict follows the figures it reads, and flips when they do."""

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
