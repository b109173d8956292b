"""The lag-study launcher, CI-sized: every method at two lags, its report and plots."""

import json
import os

import numpy as np

import pytest

from oapl_jax.studies import definitions, lag_study, layout, results, runner, stats
from oapl_jax.studies.report import NOTES_BEGIN, NOTES_END, kept_notes, report_markdown


@pytest.fixture(scope="module")
def study(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("lag_study"))
  assert lag_study.main(["--out", out, "--reduced", "--lags", "1", "2", "--seeds", "0"]) == 0
  return out


def test_runs_every_method_and_lag_from_one_base(study):
  runs = results.load_runs(study)
  assert sorted((r.method, r.lag) for r in runs) == sorted(
      (m, l) for m in definitions.METHODS for l in (1, 2))
  cache = os.listdir(os.path.join(study, "base_models"))  # one warm-up for the seed, and its eval
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
  for label, _ in definitions.METHODS.values():
    assert text.count(f"| {label} |") == 2  # one table row per lag
  for png in ("pass1_vs_samples.png", "entropy_vs_step.png", "passk_before_after.png"):
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
             "evals_during": [{"step": 2, "pass@1": 0.3 + 0.1 * seed}], "samples_generated": 32,
             "train_seconds": 5.0}
  metrics = [{"step": t, "samples_generated": 8 * t, "entropy": 1.0 - 0.1 * t - 0.01 * seed} for t in range(1, 5)]
  return results.RunResult(method, lag, seed, summary, metrics, wall_seconds=60.0)


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
  assert "Learning-rate sweep" not in text and "* pass@1 after, L=3:" in text
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
      assert np.array(e["answer_ids"]).shape == (e["num_problems"], n)
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


def test_sweep_picks_each_methods_best_lr_and_the_study_uses_it(reason_study, capsys):
  # finished sweep runs are read, not rerun: fake three lrs per method with known pass@1
  scores = {"oapl": {1e-4: 0.2, 3e-4: 0.5, 1e-3: 0.5}, "grpo_tis": {1e-4: 0.4, 3e-4: 0.1, 1e-3: 0.3}}
  for method, table in scores.items():
    for lr, p1 in table.items():
      d = layout.run_dir(reason_study, method, 2, 7, lr)
      os.makedirs(d)
      json.dump({"eval_after": {"pass@1": p1}}, open(os.path.join(d, "summary.json"), "w"))
  chosen = runner.sweep(reason_study, methods=("oapl", "grpo_tis"), lrs=(1e-4, 3e-4, 1e-3),
                           lag=2, seed=7)
  assert chosen == {"oapl": 3e-4, "grpo_tis": 1e-4}  # ties: the smaller lr
  assert json.load(open(os.path.join(reason_study, "sweep", "chosen.json")))["lr"] == chosen
  c = definitions.study_config("oapl", 2, 0, study="reason", overrides={"train.lr": chosen["oapl"]})
  assert c.train.lr == 3e-4 and c.task.name == "chain_addition"
  lag_study.write_report(reason_study, os.path.join(reason_study, "r2.md"), command="c", study="reason")
  text = open(os.path.join(reason_study, "r2.md")).read()
  assert "## Learning-rate sweep" in text and "| 0.0003 |" in text


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


def test_report_only_without_finished_runs_is_one_line(tmp_path, capsys):
  assert lag_study.main(["--out", str(tmp_path), "--report-only"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "no finished runs under" in err
