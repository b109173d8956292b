"""The reachable-targets experiment's figures and report (oapl_jax/studies/reachable.py) on runs
made up in memory, and its run list."""

import pytest

from oapl_jax.studies import reachable, results
from oapl_jax.studies.report import NOTES_BEGIN, NOTES_END


def _run(lag, curve, *, method="oapl_tied", seed=0, steps=200, reach=None):
  """A finished run of `steps` trainer steps evaluated every 50 steps: held-out pass@1 `curve`
  (before, at 50, 100, ..., after), 10 answers per step; `reach`: its per-step out-of-reach
  fraction."""
  evals = [{"step": 50 * i, "pass@1": p, "samples_generated": 500 * i} for i, p in enumerate(curve)]
  assert evals[-1]["step"] == steps
  summary = {"config": {"train": {"steps": steps, "lr": 1e-4}, "sampling": {"max_new_tokens": 54},
                        "rl": {"loss": "oapl", "beta1": 0.1, "beta2": 1e-3, "beta2_rule": "tied"}},
             "eval_before": {"pass@1": curve[0]}, "eval_after": {"pass@1": curve[-1]},
             "evals_during": evals[1:-1], "samples_generated": 10 * steps, "trainer_steps": steps}
  metrics = [{"step": t, "entropy": 0.5, **({"target_out_of_reach": reach} if reach is not None else {})}
             for t in range(1, steps + 1)]
  return results.RunResult(method, lag, seed, summary, metrics, wall_seconds=60.0, point="lr0.0001")


def test_a_window_falls_when_its_end_is_more_than_the_threshold_below_its_start():
  # L = 100 over 200 steps: windows [0, 100] and [100, 200]; the evaluation at 50 and 150
  # (inside a window) do not count
  r = _run(100, [0.1, 0.0, 0.5, 0.9, 0.47])
  assert reachable.window_falls(r) == (1, 2)  # 0.5 -> 0.47: fell by 0.03
  assert reachable.window_falls(_run(100, [0.1, 0.0, 0.5, 0.9, 0.49])) == (0, 2)  # by 0.01
  # L = 50: four windows, one fall (0.5 -> 0.3)
  assert reachable.window_falls(_run(50, [0.1, 0.5, 0.3, 0.6, 0.7])) == (1, 4)
  # L = 1 with evaluations every 50 steps: no window [k, k + 1] has both ends evaluated
  assert reachable.window_falls(_run(1, [0.1, 0.5, 0.3, 0.6, 0.7])) == (0, 0)


def test_last_evaluations_mean_and_area():
  r = _run(100, [0.0, 0.2, 0.4, 0.6, 0.8])
  assert reachable.last_evals_mean(r) == pytest.approx(0.6)
  # pass@1 rising linearly from 0 to 0.8 over the answers: the mean over them is 0.4
  assert reachable.pass1_area(r) == pytest.approx(0.4)
  assert reachable.pass1_area(_run(100, [0.0, 1.0, 1.0, 1.0, 1.0])) == pytest.approx(0.875)


def test_the_run_list_is_the_registered_grid_seed_by_seed():
  todo = reachable.runs(baseline=False)
  assert len(todo) == 2 * 3 * 2 * 3  # settings x lrs x lags x seeds
  with_baseline = reachable.runs()
  assert len(with_baseline) == len(todo) + 2 * 3  # a baseline run per lag and seed
  assert [r for r in with_baseline if r.method != reachable.BASELINE[0]] == todo
  assert with_baseline[4].method == reachable.BASELINE[0] and with_baseline[4].lag == 100
  assert {r.overrides["train.lr"] for r in with_baseline[:4]} == set(reachable.LRS[:2])
  assert [r.seed for r in todo] == sorted(r.seed for r in todo)  # a seed's runs before the next's
  first = todo[:2]
  assert {r.method for r in first} == set(reachable.SETTINGS) and {r.lag for r in first} == {100}
  assert all(r.overrides["eval.every"] == 50 and r.point == reachable.point(r.overrides["train.lr"])
             for r in todo)
  assert len({r.name for r in todo}) == len(todo)


def test_the_report_keeps_the_registered_prediction_and_refuses_without_one(tmp_path):
  report = tmp_path / "r.md"
  with pytest.raises(reachable.UserError, match="no registered prediction"):
    reachable.write_report(None, None, str(report), reference=str(tmp_path))
  report.write_text(f"{reachable.PREDICTION_BEGIN}\nIt will hold.\n{reachable.PREDICTION_END}\n"
                    f"{NOTES_BEGIN}\nmy notes\n{NOTES_END}\n")
  runs = [_run(100, [0.1, 0.0, 0.5, 0.9, 0.47], seed=s, reach=0.1 * s) for s in (0, 1)]
  text = reachable.report_markdown(runs, [], prediction="It will hold.", notes="my notes")
  assert "It will hold." in text and "my notes" in text
  assert reachable.kept_prediction(text) == "It will hold."
  assert "2 of 36 runs finished" in text
  line = next(x for x in text.splitlines() if x.startswith("| OAPL beta1=0.1 beta2=0.1 | 100 |"))
  assert "| 2 of 4 |" in line  # each seed's window [100, 200] fell
  assert "| 0.050 ± 0.071 |" in line  # the out-of-reach fractions 0 and 0.1
