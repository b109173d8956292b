"""The lag-study launcher, CI-sized: every method at two lags, its report and plots."""

import dataclasses
import json
import os
import shutil
import time

import numpy as np

import pytest

from oapl_jax.studies import definitions, lag_study, layout, results, runner, search, stats
from oapl_jax.studies.report import NOTES_BEGIN, NOTES_END, kept_notes, report_markdown


@pytest.fixture(scope="module")
def study(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("lag_study"))
  assert lag_study.main(["--out", out, "--reduced", "--lags", "1", "2", "--seeds", "0"]) == 0
  return out


def test_runs_every_method_and_lag_from_one_base(study):
  runs = results.load_runs(study)
  assert sorted((r.method, r.lag) for r in runs) == sorted(
      (m, l) for m in definitions.DEFAULT_METHODS for l in (1, 2))
  cache = [n for n in os.listdir(os.path.join(study, "base_models")) if not n.endswith(".lock")]
  # one warm-up for the seed, and its eval (beside them the lock its builder held)
  assert len(cache) == 2 and sum(".eval-" in name for name in cache) == 1
  befores = {str(r.summary["eval_before"]) for r in runs}
  assert len(befores) == 1  # every method starts from the same base and is evaluated the same way
  for r in runs:
    cfg = r.summary["config"]
    assert cfg["rl"]["lag"] == r.lag and cfg["seed"] == 0
    assert cfg["rl"]["loss"] == definitions.METHODS[r.method][1]["rl.loss"]
    assert r.summary["samples_generated"] == runs[0].summary["samples_generated"]  # equal budgets
    x, y = r.pass1_curve()
    assert x[0] == 0 and x[-1] == r.summary["samples_generated"] and len(x) == len(y) >= 3
  assert {r.summary["config"]["rl"]["beta2"] for r in runs if r.method == "oapl_paper_betas"} == {1e-3}


def test_report_has_table_plots_findings_and_keeps_notes(study):
  report = os.path.join(study, "report.md")
  lag_study.write_report(study, report, command="python -m oapl_jax.studies.lag_study --reduced")
  text = open(report).read()
  assert "python -m oapl_jax.studies.lag_study --reduced" in text
  for method in definitions.DEFAULT_METHODS:
    config = next(r.summary["config"] for r in results.load_runs(study) if r.method == method)
    assert text.count(f"| {definitions.method_label(method, config)} |") == 2  # one table row per lag
  assert "| GRPO+IS (token TIS, C=2, clip 0.2/0.28) |" in text  # the label says the run's settings
  for png in ("pass1_vs_samples.png", "pass1_vs_refreshes.png", "entropy_vs_step.png", "passk_before_after.png"):
    path = os.path.join(study, "report", png)
    with open(path, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert f"(report/{png})" in text
  assert "pass@k after >= before" in text and "entropy," in text and "pass@1 after, L=2" in text
  assert "no interval from one seed" in text  # the reduced study has one seed
  assert "* the paper's setting, OAPL at L=2 vs GRPO+IS at L=1 (per seed, OAPL - GRPO+IS): pass@1 " in text
  # a hand-written reading survives regeneration
  text = text.replace("_(no notes yet)_", "My reading.")
  open(report, "w").write(text)
  lag_study.write_report(study, report, command="again")
  assert "My reading." in open(report).read()


def test_the_report_says_how_many_of_the_launchers_seeds_are_done():
  runs = [_fake_run(m, lag, s) for m in ("oapl", "grpo_tis") for lag in (1, 3) for s in (0, 1, 2)]
  runs += [_fake_run("oapl", 1, 3), _fake_run("grpo_tis", 1, 3)]  # seed 3: 2 of its 4 runs
  text = report_markdown(runs, study="reason", command="cmd", figures={})
  assert ("**Seeds done: 3 of the 5 that `launch/reasoning_study.sh` runs** (0, 1, 2: a seed is done "
          "when it has all 4 (method, L) runs); in progress: seed 3 (2 of 4 runs)") in text
  text = report_markdown([r for r in runs if r.seed == 0], study="tiny", command="cmd", figures={})  # seed 0
  assert "**Seeds done: 1 of the 3 that `launch/lag_study.sh` runs** (0: " in text and "in progress" not in text
  # against the command's plan: a lag no seed has reached yet keeps every seed in progress, and a
  # run outside the plan neither counts nor blocks
  text = report_markdown(runs + [_fake_run("oapl_paper_betas", 1, 0)], study="reason", command="cmd",
                         figures={}, planned=(["oapl", "grpo_tis"], [1, 3, 5]))
  assert ("**Seeds done: 0 of the 5 that `launch/reasoning_study.sh` runs** (none: a seed is done when it has "
          "all 6 (method, L) runs); in progress: seed 0 (4 of 6 runs), seed 1 (4 of 6 runs)") in text
  assert "The launcher starts every method and lag of a seed" in text
  # runs of another launcher (step 2's stages go lag by lag): the header names it, not the study's,
  # and makes no claim about its order
  text = report_markdown(runs, study="mix", command="python -m oapl_jax.studies.lag_study --report-only",
                         figures={}, launcher="launch/mix_step2.sh")
  assert "; `bash launch/mix_step2.sh` runs the same):" in text and "mix_study.sh" not in text
  assert "**Seeds done: 3 of the 3 that `launch/mix_step2.sh` runs**" in text
  assert "The launcher starts" not in text


def test_a_launcher_that_is_not_there_is_refused(capsys):
  with pytest.raises(SystemExit) as e:
    lag_study._parse(["--study", "mix", "--out", "/tmp/x", "--launcher", "launch/mix_step3.sh"])
  assert e.value.code == 2 and "--launcher=launch/mix_step3.sh: no such file" in capsys.readouterr().err


def test_paired_interval_is_students_t_on_the_per_seed_differences():
  mean, lo, hi = stats.paired_interval([0.1, 0.2, 0.3])
  half = 4.302652729749464 * 0.1 / np.sqrt(3)  # t(0.975, 2 dof) x sd / sqrt(n)
  assert mean == pytest.approx(0.2) and (lo, hi) == pytest.approx((0.2 - half, 0.2 + half))
  assert stats.paired_interval([0.1, 0.2, 0.3], level=0.5)[2] - 0.2 < half / 4
  mean, lo, hi = stats.paired_interval([0.4])
  assert mean == 0.4 and np.isnan(lo) and np.isnan(hi)


def _fake_run(method, lag, seed):
  """A finished run in memory: 4 problems x 4 samples, evaluated before, at step 2 and after."""
  def ev(correct):
    return {"samples_per_problem": 4, "correct_per_problem": correct, "pass@1": sum(correct) / 16,
            "pass@4": sum(c > 0 for c in correct) / 4}
  summary = {"config": {"train": {"steps": 4, "lr": 1e-3}, "rl": {"groups_per_step": 2, "group_size": 4},
                        "task": {"num_eval": 4}, "eval": {"samples_per_problem": 4}},
             "eval_before": ev([0, 1, 2, 1]), "eval_after": ev([seed, 2, 3, lag % 5]),
             "evals_during": [{"step": 2, "pass@1": 0.3 + 0.1 * seed, "samples_generated": 16}],
             "samples_generated": 32, "trainer_steps": 4, "train_seconds": 5.0}
  metrics = [{"step": t, "samples_generated": 8 * t, "entropy": 1.0 - 0.1 * t - 0.01 * seed} for t in range(1, 5)]
  return results.RunResult(method, lag, seed, summary, metrics, wall_seconds=60.0)


def test_pass1_along_the_run_and_at_the_short_runs_length():
  from oapl_jax.studies import report
  runs = [_fake_run(m, lag, s) for m in ("oapl", "grpo_tis") for lag in (1, 3) for s in (0, 1)]
  assert stats.pass1_at_step(runs[0], 2) == 0.3 and stats.pass1_at_step(runs[0], 3) is None
  assert stats.pass1_at_step(runs[0], 4) == runs[0].summary["eval_after"]["pass@1"]
  assert stats.pass1_at_step(runs[0], 0) == runs[0].summary["eval_before"]["pass@1"]
  text = "\n".join(report._along_table(stats.summarise(runs), runs, (2, 3, 4)))  # no run evaluated at step 3: left out
  assert "| method | L | step 2 (16 answers) | step 4 (32 answers) |" in text and "step 3" not in text
  assert "| OAPL (beta1=1, beta2=0.1) | 1 | 0.350 ± 0.071 | 0.406 ± 0.044 |" in text  # seeds 0, 1
  assert report._along_table(stats.summarise(runs), runs, (3,)) == []
  runs[-1].summary["evals_during"] = []  # one run (GRPO+IS, L = 3, seed 1) not evaluated at step 2
  assert "step 2" not in "\n".join(report._along_table(stats.summarise(runs), runs, (2, 4)))
  runs[-1] = _fake_run("grpo_tis", 3, 1)
  reference = {"label": "short runs", "about": "Before.", "steps": 2,
               "pass1_after": {"oapl": {"1": [0.5, 0.1], "3": [0.4, 0.2]}}}
  text = report_markdown(runs, study="tiny", command="cmd", figures={}, reference=reference)
  assert "| OAPL | short runs | 0.500 ± 0.100 | 0.400 ± 0.200 |" in text
  assert "| OAPL | this study at step 2 | 0.350 ± 0.071 (2 seeds) | 0.350 ± 0.071 (2 seeds) |" in text
  assert "| OAPL | this study | 0.406 ± 0.044 (2 seeds) | 0.531 ± 0.044 (2 seeds) |" in text
  del reference["steps"]  # an earlier study of unknown length: its row and this study's end only
  assert "this study at step" not in report_markdown(runs, study="tiny", command="cmd", figures={},
                                                     reference=reference)


def test_report_markdown_is_a_pure_function_of_its_arguments(monkeypatch):
  import copy
  import scipy.stats  # noqa: F401  (imported before open() is taken away)
  runs = [_fake_run(m, lag, s) for m in ("oapl", "grpo_tis") for lag in (1, 3) for s in (1, 2)]
  kept = copy.deepcopy(runs)
  figures = {"pass1": "r/a.png", "entropy": "r/b.png", "passk": "r/c.png"}

  def no_files(*args, **kwargs):
    raise AssertionError("report_markdown opened a file")
  monkeypatch.setattr("builtins.open", no_files)
  text = report_markdown(runs, study="tiny", command="cmd", figures=figures, notes="Mine.")
  assert text == report_markdown(runs, study="tiny", command="cmd", figures=figures, notes="Mine.")
  assert runs == kept  # the results are not touched
  assert "    cmd\n" in text and "![pass@1 vs generated answers](r/a.png)" in text
  assert "Settings search" not in text and "* pass@1 after, L=3:" in text
  # 8 runs x 5 s of training and x 60 s of wall time
  assert " Summed over the runs: 1 min of training, 8 min of wall time with warm-ups" in text
  assert f"{NOTES_BEGIN}\nMine.\n{NOTES_END}\n" in text and kept_notes(text) == "Mine."


def test_finished_runs_are_skipped(study, capsys):
  runner.run_study(study, methods=("oapl",), lags=(1,), seeds=(0,), reduced=True)
  assert "done already" in capsys.readouterr().out


def test_bad_arguments_are_refused():
  with pytest.raises(ValueError, match="unknown method"):
    definitions.study_config("ppo", 1, 0)
  with pytest.raises(SystemExit):
    lag_study.main(["--out", "/tmp/x", "--lags", "0"])


# --- the reasoning study (configs/reason.py): budgeted pieces, maj@k and diversity, the lr sweep --


@pytest.fixture(scope="module")
def reason_study(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("reason_study"))
  args = ["--study", "reason", "--out", out, "--reduced", "--methods", "oapl", "grpo_tis",
          "--lags", "2", "--seeds", "0"]
  # a piece with no budget left stops before its first run, saying more is left
  assert lag_study.main(args + ["--budget-minutes", "0"]) == 3
  assert not results.load_runs(out)
  assert lag_study.main(args) == 0
  return out


def test_reason_study_runs_the_chain_task_and_measures_votes_and_diversity(reason_study):
  runs = results.load_runs(reason_study)
  assert sorted(r.method for r in runs) == ["grpo_tis", "oapl"]
  for r in runs:
    cfg = r.summary["config"]
    assert cfg["task"]["name"] == "chain_addition" and cfg["seed"] == 0 and cfg["rl"]["lag"] == 2
    for when in ("before", "after"):
      e = r.summary[f"eval_{when}"]
      n = e["samples_per_problem"]
      assert {f"pass@{n}", f"maj@{n}", "distinct_answers", "distinct_correct_chains",
              "entropy_per_token"} <= set(e)
      # the run's summary.json keeps the per-answer list; the results read back leave it out
      raw = json.load(open(os.path.join(layout.run_dir(reason_study, r.method, 2, 0), "summary.json")))
      assert np.array(raw[f"eval_{when}"]["answer_ids"]).shape == (e["num_problems"], n)
      assert "answer_ids" not in e and e["correct_per_problem"] == raw[f"eval_{when}"]["correct_per_problem"]
      assert e["entropy_per_token"] > 0 and e["mean_answer_tokens"] > 4
    # evaluations during the run are logged without their per-answer lists (metrics.jsonl too)
    assert r.summary["evals_during"] and all("answer_ids" not in e and "maj@1" in e
                                             for e in r.summary["evals_during"])
  assert runs[0].summary["samples_generated"] == runs[1].summary["samples_generated"]
  report = os.path.join(reason_study, "report.md")
  lag_study.write_report(reason_study, report, command="cmd", study="reason")
  text = open(report).read()
  assert text.startswith("# Reasoning study") and "configs/reason.py" in text
  assert "maj@8" in text and "distinct_correct_chains" in text and "* sample efficiency, L=2" in text


def _fake_committed(template: dict, results_dir: str, kind: str, name: str, pass1: float) -> None:
  """A committed result `name` made from a real run's compact result, its final pass@1 set."""
  import copy
  r = copy.deepcopy(template)
  r["summary"]["eval_after"]["pass@1"] = pass1
  path = layout.result_path(results_dir, kind, name)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  json.dump(r, open(path, "w"))


def test_sweep_picks_each_methods_best_lr_and_the_study_uses_it(reason_study, tmp_path, capsys):
  # committed search results count as finished and are read, not rerun: three lrs per method
  # with known pass@1
  template = next(iter(results.load_compact(reason_study).values()))
  committed = str(tmp_path / "results")
  scores = {"oapl": {1e-4: 0.2, 3e-4: 0.5, 1e-3: 0.5}, "grpo_tis": {1e-4: 0.4, 3e-4: 0.1, 1e-3: 0.3}}
  for method, table in scores.items():
    for lr, p1 in table.items():
      _fake_committed(template, committed, "sweep", layout.run_name(method, 2, 7, f"lr{lr:g}"), p1)
  chosen = runner.sweep(reason_study, methods=("oapl", "grpo_tis"), lrs=(1e-4, 3e-4, 1e-3),
                        lag=2, seed=7, results=committed)
  assert capsys.readouterr().out.count("done already") == 6
  assert chosen == {"oapl": 3e-4, "grpo_tis": 1e-4}  # ties: the lr listed first
  assert json.load(open(os.path.join(reason_study, "sweep", "chosen.json")))["chosen"] == {
      m: {"train.lr": lr} for m, lr in chosen.items()}
  c = definitions.study_config("oapl", 2, 0, study="reason", overrides={"train.lr": chosen["oapl"]})
  assert c.train.lr == 3e-4 and c.task.name == "chain_addition"
  lag_study.write_report(reason_study, os.path.join(reason_study, "r2.md"), command="c", study="reason",
                         results=committed)
  text = open(os.path.join(reason_study, "r2.md")).read()
  assert "## Settings search" in text and "| L=2, lr 0.0001 | L=2, lr 0.0003 | L=2, lr 0.001 |" in text
  assert "| lr only | 0.200 | **0.500** | 0.500 |" in text and "OAPL 3 of 3, GRPO+IS 3 of 3" in text


def test_sweep_seed_must_differ_from_the_study_seeds():
  with pytest.raises(SystemExit):
    lag_study.main(["--out", "/tmp/x", "--seeds", "0", "--sweep-lrs", "1e-3", "--sweep-seed", "0"])
  with pytest.raises(ValueError, match="unknown study"):
    definitions.study_config("oapl", 1, 0, study="nope")


def test_a_signal_ends_the_command_with_one_line(tmp_path, monkeypatch, capsys):
  """A run stopped by SIGTERM (its checkpoint saved) ends the study command with one line on
  stderr and exit code 128 + 15, not a traceback; the same command resumes."""
  from oapl_jax.workdir import Interrupted

  def stopped(*args, **kwargs):
    raise Interrupted(15, "stopped by SIGTERM at step 7: checkpoint saved in X; run the same command again to resume")
  monkeypatch.setattr(lag_study, "run_study", stopped)
  assert lag_study.main(["--out", str(tmp_path), "--reduced", "--lags", "1", "--seeds", "0"]) == 143
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith("error: stopped by SIGTERM at step 7")


def test_a_sitting_stopped_by_a_signal_counts_in_the_runs_wall_time(tmp_path, monkeypatch):
  """A run stopped by SIGTERM (checkpoint saved, `Interrupted`) and resumed later: its study wall
  time is the sum of both sittings, not only the one that finished it."""
  import oapl_jax.train
  from oapl_jax.workdir import Interrupted
  sittings = []

  def fake_run(config, workdir):
    sittings.append(workdir)
    os.makedirs(workdir, exist_ok=True)
    time.sleep(0.2)
    if len(sittings) == 1:
      raise Interrupted(15, "stopped by SIGTERM at step 7")
    return {"eval_before": {"pass@1": 0.1}, "eval_after": {"pass@1": 0.2}}
  monkeypatch.setattr(oapl_jax.train, "run", fake_run)
  out = str(tmp_path / "out")
  kwargs = dict(methods=("oapl",), lags=(1,), seeds=(0,), reduced=True, echo=lambda line: None)
  with pytest.raises(Interrupted):
    runner.run_study(out, **kwargs)
  wall_path = os.path.join(layout.run_dir(out, "oapl", 1, 0), layout.WALL_SECONDS)
  with open(wall_path) as f:
    first = json.load(f)
  runner.run_study(out, **kwargs)  # the second sitting finishes the run
  with open(wall_path) as f:
    total = json.load(f)
  assert len(sittings) == 2 and 0.2 <= first < total and total >= 0.4


def test_report_only_without_finished_runs_is_one_line(tmp_path, capsys):
  assert lag_study.main(["--out", str(tmp_path), "--report-only"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "no finished runs under" in err


# --- issue 30: the joint search, committed results, refreshes ------------------------------------


def test_the_joint_search_gives_both_methods_the_same_runs_current_settings_first():
  grid = search.study_grid(["oapl", "grpo_tis"])
  assert {m: len(search.points(axes)) for m, axes in grid.items()} == {"oapl": 18, "grpo_tis": 18}
  oapl = [search.overrides(grid["oapl"], idx) for idx in search.points(grid["oapl"])]
  assert {(o["rl.beta1"], o["rl.beta2"]) for o in oapl} == {(b1, b2) for b1 in (1.0, 5.0) for b2 in (0.1, 1e-2, 1e-3)}
  assert {o["train.lr"] for o in oapl} == {1e-4, 3e-4, 1e-3}
  grpo = [search.overrides(grid["grpo_tis"], idx) for idx in search.points(grid["grpo_tis"])]
  assert len({(o["rl.grpo.eps_low"], o["rl.grpo.eps_high"], o["train.lr"]) for o in grpo}) == 18
  order = search.run_order(grid, search.SEARCH_LAGS)
  assert len(order) == 72 and len(set(order)) == 72
  # first: OAPL's beta2 sweep at L = 100 at the current beta1 and lr, GRPO+IS's current setting between
  first = [(lag, m, search.overrides(grid[m], idx)) for lag, m, idx in order[:6]]
  assert [f[0] for f in first] == [100] * 6 and [f[1] for f in first[::2]] == ["oapl"] * 3
  assert [f[2]["rl.beta2"] for f in first[::2]] == [0.1, 1e-2, 1e-3]
  assert all(f[2]["rl.beta1"] == 1.0 and f[2]["train.lr"] == 3e-4 for f in first[::2])
  assert first[1][2] == {"rl.grpo.eps_low": 0.2, "rl.grpo.eps_high": 0.28, "train.lr": 1e-3}
  assert {lag for lag, _, _ in order[36:]} == {50}
  # a point's run name is unique and parses back
  names = {layout.run_name(m, lag, 100, search.label(grid[m], idx)) for lag, m, idx in order}
  assert len(names) == 72
  assert layout.parse_run_name("grpo_tis_lag100_seed100_clip-0.2_lr-0.001") == ("grpo_tis", 100, 100, "clip-0.2_lr-0.001")
  with pytest.raises(ValueError, match="no search grid"):
    search.study_grid(["oapl_paper_betas"])


def test_the_second_lag_runs_only_the_top_k_at_the_first_chosen_among_them():
  axes = (search.Axis("b2", ("rl.beta2",), ((0.1,), (0.01,), (1e-3,))), search.lr_axis((3e-4, 1e-3)))
  grid = {"oapl": axes, "grpo_tis": (search.lr_axis((1e-3, 1e-4, 3e-4)),)}
  pts, gpts, lags = search.points(axes), search.points(grid["grpo_tis"]), (100, 50)
  assert search.planned_runs(axes, lags, 2) == 6 + 2 and search.planned_runs(axes, lags, None) == 12
  assert search.planned_runs(grid["grpo_tis"], lags, 5) == 6  # fewer points than k: all of them
  # the second lag's runs are not known until every first-lag score is in
  scores = {("oapl", 100, p): 0.5 for p in pts} | {("grpo_tis", 100, p): 0.5 for p in gpts[:2]}
  assert search.screened(grid, lags, scores, 2) is None
  first = search.run_order(grid, lags, scores, 2)
  assert [x[0] for x in first] == [100] * 9 and first[:2] == [(100, "oapl", pts[0]), (100, "grpo_tis", gpts[0])]
  assert search.choose(grid, lags, scores, 2) is None
  scores[("grpo_tis", 100, gpts[2])] = 0.7
  scores[("oapl", 100, pts[4])], scores[("oapl", 100, pts[5])] = 0.8, 0.9
  # top 2 by score, best first; ties by run order (gpts[0] before gpts[1] at 0.5)
  assert search.screened(grid, lags, scores, 2) == {"oapl": [pts[5], pts[4]], "grpo_tis": [gpts[2], gpts[0]]}
  order = search.run_order(grid, lags, scores, 2)
  assert order[:9] == first and order[9:] == [(50, "oapl", pts[5]), (50, "grpo_tis", gpts[2]),
                                              (50, "oapl", pts[4]), (50, "grpo_tis", gpts[0])]
  assert search.run_order(grid, lags, scores) == search.run_order(grid, lags)  # no k: every point
  assert len(search.run_order(grid, lags)) == 18
  # the choice: the best mean over both lags among the screened points only
  scores[("oapl", 50, pts[5])], scores[("oapl", 50, pts[4])] = 0.1, 0.6  # means 0.5 and 0.7
  scores[("grpo_tis", 50, gpts[2])] = 0.3
  assert search.choose(grid, lags, scores, 2) is None  # a screened point's L = 50 run missing
  scores[("grpo_tis", 50, gpts[0])] = 0.3  # means 0.5 (gpts[2]) and 0.4 (gpts[0])
  scores[("oapl", 50, pts[0])] = 1.0  # a screened-out point (run anyway): not a candidate
  assert search.choose(grid, lags, scores, 2) == {"oapl": pts[4], "grpo_tis": gpts[2]}
  scores[("oapl", 50, pts[5])] = 0.5  # both means 0.7: the point that runs first (pts[4])
  assert search.choose(grid, lags, scores, 2) == {"oapl": pts[4], "grpo_tis": gpts[2]}
  plan = search.plan_json(grid, lags, 100, 2)
  assert search.plan_top_k(json.loads(json.dumps(plan))) == 2
  assert search.plan_top_k({k: v for k, v in plan.items() if k != "screen_top_k"}) is None


def test_the_joint_search_screens_to_48_runs_the_same_for_both_methods():
  grid = search.study_grid(["oapl", "grpo_tis"])
  k, lags = search.SCREEN_TOP_K, search.SEARCH_LAGS
  assert k == 6 and lags == (100, 50)
  assert {m: search.planned_runs(axes, lags, k) for m, axes in grid.items()} == {"oapl": 24, "grpo_tis": 24}
  scores = {(m, 100, p): 0.5 for m, axes in grid.items() for p in search.points(axes)}
  order = search.run_order(grid, lags, scores, k)
  assert len(order) == 48 and [x[0] for x in order] == [100] * 36 + [50] * 12
  assert order[36:] == [(50, m, p) for pair in zip(*(search.points(grid[m])[:6] for m in grid))
                        for m, p in zip(grid, pair)]  # all tied: the first 6 in run order
  # the committed runs keep their names (they count as finished): any setting at either lag (the
  # L = 50 ones are those the real L = 100 scores screen in, not this tied order's)
  names = {layout.run_name(m, lag, 100, search.label(grid[m], p))
           for m in grid for p in search.points(grid[m]) for lag in lags}
  committed = os.listdir("docs/reasoning_study/results/sweep")
  assert all(n[:-len(".json")] in names for n in committed if n != "search.json") and len(committed) >= 6


def test_choose_waits_for_every_run_and_averages_over_the_lags():
  axes = (search.Axis("b2", ("rl.beta2",), ((0.1,), (0.01,))), search.lr_axis((3e-4, 1e-3)))
  grid, pts = {"oapl": axes}, search.points(axes)
  scores = {("oapl", lag, p): 0.5 for p in pts for lag in (100, 50)}
  assert search.choose(grid, (100, 50), scores) == {"oapl": pts[0]}  # ties: the first point
  scores[("oapl", 100, pts[3])] = 0.9  # best at L = 100 only ...
  scores[("oapl", 50, pts[3])] = 0.2  # ... so its mean (0.55) beats 0.5
  scores[("oapl", 100, pts[2])], scores[("oapl", 50, pts[2])] = 0.6, 0.6  # mean 0.6: the best
  assert search.choose(grid, (100, 50), scores) == {"oapl": pts[2]}
  del scores[("oapl", 50, pts[1])]
  assert search.choose(grid, (100, 50), scores) is None  # a run missing: nothing chosen yet
  plan = search.plan_json(grid, (100, 50), 100)
  assert search.grid_from_plan(json.loads(json.dumps(plan))) == grid


def test_study_and_search_runs_have_the_issues_lengths():
  c = definitions.study_config("oapl", 100, 0, study="reason")
  assert c.train.steps == 1000 and c.train.steps // c.rl.lag == 10  # 10 refreshes at L = 100
  assert definitions.study_config("grpo_tis", 1, 0, study="reason").train.steps == 1000  # same answers
  s = definitions.study_config("oapl", 100, 100, study="reason", search=True,
                               overrides={"rl.beta2": 1e-3})
  assert s.train.steps == 1000 and s.eval.samples_per_problem == 64 and s.rl.beta2 == 1e-3
  assert c.eval.samples_per_problem == 256


def test_committed_results_are_small_count_as_finished_and_report_the_same(reason_study, tmp_path, capsys):
  committed = str(tmp_path / "results")
  assert lag_study.main(["--out", reason_study, "--results", committed, "--save-results"]) == 0
  written = results.save_results(reason_study, committed)  # again: the same files, rewritten
  assert f"{len(written)} results written into {committed}" in capsys.readouterr().out
  assert any("/runs/" in p for p in written)
  for p in written:
    assert os.path.getsize(p) < 20_000
    text = open(p).read()
    if "/runs/" in p:
      assert "answer_ids" not in text
    # the runs' folder (the base models' cache in each config) is named by a token, not a path
    assert os.path.abspath(reason_study) not in text, p
  assert any(results.OUT_TOKEN in open(p).read() for p in written if "/runs/" in p)
  # a fresh folder with the committed results: nothing reruns, the runs read back the same
  fresh = str(tmp_path / "fresh")
  runner.run_study(fresh, methods=("oapl", "grpo_tis"), lags=(2,), seeds=(0,), reduced=True,
                   study="reason", results=committed)
  assert capsys.readouterr().out.count("done already") == 2 and not os.path.isdir(os.path.join(fresh, "runs"))
  from_out = results.load_runs(reason_study)
  from_committed = results.load_runs(fresh, results=committed)
  assert [(r.method, r.lag, r.seed) for r in from_out] == [(r.method, r.lag, r.seed) for r in from_committed]
  assert [results.without_folder(r.summary, reason_study) for r in from_out] == [r.summary for r in from_committed]
  assert [r.metrics for r in from_out] == [r.metrics for r in from_committed]
  a, b = os.path.join(reason_study, "a.md"), os.path.join(fresh, "b.md")
  lag_study.write_report(reason_study, a, command="c", study="reason")
  lag_study.write_report(fresh, b, command="c", study="reason", results=committed)
  assert open(a).read().replace("(a/", "(b/") == open(b).read()


def test_saving_into_a_results_folder_whose_link_leads_nowhere_is_one_line(reason_study, tmp_path, capsys):
  """A results folder copied without what its `runs` (or `sweep`) link names: one line naming
  the link, exit 2, nothing written (it was a FileExistsError traceback)."""
  committed = tmp_path / "copied"
  committed.mkdir()
  os.symlink("../elsewhere/runs", committed / "runs")
  assert lag_study.main(["--out", reason_study, "--results", str(committed), "--save-results"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and f"{committed / 'runs'} is a link to ../elsewhere/runs, which does not exist" in err[0], err
  assert os.listdir(committed) == ["runs"]


def test_pass1_against_refreshes_counts_the_engine_refreshes():
  r = _fake_run("oapl", 2, 1)
  x, _ = r.eval_curve("pass@1", "refreshes")
  assert list(x) == [0, 1, 2]  # before, step 2 (one refresh at L = 2), after step 4
  x, _ = r.eval_curve("pass@1", "samples")
  assert list(x) == [0, 16, 32]


def test_search_flags_are_checked(capsys):
  for argv, why in ((["--search", "--sweep-lrs", "1e-3"], "give one"),
                    (["--search", "--methods", "oapl_paper_betas"], "no search grid"),
                    (["--save-results"], "needs --results"),
                    (["--search", "--seeds", "100"], "separate seed")):
    with pytest.raises(SystemExit) as e:
      lag_study.main(["--out", "/tmp/x"] + argv)
    assert e.value.code == 2 and why in capsys.readouterr().err


def test_a_report_of_the_search_alone_shows_its_whole_grid(tmp_path):
  grid = search.study_grid(["oapl", "grpo_tis"])
  plan = search.plan_json(grid, search.SEARCH_LAGS, 100, search.SCREEN_TOP_K)
  first = search.points(grid["oapl"])[0]
  text = report_markdown([], study="reason", command="cmd", figures={},
                         search={"plan": plan, "scores": {("oapl", 100, first): 0.42}},
                         reference=json.load(open("docs/reasoning_study/results/reference.json")))
  assert "No study run has finished yet." in text and "OAPL 1 of 24, GRPO+IS 0 of 24" in text
  assert "**Partial: the settings search has finished 1 of its 48 runs" in text
  assert "| beta2=0.1, beta1=1 | 0.420 | — | — |" in text  # L=100 lr 3e-4 first, then the others
  assert text.count("| beta2=") == 6 and text.count("| eps_low=") == 6  # every setting has a row
  assert "not yet (23 of its 24 runs left)" in text and "| OAPL | short runs, lr-only search | 0.956 ± 0.048 |" in text
  assert "at L = 50 only each method's 6 best by their final pass@1 at L = 100 run" in text
  # L = 100 unfinished: the L = 50 runs are not known yet, so no cell is screened out
  assert not any("screened out" in line for line in text.splitlines() if line.startswith("| "))
  assert "## Plots" not in text and "paper's findings" not in text
  # a plan written before the screening existed (no screen_top_k): every point at every lag
  old = {k: v for k, v in plan.items() if k != "screen_top_k"}
  text = report_markdown([], study="reason", command="cmd", figures={},
                         search={"plan": old, "scores": {("oapl", 100, first): 0.42}})
  assert "finished 1 of its 72 runs" in text and "Screening" not in text


def _table(text, setting):
  """The cells of the search table's row of `setting` ("beta2=0.1, beta1=1")."""
  row = next(line for line in text.splitlines() if line.startswith(f"| {setting} |"))
  return [c.strip() for c in row.strip("|").split("|")[1:]]


def test_the_report_marks_the_screened_out_cells_and_bolds_the_choice_among_the_screened():
  grid = search.study_grid(["oapl", "grpo_tis"])
  plan = search.plan_json(grid, search.SEARCH_LAGS, 100, search.SCREEN_TOP_K)
  scores = {}
  for m, axes in grid.items():
    for i, p in enumerate(search.points(axes)):
      scores[(m, 100, p)] = round(1 - i / 100, 2)  # the first 6 in run order are the top 6
  kept = search.screened(grid, search.SEARCH_LAGS, scores, search.SCREEN_TOP_K)
  text = report_markdown([], study="reason", command="cmd", figures={}, search={"plan": plan, "scores": scores})
  assert "finished 36 of its 48 runs" in text and "OAPL 18 of 24, GRPO+IS 18 of 24" in text
  # OAPL's beta1 = 1 row: lr 3e-4, 1e-4, 1e-3 at L = 100, then at L = 50; its lr-3e-4 point is
  # 1st in run order (kept), its lr-1e-4 point 7th (screened out)
  assert _table(text, "beta2=0.1, beta1=1") == ["1.000", "0.940", "0.880", "—", "screened out", "screened out"]
  assert sum(line.count("screened out") for line in text.splitlines() if line.startswith("| ")) == 2 * 12
  for m in grid:  # the L = 50 runs of the screened points finish: the choice is among them
    for j, p in enumerate(kept[m]):
      scores[(m, 50, p)] = 0.9 if j == 3 else 0.1
  text = report_markdown([], study="reason", command="cmd", figures={}, search={"plan": plan, "scores": scores})
  assert "Partial" not in text and "OAPL 24 of 24, GRPO+IS 24 of 24" in text
  assert "**0.970**" in text and "**0.900**" in text  # kept[3] (4th in run order): 0.97 at L=100, 0.9 at L=50
  assert f"* chosen, OAPL: {search.describe(grid['oapl'], kept['oapl'][3])}." in text


def _recording_run(template: dict, seen: list, pass1: float | None = None):
  """A stand-in for train.run: records (config, workdir) in `seen` (the config alone when no
  pass1 is given) and writes the summary a run would (`template`'s; its final pass@1 set)."""
  import copy

  def fake_run(config, workdir):
    seen.append(config if pass1 is None else (config, workdir))
    summary = copy.deepcopy(template["summary"])
    if pass1 is not None:
      summary["eval_after"]["pass@1"] = pass1
    os.makedirs(workdir, exist_ok=True)
    json.dump(summary, open(os.path.join(workdir, "summary.json"), "w"))
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
      for step in range(1, summary["trainer_steps"] + 1):
        f.write(json.dumps({"step": step, "samples_generated": 16 * step, "entropy": 1.0}) + "\n")
    return summary
  return fake_run


def test_the_search_command_uses_its_chosen_settings_for_the_study_runs(reason_study, tmp_path, monkeypatch, capsys):
  """The whole --search path with every search run committed (one setting of each method made
  the best): the study's runs get the chosen settings."""
  import oapl_jax.train
  template = next(iter(results.load_compact(reason_study).values()))
  committed = str(tmp_path / "results")
  grid = search.study_grid(["oapl", "grpo_tis"])
  best = {"oapl": {"rl.beta1": 5.0, "rl.beta2": 1e-2, "train.lr": 1e-4},
          "grpo_tis": {"rl.grpo.eps_low": 0.4, "rl.grpo.eps_high": 0.56, "train.lr": 3e-4}}
  for lag, m, idx in search.run_order(grid, (2,)):
    p1 = 0.9 if search.overrides(grid[m], idx) == best[m] else 0.3
    _fake_committed(template, committed, "sweep", layout.run_name(m, lag, 100, search.label(grid[m], idx)), p1)
  seen = []
  monkeypatch.setattr(oapl_jax.train, "run", _recording_run(template, seen))
  out = str(tmp_path / "out")
  assert lag_study.main(["--study", "reason", "--out", out, "--reduced", "--search", "--sweep-lags", "2",
                         "--methods", "oapl", "grpo_tis", "--lags", "2", "--seeds", "0",
                         "--results", committed]) == 0
  assert capsys.readouterr().out.count("done already") == 36
  by = {c.rl.loss: c for c in seen}
  assert len(seen) == 2 and (by["oapl"].rl.beta1, by["oapl"].rl.beta2, by["oapl"].train.lr) == (5.0, 1e-2, 1e-4)
  assert (by["grpo"].rl.grpo.eps_low, by["grpo"].rl.grpo.eps_high, by["grpo"].train.lr) == (0.4, 0.56, 3e-4)
  text = open(os.path.join(out, "lag_study.md")).read()
  assert "* chosen, OAPL: beta2=0.01, beta1=5, lr=0.0001." in text and "OAPL 18 of 18" in text
  assert "Partial" not in text


def _committed_search(template: dict, committed: str, best: dict) -> None:
  """Every search run of OAPL and GRPO+IS at L = 2 committed under `committed`, the setting
  `best` with final pass@1 0.9 and the others 0.3."""
  grid = search.study_grid(["oapl", "grpo_tis"])
  for lag, m, idx in search.run_order(grid, (2,)):
    p1 = 0.9 if search.overrides(grid[m], idx) == best else 0.3
    _fake_committed(template, committed, "sweep", layout.run_name(m, lag, 100, search.label(grid[m], idx)), p1)


def test_an_edge_check_runs_the_choice_moved_past_its_grid_after_the_study_and_is_reported_beside_it(
    reason_study, tmp_path, monkeypatch, capsys):
  """--beyond oapl:lr=0.003: after the study's runs, OAPL's chosen setting with lr 3e-3 (outside
  its grid) on the search's seed and lags, named as a grid point would be; the report shows it
  beside the choice, which stays."""
  import oapl_jax.train
  template = next(iter(results.load_compact(reason_study).values()))
  committed = str(tmp_path / "results")
  _committed_search(template, committed, {"rl.beta1": 5.0, "rl.beta2": 1e-2, "train.lr": 1e-4})
  seen = []
  monkeypatch.setattr(oapl_jax.train, "run", _recording_run(template, seen, pass1=0.95))
  out = str(tmp_path / "out")
  argv = ["--study", "reason", "--out", out, "--reduced", "--search", "--sweep-lags", "2", "--methods", "oapl",
          "grpo_tis", "--lags", "2", "--seeds", "0", "--results", committed, "--beyond", "oapl:lr=0.003"]
  assert lag_study.main(argv) == 0
  names = [os.path.basename(d) for _, d in seen]
  assert names == ["oapl_lag2_seed0", "grpo_tis_lag2_seed0", "oapl_lag2_seed100_b2-0.01_b1-5_lr-0.003"]
  check = seen[-1][0]
  assert (check.seed, check.rl.lag, check.rl.beta1, check.rl.beta2, check.train.lr) == (100, 2, 5.0, 1e-2, 3e-3)
  study_oapl = seen[0][0]  # the study keeps the search's choice
  assert (study_oapl.rl.beta1, study_oapl.rl.beta2, study_oapl.train.lr) == (5.0, 1e-2, 1e-4)
  text = open(os.path.join(out, "lag_study.md")).read()
  assert "* chosen, OAPL: beta2=0.01, beta1=5, lr=0.0001." in text
  assert "| OAPL | b2=0.01, b1=5, lr=0.003 | 0.950 | 0.950 | 0.900 |" in text
  assert text.count("| OAPL | b2=") == 1  # the edge check's row alone, not the grid's points
  capsys.readouterr()
  assert lag_study.main(argv) == 0 and len(seen) == 3  # made once
  assert capsys.readouterr().out.count("done already") == 36 + 2 + 1


def test_edge_checks_are_made_while_the_study_runs_left_are_another_process_s(reason_study, tmp_path, monkeypatch,
                                                                               capsys):
  """A process whose study runs left are all held by the other process (two halves share a study)
  makes the edge checks, which need the search only, then ends with exit code 4."""
  import oapl_jax.train
  from oapl_jax.workdir import WorkdirBusy
  template = next(iter(results.load_compact(reason_study).values()))
  committed = str(tmp_path / "results")
  _committed_search(template, committed, {"rl.beta1": 5.0, "rl.beta2": 1e-2, "train.lr": 1e-4})
  seen = []
  record = _recording_run(template, seen, pass1=0.95)

  def run(config, workdir):
    if config.seed == 0:  # every study run is the other process's
      raise WorkdirBusy(f"workdir lock {workdir}/run.lock is held by process 1")
    return record(config, workdir)
  monkeypatch.setattr(oapl_jax.train, "run", run)
  argv = ["--study", "reason", "--out", str(tmp_path / "out"), "--reduced", "--search", "--sweep-lags", "2",
          "--methods", "oapl", "--lags", "2", "--seeds", "0", "--results", committed, "--beyond", "oapl:lr=0.003"]
  assert lag_study.main(argv) == 4
  assert [os.path.basename(d) for _, d in seen] == ["oapl_lag2_seed100_b2-0.01_b1-5_lr-0.003"]
  assert "1 runs are being made by another process (oapl_lag2_seed0)" in capsys.readouterr().out


def test_bad_edge_checks_are_refused_with_one_line(capsys):
  base = ["--out", "/tmp/x", "--study", "reason", "--methods", "oapl", "grpo_tis"]
  for argv, why in ((["--beyond", "oapl:lr=0.003"], "no search of 'oapl'"),
                    (["--search", "--beyond", "oapl:gamma=2"], "no axis 'gamma'"),
                    (["--search", "--beyond", "grpo_tis:clip=0.9"], "moves 2 settings together"),
                    (["--search", "--beyond", "oapl:lr=0.001"], "already in the grid"),
                    (["--search", "--beyond", "oapl:lr=big"], "expected METHOD:AXIS=VALUE")):
    with pytest.raises(SystemExit) as e:
      lag_study.main(base + argv)
    assert e.value.code == 2 and why in capsys.readouterr().err


def test_two_processes_share_the_runs_a_busy_one_is_skipped_and_exit_code_4_says_so(reason_study, tmp_path, monkeypatch, capsys):
  """A run whose workdir another process holds (WorkdirBusy) is skipped, the others are made, and
  the command ends with exit code 4 and says which runs are left to the other process."""
  import oapl_jax.train
  from oapl_jax.workdir import WorkdirBusy
  template = next(iter(results.load_compact(reason_study).values()))
  made = []

  def fake_run(config, workdir):
    if config.rl.loss == "oapl":
      raise WorkdirBusy(f"workdir lock {workdir}/run.lock is held by process 1")
    made.append(workdir)
    os.makedirs(workdir, exist_ok=True)
    json.dump(template["summary"], open(os.path.join(workdir, "summary.json"), "w"))
    return template["summary"]
  monkeypatch.setattr(oapl_jax.train, "run", fake_run)
  out = str(tmp_path / "out")
  argv = ["--study", "reason", "--out", out, "--reduced", "--methods", "oapl", "grpo_tis",
          "--lags", "2", "5", "--seeds", "0"]
  assert lag_study.main(argv) == 4
  printed = capsys.readouterr().out
  assert len(made) == 2 and printed.count("running in another process, skipped") == 2
  assert "2 runs are being made by another process (oapl_lag2_seed0, oapl_lag5_seed0)" in printed


def _screened_search(reason_study, tmp_path, monkeypatch, busy=()):
  """runner.search over a 6-point OAPL grid at L = 2 then 5 with k = 2, the L = 2 runs committed
  but those in `busy` (held by another process); returns (the search's return or the exception,
  the (lag, point label) of each run made)."""
  import oapl_jax.train
  from oapl_jax.workdir import WorkdirBusy
  template = next(iter(results.load_compact(reason_study).values()))
  committed = str(tmp_path / "results")
  axes = (search.Axis("b2", ("rl.beta2",), ((0.1,), (0.01,), (1e-3,))), search.lr_axis((3e-4, 1e-3)))
  grid = {"oapl": axes}
  p1 = {p: 0.1 * (i + 1) for i, p in enumerate(search.points(axes))}  # the last two points best at L = 2
  for p in search.points(axes):
    name = layout.run_name("oapl", 2, 100, search.label(axes, p))
    if name not in busy:
      _fake_committed(template, committed, "sweep", name, p1[p])
  made = []

  def fake_run(config, workdir):
    name = os.path.basename(workdir)
    if name in busy:
      raise WorkdirBusy(f"workdir lock {workdir}/run.lock is held by process 1")
    made.append(name)
    os.makedirs(workdir, exist_ok=True)
    summary = json.loads(json.dumps(template["summary"]))
    summary["eval_after"]["pass@1"] = 0.5 if config.rl.beta2 == 0.01 else 0.2
    with open(os.path.join(workdir, "summary.json"), "w") as f:
      json.dump(summary, f)
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
      f.write(json.dumps({"step": 1, "samples_generated": 16, "entropy": 1.0}) + "\n")
    return summary
  monkeypatch.setattr(oapl_jax.train, "run", fake_run)
  out = str(tmp_path / "out")
  try:
    got = runner.search(out, grid=grid, lags=(2, 5), seed=100, top_k=2, reduced=True, study="reason",
                        results=committed, echo=lambda line: None)
  except runner.RunsElsewhere as e:
    got = e
  return got, made, out, axes


def test_the_search_runs_the_second_lag_for_the_screened_points_only(reason_study, tmp_path, monkeypatch):
  chosen, made, out, axes = _screened_search(reason_study, tmp_path, monkeypatch)
  top = search.points(axes)[-2:][::-1]  # the 2 best at L = 2, best first
  assert made == [layout.run_name("oapl", 5, 100, search.label(axes, p)) for p in top]
  assert chosen == {"oapl": search.overrides(axes, top[1])}  # (0.5 + 0.5) / 2 beats (0.6 + 0.2) / 2
  with open(layout.chosen_path(out)) as f:
    written = json.load(f)
  assert written["screen_top_k"] == 2 and written["screened"] == {"oapl": [search.label(axes, p) for p in top]}
  with open(layout.search_plan_path(out)) as f:
    assert json.load(f)["screen_top_k"] == 2


def test_a_search_whose_first_lag_is_unfinished_elsewhere_exits_4_before_the_second(reason_study, tmp_path, monkeypatch):
  """A first-lag run held by another process: its score decides the second lag's runs, so none
  of them is made and the command ends with RunsElsewhere (exit code 4: run it again)."""
  busy = layout.run_name("oapl", 2, 100, "b2-0.1_lr-0.0003")
  got, made, _, _ = _screened_search(reason_study, tmp_path, monkeypatch, busy=(busy,))
  assert isinstance(got, runner.RunsElsewhere) and busy in str(got) and made == []


# --- the mixed-task study (configs/mix.py; issue 41, point 5) ------------------------------------

def test_the_mix_study_searches_each_method_over_its_own_axis_and_the_lr_grids_edges():
  args = lag_study._parse(["--study", "mix", "--out", "/tmp/x", "--search"])
  spec = definitions.STUDIES["mix"]
  assert args.methods == ["oapl_tied", "grpo_tis", "grpo_tis_async"] == list(spec.methods)
  assert args.lags == [1, 10, 50, 100, 200]
  grid = args.grid
  for method, axes in grid.items():
    lrs = sorted(v[0] for v in axes[-1].values)
    assert axes[-1].tag == "lr" and lrs == [3e-5, 1e-4, 3e-4, 1e-3]  # the edges the last search lacked
    assert len(search.points(axes)) == 12
    assert search.planned_runs(axes, search.SEARCH_LAGS, search.SCREEN_TOP_K) == 18
  assert [a.tag for a in grid["oapl_tied"]] == ["beta", "lr"] and [a.tag for a in grid["grpo_tis_async"]] == ["C", "lr"]
  # a tied point moves beta1, and the rule carries beta2 with it (every target reachable)
  from oapl_jax.rl.names import beta2_of
  idx = search.points(grid["oapl_tied"])[1]
  c = definitions.study_config("oapl_tied", 100, 100, study="mix", search=True,
                               overrides=search.overrides(grid["oapl_tied"], idx))
  assert c.task.name == "chain_mix" and c.train.steps == 1000 and c.eval.samples_per_problem == 64
  assert c.rl.beta1 == 0.03 and beta2_of(c) == 0.03
  g = definitions.study_config("grpo_tis_async", 200, 0, study="mix",
                               overrides=search.overrides(grid["grpo_tis_async"], search.points(grid["grpo_tis_async"])[2]))
  assert g.rl.grpo.is_cap == 4.0 and g.rl.grpo.prox == "previous_step" and g.rl.lag == 200
  # the reasoning study keeps its grid and defaults
  assert lag_study._parse(["--study", "reason", "--out", "/tmp/x"]).methods == ["oapl", "oapl_paper_betas", "grpo_tis"]
  assert search.study_grid(["oapl"])["oapl"][-1].values == ((3e-4,), (1e-4,), (1e-3,))
  with pytest.raises(SystemExit):  # a method without a grid in the study's search: argparse's line
    lag_study._parse(["--study", "mix", "--out", "/tmp/x", "--search", "--methods", "oapl"])


def test_a_reduced_mix_study_runs_the_mixed_task_with_both_grpo_variants(tmp_path):
  out = str(tmp_path)
  assert lag_study.main(["--study", "mix", "--out", out, "--reduced", "--methods", "oapl_tied",
                         "grpo_tis_async", "--lags", "2", "--seeds", "0"]) == 0
  runs = results.load_runs(out)
  assert sorted(r.method for r in runs) == ["grpo_tis_async", "oapl_tied"]
  for r in runs:
    cfg = r.summary["config"]
    assert cfg["task"]["name"] == "chain_mix" and cfg["task"]["operations"] == "+-*x" and cfg["rl"]["lag"] == 2
  text = open(os.path.join(out, "lag_study.md")).read()
  assert text.startswith("# Mixed-task study") and "configs/mix.py" in text
  assert "async GRPO+TIS (token TIS, C=2, clip 0.2/0.28) | 2 |" in text  # in the tables
  # its findings pair OAPL (tied) with each GRPO: the async one here (no grpo_tis run: no part)
  assert "# oapl_tied vs grpo_tis_async" in text and "# oapl_tied vs grpo_tis\n" not in text
  assert 'In this part "OAPL" is the runs of `oapl_tied` and "GRPO+IS" those of `grpo_tis_async`' in text
  assert "**(c) after training both raise pass@k" in text.split("# oapl_tied vs grpo_tis_async")[1]
  assert "Not in the findings below" not in text
  # a method outside the study's pairs is named as left out
  from oapl_jax.studies.report import _unpaired_line
  extra = [dataclasses.replace(runs[0], method="oapl")]
  assert _unpaired_line(runs + extra, definitions.STUDIES["mix"].pairs)[0].startswith("**Not in the findings below: oapl**")


# --- the mixed-task study's step 2 (issue 62) ----------------------------------------------------

def _flat(tree, prefix=""):
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def _committed_config(name: str) -> dict:
  path = layout.result_path(os.path.join(os.path.dirname(__file__), "..", "docs", "mix_study", "results"),
                            layout.RUNS, name)
  with open(path) as f:
    return _flat(json.load(f)["summary"]["config"])


# the search's choices the committed study runs had (docs/mix_study.md, "Settings search")
_CHOSEN = {"oapl_tied": {"rl.beta1": 0.1, "train.lr": 1e-4},
           "grpo_tis": {"rl.grpo.eps_low": 0.8, "rl.grpo.eps_high": 1.12, "train.lr": 1e-3},
           "grpo_tis_async": {"rl.grpo.is_cap": 2.0, "train.lr": 3e-4}}


def _changed(method: str, committed: str) -> dict:
  """{setting: (the study run's, the variant's)} where the variant's config (L = 200, seed 0)
  differs from that of committed study run `committed` (`<method>_lag200_seed0`) as the code
  makes it now (settings the config gained or changed since then move both alike)."""
  def flat(c):
    return _flat(json.loads(json.dumps(c.to_dict())))
  mine = flat(definitions.study_config(method, 200, 0, study="mix"))
  theirs = flat(definitions.study_config(committed, 200, 0, study="mix", overrides=_CHOSEN[committed]))
  ran = _committed_config(f"{committed}_lag200_seed0")  # the choice is what those runs had
  assert {k: ran[k] for k in _CHOSEN[committed]} == _CHOSEN[committed]
  assert set(mine) == set(theirs)
  return {k: (theirs[k], mine[k]) for k in mine if mine[k] != theirs[k]}


def test_step2_variants_change_only_their_own_settings_from_the_committed_study_runs():
  """Each variant is a committed study run with only the settings issue 62 moves: its runs share
  the study's bases, task, budget and evaluation."""
  from oapl_jax.rl.names import beta2_of
  assert _changed("oapl_b1", "oapl_tied") == {
      "rl.beta1": (0.1, 1.0), "rl.beta2_rule": ("tied", "fixed")}  # beta2 0.1 and lr 1e-4 as tied's
  assert _changed("oapl_b1_len", "oapl_tied") == {
      "rl.beta1": (0.1, 1.0), "rl.beta2_rule": ("tied", "per_token")}
  c = definitions.study_config("oapl_b1_len", 200, 0, study="mix")
  assert beta2_of(c) == pytest.approx(16.384 / 46) and round(beta2_of(c), 3) == 0.356
  assert _changed("grpo_tis_lr3e-4", "grpo_tis") == {"train.lr": (1e-3, 3e-4)}
  assert _changed("grpo_tis_lr3e-4", "grpo_tis_async") == {
      "rl.grpo.prox": ("previous_step", "snapshot"), "rl.grpo.eps_low": (0.2, 0.8), "rl.grpo.eps_high": (0.28, 1.12)}
  # the labels name the lr the variant fixes; the study's methods keep theirs
  label = definitions.method_label
  assert label("grpo_tis_lr3e-4", c_dict := definitions.study_config("grpo_tis_lr3e-4", 10, 0, study="mix").to_dict()) == \
      "GRPO+IS (token TIS, C=2, clip 0.8/1.12, lr 0.0003)"
  assert label("grpo_tis", {**c_dict, "train": {**c_dict["train"], "lr": 1e-3}}) == "GRPO+IS (token TIS, C=2, clip 0.8/1.12)"
  assert label("oapl_b1_len", c.to_dict()) == "OAPL (beta1=1, beta2=0.356, lr 0.0001)"
  assert label("oapl_b1", definitions.study_config("oapl_b1", 10, 0, study="mix").to_dict()) == \
      "OAPL (beta1=1, beta2=0.1, lr 0.0001)"


def test_method_lags_give_a_method_its_own_lags_in_the_order_of_lags(monkeypatch):
  args = lag_study._parse(["--study", "mix", "--out", "/tmp/x", "--methods", "oapl_b1", "oapl_b1_len",
                           "grpo_tis_lr3e-4", "--lags", "200", "100", "50", "10", "--method-lags",
                           "oapl_b1=200,100,50", "oapl_b1_len=50,100,200", "--seeds", "0", "1"])
  assert args.method_lags == {"oapl_b1": (200, 100, 50), "oapl_b1_len": (50, 100, 200)}
  seen = []
  monkeypatch.setattr(runner, "_run_all", lambda out, todo, **kw: seen.extend(todo) or [])
  runner.run_study("/tmp/x", methods=args.methods, lags=args.lags, seeds=args.seeds, method_lags=args.method_lags)
  order = [(r.seed, r.lag, r.method) for r in seen]
  seed0 = [(0, 200, "oapl_b1"), (0, 200, "oapl_b1_len"), (0, 200, "grpo_tis_lr3e-4"),
           (0, 100, "oapl_b1"), (0, 100, "oapl_b1_len"), (0, 100, "grpo_tis_lr3e-4"),
           (0, 50, "oapl_b1"), (0, 50, "oapl_b1_len"), (0, 50, "grpo_tis_lr3e-4"), (0, 10, "grpo_tis_lr3e-4")]
  assert order == seed0 + [(1, lag, m) for _, lag, m in seed0]
  # the step's plan in definitions: every variant's lags among the issue's
  assert definitions.MIX_STEP2_LAGS == {"oapl_b1": (200, 100, 50), "oapl_b1_len": (200, 100, 50),
                                        "grpo_tis_lr3e-4": (200, 100, 50, 10)}
  # the report counts a seed done once it has the runs planned, each method at its own lags
  from oapl_jax.studies.report import _seeds_line
  runs = [_fake_run(m, lag, 0) for _, lag, m in seed0]
  line = _seeds_line(runs, definitions.STUDIES["mix"], (args.methods, args.lags, args.method_lags))
  assert "**Seeds done: 1 of the 3" in line and "all 10 (method, L) runs" in line


@pytest.mark.parametrize("bad", [["--method-lags", "oapl_tied=200"],  # not among --methods
                                 ["--method-lags", "oapl_b1=200,20"],  # 20 not among --lags
                                 ["--method-lags", "oapl_b1:200"]])  # not METHOD=L,L
def test_bad_method_lags_are_refused(bad, capsys):
  with pytest.raises(SystemExit) as e:
    lag_study._parse(["--study", "mix", "--out", "/tmp/x", "--methods", "oapl_b1", "--lags", "200", "100", *bad])
  assert e.value.code == 2 and "--method-lags" in capsys.readouterr().err


def test_a_study_goes_on_from_committed_bases_and_never_builds_one(study, tmp_path, capsys):
  # the fixture's seed-0 base and its "eval before", as a repository holds committed bases
  committed = tmp_path / "committed"
  shutil.copytree(layout.base_models_dir(study), committed, ignore=shutil.ignore_patterns("*.lock"))
  out = str(tmp_path / "out")
  argv = ["--out", out, "--reduced", "--methods", "oapl", "--lags", "1", "--bases", str(committed)]
  assert lag_study.main([*argv, "--seeds", "0"]) == 0
  printed = capsys.readouterr().out
  assert printed.count(f"bases: 2 files copied from {committed}") == 1 and "warm-up: base model read from" in printed
  assert "final loss" not in printed  # read, not built ("warm-up: N steps, final loss ...")
  run, = results.load_runs(out)
  fixture_run, = [r for r in results.load_runs(study) if (r.method, r.lag) == ("oapl", 1)]
  assert run.summary["eval_before"] == fixture_run.summary["eval_before"]
  assert run.summary["warmup"]["final_loss"] == fixture_run.summary["warmup"]["final_loss"]
  built = lambda: sorted(n for n in os.listdir(layout.base_models_dir(out)) if not n.endswith(".lock"))
  before = built()
  # a seed with no committed base: one line naming the folder looked in; nothing is built
  assert lag_study.main([*argv, "--seeds", "1"]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("error: warmup.cached_only: no base model at ") and "\n" not in err, err
  assert os.path.join(out, "base_models", "seed1-") in err and built() == before
  # a base already in the folder that is not the committed one is refused, not used
  eval_file, = [n for n in before if ".eval-" in n]
  with open(os.path.join(layout.base_models_dir(out), eval_file), "a") as f:
    f.write(" ")
  assert lag_study.main([*argv, "--seeds", "0"]) == 2
  assert "differs from" in capsys.readouterr().err
  assert lag_study.main([*argv[:-1], str(tmp_path / "none"), "--seeds", "0"]) == 2
  assert "no such folder" in capsys.readouterr().err


def test_the_committed_bases_keep_their_names():
  """The paired check's committed bases (docs/mix_study/paired_check/base_models) are found by
  the names today's settings give them: a setting added to a keyed section (model, task, warmup,
  sampling, eval, env) renames every base unless `warmup.KEY_NEUTRAL` holds its old-behaviour
  value."""
  from oapl_jax import warmup
  from oapl_jax.placement import seq_len
  committed = os.path.join(os.path.dirname(__file__), "..", "docs", "mix_study", "paired_check", "base_models")
  names = set()
  for seed in (0, 1, 2):
    c = definitions.study_config("oapl_tied", 200, seed, study="mix", cache_dir=committed)
    base, evaluated = warmup.cache_path(c, seq_len(c)), warmup.eval_cache_path(c, seq_len(c))
    assert os.path.isfile(os.path.join(base, "info.json")) and os.path.isfile(evaluated), base
    names |= {os.path.basename(base), os.path.basename(evaluated)}
  assert names == set(os.listdir(committed))
  c.model.base_quant = "int8"  # at another value than its neutral one, the setting is keyed
  assert warmup.cache_path(c, seq_len(c)) != base


def test_saving_a_search_of_some_methods_keeps_the_other_methods_grids(tmp_path, capsys):
  """Step 2's stages each search one or two methods (`--search`) into the same folder: saving
  its results into a results folder whose plan has every method's grid adds to that plan, never
  drops a grid (it did: the committed mixed-task search lost two of its three grids); a plan of
  another search is one line, exit 2, and nothing is written."""
  grid = search.study_grid(["oapl_tied", "grpo_tis", "grpo_tis_async"], definitions.STUDIES["mix"].grids,
                           definitions.STUDIES["mix"].search_lrs)
  committed, out = str(tmp_path / "results"), str(tmp_path / "out")
  for folder, methods, seed in ((committed, list(grid), 100), (out, ["grpo_tis_async"], 100)):
    os.makedirs(os.path.dirname(layout.search_plan_path(folder)), exist_ok=True)
    with open(layout.search_plan_path(folder), "w") as f:
      json.dump(search.plan_json({m: grid[m] for m in methods}, (100, 50), seed, 6), f)
  before = json.load(open(layout.search_plan_path(committed)))
  assert lag_study.main(["--study", "mix", "--out", out, "--results", committed, "--save-results"]) == 0
  assert json.load(open(layout.search_plan_path(committed))) == before
  with open(layout.search_plan_path(out), "w") as f:  # another search: another seed
    json.dump(search.plan_json({"grpo_tis_async": grid["grpo_tis_async"]}, (100, 50), 7, 6), f)
  assert lag_study.main(["--study", "mix", "--out", out, "--results", committed, "--save-results"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "seed 7 here, 100 there; nothing written" in err
  assert json.load(open(layout.search_plan_path(committed))) == before
